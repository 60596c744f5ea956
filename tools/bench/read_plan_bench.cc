// Read planning of a tensor saved in many shards. A tensor of --mib MiB
// (fp32 rows) is saved in N row shards by N ranks (N = 8, 64, 512: the
// layout of a Shard(0) tensor over that many ranks) into a local
// repository, then read whole in requests of --request KiB as the mount
// reads a file, through CheckpointReader::SliceBytes (the mount's path: the
// decoded chunks' bytes in place) and ReadBytes (a copy into one reused
// buffer). In the same run, on the same bytes and with every chunk already
// in the reader's cache (a first read warms it), each way is timed with the
// reader's own record, whose shards the reader finds through its index
// (ShardIndex), and with a copy of that record, whose shards are all
// scanned for every request (what every read did before the index).
// Printed: GB/s of each, the ratio, and the process's minor page faults
// per GiB read (none should come from planning).
//
//     build/tools/read_plan_bench --dir /tmp --mib 256 --runs 5
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <thread>
#include <string>
#include <vector>

#include <unistd.h>

#include "bench_util.h"
#include "ckpt/read_plan.h"
#include "ckpt/repository.h"

using namespace ckptfs;
using bench::Check;
using bench::Median;
using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

namespace {

constexpr uint64_t kCols = 1024;

struct Figures {
  double slice_indexed = 0, slice_scanned = 0, read_indexed = 0, read_scanned = 0;
  double faults_per_gib = 0;
};

// Seconds to read `t` whole in requests of `request` bytes, one way.
double ReadAll(const CheckpointReader& reader, const TensorRecord& t, uint64_t request, bool slices,
               std::vector<std::byte>& buffer, std::vector<ChunkSlice>& scratch) {
  const uint64_t total = t.ByteSize();
  uint64_t checksum = 0;
  const auto t0 = Clock::now();
  for (uint64_t off = 0; off < total; off += request) {
    const uint64_t n = std::min(request, total - off);
    if (slices) {
      scratch.clear();
      auto got = reader.SliceBytes(t, off, n, 64, scratch);
      Check(got.status(), "slice");
      if (!*got) {
        std::fprintf(stderr, "a request did not slice\n");
        std::exit(1);
      }
      for (const ChunkSlice& s : scratch) checksum += static_cast<uint64_t>(s.data->data()[s.offset]);
    } else {
      Check(reader.ReadBytes(t, off, std::span(buffer).first(n)), "read");
      checksum += static_cast<uint64_t>(buffer[0]);
    }
  }
  const double s = bench::Seconds(t0);
  if (checksum == 1) std::fprintf(stderr, " ");  // keeps the reads from being elided
  return s;
}

Figures Measure(const std::string& dir, uint64_t mib, uint32_t shards, uint64_t request) {
  fs::remove_all(dir);
  RepositoryConfig config;
  Check(Repository::Init(dir, config), "init");
  auto repo = Repository::Open(dir, {});
  Check(repo.status(), "open");
  const uint64_t rows = std::max<uint64_t>(shards, (mib << 20) / (kCols * 4) / shards * shards);
  const uint64_t per = rows / shards;
  std::vector<float> values(rows * kCols);
  for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>((i * 2654435761u) % 1000003) * 1e-3f;
  const TensorInfo info{"w", DType::kF32, {rows, kCols}};
  for (uint32_t r = 0; r < shards; ++r) {
    auto writer = (*repo)->BeginCheckpoint("c", {.rank = r, .world_size = shards});
    Check(writer.status(), "begin");
    const auto bytes = std::as_bytes(std::span(values)).subspan(r * per * kCols * 4, per * kCols * 4);
    HostSource source(bytes);
    Check((*writer)->PutShard(info, Region::OfBox(Box{{r * per, 0}, {per, kCols}}), source), "put");
    Check((*writer)->Commit().Wait().status(), "commit");
  }
  auto reader = (*repo)->OpenCheckpoint("c");
  Check(reader.status(), "open checkpoint");
  const TensorRecord* own = (*reader)->FindTensor("w");
  const TensorRecord copy = *own;
  std::vector<std::byte> buffer(request);
  std::vector<ChunkSlice> scratch;
  scratch.reserve(64);
  Figures f;
  const double gib = static_cast<double>(own->ByteSize()) / (1 << 30);
  long long faults = 0;
  // Each pass starts with every chunk decoded in the cache (a slicing pass
  // first: reads let a chunk go once all its bytes were copied out).
  auto pass = [&](const TensorRecord& t, bool slices) {
    ReadAll(**reader, t, request, true, buffer, scratch);
    const long long before = bench::MinorFaults(::getpid());
    const double s = ReadAll(**reader, t, request, slices, buffer, scratch);
    if (&t == own) faults += bench::MinorFaults(::getpid()) - before;
    return s;
  };
  f.slice_indexed = pass(*own, true);
  f.slice_scanned = pass(copy, true);
  f.read_indexed = pass(*own, false);
  f.read_scanned = pass(copy, false);
  f.faults_per_gib = static_cast<double>(faults) / (2 * gib);
  for (double* s : {&f.slice_indexed, &f.slice_scanned, &f.read_indexed, &f.read_scanned}) {
    *s = static_cast<double>(own->ByteSize()) / *s / 1e9;  // GB/s
  }
  return f;
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir = "/tmp";
  uint64_t mib = 256, request_kib = 128;
  int runs = 3;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--dir") {
      dir = bench::NextArg(argc, argv, i);
    } else if (a == "--mib") {
      mib = std::strtoull(bench::NextArg(argc, argv, i).c_str(), nullptr, 10);
    } else if (a == "--request") {
      request_kib = std::strtoull(bench::NextArg(argc, argv, i).c_str(), nullptr, 10);
    } else if (a == "--runs") {
      runs = std::atoi(bench::NextArg(argc, argv, i).c_str());
    } else {
      std::fprintf(stderr, "usage: %s [--dir DIR] [--mib N] [--request KIB] [--runs N]\n", argv[0]);
      return a == "--help" ? 0 : 2;
    }
  }
  if (mib == 0 || request_kib == 0 || runs < 1) {
    std::fprintf(stderr, "--mib, --request and --runs must be positive\n");
    return 2;
  }
  const std::string repo = dir + "/ckptfs-read-plan-bench-" + std::to_string(::getpid());
  std::printf("a %llu MiB fp32 tensor in N row shards, read whole in %llu KiB requests from the chunk cache; "
              "%u CPUs\n",
              static_cast<unsigned long long>(mib), static_cast<unsigned long long>(request_kib),
              std::thread::hardware_concurrency());
  for (uint32_t shards : {8u, 64u, 512u}) {
    std::vector<double> si, ss, ri, rs, pf;
    for (int run = 0; run < runs; ++run) {
      const Figures f = Measure(repo, mib, shards, request_kib << 10);
      si.push_back(f.slice_indexed);
      ss.push_back(f.slice_scanned);
      ri.push_back(f.read_indexed);
      rs.push_back(f.read_scanned);
      pf.push_back(f.faults_per_gib);
      std::printf("N=%u run %d: slices %.2f GB/s indexed, %.2f scanned (%.2fx); reads %.2f GB/s indexed, %.2f "
                  "scanned (%.2fx); %.0f minor faults/GiB\n",
                  shards, run, f.slice_indexed, f.slice_scanned, f.slice_indexed / f.slice_scanned, f.read_indexed,
                  f.read_scanned, f.read_indexed / f.read_scanned, f.faults_per_gib);
    }
    std::printf("N=%u medians: slices %.2f vs %.2f GB/s = %.2fx; reads %.2f vs %.2f GB/s = %.2fx; "
                "%.0f minor faults/GiB\n",
                shards, Median(si), Median(ss), Median(si) / Median(ss), Median(ri), Median(rs),
                Median(ri) / Median(rs), Median(pf));
  }
  fs::remove_all(repo);
  return 0;
}
