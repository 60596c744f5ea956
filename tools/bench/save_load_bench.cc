// Save/load benchmark: LLM-like training state (bf16 weights drawn from
// N(0, 0.02), fp32 Adam moments) saved by several ranks as box and flat
// shards, then loaded back resharded to another world size, every byte
// checked. Baselines on the same bytes and filesystem, in the same run: a raw
// sequential write with fsync, a raw sequential read into one reused 4 MiB
// buffer, and the same read straight into memory of the state's size that
// already exists (what loading into existing tensors takes without ckptfs);
// page cache dropped before each read when possible.
#include <sys/resource.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "bench_util.h"
#include "llm_state.h"
#include "ckpt/repository.h"
#include "io/safetensors.h"

using namespace ckptfs;

using bench::Check;
using bench::DropCaches;
using bench::Median;
using bench::Seconds;
using bench::Tensor;
using bench::BuildState;
using bench::RankRegion;
using bench::Extract;
using Clock = std::chrono::steady_clock;

namespace {

struct Options {
  std::string dir = ".";
  double gib = 2.0;
  int save_ranks = 4;
  int load_ranks = 3;
  int runs = 3;
  int level = 1;
  bool adaptive = true;
  std::string dump_state;  // write the state as safetensors here, then exit
};

// The state as one safetensors file, so other benchmarks (the Python one)
// measure the same bytes.
int DumpState(const std::string& path, const std::vector<Tensor>& state) {
  std::vector<TensorMeta> metas;
  std::vector<std::span<const std::byte>> parts;
  for (const auto& t : state) metas.push_back({t.info.name, t.info.dtype, t.info.shape});
  SafetensorsLayout layout = LayoutSafetensors(metas, {});
  parts.emplace_back(reinterpret_cast<const std::byte*>(layout.header.data()), layout.header.size());
  for (const auto& t : state) parts.emplace_back(t.bytes);
  bench::TimedWrite(path, parts);
  std::printf("wrote %zu tensors, %llu bytes to %s\n", state.size(), static_cast<unsigned long long>(layout.total_size),
              path.c_str());
  return 0;
}

double RawWrite(const std::string& path, const std::vector<Tensor>& state) {
  std::vector<std::span<const std::byte>> parts;
  for (const auto& t : state) parts.emplace_back(t.bytes);
  return bench::TimedWrite(path, parts);
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&] { return bench::NextArg(argc, argv, i); };
    if (a == "--dir") o.dir = next();
    else if (a == "--gib") o.gib = std::atof(next().c_str());
    else if (a == "--save-ranks") o.save_ranks = std::atoi(next().c_str());
    else if (a == "--load-ranks") o.load_ranks = std::atoi(next().c_str());
    else if (a == "--runs") o.runs = std::atoi(next().c_str());
    else if (a == "--level") o.level = std::atoi(next().c_str());
    else if (a == "--no-adaptive") o.adaptive = false;
    else if (a == "--dump-state") o.dump_state = next();
    else {
      std::printf(
          "usage: save_load_bench [--dir DIR] [--gib N] [--save-ranks N] [--load-ranks N] [--runs N]\n"
          "                       [--level L] [--no-adaptive] [--dump-state FILE]\n"
          "Saves LLM-like state (bf16 weights, fp32 Adam moments) from N ranks and loads it\n"
          "resharded, against a raw write (fsync) and reads of the same bytes in DIR (into a\n"
          "reused buffer, and into memory of the state's size).\n"
          "--dump-state writes that state as a safetensors file instead (for python_bench.py).\n");
      return a == "--help" || a == "-h" ? 0 : 2;
    }
  }
  auto state = BuildState(o.gib);
  if (!o.dump_state.empty()) return DumpState(o.dump_state, state);
  uint64_t total = 0, weight_bytes = 0;
  for (const auto& t : state) {
    total += t.bytes.size();
    if (t.is_weight) weight_bytes += t.bytes.size();
  }
  std::printf("state: %zu tensors, %.2f GiB (bf16 weights %.2f GiB, fp32 moments %.2f GiB); save %d ranks, load %d ranks\n",
              state.size(), total / double(1 << 30), weight_bytes / double(1 << 30),
              (total - weight_bytes) / double(1 << 30), o.save_ranks, o.load_ranks);
  const std::string work = o.dir + "/ckptfs-bench-" + std::to_string(::getpid());
  std::filesystem::create_directories(work);
  bool cold = true;
  std::vector<double> raw_w, raw_r, raw_m, save, load, ratio_all, ratio_w, save_fpg, load_fpg, save_of_limit,
      load_of_limit, save_cores, load_cores;
  std::printf("a first touch of a 4 KiB page costs %.2f us here\n", bench::PageFaultMicros());
  for (int run = 0; run < o.runs; ++run) {
    const std::string raw = work + "/raw.bin", repo_dir = work + "/repo";
    std::filesystem::remove_all(repo_dir);
    double tw = RawWrite(raw, state);
    cold &= DropCaches();
    double tr = bench::TimedRead(raw, total, 4 << 20);
    double tm;
    {
      std::vector<std::byte> landing(total);  // zero-filled: existing, touched memory
      cold &= DropCaches();
      tm = bench::TimedReadInto(raw, landing, 4 << 20);
    }
    std::filesystem::remove(raw);

    RepositoryConfig config;
    config.codec.level = o.level;
    config.adaptive = o.adaptive;
    Check(Repository::Init(repo_dir, config), "init");
    auto repo = std::move(Repository::Open(repo_dir)).value();
    // Each rank holds its own part of every tensor in its own memory.
    std::vector<std::vector<std::vector<std::byte>>> parts(o.save_ranks);
    for (int r = 0; r < o.save_ranks; ++r) parts[r] = bench::RankBoxes(state, r, o.save_ranks);
    ::sync();
    const long long faults_before_save = bench::MinorFaults(::getpid());
    const double cpu_before_save = bench::CpuSeconds();
    auto t0 = Clock::now();
    std::vector<std::thread> ranks;
    for (int r = 0; r < o.save_ranks; ++r) {
      ranks.emplace_back([&, r] { bench::SaveRank(*repo, "step-1", state, parts[r], r, o.save_ranks); });
    }
    for (auto& t : ranks) t.join();
    double ts = Seconds(t0);
    const long long save_faults = bench::MinorFaults(::getpid()) - faults_before_save;
    const double save_cpu = bench::CpuSeconds() - cpu_before_save;
    const uint64_t save_buffers = repo->buffer_stats().allocations;
    parts.clear();

    // Stored bytes, overall and for the bf16 weights.
    auto reader = std::move(repo->OpenCheckpoint("step-1")).value();
    auto sizes = std::move(reader->StoredBytes()).value();
    uint64_t stored = 0, stored_w = 0;
    for (size_t i = 0; i < reader->tensors().size(); ++i) {
      stored += sizes.tensors[i];
      if (reader->tensors()[i].dtype == DType::kBF16) stored_w += sizes.tensors[i];
    }
    reader.reset();
    repo.reset();
    cold &= DropCaches();

    // Load at another world size into per-rank buffers.
    // Like load_state_dict, the ranks load into parameters that already exist.
    std::vector<std::vector<std::vector<std::byte>>> loaded(o.load_ranks);
    for (int r = 0; r < o.load_ranks; ++r) loaded[r] = bench::RankBuffers(state, r, o.load_ranks);
    repo = std::move(Repository::Open(repo_dir)).value();
    const long long faults_before_load = bench::MinorFaults(::getpid());
    const double cpu_before_load = bench::CpuSeconds();
    auto t1 = Clock::now();
    reader = std::move(repo->OpenCheckpoint("step-1")).value();
    std::vector<std::thread> loaders;
    for (int r = 0; r < o.load_ranks; ++r) {
      loaders.emplace_back([&, r] { bench::LoadRank(*reader, state, r, o.load_ranks, loaded[r]); });
    }
    for (auto& t : loaders) t.join();
    double tl = Seconds(t1);
    const double load_cpu = bench::CpuSeconds() - cpu_before_load;
    // The load phase on the clock `perf record -k CLOCK_MONOTONIC` stamps
    // samples with, for a profile of the load alone (perf report --time).
    const auto load_end = Clock::now();
    const long long load_faults = bench::MinorFaults(::getpid()) - faults_before_load;
    const uint64_t load_buffers = repo->buffer_stats().allocations;
    if (!bench::LoadedRight(state, loaded)) return 1;
    reader.reset();
    repo.reset();
    std::filesystem::remove_all(repo_dir);
    const double gb = total / 1e9;
    const double gib = total / double(1ull << 30);
    // The physical limits: the stored bytes written (and fsync'd) at the
    // raw write rate, and read at the raw read rate, measured above.
    const double save_limit = double(stored) / total * tw / ts;
    const double load_limit = double(stored) / total * tr / tl;
    std::printf("run %d: raw write %.2f GB/s, raw read %.2f GB/s (into memory %.2f GB/s), save %.2f GB/s (%.2fx; "
                "%.2f of its limit), load %.2f GB/s (%.2fx; %.2fx the read into memory; %.2f of its limit), stored "
                "%.3f of raw (bf16 weights %.3f); minor page faults per GiB: save %.0f, load %.0f; all bytes checked\n",
                run + 1, gb / tw, gb / tr, gb / tm, gb / ts, tw / ts, save_limit, gb / tl, tr / tl, tm / tl, load_limit,
                double(stored) / total, double(stored_w) / weight_bytes, save_faults / gib, load_faults / gib);
    std::printf("       load phase, CLOCK_MONOTONIC: %.6f,%.6f\n",
                std::chrono::duration<double>(t1.time_since_epoch()).count(),
                std::chrono::duration<double>(load_end.time_since_epoch()).count());
    // Buffers the repository's pool allocated (fresh memory) rather than reused.
    std::printf("       chunk buffers allocated: save %llu, load %llu\n",
                static_cast<unsigned long long>(save_buffers), static_cast<unsigned long long>(load_buffers));
    // Which resource binds: CPU seconds per wall second (the cores busy).
    std::printf("       cores busy: save %.2f, load %.2f of %u\n", save_cpu / ts, load_cpu / tl,
                std::thread::hardware_concurrency());
    save_cores.push_back(save_cpu / ts);
    load_cores.push_back(load_cpu / tl);
    save_of_limit.push_back(save_limit);
    load_of_limit.push_back(load_limit);
    save_fpg.push_back(save_faults / gib);
    load_fpg.push_back(load_faults / gib);
    std::fflush(stdout);
    raw_w.push_back(gb / tw);
    raw_r.push_back(gb / tr);
    raw_m.push_back(gb / tm);
    save.push_back(gb / ts);
    load.push_back(gb / tl);
    ratio_all.push_back(double(stored) / total);
    ratio_w.push_back(double(stored_w) / weight_bytes);
  }
  std::filesystem::remove_all(work);
  std::vector<double> save_ratio, load_ratio, load_ratio_m;
  for (int i = 0; i < o.runs; ++i) {
    save_ratio.push_back(save[i] / raw_w[i]);
    load_ratio.push_back(load[i] / raw_r[i]);
    load_ratio_m.push_back(load[i] / raw_m[i]);
  }
  std::printf("\nmedian of %d runs (%s page cache for reads):\n", o.runs, cold ? "cold" : "WARM (could not drop)");
  std::printf("  raw write+fsync  %6.2f GB/s\n", Median(raw_w));
  std::printf("  save             %6.2f GB/s   ratio to raw write %.2f\n", Median(save), Median(save_ratio));
  std::printf("  raw read         %6.2f GB/s\n", Median(raw_r));
  std::printf("  raw read, memory %6.2f GB/s   (straight into memory of the state's size)\n", Median(raw_m));
  std::printf("  resharded load   %6.2f GB/s   ratio to raw read  %.2f, to raw read into memory %.2f\n", Median(load),
              Median(load_ratio), Median(load_ratio_m));
  std::printf("  stored / raw     %6.3f        bf16 weights %.3f\n", Median(ratio_all), Median(ratio_w));
  std::printf("  save, of its limit %.2f (the stored bytes at the raw write+fsync rate; target >= 0.9)\n",
              Median(save_of_limit));
  std::printf("  load, of its limit %.2f (the stored bytes at the raw read rate; target >= 0.9)\n",
              Median(load_of_limit));
  std::printf("  cores busy (CPU seconds per second): save %.2f, load %.2f of %u\n", Median(save_cores),
              Median(load_cores), std::thread::hardware_concurrency());
  std::printf("  minor page faults per GiB: save %.0f, load %.0f (whole runs, warm-up included)\n", Median(save_fpg),
              Median(load_fpg));
  return 0;
}
