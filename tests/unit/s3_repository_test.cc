// Repositories on S3 through the engine's API: "hosts" are Repository
// objects with cache directories of their own, in one process, sharing only
// the S3 server (and, for the fault tests, a proxy in front of it that
// breaks requests mid-save). Needs the S3 server the AWS_* variables name.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <atomic>
#include <barrier>
#include <thread>
#include <cstdlib>
#include <cstring>

#include "backend/s3_backend.h"
#include "ckpt/collective.h"
#include "ckpt/lease.h"
#include "ckpt/repository.h"
#include "core/random.h"
#include "fault_proxy.h"
#include "test_backends.h"
#include "test_util.h"

namespace ckptfs {
namespace {

using testing::RandomBytes;
using testing::TempDir;
using Fault = testing::FaultProxy::Fault;

class S3Repository : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    auto o = testing::S3TestOptions(&why);
    CKPTFS_SKIP_UNLESS(o, why);
    s3_ = *o;
    url_ = "s3://ckptfs-test/repo-" + RandomHex(10);
    RepositoryConfig config;
    config.chunk_size = 64 << 10;
    config.pack_size = 256 << 10;
    OpenOptions init;
    init.s3 = s3_;
    ASSERT_OK(Repository::Init(url_, config, init));
  }

  // A host: its own cache directory; `endpoint_port` routes through a proxy.
  // Checkpoint `name`, opened on `repo`, holds `want` as its tensor "w".
  static void ExpectTensorW(Repository& repo, const std::string& name, const std::vector<std::byte>& want) {
    auto reader = repo.OpenCheckpoint(name);
    ASSERT_OK(reader);
    std::vector<std::byte> got(want.size());
    ASSERT_OK((*reader)->ReadBytes(*(*reader)->GetTensor("w").value(), 0, got));
    EXPECT_EQ(got, want);
  }
  std::unique_ptr<Repository> Host(const std::string& name, int endpoint_port = 0, bool opening_sync = true) {
    OpenOptions o;
    o.cache_dir = dir_.path() + "/" + name;
    o.threads = 2;
    o.s3 = s3_;
    o.opening_sync = opening_sync;
    if (endpoint_port) {
      o.s3->endpoint = "http://127.0.0.1:" + std::to_string(endpoint_port);
      o.s3->reuse_connections = false;  // the proxy's plan is per connection
      o.s3->max_retries = 3;
      o.s3->throttle_wait_s = 0;  // some plans answer 503 forever
    }
    auto r = Repository::Open(url_, o);
    EXPECT_OK(r);
    return r.ok() ? std::move(r).value() : nullptr;
  }

  // Ranks 0 (on `zero`, sharing its store listing) and 1 (on `one`) of a
  // `world`-rank save whose commit is split (WriterOptions::await_ranks).
  using Begun = Result<std::unique_ptr<CheckpointWriter>>;
  std::pair<Begun, Begun> BeginSplit(Repository& zero, Repository& one, const std::string& name, uint32_t world,
                                     std::chrono::milliseconds await, const std::string& attempt = "") {
    std::string listing;
    WriterOptions first{.rank = 0, .world_size = world};
    first.share_sync = &listing;
    first.await_ranks = await;
    first.attempt = attempt;
    Begun w0 = zero.BeginCheckpoint(name, first);
    WriterOptions second{.rank = 1, .world_size = world};
    second.shared_sync = &listing;
    second.await_ranks = await;
    second.attempt = attempt;
    Begun w1 = w0.ok() ? one.BeginCheckpoint(name, second) : Begun(w0.status());
    return {std::move(w0), std::move(w1)};
  }

  int UpstreamPort() const { return std::atoi(s3_.endpoint.substr(s3_.endpoint.rfind(':') + 1).c_str()); }

  // Rank r of `world` saves rows [r*rows/world, (r+1)*rows/world) of `w`.
  Status SaveRows(Repository& repo, const std::string& name, uint32_t r, uint32_t world,
                  const std::vector<std::byte>& w, uint64_t rows, uint64_t cols) {
    CKPT_ASSIGN_OR_RETURN(auto writer, repo.BeginCheckpoint(name, {.rank = r, .world_size = world}));
    const uint64_t begin = r * rows / world, end = (r + 1) * rows / world;
    HostSource src(std::span<const std::byte>(w).subspan(begin * cols * 4, (end - begin) * cols * 4));
    Box box{{begin, 0}, {end - begin, cols}};
    CKPT_RETURN_IF_ERROR(writer->PutShard({"w", DType::kF32, {rows, cols}}, Region::OfBox(box), src));
    return writer->Commit().Wait().status();
  }

  TempDir dir_;
  ObjectStoreOptions s3_;
  std::string url_;
};

TEST_F(S3Repository, RanksOnThreeHostsAreReadAtAnotherShardingOnAFourth) {
  const uint64_t rows = 96, cols = 1000;
  auto w = RandomBytes(rows * cols * 4, 7);
  auto a = Host("a"), b = Host("b"), c = Host("c");
  ASSERT_TRUE(a && b && c);
  ASSERT_OK(SaveRows(*a, "s", 0, 3, w, rows, cols));
  ASSERT_OK(SaveRows(*b, "s", 1, 3, w, rows, cols));
  EXPECT_TRUE(a->ListCheckpoints().value().empty());
  ASSERT_OK(SaveRows(*c, "s", 2, 3, w, rows, cols));
  auto d = Host("d");
  auto reader = d->OpenCheckpoint("s");
  ASSERT_OK(reader);
  auto t = (*reader)->GetTensor("w");
  ASSERT_OK(t);
  // columns split in two: another sharding than the rows the ranks saved
  for (uint64_t half = 0; half < 2; ++half) {
    std::vector<std::byte> out(rows * (cols / 2) * 4);
    ASSERT_OK((*reader)->ReadBox(**t, Box{{0, half * cols / 2}, {rows, cols / 2}}, out));
    for (uint64_t i = 0; i < rows; ++i) {
      ASSERT_EQ(std::memcmp(out.data() + i * (cols / 2) * 4, w.data() + (i * cols + half * cols / 2) * 4, cols / 2 * 4), 0)
          << "row " << i;
    }
  }
  // the other hosts see it after a refresh
  ASSERT_OK(a->Refresh());
  EXPECT_EQ(a->ListCheckpoints().value().size(), 1u);
}

