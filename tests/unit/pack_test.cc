#include "store/pack.h"

#include <gtest/gtest.h>

#include "store/chunk_cache.h"

#include <atomic>
#include <cstring>
#include <chrono>
#include <thread>
#include "test_util.h"

namespace ckptfs {
namespace {

using testing::RandomBytes;

struct Written {
  ChunkId id;
  std::vector<std::byte> raw;
  ChunkLocation loc;
};

std::vector<Written> WriteChunks(Backend* b, PackWriter& w, int n, size_t size) {
  std::vector<Written> out;
  ChunkEncoder enc({});
  for (int i = 0; i < n; ++i) {
    Written c;
    c.raw = RandomBytes(size, i);
    // Make half of them compressible.
    if (i % 2) std::fill(c.raw.begin(), c.raw.begin() + size / 2, std::byte{0});
    c.id = ChunkId::Of(c.raw);
    std::string stored;
    Codec codec = *enc.Encode(c.raw, DType::kU8, &stored);
    c.loc = *w.Add(c.id, codec, static_cast<uint32_t>(size), std::as_bytes(std::span(stored)));
    out.push_back(std::move(c));
  }
  (void)b;
  return out;
}

TEST(Pack, IndexRoundTripsAndChunksVerify) {
  auto backend = NewMemoryBackend();
  PackWriter writer(backend.get(), 1 << 20);
  auto chunks = WriteChunks(backend.get(), writer, 10, 300 << 10);
  auto sealed = writer.Finish();
  ASSERT_OK(sealed);
  ASSERT_GE(sealed->size(), 2u);  // sealed by size
  size_t entries = 0;
  for (const auto& p : *sealed) {
    auto index = ReadPackIndex(backend.get(), p.id);
    ASSERT_OK(index);
    EXPECT_EQ(index->size, p.size);
    EXPECT_EQ(index->entries.size(), p.entries.size());
    entries += index->entries.size();
  }
  EXPECT_EQ(entries, 10u);
  for (const auto& c : chunks) {
    std::vector<std::byte> raw(c.raw.size());
    ASSERT_OK(ReadChunk(backend.get(), c.id, c.loc, raw));
    EXPECT_EQ(raw, c.raw);
  }
}

TEST(Pack, IndexesLargerThanOneTailReadRoundTrip) {
  // 3,000 entries: a 117 KiB index, more than ReadPackIndex reads from the
  // pack's end at first, so the rest comes from a second read.
  auto backend = NewMemoryBackend();
  PackWriter writer(backend.get(), 64 << 20);
  auto chunks = WriteChunks(backend.get(), writer, 3000, 16);
  auto sealed = writer.Finish();
  ASSERT_OK(sealed);
  ASSERT_EQ(sealed->size(), 1u);
  auto index = ReadPackIndex(backend.get(), (*sealed)[0].id);
  ASSERT_OK(index);
  ASSERT_EQ(index->entries.size(), 3000u);
  for (size_t i = 0; i < chunks.size(); ++i) {
    EXPECT_EQ(index->entries[i].id, chunks[i].id) << i;
    EXPECT_EQ(index->entries[i].location.offset, chunks[i].loc.offset) << i;
  }
}

TEST(Pack, UnsealedPackIsInvisible) {
  auto backend = NewMemoryBackend();
  {
    PackWriter writer(backend.get(), 64 << 20);
    WriteChunks(backend.get(), writer, 3, 1000);
  }
  EXPECT_TRUE(backend->List("packs/")->empty());
}

TEST(Pack, FlippedByteIsCorruptionNamingChunkAndPack) {
  auto backend = NewMemoryBackend();
  PackWriter writer(backend.get(), 64 << 20);
  auto chunks = WriteChunks(backend.get(), writer, 2, 4096);
  ASSERT_OK(writer.Finish());
  const auto& c = chunks[0];
  std::string pack = *backend->ReadAll(PackKey(c.loc.pack));
  pack[c.loc.offset + 100] ^= 0x40;
  ASSERT_OK(backend->Put(PackKey(c.loc.pack), std::as_bytes(std::span(pack))));
  std::vector<std::byte> raw(c.raw.size());
  Status st = ReadChunk(backend.get(), c.id, c.loc, raw);
  EXPECT_TRUE(st.IsCorruption()) << st.ToString();
  EXPECT_NE(st.message().find(c.id.ToHex()), std::string::npos);
  EXPECT_NE(st.message().find(c.loc.pack), std::string::npos);
}

TEST(Pack, ChunksReadIntoCallerMemoryAreStagedAndVerified) {
  // A local backend reads with the kernel's copy, so raw chunks bound for
  // caller memory are staged piece by piece in the thread's scratch and
  // hashed on the way; 600 KiB is two whole pieces and a partial one.
  testing::TempDir dir;
  auto backend = std::move(OpenLocalBackend(dir.path())).value();
  ASSERT_TRUE(backend->ReadsWithKernelCopy());
  EXPECT_FALSE(NewMemoryBackend()->ReadsWithKernelCopy());
  PackWriter writer(backend.get(), 64 << 20);
  auto chunks = WriteChunks(backend.get(), writer, 4, 600 << 10);
  ASSERT_OK(writer.Finish());
  ASSERT_EQ(chunks[0].loc.codec, Codec::kRaw);  // random bytes
  ASSERT_NE(chunks[1].loc.codec, Codec::kRaw);  // half zeros
  for (const auto& c : chunks) {
    for (auto destination : {ChunkDestination::kOwnBuffer, ChunkDestination::kCallerMemory}) {
      std::vector<std::byte> raw(c.raw.size(), std::byte{0x5a});
      ASSERT_OK(ReadChunk(backend.get(), c.id, c.loc, raw, destination));
      EXPECT_EQ(raw, c.raw);
    }
  }
  // A raw chunk damaged in its last piece is corruption either way.
  const auto& c = chunks[0];
  std::string pack = *backend->ReadAll(PackKey(c.loc.pack));
  pack[c.loc.offset + c.loc.stored_len - 10] ^= 0x01;
  ASSERT_OK(backend->Put(PackKey(c.loc.pack), std::as_bytes(std::span(pack))));
  for (auto destination : {ChunkDestination::kOwnBuffer, ChunkDestination::kCallerMemory}) {
    std::vector<std::byte> raw(c.raw.size());
    Status st = ReadChunk(backend.get(), c.id, c.loc, raw, destination);
    EXPECT_TRUE(st.IsCorruption()) << st.ToString();
    EXPECT_NE(st.message().find(c.id.ToHex()), std::string::npos);
  }
}

// A sealed pack of three 4 KiB chunks in a memory backend, and its bytes.
struct ThreeChunkPack {
  std::unique_ptr<Backend> backend = NewMemoryBackend();
  std::string id;
  std::string bytes;
  ThreeChunkPack() {
    PackWriter writer(backend.get(), 64 << 20);
    id = WriteChunks(backend.get(), writer, 3, 4096)[0].loc.pack;
    EXPECT_OK(writer.Finish());
    bytes = *backend->ReadAll(PackKey(id));
  }
};

TEST(Pack, DamagedIndexOrTruncationIsDetected) {
  ThreeChunkPack p;
  auto& backend = p.backend;
  const std::string& id = p.id;
  const std::string& pack = p.bytes;
  std::string damaged = pack;
  damaged[damaged.size() - kPackFooterSize - 5] ^= 1;  // inside the index
  ASSERT_OK(backend->Put(PackKey(id), std::as_bytes(std::span(damaged))));
  EXPECT_TRUE(ReadPackIndex(backend.get(), id).status().IsCorruption());
  std::string truncated = pack.substr(0, pack.size() - 3);
  ASSERT_OK(backend->Put(PackKey(id), std::as_bytes(std::span(truncated))));
  EXPECT_TRUE(ReadPackIndex(backend.get(), id).status().IsCorruption());
  ASSERT_OK(backend->Put(PackKey(id), std::as_bytes(std::span("short", 5))));
  EXPECT_TRUE(ReadPackIndex(backend.get(), id).status().IsCorruption());
}

// Rewrites entry `i` of a pack's index with `patch` and fixes the index
// checksum, so only the bounds checks stand between it and a reader.
std::string PatchIndexEntry(std::string pack, size_t i, size_t field_offset, uint64_t value, size_t width) {
  uint64_t index_offset, count;
  std::memcpy(&index_offset, pack.data() + pack.size() - kPackFooterSize, 8);
  std::memcpy(&count, pack.data() + pack.size() - kPackFooterSize + 8, 8);
  std::memcpy(pack.data() + index_offset + i * kPackIndexEntrySize + field_offset, &value, width);
  const uint64_t sum = Checksum64(std::as_bytes(std::span(pack.data() + index_offset, count * kPackIndexEntrySize)));
  std::memcpy(pack.data() + pack.size() - kPackFooterSize + 16, &sum, 8);
  return pack;
}

TEST(Pack, IndexEntriesOutsideTheDataAreaAreRejectedWithoutOverflow) {
  ThreeChunkPack p;
  auto& backend = p.backend;
  const std::string& id = p.id;
  const std::string& pack = p.bytes;
  ASSERT_OK(ReadPackIndex(backend.get(), id));
  struct Case {
    size_t field, width;
    uint64_t value;
    const char* why;
  } cases[] = {
      {16, 8, UINT64_MAX - 100, "points outside the data area"},  // offset + length wraps past 2^64
      {16, 8, 3, "points outside the data area"},                 // inside the header
      {24, 4, 1u << 30, "points outside the data area"},          // stored length past the index
      {28, 4, 0, "raw length 0"},
      {28, 4, kMaxChunkSize + 1, "raw length 268435457"},
  };
  for (const Case& c : cases) {
    const std::string bad = PatchIndexEntry(pack, 1, c.field, c.value, c.width);
    ASSERT_OK(backend->Put(PackKey(id), std::as_bytes(std::span(bad))));
    auto index = ReadPackIndex(backend.get(), id);
    ASSERT_FALSE(index.ok()) << c.why;
    EXPECT_TRUE(index.status().IsCorruption());
    EXPECT_NE(index.status().message().find(c.why), std::string::npos) << index.status().message();
  }
}

TEST(Pack, FailedAppendIsStickyAndSealsNothing) {
  // A backend whose writers fail after some bytes: a full disk.
  class FullDisk : public BackendWrapper {
   public:
    FullDisk() : BackendWrapper(NewMemoryBackend()) {}
    class W : public ObjectWriter {
     public:
      explicit W(std::unique_ptr<ObjectWriter> w) : w_(std::move(w)) {}
      Status Append(std::span<const std::byte> d) override {
        if (w_->size() + d.size() > 10000) return Status::ResourceExhausted("No space left on device");
        return w_->Append(d);
      }
      Status Commit() override { return w_->Commit(); }
      void Abort() override { w_->Abort(); }
      uint64_t size() const override { return w_->size(); }
      std::unique_ptr<ObjectWriter> w_;
    };
    Result<std::unique_ptr<ObjectWriter>> Create(std::string_view key) override {
      CKPT_ASSIGN_OR_RETURN(auto w, inner().Create(key));
      return std::unique_ptr<ObjectWriter>(new W(std::move(w)));
    }
  } disk;
  PackWriter writer(&disk, 1 << 20);
  auto data = RandomBytes(6000, 1);
  ASSERT_OK(writer.Add(ChunkId::Of(data), Codec::kRaw, 6000, data));
  auto second = writer.Add(ChunkId::Of(data), Codec::kRaw, 6000, data);
  EXPECT_EQ(second.status().code(), StatusCode::kResourceExhausted);
  EXPECT_FALSE(writer.Finish().ok());
  EXPECT_TRUE(disk.List("packs/")->empty());
}

TEST(ChunkCache, LoadsOnceAndEvictsByBytes) {
  ChunkCache cache(3000);
  int loads = 0;
  auto loader = [&](size_t n) {
    return [&, n]() -> Result<ChunkData> {
      ++loads;
      return ChunkData(std::make_shared<ChunkBuffer>(n));
    };
  };
  ChunkId a = ChunkId::Of(RandomBytes(10, 1)), b = ChunkId::Of(RandomBytes(10, 2)), c = ChunkId::Of(RandomBytes(10, 3));
  ASSERT_OK(cache.Get(a, loader(1000)));
  ASSERT_OK(cache.Get(a, loader(1000)));
  EXPECT_EQ(loads, 1);
  ASSERT_OK(cache.Get(b, loader(1000)));
  ASSERT_OK(cache.Get(c, loader(1500)));  // evicts a (least recent)
  EXPECT_LE(cache.bytes(), 3000u);
  ASSERT_OK(cache.Get(a, loader(1000)));
  EXPECT_EQ(loads, 4);
  // Errors are not cached.
  auto failing = [&]() -> Result<ChunkData> {
    ++loads;
    return Status::Corruption("bad");
  };
  ChunkId d = ChunkId::Of(RandomBytes(10, 4));
  EXPECT_FALSE(cache.Get(d, failing).ok());
  EXPECT_FALSE(cache.Get(d, failing).ok());
  EXPECT_EQ(loads, 6);
}

// A small chunk decoded into a pooled buffer holds the whole buffer: the
// cache counts that, so that chunks smaller than the pool's buffers (grid
// cells, the tails of shards) cannot hold several times its capacity.
TEST(ChunkCache, PooledBuffersCountWhole) {
  BufferPool pool(64 << 10, 8);
  ChunkCache cache(2 * (64 << 10));
  auto small = [&]() -> Result<ChunkData> { return ChunkData(std::make_shared<ChunkBuffer>(pool.Acquire(1000), 1000)); };
  const ChunkId a = ChunkId::Of(RandomBytes(10, 1)), b = ChunkId::Of(RandomBytes(10, 2)), c = ChunkId::Of(RandomBytes(10, 3));
  ASSERT_OK(cache.Get(a, small));
  ASSERT_OK(cache.Get(b, small));
  EXPECT_EQ(cache.bytes(), 2u * (64 << 10));
  ASSERT_OK(cache.Get(c, small));  // a third buffer: the least recent goes
  EXPECT_FALSE(cache.Contains(a));
  EXPECT_EQ(cache.bytes(), 2u * (64 << 10));
}

TEST(ChunkCache, AnEntryLeavesOnceEveryByteWasCopiedOut) {
  ChunkCache cache(1 << 20);
  int loads = 0;
  auto loader = [&]() -> Result<ChunkData> {
    ++loads;
    return ChunkData(std::make_shared<ChunkBuffer>(1000));
  };
  const ChunkId a = ChunkId::Of(RandomBytes(10, 1)), b = ChunkId::Of(RandomBytes(10, 2));
  cache.Consumed(a, 1000);  // not cached: nothing happens
  ASSERT_OK(cache.Get(a, loader));
  ASSERT_OK(cache.Get(b, loader));
  cache.Consumed(a, 600);  // one reader took part of it: kept for the rest
  EXPECT_TRUE(cache.Contains(a));
  ASSERT_OK(cache.Get(a, loader));
  EXPECT_EQ(loads, 2);
  cache.Consumed(a, 400);  // every byte used: its buffer is free for the next chunk
  EXPECT_FALSE(cache.Contains(a));
  EXPECT_TRUE(cache.Contains(b));
  EXPECT_EQ(cache.bytes(), 1000u);
  ASSERT_OK(cache.Get(a, loader));  // a later reader fetches it again
  EXPECT_EQ(loads, 3);
}

TEST(ChunkCache, ConcurrentReadersDecodeAChunkOnce) {
  ChunkCache cache(64 << 20);
  std::atomic<int> loads{0};
  const ChunkId id = ChunkId::Of(RandomBytes(10, 7));
  std::vector<std::thread> threads;
  std::vector<const ChunkBuffer*> got(8);
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      auto r = cache.Get(id, [&]() -> Result<ChunkData> {
        ++loads;
        std::this_thread::sleep_for(std::chrono::milliseconds(50));  // a slow decode
        return ChunkData(std::make_shared<ChunkBuffer>(4096));
      });
      ASSERT_OK(r);
      got[t] = r->get();
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(loads.load(), 1);
  for (const ChunkBuffer* p : got) EXPECT_EQ(p, got[0]);  // all share the one decoded buffer
}

}  // namespace
}  // namespace ckptfs
