// A cache of decoded chunks shared by reader threads.
//
// Bounded by the memory its buffers hold (LRU; a small chunk in a pooled,
// chunk-sized buffer counts as the buffer). Concurrent requests for the same chunk decode it
// once: later callers wait for the first. Errors are not cached. Readers
// say how many bytes they copied out of an entry (Consumed); an entry whose
// every byte has been copied out once leaves the cache, so a one-pass load
// recycles a few buffers instead of filling the cache with chunks nobody
// reads again (on the machines ckptfs runs on, fresh memory costs more than
// decoding a chunk).
// Thread safety: all methods are thread-safe.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

#include "core/buffer_pool.h"
#include "core/chunk_id.h"
#include "core/status.h"

namespace ckptfs {

// A decoded chunk, in a buffer leased from a BufferPool (given back when the
// last reference goes, e.g. when the cache evicts it) or allocated for it
// alone. Not zero-filled: decoders write every byte.
class ChunkBuffer {
 public:
  ChunkBuffer(BufferPool::Lease lease, size_t size) : lease_(std::move(lease)), size_(size) {}
  explicit ChunkBuffer(size_t size) : owned_(new std::byte[size]), size_(size) {}
  std::byte* data() { return lease_ ? lease_.data() : owned_.get(); }
  const std::byte* data() const { return lease_ ? lease_.data() : owned_.get(); }
  size_t size() const { return size_; }
  // The memory it holds: a pooled buffer is chunk-sized whatever the chunk.
  size_t footprint() const { return lease_ ? lease_.capacity() : size_; }
  std::span<std::byte> span() { return {data(), size_}; }

 private:
  BufferPool::Lease lease_;
  std::unique_ptr<std::byte[]> owned_;
  size_t size_;
};

using ChunkData = std::shared_ptr<const ChunkBuffer>;

class ChunkCache {
 public:
  explicit ChunkCache(size_t capacity_bytes);

  // Returns the decoded chunk, calling `load` (outside the lock) on a miss.
  Result<ChunkData> Get(const ChunkId& id, const std::function<Result<ChunkData>()>& load);
  // The chunk when it is cached and loaded; never loads.
  std::optional<ChunkData> Peek(const ChunkId& id);
  // True when the chunk is cached or being loaded.
  bool Contains(const ChunkId& id) const;
  // Drops every entry (e.g. after a chunk was found corrupt elsewhere).
  void Clear();
  // Drops one chunk unless it is being loaded: a sequential reader is done
  // with it, so its buffer can serve the next chunk (holders of its data
  // keep it until they let go).
  void Drop(const ChunkId& id);
  // Counts `bytes` copied out of the chunk's entry; drops the entry once
  // the count reaches its size. No-op when the chunk is not cached.
  void Consumed(const ChunkId& id, uint64_t bytes);
  size_t bytes() const;  // the footprint of the entries held
  size_t capacity() const { return capacity_; }

 private:
  struct Entry {
    ChunkData data;  // null while loading
    std::list<ChunkId>::iterator lru;
    bool loading = false;
    uint64_t consumed = 0;  // bytes copied out of it (Consumed)
  };
  void EvictLocked();
  void EraseLocked(std::unordered_map<ChunkId, Entry, ChunkIdHash>::iterator it);

  const size_t capacity_;
  mutable std::mutex mu_;
  std::condition_variable loaded_;
  std::unordered_map<ChunkId, Entry, ChunkIdHash> map_;
  std::list<ChunkId> lru_;  // front = most recent
  size_t bytes_ = 0;
};

}  // namespace ckptfs
