// Two tiers (ckpt/tiers.h): saves go to a host's fast tier (a local
// directory) and drain to a shared one (an object store); reads take each
// chunk from the nearest tier that holds it intact; the fast tier drops
// only checkpoints that are durable in the shared one.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <thread>

#include "backend/backend.h"
#include "ckpt/communicator.h"
#include "ckpt/tiers.h"
#include "test_backends.h"
#include "test_util.h"

namespace ckptfs {
namespace {

using testing::RandomBytes;
using testing::TempDir;

RepositoryConfig SmallConfig() {
  RepositoryConfig config;
  config.chunk_size = 64 << 10;
  config.pack_size = 1 << 20;
  return config;
}

constexpr uint64_t kRows = 256, kCols = 256;

// The bytes of matrix "w" of checkpoint `seed`.
std::vector<std::byte> Matrix(uint32_t seed) { return RandomBytes(kRows * kCols * 4, seed); }

// Saves rank `rank` of `world` of checkpoint `name` (rows of "w" split
// evenly between the ranks; rank 0 adds a blob).
void SaveRank(Repository& repo, const std::string& name, int64_t step, uint32_t rank, uint32_t world, uint32_t seed,
              const std::string& attempt = "", bool overwrite = false) {
  const std::vector<std::byte> w = Matrix(seed);
  WriterOptions wo;
  wo.overwrite = overwrite;
  wo.rank = rank;
  wo.world_size = world;
  wo.step = step;
  wo.attempt = attempt;
  auto writer = repo.BeginCheckpoint(name, wo);
  ASSERT_OK(writer);
  const uint64_t rows = kRows / world;
  const uint64_t bytes = rows * kCols * 4;
  HostSource part(std::span<const std::byte>(w).subspan(rank * bytes, bytes));
  ASSERT_OK((*writer)->PutShard({"w", DType::kF32, {kRows, kCols}}, Region::OfBox(Box{{rank * rows, 0}, {rows, kCols}}),
                                part));
  if (rank == 0) ASSERT_OK((*writer)->PutBlob("rng", testing::AsBytes("state " + std::to_string(seed))));
  auto done = (*writer)->Commit().Wait();
  ASSERT_OK(done);
}

// Checkpoint `name` read through `reader` is checkpoint `seed`'s matrix.
void ExpectMatrix(const CheckpointReader& reader, uint32_t seed) {
  auto t = reader.GetTensor("w");
  ASSERT_OK(t);
  std::vector<std::byte> got(kRows * kCols * 4);
  ASSERT_OK(reader.ReadBytes(**t, 0, got));
  EXPECT_TRUE(got == Matrix(seed));
}

// A fast tier on this host and a shared object store, opened as hosts do.
struct Tiers {
  TempDir dir;
  std::shared_ptr<Backend> store = NewMemoryBackend();
  Tiers() { EXPECT_OK(Repository::Init(*store, SmallConfig())); }
  std::string FastPath(const std::string& host) const { return dir / ("fast-" + host); }
  std::unique_ptr<Repository> Fast(const std::string& host) {
    const std::string path = FastPath(host);
    if (!std::filesystem::exists(path + "/ckptfs.json")) EXPECT_OK(Repository::Init(path, SmallConfig()));
    return std::move(Repository::Open(path)).value();
  }
  std::unique_ptr<Repository> Shared(const std::string& host) {
    OpenOptions o;
    o.cache_dir = dir / ("cache-" + host);
    return std::move(Repository::Open(store, o)).value();
  }
};

TEST(Tiers, ACheckpointSavedOnOneHostDrainsOnceAndReadsFromTheFastTier) {
  Tiers tiers;
  auto fast = tiers.Fast("a");
  auto shared = tiers.Shared("a");
  SaveRank(*fast, "step-1", 1, 0, 2, 7);
  SaveRank(*fast, "step-1", 1, 1, 2, 7);
  auto status = TierStatus(*fast, *shared);
  ASSERT_OK(status);
  ASSERT_EQ(status->size(), 1u);
  EXPECT_EQ(status->front().state(), "local");
  EXPECT_TRUE(status->front().complete_here);

  auto drained = Drain(*fast, *shared, {});
  ASSERT_OK(drained);
  ASSERT_EQ(drained->checkpoints.size(), 1u);
  EXPECT_TRUE(drained->checkpoints[0].durable);
  EXPECT_EQ(drained->checkpoints[0].sent.ranks_copied, 2u);
  EXPECT_GE(drained->raw_bytes_sent, kRows * kCols * 4);
  status = TierStatus(*fast, *shared);
  ASSERT_OK(status);
  EXPECT_EQ(status->front().state(), "durable");

  // Nothing is left to send.
  auto again = Drain(*fast, *shared, {});
  ASSERT_OK(again);
  EXPECT_TRUE(again->checkpoints.empty());
  DrainOptions named;
  named.names = {"step-1"};
  again = Drain(*fast, *shared, named);
  ASSERT_OK(again);
  ASSERT_EQ(again->checkpoints.size(), 1u);
  EXPECT_EQ(again->checkpoints[0].sent.outcome, CopiedCheckpoint::Outcome::kPresent);
  EXPECT_EQ(again->chunks_sent, 0u);

  // Another host reads the shared tier alone.
  {
    auto other = tiers.Shared("b");
    auto reader = other->OpenCheckpoint("step-1");
    ASSERT_OK(reader);
    ExpectMatrix(**reader, 7);
    EXPECT_GT(other->fetch_counts().chunks, 0u);
  }
  // This host reads every chunk from its fast tier: none from the store.
  ReadOptions nearest;
  nearest.nearer = {fast.get()};
  auto reader = shared->OpenCheckpoint("step-1", nearest);
  ASSERT_OK(reader);
  ExpectMatrix(**reader, 7);
  EXPECT_EQ(shared->fetch_counts().chunks, 0u);
  EXPECT_GT(fast->fetch_counts().chunks, 0u);
}

// Each host's fast tier holds its own ranks: the checkpoint is pending
// there, each host drains its part, and the last makes it visible.
TEST(Tiers, EachHostDrainsItsRanksAndTheLastMakesTheCheckpointVisible) {
  Tiers tiers;
  auto fast_a = tiers.Fast("a");
  auto fast_b = tiers.Fast("b");
  auto shared_a = tiers.Shared("a");
  auto shared_b = tiers.Shared("b");
  SaveRank(*fast_a, "step-5", 5, 0, 2, 11, "attempt-1");
  SaveRank(*fast_b, "step-5", 5, 1, 2, 11, "attempt-1");
  auto status = TierStatus(*fast_a, *shared_a);
  ASSERT_OK(status);
  ASSERT_EQ(status->size(), 1u);
  EXPECT_FALSE(status->front().complete_here);
  EXPECT_EQ(status->front().ranks_here, std::vector<uint32_t>{0});

  auto drained = Drain(*fast_a, *shared_a, {});
  ASSERT_OK(drained);
  EXPECT_FALSE(drained->checkpoints.at(0).durable);
  EXPECT_TRUE(shared_a->GetCheckpoint("step-5").status().IsNotFound());
  status = TierStatus(*fast_a, *shared_a);
  ASSERT_OK(status);
  EXPECT_EQ(status->front().state(), "drained");
  // Host a's copy stays until the checkpoint is durable; short of space
  // it may go (its ranks are in the shared tier). Host b's may not.
  auto trim_a = PlanFastTierTrim(*fast_a, *shared_a, 0);
  ASSERT_OK(trim_a);
  EXPECT_TRUE(trim_a->empty());
  trim_a = PlanFastTierTrim(*fast_a, *shared_a, 0, /*short_of_space=*/true);
  ASSERT_OK(trim_a);
  EXPECT_EQ(*trim_a, std::vector<std::string>{"step-5"});
  auto trim_b = PlanFastTierTrim(*fast_b, *shared_b, 0, /*short_of_space=*/true);
  ASSERT_OK(trim_b);
  EXPECT_TRUE(trim_b->empty());

  drained = Drain(*fast_b, *shared_b, {});
  ASSERT_OK(drained);
  EXPECT_TRUE(drained->checkpoints.at(0).durable);
  ASSERT_OK(shared_a->Refresh());
  auto reader = shared_a->OpenCheckpoint("step-5");
  ASSERT_OK(reader);
  ExpectMatrix(**reader, 11);
  auto blob = (*reader)->FindBlob("rng");
  ASSERT_NE(blob, nullptr);

  // Host a reads its rows from its fast tier, the others from the store.
  ReadOptions nearest;
  nearest.nearer = {fast_a.get()};
  auto near = shared_a->OpenCheckpoint("step-5", nearest);
  ASSERT_OK(near);
  const uint64_t before = shared_a->fetch_counts().chunks;
  ExpectMatrix(**near, 11);
  EXPECT_GT(fast_a->fetch_counts().chunks, 0u);
  EXPECT_GT(shared_a->fetch_counts().chunks, before);
}

// A drain stopped part way leaves only whole ranks in the shared tier,
// nothing visible, and the next drain sends only the rest.
TEST(Tiers, AStoppedDrainLeavesNothingVisibleAndResumes) {
  Tiers tiers;
  auto fast = tiers.Fast("a");
  auto shared = tiers.Shared("a");
  for (uint32_t r = 0; r < 4; ++r) SaveRank(*fast, "step-2", 2, r, 4, 3);
  DrainOptions stop;
  stop.ranks_at_once = 1;
  std::atomic<int> fetched{0};
  stop.cancelled = [&] { return fetched.fetch_add(1) >= 5; };
  auto stopped = Drain(*fast, *shared, stop);
  ASSERT_FALSE(stopped.ok());
  EXPECT_NE(stopped.status().message().find("cancelled"), std::string::npos) << stopped.status().ToString();
  EXPECT_TRUE(shared->GetCheckpoint("step-2").status().IsNotFound());
  auto status = TierStatus(*fast, *shared);
  ASSERT_OK(status);
  const size_t before = status->front().ranks_shared.size();
  EXPECT_GE(before, 1u);
  EXPECT_LT(before, 4u);

  auto resumed = Drain(*fast, *shared, {});
  ASSERT_OK(resumed);
  ASSERT_EQ(resumed->checkpoints.size(), 1u);
  EXPECT_TRUE(resumed->checkpoints[0].durable);
  EXPECT_EQ(resumed->checkpoints[0].sent.ranks_copied, 4u - before);
  auto reader = shared->OpenCheckpoint("step-2");
  ASSERT_OK(reader);
  ExpectMatrix(**reader, 3);
}

// A chunk whose bytes in the fast tier fail their id is read from the
// shared tier instead: the reader gets the right bytes.
TEST(Tiers, AChunkCorruptInTheFastTierIsReadFromTheSharedTier) {
  Tiers tiers;
  {
    auto fast = tiers.Fast("a");
    auto shared = tiers.Shared("a");
    SaveRank(*fast, "step-1", 1, 0, 1, 21);
    ASSERT_OK(Drain(*fast, *shared, {}));
  }
  // Flip bytes in the middle of every pack of the fast tier.
  int packs = 0;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(tiers.FastPath("a") + "/objects/packs")) {
    if (!entry.is_regular_file()) continue;
    std::fstream f(entry.path(), std::ios::in | std::ios::out | std::ios::binary);
    for (uint64_t at = 4096; at + 1 < entry.file_size() / 2; at += 32 << 10) {
      f.seekp(static_cast<std::streamoff>(at));
      f.put('\x5a');
    }
    ++packs;
  }
  ASSERT_GT(packs, 0);
  auto fast = tiers.Fast("a");
  auto shared = tiers.Shared("a");
  ReadOptions nearest;
  nearest.nearer = {fast.get()};
  auto reader = shared->OpenCheckpoint("step-1", nearest);
  ASSERT_OK(reader);
  ExpectMatrix(**reader, 21);
  EXPECT_GT(shared->fetch_counts().chunks, 0u);
}

// The fast tier's retention keeps the newest and never names a checkpoint
// that is not durable in the shared tier, however old.
TEST(Tiers, TrimmingTheFastTierNeverDropsACheckpointNotDurable) {
  Tiers tiers;
  auto fast = tiers.Fast("a");
  auto shared = tiers.Shared("a");
  for (int step = 1; step <= 4; ++step) SaveRank(*fast, "step-" + std::to_string(step), step, 0, 1, step);
  DrainOptions some;
  some.names = {"step-1", "step-3"};
  ASSERT_OK(Drain(*fast, *shared, some));
  auto plan = PlanFastTierTrim(*fast, *shared, 1);
  ASSERT_OK(plan);
  EXPECT_EQ(*plan, (std::vector<std::string>{"step-1", "step-3"}));
  plan = PlanFastTierTrim(*fast, *shared, 2);
  ASSERT_OK(plan);
  EXPECT_EQ(*plan, (std::vector<std::string>{"step-1"}));
  ASSERT_OK(fast->RemoveCheckpoints(*plan));
  ASSERT_OK(fast->CollectGarbage({}));
  // What stays in the fast tier reads; what left it reads from the store.
  ReadOptions nearest;
  nearest.nearer = {fast.get()};
  auto reader = shared->OpenCheckpoint("step-1", nearest);
  ASSERT_OK(reader);
  ExpectMatrix(**reader, 1);
  auto kept = fast->OpenCheckpoint("step-2");
  ASSERT_OK(kept);
  ExpectMatrix(**kept, 2);
}

// `hosts` threads, each a host of one in-process group, run `fn(host,
// communicator)` at once; their results in host order.
std::vector<Result<ReplicaReport>> OnEveryHost(
    int hosts, const std::function<Result<ReplicaReport>(int, Communicator&)>& fn) {
  std::vector<Result<ReplicaReport>> out(hosts, Status::Internal("not run"));
  auto comms = NewHostGroup(hosts);
  std::vector<std::thread> threads;
  for (int h = 0; h < hosts; ++h) threads.emplace_back([&, h] { out[h] = fn(h, *comms[h]); });
  for (auto& t : threads) t.join();
  return out;
}

// Each rank keeps a replica of its part in the next host's fast tier: a
// host lost before its drain still leaves every rank to drain, and a
// restore from the surviving fast tiers reads nothing from the store.
TEST(Tiers, ReplicasLetOtherHostsDrainAndRestoreALostHostsRanks) {
  Tiers tiers;
  constexpr int kHosts = 4;
  std::vector<std::unique_ptr<Repository>> fast;
  for (int h = 0; h < kHosts; ++h) fast.push_back(tiers.Fast("h" + std::to_string(h)));
  for (int h = 0; h < kHosts; ++h) SaveRank(*fast[h], "step-1", 1, h, kHosts, 31, "attempt-r");
  auto state_at = [&](int h, Repository& shared) {
    auto entries = TierStatus(*fast[h], shared);
    EXPECT_OK(entries);
    return entries.ok() && entries->size() == 1 ? entries->front().state() : std::string("?");
  };
  {
    auto seen = tiers.Shared("h1");
    EXPECT_EQ(state_at(1, *seen), "local");
  }
  auto replicate = [&] {
    return OnEveryHost(kHosts, [&](int h, Communicator& comm) {
      return ReplicateRankParts(*fast[h], "step-1", comm, {2, 1});
    });
  };
  std::vector<Result<ReplicaReport>> first = replicate();
  for (int h = 0; h < kHosts; ++h) {
    ASSERT_OK(first[h]);
    EXPECT_EQ(first[h]->parts_sent, 1u);
    EXPECT_EQ(first[h]->parts_received, 1u);
    EXPECT_GT(first[h]->chunks_sent, 0u);
  }
  auto listed = fast[1]->ListCheckpoints(true);
  ASSERT_OK(listed);
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ(listed->front().committed_ranks, (std::vector<uint32_t>{0, 1}));
  // Every host records that each part has two copies.
  for (int h = 0; h < kHosts; ++h) {
    auto seen = tiers.Shared("h" + std::to_string(h));
    EXPECT_EQ(state_at(h, *seen), "replicated") << h;
  }
  // Again: every part is there; no chunk travels.
  std::vector<Result<ReplicaReport>> second = replicate();
  for (int h = 0; h < kHosts; ++h) {
    ASSERT_OK(second[h]);
    EXPECT_EQ(second[h]->chunks_sent, 0u);
  }
  // Host 0 is lost before it drains: the others drain every rank.
  auto shared1 = tiers.Shared("h1");
  auto shared2 = tiers.Shared("h2");
  auto shared3 = tiers.Shared("h3");
  ASSERT_OK(Drain(*fast[1], *shared1, {}));
  EXPECT_EQ(state_at(1, *shared1), "drained");
  ASSERT_OK(Drain(*fast[2], *shared2, {}));
  auto last = Drain(*fast[3], *shared3, {});
  ASSERT_OK(last);
  ASSERT_EQ(last->checkpoints.size(), 1u);
  EXPECT_TRUE(last->checkpoints[0].durable);
  ReadOptions nearest;
  nearest.nearer = {fast[1].get(), fast[2].get(), fast[3].get()};
  auto reader = shared3->OpenCheckpoint("step-1", nearest);
  ASSERT_OK(reader);
  ExpectMatrix(**reader, 31);
  EXPECT_EQ(shared3->fetch_counts().chunks, 0u);

  // Host 0 comes back with an empty disk: its part comes back from the
  // peer that keeps a copy, and its rows then read from its own fast tier.
  fast[0].reset();
  std::filesystem::remove_all(tiers.FastPath("h0"));
  fast[0] = tiers.Fast("h0");
  std::vector<Result<ReplicaReport>> back = OnEveryHost(kHosts, [&](int h, Communicator& comm) {
    return RestoreRankParts(*fast[h], "step-1", comm, {2, 1});
  });
  for (int h = 0; h < kHosts; ++h) {
    ASSERT_OK(back[h]);
    EXPECT_EQ(back[h]->parts_received, h == 0 ? 1u : 0u) << h;
  }
  EXPECT_EQ(back[1]->parts_sent, 1u);
  auto shared0 = tiers.Shared("h0");
  // Its part came back after the checkpoint was committed in the shared
  // tier, but holds the same chunks: durable, not another version.
  EXPECT_EQ(state_at(0, *shared0), "durable");
  ReadOptions own;
  own.nearer = {fast[0].get()};
  auto mine = shared0->OpenCheckpoint("step-1", own);
  ASSERT_OK(mine);
  auto w = (*mine)->GetTensor("w");
  ASSERT_OK(w);
  std::vector<std::byte> rows(kRows / kHosts * kCols * 4);
  ASSERT_OK((*mine)->ReadBox(**w, Box{{0, 0}, {kRows / kHosts, kCols}}, rows));
  EXPECT_TRUE(std::equal(rows.begin(), rows.end(), Matrix(31).begin()));
  EXPECT_EQ(shared0->fetch_counts().chunks, 0u);
}

TEST(Tiers, ACliqueKeepsEveryMembersPartAndBadLayoutsAreRefused) {
  Tiers tiers;
  constexpr int kHosts = 4;
  std::vector<std::unique_ptr<Repository>> fast;
  for (int h = 0; h < kHosts; ++h) fast.push_back(tiers.Fast("h" + std::to_string(h)));
  auto exchange = [&](const std::string& name, ReplicaOptions o) {
    return OnEveryHost(kHosts, [&](int h, Communicator& comm) { return ReplicateRankParts(*fast[h], name, comm, o); });
  };
  auto ranks_at = [&](int h, const std::string& name) {
    auto listed = fast[h]->ListCheckpoints(true);
    EXPECT_OK(listed);
    for (const CheckpointRecord& c : *listed) {
      if (c.name == name) return c.committed_ranks;
    }
    return std::vector<uint32_t>{};
  };
  // A rank's part must be in its fast tier first: every rank hears which.
  for (int h = 1; h < kHosts; ++h) SaveRank(*fast[h], "step-1", 1, h, kHosts, 51, "attempt-c");
  for (const auto& r : exchange("step-1", {2, 1, ReplicaStrategy::kClique})) {
    ASSERT_FALSE(r.ok());
    EXPECT_TRUE(r.status().code() == StatusCode::kFailedPrecondition) << r.status().ToString();
  }
  SaveRank(*fast[0], "step-1", 1, 0, kHosts, 51, "attempt-c");
  // Cliques of three do not divide four ranks; a ring of three copies two
  // hosts apart would come back to its start.
  for (const auto& r : exchange("step-1", {3, 1, ReplicaStrategy::kClique})) {
    EXPECT_TRUE(r.status().code() == StatusCode::kInvalidArgument) << r.status().ToString();
  }
  for (const auto& r : exchange("step-1", {3, 2, ReplicaStrategy::kRing})) {
    EXPECT_TRUE(r.status().code() == StatusCode::kInvalidArgument) << r.status().ToString();
  }
  EXPECT_EQ(ranks_at(0, "step-1"), (std::vector<uint32_t>{0}));
  // The failed exchange kept what its other ranks swapped (2 and 3 are a
  // clique of a jump of 1), and recorded no copies.
  EXPECT_EQ(ranks_at(2, "step-1"), (std::vector<uint32_t>{2, 3}));
  {
    auto seen = tiers.Shared("h2");
    auto entries = TierStatus(*fast[2], *seen);
    ASSERT_OK(entries);
    ASSERT_EQ(entries->size(), 1u);
    EXPECT_EQ(entries->front().state(), "local");
  }
  // Cliques {0, 2} and {1, 3} (a jump of 2): each member keeps the other's part.
  for (const auto& r : exchange("step-1", {2, 2, ReplicaStrategy::kClique})) ASSERT_OK(r);
  EXPECT_EQ(ranks_at(0, "step-1"), (std::vector<uint32_t>{0, 2}));
  EXPECT_EQ(ranks_at(1, "step-1"), (std::vector<uint32_t>{1, 3}));
  EXPECT_EQ(ranks_at(2, "step-1"), (std::vector<uint32_t>{0, 2, 3}));
  EXPECT_EQ(ranks_at(3, "step-1"), (std::vector<uint32_t>{1, 2, 3}));
  // A ring of two with a jump of 1 on another checkpoint: each keeps the part behind it.
  for (int h = 0; h < kHosts; ++h) SaveRank(*fast[h], "step-2", 2, h, kHosts, 52, "attempt-c2");
  for (const auto& r : exchange("step-2", {2, 1, ReplicaStrategy::kRing})) ASSERT_OK(r);
  EXPECT_EQ(ranks_at(0, "step-2"), (std::vector<uint32_t>{0, 3}));
  EXPECT_EQ(ranks_at(2, "step-2"), (std::vector<uint32_t>{1, 2}));
  auto shared = tiers.Shared("h0");
  auto entries = TierStatus(*fast[0], *shared);
  ASSERT_OK(entries);
  ASSERT_EQ(entries->size(), 2u);
  for (const TierEntry& e : *entries) {
    EXPECT_EQ(e.copies, 2u);
    EXPECT_EQ(e.state(), "replicated");
  }
  // A checkpoint of the same name saved again is not the one replicated;
  // and a drain forgets the record of one removed.
  ASSERT_OK(fast[0]->RemoveCheckpoints({"step-1"}));
  SaveRank(*fast[0], "step-1", 1, 0, kHosts, 53, "attempt-c3");
  entries = TierStatus(*fast[0], *shared);
  ASSERT_OK(entries);
  for (const TierEntry& e : *entries) EXPECT_EQ(e.state(), e.name == "step-1" ? "local" : "replicated") << e.name;
  ASSERT_OK(fast[0]->RemoveCheckpoints({"step-1"}));
  ASSERT_OK(Drain(*fast[0], *shared, {}));
  EXPECT_FALSE(std::filesystem::exists(tiers.FastPath("h0") + "/replicated/step-1"));
  EXPECT_TRUE(std::filesystem::exists(tiers.FastPath("h0") + "/replicated/step-2"));
  EXPECT_TRUE(ParseReplicaStrategy("clique").ok());
  EXPECT_TRUE(ParseReplicaStrategy("star").status().code() == StatusCode::kInvalidArgument);
}

TEST(Tiers, ASaveThatReplacesACheckpointDrainsInPlaceOfTheSharedTiersVersion) {
  Tiers tiers;
  // One host: "last" saved, drained, then saved again over itself.
  auto fast = tiers.Fast("a");
  auto shared = tiers.Shared("a");
  SaveRank(*fast, "last", 1, 0, 1, 61);
  ASSERT_OK(Drain(*fast, *shared, {}));
  SaveRank(*fast, "last", 2, 0, 1, 62, "", /*overwrite=*/true);
  auto entries = TierStatus(*fast, *shared);
  ASSERT_OK(entries);
  ASSERT_EQ(entries->size(), 1u);
  // The shared tier's "last" is the older version: not durable, and never
  // trimmed as if it were.
  EXPECT_EQ(entries->front().state(), "local");
  EXPECT_TRUE(entries->front().overwrite);
  auto trim = PlanFastTierTrim(*fast, *shared, 0);
  ASSERT_OK(trim);
  EXPECT_TRUE(trim->empty());
  auto drained = Drain(*fast, *shared, {});
  ASSERT_OK(drained);
  EXPECT_TRUE(drained->checkpoints.at(0).durable);
  auto reader = shared->OpenCheckpoint("last");
  ASSERT_OK(reader);
  ExpectMatrix(**reader, 62);
  entries = TierStatus(*fast, *shared);
  ASSERT_OK(entries);
  EXPECT_EQ(entries->front().state(), "durable");

  // Two ranks on one host, saved over: a drain of the replacement stopped
  // after its first rank is finished by the next, under the same attempt.
  for (uint32_t r = 0; r < 2; ++r) SaveRank(*fast, "pair", 1, r, 2, 65, "attempt-p1");
  ASSERT_OK(Drain(*fast, *shared, {}));
  for (uint32_t r = 0; r < 2; ++r) SaveRank(*fast, "pair", 2, r, 2, 66, "attempt-p2", /*overwrite=*/true);
  DrainOptions one_rank;
  one_rank.names = {"pair"};
  one_rank.ranks_at_once = 1;
  bool stop = false;
  one_rank.cancelled = [&] { return stop; };
  EXPECT_FALSE(Drain(*fast, *shared, one_rank, [&](uint64_t done, uint64_t) { stop = done > 0; }).ok());
  {
    auto before = shared->OpenCheckpoint("pair");
    ASSERT_OK(before);
    ExpectMatrix(**before, 65);
  }
  auto finished = Drain(*fast, *shared, {});
  ASSERT_OK(finished);
  auto pair = shared->OpenCheckpoint("pair");
  ASSERT_OK(pair);
  ExpectMatrix(**pair, 66);

  // Two hosts: each fast tier keeps the replacing save pending as "last~";
  // the shared tier shows the old version until the second host drains.
  std::vector<std::unique_ptr<Repository>> hosts, views;
  for (const char* h : {"h0", "h1"}) {
    hosts.push_back(tiers.Fast(h));
    views.push_back(tiers.Shared(h));
  }
  for (uint32_t h = 0; h < 2; ++h) SaveRank(*hosts[h], "run", 1, h, 2, 63, "attempt-o1");
  for (uint32_t h = 0; h < 2; ++h) ASSERT_OK(Drain(*hosts[h], *views[h], {}));
  for (uint32_t h = 0; h < 2; ++h) SaveRank(*hosts[h], "run", 2, h, 2, 64, "attempt-o2", /*overwrite=*/true);
  entries = TierStatus(*hosts[0], *views[0]);
  ASSERT_OK(entries);
  ASSERT_EQ(entries->size(), 2u);  // the drained version and the replacing save
  const TierEntry& replacing = entries->back();
  EXPECT_EQ(replacing.name, "run~");
  EXPECT_EQ(replacing.target, "run");
  EXPECT_EQ(replacing.state(), "local");
  ASSERT_OK(Drain(*hosts[0], *views[0], {}));
  {
    auto visible = views[0]->OpenCheckpoint("run");
    ASSERT_OK(visible);
    ExpectMatrix(**visible, 63);
  }
  entries = TierStatus(*hosts[0], *views[0]);
  ASSERT_OK(entries);
  EXPECT_EQ(entries->back().state(), "drained");
  auto last = Drain(*hosts[1], *views[1], {});
  ASSERT_OK(last);
  EXPECT_TRUE(last->checkpoints.back().durable);
  ASSERT_OK(views[0]->Refresh());
  auto visible = views[0]->OpenCheckpoint("run");
  ASSERT_OK(visible);
  ExpectMatrix(**visible, 64);
  entries = TierStatus(*hosts[0], *views[0]);
  ASSERT_OK(entries);
  for (const TierEntry& e : *entries) EXPECT_EQ(e.state(), "durable") << e.name;
}

TEST(Tiers, AReplicaBundleThatIsDamagedIsRefused) {
  Tiers tiers;
  auto a = tiers.Fast("a");
  auto b = tiers.Fast("b");
  SaveRank(*a, "step-1", 1, 0, 2, 41, "attempt-d");
  auto ids = RankPartChunks(*a, "step-1", 0);
  ASSERT_OK(ids);
  auto bundle = ExportRankPart(*a, "step-1", 0, *ids);
  ASSERT_OK(bundle);
  // A flipped byte in the last chunk's stored bytes: its id check fails.
  std::string damaged = *bundle;
  damaged[damaged.size() - 10] ^= 0x5a;
  Status st = ImportRankPart(*b, damaged);
  EXPECT_TRUE(st.IsCorruption()) << st.ToString();
  // Cut short, or not a bundle at all.
  EXPECT_TRUE(ImportRankPart(*b, bundle->substr(0, bundle->size() / 2)).IsCorruption());
  EXPECT_TRUE(ImportRankPart(*b, "not a bundle").IsCorruption());
  auto none = b->ListCheckpoints(true);
  ASSERT_OK(none);
  EXPECT_TRUE(none->empty());
  // Intact, it is kept, and again changes nothing.
  ASSERT_OK(ImportRankPart(*b, *bundle));
  ASSERT_OK(ImportRankPart(*b, *bundle));
  auto missing = MissingChunks(*b, *ids);
  ASSERT_OK(missing);
  EXPECT_TRUE(missing->empty());
}

TEST(Tiers, TheFastTierNamesOneSharedTier) {
  TempDir dir;
  auto none = ReadSharedTier(dir.path());
  ASSERT_OK(none);
  EXPECT_FALSE(none->has_value());
  ASSERT_OK(WriteSharedTier(dir.path(), "s3://bucket/shared"));
  ASSERT_OK(WriteSharedTier(dir.path(), "s3://bucket/shared"));
  auto named = ReadSharedTier(dir.path());
  ASSERT_OK(named);
  EXPECT_EQ(named->value(), "s3://bucket/shared");
  Status other = WriteSharedTier(dir.path(), "s3://bucket/other");
  EXPECT_TRUE(other.code() == StatusCode::kInvalidArgument) << other.ToString();
  EXPECT_NE(other.message().find("s3://bucket/shared"), std::string::npos) << other.ToString();
  EXPECT_TRUE(WriteSharedTier(dir.path(), "").code() == StatusCode::kInvalidArgument);
}

TEST(Tiers, AFastTierMustBeALocalDirectoryOtherThanTheSharedOne) {
  Tiers tiers;
  auto shared = tiers.Shared("a");
  auto again = tiers.Shared("b");
  auto st = TierStatus(*shared, *again);
  EXPECT_TRUE(st.status().code() == StatusCode::kInvalidArgument) << st.status().ToString();
  auto fast = tiers.Fast("a");
  st = TierStatus(*fast, *fast);
  EXPECT_TRUE(st.status().code() == StatusCode::kInvalidArgument) << st.status().ToString();
}

}  // namespace
}  // namespace ckptfs
