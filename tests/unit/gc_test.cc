// Garbage collection, retention, disk usage and diff through the public API.
#include <map>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "ckpt/lease.h"
#include "ckpt/repo_lock.h"
#include "ckpt/repository.h"
#include "store/pack.h"
#include "test_repositories.h"
#include "test_util.h"

namespace ckptfs {
namespace {

using testing::RandomBytes;
using testing::TempDir;
using testing::RepoKind;

// A repository of one kind (test_repositories.h), opened as repo_.
class GcFixture : public testing::RepositoryTest {
 protected:
  void Create(RepoKind kind) { RepositoryTest::Create(kind, {2, 1 << 20}); }
  // Saves a checkpoint whose tensor "base" is shared by all and "own" unique.
  void Save(const std::string& name, std::optional<int64_t> step, uint32_t seed,
            const std::vector<std::byte>& base) {
    auto w = std::move(repo_->BeginCheckpoint(name, {0, 1, step, {}})).value();
    auto own = RandomBytes(300 << 10, 1000 + seed);  // never the seed of a base
    ASSERT_OK(w->PutTensor({"base", DType::kU8, {base.size()}}, base));
    ASSERT_OK(w->PutTensor({"own", DType::kU8, {own.size()}}, own));
    ASSERT_OK(w->Commit().Wait());
    owns_[name] = own;
  }
  // What the store holds in packs, read from the store itself.
  uint64_t PackBytesOnDisk() { return where_.StoredBytes("packs/"); }
  void ExpectReadable(const std::string& name, const std::vector<std::byte>& base) {
    auto r = repo_->OpenCheckpoint(name);
    ASSERT_OK(r);
    std::vector<std::byte> got(base.size());
    ASSERT_OK((*r)->ReadBytes(*(*r)->FindTensor("base"), 0, got));
    EXPECT_EQ(got, base);
    got.resize(owns_[name].size());
    ASSERT_OK((*r)->ReadBytes(*(*r)->FindTensor("own"), 0, got));
    EXPECT_EQ(got, owns_[name]);
  }

  // Another host of the repository, with a catalog of its own; a local
  // repository has one catalog, which this process opens once (repo_).
  Repository* OtherHost() {
    if (where_.kind() == RepoKind::kLocal) return repo_.get();
    other_ = std::move(where_.Open({2, 1 << 20}, "other")).value();
    return other_.get();
  }

