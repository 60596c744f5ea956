// A bounded, recycling pool of chunk-sized buffers for the read and save
// paths.
//
// Every chunk read or saved needs a few buffers of about the chunk size
// (stored bytes, decoded bytes, encoded bytes). Allocating them per chunk
// maps fresh pages each time (glibc serves large blocks with mmap), and on
// virtual machines the first touch of a page is expensive: reading 1 GB
// took 400,000 page faults. The pool hands out buffers as leases and keeps
// returned ones for the next request, so in steady state no chunk touches
// new memory.
//
// - Buffers are never zero-filled: a lease's content is unspecified.
// - Buffers of 2 MiB or more are 2 MiB-aligned mappings advised with
//   MADV_HUGEPAGE, which the kernel honours under the default transparent
//   huge page mode ("madvise"): one fault per 2 MiB instead of 512.
// - Requests up to buffer_size() get a pooled buffer of buffer_size() bytes;
//   larger ones get a buffer of their own, freed when the lease ends (they
//   are counted as allocations, so tests notice them).
// - The pool keeps at most max_idle buffers that no lease holds; the memory
//   in use is bounded by its users (the chunk cache's capacity, the writer's
//   in-flight limit).
//
// Thread safety: Acquire and lease destruction may run on any thread. A
// lease keeps the pool's state alive, so it may outlive the BufferPool
// object.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

namespace ckptfs {

struct BufferPoolStats {
  uint64_t allocations = 0;  // buffers allocated (pooled or oversized)
  uint64_t reuses = 0;       // leases served from an idle buffer
  uint64_t bytes_held = 0;   // bytes of buffers allocated and not yet freed
  uint64_t idle_buffers = 0;
};

class BufferPool {
  struct State;

 public:
  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& o) noexcept { *this = std::move(o); }
    Lease& operator=(Lease&& o) noexcept;
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease() { Reset(); }

    std::byte* data() const { return data_; }
    size_t capacity() const { return capacity_; }
    // The first n bytes (n <= capacity()).
    std::span<std::byte> first(size_t n) const { return {data_, n}; }
    explicit operator bool() const { return data_ != nullptr; }
    // Gives the buffer back now.
    void Reset();

   private:
    friend class BufferPool;
    std::shared_ptr<State> state_;
    std::byte* data_ = nullptr;
    size_t capacity_ = 0;
  };

  BufferPool(size_t buffer_size, size_t max_idle);
  ~BufferPool();
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  // A buffer of at least `size` bytes. Never fails short of the process
  // running out of memory (std::bad_alloc, like new).
  Lease Acquire(size_t size);

  size_t buffer_size() const;
  BufferPoolStats stats() const;

 private:
  std::shared_ptr<State> state_;
};

// Grow-only scratch memory for one thread's codec work: reused from call to
// call, never zero-filled, never shrunk; allocated like the pool's buffers
// (huge-page aligned from 2 MiB on).
class ScratchBuffer {
 public:
  ScratchBuffer() = default;
  ScratchBuffer(const ScratchBuffer&) = delete;
  ScratchBuffer& operator=(const ScratchBuffer&) = delete;
  ~ScratchBuffer();
  std::byte* Reserve(size_t size);

 private:
  std::byte* data_ = nullptr;
  size_t capacity_ = 0;
};

}  // namespace ckptfs
