// Planning collective saves and restores (AssignSaveOwners,
// AssignLoadReaders): replicated regions go to one rank each, balanced by
// bytes, the same answer wherever it is computed; and how the planning
// time grows with the number of ranks.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>

#include "ckpt/collective_plan.h"

namespace ckptfs {
namespace {

PlanEntry Rows(const std::string& name, uint64_t rows, uint64_t cols, uint64_t first, uint64_t count) {
  return {name, {rows, cols}, Region::OfBox(Box{{first, 0}, {count, cols}}), count * cols * 4};
}
PlanEntry Whole(const std::string& name, uint64_t n) { return {name, {n}, Region::OfBox(Box{{0}, {n}}), n * 4}; }

// HSDP: `groups` replica groups of `shards` ranks; rank r holds rows
// (r % shards) of each of `tensors` tensors, and every rank a whole norm.
std::vector<std::vector<PlanEntry>> Hsdp(int groups, int shards, int tensors, uint64_t rows = 64) {
  std::vector<std::vector<PlanEntry>> ranks(groups * shards);
  for (int r = 0; r < groups * shards; ++r) {
    const uint64_t part = rows / shards;
    for (int t = 0; t < tensors; ++t) {
      ranks[r].push_back(Rows("layers." + std::to_string(t) + ".w", rows, 32, (r % shards) * part, part));
    }
    ranks[r].push_back(Whole("norm", 32));
  }
  return ranks;
}

TEST(CollectivePlan, EachReplicatedRegionIsPutByOneRankBalancedByBytes) {
  const auto ranks = Hsdp(2, 2, 8);
  SaveOwners owners = AssignSaveOwners(ranks);
  ASSERT_EQ(owners.put.size(), 4u);
  // Every region (shard s of tensor t, and the norm) is put exactly once,
  // by a rank that holds it.
  std::map<std::string, int> times;
  for (size_t r = 0; r < ranks.size(); ++r) {
    for (size_t i = 0; i < ranks[r].size(); ++i) {
      if (owners.put[r][i]) times[ranks[r][i].name + ranks[r][i].region.ToString()]++;
    }
  }
  EXPECT_EQ(times.size(), 8u * 2 + 1);
  for (const auto& [key, n] : times) EXPECT_EQ(n, 1) << key;
  const uint64_t shard = 32 * 32 * 4;
  EXPECT_EQ(owners.unique_bytes, 16 * shard + 32 * 4);
  EXPECT_EQ(owners.held_bytes, 4 * (8 * shard + 32 * 4));
  // Balanced: the two replicas of each shard split its tensors.
  for (uint64_t b : owners.bytes_per_rank) {
    EXPECT_GE(b, 4 * shard);
    EXPECT_LE(b, 4 * shard + 32 * 4);
  }
}

TEST(CollectivePlan, AContiguousBoxAndItsFlatRangeAreOneRegion) {
  std::vector<std::vector<PlanEntry>> ranks(2);
  ranks[0].push_back(Rows("w", 8, 4, 2, 3));
  ranks[1].push_back({"w", {8, 4}, Region::OfFlat(8, 20), 48});
  // Overlapping but not equal: kept on both ranks.
  ranks[0].push_back(Rows("v", 8, 4, 0, 4));
  ranks[1].push_back(Rows("v", 8, 4, 2, 4));
  SaveOwners owners = AssignSaveOwners(ranks);
  EXPECT_EQ(owners.put[0][0] + owners.put[1][0], 1);
  EXPECT_EQ(owners.put[0][1], 1);
  EXPECT_EQ(owners.put[1][1], 1);
}

TEST(CollectivePlan, BlobsOfOneNameAreOneRegion) {
  std::vector<std::vector<PlanEntry>> ranks(3);
  for (auto& r : ranks) r.push_back({"rng", {}, Region::OfFlat(0, 0), 100});
  SaveOwners owners = AssignSaveOwners(ranks);
  EXPECT_EQ(owners.put[0][0] + owners.put[1][0] + owners.put[2][0], 1);
  EXPECT_EQ(owners.unique_bytes, 100u);
}

TEST(CollectivePlan, EveryNeededRegionIsFetchedOnceAndReachesEveryRankNeedingIt) {
  // Pure data parallelism: 4 ranks need everything.
  std::vector<std::vector<PlanEntry>> ranks(4);
  for (auto& r : ranks) {
    for (int t = 0; t < 6; ++t) r.push_back(Whole("t" + std::to_string(t), 1000 * (t + 1)));
  }
  LoadRoutes routes = AssignLoadReaders(ranks);
  ASSERT_EQ(routes.routes.size(), 6u);
  EXPECT_EQ(routes.needed_bytes, 4 * routes.unique_bytes);
  for (const LoadRoute& route : routes.routes) {
    ASSERT_EQ(route.needers.size(), 4u);
    bool reader_needs_it = false;
    for (const auto& [rank, index] : route.needers) {
      EXPECT_EQ(ranks[rank][index].bytes, route.bytes);
      reader_needs_it |= rank == route.reader;
    }
    EXPECT_TRUE(reader_needs_it);
  }
  // Largest first, then to the least loaded: sizes 6,5,4,3,2,1 (x4000) go
  // to ranks 0,1,2,3,3,2.
  std::vector<int> readers;
  for (const auto& route : routes.routes) readers.push_back(route.reader);
  EXPECT_EQ(readers, (std::vector<int>{0, 1, 2, 3, 3, 2}));
}

TEST(CollectivePlan, TheSameInputGivesTheSamePlanWhateverTheEntryOrder) {
  auto ranks = Hsdp(2, 4, 16);
  SaveOwners a = AssignSaveOwners(ranks);
  for (auto& r : ranks) std::reverse(r.begin(), r.end());
  SaveOwners b = AssignSaveOwners(ranks);
  for (size_t r = 0; r < ranks.size(); ++r) {
    const size_t n = ranks[r].size();
    for (size_t i = 0; i < n; ++i) EXPECT_EQ(a.put[r][i], b.put[r][n - 1 - i]) << r << " " << i;
  }
  EXPECT_EQ(a.bytes_per_rank, b.bytes_per_rank);
}

// The planning time at 8, 64 and 512 simulated ranks (HSDP, 8 shards a
// group, 200 tensors a rank): printed, and bounded loosely so that a
// quadratic plan would fail at 512 (N log N keeps it well under a second).
TEST(CollectivePlan, PlanningTimeGrowsAsNLogN) {
  double per_entry_8 = 0;
  for (int world : {8, 64, 512}) {
    const auto ranks = Hsdp(world / 8, 8, 200);
    const auto start = std::chrono::steady_clock::now();
    SaveOwners owners = AssignSaveOwners(ranks);
    LoadRoutes routes = AssignLoadReaders(ranks);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const double entries = static_cast<double>(world) * 201;
    std::printf("planning at %d ranks (%.0f entries): %.3f s (save and load plans)\n", world, entries, s);
    EXPECT_EQ(owners.unique_bytes, routes.unique_bytes);
    if (world == 8) per_entry_8 = s / entries;
    if (world == 512) {
      EXPECT_LT(s, 20.0);
      // 64 times the entries: a quadratic plan would take 4096 times as
      // long; N log N about 100 times at most here.
      EXPECT_LT(s / entries, std::max(per_entry_8, 1e-7) * 40) << "per-entry planning time grew too fast";
    }
  }
}

}  // namespace
}  // namespace ckptfs
