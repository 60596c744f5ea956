// A restart storm: N ranks restore one checkpoint from S3 at once, through
// a proxy of the project's own that throttles requests above a set rate
// (503 SlowDown, or 429 with --mode 429), as S3's per-prefix request limits
// and smaller providers' per-bucket limits do.
//
// The checkpoint (--mib of f32 rows in --save-ranks row shards, 1 MiB
// chunks in 8 MiB packs) is saved without the proxy. Then, for each rank
// count, the ranks (threads of this process, each a host with its own
// catalog, joined by the engine's in-process host group) restore their
// rows at that world size, twice:
//
//   collective: OpenCollective, then LoadCollective (one listing, one read
//               lease and each pack index read once per job; each chunk
//               fetched once and handed to the ranks needing it);
//   alone:      each rank opens the repository and reads its rows itself,
//               as a job without ckptfs's collective restore does.
//
// For each it reports the time to restore (open and load), for a
// collective one the planning time (the longest any rank waited for its
// part of the plan, and rank 0's time making it), requests
// answered per rank, LIST pages per restart, bytes downloaded at the wire
// (headers, listings and indexes included) over the bytes stored,
// requests throttled (each retried with backoff and jitter by the client),
// and whether every rank's rows came back bit-exact.
//
//   eval "$(tools/s3-server.sh start /tmp/s3)"
//   build/tools/restart_storm_bench --ranks 64,256,512 --rate 2000
//
// The server comes from AWS_ENDPOINT_URL and the credentials from
// AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY.
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "backend/store_url.h"
#include "bench_util.h"
#include "ckpt/collective.h"
#include "ckpt/repository.h"
#include "fault_proxy.h"

using namespace ckptfs;
using bench::Check;
using bench::Seconds;
using Clock = std::chrono::steady_clock;
using Fault = testing::FaultProxy::Fault;

