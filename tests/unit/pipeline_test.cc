// The save pipeline on its own (ckpt/pipeline.h): an in-memory store, a
// compute pool, and a map standing in for "already stored"; no catalog, no
// checkpoint, no commit.
#include "ckpt/pipeline.h"
#include "ckpt/repository.h"

#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <set>

#include "test_util.h"

namespace ckptfs {
namespace {

using testing::RandomBytes;

constexpr uint64_t kChunk = 64 << 10;

// What the pipeline is given, and what it asked.
struct Harness {
  explicit Harness(Compression compression = Compression::kZstd, std::shared_ptr<Backend> s = NewMemoryBackend())
      : store(std::move(s)), pool(3), buffers(kChunk, 16) {
    settings.store = store.get();
    settings.pool = &pool;
    settings.buffers = &buffers;
    settings.chunk_size = kChunk;
    settings.pack_size = 256 << 10;
    settings.codec.compression = compression;
    settings.lookup = [this](const ChunkId& id) -> Result<ChunkLocation> {
      std::lock_guard lock(mu);
      ++lookups;
      auto it = known.find(id);
      if (it == known.end()) return Status::NotFound("not stored");
      return it->second;
    };
  }
  std::shared_ptr<Backend> store;
  ThreadPool pool;
  BufferPool buffers;
  PipelineSettings settings;
  std::mutex mu;
  std::map<ChunkId, ChunkLocation> known;  // guarded by mu
  int lookups = 0;                          // guarded by mu
};

// Every chunk a sealed pack indexes, read back from the store and decoded.
std::map<ChunkId, std::vector<std::byte>> ReadBack(Backend& store, const std::vector<SealedPack>& packs) {
  std::map<ChunkId, std::vector<std::byte>> out;
  for (const auto& p : packs) {
    auto index = ReadPackIndex(&store, p.id);
    EXPECT_TRUE(index.ok()) << index.status().ToString();
    if (!index.ok()) continue;
    EXPECT_EQ(index->entries.size(), p.entries.size());
    for (const auto& e : index->entries) {
      std::vector<std::byte> raw(e.location.raw_len);
      Status st = ReadChunk(&store, e.id, e.location, raw);
      EXPECT_TRUE(st.ok()) << st.ToString();
      out[e.id] = std::move(raw);
    }
  }
  return out;
}

TEST(SavePipeline, ChunksHashesDeduplicatesEncodesAndPacksWithoutACatalog) {
  Harness h;
  // Six chunks: 0 and 3 alike, 5 already stored elsewhere, 4 a short tail.
  auto a = RandomBytes(kChunk, 1), b = RandomBytes(kChunk, 2), c = RandomBytes(kChunk, 3);
  auto stored_before = RandomBytes(kChunk, 4), tail = RandomBytes(1000, 5);
  std::vector<std::byte> data;
  for (const auto* part : {&a, &b, &c, &a, &stored_before, &tail}) data.insert(data.end(), part->begin(), part->end());
  const ChunkId stored_id = ChunkId::Of(stored_before);
  h.known[stored_id] = ChunkLocation{"elsewhere", 0, kChunk, kChunk, Codec::kRaw};

  SavePipeline p(h.settings);
  const auto bounds = p.ChunkBounds(0, data.size());
  ASSERT_EQ(bounds.size(), 7u);
  std::vector<ChunkRef> refs;
  HostSource src(data);
  ASSERT_OK(p.Stream(bounds, DType::kU8, src, refs));
  p.Shutdown();
  auto sealed = p.Finish();
  ASSERT_OK(sealed);

  // The refs name each chunk's content and length.
  ASSERT_EQ(refs.size(), 6u);
  for (size_t i = 0; i < refs.size(); ++i) {
    std::span<const std::byte> piece(data.data() + bounds[i], bounds[i + 1] - bounds[i]);
    EXPECT_EQ(refs[i].id, ChunkId::Of(piece)) << i;
    EXPECT_EQ(refs[i].raw_len, piece.size()) << i;
  }
  // Stored: a, b, c and the tail, once each; the repeat of a and the chunk
  // stored before are deduplicated.
  const PipelineStats stats = p.stats();
  EXPECT_EQ(stats.chunks_written, 4u);
  EXPECT_EQ(stats.chunks_deduplicated, 2u);
  EXPECT_EQ(p.stored().size(), 4u);
  EXPECT_FALSE(p.stored().count(stored_id));
  // Random bytes do not compress: stored raw, a few bytes of framing at most.
  EXPECT_GE(stats.stored_bytes, 3 * kChunk + 1000);
  auto back = ReadBack(*h.store, *sealed);
  ASSERT_EQ(back.size(), 4u);
  EXPECT_EQ(back[ChunkId::Of(a)], a);
  EXPECT_EQ(back[ChunkId::Of(b)], b);
  EXPECT_EQ(back[ChunkId::Of(c)], c);
  EXPECT_EQ(back[ChunkId::Of(tail)], tail);
  // Each location the pipeline reports is where the pack holds the chunk.
  for (const auto& [id, loc] : p.stored()) {
    std::vector<std::byte> raw(loc.raw_len);
    ASSERT_OK(ReadChunk(h.store.get(), id, loc, raw));
    EXPECT_EQ(raw, back[id]);
  }
  // The sealed packs hold every stored byte, and their indexes besides.
  uint64_t packed = 0;
  for (const auto& s : *sealed) packed += s.size;
  EXPECT_GE(packed, stats.stored_bytes);
}

// The caller changes a chunk's bytes after the pipeline hashed them and
// before it stored them (here: while it asks whether the chunk is stored,
// the step between the two). The chunk is stored under the id of the bytes
// stored, and its reference names that id: never bytes that fail their id.
// With `twin`, a second chunk with the old bytes, which may have found the
// first's id claimed, is stored with its own bytes. (Under TSan without it:
// the twin's job may be the one that changes chunk 0 while chunk 0's job
// reads it, the race this test stages on purpose.)
void SourceChangedBetweenHashAndStore(Compression compression, bool twin) {
  Harness h(compression);
  // 24 chunks stored already come first: after them the pipeline hashes a
  // changeable source in place before it copies a new chunk (the path
  // where a change can fall between the hash and the copy).
  constexpr size_t kStored = 24;
  std::vector<std::byte> data((kStored + 3) * kChunk);
  for (size_t c = 0; c < kStored; ++c) {
    auto stored = RandomBytes(kChunk, 100 + static_cast<uint32_t>(c));
    std::memcpy(data.data() + c * kChunk, stored.data(), kChunk);
    h.known[ChunkId::Of(stored)] = ChunkLocation{"elsewhere", 0, kChunk, kChunk, Codec::kRaw};
  }
  const size_t at = kStored * kChunk;  // chunk "0" of the test
  for (size_t i = at; i < data.size(); ++i) data[i] = std::byte(i % 251 < 200 ? 0 : i % 7);  // compressible
  if (twin) std::memcpy(data.data() + at + kChunk, data.data() + at, kChunk);  // chunks 0 and 1 alike
  const std::vector<std::byte> old_chunk(data.begin() + at, data.begin() + at + kChunk);
  const ChunkId old_id = ChunkId::Of(old_chunk);
  std::atomic<bool> changed{false};
  auto lookup = h.settings.lookup;
  h.settings.lookup = [&](const ChunkId& id) {
    // The first job to look up chunk 0's old id changes chunk 0 (only).
    if (id == old_id && !changed.exchange(true)) data[at + 100] = std::byte(0x77);
    return lookup(id);
  };
  SavePipeline p(h.settings);
  const auto bounds = p.ChunkBounds(0, data.size());
  std::vector<ChunkRef> refs;
  HostSource src(data);
  ASSERT_OK(p.Stream(bounds, DType::kU8, src, refs));
  p.Shutdown();
  auto sealed = p.Finish();
  ASSERT_OK(sealed);
  ASSERT_TRUE(changed.load());
  auto back = ReadBack(*h.store, *sealed);  // each chunk checked against its id
  ASSERT_EQ(refs.size(), kStored + 3);
  refs.erase(refs.begin(), refs.begin() + kStored);
  for (size_t i = 0; i < refs.size(); ++i) {
    ASSERT_TRUE(back.count(refs[i].id)) << "chunk " << i << " names an id nothing stored";
    EXPECT_EQ(back[refs[i].id].size(), refs[i].raw_len);
  }
  // Chunk 1 kept the old bytes; chunk 0 names either the old bytes (hashed
  // and referenced before the change by a job that found them claimed) or
  // the new ones, and the store holds each id with its own bytes.
  if (twin) {
    EXPECT_EQ(refs[1].id, old_id);
    EXPECT_EQ(back[old_id], old_chunk);
  }
  std::vector<std::byte> new_chunk = old_chunk;
  new_chunk[100] = std::byte(0x77);
  EXPECT_TRUE(refs[0].id == old_id || refs[0].id == ChunkId::Of(new_chunk));
  if (refs[0].id != old_id) {
    EXPECT_EQ(back[refs[0].id], new_chunk);
  }
}

TEST(SavePipeline, ASourceChangedAfterItWasHashedStoresTheBytesItStoresUnderTheirOwnId) {
  const bool twin = !testing::kThreadSanitizer;
  SourceChangedBetweenHashAndStore(Compression::kZstd, twin);
  SourceChangedBetweenHashAndStore(Compression::kNone, twin);
}

TEST(SavePipeline, BytesLentFromAMappedFileStayMappedUntilTheThreadsAreDone) {
  Harness h;
  testing::TempDir dir;
  const std::string path = dir / "items";
  const auto bytes = RandomBytes(4 * kChunk, 9);
  {
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  }
  const uint64_t at = 100, size = 3 * kChunk + 77;
  SavePipeline p(h.settings);
  std::vector<ChunkRef> refs;
  const auto bounds = p.ChunkBounds(0, size);
  {
    auto file = MappedFile::Open(path);
    ASSERT_OK(file);
    EXPECT_EQ((*file)->size(), bytes.size());
    auto src = MappedSource::Make(*file, at, size);
    ASSERT_OK(src);
    ASSERT_OK(p.Stream(bounds, DType::kU8, *src, refs));
    // The caller's references go here, perhaps before the threads are
    // done: the chunks they still read keep the file mapped.
  }
  p.Shutdown();
  auto sealed = p.Finish();
  ASSERT_OK(sealed);
  auto back = ReadBack(*h.store, *sealed);
  ASSERT_EQ(refs.size(), 4u);
  for (size_t i = 0; i < refs.size(); ++i) {
    std::vector<std::byte> want(bytes.begin() + at + bounds[i], bytes.begin() + at + bounds[i + 1]);
    EXPECT_EQ(back[refs[i].id], want) << i;
  }
}

TEST(SavePipeline, AStagedCopyIsQueuedWholeWithoutWaitingForTheThreadsAndReleasedWhenEncoded) {
  Harness h;
  // Every worker is busy until `go`: a stream that waited for them (as one
  // over the caller's memory does, past 2 * workers + 2 chunks) would hang.
  std::mutex mu;
  std::condition_variable cv;
  bool go = false;
  for (size_t i = 0; i < h.pool.size(); ++i) {
    h.pool.Submit([&] {
      std::unique_lock lock(mu);
      cv.wait(lock, [&] { return go; });
    });
  }
  auto copy = std::make_shared<std::vector<std::byte>>(RandomBytes(20 * kChunk, 12));
  SavePipeline p(h.settings);
  std::vector<ChunkRef> refs;
  {
    StableSource src(copy, *copy);
    ASSERT_OK(p.Stream(p.ChunkBounds(0, copy->size()), DType::kF32, src, refs));
  }
  EXPECT_GT(copy.use_count(), 1);  // the queued chunks hold the copy
  {
    std::lock_guard lock(mu);
    go = true;
  }
  cv.notify_all();
  p.Shutdown();
  EXPECT_EQ(copy.use_count(), 1);  // released once every chunk was encoded
  auto sealed = p.Finish();
  ASSERT_OK(sealed);
  auto back = ReadBack(*h.store, *sealed);
  ASSERT_EQ(refs.size(), 20u);
  for (size_t i = 0; i < refs.size(); ++i) {
    std::vector<std::byte> want(copy->begin() + i * kChunk, copy->begin() + (i + 1) * kChunk);
    EXPECT_EQ(refs[i].id, ChunkId::Of(want)) << i;
    EXPECT_EQ(back[refs[i].id], want) << i;
  }
  std::vector<std::byte> dst(100);
  StableSource src(copy, *copy);
  ASSERT_OK(src.Read(kChunk - 50, dst));
  EXPECT_TRUE(std::equal(dst.begin(), dst.end(), copy->begin() + kChunk - 50));
  EXPECT_EQ(src.Borrow(copy->size() - 10, 11).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(src.Read(copy->size() - 10, dst).code(), StatusCode::kInvalidArgument);
}

TEST(SavePipeline, AMappedSourceOutsideItsFileOrOfNoRegularFileIsRefused) {
  testing::TempDir dir;
  const std::string path = dir / "small";
  {
    std::ofstream out(path, std::ios::binary);
    out << "0123456789";
  }
  auto file = MappedFile::Open(path);
  ASSERT_OK(file);
  EXPECT_OK(MappedSource::Make(*file, 4, 6));
  for (auto [at, n] : {std::pair<uint64_t, uint64_t>{4, 7}, {11, 0}, {1, UINT64_MAX}}) {
    auto bad = MappedSource::Make(*file, at, n);
    ASSERT_FALSE(bad.ok()) << at << " " << n;
    EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(bad.status().message().find(path), std::string::npos) << bad.status().ToString();
  }
  auto directory = MappedFile::Open(dir.path());
  ASSERT_FALSE(directory.ok());
  EXPECT_NE(directory.status().message().find("not a regular file"), std::string::npos);
  auto missing = MappedFile::Open(dir / "missing");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find(dir / "missing"), std::string::npos);
  std::ofstream(dir / "empty").flush();
  auto empty = MappedFile::Open(dir / "empty");
  ASSERT_OK(empty);
  EXPECT_EQ((*empty)->size(), 0u);
  EXPECT_OK(MappedSource::Make(*empty, 0, 0));
}

TEST(SavePipeline, CompressibleChunksAreEncodedAndDecodeToTheirBytes) {
  Harness h(Compression::kZstd);
  // bf16-like values: the high bytes repeat, so byte grouping and zstd win.
  std::vector<std::byte> data(3 * kChunk);
  for (size_t i = 0; i < data.size(); ++i) data[i] = std::byte(i % 2 ? 0x3f : (i * 7) % 13);
  SavePipeline p(h.settings);
  std::vector<ChunkRef> refs;
  HostSource src(data);
  ASSERT_OK(p.Stream(p.ChunkBounds(0, data.size()), DType::kBF16, src, refs));
  p.Shutdown();
  auto sealed = p.Finish();
  ASSERT_OK(sealed);
  EXPECT_LT(p.stats().stored_bytes, data.size() / 4);
  auto back = ReadBack(*h.store, *sealed);
  for (size_t i = 0; i < refs.size(); ++i) {
    std::vector<std::byte> want(data.begin() + i * kChunk, data.begin() + (i + 1) * kChunk);
    EXPECT_EQ(back[refs[i].id], want) << i;
  }
}

TEST(SavePipeline, ChunkBoundsFollowTheTensorSoAFlatRangeChunksAlikeAtAnyStart) {
  Harness h;
  SavePipeline p(h.settings);
  EXPECT_EQ(p.ChunkBounds(0, 0), (std::vector<uint64_t>{0}));
  EXPECT_EQ(p.ChunkBounds(0, 2 * kChunk), (std::vector<uint64_t>{0, kChunk, 2 * kChunk}));
  // A range starting 1000 bytes into the tensor ends its first chunk where
  // the tensor's first chunk ends.
  EXPECT_EQ(p.ChunkBounds(1000, 2 * kChunk), (std::vector<uint64_t>{0, kChunk - 1000, 2 * kChunk - 1000, 2 * kChunk}));
  // So two ranks' halves chunk like the whole: the same chunks, the same ids.
  auto data = RandomBytes(4 * kChunk, 9);
  std::vector<ChunkRef> whole, left, right;
  HostSource all(data);
  ASSERT_OK(p.Stream(p.ChunkBounds(0, data.size()), DType::kU8, all, whole));
  std::span<const std::byte> l(data.data(), 2 * kChunk), r(data.data() + 2 * kChunk, 2 * kChunk);
  HostSource ls(l), rs(r);
  ASSERT_OK(p.Stream(p.ChunkBounds(0, l.size()), DType::kU8, ls, left));
  ASSERT_OK(p.Stream(p.ChunkBounds(2 * kChunk, r.size()), DType::kU8, rs, right));
  left.insert(left.end(), right.begin(), right.end());
  EXPECT_EQ(left, whole);
  p.Shutdown();
  EXPECT_EQ(p.stats().chunks_written, 4u);
  EXPECT_EQ(p.stats().chunks_deduplicated, 4u);
}

// A store whose pack objects cannot be created (a full disk).
class NoRoom : public BackendWrapper {
 public:
  using BackendWrapper::BackendWrapper;
  Result<std::unique_ptr<ObjectWriter>> Create(std::string_view) override {
    return Status::IOError("no space left on device");
  }
};

TEST(SavePipeline, AStoreThatFailsMakesTheStreamFailWithItsErrorAndNothingIsSealed) {
  Harness h(Compression::kZstd, std::make_shared<NoRoom>(NewMemoryBackend()));
  SavePipeline p(h.settings);
  auto data = RandomBytes(8 * kChunk, 3);
  std::vector<ChunkRef> refs;
  HostSource src(data);
  Status st = p.Stream(p.ChunkBounds(0, data.size()), DType::kU8, src, refs);
  p.Shutdown();
  // The error shows in the stream (when the writer failed before it ended)
  // or, sticky, right after; nothing more is written, and no pack seals.
  Status err = st.ok() ? p.error() : st;
  EXPECT_EQ(err.code(), StatusCode::kIOError) << err.ToString();
  EXPECT_NE(err.message().find("no space left"), std::string::npos);
  EXPECT_EQ(p.stats().chunks_written, 0u);
  EXPECT_EQ(std::move(h.store->List("")).value().size(), 0u);
}

}  // namespace
}  // namespace ckptfs
