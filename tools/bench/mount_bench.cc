// Mount read benchmark: one multi-GiB bf16 tensor, sharded over several ranks
// by columns (tensor parallel boxes) and compressed, is read through the FUSE
// mount with plain sequential reads, and compared with reading a plain file
// holding the same bytes (the .npy image) on the same filesystem, in the same
// run: first read (page cache dropped) and second read.
#include <fcntl.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
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

namespace {

bool IsMounted(const std::string& path) {
  std::ifstream m("/proc/mounts");
  std::string line;
  while (std::getline(m, line)) {
    if (line.find(" " + path + " ") != std::string::npos) return true;
  }
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir = ".", ckpt = (std::filesystem::path(argv[0]).parent_path() / "ckpt").string();
  double gib = 2;
  int ranks = 4, runs = 3;
  std::string cache_size = "1G";
  bool keep = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
    if (a == "--dir") dir = next();
    else if (a == "--gib") gib = std::atof(next().c_str());
    else if (a == "--ranks") ranks = std::atoi(next().c_str());
    else if (a == "--runs") runs = std::atoi(next().c_str());
    else if (a == "--ckpt") ckpt = next();
    else if (a == "--cache-size") cache_size = next();
    else if (a == "--keep") keep = true;
    else {
      std::printf("usage: mount_bench [--dir DIR] [--gib N] [--ranks N] [--runs N] [--ckpt PATH/TO/ckpt] [--cache-size SIZE] [--keep]\n"
                  "--keep leaves the repository and the mount in place for inspection.\n");
      return a == "--help" || a == "-h" ? 0 : 2;
    }
  }
  dir = std::filesystem::absolute(dir).string();
  const uint64_t cols = 8192;
  const uint64_t rows = static_cast<uint64_t>(gib * (1ull << 30) / (cols * 2));
  const Shape shape = {rows, cols};
  std::printf("tensor: bf16 [%llu, %llu] = %.2f GiB, %d column shards, N(0, 0.02)\n", (unsigned long long)rows,
              (unsigned long long)cols, rows * cols * 2 / double(1 << 30), ranks);
  std::vector<uint16_t> data(rows * cols);
  bench::FillNormalBf16(data.data(), data.size(), 0.02f, 99);
  const std::string work = dir + "/ckptfs-mount-bench-" + std::to_string(::getpid());
  const std::string repo_dir = work + "/repo", mnt = work + "/mnt", plain = work + "/plain.npy";
  std::filesystem::create_directories(mnt);
  Check(Repository::Init(repo_dir, {}), "init");
  {
    auto repo = std::move(Repository::Open(repo_dir)).value();
    TensorInfo info{"model.embed.weight", DType::kBF16, shape};
    for (int r = 0; r < ranks; ++r) {
      auto w = std::move(repo->BeginCheckpoint("step-1", {uint32_t(r), uint32_t(ranks), 1, {}})).value();
      uint64_t c0 = cols * r / ranks, c1 = cols * (r + 1) / ranks;
      std::vector<uint16_t> part(rows * (c1 - c0));
      for (uint64_t i = 0; i < rows; ++i) std::memcpy(&part[i * (c1 - c0)], &data[i * cols + c0], (c1 - c0) * 2);
      HostSource src(std::as_bytes(std::span(part)));
      Check(w->PutShard(info, Region::OfBox(Box{{0, c0}, {rows, c1 - c0}}), src), "put");
      Check(w->Commit().Wait().status(), "commit");
    }
  }
  // The plain file: the same bytes the mount serves.
  {
    std::string header = NpyHeader(DType::kBF16, shape);
    std::ofstream f(plain, std::ios::binary);
    f.write(header.data(), static_cast<std::streamsize>(header.size()));
    f.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size() * 2));
  }
  const uint64_t size = std::filesystem::file_size(plain);
  data.clear();
  data.shrink_to_fit();

  pid_t pid = fork();
  if (pid == 0) {
    execl(ckpt.c_str(), ckpt.c_str(), "mount", "-r", repo_dir.c_str(), mnt.c_str(), "--foreground", "--cache-size",
          cache_size.c_str(), (char*)nullptr);
    std::perror("exec ckpt");
    _exit(127);
  }
  for (int i = 0; i < 200 && !IsMounted(mnt); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  if (!IsMounted(mnt)) {
    std::fprintf(stderr, "mount did not come up (ckpt at %s)\n", ckpt.c_str());
    return 1;
  }
  const std::string file = mnt + "/step-1/model.embed.weight.npy";
  bool cold = true;
  std::vector<double> p1, p2, m1, m2;
  for (int run = 0; run < runs; ++run) {
    cold &= DropCaches();
    uint64_t ph, ph2, mh, mh2;
    const double pf = bench::TimedRead(plain, size, 1 << 20, &ph);
    const double ps = bench::TimedRead(plain, size, 1 << 20, &ph2);
    cold &= DropCaches();
    const double mf = bench::TimedRead(file, size, 1 << 20, &mh);
    const double ms = bench::TimedRead(file, size, 1 << 20, &mh2);
    if (mh != ph || mh2 != ph || ph2 != ph) {
      std::fprintf(stderr, "MISMATCH: the mount served different bytes\n");
      return 1;
    }
    const double gb = size / 1e9;
    std::printf("run %d: plain first %.2f GB/s, mount first %.2f GB/s (%.2fx); plain second %.2f GB/s, mount second %.2f GB/s (%.2fx); bytes equal\n",
                run + 1, gb / pf, gb / mf, pf / mf, gb / ps, gb / ms, ps / ms);
    std::fflush(stdout);
    p1.push_back(gb / pf);
    p2.push_back(gb / ps);
    m1.push_back(gb / mf);
    m2.push_back(gb / ms);
  }
  if (keep) {
    std::printf("kept: repository %s, plain file %s, mount %s (pid %d)\n", repo_dir.c_str(), plain.c_str(), mnt.c_str(), pid);
  } else {
    kill(pid, SIGTERM);
    int status = 0;
    waitpid(pid, &status, 0);
    std::filesystem::remove_all(work);
  }
  std::vector<double> r1, r2;
  for (int i = 0; i < runs; ++i) {
    r1.push_back(m1[i] / p1[i]);
    r2.push_back(m2[i] / p2[i]);
  }
  std::printf("\nmedian of %d runs (%s):\n", runs, cold ? "page cache dropped before first reads" : "WARM: could not drop caches");
  std::printf("  first read:  plain %.2f GB/s, mount %.2f GB/s, ratio %.2f\n", Median(p1), Median(m1), Median(r1));
  std::printf("  second read: plain %.2f GB/s, mount %.2f GB/s, ratio %.2f\n", Median(p2), Median(m2), Median(r2));
  return 0;
}
