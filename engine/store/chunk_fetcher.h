// Fetching chunks by id: the interface readers and the merge use, a fetcher
// that looks each chunk's location up and reads it from its pack (following
// it when gc moved it), and one in front of that which shares decoded
// chunks through a ChunkCache.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <span>

#include "backend/backend.h"
#include "core/buffer_pool.h"
#include "core/chunk_id.h"
#include "core/status.h"
#include "store/chunk_cache.h"
#include "store/chunk_ref.h"
#include "store/pack.h"

namespace ckptfs {

// Supplies decoded, verified chunks. Implementations must be thread-safe.
class ChunkFetcher {
 public:
  virtual ~ChunkFetcher() = default;
  virtual Result<ChunkData> Fetch(const ChunkRef& chunk) = 0;
  // Decodes the whole chunk straight into `dst` (chunk.raw_len bytes),
  // bypassing any cache when the chunk is not already there: the path of
  // large sequential reads. On error the content of dst is unspecified.
  virtual Status FetchInto(const ChunkRef& chunk, std::span<std::byte> dst);
  // The reader copied `bytes` out of a chunk Fetch gave it: a cache may let
  // the chunk go once all its bytes have been used (ChunkCache::Consumed).
  virtual void Consumed(const ChunkRef& /*chunk*/, uint64_t /*bytes*/) {}
};

// Chunks read from packs and their stored bytes, relaxed counters shared by
// a repository's fetchers: what a load cost the store.
struct FetchCounters {
  std::atomic<uint64_t> chunks{0};
  std::atomic<uint64_t> stored_bytes{0};
  void Add(uint64_t bytes) {
    chunks.fetch_add(1, std::memory_order_relaxed);
    stored_bytes.fetch_add(bytes, std::memory_order_relaxed);
  }
};

// Reads a chunk by location lookup, without caching.
class DirectFetcher : public ChunkFetcher {
 public:
  using Lookup = std::function<Result<ChunkLocation>(const ChunkId&)>;
  // Decoded chunks are leased from `buffers` (allocated per chunk when null).
  // `refresh`, when given, is called once when a chunk's pack is gone and
  // the lookup still names it: an object store's catalog learns there where
  // gc on another host moved the chunk.
  // `counters`, when given, counts every chunk read from a pack.
  DirectFetcher(Backend* backend, Lookup lookup, BufferPool* buffers = nullptr,
                std::function<Status()> refresh = {}, FetchCounters* counters = nullptr)
      : backend_(backend),
        lookup_(std::move(lookup)),
        buffers_(buffers),
        refresh_(std::move(refresh)),
        counters_(counters) {}
  Result<ChunkData> Fetch(const ChunkRef& chunk) override;
  Status FetchInto(const ChunkRef& chunk, std::span<std::byte> dst) override;
  // The chunk as it is stored (encoded), checked (ReadStoredChunk), in a
  // buffer leased from `buffers`: its location says how it is encoded and
  // how many of `stored`'s bytes hold it.
  Result<ChunkLocation> FetchStored(const ChunkRef& chunk, BufferPool& buffers, BufferPool::Lease* stored);

 private:
  // Reads the chunk at `loc` with `read(location)`, looking it up again
  // where gc moved it meanwhile; the location read last. A template, not a
  // std::function: it runs once per chunk read, and a std::function of a
  // lambda holding three references allocates.
  template <class Read>
  Result<ChunkLocation> WithRelocation(const ChunkId& id, ChunkLocation loc, const Read& read);
  Backend* backend_;
  Lookup lookup_;
  BufferPool* buffers_;
  std::function<Status()> refresh_;
  FetchCounters* counters_;
};

// A DirectFetcher behind a shared cache of decoded chunks: Fetch keeps what
// it read in `cache`; FetchInto uses a cached chunk and otherwise reads
// straight into the destination without caching it.
class CachedFetcher : public ChunkFetcher {
 public:
  CachedFetcher(ChunkCache* cache, DirectFetcher direct) : cache_(cache), direct_(std::move(direct)) {}
  Result<ChunkData> Fetch(const ChunkRef& chunk) override;
  Status FetchInto(const ChunkRef& chunk, std::span<std::byte> dst) override;
  void Consumed(const ChunkRef& chunk, uint64_t bytes) override;

 private:
  ChunkCache* cache_;
  DirectFetcher direct_;
};

}  // namespace ckptfs
