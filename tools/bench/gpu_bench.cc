// GPU staging benchmark: device-to-host staging throughput of a multi-GiB
// state against a plain pinned cudaMemcpy of the same bytes, the blocking
// time of a snapshot save against that plain copy, and end-to-end streaming
// save and load throughput. Needs a GPU; says why and exits 0 without one.
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
using Clock = std::chrono::steady_clock;

int main(int argc, char** argv) {
  std::string dir = ".";
  double gib = 4;
  size_t buffer_mib = 64, buffers = 2;
  int runs = 3;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
    if (a == "--dir") dir = next();
    else if (a == "--gib") gib = std::atof(next().c_str());
    else if (a == "--buffer-mib") buffer_mib = std::atoi(next().c_str());
    else if (a == "--buffers") buffers = std::atoi(next().c_str());
    else if (a == "--runs") runs = std::atoi(next().c_str());
    else {
      std::printf("usage: gpu_bench [--dir DIR] [--gib N] [--buffer-mib N] [--buffers N] [--runs N]\n");
      return a == "--help" || a == "-h" ? 0 : 2;
    }
  }
  std::string why;
  if (!gpu::CudaAvailable(&why)) {
    std::printf("gpu_bench: nothing measured: %s\n", why.c_str());
    return 0;
  }
#ifdef CKPTFS_HAVE_CUDA
  using bench::Check;
  const size_t bytes = static_cast<size_t>(gib * (1ull << 30)) / 4096 * 4096;
  auto engine = std::move(gpu::NewCudaCopyEngine(0)).value();
  std::printf("device: %s; state %.2f GiB of bf16 N(0, 0.02); staging %zu x %zu MiB pinned\n", engine->Describe().c_str(),
              bytes / double(1 << 30), buffers, buffer_mib);
  // Device state, distinct in every 256 MiB block (no dedup between blocks).
  std::byte* dev = nullptr;
  if (cudaMalloc(reinterpret_cast<void**>(&dev), bytes) != cudaSuccess) return 1;
  {
    std::vector<uint16_t> block((256u << 20) / 2);
    for (size_t off = 0; off < bytes; off += block.size() * 2) {
      bench::FillNormalBf16(block.data(), block.size(), 0.02f, 7 + off);
      size_t n = std::min(block.size() * 2, bytes - off);
      cudaMemcpy(dev + off, block.data(), n, cudaMemcpyHostToDevice);
    }
  }
  std::byte* pinned = nullptr;
  cudaHostAlloc(reinterpret_cast<void**>(&pinned), bytes, cudaHostAllocDefault);
  auto pool = std::move(gpu::PinnedPool::Create(*engine, buffers, buffer_mib << 20)).value();
  gpu::SnapshotBuffer snapshot_buffer(*engine);
  Check(snapshot_buffer.Reserve(bytes), "snapshot buffer");
  std::vector<double> plain, staged, blocking_ratio, save_tp, load_tp;
  for (int run = 0; run < runs; ++run) {
    auto t0 = Clock::now();
    cudaMemcpy(pinned, dev, bytes, cudaMemcpyDeviceToHost);
    const double t_plain = std::chrono::duration<double>(Clock::now() - t0).count();
    // Staging alone, as the writer drives it: 4 MiB chunks lent in place
    // from the pinned buffers and handed back at once.
    const uint64_t chunk = RepositoryConfig{}.chunk_size;
    std::vector<uint64_t> bounds;
    for (uint64_t off = 0; off < bytes; off += chunk) bounds.push_back(off);
    bounds.push_back(bytes);
    t0 = Clock::now();
    {
      gpu::DeviceSource source(*engine, *pool, dev, bytes);
      source.PlanChunks(bounds);
      for (size_t i = 0; i + 1 < bounds.size(); ++i) {
        auto lent = source.Borrow(bounds[i], bounds[i + 1] - bounds[i]);
        Check(lent.status(), "staging");
        if (!lent->keep) {
          std::fprintf(stderr, "staging buffers smaller than a chunk: use --buffer-mib >= %llu\n",
                       static_cast<unsigned long long>(chunk >> 20));
          return 2;
        }
      }
    }
    const double t_staged = std::chrono::duration<double>(Clock::now() - t0).count();
    // Snapshot save: blocking time against the plain copy; then durable.
    const std::string repo_dir = dir + "/ckptfs-gpu-bench";
    std::filesystem::remove_all(repo_dir);
    Check(Repository::Init(repo_dir, {}), "init");
    auto repo = std::move(Repository::Open(repo_dir)).value();
    TensorInfo info{"state", DType::kBF16, {bytes / 2}};
    // The snapshot buffer is allocated once, before the runs, like the
    // staging pool: a training job keeps it for every save.
    auto handle = std::move(gpu::SaveSnapshot(*repo, "snap", {0, 1, 1, {}},
                                              {{info, Region::OfFlat(0, bytes / 2), dev}}, *engine, snapshot_buffer))
                      .value();
    const double t_block = std::chrono::duration<double>(handle.blocking_time()).count();
    Check(handle.Wait().status(), "snapshot");
    // Streaming save end to end (durable), then a load back to the device.
    t0 = Clock::now();
    auto w = std::move(repo->BeginCheckpoint("stream", {0, 1, 2, {}})).value();
    Check(gpu::PutShardFromDevice(*w, {info, Region::OfFlat(0, bytes / 2), dev}, *engine, *pool), "put");
    Check(w->Commit().Wait().status(), "commit");
    const double t_save = std::chrono::duration<double>(Clock::now() - t0).count();
    bench::DropCaches();
    auto reader = std::move(repo->OpenCheckpoint("stream")).value();
    std::byte* dev2 = nullptr;
    cudaMalloc(reinterpret_cast<void**>(&dev2), bytes);
    t0 = Clock::now();
    Check(gpu::LoadToDevice(*reader, *reader->FindTensor("state"), Region::OfFlat(0, bytes / 2), dev2, *engine, *pool),
          "load");
    const double t_load = std::chrono::duration<double>(Clock::now() - t0).count();
    // Every byte back on the device must match.
    std::vector<std::byte> a(64 << 20), b(64 << 20);
    for (size_t off = 0; off < bytes; off += a.size()) {
      size_t n = std::min(a.size(), bytes - off);
      cudaMemcpy(a.data(), dev + off, n, cudaMemcpyDeviceToHost);
      cudaMemcpy(b.data(), dev2 + off, n, cudaMemcpyDeviceToHost);
      if (std::memcmp(a.data(), b.data(), n) != 0) {
        std::fprintf(stderr, "MISMATCH after load at offset %zu\n", off);
        return 1;
      }
    }
    cudaFree(dev2);
    reader.reset();
    repo.reset();
    std::filesystem::remove_all(repo_dir);
    const double gb = bytes / 1e9;
    std::printf("run %d: plain pinned D2H %.2f GB/s; staging %.2f GB/s (%.2fx); snapshot blocking %.3f s vs plain %.3f s "
                "(%.2fx); streaming save %.2f GB/s; load to device %.2f GB/s; bytes checked\n",
                run + 1, gb / t_plain, gb / t_staged, t_plain / t_staged, t_block, t_plain, t_block / t_plain,
                gb / t_save, gb / t_load);
    plain.push_back(gb / t_plain);
    staged.push_back(t_plain / t_staged);
    blocking_ratio.push_back(t_block / t_plain);
    save_tp.push_back(gb / t_save);
    load_tp.push_back(gb / t_load);
  }
  std::printf("\nmedian of %d runs: plain D2H %.2f GB/s; staging %.2fx of it (target >= 0.9); snapshot blocking %.2fx of "
              "the plain copy (target <= 1.1); save %.2f GB/s; load %.2f GB/s\n",
              runs, bench::Median(plain), bench::Median(staged), bench::Median(blocking_ratio), bench::Median(save_tp),
              bench::Median(load_tp));
  cudaFreeHost(pinned);
  cudaFree(dev);
#endif
  return 0;
}
