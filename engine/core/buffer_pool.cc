#include "core/buffer_pool.h"

#include <sys/mman.h>

#include <algorithm>
#include <mutex>
#include <new>
#include <vector>

namespace ckptfs {
namespace {

constexpr size_t kHugePage = 2 << 20;

// Large buffers: an anonymous mapping trimmed to a 2 MiB boundary, so that
// transparent huge pages can back it; small ones come from the heap.
std::byte* AllocateBuffer(size_t size) {
  if (size < kHugePage) return new std::byte[size];
  const size_t len = (size + kHugePage - 1) / kHugePage * kHugePage;
  void* p = ::mmap(nullptr, len + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  auto base = reinterpret_cast<uintptr_t>(p);
  const uintptr_t aligned = (base + kHugePage - 1) / kHugePage * kHugePage;
  if (aligned > base) ::munmap(p, aligned - base);
  const uintptr_t end = base + len + kHugePage;
  if (end > aligned + len) ::munmap(reinterpret_cast<void*>(aligned + len), end - (aligned + len));
  ::madvise(reinterpret_cast<void*>(aligned), len, MADV_HUGEPAGE);  // best effort
  return reinterpret_cast<std::byte*>(aligned);
}

void FreeBuffer(std::byte* p, size_t size) {
  if (size < kHugePage) {
    delete[] p;
    return;
  }
  const size_t len = (size + kHugePage - 1) / kHugePage * kHugePage;
  ::munmap(p, len);
}

}  // namespace

struct BufferPool::State {
  size_t buffer_size;
  size_t max_idle;
  std::mutex mu;
  std::vector<std::byte*> idle;
  BufferPoolStats stats;

  ~State() {
    for (std::byte* p : idle) FreeBuffer(p, buffer_size);
  }

  void Give(std::byte* p, size_t capacity) {
    {
      std::lock_guard lock(mu);
      if (capacity == buffer_size && idle.size() < max_idle) {
        idle.push_back(p);
        return;
      }
      stats.bytes_held -= capacity;
    }
    FreeBuffer(p, capacity);
  }
};

BufferPool::Lease& BufferPool::Lease::operator=(Lease&& o) noexcept {
  if (this != &o) {
    Reset();
    state_ = std::move(o.state_);
    data_ = o.data_;
    capacity_ = o.capacity_;
    o.data_ = nullptr;
    o.capacity_ = 0;
  }
  return *this;
}

void BufferPool::Lease::Reset() {
  if (data_) state_->Give(data_, capacity_);
  data_ = nullptr;
  capacity_ = 0;
  state_.reset();
}

BufferPool::BufferPool(size_t buffer_size, size_t max_idle) : state_(std::make_shared<State>()) {
  state_->buffer_size = buffer_size;
  state_->max_idle = max_idle;
}

BufferPool::~BufferPool() = default;

size_t BufferPool::buffer_size() const { return state_->buffer_size; }

BufferPoolStats BufferPool::stats() const {
  std::lock_guard lock(state_->mu);
  BufferPoolStats s = state_->stats;
  s.idle_buffers = state_->idle.size();
  return s;
}

BufferPool::Lease BufferPool::Acquire(size_t size) {
  Lease lease;
  lease.state_ = state_;
  const size_t capacity = size <= state_->buffer_size ? state_->buffer_size : size;
  {
    std::lock_guard lock(state_->mu);
    if (capacity == state_->buffer_size && !state_->idle.empty()) {
      lease.data_ = state_->idle.back();
      state_->idle.pop_back();
      lease.capacity_ = capacity;
      ++state_->stats.reuses;
      return lease;
    }
    ++state_->stats.allocations;
    state_->stats.bytes_held += capacity;
  }
  try {
    lease.data_ = AllocateBuffer(capacity);
  } catch (...) {
    std::lock_guard lock(state_->mu);
    --state_->stats.allocations;
    state_->stats.bytes_held -= capacity;
    throw;
  }
  lease.capacity_ = capacity;
  return lease;
}

ScratchBuffer::~ScratchBuffer() {
  if (data_) FreeBuffer(data_, capacity_);
}

std::byte* ScratchBuffer::Reserve(size_t size) {
  if (size > capacity_) {
    // Grown to at least 1 MiB at once: small first requests (a short read)
    // should not cause a chain of ever larger allocations.
    const size_t capacity = std::max<size_t>(size, 1 << 20);
    std::byte* p = AllocateBuffer(capacity);
    if (data_) FreeBuffer(data_, capacity_);
    data_ = p;
    capacity_ = capacity;
  }
  return data_;
}

}  // namespace ckptfs
