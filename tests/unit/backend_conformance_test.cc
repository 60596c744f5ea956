// The contract of backend/backend.h, run against every backend.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <functional>
#include <thread>

#include "backend/backend.h"
#include "test_backends.h"
#include "test_util.h"

namespace ckptfs {
namespace {

using testing::AsBytes;
using testing::TempDir;

class BackendConformance : public testing::EachBackend {};

TEST_P(BackendConformance, PutThenReadRangeAndSize) {
  ASSERT_OK(backend_->Put("a/b/obj", AsBytes("hello world")));
  std::string out(5, '\0');
  ASSERT_OK(backend_->ReadRange("a/b/obj", 6, std::as_writable_bytes(std::span(out.data(), 5))));
  EXPECT_EQ(out, "world");
  EXPECT_EQ(*backend_->Size("a/b/obj"), 11u);
  EXPECT_EQ(*backend_->ReadAll("a/b/obj"), "hello world");
}

// Listed tags tell an object written again with other bytes from one left
// alone (a host's sync tells a checkpoint saved again under a name from the
// one it knew by them).
TEST_P(BackendConformance, ListedTagsChangeWhenAnObjectIsWrittenAgainWithOtherBytes) {
  ASSERT_OK(backend_->Put("m/a", AsBytes("first version")));
  ASSERT_OK(backend_->Put("m/b", AsBytes("left alone")));
  auto before = backend_->ListTagged("m/");
  ASSERT_OK(before);
  ASSERT_EQ(before->size(), 2u);
  EXPECT_EQ((*before)[0].key, "m/a");
  EXPECT_EQ((*before)[1].key, "m/b");
  EXPECT_FALSE((*before)[0].tag.empty());
  EXPECT_EQ(*backend_->List("m/"), (std::vector<std::string>{"m/a", "m/b"}));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // a file's time moves on
  ASSERT_OK(backend_->Delete("m/a"));
  ASSERT_OK(backend_->Put("m/a", AsBytes("second version")));
  auto after = backend_->ListTagged("m/");
  ASSERT_OK(after);
  ASSERT_EQ(after->size(), 2u);
  EXPECT_NE((*after)[0].tag, (*before)[0].tag);
  EXPECT_EQ((*after)[1].tag, (*before)[1].tag);
}

TEST_P(BackendConformance, ReadPastEndFailsInsteadOfShortRead) {
  ASSERT_OK(backend_->Put("obj", AsBytes("abc")));
  std::string out(4, '\0');
  EXPECT_FALSE(backend_->ReadRange("obj", 0, std::as_writable_bytes(std::span(out.data(), 4))).ok());
  EXPECT_FALSE(backend_->ReadRange("obj", 4, std::as_writable_bytes(std::span(out.data(), 1))).ok());
  EXPECT_OK(backend_->ReadRange("obj", 3, {}));
}

TEST_P(BackendConformance, MissingObjectsAreNotFound) {
  std::string out(1, '\0');
  EXPECT_TRUE(backend_->ReadRange("nope", 0, std::as_writable_bytes(std::span(out.data(), 1))).IsNotFound());
  EXPECT_TRUE(backend_->Size("nope").status().IsNotFound());
  EXPECT_TRUE(backend_->Delete("nope").IsNotFound());
}

TEST_P(BackendConformance, WriterIsInvisibleUntilCommit) {
  auto w = backend_->Create("packs/p1");
  ASSERT_OK(w);
  ASSERT_OK((*w)->Append(AsBytes("part1-")));
  ASSERT_OK((*w)->Append(AsBytes("part2")));
  EXPECT_EQ((*w)->size(), 11u);
  EXPECT_TRUE(backend_->Size("packs/p1").status().IsNotFound());
  EXPECT_TRUE(backend_->List("packs/")->empty());
  ASSERT_OK((*w)->Commit());
  EXPECT_EQ(*backend_->ReadAll("packs/p1"), "part1-part2");
  EXPECT_FALSE((*w)->Append(AsBytes("x")).ok());
}

TEST_P(BackendConformance, AbortedWriterLeavesNothing) {
  {
    auto w = backend_->Create("packs/p2");
    ASSERT_OK(w);
    ASSERT_OK((*w)->Append(AsBytes("data")));
    (*w)->Abort();
  }
  {
    auto w = backend_->Create("packs/p3");
    ASSERT_OK(w);
    ASSERT_OK((*w)->Append(AsBytes("data")));
    // destroyed without Commit
  }
  EXPECT_TRUE(backend_->List("")->empty());
}

TEST_P(BackendConformance, PutReplacesAtomically) {
  ASSERT_OK(backend_->Put("k", AsBytes("old")));
  ASSERT_OK(backend_->Put("k", AsBytes("newer")));
  EXPECT_EQ(*backend_->ReadAll("k"), "newer");
}

TEST_P(BackendConformance, PutIfAbsentNeverReplacesAndOneOfRacingWritersWins) {
  ASSERT_OK(backend_->PutIfAbsent("m/k", AsBytes("first")));
  Status again = backend_->PutIfAbsent("m/k", AsBytes("second"));
  EXPECT_TRUE(again.IsAlreadyExists()) << again.ToString();
  EXPECT_EQ(*backend_->ReadAll("m/k"), "first");
  // Racing writers of one key: exactly one wins, and its bytes are there.
  constexpr int kWriters = 12;
  std::vector<Status> results(kWriters);
  std::vector<std::thread> writers;
  for (int i = 0; i < kWriters; ++i) {
    writers.emplace_back([&, i] { results[i] = backend_->PutIfAbsent("m/race", AsBytes("writer " + std::to_string(i))); });
  }
  for (auto& t : writers) t.join();
  int winner = -1, wins = 0;
  for (int i = 0; i < kWriters; ++i) {
    if (results[i].ok()) {
      winner = i;
      ++wins;
    } else {
      EXPECT_TRUE(results[i].IsAlreadyExists()) << results[i].ToString();
    }
  }
  ASSERT_EQ(wins, 1);
  EXPECT_EQ(*backend_->ReadAll("m/race"), "writer " + std::to_string(winner));
  EXPECT_EQ(*backend_->List("m/"), (std::vector<std::string>{"m/k", "m/race"}));  // no temporary left
}

TEST_P(BackendConformance, ListIsSortedAndFilteredByPrefix) {
  for (const char* k : {"packs/b", "packs/a", "manifests/x.manifest", "packsx", "packs/sub/c"}) {
    ASSERT_OK(backend_->Put(k, AsBytes("1")));
  }
  EXPECT_EQ(*backend_->List("packs/"), (std::vector<std::string>{"packs/a", "packs/b", "packs/sub/c"}));
  EXPECT_EQ(*backend_->List("pack"),
            (std::vector<std::string>{"packs/a", "packs/b", "packs/sub/c", "packsx"}));
  EXPECT_EQ(backend_->List("")->size(), 5u);
  ASSERT_OK(backend_->Delete("packs/a"));
  EXPECT_EQ(*backend_->List("packs/"), (std::vector<std::string>{"packs/b", "packs/sub/c"}));
}

TEST_P(BackendConformance, RejectsInvalidKeys) {
  for (const char* k : {"", "/abs", "a/../b", "a//b", ".hidden", "a/.tmp", "sp ace", "a/"}) {
    EXPECT_FALSE(backend_->Put(k, AsBytes("x")).ok()) << k;
  }
}

TEST_P(BackendConformance, ConcurrentPutsAndReads) {
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 20; ++i) {
        std::string key = "c/" + std::to_string(t) + "-" + std::to_string(i);
        std::string value(1000 + i, static_cast<char>('a' + t));
        ASSERT_OK(backend_->Put(key, AsBytes(value)));
        EXPECT_EQ(*backend_->ReadAll(key), value);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(backend_->List("c/")->size(), 80u);
}

INSTANTIATE_TEST_SUITE_P(AllBackends, BackendConformance, testing::AllBackendFactories(),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace ckptfs
