// ckpt copy (CopyCheckpoints) between a local repository and S3, against a
// plain transfer of the same repository's objects in the same run:
//
//   first copy: a local repository holding two steps of LLM-like state
//        (llm_state.h, saved by 4 ranks; the second step shares ~90 % of
//        its chunks with the first) copied whole to a fresh S3 prefix,
//        timed from opening the destination to the last checkpoint
//        visible; against `s3cmd sync` of the repository's objects/
//        directory (the same packs and manifests) to another fresh prefix.
//   incremental: a destination that holds step 1 receives step 2: the
//        stored bytes sent, against step 2's stored bytes.
//
//   eval "$(tools/s3-server.sh start /tmp/s3)"
//   build/tools/copy_bench --gib 0.5 --runs 3
//
// The server comes from AWS_ENDPOINT_URL and the credentials from
// AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY; s3cmd (Debian package) must be
// on PATH.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
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
using bench::Seconds;
using Clock = std::chrono::steady_clock;

namespace {

constexpr const char* kBucket = "ckptfs-bench";
constexpr int kRanks = 4;

struct Options {
  double gib = 0.5;
  int runs = 3;
  double changed = 0.1;  // fraction of the tensors step 2 changes
  std::string dir = "/tmp";
};

void RemovePrefix(const ObjectStoreOptions& s3, const std::string& prefix) {
  bench::RemovePrefix(s3, kBucket, prefix);
}

void SaveStep(Repository& repo, const std::string& name, const std::vector<bench::Tensor>& state) {
  std::vector<std::thread> ranks;
  for (int r = 0; r < kRanks; ++r) {
    ranks.emplace_back([&, r] {
      auto boxes = bench::RankBoxes(state, r, kRanks);
      bench::SaveRank(repo, name, state, boxes, r, kRanks);
    });
  }
  for (auto& t : ranks) t.join();
}

OpenOptions S3Host(const ObjectStoreOptions& s3, const std::string& cache_dir) {
  OpenOptions o;
  o.s3 = s3;
  o.cache_dir = cache_dir;
  return o;
}

int Run(const Options& o, const ObjectStoreOptions& s3) {
  auto state = bench::BuildState(o.gib);
  uint64_t logical = 0;
  for (const auto& t : state) logical += t.bytes.size();
  const std::string work = o.dir + "/ckptfs-copy-bench-" + std::to_string(::getpid());
  std::filesystem::create_directories(work);
  const std::string local = work + "/local";
  Check(Repository::Init(local, RepositoryConfig{}), "init local");
  {
    auto repo = std::move(Repository::Open(local)).value();
    SaveStep(*repo, "step-1", state);
    // Step 2: every tenth tensor (the share `changed`) is trained on.
    const size_t every = std::max<size_t>(1, static_cast<size_t>(1 / o.changed));
    for (size_t i = 0; i < state.size(); i += every) {
      for (size_t b = 0; b < state[i].bytes.size(); b += 4096) state[i].bytes[b] ^= std::byte{1};
    }
    SaveStep(*repo, "step-2", state);
  }
  state.clear();
  auto source = std::move(Repository::Open(local)).value();
  auto usage = std::move(source->DiskUsage({"step-2"})).value();
  const uint64_t step2_stored = usage.checkpoints[0].referenced_bytes;
  const uint64_t objects_bytes = [&] {
    uint64_t n = 0;
    for (const auto& e : std::filesystem::recursive_directory_iterator(local + "/objects")) {
      if (e.is_regular_file()) n += e.file_size();
    }
    return n;
  }();
  std::printf("source: 2 checkpoints of %d ranks, %.2f GiB logical each, objects/ %.1f MiB (step 2 stores %.1f MiB "
              "and shares the rest); server %s\n",
              kRanks, logical / double(1 << 30), objects_bytes / 1048576.0, step2_stored / 1048576.0,
              s3.endpoint.c_str());
  const std::string s3cmd = bench::S3cmd(s3);
  bench::RunFigures fig;
  for (int run = 0; run < o.runs; ++run) {
    const std::string tag = std::to_string(::getpid()) + "-" + std::to_string(run);
    // First copy of the whole repository.
    const std::string prefix = "copy-bench-" + tag;
    const std::string url = std::string("s3://") + kBucket + "/" + prefix;
    Check(Repository::Init(url, RepositoryConfig{}, S3Host(s3, "")), "init s3");
    const long long faults0 = bench::MinorFaults(::getpid());
    auto t0 = Clock::now();
    uint64_t sent = 0;
    {
      auto dst = std::move(Repository::Open(url, S3Host(s3, work + "/cache-" + tag))).value();
      CopyOptions all;
      all.all = true;
      auto report = CopyCheckpoints(*source, *dst, all);
      Check(report.status(), "copy");
      sent = report->stored_bytes_sent;
    }
    const double t_copy = Seconds(t0);
    const long long faults = bench::MinorFaults(::getpid()) - faults0;
    RemovePrefix(s3, prefix);

    const std::string sync_prefix = "copy-bench-sync-" + tag;
    t0 = Clock::now();
    if (std::system((s3cmd + " sync " + local + "/objects/ s3://" + kBucket + "/" + sync_prefix + "/").c_str()) != 0) {
      std::fprintf(stderr, "s3cmd sync failed\n");
      return 1;
    }
    const double t_sync = Seconds(t0);
    RemovePrefix(s3, sync_prefix);

    // Incremental: the destination has step 1.
    const std::string inc_prefix = "copy-bench-inc-" + tag;
    const std::string inc_url = std::string("s3://") + kBucket + "/" + inc_prefix;
    Check(Repository::Init(inc_url, RepositoryConfig{}, S3Host(s3, "")), "init s3");
    uint64_t inc_sent = 0;
    double t_inc = 0;
    {
      auto dst = std::move(Repository::Open(inc_url, S3Host(s3, work + "/cache-inc-" + tag))).value();
      CopyOptions first;
      first.names = {"step-1"};
      Check(CopyCheckpoints(*source, *dst, first).status(), "copy step-1");
      CopyOptions second;
      second.names = {"step-2"};
      t0 = Clock::now();
      auto report = CopyCheckpoints(*source, *dst, second);
      t_inc = Seconds(t0);
      Check(report.status(), "copy step-2");
      inc_sent = report->stored_bytes_sent;
    }
    RemovePrefix(s3, inc_prefix);

    fig.Add("copy", objects_bytes / t_copy / 1e6);
    fig.Add("sync", objects_bytes / t_sync / 1e6);
    fig.Add("ratio", t_sync / t_copy);
    fig.Add("faults", faults / (objects_bytes / double(1 << 30)));
    fig.Add("inc", double(inc_sent) / step2_stored);
    fig.Add("inc_s", t_inc);
    std::printf("run %d: first copy %.2f s (%.0f MB/s, sent %.1f MiB, %.0f minor faults/GiB), s3cmd sync %.2f s "
                "(%.0f MB/s): %.2fx; step 2 onto step 1: sent %.1f MiB = %.3f of its stored bytes in %.2f s\n",
                run, t_copy, objects_bytes / t_copy / 1e6, sent / 1048576.0, faults / (objects_bytes / double(1 << 30)),
                t_sync, objects_bytes / t_sync / 1e6, t_sync / t_copy, inc_sent / 1048576.0,
                double(inc_sent) / step2_stored, t_inc);
  }
  std::printf("\nmedians of %d runs (MB/s of the repository's %.1f MiB of objects):\n", o.runs,
              objects_bytes / 1048576.0);
  std::printf("  ckpt copy, first, to S3   %6.0f MB/s   ratio to s3cmd sync %.2f   (target >= 1.0)\n",
              fig.Median("copy"), fig.Median("ratio"));
  std::printf("  s3cmd sync objects/       %6.0f MB/s\n", fig.Median("sync"));
  std::printf("  minor page faults / GiB   %6.0f\n", fig.Median("faults"));
  std::printf("  copy of step 2 onto step 1: sent %.3f of its stored bytes (target <= 0.15), %.2f s\n",
              fig.Median("inc"), fig.Median("inc_s"));
  source.reset();
  std::filesystem::remove_all(work);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--gib") o.gib = std::atof(bench::NextArg(argc, argv, i).c_str());
    else if (a == "--runs") o.runs = std::atoi(bench::NextArg(argc, argv, i).c_str());
    else if (a == "--changed") o.changed = std::atof(bench::NextArg(argc, argv, i).c_str());
    else if (a == "--dir") o.dir = bench::NextArg(argc, argv, i);
    else {
      std::fprintf(stderr,
                   "usage: copy_bench [--gib G] [--runs N] [--changed F] [--dir DIR]\n"
                   "Copies a local repository to S3 with CopyCheckpoints against s3cmd sync of its objects,\n"
                   "and a checkpoint onto its predecessor (bytes sent).\n");
      return a == "--help" || a == "-h" ? 0 : 2;
    }
  }
  if (o.runs < 1 || o.gib <= 0 || o.changed <= 0 || o.changed > 1) {
    std::fprintf(stderr, "copy_bench: --runs, --gib and --changed (0 < F <= 1) must be positive\n");
    return 2;
  }
  auto s3 = ObjectStoreOptions::FromEnvironment(std::getenv);
  Check(s3.status(), "S3 settings (AWS_ENDPOINT_URL and credentials)");
  return Run(o, *s3);
}
