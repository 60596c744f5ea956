// The chunk-buffer pool, and the read and save paths that use it: in steady
// state they reuse buffers and allocate none.
#include "core/buffer_pool.h"

#include <gtest/gtest.h>

#include <cstring>
#include <thread>

#include "ckpt/repository.h"
#include "test_util.h"

namespace ckptfs {
namespace {

using testing::RandomBytes;
using testing::TempDir;

TEST(BufferPool, ReturnedBuffersAreReusedAndIdleOnesAreBounded) {
  BufferPool pool(64 << 10, 2);
  std::byte* first;
  {
    auto a = pool.Acquire(1000);
    ASSERT_TRUE(a);
    EXPECT_EQ(a.capacity(), 64u << 10);
    first = a.data();
    std::memset(a.data(), 7, a.capacity());  // all of it is writable
  }
  auto b = pool.Acquire(64 << 10);
  EXPECT_EQ(b.data(), first);  // the same buffer came back
  auto s = pool.stats();
  EXPECT_EQ(s.allocations, 1u);
  EXPECT_EQ(s.reuses, 1u);
  EXPECT_EQ(s.bytes_held, 64u << 10);
  {
    std::vector<BufferPool::Lease> many;
    for (int i = 0; i < 5; ++i) many.push_back(pool.Acquire(10));
  }
  s = pool.stats();
  EXPECT_EQ(s.idle_buffers, 2u);                       // at most max_idle kept ...
  EXPECT_EQ(s.bytes_held, (2u + 1u) * (64u << 10));    // ... the rest freed (plus b)
}

TEST(BufferPool, OversizedRequestsGetTheirOwnBufferAndLargeOnesAreHugePageAligned) {
  BufferPool pool(4 << 20, 4);
  auto big = pool.Acquire(4 << 20);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(big.data()) % (2 << 20), 0u);
  {
    auto huge = pool.Acquire(9 << 20);
    EXPECT_GE(huge.capacity(), 9u << 20);
    std::memset(huge.data(), 1, huge.capacity());
    EXPECT_EQ(pool.stats().bytes_held, (4u << 20) + (9u << 20));
  }
  auto s = pool.stats();
  EXPECT_EQ(s.allocations, 2u);
  EXPECT_EQ(s.idle_buffers, 0u);  // an oversized buffer is never kept
  EXPECT_EQ(s.bytes_held, 4u << 20);
}

TEST(BufferPool, LeasesMayOutliveThePoolAndMoveBetweenThreads) {
  BufferPool::Lease kept;
  {
    BufferPool pool(1 << 16, 4);
    kept = pool.Acquire(100);
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&pool] {
        for (int i = 0; i < 200; ++i) {
          auto l = pool.Acquire(1 << 16);
          l.data()[0] = std::byte{1};
        }
      });
    }
    for (auto& t : threads) t.join();
    EXPECT_LE(pool.stats().allocations, 5u);  // 4 threads + the kept lease
  }
  kept.data()[0] = std::byte{2};  // still valid; freed with the lease
}

class SteadyState : public ::testing::Test {
 protected:
  void SetUp() override {
    RepositoryConfig config;
    config.chunk_size = 64 << 10;
    config.pack_size = 8 << 20;
    config.adaptive = false;  // compress every chunk: encoder buffers in play
    ASSERT_OK(Repository::Init(dir_.path(), config));
    OpenOptions options;
    options.threads = 2;
    options.cache_bytes = 4 * (64 << 10);  // smaller than the tensors: the cache evicts
    auto r = Repository::Open(dir_.path(), options);
    ASSERT_OK(r);
    repo_ = std::move(r).value();
  }

  void Save(const std::string& name, uint32_t seed) {
    auto w = repo_->BeginCheckpoint(name, {});
    ASSERT_OK(w);
    data_ = RandomBytes(kChunks * (64 << 10), seed);
    // Half of each chunk compresses: the encoder writes zstd frames.
    for (size_t i = 0; i < data_.size(); i += 4) data_[i] = data_[i + 1] = std::byte{0};
    ASSERT_OK((*w)->PutTensor({"t", DType::kF32, {data_.size() / 4}}, data_));
    ASSERT_OK((*w)->Commit().Wait());
  }

  // Reads the whole tensor in small pieces (through the chunk cache) and in
  // one large read (decoded straight into the destination).
  void ReadBack(const std::string& name) {
    auto reader = repo_->OpenCheckpoint(name);
    ASSERT_OK(reader);
    const TensorRecord& t = (*reader)->tensors()[0];
    std::vector<std::byte> got(data_.size());
    for (size_t off = 0; off < got.size(); off += 16 << 10) {
      ASSERT_OK((*reader)->ReadBytes(t, off, std::span(got).subspan(off, 16 << 10)));
    }
    EXPECT_TRUE(got == data_);
    std::fill(got.begin(), got.end(), std::byte{0});
    ASSERT_OK((*reader)->ReadBytes(t, 0, got));
    EXPECT_TRUE(got == data_);
  }

