// GPU staging: saving from and loading into device memory through a small
// pool of pinned host buffers, with copies overlapped with hashing,
// compression and I/O.
//
// A CopyEngine moves bytes between "device" and host memory asynchronously,
// in order, like one CUDA stream. Two implementations: CUDA (cudaMemcpyAsync
// on a dedicated non-blocking stream, events for completion) when the build
// has CUDA and a GPU is present, and a host engine with the same semantics
// whose "device" memory is ordinary host memory — what the CPU tests and
// builds without CUDA use.
//
// Thread safety: a CopyEngine may be used from several threads; copies
// complete in submission order. A PinnedPool's Acquire is thread-safe.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "ckpt/repository.h"
#include "core/status.h"
#include "core/thread_pool.h"

namespace ckptfs::gpu {

class CopyEngine {
 public:
  virtual ~CopyEngine() = default;
  virtual std::string Describe() const = 0;
  // Page-locked host memory for staging (pinned, so copies run at full
  // PCIe speed and asynchronously).
  virtual Result<std::byte*> AllocatePinned(size_t bytes) = 0;
  virtual void FreePinned(std::byte* p) = 0;
  // Starts an asynchronous copy and returns a ticket for Wait. Copies run
  // in submission order.
  virtual Result<uint64_t> DeviceToHost(std::byte* host, const std::byte* device, size_t n) = 0;
  virtual Result<uint64_t> HostToDevice(std::byte* device, const std::byte* host, size_t n) = 0;
  virtual Result<uint64_t> DeviceToDevice(std::byte* dst, const std::byte* src, size_t n) = 0;
  // Memory on the engine's device (host memory for the host engine), for
  // what the staging layer itself keeps there (a collective's hand-offs).
  virtual Result<std::byte*> AllocateDevice(size_t bytes) = 0;
  virtual void FreeDevice(std::byte* p) = 0;
  // Blocks until the copy of `ticket` (and all before it) finished; its
  // error, if any.
  virtual Status Wait(uint64_t ticket) = 0;
};

// Copies on a worker thread; "device" memory is host memory.
class HostCopyEngine final : public CopyEngine {
 public:
  HostCopyEngine();
  ~HostCopyEngine() override;
  std::string Describe() const override { return "host copy engine"; }
  Result<std::byte*> AllocatePinned(size_t bytes) override;
  void FreePinned(std::byte* p) override;
  Result<uint64_t> DeviceToHost(std::byte* host, const std::byte* device, size_t n) override;
  Result<uint64_t> HostToDevice(std::byte* device, const std::byte* host, size_t n) override;
  Result<uint64_t> DeviceToDevice(std::byte* dst, const std::byte* src, size_t n) override;
  Result<std::byte*> AllocateDevice(size_t bytes) override;
  void FreeDevice(std::byte* p) override;
  Status Wait(uint64_t ticket) override;

  // Test hooks: the copy after `n` more succeed fails, as a device error would.
  void FailAfter(uint64_t n);
  uint64_t pinned_allocations() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// True when CUDA is built in and a device can be used; otherwise `why` says
// why not (no CUDA in this build, or the driver's error, e.g. no GPU).
bool CudaAvailable(std::string* why);
// A CUDA engine on `device`; Unsupported when CudaAvailable is false.
Result<std::unique_ptr<CopyEngine>> NewCudaCopyEngine(int device);

// A fixed set of pinned buffers, allocated once and reused across saves and
// loads. Pinned memory never exceeds count x size.
class PinnedPool {
 public:
  // RAII lease of one buffer; returns it to the pool when destroyed.
  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& o) noexcept : pool_(o.pool_), index_(o.index_) { o.pool_ = nullptr; }
    Lease& operator=(Lease&& o) noexcept;
    ~Lease();
    std::span<std::byte> buffer() const;
    bool valid() const { return pool_ != nullptr; }

