#include "store/chunk_cache.h"

#include <iterator>

namespace ckptfs {

ChunkCache::ChunkCache(size_t capacity_bytes) : capacity_(capacity_bytes) {}

size_t ChunkCache::bytes() const {
  std::lock_guard lock(mu_);
  return bytes_;
}

std::optional<ChunkData> ChunkCache::Peek(const ChunkId& id) {
  std::lock_guard lock(mu_);
  auto it = map_.find(id);
  if (it == map_.end() || it->second.loading) return std::nullopt;
  lru_.splice(lru_.begin(), lru_, it->second.lru);
  return it->second.data;
}

bool ChunkCache::Contains(const ChunkId& id) const {
  std::lock_guard lock(mu_);
  return map_.count(id) > 0;
}

void ChunkCache::Clear() {
  std::lock_guard lock(mu_);
  for (auto it = map_.begin(); it != map_.end();) {
    if (it->second.loading) {
      ++it;
      continue;
    }
    auto next = std::next(it);
    EraseLocked(it);
    it = next;
  }
}

void ChunkCache::EraseLocked(std::unordered_map<ChunkId, Entry, ChunkIdHash>::iterator it) {
  bytes_ -= it->second.data->footprint();
  lru_.erase(it->second.lru);
  map_.erase(it);
}

void ChunkCache::Drop(const ChunkId& id) {
  std::lock_guard lock(mu_);
  auto it = map_.find(id);
  if (it == map_.end() || it->second.loading) return;
  EraseLocked(it);
}

void ChunkCache::Consumed(const ChunkId& id, uint64_t bytes) {
  std::lock_guard lock(mu_);
  auto it = map_.find(id);
  if (it == map_.end() || it->second.loading) return;
  it->second.consumed += bytes;
  if (it->second.consumed >= it->second.data->size()) EraseLocked(it);
}

void ChunkCache::EvictLocked() {
  while (bytes_ > capacity_ && !lru_.empty()) {
    auto it = map_.find(lru_.back());
    bytes_ -= it->second.data->footprint();
    map_.erase(it);
    lru_.pop_back();
  }
}

Result<ChunkData> ChunkCache::Get(const ChunkId& id, const std::function<Result<ChunkData>()>& load) {
  std::unique_lock lock(mu_);
  while (true) {
    auto it = map_.find(id);
    if (it == map_.end()) break;
    if (!it->second.loading) {
      lru_.splice(lru_.begin(), lru_, it->second.lru);
      return it->second.data;
    }
    loaded_.wait(lock);
  }
  map_[id].loading = true;
  lock.unlock();
  Result<ChunkData> r = load();
  lock.lock();
  auto it = map_.find(id);
  if (!r.ok() || capacity_ == 0) {
    map_.erase(it);
  } else {
    it->second.loading = false;
    it->second.data = r.value();
    lru_.push_front(id);
    it->second.lru = lru_.begin();
    bytes_ += r.value()->footprint();
    EvictLocked();
  }
  loaded_.notify_all();
  return r;
}

}  // namespace ckptfs
