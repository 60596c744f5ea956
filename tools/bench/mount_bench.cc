// Mount read benchmark. Two checkpoints are read through the FUSE mount with
// plain sequential reads and compared, in the same run and on the same bytes
// and filesystem, with:
//   - one large tensor (bf16, sharded by columns over 4 ranks): a plain file
//     holding the same .npy image;
//   - an LLM-like checkpoint of many tensors (per layer a bf16 weight and
//     fp32 master weight and Adam moments, [2048, 4096] each), read as its
//     .npy files one after another and as model.safetensors: the engine's own
//     in-process sequential read of the same tensors (no FUSE), the plain
//     .npy files, and `borg mount` of those files (when borg is installed).
// First reads start with the page cache dropped and a freshly started mount
// daemon (empty chunk cache); second reads follow at once. The daemon's
// minor page faults are reported per GiB read after its first GiB. After
// each large file's second read, the largest page-cache folio behind the
// mount's file and the plain file is printed (root; /proc/kpageflags).
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "bench_util.h"
#include "ckpt/repository.h"
#include "io/safetensors.h"

using namespace ckptfs;
using bench::Check;
using bench::DropCaches;
using bench::Median;
using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

namespace {

bool IsMounted(const std::string& path) {
  std::ifstream m("/proc/mounts");
  std::string line;
  while (std::getline(m, line)) {
    if (line.find(" " + path + " ") != std::string::npos) return true;
  }
  return false;
}

bool WaitMounted(const std::string& path, bool want) {
  for (int i = 0; i < 400; ++i) {
    if (IsMounted(path) == want) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  return false;
}

int Shell(const std::string& cmd) { return std::system(cmd.c_str()); }

// The mount daemon, started fresh for each run so its chunk cache is empty.
struct Daemon {
  pid_t pid = -1;
  void Start(const std::string& ckpt, const std::string& repo, const std::string& mnt, const std::string& cache) {
    pid = fork();
    if (pid == 0) {
      execl(ckpt.c_str(), ckpt.c_str(), "mount", "-r", repo.c_str(), mnt.c_str(), "--foreground", "--cache-size",
            cache.c_str(), (char*)nullptr);
      std::perror("exec ckpt");
      _exit(127);
    }
    if (!WaitMounted(mnt, true)) {
      std::fprintf(stderr, "mount did not come up (ckpt at %s)\n", ckpt.c_str());
      std::exit(1);
    }
  }
  void Stop(const std::string& mnt) {
    kill(pid, SIGTERM);
    int status = 0;
    waitpid(pid, &status, 0);
    WaitMounted(mnt, false);
  }
};

// Reads `paths` one after another in `piece`-byte reads: seconds, digest of
// all bytes; `at_bytes(total)` is called after each read.
struct ReadResult {
  double seconds = 0;
  uint64_t bytes = 0;
  uint64_t digest = 0;
};
ReadResult ReadFiles(const std::vector<std::string>& paths, size_t piece,
                     const std::function<void(uint64_t)>& at_bytes = {}) {
  std::vector<std::byte> buf(piece);
  XXH3_state_t* h = XXH3_createState();
  XXH3_64bits_reset(h);
  ReadResult r;
  const auto t0 = Clock::now();
  for (const auto& p : paths) {
    bench::ReadToEnd(
        p, [&](uint64_t) { return std::span(buf); },
        [&](std::span<std::byte> got) {
          XXH3_64bits_update(h, got.data(), got.size());
          r.bytes += got.size();
          if (at_bytes) at_bytes(r.bytes);
        });
  }
  r.seconds = bench::Seconds(t0);
  r.digest = XXH3_64bits_digest(h);
  XXH3_freeState(h);
  return r;
}

std::vector<std::string> Under(const std::string& dir, const std::vector<std::string>& names) {
  std::vector<std::string> out;
  for (const auto& n : names) out.push_back(dir + "/" + n);
  return out;
}

struct Series {
  std::vector<double> v;
  void Add(double x) { v.push_back(x); }
  double Med() const { return Median(v); }
};

}  // namespace

int main(int argc, char** argv) {
  std::string dir = ".", ckpt = (fs::path(argv[0]).parent_path() / "ckpt").string();
  double gib = 1;
  int layers = 10, runs = 3;
  std::string cache_size = "256M";
  bool keep = false, use_borg = true, borg_asked_off = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&] { return bench::NextArg(argc, argv, i); };
    if (a == "--dir") dir = next();
    else if (a == "--gib") gib = std::atof(next().c_str());
    else if (a == "--layers") layers = std::atoi(next().c_str());
    else if (a == "--runs") runs = std::atoi(next().c_str());
    else if (a == "--ckpt") ckpt = next();
    else if (a == "--cache-size") cache_size = next();
    else if (a == "--no-borg") use_borg = false, borg_asked_off = true;
    else if (a == "--keep") keep = true;
    else {
      std::printf(
          "usage: mount_bench [--dir DIR] [--gib N] [--layers N] [--runs N] [--ckpt PATH/TO/ckpt]\n"
          "                   [--cache-size SIZE] [--no-borg] [--keep]\n"
          "--gib sizes the one-tensor case, --layers the LLM-like one (4 tensors of 16-32 MiB per layer).\n"
          "--keep leaves the repository and files in place for inspection.\n");
      return a == "--help" || a == "-h" ? 0 : 2;
    }
  }
  dir = fs::absolute(dir).string();
  const std::string work = dir + "/ckptfs-mount-bench-" + std::to_string(::getpid());
  const std::string repo_dir = work + "/repo", mnt = work + "/mnt", plain = work + "/plain";
  const std::string borg_repo = work + "/borg", borg_mnt = work + "/borg-mnt";
  fs::create_directories(mnt);
  fs::create_directories(plain);
  use_borg = use_borg && Shell("command -v borg >/dev/null 2>&1") == 0;
  Check(Repository::Init(repo_dir, {}), "init");

  // The one large tensor, saved by 4 ranks as column boxes.
  const uint64_t cols = 8192, rows = static_cast<uint64_t>(gib * (1ull << 30) / (cols * 2));
  const Shape big_shape = {rows, cols};
  // The LLM-like checkpoint.
  struct Tensor {
    std::string name;
    DType dtype;
  };
  std::vector<Tensor> llm;
  for (int l = 0; l < layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    llm.push_back({p + "weight", DType::kBF16});
    llm.push_back({p + "master", DType::kF32});
    llm.push_back({p + "exp_avg", DType::kF32});
    llm.push_back({p + "exp_avg_sq", DType::kF32});
  }
  const Shape layer_shape = {2048, 4096};
  std::vector<std::string> npy_names;
  uint64_t llm_bytes = 0;
  {
    auto repo = std::move(Repository::Open(repo_dir)).value();
    std::vector<uint16_t> data(rows * cols);
    bench::FillNormalBf16(data.data(), data.size(), 0.02f, 99);
    TensorInfo info{"model.embed.weight", DType::kBF16, big_shape};
    for (int r = 0; r < 4; ++r) {
      auto w = std::move(repo->BeginCheckpoint("big", {uint32_t(r), 4, 1, {}})).value();
      const uint64_t c0 = cols * r / 4, c1 = cols * (r + 1) / 4;
      std::vector<uint16_t> part(rows * (c1 - c0));
      for (uint64_t i = 0; i < rows; ++i) std::memcpy(&part[i * (c1 - c0)], &data[i * cols + c0], (c1 - c0) * 2);
      HostSource src(std::as_bytes(std::span(part)));
      Check(w->PutShard(info, Region::OfBox(Box{{0, c0}, {rows, c1 - c0}}), src), "put");
      Check(w->Commit().Wait().status(), "commit");
    }
    {
      std::string header = NpyHeader(DType::kBF16, big_shape);
      std::ofstream f(plain + "/big.npy", std::ios::binary);
      f.write(header.data(), static_cast<std::streamsize>(header.size()));
      f.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size() * 2));
    }
    auto w = std::move(repo->BeginCheckpoint("llm", {0, 1, 2, {}})).value();
    fs::create_directories(plain + "/llm");
    bench::Rng rng{7};
    std::vector<float> f32(NumElements(layer_shape));
    std::vector<uint16_t> bf16(NumElements(layer_shape));
    for (size_t i = 0; i < llm.size(); ++i) {
      const Tensor& t = llm[i];
      std::span<const std::byte> bytes;
      if (t.dtype == DType::kBF16) {
        bench::FillNormalBf16(bf16.data(), bf16.size(), 0.02f, 1000 + i);
        bytes = std::as_bytes(std::span(bf16));
      } else {
        rng.Normals(f32.data(), f32.size(), t.name.find("sq") != std::string::npos ? 1e-4f : 0.02f);
        bytes = std::as_bytes(std::span(f32));
      }
      Check(w->PutTensor({t.name, t.dtype, layer_shape}, bytes), "put");
      const std::string header = NpyHeader(t.dtype, layer_shape);
      std::ofstream f(plain + "/llm/" + t.name + ".npy", std::ios::binary);
      f.write(header.data(), static_cast<std::streamsize>(header.size()));
      f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
      npy_names.push_back(t.name + ".npy");
      llm_bytes += bytes.size();
    }
    Check(w->Commit().Wait().status(), "commit");
  }
  std::sort(npy_names.begin(), npy_names.end());  // `cat DIR/*.npy` order
  std::printf("a first touch of a 4 KiB page costs %.2f us here\n", bench::PageFaultMicros());
  std::printf("one tensor: bf16 [%llu, %llu] = %.2f GiB, 4 column shards\n", (unsigned long long)rows,
              (unsigned long long)cols, rows * cols * 2 / double(1 << 30));
  std::printf("LLM-like: %zu tensors ([2048, 4096] bf16 weights, fp32 master and Adam moments) = %.2f GiB\n",
              llm.size(), llm_bytes / double(1 << 30));
  if (use_borg) {
    const std::string env = "BORG_UNKNOWN_UNENCRYPTED_REPO_ACCESS_IS_OK=yes BORG_RELOCATED_REPO_ACCESS_IS_OK=yes ";
    if (Shell(env + "borg init --encryption=none " + borg_repo + " >/dev/null 2>&1") != 0 ||
        Shell("cd " + plain + "/llm && " + env + "borg create --compression lz4 " + borg_repo + "::a . >/dev/null 2>&1") != 0) {
      std::printf("borg: could not create its repository; borg mount is left out\n");
      use_borg = false;
    }
    fs::create_directories(borg_mnt);
  } else {
    std::printf(borg_asked_off ? "borg mount is left out (--no-borg)\n"
                               : "borg is not installed (Debian: borgbackup, python3-llfuse): borg mount is left out\n");
  }

  const std::vector<std::string> mount_npys = Under(mnt + "/llm", npy_names);
  const std::vector<std::string> plain_npys = Under(plain + "/llm", npy_names);
  const std::vector<std::string> borg_npys = Under(borg_mnt, npy_names);
  const uint64_t big_size = fs::file_size(plain + "/big.npy");
  bool cold = true;
  Series big_plain1, big_plain2, big_mount1, big_mount2, big_r1, big_r2;
  Series np_plain1, np_plain2, np_mount1, np_mount2, np_borg1, np_borg2, inproc, st_mount1, st_mount2;
  Series r_inproc, r_borg1, r_borg2, r_st, faults_gib;
  const double gb_llm = llm_bytes / 1e9;
  for (int run = 0; run < runs; ++run) {
    // One large file: plain, then the mount.
    cold &= DropCaches();
    auto p1 = ReadFiles({plain + "/big.npy"}, 1 << 20), p2 = ReadFiles({plain + "/big.npy"}, 1 << 20);
    // The page cache's folio sizes behind each second read (see PERFORMANCE.md).
    const size_t plain_folio = bench::LargestCachedFolioPages(plain + "/big.npy", 256 << 20);
    Daemon daemon;
    daemon.Start(ckpt, repo_dir, mnt, cache_size);
    cold &= DropCaches();
    auto m1 = ReadFiles({mnt + "/big/model.embed.weight.npy"}, 1 << 20);
    auto m2 = ReadFiles({mnt + "/big/model.embed.weight.npy"}, 1 << 20);
    const size_t mount_folio = bench::LargestCachedFolioPages(mnt + "/big/model.embed.weight.npy", 256 << 20);
    daemon.Stop(mnt);
    if (m1.digest != p1.digest || m2.digest != p1.digest || m1.bytes != big_size) {
      std::fprintf(stderr, "MISMATCH: the mount served different bytes for the large tensor\n");
      return 1;
    }
    big_plain1.Add(big_size / 1e9 / p1.seconds);
    big_plain2.Add(big_size / 1e9 / p2.seconds);
    big_mount1.Add(big_size / 1e9 / m1.seconds);
    big_mount2.Add(big_size / 1e9 / m2.seconds);
    big_r1.Add(p1.seconds / m1.seconds);
    big_r2.Add(p2.seconds / m2.seconds);

    // The LLM-like checkpoint in-process: every tensor whole, in name order.
    cold &= DropCaches();
    double in_seconds;
    {
      const auto t0 = Clock::now();
      auto repo = std::move(Repository::Open(repo_dir)).value();
      auto reader = std::move(repo->OpenCheckpoint("llm")).value();
      std::vector<std::byte> buf(32 << 20);
      for (const auto& t : reader->tensors()) Check(reader->ReadBytes(t, 0, std::span(buf).first(t.ByteSize())), "read");
      in_seconds = bench::Seconds(t0);
    }
    // Plain .npy files.
    cold &= DropCaches();
    auto n1 = ReadFiles(plain_npys, 1 << 20), n2 = ReadFiles(plain_npys, 1 << 20);
    // The mount: *.npy one after another, then model.safetensors; the
    // daemon's faults from its first GiB on.
    daemon.Start(ckpt, repo_dir, mnt, cache_size);
    cold &= DropCaches();
    long long faults_at_gib = -1;
    const long long faults_start = bench::MinorFaults(daemon.pid);
    auto q1 = ReadFiles(mount_npys, 1 << 20, [&](uint64_t b) {
      if (faults_at_gib < 0 && b >= (1ull << 30)) faults_at_gib = bench::MinorFaults(daemon.pid);
    });
    auto q2 = ReadFiles(mount_npys, 1 << 20);
    cold &= DropCaches();
    auto s1 = ReadFiles({mnt + "/llm/model.safetensors"}, 1 << 20, [&](uint64_t b) {
      if (faults_at_gib < 0 && q1.bytes + b >= (1ull << 30)) faults_at_gib = bench::MinorFaults(daemon.pid);
    });
    const long long faults_end = bench::MinorFaults(daemon.pid);
    auto s2 = ReadFiles({mnt + "/llm/model.safetensors"}, 1 << 20);
    daemon.Stop(mnt);
    if (q1.digest != n1.digest || q2.digest != n1.digest) {
      std::fprintf(stderr, "MISMATCH: the mount's .npy files differ from the plain ones\n");
      return 1;
    }
    const double after_gib = (q1.bytes + s1.bytes - double(1ull << 30)) / double(1ull << 30);
    const double fpg = faults_at_gib >= 0 ? (faults_end - faults_at_gib) / after_gib : -1;
    np_plain1.Add(gb_llm / n1.seconds);
    np_plain2.Add(gb_llm / n2.seconds);
    np_mount1.Add(gb_llm / q1.seconds);
    np_mount2.Add(gb_llm / q2.seconds);
    inproc.Add(gb_llm / in_seconds);
    r_inproc.Add(in_seconds / q1.seconds);
    st_mount1.Add(gb_llm / s1.seconds);
    st_mount2.Add(gb_llm / s2.seconds);
    r_st.Add(in_seconds / s1.seconds);
    faults_gib.Add(fpg);
    std::printf("run %d: large file: first %.2f GB/s (plain %.2f, %.2fx), second %.2f GB/s (plain %.2f, %.2fx); "
                "largest page-cache folio: %s\n",
                run + 1, big_mount1.v.back(), big_plain1.v.back(), big_r1.v.back(), big_mount2.v.back(),
                big_plain2.v.back(), big_r2.v.back(),
                mount_folio && plain_folio
                    ? ("mount " + std::to_string(mount_folio * 4) + " KiB, plain " + std::to_string(plain_folio * 4) +
                       " KiB").c_str()
                    : "unknown (needs root)");
    std::printf("       LLM *.npy: first %.2f GB/s (in-process %.2f, %.2fx; plain %.2f), second %.2f GB/s (plain %.2f)\n",
                np_mount1.v.back(), inproc.v.back(), r_inproc.v.back(), np_plain1.v.back(), np_mount2.v.back(),
                np_plain2.v.back());
    std::printf("       LLM model.safetensors: first %.2f GB/s (%.2fx in-process), second %.2f GB/s\n",
                st_mount1.v.back(), r_st.v.back(), st_mount2.v.back());
    std::printf("       daemon minor faults: %lld in all, %.0f per GiB after the first GiB\n",
                faults_end - faults_start, fpg);
    if (use_borg) {
      const std::string env = "BORG_UNKNOWN_UNENCRYPTED_REPO_ACCESS_IS_OK=yes BORG_RELOCATED_REPO_ACCESS_IS_OK=yes ";
      if (Shell(env + "borg mount " + borg_repo + "::a " + borg_mnt) != 0 || !WaitMounted(borg_mnt, true)) {
        std::fprintf(stderr, "borg mount failed\n");
        return 1;
      }
      cold &= DropCaches();
      auto b1 = ReadFiles(borg_npys, 1 << 20), b2 = ReadFiles(borg_npys, 1 << 20);
      Shell("borg umount " + borg_mnt);
      WaitMounted(borg_mnt, false);
      if (b1.digest != n1.digest) {
        std::fprintf(stderr, "MISMATCH: borg served different bytes\n");
        return 1;
      }
      np_borg1.Add(gb_llm / b1.seconds);
      np_borg2.Add(gb_llm / b2.seconds);
      r_borg1.Add(b1.seconds / q1.seconds);
      r_borg2.Add(b2.seconds / q2.seconds);
      std::printf("       borg mount *.npy: first %.2f GB/s (ckpt %.2fx), second %.2f GB/s (ckpt %.2fx)\n",
                  np_borg1.v.back(), r_borg1.v.back(), np_borg2.v.back(), r_borg2.v.back());
    }
    std::printf("       bytes equal\n");
    std::fflush(stdout);
  }
  if (keep) {
    std::printf("kept: %s\n", work.c_str());
  } else {
    fs::remove_all(work);
  }
  std::printf("\nmedian of %d runs (%s):\n", runs, cold ? "page cache dropped before first reads" : "WARM: could not drop caches");
  std::printf("  large file first read:  mount %.2f GB/s, plain %.2f GB/s, ratio %.2f\n", big_mount1.Med(),
              big_plain1.Med(), big_r1.Med());
  std::printf("  large file second read: mount %.2f GB/s, plain %.2f GB/s, ratio %.2f\n", big_mount2.Med(),
              big_plain2.Med(), big_r2.Med());
  std::printf("  LLM *.npy first read:   mount %.2f GB/s, in-process %.2f GB/s, ratio %.2f (plain files %.2f GB/s)\n",
              np_mount1.Med(), inproc.Med(), r_inproc.Med(), np_plain1.Med());
  std::printf("  LLM *.npy second read:  mount %.2f GB/s (plain files %.2f GB/s)\n", np_mount2.Med(), np_plain2.Med());
  std::printf("  LLM model.safetensors:  first %.2f GB/s (ratio to in-process %.2f), second %.2f GB/s\n",
              st_mount1.Med(), r_st.Med(), st_mount2.Med());
  if (use_borg) {
    std::printf("  borg mount *.npy:       first %.2f GB/s (mount/borg %.2f), second %.2f GB/s (mount/borg %.2f)\n",
                np_borg1.Med(), r_borg1.Med(), np_borg2.Med(), r_borg2.Med());
  }
  std::printf("  daemon minor page faults per GiB after the first GiB: %.0f\n", faults_gib.Med());
  return 0;
}