   private:
    friend class PinnedPool;
    Lease(PinnedPool* pool, size_t index) : pool_(pool), index_(index) {}
    PinnedPool* pool_ = nullptr;
    size_t index_ = 0;
  };

  static Result<std::unique_ptr<PinnedPool>> Create(CopyEngine& engine, size_t count, size_t bytes_each);
  ~PinnedPool();
  // Blocks until a buffer is free.
  Lease Acquire();
  // A free buffer, or an empty lease (valid() false) when none is.
  Lease TryAcquire();
  size_t count() const { return buffers_.size(); }
  size_t buffer_bytes() const { return bytes_each_; }
  size_t pinned_bytes() const { return buffers_.size() * bytes_each_; }

 private:
  PinnedPool(CopyEngine& engine, size_t bytes_each) : engine_(engine), bytes_each_(bytes_each) {}
  void Release(size_t index);
  CopyEngine& engine_;
  size_t bytes_each_;
  std::vector<std::byte*> buffers_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<size_t> free_;
};

// A ShardSource over device memory that streams through the pinned pool:
// device-to-host copies run ahead of the reader into every free buffer, so
// the next buffer fills while the previous one is hashed and compressed.
// Copies are cut at the writer's chunk boundaries, so a chunk lies in one
// buffer and is lent to the writer in place (Borrow): it is hashed and
// compressed straight from pinned memory, and its buffer returns to the pool
// when the last of its chunks is encoded. A chunk larger than a buffer is
// copied out instead (Read).
class DeviceSource final : public ShardSource {
 public:
  DeviceSource(CopyEngine& engine, PinnedPool& pool, const std::byte* device, uint64_t size)
      : engine_(engine), pool_(pool), device_(device), size_(size) {}
  ~DeviceSource() override;
  uint64_t size() const override { return size_; }
  Status Read(uint64_t offset, std::span<std::byte> dst) override;
  void PlanChunks(std::span<const uint64_t> bounds) override;
  Result<BorrowedBytes> Borrow(uint64_t offset, uint64_t n) override;
  // Bytes handed out in place rather than copied (for tests and benchmarks).
  uint64_t lent_bytes() const { return lent_; }

 private:
  // One device-to-host copy into a leased buffer; the buffer goes back to
  // the pool when the piece is destroyed (by the source, or by the writer's
  // last job still using bytes lent from it).
  struct Piece {
    Piece(PinnedPool::Lease l, uint64_t off, uint64_t len, uint64_t t, WaitGroup* wg)
        : lease(std::move(l)), offset(off), length(len), ticket(t), outstanding(wg) {
      outstanding->Add();
    }
    ~Piece() {
      lease = PinnedPool::Lease();
      outstanding->Done();
    }
    PinnedPool::Lease lease;
    uint64_t offset;
    uint64_t length;
    uint64_t ticket;
    WaitGroup* outstanding;
    bool waited = false;
  };
  // Keeps the pool's free buffers busy with the next copies; blocks for a
  // buffer only when no copy is in flight.
  Status Prime();
  // The piece holding `offset`, its copy finished.
  Result<Piece*> Front(uint64_t offset);
  uint64_t NextPieceEnd() const;

  CopyEngine& engine_;
  PinnedPool& pool_;
  const std::byte* device_;
  const uint64_t size_;
  std::vector<uint64_t> bounds_;  // planned chunk boundaries, if any
  uint64_t submitted_ = 0;
  uint64_t consumed_ = 0;
  uint64_t lent_ = 0;
  std::deque<std::shared_ptr<Piece>> inflight_;
  // Pieces alive, lent ones included: the destructor waits for them, so no
  // buffer is still in use by the writer once PutShard returned.
  WaitGroup outstanding_;
};

// A region of a tensor held in device memory, row-major.
struct DeviceShard {
  TensorInfo tensor;
  Region region;
  const std::byte* device = nullptr;  // region.NumElements() * dtype size bytes
};

