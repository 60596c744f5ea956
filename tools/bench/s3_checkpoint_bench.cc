// Checkpoints on S3 through the repository, against plain S3 transfers of
// the same bytes to the same server in the same run:
//
//   save: LLM-like state (llm_state.h) saved by several ranks, each a
//         "host" with its own catalog, from the first put to the checkpoint
//         visible; against s3cmd's multipart upload of the same bytes.
//   load: a host that has never seen the repository opens it and loads the
//         checkpoint at another world size (every byte checked); against a
//         download of the same bytes with 4 MiB ranged GETs (several
//         threads, and one) and with s3cmd get, the fastest of the three.
//   scale: 1, 8, 32, 64 ranks (each its own host) save small shards of one
//         tensor, three steps in a row; S3 requests per rank and commit
//         latency: the last rank commits after all others are in, and its
//         commit call (its own part, then the merge of all N) is timed.
//
//   eval "$(tools/s3-server.sh start /tmp/s3)"
//   build/tools/s3_checkpoint_bench --gib 0.5 --runs 3
//
// The server comes from AWS_ENDPOINT_URL and the credentials from
// AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY; s3cmd (Debian package) must be
// on PATH for the save and load part.
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "backend/store_url.h"
#include "bench_util.h"
#include "ckpt/repository.h"
#include "llm_state.h"

using namespace ckptfs;
using bench::Check;
using bench::Median;
using bench::Seconds;
using Clock = std::chrono::steady_clock;