  static constexpr size_t kChunks = 48;
  TempDir dir_;
  std::unique_ptr<Repository> repo_;
  std::vector<std::byte> data_;
};

TEST_F(SteadyState, ReadingChunksAllocatesNoNewBuffers) {
  Save("a", 1);
  ReadBack("a");  // warms the pool up
  const BufferPoolStats warm = repo_->buffer_stats();
  for (int round = 0; round < 3; ++round) ReadBack("a");  // 3 x 48 chunks, evicted and refetched
  const BufferPoolStats after = repo_->buffer_stats();
  EXPECT_EQ(after.allocations, warm.allocations);
  EXPECT_GE(after.reuses, warm.reuses + 3 * kChunks);
  EXPECT_EQ(after.bytes_held, warm.bytes_held);
}

TEST_F(SteadyState, SavingChunksAllocatesBuffersForWhatIsInFlightOnly) {
  // The writer keeps at most a few chunks per worker in flight (encoding,
  // queued, being written); how many are in flight at once depends on
  // timing, so the bound is the pool's idle limit (4 per worker + 8), not
  // an exact count. 3 x 48 chunks are saved.
  Save("a", 1);
  Save("b", 2);
  Save("c", 3);
  const BufferPoolStats after = repo_->buffer_stats();
  EXPECT_LE(after.allocations, 4u * 2 + 8);
  EXPECT_GE(after.reuses, 3 * kChunks - after.allocations);
  ReadBack("c");
}

// A load at another sharding uses most chunks partly, through the cache.
// Even with a cache far larger than the checkpoint, chunks whose bytes have
// all been copied out leave it, so a one-pass load recycles a few buffers
// instead of holding (and first touching) one per chunk.
TEST(ReshardedLoad, RecyclesBuffersWithALargeCache) {
  TempDir dir;
  RepositoryConfig config;
  config.chunk_size = 64 << 10;
  ASSERT_OK(Repository::Init(dir.path(), config));
  OpenOptions options;
  options.threads = 2;
  options.cache_bytes = 512 << 20;
  auto opened = Repository::Open(dir.path(), options);
  ASSERT_OK(opened);
  Repository& repo = **opened;
  const uint64_t rows = 1024, cols = 1024;  // f32: 4 MiB, 64 chunks
  const TensorInfo info{"w", DType::kF32, {rows, cols}};
  const auto full = RandomBytes(rows * cols * 4, 5);
  auto column_box = [&](int r, int world) {
    const uint64_t c0 = cols * r / world, c1 = cols * (r + 1) / world;
    return Box{{0, c0}, {rows, c1 - c0}};
  };
  auto extract = [&](const Box& box) {
    std::vector<std::byte> out(box.NumElements() * 4);
    for (uint64_t i = 0; i < rows; ++i) {
      std::memcpy(out.data() + i * box.lengths[1] * 4, full.data() + (i * cols + box.offsets[1]) * 4,
                  box.lengths[1] * 4);
    }
    return out;
  };
  for (int r = 0; r < 4; ++r) {  // saved by 4 ranks as column boxes
    auto w = repo.BeginCheckpoint("c", {uint32_t(r), 4, 1, {}});
    ASSERT_OK(w);
    const auto bytes = extract(column_box(r, 4));
    HostSource src(bytes);
    ASSERT_OK((*w)->PutShard(info, Region::OfBox(column_box(r, 4)), src));
    ASSERT_OK((*w)->Commit().Wait());
  }
  auto reader = repo.OpenCheckpoint("c");
  ASSERT_OK(reader);
  const TensorRecord& t = *(*reader)->FindTensor("w");
  auto load_at_3 = [&] {
    for (int r = 0; r < 3; ++r) {
      std::vector<std::byte> got(column_box(r, 3).NumElements() * 4);
      ASSERT_OK((*reader)->ReadBox(t, column_box(r, 3), got));
      ASSERT_TRUE(got == extract(column_box(r, 3))) << "rank " << r;
    }
  };
  load_at_3();
  const BufferPoolStats first = repo.buffer_stats();
  // Every chunk was read (the saved shards straddle the loaded ones), yet
  // at most the chunks of one saved shard (16) wait in the cache for their
  // second reader, plus what the workers hold.
  EXPECT_LE(first.allocations, 16u + 4 * 2 + 8);
  EXPECT_EQ(first.bytes_held, first.idle_buffers * (64 << 10));  // the cache holds none
  load_at_3();
  EXPECT_EQ(repo.buffer_stats().allocations, first.allocations);
}

}  // namespace
}  // namespace ckptfs
