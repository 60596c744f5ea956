// Fine-tuning sequence benchmark: N checkpoints of one run in which a frozen
// base stays equal and a small part of the tensors changes at every step.
// Reports stored bytes against the sum of logical bytes, the time of each
// save against the first, and the time of a gc that keeps the last few.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "bench_util.h"
#include "ckpt/repository.h"

using namespace ckptfs;
using bench::Check;
using Clock = std::chrono::steady_clock;

int main(int argc, char** argv) {
  std::string dir = ".";
  double gib = 2;
  int steps = 10, tensors = 40;
  double changed = 0.1;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&] { return bench::NextArg(argc, argv, i); };
    if (a == "--dir") dir = next();
    else if (a == "--gib") gib = std::atof(next().c_str());
    else if (a == "--steps") steps = std::atoi(next().c_str());
    else if (a == "--changed") changed = std::atof(next().c_str());
    else {
      std::printf("usage: dedup_bench [--dir DIR] [--gib N] [--steps N] [--changed FRACTION]\n");
      return a == "--help" || a == "-h" ? 0 : 2;
    }
  }
  const uint64_t per_tensor = static_cast<uint64_t>(gib * (1ull << 30) / tensors / 2);  // bf16 elements
  const int n_changed = std::max(1, static_cast<int>(std::lround(tensors * changed)));
  std::printf("%d checkpoints of %d bf16 tensors (%.2f GiB each); %d tensors (%.0f%%) change per step\n", steps, tensors,
              tensors * per_tensor * 2 / double(1 << 30), n_changed, 100.0 * n_changed / tensors);
  std::vector<std::vector<uint16_t>> state(tensors, std::vector<uint16_t>(per_tensor));
  for (int t = 0; t < tensors; ++t) bench::FillNormalBf16(state[t].data(), per_tensor, 0.02f, 1000 + t);
  const std::string repo_dir = dir + "/ckptfs-dedup-bench-" + std::to_string(::getpid());
  Check(Repository::Init(repo_dir, {}), "init");
  auto repo = std::move(Repository::Open(repo_dir)).value();
  std::vector<double> times;
  uint64_t logical = 0;
  for (int step = 0; step < steps; ++step) {
    if (step > 0) {  // the trainable head: the last n_changed tensors
      for (int t = tensors - n_changed; t < tensors; ++t) {
        bench::FillNormalBf16(state[t].data(), per_tensor, 0.02f, step * 100000 + t);
      }
    }
    auto t0 = Clock::now();
    auto w = std::move(repo->BeginCheckpoint("step-" + std::to_string(step), {0, 1, step, {}})).value();
    for (int t = 0; t < tensors; ++t) {
      Check(w->PutTensor({"layer." + std::to_string(t), DType::kBF16, {per_tensor}}, std::as_bytes(std::span(state[t]))),
            "put");
    }
    auto res = w->Commit().Wait();
    Check(res.status(), "commit");
    double s = bench::Seconds(t0);
    times.push_back(s);
    logical += res->logical_bytes;
    std::printf("save %2d: %6.2f s (%.2fx of the first), %8.1f MiB new stored\n", step, s, s / times[0],
                res->stored_bytes / double(1 << 20));
    std::fflush(stdout);
  }
  auto usage = *repo->DiskUsage({});
  std::printf("\nlogical %.2f GiB in %d checkpoints; stored %.2f GiB = %.3f of logical (dedup %.2fx, compression %.2fx)\n",
              logical / double(1 << 30), steps, usage.pack_bytes / double(1 << 30), double(usage.pack_bytes) / logical,
              usage.dedup_ratio(), usage.compression_ratio());
  std::vector<double> later(times.begin() + 1, times.end());
  std::sort(later.begin(), later.end());
  if (!later.empty()) {
    std::printf("later saves: median %.2f s = %.3fx of the first (%.2f s); worst %.3fx\n", later[later.size() / 2],
                later[later.size() / 2] / times[0], times[0], later.back() / times[0]);
  }
  GcOptions gc;
  gc.retention.keep_last = 3;
  auto t0 = Clock::now();
  auto r = repo->CollectGarbage(gc);
  Check(r.status(), "gc");
  std::printf("gc --keep-last 3: %.2f s, removed %zu checkpoints, reclaimed %.1f MiB, rewrote %llu packs\n",
              bench::Seconds(t0), r->removed.size(),
              r->bytes_reclaimed() / double(1 << 20), static_cast<unsigned long long>(r->packs_rewritten));
  repo.reset();
  std::filesystem::remove_all(repo_dir);
  return 0;
}