TEST_F(S3Repository, AHostsSyncDoesNotReadTheRanksOfCheckpointsInFlight) {
  // A save's requests must not grow with the number of ranks saving at
  // the same time: a host that knows a pending checkpoint reads none of
  // its new ranks' objects, only the LISTs and the indexes of new packs.
  const uint64_t rows = 8, cols = 1024;
  auto w = RandomBytes(rows * cols * 4, 6);
  auto a = Host("a");
  ASSERT_TRUE(a);
  ASSERT_OK(SaveRows(*a, "s", 0, 8, w, rows, cols));
  std::atomic<int> requests{0};
  testing::FaultProxy counter(UpstreamPort(), [&](int) {
    ++requests;
    return Fault::kNone;
  });
  auto b = Host("b", counter.port());
  ASSERT_TRUE(b);
  ASSERT_EQ(b->ListCheckpoints(true).value().size(), 1u);  // pending, known now
  for (uint32_t r = 1; r < 7; ++r) ASSERT_OK(SaveRows(*a, "s", r, 8, w, rows, cols));  // one pack each
  requests = 0;
  ASSERT_OK(b->Refresh());
  // LIST pending/, manifests/, packs/: no rank object, and no index of the
  // new packs (read when a checkpoint is opened).
  EXPECT_EQ(requests.load(), 3);
  auto pending = b->ListCheckpoints(true).value();
  ASSERT_EQ(pending.size(), 1u);
  EXPECT_EQ(pending[0].committed_ranks, (std::vector<uint32_t>{0, 1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(pending[0].state, CheckpointState::kPending);
}

TEST_F(S3Repository, ASaveReadsNoIndexOfOtherHostsPacksAndAReaderReadsThemOnce) {
  // At every step each rank would otherwise read the new packs of every
  // other rank: requests per rank growing with the world size.
  const uint64_t rows = 8, cols = 1024;
  auto w = RandomBytes(rows * cols * 4, 11);
  auto a = Host("a"), b = Host("b");
  ASSERT_TRUE(a && b);
  for (uint32_t r = 0; r < 4; ++r) ASSERT_OK(SaveRows(*a, "step-1", r, 4, w, rows, cols));  // 4 packs
  // b's next save, as one rank of two: a shared lock, a sync (LISTs, and
  // a GET of the new manifest), its pack, its rank record, a LIST of the
  // ranks in; no GET of a's 4 packs. (The last rank in, which commits,
  // reads the packs: the committer's cost grows with the ranks.)
  const RequestCounts before = b->store_requests();
  ASSERT_OK(SaveRows(*b, "b-step-1", 0, 2, w, rows, cols));
  const RequestCounts save = b->store_requests() - before;
  EXPECT_EQ(save.get, 1u) << "only the new manifest";
  EXPECT_LE(save.total(), 16u);
  // Reading a's checkpoint reads the indexes of the packs the last sync
  // listed, once (3 requests each), listing nothing; its read lease is a
  // PUT and a HEAD of the manifest (lease.h).
  RequestCounts mark = b->store_requests();
  auto reader = b->OpenCheckpoint("step-1");
  ASSERT_OK(reader);
  const RequestCounts open = b->store_requests() - mark;
  EXPECT_EQ(open.list, 0u);
  EXPECT_EQ(open.total(), 4u * 3 + 2);
  std::vector<std::byte> out(w.size());
  ASSERT_OK((*reader)->ReadBytes(*(*reader)->GetTensor("w").value(), 0, out));
  EXPECT_EQ(out, w);
  // Opened again (the lease held): one HEAD of the manifest, which says
  // the catalog's record is still the store's.
  mark = b->store_requests();
  ASSERT_OK(b->OpenCheckpoint("step-1"));
  EXPECT_EQ((b->store_requests() - mark).total(), 1u);
  EXPECT_EQ((b->store_requests() - mark).head, 1u);
  // verify on a host that never read them finds every chunk.
  auto c = Host("c");
  auto report = c->Verify(std::nullopt);
  ASSERT_OK(report);
  EXPECT_TRUE(report->ok());
  EXPECT_EQ(report->checkpoints, 1u);  // b-step-1 waits for its second rank
}

TEST_F(S3Repository, RanksCommittingAtTheSameInstantCommitOnce) {
  // Ranks released together all see every rank in; the claim lets exactly
  // one of them merge and write the manifest, at every step.
  constexpr uint32_t kRanks = 8;
  const uint64_t rows = 16, cols = 1024;
  std::vector<std::unique_ptr<Repository>> hosts;
  for (uint32_t r = 0; r < kRanks; ++r) {
    hosts.push_back(Host("h" + std::to_string(r)));
    ASSERT_TRUE(hosts.back());
  }
  for (int step = 1; step <= 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const std::string name = "step-" + std::to_string(step);
    auto w = RandomBytes(rows * cols * 4, 100 + step);
    std::vector<std::unique_ptr<CheckpointWriter>> writers(kRanks);
    for (uint32_t r = 0; r < kRanks; ++r) {
      auto begun = hosts[r]->BeginCheckpoint(name, {.rank = r, .world_size = kRanks});
      ASSERT_OK(begun);
      writers[r] = std::move(begun).value();
      const uint64_t begin = r * rows / kRanks, end = (r + 1) * rows / kRanks;
      HostSource src(std::span<const std::byte>(w).subspan(begin * cols * 4, (end - begin) * cols * 4));
      ASSERT_OK(writers[r]->PutShard({"w", DType::kF32, {rows, cols}}, Region::OfBox(Box{{begin, 0}, {end - begin, cols}}),
                                     src));
    }
    std::barrier start(kRanks);
    std::vector<Result<CommitResult>> results(kRanks, Status::Internal("not run"));
    std::vector<RequestCounts> before(kRanks), cost(kRanks);
    for (uint32_t r = 0; r < kRanks; ++r) before[r] = hosts[r]->store_requests();
    std::vector<std::thread> ranks;
    for (uint32_t r = 0; r < kRanks; ++r) {
      ranks.emplace_back([&, r] {
        start.arrive_and_wait();
        results[r] = writers[r]->Commit().Wait();
        cost[r] = hosts[r]->store_requests() - before[r];
      });
    }
    for (auto& t : ranks) t.join();
    int visible = 0;
    for (uint32_t r = 0; r < kRanks; ++r) {
      ASSERT_OK(results[r]);
      visible += results[r]->checkpoint_visible;
      // A commit's requests: a rank's own few, plus about five per rank
      // for the committer (each rank object read, then it and the rank's
      // started- object removed, each with a HEAD and a DELETE). Losing
      // the claim costs two more, no merge, and a HEAD of the manifest
      // each poll until the committer has published it (polls 10 ms
      // doubling to a second: about a dozen while a committer under a
      // sanitizer takes a second or two). A loser reads the claim to see
      // whose it is: once, or twice when the committer let go of it and
      // another late rank claimed meanwhile (seen once in 20 runs under
      // TSan); never a rank object.
      if (results[r]->checkpoint_visible) {
        EXPECT_LE(cost[r].total(), 5 * kRanks + 24) << "committer, rank " << r;
      } else {
        EXPECT_LE(cost[r].total(), 28u) << "rank " << r;
        EXPECT_LE(cost[r].head, 18u) << "rank " << r;
        EXPECT_LE(cost[r].get, 2u) << "rank " << r << " read rank objects without committing";
      }
    }
    EXPECT_EQ(visible, 1);
    auto fresh = Host("fresh-" + std::to_string(step));
    auto reader = fresh->OpenCheckpoint(name);
    ASSERT_OK(reader);
    std::vector<std::byte> out(w.size());
    ASSERT_OK((*reader)->ReadBytes(*(*reader)->GetTensor("w").value(), 0, out));
    EXPECT_EQ(out, w);
    EXPECT_TRUE(fresh->ListCheckpoints(true).value().size() == size_t(step));  // nothing left pending
  }
}

TEST_F(S3Repository, GcOnAHostThatNeverSawAPendingCheckpointKeepsItsRanks) {
  const uint64_t rows = 48, cols = 1024;
  auto w = RandomBytes(rows * cols * 4, 5);
  auto a = Host("a");
  ASSERT_TRUE(a);
  ASSERT_OK(SaveRows(*a, "s", 0, 3, w, rows, cols));
  ASSERT_OK(SaveRows(*a, "s", 1, 3, w, rows, cols));
  {
    auto b = Host("b");  // knows "s" only by name until gc reads its ranks
    ASSERT_TRUE(b);
    auto report = b->CollectGarbage({});
    ASSERT_OK(report);
    EXPECT_EQ(report->packs_deleted, 0u);
    EXPECT_EQ(report->dead_chunks, 0u);
  }
  ASSERT_OK(SaveRows(*a, "s", 2, 3, w, rows, cols));
  auto c = Host("c");
  auto reader = c->OpenCheckpoint("s");
  ASSERT_OK(reader);
  std::vector<std::byte> out(w.size());
  ASSERT_OK((*reader)->ReadBytes(*(*reader)->GetTensor("w").value(), 0, out));
  EXPECT_EQ(out, w);
}

// The repository's objects/ as a plain store, to look at or plant objects.
std::unique_ptr<Backend> ObjectsOf(const std::string& url, const ObjectStoreOptions& s3) {
  const std::string prefix = url.substr(std::string("s3://ckptfs-test/").size()) + "/objects";
  return std::move(OpenS3Backend({"ckptfs-test", prefix}, s3)).value();
}

TEST_F(S3Repository, AReaderOnOneHostKeepsWhatRmAndGcOnAnotherWouldCollect) {
  const uint64_t rows = 32, cols = 1024;  // 2 chunks: x's first pack holds them and 2 of its own
  auto old_w = RandomBytes(rows * cols * 4, 7), new_w = RandomBytes(rows * cols * 4, 8);
  auto a = Host("a"), b = Host("b");
  ASSERT_TRUE(a && b);
  {
    // x's packs hold s0's chunks (deduplicated) beside bytes only x has.
    auto x = std::move(a->BeginCheckpoint("x", {})).value();
    ASSERT_OK(x->PutTensor({"w", DType::kF32, {rows, cols}}, old_w));
    auto own = RandomBytes(old_w.size(), 6);
    ASSERT_OK(x->PutTensor({"own", DType::kU8, {own.size()}}, own));
    ASSERT_OK(x->Commit().Wait());
  }
  ASSERT_OK(SaveRows(*a, "s0", 0, 1, old_w, rows, cols));
  ASSERT_OK(SaveRows(*a, "s1", 0, 1, new_w, rows, cols));
  ASSERT_OK(b->Refresh());
  auto reader = std::move(b->OpenCheckpoint("s0")).value();
  auto objects = ObjectsOf(url_, s3_);
  EXPECT_EQ(objects->List("leases/s0/").value().size(), 1u);  // one per host and checkpoint
  auto second = std::move(b->OpenCheckpoint("s0")).value();
  EXPECT_EQ(objects->List("leases/s0/").value().size(), 1u);
  second.reset();
  EXPECT_EQ(objects->List("leases/s0/").value().size(), 1u);  // the first reader still holds it

  ASSERT_OK(a->RemoveCheckpoints({"x", "s0"}));
  GcOptions o;
  o.rewrite_below = 0.99;
  auto r = a->CollectGarbage(o);
  ASSERT_OK(r);
  EXPECT_EQ(r->retired_kept, 1u);
  EXPECT_EQ(r->retired_collected, 1u);  // x: nobody reads it
  EXPECT_GT(r->packs_rewritten, 0u);
  EXPECT_TRUE(a->OpenCheckpoint("s0").status().IsNotFound());
  // b's catalog still names the old packs: the reader finds the moved chunks.
  std::vector<std::byte> out(old_w.size());
  ASSERT_OK(reader->ReadBytes(*reader->GetTensor("w").value(), 0, out));
  EXPECT_EQ(out, old_w);
  ASSERT_OK(b->Refresh());  // as a mount polls: the name is gone on b too
  EXPECT_TRUE(b->OpenCheckpoint("s0").status().IsNotFound());
  std::fill(out.begin(), out.end(), std::byte{0});
  ASSERT_OK(reader->ReadBytes(*reader->GetTensor("w").value(), 0, out));
  EXPECT_EQ(out, old_w);

  // The first gc after the reader went reclaims the space. The lease
  // lingers a few seconds first (a loop of short reads takes it once).
  reader.reset();
  EXPECT_EQ(objects->List("leases/s0/").value().size(), 1u);
  const auto deadline = std::chrono::steady_clock::now() + 3 * LeaseRegistry::kLinger;
  while (!objects->List("leases/").value().empty() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(objects->List("leases/").value().empty());
  const uint64_t before = a->DiskUsage({}).value().pack_bytes;
  r = a->CollectGarbage(o);
  ASSERT_OK(r);
  EXPECT_EQ(r->retired_collected, 1u);
  EXPECT_TRUE(objects->List("retired/").value().empty());
  auto u = a->DiskUsage({});
  ASSERT_OK(u);
  EXPECT_EQ(u->retired_bytes, 0u);
  EXPECT_GE(before - u->pack_bytes, old_w.size() / 2);  // random floats: stored about raw
  auto fresh = std::move(b->OpenCheckpoint("s1")).value();
  ASSERT_OK(fresh->ReadBytes(*fresh->GetTensor("w").value(), 0, out));
  EXPECT_EQ(out, new_w);
}

TEST_F(S3Repository, APendingCheckpointSaysWhereEachRankThatBeganRuns) {
  const uint64_t rows = 8, cols = 1024;
  auto w = RandomBytes(rows * cols * 4, 12);
  auto a = Host("a"), b = Host("b"), c = Host("c");
  ASSERT_TRUE(a && b && c);
  auto saving = std::move(a->BeginCheckpoint("s", {.rank = 0, .world_size = 3})).value();  // in progress
  ASSERT_OK(SaveRows(*b, "s", 1, 3, w, rows, cols));                                        // committed
  ASSERT_OK(c->Refresh());
  auto ranks = c->PendingRanks("s");
  ASSERT_OK(ranks);
  ASSERT_EQ(ranks->size(), 2u);  // rank 2 never began
  EXPECT_EQ((*ranks)[0].rank, 0u);
  EXPECT_FALSE((*ranks)[0].committed);
  EXPECT_EQ((*ranks)[0].pid, static_cast<uint64_t>(::getpid()));
  EXPECT_FALSE((*ranks)[0].host.empty());
  EXPECT_GT((*ranks)[0].started_unix_ms, 0u);
  EXPECT_EQ((*ranks)[1].rank, 1u);
  EXPECT_TRUE((*ranks)[1].committed);
  saving.reset();  // given up: it no longer shows as saving
  ASSERT_EQ(c->PendingRanks("s").value().size(), 1u);
  EXPECT_TRUE(c->PendingRanks("nope").status().IsNotFound());
  // Once committed, the records of where ranks ran are gone with the rank objects.
  ASSERT_OK(SaveRows(*a, "s", 0, 3, w, rows, cols));
  ASSERT_OK(SaveRows(*a, "s", 2, 3, w, rows, cols));
  EXPECT_TRUE(ObjectsOf(url_, s3_)->List("pending/").value().empty());
}

TEST_F(S3Repository, ALeaseNotRefreshedForTheStaleTimeIsIgnoredAndDeleted) {
  const uint64_t rows = 16, cols = 1024;
  auto w = RandomBytes(rows * cols * 4, 9);
  auto a = Host("a");
  ASSERT_TRUE(a);
  ASSERT_OK(SaveRows(*a, "s0", 0, 1, w, rows, cols));
  ASSERT_OK(SaveRows(*a, "s1", 0, 1, RandomBytes(rows * cols * 4, 10), rows, cols));
  auto objects = ObjectsOf(url_, s3_);
  // A host that crashed an hour ago while reading s0, and one reading now.
  auto lease = [](uint64_t at) {
    return "{\"host\":\"gone\",\"pid\":1,\"refreshed_unix_ms\":" + std::to_string(at) + "}";
  };
  const uint64_t now = static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                                 std::chrono::system_clock::now().time_since_epoch())
                                                 .count());
  const std::string crashed = lease(now - 3600 * 1000), alive = lease(now);
  ASSERT_OK(objects->Put("leases/s0/0123456789abcdef", std::as_bytes(std::span(crashed))));
  ASSERT_OK(objects->Put("leases/s1/fedcba9876543210", std::as_bytes(std::span(alive))));
  ASSERT_OK(a->RemoveCheckpoints({"s0", "s1"}));
  auto r = a->CollectGarbage({});
  ASSERT_OK(r);
  EXPECT_EQ(r->retired_collected, 1u);  // s0
  EXPECT_EQ(r->retired_kept, 1u);       // s1
  EXPECT_EQ(objects->List("leases/").value(), (std::vector<std::string>{"leases/s1/fedcba9876543210"}));
  EXPECT_EQ(objects->List("retired/").value().size(), 1u);
}

TEST_F(S3Repository, TransientFaultsMidSaveAreRetriedToSuccess) {
  const uint64_t rows = 64, cols = 4096;  // 1 MiB: 16 chunks, 4 packs per rank
  auto w = RandomBytes(rows * cols * 4, 8);
  const Fault kinds[] = {Fault::kServiceUnavailable, Fault::kResetBeforeAnswer, Fault::kCutAnswer};
  testing::FaultProxy proxy(UpstreamPort(), [&](int n) { return n % 3 == 2 ? kinds[(n / 3) % 3] : Fault::kNone; });
  {
    auto flaky = Host("flaky", proxy.port());
    ASSERT_TRUE(flaky);
    ASSERT_OK(SaveRows(*flaky, "s", 0, 2, w, rows, cols));
    ASSERT_OK(SaveRows(*flaky, "s", 1, 2, w, rows, cols));
  }
  auto clean = Host("clean");
  auto reader = clean->OpenCheckpoint("s");
  ASSERT_OK(reader);
  std::vector<std::byte> out(w.size());
  ASSERT_OK((*reader)->ReadBytes(*(*reader)->GetTensor("w").value(), 0, out));
  EXPECT_EQ(out, w);
  auto report = clean->Verify(std::nullopt);
  ASSERT_OK(report);
  EXPECT_TRUE(report->ok());
}

TEST_F(S3Repository, ASaveWhoseRequestsKeepFailingFailsCleanlyAndStaysInvisible) {
  const uint64_t rows = 64, cols = 4096;
  auto w = RandomBytes(rows * cols * 4, 9);
  // The store goes away after `healthy` connections, at different points
  // of the save: before, during and after the packs, and at the records.
  for (int healthy : {0, 2, 4, 6, 8, 10, 14}) {
    SCOPED_TRACE("store fails from connection " + std::to_string(healthy));
    const std::string name = "s" + std::to_string(healthy);
    // Counted from the first connection after the flaky host opened.
    std::atomic<int> seen{0}, fail_from{1 << 30};
    testing::FaultProxy proxy(UpstreamPort(), [&](int n) {
      seen = n + 1;
      return n < fail_from ? Fault::kNone : Fault::kServiceUnavailable;
    });
    auto good = Host("good-" + name);
    ASSERT_OK(SaveRows(*good, name, 0, 2, w, rows, cols));
    Status st;
    {
      auto flaky = Host("flaky-" + name, proxy.port());
      ASSERT_TRUE(flaky);
      fail_from = seen + healthy;
      st = SaveRows(*flaky, name, 1, 2, w, rows, cols);
    }
    auto fresh = Host("fresh-" + name);
    auto list = fresh->ListCheckpoints();
    ASSERT_OK(list);
    const bool visible = std::any_of(list->begin(), list->end(), [&](const auto& c) { return c.name == name; });
    if (st.ok()) {
      EXPECT_TRUE(visible);
    } else {
      EXPECT_FALSE(visible) << st.message();
      EXPECT_NE(st.message().find("127.0.0.1"), std::string::npos) << st.message();
    }
    auto report = fresh->Verify(std::nullopt);
    ASSERT_OK(report);
    EXPECT_TRUE(report->ok());
  }
}

// A store that throttles (503 SlowDown past every retry) is an error, never
// "no checkpoints" or "not found": a host opening through it fails, a host
// whose listing is throttled keeps what its catalog knew, and a reader's
// check of a name it knows fails rather than calling the name removed.
TEST_F(S3Repository, AThrottledListingIsNeverTakenAsNoCheckpointsOrNotFound) {
  const uint64_t rows = 16, cols = 1024;
  auto w = RandomBytes(rows * cols * 4, 10);
  auto writer = Host("writer");
  ASSERT_OK(SaveRows(*writer, "a", 0, 1, w, rows, cols));
  ASSERT_OK(SaveRows(*writer, "b", 0, 1, w, rows, cols));
  std::atomic<int> seen{0}, throttle_from{1 << 30};
  testing::FaultProxy proxy(UpstreamPort(), [&](int n) {
    seen = n + 1;
    return n < throttle_from ? Fault::kNone : Fault::kServiceUnavailable;
  });
  auto host = Host("throttled", proxy.port());
  ASSERT_TRUE(host);
  ASSERT_EQ(host->ListCheckpoints().value().size(), 2u);
  throttle_from = seen.load();
  Status refreshed = host->Refresh();
  EXPECT_FALSE(refreshed.ok());
  EXPECT_FALSE(refreshed.IsNotFound()) << refreshed.ToString();
  EXPECT_NE(refreshed.message().find("503"), std::string::npos) << refreshed.ToString();
  EXPECT_EQ(host->ListCheckpoints().value().size(), 2u);  // nothing taken away
  auto opened = host->OpenCheckpoint("a");
  EXPECT_FALSE(opened.ok());
  EXPECT_FALSE(opened.status().IsNotFound()) << opened.status().ToString();
  // Opening through the throttled store fails; it does not show an empty
  // repository.
  OpenOptions o;
  o.cache_dir = dir_.path() + "/fresh";
  o.s3 = s3_;
  o.s3->endpoint = "http://127.0.0.1:" + std::to_string(proxy.port());
  o.s3->reuse_connections = false;
  o.s3->max_retries = 2;
  o.s3->throttle_wait_s = 0;
  auto fresh = Repository::Open(url_, o);
  ASSERT_FALSE(fresh.ok());
  EXPECT_FALSE(fresh.status().IsNotFound()) << fresh.status().ToString();
}

TEST_F(S3Repository, OneHostListsTheStoreAndTheOthersApplyWhatItShares) {
  const uint64_t rows = 64, cols = 256;
  auto a = Host("a");
  const auto w0 = RandomBytes(rows * cols * 4, 1), w1 = RandomBytes(rows * cols * 4, 2);
  ASSERT_OK(SaveRows(*a, "s0", 0, 1, w0, rows, cols));
  ASSERT_OK(SaveRows(*a, "s1", 0, 1, w1, rows, cols));
  auto names = [](Repository& r) {
    std::vector<std::string> out;
    auto all = r.ListCheckpoints();
    EXPECT_OK(all);
    if (all.ok()) {
      for (const auto& c : *all) out.push_back(c.name);
    }
    return out;
  };
  // A job's processes open without a sync; one lists (pending/, manifests/,
  // packs/), reads the manifests and the indexes of the packs (a HEAD and
  // two ranged GETs each), and shares what it read.
  auto b = Host("b", 0, /*opening_sync=*/false);
  auto c = Host("c", 0, /*opening_sync=*/false);
  EXPECT_TRUE(names(*c).empty());
  RequestCounts mark = b->store_requests();
  auto shared = b->ShareSync();
  ASSERT_OK(shared);
  const RequestCounts sharing = b->store_requests() - mark;
  EXPECT_EQ(sharing.list, 3u);
  EXPECT_GE(sharing.head, 2u) << "a pack or more for each checkpoint";
  EXPECT_EQ(sharing.get, 2u + 2 * sharing.head);
  mark = c->store_requests();
  ASSERT_OK(c->SyncFrom(*shared));
  EXPECT_EQ((c->store_requests() - mark).total(), 0u) << "neither a listing nor a manifest read";
  EXPECT_EQ(names(*c), (std::vector<std::string>{"s0", "s1"}));
  // Reading lists nothing and reads no pack index: the sharer's are used.
  auto reader = c->OpenCheckpoint("s1");
  ASSERT_OK(reader);
  std::vector<std::byte> out(w1.size());
  ASSERT_OK((*reader)->ReadBytes(*(*reader)->GetTensor("w").value(), 0, out));
  EXPECT_EQ(out, w1);
  EXPECT_EQ((c->store_requests() - mark).list, 0u);
  EXPECT_EQ((c->store_requests() - mark).head, 1u) << "the manifest's (is it the one the store holds?), no pack's";

  // The sharer knew s0 and s1 already: it shares s2's manifest only, and a
  // host that lacks the others reads them itself, still without a listing.
  ASSERT_OK(SaveRows(*a, "s2", 0, 1, w0, rows, cols));
  auto d = Host("d", 0, /*opening_sync=*/false);
  auto again = b->ShareSync();
  ASSERT_OK(again);
  mark = d->store_requests();
  ASSERT_OK(d->SyncFrom(*again));
  EXPECT_EQ((d->store_requests() - mark).list, 0u);
  EXPECT_EQ((d->store_requests() - mark).get, 2u) << "the manifests of s0 and s1";
  EXPECT_EQ(names(*d), (std::vector<std::string>{"s0", "s1", "s2"}));

  // What is not a shared listing is refused, naming it; nothing changes.
  for (const std::string& bad : {std::string("garbage"), again->substr(0, again->size() / 2), *again + "x"}) {
    Status st = d->SyncFrom(bad);
    EXPECT_EQ(st.code(), StatusCode::kCorruption) << st.ToString();
    EXPECT_NE(st.message().find("store listing"), std::string::npos) << st.ToString();
  }
  EXPECT_EQ(names(*d), (std::vector<std::string>{"s0", "s1", "s2"}));
}

TEST_F(S3Repository, APackCollectedAfterTheListingIsFoundThroughANewOne) {
  const uint64_t rows = 512, cols = 256;
  auto a = Host("a");
  const auto w0 = RandomBytes(rows * cols * 4, 3), w1 = RandomBytes(rows * cols * 4, 4);
  ASSERT_OK(SaveRows(*a, "s0", 0, 1, w0, rows, cols));
  // s1 shares half its rows with s0: gc below deletes s0's other packs.
  auto mixed = w0;
  std::copy(w1.begin(), w1.begin() + w1.size() / 2, mixed.begin());
  ASSERT_OK(SaveRows(*a, "s1", 0, 1, mixed, rows, cols));
  auto b = Host("b");  // lists the packs, reads no index yet
  ASSERT_OK(a->RemoveCheckpoints({"s0"}));
  GcOptions o;
  o.rewrite_below = 0.99;
  auto r = a->CollectGarbage(o);
  ASSERT_OK(r);
  ASSERT_GT(r->packs_deleted, 0u);
  // Packs b listed are gone: b lists the packs again and finds the moved chunks.
  const RequestCounts mark = b->store_requests();
  auto reader = b->OpenCheckpoint("s1");
  ASSERT_OK(reader);
  EXPECT_GE((b->store_requests() - mark).list, 1u);
  std::vector<std::byte> out(mixed.size());
  ASSERT_OK((*reader)->ReadBytes(*(*reader)->GetTensor("w").value(), 0, out));
  EXPECT_EQ(out, mixed);
}

TEST_F(S3Repository, ACollectiveOpenListsTheStoreOnceForTheGroup) {
  const uint64_t rows = 64, cols = 256;
  auto a = Host("a");
  const auto w = RandomBytes(rows * cols * 4, 21);
  ASSERT_OK(SaveRows(*a, "s0", 0, 1, w, rows, cols));
  std::vector<std::unique_ptr<Repository>> repos(4);
  std::vector<Status> opened(4);
  auto comms = NewHostGroup(4);
  std::vector<std::thread> threads;
  for (int r = 0; r < 4; ++r) {
    threads.emplace_back([&, r] {
      OpenOptions o;
      o.cache_dir = dir_.path() + "/host" + std::to_string(r);
      o.threads = 2;
      o.s3 = s3_;
      auto repo = OpenCollective(url_, o, *comms[r]);
      opened[r] = repo.status();
      if (repo.ok()) repos[r] = std::move(repo).value();
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 4; ++r) {
    ASSERT_OK(opened[r]);
    EXPECT_EQ(repos[r]->store_requests().list, r == 0 ? 3u : 0u) << r;
    auto all = repos[r]->ListCheckpoints();
    ASSERT_OK(all);
    ASSERT_EQ(all->size(), 1u) << r;
    EXPECT_EQ((*all)[0].name, "s0");
  }
}

TEST_F(S3Repository, ACollectiveLoadLeasesTheCheckpointOnceAndAHostThatKnowsAnOlderOneOfItsNameCatchesUp) {
  const uint64_t rows = 64, cols = 256;
  const auto v1 = RandomBytes(rows * cols * 4, 31), v2 = RandomBytes(rows * cols * 4, 32);
  auto writer = Host("writer");
  ASSERT_OK(SaveRows(*writer, "s", 0, 1, v1, rows, cols));
  std::vector<std::unique_ptr<Repository>> repos;
  for (int r = 0; r < 4; ++r) repos.push_back(Host("host" + std::to_string(r)));
  auto load = [&] {
    std::vector<std::vector<std::byte>> got(4, std::vector<std::byte>(rows * cols * 4));
    std::vector<Result<CollectiveLoadResult>> out(4, Status::Internal("not run"));
    auto comms = NewHostGroup(4);
    std::vector<std::thread> threads;
    for (int r = 0; r < 4; ++r) {
      threads.emplace_back([&, r] {
        std::vector<CollectiveTarget> targets = {{{"w", DType::kF32, {rows, cols}}, Region::OfBox(Box{{0, 0}, {rows, cols}}), got[r]}};
        out[r] = LoadCollective(*repos[r], "s", targets, *comms[r]);
      });
    }
    for (auto& t : threads) t.join();
    return std::make_pair(std::move(out), std::move(got));
  };
  std::vector<RequestCounts> before;
  for (auto& r : repos) before.push_back(r->store_requests());
  {
    auto [out, got] = load();
    for (int r = 0; r < 4; ++r) {
      ASSERT_OK(out[r]);
      EXPECT_EQ(got[r], v1) << r;
    }
  }
  // Only rank 0 wrote a read lease.
  for (int r = 0; r < 4; ++r) EXPECT_EQ((repos[r]->store_requests() - before[r]).put, r == 0 ? 1u : 0u) << r;
  // "s" removed and saved again by another host. Ranks 0, 1 and 3 run on
  // hosts that open the repository afresh; rank 2's host still lists the
  // old "s" and has not synced: its open finds the manifest under another
  // tag, syncs, and every rank loads the new "s" (rank 0's refusal of a
  // plan whose ranks opened different checkpoints is then never needed).
  ASSERT_OK(writer->RemoveCheckpoints({"s"}));
  ASSERT_OK(SaveRows(*writer, "s", 0, 1, v2, rows, cols));
  for (int r : {0, 1, 3}) repos[r] = Host("later" + std::to_string(r));
  auto [out, got] = load();
  for (int r = 0; r < 4; ++r) {
    ASSERT_OK(out[r]);
    EXPECT_EQ(got[r], v2) << r;
  }
}

// A restart through a store that throttles by request rate (503 SlowDown,
// then 429): every request over the rate is retried with backoff and
// jitter, and the job's 8 ranks restore bit-exact, with one read lease,
// each pack index read once, and at most 1.05x the stored bytes
// downloaded, counted at the wire (indexes, listings and headers too).
TEST_F(S3Repository, AThrottledCollectiveRestoreRetriesAndEveryRankRestoresBitExact) {
  constexpr int kRanks = 8;
  const uint64_t rows = 512, cols = 2048;  // 4 MiB of f32: 64 chunks in 16 packs
  const auto w = RandomBytes(rows * cols * 4, 41);
  auto writer = Host("writer");
  for (uint32_t r = 0; r < 2; ++r) ASSERT_OK(SaveRows(*writer, "s", r, 2, w, rows, cols));
  const uint64_t stored = writer->DiskUsage({}).value().referenced_bytes;
  for (const Fault mode : {Fault::kServiceUnavailable, Fault::kTooManyRequests}) {
    SCOPED_TRACE(mode == Fault::kServiceUnavailable ? "503 SlowDown" : "429");
    testing::RateLimit limit(/*per_second=*/60, /*burst=*/8);
    testing::FaultProxy proxy(UpstreamPort(), [&](int) { return limit.Admit() ? Fault::kNone : mode; });
    std::vector<std::unique_ptr<Repository>> repos(kRanks);
    std::vector<Status> opened(kRanks);
    std::vector<Result<CollectiveLoadResult>> loaded(kRanks, Status::Internal("not run"));
    std::vector<std::vector<std::byte>> got(kRanks);
    auto comms = NewHostGroup(kRanks);
    std::vector<std::thread> threads;
    const std::string tag = mode == Fault::kServiceUnavailable ? "503" : "429";
    for (int r = 0; r < kRanks; ++r) {
      threads.emplace_back([&, r] {
        OpenOptions o;
        o.cache_dir = dir_.path() + "/throttled-" + tag + "-" + std::to_string(r);
        o.threads = 1;
        o.s3 = s3_;
        o.s3->endpoint = "http://127.0.0.1:" + std::to_string(proxy.port());
        o.s3->reuse_connections = false;
        auto repo = OpenCollective(url_, o, *comms[r]);
        opened[r] = repo.status();
        if (!repo.ok()) return;
        repos[r] = std::move(repo).value();
        const uint64_t first = r * rows / kRanks, n = rows / kRanks;
        got[r].resize(n * cols * 4);
        std::vector<CollectiveTarget> targets = {
            {{"w", DType::kF32, {rows, cols}}, Region::OfBox(Box{{first, 0}, {n, cols}}), got[r]}};
        loaded[r] = LoadCollective(*repos[r], "s", targets, *comms[r]);
      });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < kRanks; ++r) {
      ASSERT_OK(opened[r]);
      ASSERT_OK(loaded[r]);
      const uint64_t first = r * rows / kRanks;
      EXPECT_TRUE(std::equal(got[r].begin(), got[r].end(), w.begin() + first * cols * 4)) << "rank " << r;
      // Counted per attempt: a throttled request counts again when retried.
      const RequestCounts c = repos[r]->store_requests();
      EXPECT_EQ(c.put > 0, r == 0) << "rank " << r << ": one read lease per job";
      EXPECT_EQ(c.list > 0, r == 0) << "rank " << r << ": the group lists the store once";
    }
    EXPECT_GT(proxy.faults(), 0) << "the rate limit throttled nothing";
    // Answered: 16 pack indexes of 3 requests each, read once for the job
    // (once per rank would be 384); 64 chunks; per rank 4 requests to open
    // the repository and check that the checkpoint's manifest is current;
    // the listing, the lease and the manifest.
    const int answered = proxy.connections() - proxy.faults();
    EXPECT_LE(answered, 16 * 3 + 64 + kRanks * 4 + 8) << proxy.faults() << " throttled";
    EXPECT_LE(static_cast<double>(proxy.bytes_down()), 1.05 * static_cast<double>(stored))
        << proxy.bytes_down() << " bytes downloaded for " << stored << " stored";
  }
}

TEST_F(S3Repository, ACollectiveSaveListsTheStoreOnceForTheGroup) {
  const uint64_t rows = 64, cols = 256;
  const auto w = RandomBytes(rows * cols * 4, 23);
  std::vector<std::unique_ptr<Repository>> repos;
  for (int r = 0; r < 4; ++r) repos.push_back(Host("host" + std::to_string(r)));
  // Committed by another host after the ranks' hosts opened: only the
  // store knows it.
  auto other = Host("other");
  ASSERT_OK(SaveRows(*other, "late", 0, 1, w, rows, cols));
  auto lists = [&] {
    uint64_t n = 0;
    for (auto& r : repos) n += r->store_requests().list;
    return n;
  };
  auto save = [&](const std::string& name) {
    std::vector<Result<CollectiveSaveResult>> out(4, Status::Internal("not run"));
    auto comms = NewHostGroup(4);
    std::vector<std::thread> threads;
    for (int r = 0; r < 4; ++r) {
      threads.emplace_back([&, r] {
        const uint64_t begin = r * rows / 4, n = rows / 4;
        std::vector<CollectiveShard> shards = {{{"w", DType::kF32, {rows, cols}},
                                                Region::OfBox(Box{{begin, 0}, {n, cols}}),
                                                std::span<const std::byte>(w).subspan(begin * cols * 4, n * cols * 4)}};
        out[r] = SaveCollective(*repos[r], name, shards, {}, *comms[r]);
      });
    }
    for (auto& t : threads) t.join();
    return out;
  };
  auto requests = [&] {
    std::vector<RequestCounts> out;
    for (auto& r : repos) out.push_back(r->store_requests());
    return out;
  };
  uint64_t mark = lists();
  auto before = requests();
  auto saved = save("shared");
  auto after = requests();
  for (auto& s : saved) ASSERT_OK(s);
  const uint64_t shared = lists() - mark;
  // Rank 0 completed the checkpoint, once every part was in.
  EXPECT_TRUE(saved[0]->commit.checkpoint_visible);
  // Ranks 1-3 neither listed the store (rank 0's listing at the begin,
  // rank 0's at the commit) nor took a store lock (nothing of theirs to
  // delete when they finished): the save costs one rank's listings.
  for (int r = 1; r < 4; ++r) {
    const RequestCounts sent = after[r] - before[r];
    EXPECT_EQ(sent.list, 0u) << "rank " << r;
    EXPECT_EQ(sent.del, 0u) << "rank " << r;
  }
  // Its lock (1), its begin's sync (3), its commit's look for the parts
  // (at least 1) and the committer's sync (3).
  EXPECT_GE(shared, 8u);
  // Every rank's catalog learnt of "late" from rank 0's listing.
  for (auto& repo : repos) {
    auto all = repo->ListCheckpoints();
    ASSERT_OK(all);
    EXPECT_TRUE(std::any_of(all->begin(), all->end(), [](const auto& c) { return c.name == "late"; }));
  }
  ExpectTensorW(*repos[0], "shared", w);
  // The same save by each rank alone: each takes a lock, lists the store
  // at its begin and looks for the other ranks at its commit.
  mark = lists();
  for (uint32_t r = 0; r < 4; ++r) ASSERT_OK(SaveRows(*repos[r], "alone", r, 4, w, rows, cols));
  const uint64_t alone = lists() - mark;
  EXPECT_GE(alone, 4u * 5 + 3) << "alone " << alone << ", shared " << shared;
  EXPECT_LT(shared, alone);
  // A name taken: rank 0's error, with its code, on every rank.
  for (auto& s : save("late")) {
    ASSERT_FALSE(s.ok());
    EXPECT_TRUE(s.status().IsAlreadyExists()) << s.status().ToString();
  }
}

// A group's split commit (WriterOptions::await_ranks), driven by hand as
// an asynchronous save would: rank 0 commits before rank 1's part is in,
// waits for it, and completes; meanwhile rank 0's lock, the only one the
// group holds, keeps a gc on another host away from rank 1's chunks too.
TEST_F(S3Repository, TheSharingRanksCommitWaitsForEveryPartAndItsLockCoversTheGroup) {
  const uint64_t rows = 32, cols = 256;
  const auto w = RandomBytes(rows * cols * 4, 41);
  auto a = Host("a");
  auto b = Host("b");
  auto [w0, w1] = BeginSplit(*a, *b, "split", 2, std::chrono::seconds(30));
  ASSERT_OK(w0);
  ASSERT_OK(w1);
  auto put = [&](CheckpointWriter& writer, uint64_t r) {
    HostSource src(std::span<const std::byte>(w).subspan(r * rows / 2 * cols * 4, rows / 2 * cols * 4));
    return writer.PutShard({"w", DType::kF32, {rows, cols}}, Region::OfBox(Box{{r * rows / 2, 0}, {rows / 2, cols}}),
                           src);
  };
  ASSERT_OK(put(**w0, 0));
  ASSERT_OK(put(**w1, 1));
  // Rank 0 commits first: its commit waits.
  CommitHandle first_commit = (*w0)->Commit();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_FALSE(first_commit.Ready());
  // A gc elsewhere cannot start: rank 0 still holds the group's lock.
  OpenOptions o;
  o.cache_dir = dir_.path() + "/gc-host";
  o.s3 = s3_;
  o.lock_wait = std::chrono::milliseconds(200);
  auto gc_host = Repository::Open(url_, o);
  ASSERT_OK(gc_host);
  auto gc = (*gc_host)->CollectGarbage({});
  ASSERT_FALSE(gc.ok());
  EXPECT_EQ(gc.status().code(), StatusCode::kFailedPrecondition) << gc.status().ToString();
  const RequestCounts before = b->store_requests();
  auto second_commit = (*w1)->Commit().Wait();
  ASSERT_OK(second_commit);
  EXPECT_FALSE(second_commit->checkpoint_visible);
  EXPECT_EQ((b->store_requests() - before).list, 0u);  // its part only: rank 0 looks
  auto done = first_commit.Wait();
  ASSERT_OK(done);
  EXPECT_TRUE(done->checkpoint_visible);
  ASSERT_OK(b->Refresh());
  ExpectTensorW(*b, "split", w);
}

// A collective save restarted after a crash: the sharing rank's listing
// shows every rank in, one of them the crashed attempt's part. It waits
// for this attempt's rank to replace it, then commits this attempt alone.
TEST_F(S3Repository, TheSharingRankOfARestartedSaveWaitsForItsOwnAttemptsPartsAndCommitsThem) {
  const uint64_t rows = 32, cols = 256;
  const auto crashed_bytes = RandomBytes(rows * cols * 4, 45);
  const auto w = RandomBytes(rows * cols * 4, 46);
  auto a = Host("a");
  auto b = Host("b");
  auto put = [&](CheckpointWriter& writer, uint64_t r, const std::vector<std::byte>& bytes) {
    HostSource src(std::span<const std::byte>(bytes).subspan(r * rows / 2 * cols * 4, rows / 2 * cols * 4));
    return writer.PutShard({"w", DType::kF32, {rows, cols}}, Region::OfBox(Box{{r * rows / 2, 0}, {rows / 2, cols}}),
                           src);
  };
  const std::string crashed = NewSaveAttempt();
  {
    WriterOptions o{.rank = 1, .world_size = 2};
    o.attempt = crashed;
    auto part = b->BeginCheckpoint("restarted", o);
    ASSERT_OK(part);
    ASSERT_OK(put(**part, 1, crashed_bytes));
    ASSERT_OK((*part)->Commit().Wait());  // then the job dies
  }
  const std::string attempt = crashed + "0";  // later than the crashed one
  auto [w0, w1] = BeginSplit(*a, *b, "restarted", 2, std::chrono::seconds(30), attempt);
  ASSERT_OK(w0);
  ASSERT_OK(w1);
  ASSERT_OK(put(**w0, 0, w));
  ASSERT_OK(put(**w1, 1, w));
  CommitHandle first_commit = (*w0)->Commit();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_FALSE(first_commit.Ready());  // rank 1's part is still the crashed attempt's
  auto second_commit = (*w1)->Commit().Wait();
  ASSERT_OK(second_commit);
  EXPECT_FALSE(second_commit->checkpoint_visible);
  auto done = first_commit.Wait();
  ASSERT_OK(done);
  EXPECT_TRUE(done->checkpoint_visible);
  ASSERT_OK(b->Refresh());
  ExpectTensorW(*b, "restarted", w);
}

TEST_F(S3Repository, APartThatNeverArrivesFailsTheSharingRanksCommitNamingTheRankAndNothingShows) {
  const uint64_t rows = 32, cols = 256;
  const auto w = RandomBytes(rows * cols * 4, 43);
  auto a = Host("a");
  auto b = Host("b");
  auto [w0, w1] = BeginSplit(*a, *b, "half", 3, std::chrono::milliseconds(400));
  ASSERT_OK(w0);
  ASSERT_OK(w1);
  HostSource src{std::span<const std::byte>(w)};
  ASSERT_OK((*w0)->PutShard({"w", DType::kF32, {rows, cols}}, Region::OfBox(Box{{0, 0}, {rows, cols}}), src));
  ASSERT_OK((*w1)->Commit().Wait().status());  // a part only, however early
  const auto t0 = std::chrono::steady_clock::now();
  auto failed = (*w0)->Commit().Wait();  // rank 2 never commits
  const auto waited = std::chrono::steady_clock::now() - t0;
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), StatusCode::kIOError);
  EXPECT_NE(failed.status().message().find("rank 2 of 3 did not commit its part within 0.4 s"), std::string::npos)
      << failed.status().message();
  EXPECT_GE(waited, std::chrono::milliseconds(400));
  EXPECT_LT(waited, std::chrono::seconds(5));
  ASSERT_OK(a->Refresh());
  auto all = a->ListCheckpoints(/*include_pending=*/true);
  ASSERT_OK(all);
  for (const auto& c : *all) {
    EXPECT_FALSE(c.name == "half" && c.state == CheckpointState::kCommitted) << "nothing becomes visible";
  }
  // The split needs a listing shared or given.
  WriterOptions alone{.rank = 0, .world_size = 1};
  alone.await_ranks = std::chrono::seconds(1);
  EXPECT_EQ(a->BeginCheckpoint("alone", alone).status().code(), StatusCode::kInvalidArgument);
}

TEST_F(S3Repository, AListingSharedFromBeforeThisHostsOwnCommitsTakesNothingAwayButWhatIsGone) {
  const uint64_t rows = 32, cols = 256;
  auto a = Host("a");
  auto b = Host("b");
  ASSERT_OK(SaveRows(*a, "gone", 0, 1, RandomBytes(rows * cols * 4, 31), rows, cols));
  ASSERT_OK(b->Refresh());
  ASSERT_OK(a->RemoveCheckpoints({"gone"}));
  ASSERT_OK(a->CollectGarbage({}).status());
  auto listing = a->ShareSync();  // taken now: "gone" is gone, nothing else is there yet
  ASSERT_OK(listing);
  // Host b commits after the listing was taken: a checkpoint, and one rank
  // of another (pending).
  ASSERT_OK(SaveRows(*b, "late", 0, 1, RandomBytes(rows * cols * 4, 32), rows, cols));
  ASSERT_OK(SaveRows(*b, "half", 0, 2, RandomBytes(rows * cols * 4, 33), rows, cols));
  ASSERT_OK(b->Refresh());  // now b's catalog has "half" pending too
  auto names = [&](bool pending) {
    std::vector<std::string> out;
    auto all = b->ListCheckpoints(pending);
    EXPECT_OK(all);
    for (const auto& c : *all) out.push_back(c.name);
    std::sort(out.begin(), out.end());
    return out;
  };
  ASSERT_EQ(names(true), (std::vector<std::string>{"half", "late"}));
  ASSERT_OK(b->SyncFrom(*listing));
  EXPECT_EQ(names(false), std::vector<std::string>{"late"});
  EXPECT_EQ(names(true), (std::vector<std::string>{"half", "late"}));
  // What b wrote is still in its catalog: its chunks are found, no index read again.
  auto reader = b->OpenCheckpoint("late");
  ASSERT_OK(reader);
  std::vector<std::byte> out(rows * cols * 4);
  ASSERT_OK((*reader)->ReadBytes(*(*reader)->GetTensor("w").value(), 0, out));
  EXPECT_EQ(out, RandomBytes(rows * cols * 4, 32));
}

}  // namespace
}  // namespace ckptfs
