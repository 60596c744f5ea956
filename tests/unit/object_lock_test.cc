// Lock objects (ckpt/object_lock.h) on every backend: shared and exclusive
// locks exclude each other, stale locks of crashed holders are ignored and
// removed, refreshes keep a held lock fresh, and racing acquirers never
// both win.
#include "ckpt/object_lock.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "test_backends.h"
#include "test_util.h"

namespace ckptfs {
namespace {

using namespace std::chrono_literals;
using Mode = ObjectLock::Mode;

class ObjectLocks : public testing::EachBackend {
 protected:
  ObjectLockOptions Options(std::string holder) {
    ObjectLockOptions o;
    o.holder = std::move(holder);
    o.refresh_interval = 200ms;
    o.stale_after = 2s;
    return o;
  }
};

TEST_P(ObjectLocks, SharedLocksCoexistAndExcludeAnExclusiveOne) {
  auto a = ObjectLock::Acquire(*backend_, Mode::kShared, Options("saver a"));
  ASSERT_OK(a);
  auto b = ObjectLock::Acquire(*backend_, Mode::kShared, Options("saver b"));
  ASSERT_OK(b);
  auto gc = ObjectLock::Acquire(*backend_, Mode::kExclusive, Options("gc"));
  ASSERT_EQ(gc.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(gc.status().message().find("shared lock of saver"), std::string::npos) << gc.status().message();
  a->reset();
  b->reset();
  auto gc2 = ObjectLock::Acquire(*backend_, Mode::kExclusive, Options("gc"));
  ASSERT_OK(gc2);
  auto late = ObjectLock::Acquire(*backend_, Mode::kShared, Options("saver c"));
  ASSERT_EQ(late.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(late.status().message().find("exclusive lock of gc"), std::string::npos) << late.status().message();
  // The failed attempts left nothing behind.
  auto locks = ListObjectLocks(*backend_, Options("x"));
  ASSERT_OK(locks);
  ASSERT_EQ(locks->size(), 1u);
  EXPECT_EQ((*locks)[0].key, (*gc2)->key());
  gc2->reset();
  EXPECT_TRUE(ListObjectLocks(*backend_, Options("x"))->empty());
}

TEST_P(ObjectLocks, TakingASharedLockReadsNoOtherSharedLock) {
  // Saves on many hosts take shared locks at once: each must cost a fixed
  // number of requests, not one per save in flight.
  std::vector<std::unique_ptr<ObjectLock>> held;
  for (int i = 0; i < 8; ++i) {
    auto l = ObjectLock::Acquire(*backend_, Mode::kShared, Options("saver " + std::to_string(i)));
    ASSERT_OK(l);
    held.push_back(std::move(l).value());
  }
  // Nor does its listing name them: the answer stays small however many
  // saves are in flight.
  class Listings : public BackendWrapper {
   public:
    using BackendWrapper::BackendWrapper;
    Result<std::vector<std::string>> List(std::string_view prefix) override {
      auto keys = inner().List(prefix);
      if (keys.ok()) listed += keys->size();
      return keys;
    }
    size_t listed = 0;
  };
  Listings spy(std::shared_ptr<Backend>(backend_.get(), [](Backend*) {}));
  auto spied = ObjectLock::Acquire(spy, Mode::kShared, Options("saver 9"));
  ASSERT_OK(spied);
  EXPECT_EQ(spy.listed, 0u);
  spied->reset();
  const RequestCounts before = backend_->Requests();
  if (before.total() == 0) GTEST_SKIP() << "this backend counts no requests";
  auto mine = ObjectLock::Acquire(*backend_, Mode::kShared, Options("saver 8"));
  ASSERT_OK(mine);
  const RequestCounts cost = backend_->Requests() - before;
  EXPECT_EQ(cost.put, 1u);
  EXPECT_EQ(cost.list, 1u);
  EXPECT_EQ(cost.get, 0u);
  // An exclusive lock elsewhere is still seen (its object is read).
  held.clear();
  mine->reset();
  auto gc = ObjectLock::Acquire(*backend_, Mode::kExclusive, Options("gc"));
  ASSERT_OK(gc);
  auto late = ObjectLock::Acquire(*backend_, Mode::kShared, Options("late saver"));
  ASSERT_EQ(late.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(late.status().message().find("exclusive lock of gc"), std::string::npos) << late.status().message();
}

TEST_P(ObjectLocks, AWaiterGetsTheLockWhenItsHolderLetsGo) {
  auto saver = ObjectLock::Acquire(*backend_, Mode::kShared, Options("saver"));
  ASSERT_OK(saver);
  std::thread release([&] {
    std::this_thread::sleep_for(300ms);
    saver->reset();
  });
  ObjectLockOptions waiting = Options("gc");
  waiting.wait = 10s;
  auto gc = ObjectLock::Acquire(*backend_, Mode::kExclusive, waiting);
  release.join();
  ASSERT_OK(gc);
}

TEST_P(ObjectLocks, ACrashedHoldersLockGoesStaleAndIsRemoved) {
  // A holder whose clock says it took the lock an hour ago and never
  // refreshed it: a process that died.
  ObjectLockOptions dead = Options("crashed saver");
  dead.now_unix_ms = [] {
    return static_cast<uint64_t>(
               std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
                   .count()) -
           3600 * 1000;
  };
  dead.refresh_interval = 1h;
  auto crashed = ObjectLock::Acquire(*backend_, Mode::kShared, dead);
  ASSERT_OK(crashed);
  auto gc = ObjectLock::Acquire(*backend_, Mode::kExclusive, Options("gc"));
  ASSERT_OK(gc);  // the stale lock does not block it
  auto locks = ListObjectLocks(*backend_, Options("x"));
  ASSERT_OK(locks);
  ASSERT_EQ(locks->size(), 2u);
  size_t stale = 0;
  for (const auto& l : *locks) stale += l.stale ? 1 : 0;
  EXPECT_EQ(stale, 1u);
  auto removed = RemoveStaleObjectLocks(*backend_, Options("gc"));
  ASSERT_OK(removed);
  EXPECT_EQ(*removed, 1u);
  EXPECT_EQ(ListObjectLocks(*backend_, Options("x"))->size(), 1u);
}

TEST_P(ObjectLocks, RefreshesKeepAHeldLockFresh) {
  // A wider margin than the other tests: a refresh is one PUT, which a
  // busy test server can take over a second to answer.
  ObjectLockOptions options = Options("long save");
  options.stale_after = 3s;
  auto held = ObjectLock::Acquire(*backend_, Mode::kShared, options);
  ASSERT_OK(held);
  // Longer than stale_after: without refreshes it would go stale.
  const auto until = std::chrono::steady_clock::now() + 4s;
  while (std::chrono::steady_clock::now() < until) {
    ObjectLockOptions observer = Options("observer");
    observer.stale_after = options.stale_after;
    auto locks = ListObjectLocks(*backend_, observer);
    ASSERT_OK(locks);
    ASSERT_EQ(locks->size(), 1u);
    EXPECT_FALSE((*locks)[0].stale);
    ASSERT_OK((*held)->Check());
    std::this_thread::sleep_for(250ms);
  }
  auto gc = ObjectLock::Acquire(*backend_, Mode::kExclusive, Options("gc"));
  EXPECT_EQ(gc.status().code(), StatusCode::kFailedPrecondition);
}

TEST_P(ObjectLocks, RacingAcquirersNeverBothHoldConflictingLocks) {
  std::atomic<int> exclusive_inside{0}, shared_inside{0}, violations{0}, exclusive_taken{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 4; ++i) {
        const Mode mode = (t + i) % 2 ? Mode::kExclusive : Mode::kShared;
        ObjectLockOptions o = Options("thread " + std::to_string(t));
        o.wait = 60s;
        auto lock = ObjectLock::Acquire(*backend_, mode, o);
        ASSERT_OK(lock);
        if (mode == Mode::kExclusive) {
          if (exclusive_inside++ != 0 || shared_inside != 0) ++violations;
          ++exclusive_taken;
          std::this_thread::sleep_for(20ms);
          --exclusive_inside;
        } else {
          ++shared_inside;
          if (exclusive_inside != 0) ++violations;
          std::this_thread::sleep_for(20ms);
          --shared_inside;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(violations, 0);
  EXPECT_EQ(exclusive_taken, 8);
  EXPECT_TRUE(ListObjectLocks(*backend_, Options("x"))->empty());
}

TEST_P(ObjectLocks, AnUnreadableLockObjectBlocksAndIsNamed) {
  ASSERT_OK(backend_->Put("locks/exclusive-foreign", testing::AsBytes("not a lock")));
  auto lock = ObjectLock::Acquire(*backend_, Mode::kShared, Options("saver"));
  ASSERT_EQ(lock.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(lock.status().message().find("locks/exclusive-foreign"), std::string::npos) << lock.status().message();
}

INSTANTIATE_TEST_SUITE_P(AllBackends, ObjectLocks, testing::AllBackendFactories(),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace ckptfs