namespace {

constexpr const char* kBucket = "ckptfs-bench";

struct Options {
  std::vector<int> ranks = {64, 256, 512};
  double rate = 2000;  // requests a second the proxy lets through
  double burst = 200;
  Fault mode = Fault::kServiceUnavailable;
  double mib = 64;
  int save_ranks = 8;
  bool alone = true;
  std::string dir = "/tmp";
};


struct Figures {
  double seconds = 0, open_seconds = 0;
  // Collective only: the longest any rank waited for its part of the plan
  // (from its LoadCollective call), and rank 0's time making it.
  double plan_seconds = 0, plan_make_seconds = 0;
  double requests_per_rank = 0;
  uint64_t lists = 0;
  double down_over_stored = 0;
  int throttled = 0;
  int exact = 0;
  std::string error;
};

OpenOptions HostOptions(const ObjectStoreOptions& s3, const std::string& cache_dir, int proxy_port) {
  OpenOptions o;
  o.cache_dir = cache_dir;
  o.threads = 1;
  o.io_threads = 2;
  o.cache_bytes = 4 << 20;
  o.s3 = s3;
  o.s3->endpoint = "http://127.0.0.1:" + std::to_string(proxy_port);
  o.s3->reuse_connections = false;  // the proxy throttles per connection
  return o;
}

// One restore of `rows` x `cols` f32 rows by `n` ranks; `collective` or each alone.
Figures Restore(const Options& opt, const ObjectStoreOptions& s3, const std::string& url, int upstream, int n,
                bool collective, uint64_t rows, uint64_t cols, const std::vector<std::byte>& w, uint64_t stored) {
  testing::RateLimit limit(opt.rate, opt.burst);
  testing::FaultProxy proxy(upstream, [&](int) { return limit.Admit() ? Fault::kNone : opt.mode; });
  const std::string caches = opt.dir + "/ckptfs-storm-" + std::to_string(::getpid()) + "-" + std::to_string(n);
  std::vector<std::unique_ptr<Repository>> repos(n);
  std::vector<std::string> errors(n);
  std::vector<double> opened(n), planned(n), made(n);
  std::atomic<int> exact{0};
  auto comms = collective ? NewHostGroup(n) : std::vector<std::unique_ptr<Communicator>>{};
  const auto t0 = Clock::now();
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      const OpenOptions o = HostOptions(s3, caches + "/host" + std::to_string(r), proxy.port());
      auto repo = collective ? OpenCollective(url, o, *comms[r]) : Repository::Open(url, o);
      opened[r] = Seconds(t0);
      if (!repo.ok()) {
        errors[r] = "open: " + repo.status().ToString();
        return;
      }
      repos[r] = std::move(repo).value();
      const uint64_t first = r * rows / n, count = (r + 1) * rows / n - first;
      std::vector<std::byte> got(count * cols * 4);
      Status st;
      if (collective) {
        std::vector<CollectiveTarget> targets = {
            {{"w", DType::kF32, {rows, cols}}, Region::OfBox(Box{{first, 0}, {count, cols}}), got}};
        auto loaded = LoadCollective(*repos[r], "s", targets, *comms[r]);
        st = loaded.status();
        if (loaded.ok()) {
          planned[r] = loaded->plan_seconds;
          made[r] = loaded->plan_make_seconds;
        }
      } else {
        auto reader = repos[r]->OpenCheckpoint("s");
        st = reader.status();
        if (st.ok() && count) st = (*reader)->ReadBox(*(*reader)->FindTensor("w"), Box{{first, 0}, {count, cols}}, got);
      }
      if (!st.ok()) {
        errors[r] = "load: " + st.ToString();
        return;
      }
      if (std::equal(got.begin(), got.end(), w.begin() + first * cols * 4)) ++exact;
    });
  }
  for (auto& t : threads) t.join();
  Figures f;
  f.seconds = Seconds(t0);
  f.open_seconds = *std::max_element(opened.begin(), opened.end());
  f.plan_seconds = *std::max_element(planned.begin(), planned.end());
  f.plan_make_seconds = made[0];
  for (int r = 0; r < n; ++r) {
    if (!errors[r].empty() && f.error.empty()) f.error = "rank " + std::to_string(r) + ": " + errors[r];
    if (repos[r]) f.lists += repos[r]->store_requests().list;
  }
  f.requests_per_rank = double(proxy.connections() - proxy.faults()) / n;
  f.down_over_stored = double(proxy.bytes_down()) / double(stored);
  f.throttled = proxy.faults();
  f.exact = exact.load();
  repos.clear();
  std::filesystem::remove_all(caches);
  return f;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&] { return bench::NextArg(argc, argv, i); };
    if (a == "--ranks") o.ranks = bench::ParseIntList(next());
    else if (a == "--rate") o.rate = std::atof(next().c_str());
    else if (a == "--burst") o.burst = std::atof(next().c_str());
    else if (a == "--mode") o.mode = next() == "429" ? Fault::kTooManyRequests : Fault::kServiceUnavailable;
    else if (a == "--mib") o.mib = std::atof(next().c_str());
    else if (a == "--save-ranks") o.save_ranks = std::atoi(next().c_str());
    else if (a == "--collective-only") o.alone = false;
    else if (a == "--dir") o.dir = next();
    else {
      std::printf("usage: restart_storm_bench [--ranks 64,256,512] [--rate REQ/S] [--burst N] [--mode 503|429]\n"
                  "                           [--mib 64] [--save-ranks 8] [--collective-only] [--dir /tmp]\n");
      return a == "--help" || a == "-h" ? 0 : 2;
    }
  }
  // Every rank is a thread with a few of its own: 512 ranks need more
  // descriptors than the usual soft limit.
  rlimit files{};
  ::getrlimit(RLIMIT_NOFILE, &files);
  files.rlim_cur = files.rlim_max;
  ::setrlimit(RLIMIT_NOFILE, &files);

  auto s3 = ObjectStoreOptions::FromEnvironment(std::getenv);
  Check(s3.status(), "S3 settings");
  Check(OpenObjectStore(std::string("s3://") + kBucket, *s3, /*create=*/true).status(), "create bucket");
  const int upstream = std::atoi(s3->endpoint.substr(s3->endpoint.rfind(':') + 1).c_str());
  const std::string prefix = "storm-" + std::to_string(::getpid());
  const std::string url = std::string("s3://") + kBucket + "/" + prefix;
  RepositoryConfig config;
  config.chunk_size = 1 << 20;
  config.pack_size = 8 << 20;
  OpenOptions plain;
  plain.s3 = *s3;
  plain.cache_dir = o.dir + "/ckptfs-storm-" + std::to_string(::getpid()) + "-writer";
  Check(Repository::Init(url, config, plain), "init");
  const uint64_t cols = 4096;
  const uint64_t rows = std::max<uint64_t>(512, static_cast<uint64_t>(o.mib * (1 << 20)) / (cols * 4));
  std::vector<std::byte> w(rows * cols * 4);
  // Random bits: the codec stores them raw, so stored bytes are the rows'.
  uint64_t x = 0x9e3779b97f4a7c15ull;
  for (size_t i = 0; i + 8 <= w.size(); i += 8) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    std::memcpy(w.data() + i, &x, 8);
  }
  uint64_t stored = 0;
  {
    auto writer = std::move(Repository::Open(url, plain)).value();
    for (int r = 0; r < o.save_ranks; ++r) {
      WriterOptions wo;
      wo.rank = static_cast<uint32_t>(r);
      wo.world_size = static_cast<uint32_t>(o.save_ranks);
      auto put = std::move(writer->BeginCheckpoint("s", wo)).value();
      const uint64_t first = r * rows / o.save_ranks, count = (r + 1) * rows / o.save_ranks - first;
      HostSource src(std::span<const std::byte>(w).subspan(first * cols * 4, count * cols * 4));
      Check(put->PutShard({"w", DType::kF32, {rows, cols}}, Region::OfBox(Box{{first, 0}, {count, cols}}), src), "put");
      Check(put->Commit().Wait().status(), "commit");
    }
    stored = std::move(writer->DiskUsage({})).value().referenced_bytes;
  }
  std::filesystem::remove_all(plain.cache_dir);
  std::printf("checkpoint: %.0f MiB of f32 (%llu rows), saved by %d ranks; %.1f MiB stored in 1 MiB chunks, "
              "8 MiB packs\nproxy: %.0f requests/s (bursts of %.0f), above it %s\n\n",
              double(w.size()) / (1 << 20), static_cast<unsigned long long>(rows), o.save_ranks,
              double(stored) / (1 << 20), o.rate, o.burst,
              o.mode == Fault::kTooManyRequests ? "429 Too Many Requests" : "503 SlowDown");
  std::printf("%6s %-11s %9s %8s %8s %8s %10s %7s %12s %10s %10s\n", "ranks", "restore", "time s", "open s",
              "plan s", "make s", "req/rank", "LISTs", "down/stored", "throttled", "bit-exact");
  int failures = 0;
  for (int n : o.ranks) {
    for (bool collective : {true, false}) {
      if (!collective && !o.alone) continue;
      const Figures f = Restore(o, *s3, url, upstream, n, collective, rows, cols, w, stored);
      char plan[32] = "-", make[32] = "-";
      if (collective) {
        std::snprintf(plan, sizeof plan, "%.2f", f.plan_seconds);
        std::snprintf(make, sizeof make, "%.3f", f.plan_make_seconds);
      }
      std::printf("%6d %-11s %9.2f %8.2f %8s %8s %10.1f %7llu %12.3f %10d %6d/%-4d%s\n", n,
                  collective ? "collective" : "alone", f.seconds, f.open_seconds, plan, make, f.requests_per_rank,
                  static_cast<unsigned long long>(f.lists), f.down_over_stored, f.throttled, f.exact, n,
                  f.error.empty() ? "" : ("  " + f.error).c_str());
      std::fflush(stdout);
      failures += f.exact != n;
    }
  }
  bench::RemovePrefix(*s3, kBucket, prefix);
  return failures ? 1 : 0;
}
