// GPU staging benchmark: device-to-host staging throughput of a multi-GiB
// state against a plain pinned copy of the same bytes, the blocking time of
// a snapshot save against that plain copy, and end-to-end streaming save and
// load throughput, every byte checked.
//
// On a GPU (the default) the plain copy is one cudaMemcpy into pinned
// memory. With --host the same pipeline runs through the host copy engine,
// whose "device" memory is host memory and whose plain copy is a memcpy:
// that measures the pipeline's own overhead on a machine without a GPU, not
// PCIe. Without a GPU and without --host it says why and exits 0.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "bench_util.h"
#include "staging.h"

#ifdef CKPTFS_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

using namespace ckptfs;
using bench::Seconds;
using Clock = std::chrono::steady_clock;

namespace {

// Device memory of the engine under test.
struct DeviceBuffer {
  bool cuda = false;
  std::byte* p = nullptr;
  std::vector<std::byte> host;
  DeviceBuffer(bool use_cuda, size_t n) : cuda(use_cuda) {
#ifdef CKPTFS_HAVE_CUDA
    if (cuda) {
      if (cudaMalloc(reinterpret_cast<void**>(&p), n) != cudaSuccess) p = nullptr;
      return;
    }
#endif
    host.resize(n);
    p = host.data();
  }
  ~DeviceBuffer() {
#ifdef CKPTFS_HAVE_CUDA
    if (cuda && p) cudaFree(p);
#endif
  }
};

// One synchronous copy through the engine (a plain cudaMemcpyAsync +
// synchronize on CUDA).
void Copy(gpu::CopyEngine& engine, bool to_host, std::byte* dst, const std::byte* src, size_t n) {
  auto t = to_host ? engine.DeviceToHost(dst, src, n) : engine.HostToDevice(dst, src, n);
  bench::Check(t.status(), "copy");
  bench::Check(engine.Wait(*t), "copy");
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir = ".";
  double gib = 4;
  size_t buffer_mib = 64, buffers = 2;
  int runs = 3;
  bool host = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&] { return bench::NextArg(argc, argv, i); };
    if (a == "--dir") dir = next();
    else if (a == "--gib") gib = std::atof(next().c_str());
    else if (a == "--buffer-mib") buffer_mib = std::atoi(next().c_str());
    else if (a == "--buffers") buffers = std::atoi(next().c_str());
    else if (a == "--runs") runs = std::atoi(next().c_str());
    else if (a == "--host") host = true;
    else {
      std::printf("usage: gpu_bench [--dir DIR] [--gib N] [--buffer-mib N] [--buffers N] [--runs N] [--host]\n");
      return a == "--help" || a == "-h" ? 0 : 2;
    }
  }
  using bench::Check;
  std::unique_ptr<gpu::CopyEngine> engine;
  if (host) {
    engine = std::make_unique<gpu::HostCopyEngine>();
  } else {
    std::string why;
    if (!gpu::CudaAvailable(&why)) {
      std::printf("gpu_bench: nothing measured: %s (--host runs the pipeline through the host copy engine)\n",
                  why.c_str());
      return 0;
    }
    engine = std::move(gpu::NewCudaCopyEngine(0)).value();
  }
  const size_t bytes = static_cast<size_t>(gib * (1ull << 30)) / 4096 * 4096;
  std::printf("engine: %s; state %.2f GiB of bf16 N(0, 0.02); staging %zu x %zu MiB pinned\n",
              engine->Describe().c_str(), bytes / double(1 << 30), buffers, buffer_mib);
  DeviceBuffer dev(!host, bytes), dev2(!host, bytes);
  if (!dev.p || !dev2.p) {
    std::fprintf(stderr, "gpu_bench: cannot allocate 2 x %.2f GiB of device memory\n", bytes / double(1 << 30));
    return 1;
  }
  auto pinned = engine->AllocatePinned(bytes);
  Check(pinned.status(), "pinned allocation");
  // The state, distinct in every 256 MiB block (no dedup between blocks).
  for (size_t off = 0; off < bytes; off += 256u << 20) {
    const size_t n = std::min<size_t>(256u << 20, bytes - off);
    bench::FillNormalBf16(reinterpret_cast<uint16_t*>(*pinned), n / 2, 0.02f, 7 + off);
    Copy(*engine, false, dev.p + off, *pinned, n);
  }
  auto pool = std::move(gpu::PinnedPool::Create(*engine, buffers, buffer_mib << 20)).value();
  // The snapshot buffer is reserved before the runs, as a training job keeps it.
  gpu::SnapshotBuffer snapshot_buffer(*engine);
  Check(snapshot_buffer.Reserve(bytes), "snapshot buffer");
  const uint64_t chunk = RepositoryConfig{}.chunk_size;
  std::vector<uint64_t> bounds;
  for (uint64_t off = 0; off < bytes; off += chunk) bounds.push_back(off);
  bounds.push_back(bytes);
  bench::RunFigures fig;
  Copy(*engine, true, *pinned, dev.p, bytes);  // warm-up: first touch of the pinned pages
  for (int run = 0; run < runs; ++run) {
    auto t0 = Clock::now();
    Copy(*engine, true, *pinned, dev.p, bytes);
    const double t_plain = Seconds(t0);
    // Staging alone, as the writer drives it: chunks lent in place from the
    // pinned buffers and handed back at once.
    t0 = Clock::now();
    {
      gpu::DeviceSource source(*engine, *pool, dev.p, bytes);
      source.PlanChunks(bounds);
      for (size_t i = 0; i + 1 < bounds.size(); ++i) {
        auto lent = source.Borrow(bounds[i], bounds[i + 1] - bounds[i]);
        Check(lent.status(), "staging");
        if (!lent->keep) {
          std::fprintf(stderr, "gpu_bench: staging buffers are smaller than a chunk: use --buffer-mib >= %llu\n",
                       static_cast<unsigned long long>(chunk >> 20));
          return 2;
        }
      }
    }
    const double t_staged = Seconds(t0);
    // Disk baselines on the same bytes: a raw write (fsync) and read back
    // from the page cache dropped.
    const std::string raw = dir + "/ckptfs-gpu-bench.raw";
    const double t_raw_write = bench::TimedWrite(raw, {std::span<const std::byte>(*pinned, bytes)});
    bench::DropCaches();
    const double t_raw_read = bench::TimedRead(raw, bytes, 4 << 20);
    std::filesystem::remove(raw);
    const std::string repo_dir = dir + "/ckptfs-gpu-bench";
    std::filesystem::remove_all(repo_dir);
    Check(Repository::Init(repo_dir, {}), "init");
    auto repo = std::move(Repository::Open(repo_dir)).value();
    TensorInfo info{"state", DType::kBF16, {bytes / 2}};
    // Snapshot save: blocking time against the plain copy; then durable.
    auto handle = std::move(gpu::SaveSnapshot(*repo, "snap", {0, 1, 1, {}},
                                              {{info, Region::OfFlat(0, bytes / 2), dev.p}}, *engine, snapshot_buffer))
                      .value();
    const double t_block = std::chrono::duration<double>(handle.blocking_time()).count();
    Check(handle.Wait().status(), "snapshot");
    // Streaming save end to end (durable), then a load back to the device.
    // The snapshot stored the same bytes: a fresh repository, so nothing is
    // deduplicated away.
    repo.reset();
    std::filesystem::remove_all(repo_dir);
    Check(Repository::Init(repo_dir, {}), "init");
    repo = std::move(Repository::Open(repo_dir)).value();
    t0 = Clock::now();
    Check(gpu::SaveStreaming(*repo, "stream", {0, 1, 2, {}}, {{info, Region::OfFlat(0, bytes / 2), dev.p}}, *engine,
                             *pool)
              .status(),
          "streaming save");
    const double t_save = Seconds(t0);
    bench::DropCaches();
    auto reader = std::move(repo->OpenCheckpoint("stream")).value();
    t0 = Clock::now();
    Check(gpu::LoadToDevice(*reader, *reader->FindTensor("state"), Region::OfFlat(0, bytes / 2), dev2.p, *engine,
                            *pool),
          "load");
    const double t_load = Seconds(t0);
    // Every byte back on the device must match.
    std::vector<std::byte> a(64 << 20);
    for (size_t off = 0; off < bytes; off += a.size()) {
      const size_t n = std::min(a.size(), bytes - off);
      Copy(*engine, true, *pinned, dev.p + off, n);
      std::memcpy(a.data(), *pinned, n);
      Copy(*engine, true, *pinned, dev2.p + off, n);
      if (std::memcmp(a.data(), *pinned, n) != 0) {
        std::fprintf(stderr, "MISMATCH after load at offset %zu\n", off);
        return 1;
      }
    }
    reader.reset();
    repo.reset();
    std::filesystem::remove_all(repo_dir);
    const double gb = bytes / 1e9;
    std::printf("run %d: plain pinned D2H %.2f GB/s; staging %.2f GB/s (%.2fx); snapshot blocking %.3f s vs plain %.3f s "
                "(%.2fx); streaming save %.2f GB/s (%.2fx raw write %.2f); load to device %.2f GB/s (%.2fx raw read "
                "%.2f); bytes checked\n",
                run + 1, gb / t_plain, gb / t_staged, t_plain / t_staged, t_block, t_plain, t_block / t_plain,
                gb / t_save, t_raw_write / t_save, gb / t_raw_write, gb / t_load, t_raw_read / t_load,
                gb / t_raw_read);
    fig.Add("save_ratio", t_raw_write / t_save);
    fig.Add("load_ratio", t_raw_read / t_load);
    fig.Add("plain", gb / t_plain);
    fig.Add("staged", t_plain / t_staged);
    fig.Add("blocking_ratio", t_block / t_plain);
    fig.Add("save_tp", gb / t_save);
    fig.Add("load_tp", gb / t_load);
  }
  std::printf("\nmedian of %d runs: plain D2H %.2f GB/s; staging %.2fx of it (target >= 0.9); snapshot blocking %.2fx of "
              "the plain copy (target <= 1.1); streaming save %.2f GB/s (%.2fx raw write); load to device %.2f GB/s "
              "(%.2fx raw read)\n",
              runs, fig.Median("plain"), fig.Median("staged"), fig.Median("blocking_ratio"), fig.Median("save_tp"),
              fig.Median("save_ratio"), fig.Median("load_tp"), fig.Median("load_ratio"));
  engine->FreePinned(*pinned);
  return 0;
}