// Streaming save of one shard into a writer: the shard flows through the
// pinned pool; while one buffer is hashed, compressed and written, the next
// is being filled by a device-to-host copy. Pinned memory stays bounded by
// the pool. The data is durable once the writer's commit is.
Status PutShardFromDevice(CheckpointWriter& writer, const DeviceShard& shard, CopyEngine& engine, PinnedPool& pool);

// Streaming save of this rank's shards of checkpoint `name`, each through
// PutShardFromDevice, then the commit: returns when they are durable. On an
// error nothing of this rank is committed.
Result<CommitResult> SaveStreaming(Repository& repo, const std::string& name, const WriterOptions& options,
                                   const std::vector<DeviceShard>& shards, CopyEngine& engine, PinnedPool& pool);

// Pinned host memory for snapshot saves, allocated on the first snapshot
// (or up front with Reserve), grown only for a larger one, and reused, so a
// snapshot save blocks for the device-to-host copies alone. One snapshot
// uses it at a time: the next SaveSnapshot waits until the previous one is
// durable (or failed). The engine must outlive it.
class SnapshotBuffer {
 public:
  explicit SnapshotBuffer(CopyEngine& engine) : engine_(engine) {}
  ~SnapshotBuffer();  // waits for a snapshot still persisting
  SnapshotBuffer(const SnapshotBuffer&) = delete;
  SnapshotBuffer& operator=(const SnapshotBuffer&) = delete;
  Status Reserve(uint64_t bytes);
  uint64_t capacity() const;

 private:
  friend class SnapshotBufferUse;
  // Waits until no snapshot uses the buffer, then makes it at least `bytes`.
  Status GrowLocked(std::unique_lock<std::mutex>& lock, uint64_t bytes);
  CopyEngine& engine_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::byte* data_ = nullptr;
  uint64_t capacity_ = 0;
  bool busy_ = false;
};

// Snapshot save: copies every shard out of device memory into `buffer` at
// full speed (all copies queued at once), returns as soon as training may
// modify its tensors, and persists in the background. `buffer` and `engine`
// must outlive the handle's background work (Wait, or the buffer's
// destructor, waits for it).
class SnapshotHandle {
 public:
  // The outcome of the background save (commit included).
  Result<CommitResult> Wait();
  // How long the caller was blocked: waiting for the previous snapshot to
  // release the buffer, and the device-to-host copies.
  std::chrono::nanoseconds blocking_time() const { return blocking_; }
  // From the start until durable; 0 until Wait returned.
  std::chrono::nanoseconds total_time() const;
  bool durable() const;

 private:
  friend Result<SnapshotHandle> SnapshotAndCommit(std::unique_ptr<CheckpointWriter>, const std::vector<DeviceShard>&,
                                                  CopyEngine&, SnapshotBuffer&, std::chrono::steady_clock::time_point);
  struct State;
  std::shared_ptr<State> state_;
  std::chrono::nanoseconds blocking_{0};
};

Result<SnapshotHandle> SaveSnapshot(Repository& repo, const std::string& name, const WriterOptions& options,
                                    const std::vector<DeviceShard>& shards, CopyEngine& engine,
                                    SnapshotBuffer& buffer);

// The same for a writer that may already hold other puts (host tensors,
// blobs): copies the device shards out, returns, then puts them and commits
// in the background. `start` is when the caller's blocking began (for
// blocking_time). On an error before the handle is returned, the writer is
// aborted.
Result<SnapshotHandle> SnapshotAndCommit(std::unique_ptr<CheckpointWriter> writer,
                                         const std::vector<DeviceShard>& shards, CopyEngine& engine,
                                         SnapshotBuffer& buffer,
                                         std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now());

// Load: `region` of `tensor` (any box or flat range: this rank's target
// sharding) into device memory, row-major. The reader's merge plan fills
// pinned buffers, which are copied to the device while the next is filled.
Status LoadToDevice(const CheckpointReader& reader, const TensorRecord& tensor, const Region& region,
                    std::byte* device, CopyEngine& engine, PinnedPool& pool);

}  // namespace ckptfs::gpu