  std::map<std::string, std::vector<std::byte>> owns_;
  std::unique_ptr<Repository> other_;  // OtherHost's, on a store
};

// The conformance suite: what gc, retention, rm, du and diff do alike on
// every kind of repository.
class GarbageCollection : public testing::EachKind<GcFixture> {};
INSTANTIATE_TEST_SUITE_P(Repositories, GarbageCollection, testing::AllRepositoryKinds(), testing::RepoKindNamer());

// A local repository's own: its lock and lease files, its reindex, packs
// a killed save left on its disk.
class LocalGarbageCollection : public testing::LocalKind<GcFixture> {};

TEST(StateKinds, TensorsAreSortedByTheLastPartOfTheirNameThenByDtype) {
  EXPECT_STREQ(StateKindOf("optim.state.layers.0.w.exp_avg", DType::kF32, false), "adam_exp_avg");
  EXPECT_STREQ(StateKindOf("optimizer_states/0/state/3/exp_avg_sq", DType::kF32, false), "adam_exp_avg_sq");
  EXPECT_STREQ(StateKindOf("state.1.max_exp_avg_sq", DType::kBF16, false), "adam_exp_avg_sq");
  EXPECT_STREQ(StateKindOf("state.1.momentum_buffer", DType::kF32, false), "adam_exp_avg");
  EXPECT_STREQ(StateKindOf("optim.state.layers.0.w.step", DType::kF32, false), "other");
  EXPECT_STREQ(StateKindOf("model.layers.0.w", DType::kBF16, false), "weights_16bit");
  EXPECT_STREQ(StateKindOf("model.layers.0.w", DType::kF16, false), "weights_16bit");
  EXPECT_STREQ(StateKindOf("model.layers.0.w", DType::kF32, false), "weights_fp32");
  EXPECT_STREQ(StateKindOf("model.layers.0.w", DType::kF64, false), "other");
  EXPECT_STREQ(StateKindOf("model.rope.inv_freq_exp_avg", DType::kF32, false), "weights_fp32");
  EXPECT_STREQ(StateKindOf("exp_avg", DType::kU8, true), "other");
}

TEST_P(GarbageCollection, UsageByKindCountsEachKindsDistinctChunksOnceAndItsCompression) {
  // 16-bit weights of little entropy (they compress), fp32 moments of
  // random bytes (they do not), a blob; a second checkpoint shares the
  // weights and changes the moments.
  std::vector<std::byte> weights(256 << 10);
  for (size_t i = 0; i < weights.size(); ++i) weights[i] = std::byte(i % 7 == 0 ? i / 7 : 0);
  auto save = [&](const std::string& name, uint32_t seed) {
    auto w = std::move(repo_->BeginCheckpoint(name, {0, 1, std::nullopt, {}})).value();
    auto m1 = RandomBytes(128 << 10, seed), m2 = RandomBytes(128 << 10, seed + 1);
    ASSERT_OK(w->PutTensor({"model.w", DType::kBF16, {weights.size() / 2}}, weights));
    ASSERT_OK(w->PutTensor({"optim.state.model.w.exp_avg", DType::kF32, {m1.size() / 4}}, m1));
    ASSERT_OK(w->PutTensor({"optim.state.model.w.exp_avg_sq", DType::kF32, {m2.size() / 4}}, m2));
    ASSERT_OK(w->PutBlob("extra", RandomBytes(1000, seed + 2)));
    ASSERT_OK(w->Commit().Wait());
  };
  save("a", 10);
  save("b", 20);
  auto kinds = repo_->UsageByKind({});
  ASSERT_OK(kinds);
  ASSERT_EQ(kinds->size(), std::size(kStateKinds));
  std::map<std::string, KindUsage> by;
  for (const KindUsage& k : *kinds) by[k.kind] = k;
  EXPECT_EQ(by["weights_16bit"].tensors, 2u);
  EXPECT_EQ(by["weights_16bit"].logical_bytes, 2 * weights.size());
  EXPECT_EQ(by["weights_16bit"].unique_raw_bytes, weights.size()) << "the second checkpoint's are the same chunks";
  EXPECT_LT(by["weights_16bit"].stored_bytes, weights.size() / 2) << "they compress";
  for (const char* moment : {"adam_exp_avg", "adam_exp_avg_sq"}) {
    EXPECT_EQ(by[moment].tensors, 2u) << moment;
    EXPECT_EQ(by[moment].unique_raw_bytes, 2u * (128 << 10)) << moment;
    EXPECT_GE(by[moment].stored_bytes, by[moment].unique_raw_bytes) << moment << ": random bytes stay raw";
  }
  EXPECT_EQ(by["weights_fp32"].tensors, 0u);
  EXPECT_EQ(by["other"].tensors, 2u);
  EXPECT_EQ(by["other"].logical_bytes, 2000u);
  // One checkpoint alone; an unknown one is NotFound.
  auto one = repo_->UsageByKind({"a"});
  ASSERT_OK(one);
  EXPECT_EQ((*one)[0].tensors, 1u);
  EXPECT_TRUE(repo_->UsageByKind({"nope"}).status().IsNotFound());
}

TEST(ThinRetention, TheDefaultRuleDropsOptimizerSchedulerAndRngStateAndPatternsKeepWhatTheyMatch) {
  const std::vector<std::string> none;
  for (const char* model : {"model.layers.0.attn.wq.weight", "lm_head.weight", "state_dict.layer.bias",
                            "config.json", "trainer_state.json", "model.optimum.weight", "rngx"}) {
    EXPECT_TRUE(ThinKeeps(model, DType::kBF16, false, none)) << model;
  }
  for (const char* state : {"optim.state.layers.0.w.exp_avg", "optim.state.layers.0.w.step",
                            "optim.param_groups.0.lr", "optimizer_states.0.state.3.exp_avg_sq",
                            "lr_schedulers.0.last_epoch", "optimizer.pt", "scheduler.pt", "rng_state_3.pth",
                            "extra/rng_states", "w.exp_avg", "w.momentum_buffer"}) {
    EXPECT_FALSE(ThinKeeps(state, DType::kF32, false, none)) << state;
  }
  const std::vector<std::string> patterns = {"model.*", "config.json"};
  EXPECT_TRUE(ThinKeeps("model.layers/0.w", DType::kF32, false, patterns));  // '*' crosses '.' and '/'
  EXPECT_TRUE(ThinKeeps("config.json", DType::kU8, true, patterns));
  EXPECT_FALSE(ThinKeeps("lm_head.weight", DType::kBF16, false, patterns));
  EXPECT_FALSE(ThinKeeps("configXjson", DType::kU8, true, patterns));
}

// Thin retention: the checkpoints older than the newest N keep "base" and
// drop "own"; each stays readable (and the newest N whole), keeps its
// step and its place in the order, says it was thinned, and the dropped
// bytes are reclaimed by the same gc. A reader of the whole version keeps
// reading it, and a second run has nothing left to do.
TEST_P(GarbageCollection, ThinningKeepsTheModelOfOldCheckpointsAndReclaimsTheRest) {
  const auto base = RandomBytes(200 << 10, 21);
  for (int i = 0; i < 4; ++i) Save("s" + std::to_string(i), i, 30 + i, base);
  auto whole = std::move(repo_->OpenCheckpoint("s0")).value();
  const auto before = std::move(repo_->ListCheckpoints()).value();
  GcOptions o;
  o.retention.thin_older_than = 2;
  o.retention.thin_keep = {"base"};
  auto dry = o;
  dry.dry_run = true;
  auto estimate = repo_->CollectGarbage(dry);
  ASSERT_OK(estimate);
  EXPECT_EQ(estimate->thinned, (std::vector<std::string>{"s0", "s1"}));
  ASSERT_EQ(estimate->retention.size(), 4u);
  EXPECT_TRUE(estimate->retention[1].thin);
  EXPECT_EQ(estimate->retention[1].thin_tensors, 1u);
  EXPECT_EQ(estimate->retention[1].thin_bytes, 300u << 10);
  EXPECT_FALSE(estimate->retention[2].thin);
  EXPECT_NE(estimate->retention[2].thin_why.find("among the newest 2"), std::string::npos);
  EXPECT_EQ(repo_->OpenCheckpoint("s0").value()->tensors().size(), 2u);  // a dry run changes nothing

  auto r = repo_->CollectGarbage(o);
  ASSERT_OK(r);
  EXPECT_EQ(r->thinned, (std::vector<std::string>{"s0", "s1"}));
  EXPECT_TRUE(r->removed.empty());
  EXPECT_EQ(r->retired_kept, 1u);  // s0's whole version, which `whole` reads
  const auto after = std::move(repo_->ListCheckpoints()).value();
  ASSERT_EQ(after.size(), before.size());
  for (size_t i = 0; i < after.size(); ++i) {
    EXPECT_EQ(after[i].name, before[i].name);  // the same order: s3 is still the newest
    EXPECT_EQ(after[i].step, before[i].step);
    EXPECT_EQ(after[i].sequence, before[i].sequence);
    EXPECT_EQ(after[i].tensor_count, i < 2 ? 1u : 2u);
    EXPECT_EQ(ThinnedNote(after[i].tags) != nullptr, i < 2) << after[i].name;
  }
  for (const char* name : {"s0", "s1"}) {
    auto thin = std::move(repo_->OpenCheckpoint(name)).value();
    ASSERT_EQ(thin->tensors().size(), 1u);
    std::vector<std::byte> got(base.size());
    ASSERT_OK(thin->ReadBytes(*thin->FindTensor("base"), 0, got));
    EXPECT_EQ(got, base);
    EXPECT_EQ(thin->FindTensor("own"), nullptr);
  }
  ExpectReadable("s2", base);
  ExpectReadable("s3", base);
  // The reader of the whole s0 still reads what it dropped.
  std::vector<std::byte> got(owns_["s0"].size());
  ASSERT_OK(whole->ReadBytes(*whole->FindTensor("own"), 0, got));
  EXPECT_EQ(got, owns_["s0"]);
  whole.reset();
  LeasesLetGo();
  const uint64_t packed = PackBytesOnDisk();
  GcOptions again = o;
  again.rewrite_below = 0.99;
  r = repo_->CollectGarbage(again);
  ASSERT_OK(r);
  EXPECT_TRUE(r->thinned.empty());  // nothing left to drop
  EXPECT_NE(r->retention[0].thin_why.find("thinned before, nothing to drop"), std::string::npos);
  // s0's and s1's own tensors (300 KiB each, random) are gone from the packs.
  EXPECT_GE(packed - PackBytesOnDisk() + (estimate->bytes_before - packed), 590u << 10);
  auto verify = repo_->Verify(std::nullopt);
  ASSERT_OK(verify);
  EXPECT_TRUE(verify->ok());
}

// A thinning renames over the version it read and no other: when the name
// was saved again (or removed) meanwhile, the thinned replacement is
// dropped and the name keeps what it holds. Tags under "ckptfs." are the
// engine's.
TEST_P(GarbageCollection, AThinningOfAVersionThatChangedMeanwhileLeavesTheNameAsItIs) {
  const auto base = RandomBytes(100 << 10, 22);
  Save("x", 1, 40, base);
  const auto first = std::move(repo_->ListCheckpoints()).value().at(0);
  Save("y", 2, 41, base);
  WriterOptions thin{0, 1, 1, {{kThinnedTag, "test"}}};
  auto refused = repo_->BeginCheckpoint("x", thin);
  EXPECT_TRUE(refused.status().code() == StatusCode::kInvalidArgument) << refused.status().ToString();
  thin.engine_tags = true;
  thin.overwrite = true;
  thin.thins = first.sequence + 100;  // not the version x holds
  thin.thins_committed_unix_ms = first.committed_unix_ms;
  auto w = std::move(repo_->BeginCheckpoint("x", thin)).value();
  ASSERT_OK(w->PutTensor({"base", DType::kU8, {base.size()}}, base));
  auto committed = w->Commit().Wait();
  EXPECT_TRUE(committed.status().code() == StatusCode::kFailedPrecondition) << committed.status().ToString();
  EXPECT_NE(committed.status().message().find("changed while it was being thinned"), std::string::npos);
  ExpectReadable("x", base);
  auto all = std::move(repo_->ListCheckpoints(/*include_pending=*/true)).value();
  EXPECT_EQ(all.size(), 2u);  // no replacement left behind
  // The right version is renamed over, keeping its place.
  thin.thins = first.sequence;
  w = std::move(repo_->BeginCheckpoint("x", thin)).value();
  ASSERT_OK(w->PutTensor({"base", DType::kU8, {base.size()}}, base));
  ASSERT_OK(w->Commit().Wait());
  auto list = std::move(repo_->ListCheckpoints()).value();
  ASSERT_EQ(list.size(), 2u);
  EXPECT_EQ(list[0].name, "x");
  EXPECT_EQ(list[0].sequence, first.sequence);
  EXPECT_EQ(list[0].tensor_count, 1u);
}

// A thinned checkpoint of several ranks keeps its world size and every
// rank's shards of what it keeps; a policy that removes some and thins
// others does both in one run; thinning that would keep no tensor leaves
// a checkpoint whole.
TEST_P(GarbageCollection, ThinningKeepsTheRanksOfAShardedCheckpointAndLeavesOneWithoutModelWhole) {
  const auto base = RandomBytes(128 << 10, 23);
  for (int step = 0; step < 3; ++step) {
    WriterOptions wo{0, 2, step, {}};
    wo.attempt = NewSaveAttempt();
    for (uint32_t rank = 0; rank < 2; ++rank) {
      wo.rank = rank;
      auto w = std::move(repo_->BeginCheckpoint("t" + std::to_string(step), wo)).value();
      const auto half = std::span(base).subspan(rank * (64 << 10), 64 << 10);
      HostSource model(half);
      ASSERT_OK(w->PutShard({"model.w", DType::kU8, {base.size()}}, Region::OfFlat(rank * (64 << 10), (rank + 1) * (64 << 10)), model));
      const auto moment = RandomBytes(64 << 10, 100 + step * 2 + rank);
      HostSource state(moment);
      ASSERT_OK(w->PutShard({"optim.state.model.w.exp_avg", DType::kF32, {base.size() / 4}},
                            Region::OfFlat(rank * (16 << 10), (rank + 1) * (16 << 10)), state));
      if (rank == 0) ASSERT_OK(w->PutBlob("rng_state.pth", RandomBytes(100, 7)));
      ASSERT_OK(w->Commit().Wait());
    }
  }
  {
    auto w = std::move(repo_->BeginCheckpoint("optim-only", {0, 1, 3, {}})).value();
    ASSERT_OK(w->PutTensor({"optimizer.exp_avg", DType::kF32, {16}}, RandomBytes(64, 8)));
    ASSERT_OK(w->Commit().Wait());
  }
  Save("newest", 4, 42, base);
  {
    // A thinning of t1 killed after its first rank's commit left a pending
    // replacement: the next thinning's newer attempt abandons it.
    WriterOptions killed{0, 2, 1, {}};
    killed.overwrite = true;
    killed.attempt = NewSaveAttempt();
    auto w = std::move(repo_->BeginCheckpoint("t1", killed)).value();
    ASSERT_OK(w->PutBlob("rng_state.pth", RandomBytes(10, 9)));
    ASSERT_OK(w->Commit().Wait());
    if (where_.kind() == RepoKind::kLocal) {
      EXPECT_EQ(repo_->ListCheckpoints(/*include_pending=*/true).value().size(), 6u);
    }
  }
  GcOptions o;
  o.retention.keep_last = 4;  // removes t0
  o.retention.thin_older_than = 1;
  auto r = repo_->CollectGarbage(o);
  ASSERT_OK(r);
  EXPECT_EQ(r->removed, (std::vector<std::string>{"t0"}));
  EXPECT_EQ(r->thinned, (std::vector<std::string>{"t1", "t2"}));
  EXPECT_NE(r->retention[3].thin_why.find("left whole"), std::string::npos) << r->retention[3].thin_why;
  for (const char* name : {"t1", "t2"}) {
    auto thin = std::move(repo_->OpenCheckpoint(name)).value();
    EXPECT_EQ(thin->info().world_size, 2u);
    ASSERT_EQ(thin->tensors().size(), 1u);
    EXPECT_TRUE(thin->blobs().empty());
    EXPECT_EQ(thin->tensors()[0].shards.size(), 2u);
    std::vector<std::byte> got(base.size());
    ASSERT_OK(thin->ReadBytes(thin->tensors()[0], 0, got));
    EXPECT_EQ(got, base);
  }
  EXPECT_EQ(repo_->OpenCheckpoint("optim-only").value()->tensors().size(), 1u);
  ExpectReadable("newest", base);
  EXPECT_EQ(repo_->ListCheckpoints(/*include_pending=*/true).value().size(), 4u);  // nothing pending
  RetentionPolicy zero;
  zero.thin_older_than = 0;
  EXPECT_TRUE(repo_->ExplainRetention(zero).status().code() == StatusCode::kInvalidArgument);
}

TEST_P(GarbageCollection, RetentionByStepAndByCommitOrder) {
  auto base = RandomBytes(1000, 1);
  for (int i = 0; i < 6; ++i) Save("s" + std::to_string(i), i * 100, i + 10, base);
  RetentionPolicy p;
  p.keep_last = 2;
  EXPECT_EQ(*repo_->PlanRetention(p), (std::vector<std::string>{"s0", "s1", "s2", "s3"}));
  p.keep_every = 200;
  EXPECT_EQ(*repo_->PlanRetention(p), (std::vector<std::string>{"s1", "s3"}));
  p.keep = {"s1"};
  EXPECT_EQ(*repo_->PlanRetention(p), (std::vector<std::string>{"s3"}));
  EXPECT_TRUE(repo_->PlanRetention({}).value().empty());
  RetentionPolicy unknown;
  unknown.keep = {"nope"};
  EXPECT_FALSE(repo_->PlanRetention(unknown).ok());
  // Without a step everywhere, commit order decides.
  Save("nostep", std::nullopt, 99, base);
  RetentionPolicy last1;
  last1.keep_last = 1;
  auto plan = *repo_->PlanRetention(last1);
  EXPECT_EQ(plan.size(), 6u);
  EXPECT_EQ(std::count(plan.begin(), plan.end(), "nostep"), 0);
}

// One checkpoint without a step (an import without --step) neither keeps
// nor shifts what --keep-every keeps, and every decision says why.
TEST_P(GarbageCollection, ACheckpointWithoutAStepNeverDisplacesSteppedOnesFromKeepEvery) {
  auto base = RandomBytes(1000, 1);
  Save("imported", std::nullopt, 1, base);
  for (int step = 5; step <= 30; step += 5) Save("step-" + std::to_string(step), step, step, base);
  RetentionPolicy p;
  p.keep_last = 2;
  p.keep_every = 10;
  auto decisions = repo_->ExplainRetention(p);
  ASSERT_OK(decisions);
  std::map<std::string, RetentionDecision> by_name;
  for (const auto& d : *decisions) by_name[d.name] = d;
  ASSERT_EQ(by_name.size(), 7u);
  for (const char* kept : {"step-10", "step-20", "step-30", "step-25", "imported"}) {
    EXPECT_TRUE(by_name[kept].keep) << kept << ": " << by_name[kept].why;
  }
  for (const char* gone : {"step-5", "step-15"}) EXPECT_FALSE(by_name[gone].keep) << gone;
  EXPECT_EQ(by_name["step-20"].why, "keep-every 10: step 20");
  EXPECT_EQ(by_name["step-30"].why, "keep-last 2: the newest by commit order; keep-every 10: step 30");
  EXPECT_EQ(by_name["step-15"].why,
            "keep-last 2: the 4th newest by commit order; keep-every 10: step 15 is not a multiple of 10");
  EXPECT_EQ(by_name["imported"].why, "keep-every 10: no step; the 1st of 1 without one, in commit order");
  EXPECT_EQ(*repo_->PlanRetention(p), (std::vector<std::string>{"step-5", "step-15"}));
  p = RetentionPolicy();
  p.keep_within_s = 129600;
  p.keep = {"step-5"};
  decisions = repo_->ExplainRetention(p);
  ASSERT_OK(decisions);
  for (const auto& d : *decisions) {
    EXPECT_TRUE(d.keep);
    if (d.name == "step-5") {
      EXPECT_EQ(d.why.rfind("--keep; keep-within 1d12h: committed ", 0), 0u) << d.why;
    }
  }
  GcOptions dry;
  dry.retention.keep_last = 2;
  dry.retention.keep_every = 10;
  dry.dry_run = true;
  auto report = repo_->CollectGarbage(dry);
  ASSERT_OK(report);
  EXPECT_EQ(report->retention.size(), 7u);
  EXPECT_EQ(report->removed, (std::vector<std::string>{"step-5", "step-15"}));
}

TEST_P(GarbageCollection, RetentionNeverRemovesTheNewestOrEveryCheckpointUnlessAllowed) {
  auto base = RandomBytes(1000, 1);
  Save("s1", 100, 1, base);
  Save("s2", 200, 2, base);
  // An asynchronous save in flight: one of its two ranks is in.
  auto pending = std::move(repo_->BeginCheckpoint("s3", {0, 2, 300, {}})).value();
  ASSERT_OK(pending->PutTensor({"base", DType::kU8, {base.size()}}, base));
  ASSERT_OK(pending->Commit().Wait());
  pending.reset();

  RetentionPolicy none_left;
  none_left.keep_last = 0;
  auto refused = repo_->PlanRetention(none_left);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("every checkpoint (2)"), std::string::npos) << refused.status().message();
  EXPECT_NE(refused.status().message().find("--allow-removing-newest"), std::string::npos);
  GcOptions wipe;
  wipe.retention = none_left;
  EXPECT_EQ(repo_->CollectGarbage(wipe).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(repo_->ListCheckpoints()->size(), 2u);  // nothing removed

  RetentionPolicy by_name;  // keeps s1, would drop the newest
  by_name.keep = {"s1"};
  auto newest = repo_->PlanRetention(by_name);
  ASSERT_FALSE(newest.ok());
  EXPECT_NE(newest.status().message().find("newest committed checkpoint 's2'"), std::string::npos)
      << newest.status().message();

  // keep-last 1 with the pending save in flight loses nothing that matters:
  // the newest committed stays, and the pending checkpoint completes.
  GcOptions last1;
  last1.retention.keep_last = 1;
  auto r = repo_->CollectGarbage(last1);
  ASSERT_OK(r);
  EXPECT_EQ(r->removed, (std::vector<std::string>{"s1"}));
  ExpectReadable("s2", base);
  auto rank1 = std::move(repo_->BeginCheckpoint("s3", {1, 2, 300, {}})).value();
  ASSERT_OK(rank1->PutTensor({"own", DType::kU8, {3}}, RandomBytes(3, 7)));
  ASSERT_OK(rank1->Commit().Wait());
  auto s3 = repo_->OpenCheckpoint("s3");
  ASSERT_OK(s3);
  std::vector<std::byte> got(base.size());
  ASSERT_OK((*s3)->ReadBytes(*(*s3)->FindTensor("base"), 0, got));
  EXPECT_EQ(got, base);

  // Said explicitly, the policy may remove everything.
  wipe.retention.allow_removing_newest = true;
  auto all = repo_->CollectGarbage(wipe);
  ASSERT_OK(all);
  EXPECT_EQ(all->removed.size(), 2u);
  EXPECT_TRUE(repo_->ListCheckpoints()->empty());
}

// A host that knew a checkpoint reads, after a refresh, the checkpoint now
// saved under its name elsewhere, not the one removed (and collected) under
// it: its catalog's record is replaced, not kept because the name matches.
TEST_P(GarbageCollection, ANameRemovedAndSavedAgainOnAnotherHostIsReadAsItIsNow) {
  const auto base = RandomBytes(200 << 10, 7);
  Save("x", 1, 1, base);
  const auto first = owns_["x"];
  const bool local = where_.kind() == RepoKind::kLocal;
  Repository* other = OtherHost();
  auto read_own = [&](Repository& repo, int64_t step) {
    auto r = repo.OpenCheckpoint("x");
    if (!r.ok()) return std::vector<std::byte>{};
    EXPECT_EQ((*r)->info().step, step);
    const TensorRecord* t = (*r)->FindTensor("own");
    std::vector<std::byte> got(t ? t->shape[0] : 0);
    EXPECT_OK((*r)->ReadBytes(*t, 0, got));
    return got;
  };
  EXPECT_EQ(read_own(*other, 1), first);
  ASSERT_OK(repo_->RemoveCheckpoints({"x"}));
  LeasesLetGo();
  GcOptions gc;
  gc.retention.keep_last = 1;
  Save("y", 5, 5, base);  // so that retention keeps a checkpoint
  ASSERT_OK(repo_->CollectGarbage(gc));
  Save("x", 2, 2, base);
  ASSERT_NE(owns_["x"], first);
  ASSERT_OK(other->Refresh());
  EXPECT_EQ(read_own(*other, 2), owns_["x"]);
  auto listed = other->ListCheckpoints();
  ASSERT_OK(listed);
  EXPECT_EQ(std::count_if(listed->begin(), listed->end(), [](const CheckpointRecord& c) { return c.name == "x"; }), 1);
  if (local) return;
  // The replaced record is what that host's catalog holds from now on.
  other_.reset();
  auto again = where_.Open({2, 1 << 20}, "other");
  ASSERT_OK(again);
  EXPECT_EQ(read_own(**again, 2), owns_["x"]);
}

// The same without a refresh: a long-lived process on another host (a
// training job's reader, the Python package) opens the name after it was
// removed, then after it was saved again there, and never gets the removed
// checkpoint's bytes. An open of a name its catalog has right costs one
// request (a HEAD of the manifest), no listing.
TEST_P(GarbageCollection, AHostThatDidNotSyncNeverReadsARemovedOrReplacedCheckpoint) {
  const auto base = RandomBytes(200 << 10, 8);
  Save("x", 1, 1, base);
  const auto first = owns_["x"];
  Repository* other = OtherHost();
  auto held = other->OpenCheckpoint("x");  // a reader kept across all that follows
  ASSERT_OK(held);
  if (where_.kind() == RepoKind::kS3) {  // the store whose requests are counted
    const RequestCounts before = other->store_requests();
    auto again = other->OpenCheckpoint("x");
    ASSERT_OK(again);
    const RequestCounts cost = other->store_requests() - before;
    EXPECT_EQ(cost.head, 1u);
    EXPECT_EQ(cost.list, 0u);
    EXPECT_EQ(cost.total(), 1u);
  }
  ASSERT_OK(repo_->RemoveCheckpoints({"x"}));
  auto gone = other->OpenCheckpoint("x");
  EXPECT_TRUE(gone.status().IsNotFound()) << gone.status().ToString();
  Save("x", 2, 2, base);
  ASSERT_NE(owns_["x"], first);
  auto now = other->OpenCheckpoint("x");
  ASSERT_OK(now);
  EXPECT_EQ((*now)->info().step, 2);
  std::vector<std::byte> got(owns_["x"].size());
  ASSERT_OK((*now)->ReadBytes(*(*now)->FindTensor("own"), 0, got));
  EXPECT_EQ(got, owns_["x"]);
  // The reader opened first keeps the checkpoint it opened.
  EXPECT_EQ((*held)->info().step, 1);
  got.resize(first.size());
  ASSERT_OK((*held)->ReadBytes(*(*held)->FindTensor("own"), 0, got));
  EXPECT_EQ(got, first);
}

TEST_P(GarbageCollection, KeepWithinKeepsWhatWasCommittedNearTheNewest) {
  auto base = RandomBytes(1000, 1);
  Save("old", 1, 1, base);
  std::this_thread::sleep_for(std::chrono::milliseconds(3100));
  Save("recent", 2, 2, base);
  Save("newest", 3, 3, base);
  RetentionPolicy p;
  p.keep_within_s = 2;
  EXPECT_EQ(*repo_->PlanRetention(p), (std::vector<std::string>{"old"}));
  p.keep_within_s = 3600;
  EXPECT_TRUE(repo_->PlanRetention(p)->empty());
  // Combined with keep-last, what either keeps stays.
  p.keep_within_s = 0;
  p.keep_last = 2;
  EXPECT_EQ(*repo_->PlanRetention(p), (std::vector<std::string>{"old"}));
}

TEST(Retention, DurationsAreNumbersWithUnitsSummed) {
  EXPECT_EQ(*ParseDuration("90"), 90u);
  EXPECT_EQ(*ParseDuration("36h"), 36u * 3600);
  EXPECT_EQ(*ParseDuration("1w2d"), 9u * 86400);
  EXPECT_EQ(*ParseDuration("1h30m15s"), 5415u);
  for (const char* bad : {"", "h", "1x", "1h30", "-5m", "1.5h", "99999999999999999999s"}) {
    auto r = ParseDuration(bad);
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << bad;
  }
}

TEST_P(GarbageCollection, ReclaimsExactlyWhatIsDeadAndRewritesMostlyDeadPacks) {
  auto base = RandomBytes(700 << 10, 1);  // shared by every checkpoint
  for (int i = 0; i < 5; ++i) Save("s" + std::to_string(i), i, i + 10, base);
  auto before = *repo_->DiskUsage({});
  EXPECT_GT(before.dedup_ratio(), 1.5);
  GcOptions o;
  o.retention.keep_last = 2;
  o.dry_run = true;
  auto dry = repo_->CollectGarbage(o);
  ASSERT_OK(dry);
  EXPECT_EQ(dry->removed.size(), 3u);
  EXPECT_EQ(repo_->ListCheckpoints()->size(), 5u);  // nothing changed
  o.dry_run = false;
  auto r = repo_->CollectGarbage(o);
  ASSERT_OK(r);
  EXPECT_EQ(r->removed, (std::vector<std::string>{"s0", "s1", "s2"}));
  EXPECT_GT(r->dead_chunks, 0u);
  // s1 and s2 had packs of their own; s0's pack also holds the shared base
  // and stays (more than half live).
  EXPECT_GT(r->bytes_reclaimed(), 2u * (300 << 10));
  // Stored bytes now match what the remaining checkpoints reference, within
  // the pack-rewrite threshold: no pack is less than half live.
  auto after = *repo_->DiskUsage({});
  EXPECT_EQ(after.referenced_bytes, r->live_bytes);
  EXPECT_LE(PackBytesOnDisk(), 2 * after.referenced_bytes + (64 << 10));
  EXPECT_EQ(PackBytesOnDisk(), after.pack_bytes);
  ExpectReadable("s3", base);
  ExpectReadable("s4", base);
  ExpectVerifies();
  // A second gc has nothing left to do.
  // (An object store's catalog mirrors the pack indexes, so the dead
  // chunks of a kept pack are still listed as dead there; nothing moves.)
  auto again = repo_->CollectGarbage({});
  ASSERT_OK(again);
  if (GetParam() == RepoKind::kLocal) {
    EXPECT_EQ(again->dead_chunks, 0u);
  }
  EXPECT_EQ(again->bytes_reclaimed(), 0u);
  EXPECT_EQ(again->packs_deleted, 0u);
  EXPECT_EQ(again->packs_written, 0u);
  EXPECT_EQ(PackBytesOnDisk(), after.pack_bytes);
}

TEST_F(LocalGarbageCollection, AnAbortedSaveLeavesNoPackAndGcRemovesThoseOfKilledSaves) {
  auto base = RandomBytes(1000, 1);
  Save("keep", 1, 1, base);
  const uint64_t kept = PackBytesOnDisk();
  auto big = RandomBytes(2 << 20, 5);
  {
    auto w = std::move(repo_->BeginCheckpoint("aborted", {0, 2, 2, {}})).value();
    ASSERT_OK(w->PutTensor({"x", DType::kU8, {big.size()}}, big));  // two packs sealed
    w->Abort();
  }
  EXPECT_EQ(PackBytesOnDisk(), kept);  // a save given up removes its packs
  {
    // A killed save cannot: its sealed packs stay, unknown to the catalog.
    auto objects = std::move(OpenLocalBackend(dir_ / "objects")).value();
    PackWriter killed(objects.get(), 1 << 20);
    for (size_t off = 0; off < big.size(); off += 64 << 10) {
      auto chunk = std::span<const std::byte>(big).subspan(off, 64 << 10);
      ASSERT_OK(killed.Add(ChunkId::Of(chunk), Codec::kRaw, 64 << 10, chunk));
    }
    ASSERT_OK(killed.Finish());
  }
  const uint64_t with_orphans = PackBytesOnDisk();
  ASSERT_GT(with_orphans, kept + (1 << 20));
  auto r = repo_->CollectGarbage({});
  ASSERT_OK(r);
  EXPECT_GE(r->orphan_packs, 1u);
  EXPECT_LT(PackBytesOnDisk(), with_orphans - (1 << 20));
  ExpectReadable("keep", base);
}

TEST_P(GarbageCollection, ReaderOpenedBeforeARewriteKeepsReading) {
  auto base = RandomBytes(200 << 10, 1);
  for (int i = 0; i < 4; ++i) Save("s" + std::to_string(i), i, i + 10, base);
  auto reader = std::move(repo_->OpenCheckpoint("s3")).value();
  GcOptions o;
  o.retention.keep = {"s3"};
  o.rewrite_below = 0.99;  // rewrite every pack that lost anything
  auto r = repo_->CollectGarbage(o);
  ASSERT_OK(r);
  EXPECT_GT(r->packs_rewritten, 0u);
  std::vector<std::byte> got(base.size());
  ASSERT_OK(reader->ReadBytes(*reader->FindTensor("base"), 0, got));
  EXPECT_EQ(got, base);
  got.resize(owns_["s3"].size());
  ASSERT_OK(reader->ReadBytes(*reader->FindTensor("own"), 0, got));
  EXPECT_EQ(got, owns_["s3"]);
}

// Two gc runs whose retention read the same list: the second finds some of
// its names removed by the first, and removes the rest (missing_ok); rm
// still refuses an unknown name and removes nothing.
TEST_P(GarbageCollection, RemovalOfNamesAnotherProcessRemovedSkipsThemWhenAsked) {
  auto base = RandomBytes(1000, 2);
  Save("s0", 0, 10, base);
  Save("s1", 1, 11, base);
  Save("s2", 2, 12, base);
  ASSERT_OK(repo_->RemoveCheckpoints({"s0"}));
  EXPECT_TRUE(repo_->RemoveCheckpoints({"s0", "s1"}).IsNotFound());
  EXPECT_EQ(repo_->ListCheckpoints().value().size(), 2u);  // nothing was removed
  ASSERT_OK(repo_->RemoveCheckpoints({"s0", "s1"}, /*missing_ok=*/true));
  auto left = repo_->ListCheckpoints().value();
  ASSERT_EQ(left.size(), 1u);
  EXPECT_EQ(left[0].name, "s2");
  ASSERT_OK(repo_->RemoveCheckpoints({"s0", "s1"}, /*missing_ok=*/true));  // all gone: nothing to do
}

TEST_P(GarbageCollection, AnOpenReaderKeepsARemovedCheckpointsBytesUntilItGoes) {
  auto base = RandomBytes(1000, 1);
  Save("s0", 0, 10, base);
  Save("s1", 1, 11, base);
  auto reader = std::move(repo_->OpenCheckpoint("s0")).value();
  ASSERT_OK(repo_->RemoveCheckpoints({"s0"}));
  // The name is gone at once...
  EXPECT_EQ(repo_->ListCheckpoints().value().size(), 1u);
  EXPECT_TRUE(repo_->OpenCheckpoint("s0").status().IsNotFound());
  EXPECT_TRUE(repo_->RemoveCheckpoints({"s0"}).IsNotFound());
  // ...the bytes stay while the reader lives, through gc and pack rewrites.
  GcOptions o;
  o.rewrite_below = 0.99;
  auto r = repo_->CollectGarbage(o);
  ASSERT_OK(r);
  EXPECT_EQ(r->retired_kept, 1u);
  EXPECT_EQ(r->retired_collected, 0u);
  std::vector<std::byte> got(owns_["s0"].size());
  ASSERT_OK(reader->ReadBytes(*reader->FindTensor("own"), 0, got));
  EXPECT_EQ(got, owns_["s0"]);
  auto u = repo_->DiskUsage({});
  ASSERT_OK(u);
  EXPECT_NEAR(static_cast<double>(u->retired_bytes), 300 << 10, 4096);
  const uint64_t before = PackBytesOnDisk();
  // The first gc after the reader went reclaims them.
  reader.reset();
  LeasesLetGo();
  r = repo_->CollectGarbage(o);
  ASSERT_OK(r);
  EXPECT_EQ(r->retired_collected, 1u);
  EXPECT_EQ(r->retired_kept, 0u);
  EXPECT_GE(before - PackBytesOnDisk(), 290u << 10);
  EXPECT_EQ(repo_->DiskUsage({}).value().retired_bytes, 0u);
  ExpectReadable("s1", base);
}

TEST_P(GarbageCollection, RetentionWithAReaderOfTheOldestRemovesTheNameAndKeepsTheBytes) {
  auto base = RandomBytes(1000, 1);
  for (int i = 0; i < 3; ++i) Save("s" + std::to_string(i), i, i + 10, base);
  auto reader = std::move(repo_->OpenCheckpoint("s0")).value();
  GcOptions o;
  o.retention.keep_last = 1;
  auto r = repo_->CollectGarbage(o);
  ASSERT_OK(r);
  EXPECT_EQ(r->removed, (std::vector<std::string>{"s0", "s1"}));
  EXPECT_EQ(r->retired_collected, 1u);  // s1: nobody reads it
  EXPECT_EQ(r->retired_kept, 1u);
  std::vector<std::byte> got(owns_["s0"].size());
  ASSERT_OK(reader->ReadBytes(*reader->FindTensor("own"), 0, got));
  EXPECT_EQ(got, owns_["s0"]);
}

TEST_P(GarbageCollection, ANameSavedAgainAfterRemovalIsANewCheckpointAndTheOldReaderKeepsTheOld) {
  auto base = RandomBytes(1000, 1);
  Save("x", 1, 10, base);
  const auto old_own = owns_["x"];
  auto old_reader = std::move(repo_->OpenCheckpoint("x")).value();
  ASSERT_OK(repo_->RemoveCheckpoints({"x"}));
  std::this_thread::sleep_for(std::chrono::milliseconds(5));  // another commit time
  Save("x", 2, 20, base);
  ASSERT_OK(repo_->CollectGarbage({}));
  std::vector<std::byte> got(old_own.size());
  ASSERT_OK(old_reader->ReadBytes(*old_reader->FindTensor("own"), 0, got));
  EXPECT_EQ(got, old_own);
  ExpectReadable("x", base);
  old_reader.reset();
  LeasesLetGo();
  auto r = repo_->CollectGarbage({});
  ASSERT_OK(r);
  EXPECT_EQ(r->retired_collected, 1u);
  ExpectReadable("x", base);
}

TEST_P(GarbageCollection, ALeaseTakenAfterCollectionSaysTheCheckpointIsGone) {
  auto base = RandomBytes(1000, 1);
  Save("s0", 0, 10, base);
  Save("s1", 1, 11, base);
  // As the mount does: a view without a lease, a lease per open file.
  auto view = std::move(repo_->OpenCheckpoint("s0", ReadOptions{.lease = false})).value();
  {
    auto lease = repo_->LeaseCheckpoint(*view);
    ASSERT_OK(lease);
    ASSERT_OK(repo_->RemoveCheckpoints({"s0"}));
    EXPECT_EQ(repo_->CollectGarbage({}).value().retired_kept, 1u);
    ASSERT_OK(repo_->LeaseCheckpoint(*view));  // a second file, while the first is open
  }
  LeasesLetGo(/*reader_kept=*/true);
  EXPECT_EQ(repo_->CollectGarbage({}).value().retired_collected, 1u);
  EXPECT_TRUE(repo_->LeaseCheckpoint(*view).status().IsNotFound());
}

TEST_F(LocalGarbageCollection, ALeaseIsAFileOnlyForACheckpointName) {
  // A name that is not one finds nothing and creates no lease file, inside
  // the repository or out of it.
  for (const std::string bad : {"../../escaped", "a/123", "..", "x y"}) {
    EXPECT_TRUE(repo_->OpenCheckpoint(bad).status().IsNotFound()) << bad;
  }
  EXPECT_FALSE(std::filesystem::exists(std::filesystem::path(dir_.path()).parent_path() / "escaped"));
  LeaseRegistry leases(dir_.path(), nullptr, {});
  EXPECT_EQ(leases.Acquire("../../escaped").code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(std::filesystem::exists(std::filesystem::path(dir_.path()).parent_path() / "escaped"));
  LocalLeaseScan scan(dir_.path());
  EXPECT_EQ(scan.Leased("../x").status().code(), StatusCode::kInvalidArgument);
}

TEST_F(LocalGarbageCollection, ReindexKeepsRemovedCheckpointsForGcToDecide) {
  auto base = RandomBytes(1000, 1);
  Save("s0", 0, 10, base);
  Save("s1", 1, 11, base);
  ASSERT_OK(repo_->RemoveCheckpoints({"s0"}));
  repo_.reset();
  ASSERT_OK(Repository::Reindex(dir_.path()));
  repo_ = std::move(Repository::Open(dir_.path(), {2, 1 << 20})).value();
  EXPECT_EQ(repo_->ListCheckpoints().value().size(), 1u);
  auto u = repo_->DiskUsage({});
  ASSERT_OK(u);
  EXPECT_EQ(u->retired_checkpoints, 1u);
  EXPECT_NEAR(static_cast<double>(u->retired_bytes), 300 << 10, 4096);
  EXPECT_EQ(repo_->CollectGarbage({}).value().retired_collected, 1u);
  ExpectReadable("s1", base);
}

TEST_F(LocalGarbageCollection, GcWaitsForSavesInFlight) {
  auto w = std::move(repo_->BeginCheckpoint("inflight", {0, 1, 1, {}})).value();
  // While a writer lives, the exclusive lock cannot be had...
  EXPECT_FALSE(RepoLock::TryAcquire(dir_.path(), RepoLock::Mode::kExclusive).ok());
  ASSERT_OK(w->Commit().Wait());
  w.reset();
  // ... and once it is gone it can.
  auto lock = RepoLock::TryAcquire(dir_.path(), RepoLock::Mode::kExclusive);
  EXPECT_OK(lock);
}

TEST_F(LocalGarbageCollection, AKeptCommitHandleDoesNotBlockGc) {
  auto w = std::move(repo_->BeginCheckpoint("kept", {0, 1, 1, {}})).value();
  CommitHandle handle = w->Commit();
  ASSERT_OK(handle.Wait());
  w.reset();  // the handle lives on
  EXPECT_OK(RepoLock::TryAcquire(dir_.path(), RepoLock::Mode::kExclusive));
}

TEST_P(GarbageCollection, RemoveIsAllOrNothing) {
  auto base = RandomBytes(1000, 1);
  Save("a", 1, 1, base);
  Save("b", 2, 2, base);
  EXPECT_TRUE(repo_->RemoveCheckpoints({"a", "missing"}).IsNotFound());
  EXPECT_EQ(repo_->ListCheckpoints()->size(), 2u);
  ASSERT_OK(repo_->RemoveCheckpoints({"a", "b"}));
  EXPECT_TRUE(repo_->ListCheckpoints()->empty());
}

TEST_P(GarbageCollection, DiskUsageCountsExclusiveBytes) {
  auto base = RandomBytes(500 << 10, 1);
  Save("a", 1, 1, base);
  Save("b", 2, 2, base);
  auto u = repo_->DiskUsage({"a"});
  ASSERT_OK(u);
  ASSERT_EQ(u->checkpoints.size(), 1u);
  const auto& a = u->checkpoints[0];
  EXPECT_EQ(a.logical_bytes, (500u << 10) + (300u << 10));
  EXPECT_GE(a.referenced_bytes, a.exclusive_bytes);
  EXPECT_NEAR(static_cast<double>(a.exclusive_bytes), 300 << 10, 1024);  // random bytes: stored raw
  EXPECT_NEAR(u->dedup_ratio(), (1600.0) / (1100.0), 0.01);
  EXPECT_FALSE(repo_->DiskUsage({"zzz"}).ok());
}

TEST_F(LocalGarbageCollection, DiskUsageSeparatesPendingUnreferencedAndUnrecordedSpace) {
  auto base = RandomBytes(1000, 1);
  Save("a", 1, 1, base);
  Save("b", 2, 2, base);
  auto pending_data = RandomBytes(200 << 10, 3);
  {
    auto w = std::move(repo_->BeginCheckpoint("p", {0, 2, 3, {}})).value();
    ASSERT_OK(w->PutTensor({"x", DType::kU8, {pending_data.size()}}, pending_data));
    ASSERT_OK(w->Commit().Wait());
  }
  ASSERT_OK(repo_->RemoveCheckpoints({"a"}));  // its own 300 KiB wait for gc, which no reader holds off
  {
    auto objects = std::move(OpenLocalBackend(dir_ / "objects")).value();
    PackWriter killed(objects.get(), 1 << 20);
    auto chunk = RandomBytes(64 << 10, 4);
    ASSERT_OK(killed.Add(ChunkId::Of(chunk), Codec::kRaw, 64 << 10, chunk));
    ASSERT_OK(killed.Finish());
  }
  auto u = repo_->DiskUsage({});
  ASSERT_OK(u);
  EXPECT_NEAR(static_cast<double>(u->pending_bytes), 200 << 10, 4096);  // random bytes: stored raw
  EXPECT_NEAR(static_cast<double>(u->retired_bytes), 300 << 10, 4096);
  EXPECT_EQ(u->retired_checkpoints, 1u);
  EXPECT_EQ(u->unreferenced_bytes, 0u);
  EXPECT_EQ(u->unrecorded_packs, 1u);
  EXPECT_GT(u->unrecorded_pack_bytes, 64u << 10);
  {
    // A killed save's pack that was never sealed: a temporary file.
    std::ofstream tmp(dir_ / "objects/packs/.tmp-killed", std::ios::binary);
    tmp << std::string(1000, 'x');
  }
  auto r = repo_->CollectGarbage({});
  ASSERT_OK(r);
  EXPECT_EQ(r->orphan_packs, 1u);
  EXPECT_EQ(r->temporary_bytes, 1000u);  // removed, and counted in what gc reclaimed
  EXPECT_GE(r->bytes_reclaimed(), (300u << 10) + u->unrecorded_pack_bytes + 1000);
  EXPECT_FALSE(std::filesystem::exists(dir_ / "objects/packs/.tmp-killed"));
  auto after = *repo_->DiskUsage({});
  EXPECT_EQ(after.unreferenced_bytes, 0u);
  EXPECT_EQ(after.retired_bytes, 0u);
  EXPECT_EQ(after.retired_checkpoints, 0u);
  EXPECT_EQ(r->retired_collected, 1u);
  EXPECT_EQ(after.unrecorded_packs, 0u);
  EXPECT_EQ(after.pending_bytes, u->pending_bytes);  // gc keeps what a pending rank wrote
}

TEST_P(GarbageCollection, StatsOfABf16TensorWithPlantedNaNsAndInfinities) {
  // bf16 is the top half of a float32.
  auto bf16 = [](float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    return static_cast<uint16_t>(bits >> 16);
  };
  std::vector<uint16_t> x(300000);
  double sum = 0, sum_sq = 0;
  uint64_t finite = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const float v = static_cast<float>(static_cast<int>(i % 17) - 8) * 0.5f;  // exact in bf16
    x[i] = bf16(v);
  }
  x[10] = 0x7fc0;   // NaN
  x[11] = 0xffc1;   // another NaN payload, negative
  x[20] = 0x7f80;   // +inf
  x[21] = 0xff80;   // -inf
  uint64_t zeros = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (i == 10 || i == 11 || i == 20 || i == 21) continue;
    const double v = static_cast<double>(static_cast<int>(i % 17) - 8) * 0.5;
    sum += v;
    sum_sq += v * v;
    ++finite;
    zeros += v == 0;
  }
  auto w = std::move(repo_->BeginCheckpoint("s", {0, 1, 1, {}})).value();
  ASSERT_OK(w->PutTensor({"x", DType::kBF16, {x.size()}}, std::as_bytes(std::span(x))));
  std::vector<int32_t> ints = {-3, 0, 5};
  ASSERT_OK(w->PutTensor({"i", DType::kI32, {3}}, std::as_bytes(std::span(ints))));
  std::vector<float> nans(4, std::nanf(""));
  ASSERT_OK(w->PutTensor({"n", DType::kF32, {4}}, std::as_bytes(std::span(nans))));
  ASSERT_OK(w->Commit().Wait());
  auto s = repo_->Stats("s", {});
  ASSERT_OK(s);
  ASSERT_EQ(s->size(), 3u);  // by name: i, n, x
  const TensorStats& bx = (*s)[2];
  EXPECT_EQ(bx.name, "x");
  EXPECT_EQ(bx.elements, x.size());
  EXPECT_EQ(bx.nan_count, 2u);
  EXPECT_EQ(bx.inf_count, 2u);
  EXPECT_EQ(bx.zero_count, zeros);
  EXPECT_EQ(*bx.min, -4.0);
  EXPECT_EQ(*bx.max, 4.0);
  const double mean = sum / finite;
  EXPECT_NEAR(*bx.mean, mean, 1e-12);
  EXPECT_NEAR(*bx.std, std::sqrt(sum_sq / finite - mean * mean), 1e-9);
  EXPECT_NEAR(bx.l2_norm, std::sqrt(sum_sq), 1e-6);
  EXPECT_EQ(*(*s)[0].min, -3.0);
  EXPECT_EQ((*s)[0].zero_count, 1u);
  EXPECT_EQ((*s)[1].nan_count, 4u);
  EXPECT_FALSE((*s)[1].mean.has_value());  // nothing finite
  auto one = repo_->Stats("s", {"i"});
  ASSERT_OK(one);
  EXPECT_EQ(one->size(), 1u);
  EXPECT_TRUE(repo_->Stats("s", {"nope"}).status().IsNotFound());
}

TEST_P(GarbageCollection, DiffReportsChangesSharingAndMaxAbsDiff) {
  std::vector<float> w(100000), w2;
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(i % 97) * 0.01f;
  w2 = w;
  w2[12345] += 0.5f;
  auto put = [&](const std::string& name, const std::vector<float>& data, bool with_extra) {
    auto wr = std::move(repo_->BeginCheckpoint(name, {0, 1, 1, {}})).value();
    ASSERT_OK(wr->PutTensor({"w", DType::kF32, {data.size()}}, std::as_bytes(std::span(data))));
    std::vector<uint16_t> same(1000, 7);
    ASSERT_OK(wr->PutTensor({"same", DType::kBF16, {1000}}, std::as_bytes(std::span(same))));
    std::vector<float> nan_in_b(10, 1.0f);
    if (with_extra) nan_in_b[3] = std::nanf("");
    ASSERT_OK(wr->PutTensor({"n", DType::kF32, {10}}, std::as_bytes(std::span(nan_in_b))));
    if (with_extra) ASSERT_OK(wr->PutTensor({"extra", DType::kU8, {3}}, RandomBytes(3, 1)));
    ASSERT_OK(wr->PutBlob("config", RandomBytes(100, 5)));
    ASSERT_OK(wr->PutBlob("rng", RandomBytes(100, with_extra ? 6 : 7)));
    ASSERT_OK(wr->Commit().Wait());
  };
  put("a", w, false);
  put("b", w2, true);
  auto d = repo_->Diff("a", "b");
  ASSERT_OK(d);
  std::map<std::string, TensorDiff> by, blobs;
  for (auto& x : *d) (x.blob ? blobs : by)[x.name] = x;
  EXPECT_EQ(by["extra"].kind, TensorDiff::Kind::kOnlyInB);
  EXPECT_EQ(by["same"].kind, TensorDiff::Kind::kUnchanged);
  EXPECT_EQ(*by["same"].relative_l2, 0.0);
  EXPECT_EQ(by["w"].kind, TensorDiff::Kind::kChanged);
  EXPECT_NEAR(*by["w"].max_abs_diff, 0.5, 1e-6);
  EXPECT_NEAR(*by["w"].mean_abs_diff, 0.5 / 100000, 1e-9);
  double norm = 0;
  for (float v : w) norm += double(v) * v;
  EXPECT_NEAR(*by["w"].relative_l2, 0.5 / std::sqrt(norm), 1e-9);
  EXPECT_GT(by["w"].shared_fraction, 0.8);  // one of seven chunks changed
  EXPECT_LT(by["w"].shared_fraction, 1.0);
  EXPECT_EQ(by["w"].chunks, 7u);
  EXPECT_EQ(by["w"].changed_chunks, 1u);
  EXPECT_TRUE(std::isinf(*by["n"].max_abs_diff));  // NaN against a number
  EXPECT_TRUE(std::isinf(*by["n"].relative_l2));
  EXPECT_EQ(blobs["config"].kind, TensorDiff::Kind::kUnchanged);
  EXPECT_EQ(blobs["rng"].kind, TensorDiff::Kind::kChanged);
  EXPECT_EQ(blobs["rng"].changed_chunks, 1u);
  EXPECT_FALSE(blobs["rng"].max_abs_diff.has_value());
}

}  // namespace
}  // namespace ckptfs