namespace {

constexpr const char* kBucket = "ckptfs-bench";


struct Options {
  double gib = 0.5;
  int runs = 3;
  int save_ranks = 4;
  int load_ranks = 3;
  int get_threads = 8;
  int load_threads = 0;  // the loading host's repository threads (0: its default)
  std::vector<int> scale = {1, 8, 32, 64};
  int steps = 3;
  bool transfers = true;
  std::string dir = "/tmp";
};


void RemovePrefix(const ObjectStoreOptions& s3, const std::string& prefix) {
  bench::RemovePrefix(s3, kBucket, prefix);
}

// Open options that only name the S3 settings.
OpenOptions S3Only(const ObjectStoreOptions& s3) {
  OpenOptions o;
  o.s3 = s3;
  return o;
}

std::unique_ptr<Repository> OpenHost(const std::string& url, const std::string& cache_dir, const ObjectStoreOptions& s3,
                                     size_t threads) {
  OpenOptions o;
  o.cache_dir = cache_dir;
  o.s3 = s3;
  o.threads = threads;
  if (threads == 1) o.cache_bytes = 16 << 20;
  auto r = Repository::Open(url, o);
  Check(r.status(), "open repository");
  return std::move(r).value();
}

// ---- save and load against plain transfers ----

void TransferRuns(const Options& o, const ObjectStoreOptions& s3) {
  auto state = bench::BuildState(o.gib);
  uint64_t total = 0;
  for (const auto& t : state) total += t.bytes.size();
  std::printf("state: %zu tensors, %.2f GiB; save %d ranks (hosts), load %d ranks on a new host; server %s\n",
              state.size(), total / double(1 << 30), o.save_ranks, o.load_ranks, s3.endpoint.c_str());
  const std::string work = o.dir + "/ckptfs-s3-bench-" + std::to_string(::getpid());
  std::filesystem::create_directories(work);
  const std::string raw = work + "/raw.bin";
  {
    std::vector<std::span<const std::byte>> parts;
    for (const auto& t : state) parts.emplace_back(t.bytes);
    bench::TimedWrite(raw, parts);
  }
  const std::string s3cmd = bench::S3cmd(s3);
  bench::RunFigures fig;
  for (int run = 0; run < o.runs; ++run) {
    const std::string prefix = "ckpt-bench-" + std::to_string(::getpid()) + "-" + std::to_string(run);
    const std::string url = std::string("s3://") + kBucket + "/" + prefix;
    RepositoryConfig config;
    Check(Repository::Init(url, config, S3Only(s3)), "init");
    // Each rank a host of its own; opened before the clock starts, as a
    // training job opens its repository once.
    std::vector<std::unique_ptr<Repository>> hosts;
    for (int r = 0; r < o.save_ranks; ++r) {
      hosts.push_back(OpenHost(url, work + "/run" + std::to_string(run) + "-host" + std::to_string(r), s3, 0));
    }
    std::vector<std::vector<std::vector<std::byte>>> parts(o.save_ranks);
    for (int r = 0; r < o.save_ranks; ++r) parts[r] = bench::RankBoxes(state, r, o.save_ranks);
    auto t0 = Clock::now();
    std::vector<std::thread> ranks;
    for (int r = 0; r < o.save_ranks; ++r) {
      ranks.emplace_back([&, r] { bench::SaveRank(*hosts[r], "step-1", state, parts[r], r, o.save_ranks); });
    }
    for (auto& t : ranks) t.join();
    const double ts = Seconds(t0);
    hosts.clear();
    parts.clear();

    t0 = Clock::now();
    const std::string raw_key = prefix + "-raw/raw.bin";
    if (std::system((s3cmd + " put " + raw + " s3://" + kBucket + "/" + raw_key).c_str()) != 0) {
      std::fprintf(stderr, "s3cmd put failed\n");
      std::exit(1);
    }
    const double tput = Seconds(t0);

    // Load on a host that has never seen the repository: open (its catalog
    // is built from the store) and read at another world size.
    std::vector<std::vector<std::vector<std::byte>>> loaded(o.load_ranks);
    for (int r = 0; r < o.load_ranks; ++r) loaded[r] = bench::RankBuffers(state, r, o.load_ranks);
    double cpu0 = bench::CpuSeconds();
    t0 = Clock::now();
    auto reader_host = OpenHost(url, work + "/run" + std::to_string(run) + "-reader", s3, o.load_threads);
    auto reader = std::move(reader_host->OpenCheckpoint("step-1")).value();
    std::vector<std::thread> loaders;
    for (int r = 0; r < o.load_ranks; ++r) {
      loaders.emplace_back([&, r] { bench::LoadRank(*reader, state, r, o.load_ranks, loaded[r]); });
    }
    for (auto& t : loaders) t.join();
    const double tl = Seconds(t0);
    const double load_cpu = bench::CpuSeconds() - cpu0;
    const RequestCounts load_requests = reader_host->store_requests();
    const uint64_t stored = std::move(reader->StoredBytes()).value().total;
    reader.reset();
    reader_host.reset();
    if (!bench::LoadedRight(state, loaded)) std::exit(1);
    loaded.clear();

    // The same bytes downloaded: 4 MiB ranged GETs from several threads,
    // and s3cmd get.
    auto raw_backend = std::move(OpenObjectStore(std::string("s3://") + kBucket + "/" + prefix + "-raw", s3)).value();
    std::vector<std::byte> out(total);
    cpu0 = bench::CpuSeconds();
    t0 = Clock::now();
    bench::ReadInPieces(*raw_backend, "raw.bin", out, o.get_threads);
    const double tget = Seconds(t0);
    const double get_cpu = bench::CpuSeconds() - cpu0;
    // One thread, in order (on a loaded 2-core server often the fastest).
    t0 = Clock::now();
    bench::ReadInPieces(*raw_backend, "raw.bin", out, 1);
    const double tseq = Seconds(t0);
    t0 = Clock::now();
    if (std::system((s3cmd + " get --force s3://" + kBucket + "/" + raw_key + " - > /dev/null").c_str()) != 0) {
      std::fprintf(stderr, "s3cmd get failed\n");
      std::exit(1);
    }
    const double tcget = Seconds(t0);
    const double tdown = std::min({tget, tseq, tcget});
    // The same bytes uploaded as the fastest plain client would: 16 MiB
    // objects put from the threads a ranged download uses (the save's 4
    // hosts keep as many requests in flight).
    t0 = Clock::now();
    bench::WriteInPieces(*raw_backend, "put", out, o.get_threads);
    const double tpar = Seconds(t0);
    // The limits: the bytes the checkpoint stores, moved at those rates.
    const double save_limit = double(stored) / total * std::min(tpar, tput) / ts;
    const double load_limit = double(stored) / total * tdown / tl;
    RemovePrefix(s3, prefix);
    RemovePrefix(s3, prefix + "-raw");

    const double mb = total / 1e6;
    std::printf("run %d: save %.0f MB/s, s3cmd put %.0f MB/s (%.2fx), %d-thread puts %.0f MB/s, stored %.3f of the "
                "bytes; load %.0f MB/s (%llu requests), ranged GETs %.0f MB/s (%d threads) %.0f MB/s (1 thread), s3cmd "
                "get %.0f MB/s (%.2fx the fastest); of their limits: save %.2f, load %.2f; client CPU %.2f s for the "
                "load, %.2f s for the %d-thread GETs; bytes checked\n",
                run + 1, mb / ts, mb / tput, tput / ts, o.get_threads, mb / tpar, double(stored) / total, mb / tl,
                static_cast<unsigned long long>(load_requests.total()), mb / tget, o.get_threads, mb / tseq,
                mb / tcget, tdown / tl, save_limit, load_limit, load_cpu, get_cpu, o.get_threads);
    fig.Add("parallel_put", mb / tpar);
    fig.Add("save_limit", save_limit);
    fig.Add("load_limit", load_limit);
    std::fflush(stdout);
    fig.Add("save", mb / ts);
    fig.Add("put", mb / tput);
    fig.Add("save_ratio", tput / ts);
    fig.Add("load", mb / tl);
    fig.Add("get", mb / tget);
    fig.Add("get_seq", mb / tseq);
    fig.Add("cmd_get", mb / tcget);
    fig.Add("load_ratio", tdown / tl);
    fig.Add("stored", double(stored) / total);
    fig.Add("load_cpu", load_cpu);
    fig.Add("get_cpu", get_cpu);
  }
  std::filesystem::remove_all(work);
  std::printf("\nmedian of %d runs:\n", o.runs);
  std::printf("  save (%d hosts)        %6.0f MB/s   ratio to s3cmd put %.2f   (target >= 0.8)\n", o.save_ranks,
              fig.Median("save"), fig.Median("save_ratio"));
  std::printf("  s3cmd put (multipart)  %6.0f MB/s   (the save uploads %.3f of the bytes: compressed)\n",
              fig.Median("put"), fig.Median("stored"));
  std::printf("  resharded load         %6.0f MB/s   ratio to the fastest download %.2f   (target >= 0.8)\n",
              fig.Median("load"), fig.Median("load_ratio"));
  std::printf("  ranged GETs, %d threads %6.0f MB/s\n", o.get_threads, fig.Median("get"));
  std::printf("  ranged GETs, 1 thread  %6.0f MB/s\n", fig.Median("get_seq"));
  std::printf("  s3cmd get              %6.0f MB/s\n", fig.Median("cmd_get"));
  std::printf("  %d-thread 16 MiB puts %6.0f MB/s\n", o.get_threads, fig.Median("parallel_put"));
  std::printf("  save, of its limit %.2f (the stored bytes at the fastest plain upload; target >= 0.9)\n",
              fig.Median("save_limit"));
  std::printf("  load, of its limit %.2f (the stored bytes at the fastest plain download; target >= 0.9)\n",
              fig.Median("load_limit"));
  std::printf("  client CPU: load %.2f s, %d-thread ranged GETs %.2f s (the server shares the machine)\n\n",
              fig.Median("load_cpu"), o.get_threads, fig.Median("get_cpu"));
}

// ---- scale ----

struct RankStep {
  RequestCounts requests;
  Clock::time_point commit_start, commit_end;
  bool committed = false;
};

struct ScaleFigures {
  int ranks;
  double requests_per_rank;  // median over steps of the median over ranks that did not commit
  double committer_requests;
  double latency_ms;         // median over steps
};

ScaleFigures ScaleRun(const Options& o, const ObjectStoreOptions& s3, int n) {
  std::vector<double> step_requests, step_committer, step_latency;
  const std::string prefix = "ckpt-scale-" + std::to_string(::getpid()) + "-" + std::to_string(n);
  const std::string url = std::string("s3://") + kBucket + "/" + prefix;
  const std::string work = o.dir + "/ckptfs-s3-scale-" + std::to_string(::getpid());
  RepositoryConfig config;
  Check(Repository::Init(url, config, S3Only(s3)), "init");
  std::vector<std::unique_ptr<Repository>> hosts(n);
  {
    std::vector<std::thread> openers;
    for (int r = 0; r < n; ++r) {
      openers.emplace_back([&, r] { hosts[r] = OpenHost(url, work + "/" + std::to_string(n) + "-" + std::to_string(r), s3, 1); });
    }
    for (auto& t : openers) t.join();
  }
  // Rank r holds rows [16r, 16r+16) of a [16n, 1024] fp32 tensor: 64 KiB,
  // new bytes at every step.
  const uint64_t rows = 16, cols = 1024;
  const TensorInfo info{"w", DType::kF32, {rows * n, cols}};
  for (int step = 1; step <= o.steps; ++step) {
    std::vector<RankStep> result(n);
    std::barrier sync(n);
    auto t0 = Clock::now();
    std::vector<std::thread> ranks;
    for (int r = 0; r < n; ++r) {
      ranks.emplace_back([&, r] {
        std::vector<std::byte> data(rows * cols * 4);
        bench::Rng rng{uint64_t(step) * 1000003 + uint64_t(r)};
        for (size_t i = 0; i + 8 <= data.size(); i += 8) {
          uint64_t v = rng.Next();
          std::memcpy(&data[i], &v, 8);
        }
        sync.arrive_and_wait();
        const RequestCounts before = hosts[r]->store_requests();
        auto w = std::move(hosts[r]->BeginCheckpoint("step-" + std::to_string(step),
                                                     {uint32_t(r), uint32_t(n), step, {}}))
                     .value();
        HostSource src(data);
        Check(w->PutShard(info, Region::OfBox(Box{{rows * r, 0}, {rows, cols}}), src), "put");
        // The last rank commits once all others are in, alone: its commit
        // is the latency from the last rank done to the checkpoint visible.
        const bool last = r == n - 1;
        if (last) sync.arrive_and_wait();
        result[r].commit_start = Clock::now();
        auto done = w->Commit().Wait();
        result[r].commit_end = Clock::now();
        if (!last) sync.arrive_and_wait();
        Check(done.status(), "commit");
        result[r].committed = done->checkpoint_visible;
        result[r].requests = hosts[r]->store_requests() - before;
      });
    }
    for (auto& t : ranks) t.join();
    const double wall = Seconds(t0);
    Clock::time_point last_start = result[0].commit_start, last_end = result[0].commit_end;
    std::vector<double> others;
    double committer = 0, max_other = 0;
    int committers = 0;
    RequestCounts committer_counts;
    for (const auto& s : result) {
      last_start = std::max(last_start, s.commit_start);
      last_end = std::max(last_end, s.commit_end);
      if (s.committed) {
        ++committers;
        committer = std::max(committer, double(s.requests.total()));
        committer_counts = s.requests;
      } else {
        others.push_back(double(s.requests.total()));
        max_other = std::max(max_other, double(s.requests.total()));
      }
    }
    (void)last_start;
    const auto& final_rank = result[n - 1];
    const double latency_ms =
        std::chrono::duration<double, std::milli>(final_rank.commit_end - final_rank.commit_start).count();
    std::printf("%3d ranks, step %d: requests per rank %5.1f median, %3.0f max (ranks that did not commit); "
                "committer %4.0f (GET %llu, LIST %llu, PUT %llu, DELETE %llu, HEAD %llu); "
                "commit latency %7.1f ms; step %.2f s; %d committer(s)\n",
                n, step, others.empty() ? 0.0 : Median(others), max_other, committer,
                static_cast<unsigned long long>(committer_counts.get), static_cast<unsigned long long>(committer_counts.list),
                static_cast<unsigned long long>(committer_counts.put), static_cast<unsigned long long>(committer_counts.del),
                static_cast<unsigned long long>(committer_counts.head), latency_ms, wall, committers);
    std::fflush(stdout);
    step_requests.push_back(others.empty() ? committer : Median(others));
    step_committer.push_back(committer);
    step_latency.push_back(latency_ms);
  }
  // Every step is visible, complete, on a host that saw none of it.
  auto fresh = OpenHost(url, work + "/" + std::to_string(n) + "-fresh", s3, 0);
  auto list = std::move(fresh->ListCheckpoints()).value();
  if (list.size() != size_t(o.steps)) {
    std::fprintf(stderr, "expected %d checkpoints, found %zu\n", o.steps, list.size());
    std::exit(1);
  }
  auto reader = std::move(fresh->OpenCheckpoint("step-" + std::to_string(o.steps))).value();
  std::vector<std::byte> all(rows * n * cols * 4);
  Check(reader->ReadBytes(*reader->GetTensor("w").value(), 0, all), "read back");
  reader.reset();
  fresh.reset();
  hosts.clear();
  RemovePrefix(s3, prefix);
  std::filesystem::remove_all(work);
  return {n, Median(step_requests), Median(step_committer), Median(step_latency)};
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&] { return bench::NextArg(argc, argv, i); };
    if (a == "--gib") o.gib = std::atof(next().c_str());
    else if (a == "--runs") o.runs = std::atoi(next().c_str());
    else if (a == "--save-ranks") o.save_ranks = std::atoi(next().c_str());
    else if (a == "--load-ranks") o.load_ranks = std::atoi(next().c_str());
    else if (a == "--get-threads") o.get_threads = std::atoi(next().c_str());
    else if (a == "--load-threads") o.load_threads = std::atoi(next().c_str());
    else if (a == "--scale") o.scale = bench::ParseIntList(next());
    else if (a == "--steps") o.steps = std::atoi(next().c_str());
    else if (a == "--scale-only") o.transfers = false;
    else if (a == "--dir") o.dir = next();
    else {
      std::printf(
          "usage: s3_checkpoint_bench [--gib N] [--runs N] [--save-ranks N] [--load-ranks N] [--get-threads N]\n"
          "                           [--load-threads N] [--scale 1,8,32,64] [--steps N] [--scale-only] [--dir DIR]\n"
          "Saves and loads a checkpoint on S3 through the repository against s3cmd and ranged GETs of\n"
          "the same bytes, then saves small shards from 1..64 ranks (hosts) and reports S3 requests per\n"
          "rank and commit latency. --scale '' skips that part. Server: AWS_ENDPOINT_URL,\n"
          "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY.\n");
      return a == "--help" || a == "-h" ? 0 : 2;
    }
  }
  auto s3 = ObjectStoreOptions::FromEnvironment(std::getenv);
  Check(s3.status(), "S3 settings");
  Check(OpenObjectStore(std::string("s3://") + kBucket, *s3, /*create=*/true).status(), "create bucket");
  if (o.transfers) TransferRuns(o, *s3);
  if (!o.scale.empty()) {
    std::printf("scale: each rank a host with its own catalog, 64 KiB of new bytes per rank and step, %d steps\n",
                o.steps);
  }
  std::vector<ScaleFigures> figures;
  for (int n : o.scale) figures.push_back(ScaleRun(o, *s3, n));
  if (!figures.empty()) {
    // Growth against the smallest run with more than one rank (one rank
    // commits without reading any other).
    const ScaleFigures* base = &figures[0];
    for (const auto& f : figures) {
      if (f.ranks > 1) {
        base = &f;
        break;
      }
    }
    auto nlogn = [](double n) { return n * std::max(1.0, std::log2(n)); };
    std::printf("\nmedian over %d steps:\n  ranks  requests/rank  committer  commit latency  latency vs %d ranks"
                "  N log N vs %d ranks\n",
                o.steps, base->ranks, base->ranks);
    for (const auto& f : figures) {
      std::printf("  %5d  %13.1f  %9.0f  %11.1f ms  %19.2f  %19.2f\n", f.ranks, f.requests_per_rank,
                  f.committer_requests, f.latency_ms, f.latency_ms / base->latency_ms,
                  nlogn(f.ranks) / nlogn(base->ranks));
    }
  }
  return 0;
}
