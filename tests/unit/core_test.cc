// Status, dtypes, random ids, chunk ids and content-defined cuts.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <future>
#include <mutex>
#include <thread>
#include <vector>
#include <set>

#include "core/chunk_id.h"
#include "core/content_cuts.h"
#include "core/dtype.h"
#include "core/random.h"
#include "core/status.h"
#include "core/text.h"
#include "core/thread_pool.h"

namespace ckptfs {
namespace {

TEST(Text, Utf8IsCheckedAndEscapedForTerminals) {
  EXPECT_TRUE(IsValidUtf8("layers.0.w"));
  EXPECT_TRUE(IsValidUtf8("\xce\xb1\xe2\x82\xac\xf0\x9f\x98\x80"));  // alpha, euro, an emoji
  for (const char* bad : {"\xff", "\xc0\xaf", "\xe0\x80\xaf", "\xed\xa0\x80", "\xf4\x90\x80\x80", "\xe2\x82"}) {
    EXPECT_FALSE(IsValidUtf8(bad)) << bad;  // stray, overlong, surrogate, past U+10FFFF, cut short
  }
  EXPECT_TRUE(HasControlCharacter("a\x1b[31mb"));
  EXPECT_TRUE(HasControlCharacter("a\xc2\x9b"));  // C1 CSI
  EXPECT_FALSE(HasControlCharacter("\xce\xb1 b"));
  EXPECT_EQ(EscapeForTerminal("a\x1b[2Jb\xff\xce\xb1"), "a\\x1b[2Jb\\xff\xce\xb1");
  EXPECT_EQ(EscapeForTerminal(EscapeForTerminal("a\x1b")), "a\\x1b");
  EXPECT_EQ(ToValidUtf8("a\xff" "b\xce\xb1"), "a\xef\xbf\xbd" "b\xce\xb1");
  EXPECT_EQ(RedactUrl("https://me:s3cret@s3.example.com:8443/x"), "https://me:***@s3.example.com:8443/x");
  EXPECT_EQ(RedactUrl("http://127.0.0.1:7480"), "http://127.0.0.1:7480");
  EXPECT_EQ(RedactUrl("http://user@host/a:b@c"), "http://user@host/a:b@c");
}

TEST(Status, OkIsCheapAndErrorsCarryCodeAndMessage) {
  Status ok;
  EXPECT_TRUE(ok.ok());
  EXPECT_EQ(ok.ToString(), "OK");
  Status e = Status::NotFound("no checkpoint named 'x'");
  EXPECT_TRUE(e.IsNotFound());
  EXPECT_EQ(e.ToString(), "NotFound: no checkpoint named 'x'");
  EXPECT_EQ(e.WithContext("ls").message(), "ls: no checkpoint named 'x'");
  EXPECT_TRUE(Status::OK().WithContext("ignored").ok());
}

TEST(Status, ADetailIsKeptWithContextAndApartFromTheMessage) {
  Status plain = Status::NotFound("bucket 'b' does not exist");
  EXPECT_EQ(plain.detail(), StatusDetail::kNone);
  Status missing = plain.WithDetail(StatusDetail::kBucketMissing);
  EXPECT_EQ(missing.detail(), StatusDetail::kBucketMissing);
  EXPECT_EQ(missing.code(), StatusCode::kNotFound);
  EXPECT_EQ(missing.message(), plain.message());
  EXPECT_EQ(plain.detail(), StatusDetail::kNone);  // a copy, the original unchanged
  Status wrapped = missing.WithContext("reading ckptfs.json");
  EXPECT_EQ(wrapped.detail(), StatusDetail::kBucketMissing);
  EXPECT_EQ(wrapped.message(), "reading ckptfs.json: bucket 'b' does not exist");
  EXPECT_EQ(Status::OK().WithDetail(StatusDetail::kCatalogMapFull).detail(), StatusDetail::kNone);
}

TEST(Status, ErrnoMapsToCodes) {
  EXPECT_EQ(Status::FromErrno(ENOSPC, "writing").code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(Status::FromErrno(EDQUOT, "writing").code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(Status::FromErrno(ENOENT, "opening").code(), StatusCode::kNotFound);
  EXPECT_EQ(Status::FromErrno(EEXIST, "creating").code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(Status::FromErrno(EIO, "reading").code(), StatusCode::kIOError);
  EXPECT_NE(Status::FromErrno(ENOSPC, "writing x").message().find("No space left on device"), std::string::npos);
}

TEST(Result, HoldsValueOrError) {
  Result<int> v = 3;
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(*v, 3);
  Result<int> e = Status::Corruption("bad");
  EXPECT_TRUE(e.status().IsCorruption());
}

TEST(DType, EverySafetensorsDTypeRoundTrips) {
  const char* names[] = {"BOOL", "U8",  "I8",  "U16", "I16", "U32",    "I32",    "U64",
                         "I64",  "F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2"};
  const uint32_t sizes[] = {1, 1, 1, 2, 2, 4, 4, 8, 8, 2, 2, 4, 8, 1, 1};
  for (int i = 0; i < kDTypeCount; ++i) {
    auto dt = ParseDType(names[i]);
    ASSERT_TRUE(dt.has_value()) << names[i];
    EXPECT_EQ(DTypeName(*dt), names[i]);
    EXPECT_EQ(DTypeSize(*dt), sizes[i]) << names[i];
    EXPECT_EQ(DTypeFromCode(i), dt);
  }
  EXPECT_FALSE(ParseDType("F8").has_value());
  EXPECT_FALSE(ParseDType("bf16").has_value());
  EXPECT_FALSE(DTypeFromCode(kDTypeCount).has_value());
  EXPECT_EQ(NumpyDescr(DType::kBF16), "<u2");  // bits kept in a same-width unsigned type
  EXPECT_EQ(NumpyDescr(DType::kF8E4M3), "|u1");
}

TEST(ChunkHasher, PiecesHashLikeTheirConcatenation) {
  std::vector<std::byte> data(700 << 10);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<std::byte>((i * 2654435761u) >> 13);
  const ChunkId whole = ChunkId::Of(data);
  ChunkHasher h;
  for (size_t piece : {size_t{1}, size_t{4096}, size_t{256 << 10}, data.size()}) {
    h.Reset();
    for (size_t at = 0; at < data.size(); at += piece) {
      h.Update(std::span(data).subspan(at, std::min(piece, data.size() - at)));
    }
    EXPECT_EQ(h.Finish(), whole) << piece;
  }
  h.Reset();
  EXPECT_EQ(h.Finish(), ChunkId::Of({}));
  data[data.size() - 1] ^= std::byte{1};
  h.Reset();
  h.Update(data);
  EXPECT_NE(h.Finish(), whole);
}

// Cuts depend on the bytes, not on their offset: after an insertion the
// cuts past it are the old ones shifted, once they agree again.
TEST(ContentCuts, ChunksStayWithinTheirBoundsAndFollowTheBytesWhenTheyMove) {
  std::vector<std::byte> data(3 << 20);
  uint64_t x = 7;
  for (auto& b : data) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    b = std::byte(x >> 56);
  }
  for (size_t target : {size_t{4096}, size_t{65536}, size_t{100000}}) {
    std::vector<uint64_t> ends;
    ContentCuts(data, target, ends);
    const size_t t = size_t{1} << (63 - __builtin_clzll(target));
    EXPECT_EQ(ContentCutsMaxChunk(target), 2 * t);
    ASSERT_FALSE(ends.empty());
    EXPECT_EQ(ends.back(), data.size());
    uint64_t start = 0;
    for (size_t i = 0; i < ends.size(); ++i) {
      ASSERT_GT(ends[i], start);
      EXPECT_LE(ends[i] - start, 2 * t);
      if (i + 1 < ends.size()) {
        EXPECT_GT(ends[i] - start, t / 8);
      }
      start = ends[i];
    }
    // The mean is near the target (random bytes): between a half and twice.
    const double mean = double(data.size()) / double(ends.size());
    EXPECT_GT(mean, t / 2.0);
    EXPECT_LT(mean, 2.0 * t);

    // 777 bytes inserted at 1 MiB: the cuts after 1 MiB + 4 x the largest
    // chunk are the old ones, 777 bytes later.
    std::vector<std::byte> moved(data.begin(), data.begin() + (1 << 20));
    moved.insert(moved.end(), 777, std::byte{0x5a});
    moved.insert(moved.end(), data.begin() + (1 << 20), data.end());
    std::vector<uint64_t> moved_ends;
    ContentCuts(moved, target, moved_ends);
    std::set<uint64_t> old_after, new_after;
    for (uint64_t e : ends) {
      if (e > (1u << 20) + 8 * t) old_after.insert(e + 777);
    }
    for (uint64_t e : moved_ends) {
      if (e > (1u << 20) + 777 + 8 * t) new_after.insert(e);
    }
    EXPECT_EQ(old_after, new_after) << "target " << target;
    // And before the insertion, nothing moved.
    for (size_t i = 0; i < ends.size() && ends[i] < (1u << 20); ++i) {
      EXPECT_EQ(ends[i], moved_ends[i]);
    }
  }
  std::vector<uint64_t> none;
  ContentCuts({}, 4096, none);
  EXPECT_TRUE(none.empty());
  ContentCuts(std::span(data).first(100), 4096, none);  // under the least chunk: one
  EXPECT_EQ(none, std::vector<uint64_t>{100});
}

TEST(RandomHex, DistinctAndForkSafe) {
  std::set<std::string> seen;
  for (int i = 0; i < 1000; ++i) {
    std::string id = RandomHex(24);
    ASSERT_EQ(id.size(), 24u);
    ASSERT_EQ(id.find_first_not_of("0123456789abcdef"), std::string::npos);
    seen.insert(id);
  }
  EXPECT_EQ(seen.size(), 1000u);
  // The generator was used before fork: the child must not repeat the parent.
  int pipefd[2];
  ASSERT_EQ(::pipe(pipefd), 0);
  pid_t pid = ::fork();
  if (pid == 0) {
    std::string id = RandomHex(24);
    ssize_t w = ::write(pipefd[1], id.data(), id.size());
    _exit(w == 24 ? 0 : 1);
  }
  std::string parent = RandomHex(24);
  char buf[24];
  ASSERT_EQ(::read(pipefd[0], buf, sizeof buf), 24);
  int status = 0;
  ::waitpid(pid, &status, 0);
  ::close(pipefd[0]);
  ::close(pipefd[1]);
  EXPECT_NE(std::string(buf, 24), parent);
}

// ParallelFor runs on the caller and the pool's workers: every index once,
// no thread of its own, and no deadlock when the workers are busy or the
// loop nests.
TEST(ParallelFor, EveryIndexOnceOnTheCallerAndThePoolsWorkersOnly) {
  ThreadPool pool(3);
  std::mutex mu;
  std::set<std::thread::id> threads;
  for (int round = 0; round < 50; ++round) {
    std::vector<std::atomic<int>> calls(37);
    ParallelFor(pool, calls.size(), 16, [&](size_t i) {
      calls[i].fetch_add(1);
      std::lock_guard lock(mu);
      threads.insert(std::this_thread::get_id());
    });
    for (auto& c : calls) ASSERT_EQ(c.load(), 1);
  }
  EXPECT_LE(threads.size(), 4u) << "threads beyond the caller and the pool's 3 workers ran the loop";
  ParallelFor(pool, 0, 16, [](size_t) { FAIL() << "no index in an empty loop"; });
}

TEST(ParallelFor, FinishesWhenEveryWorkerIsBusyAndWhenNested) {
  ThreadPool pool(2);
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  for (int k = 0; k < 2; ++k) pool.Submit([released] { released.wait(); });
  std::atomic<int> sum{0};
  {
    // The helpers it queued run after it returned, once the workers are
    // free: they must not touch the loop's state (ASan would see it).
    std::vector<int> values(10, 1);
    ParallelFor(pool, values.size(), 8, [&](size_t i) { sum += values[i]; });
  }
  EXPECT_EQ(sum.load(), 10);
  release.set_value();
  sum = 0;
  ParallelFor(pool, 4, 8, [&](size_t) { ParallelFor(pool, 5, 8, [&](size_t) { sum += 1; }); });
  EXPECT_EQ(sum.load(), 20);
}

}  // namespace
}  // namespace ckptfs
