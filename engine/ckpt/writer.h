// Saving one rank's part of a checkpoint (ckpt/repository.h): where a
// shard's bytes come from, the writer, and the handle of its commit.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <future>
#include <memory>
#include <span>
#include <string>

#include "core/fork.h"
#include "core/region.h"
#include "core/status.h"
#include "io/mapped_file.h"
#include "meta/records.h"

namespace ckptfs {

// Bytes a source lends to the writer: valid while `keep` is held. The
// writer drops `keep` as soon as it has hashed and encoded (or copied) them.
struct BorrowedBytes {
  std::span<const std::byte> bytes;
  std::shared_ptr<const void> keep;  // empty: nothing was lent
  // The bytes are the source's own copy (a staging buffer) that nothing
  // changes while `keep` is held: the writer hashes and encodes them in
  // place. Otherwise (a mapped file another process may rewrite) the writer
  // copies each chunk it stores before hashing and encoding it.
  bool stable = false;
  // The bytes are a copy made for this save alone (StableSource): they stay
  // in memory whatever the writer does, so it need not bound how many of
  // them its jobs hold, and PutShard returns without waiting for them.
  bool resident = false;
};

// Where a shard's bytes come from. Read and Borrow are called from one
// thread, together covering consecutive offsets. The GPU layer implements
// this to stream from device memory.
class ShardSource {
 public:
  virtual ~ShardSource() = default;
  virtual uint64_t size() const = 0;
  virtual Status Read(uint64_t offset, std::span<std::byte> dst) = 0;
  // The bytes, when they are in host memory that stays valid until PutShard
  // returns; lets the writer hash them in place (and skip chunks stored
  // already). The caller may still change them meanwhile (another thread,
  // an optimizer step during an asynchronous save): a chunk the writer
  // stores is copied first and hashed and encoded from the copy, so such a
  // change gives a mix of old and new values, never a chunk that fails its
  // id.
  virtual const std::byte* HostData() const { return nullptr; }
  // Whether Read may be called at any offsets in any order. A source that
  // streams (from a device) reads forward only, and the writer then takes
  // a box shard that it cuts into tiles a band of rows at a time.
  virtual bool RandomAccess() const { return HostData() != nullptr; }
  // Zero-copy for sources that stage through their own buffers: the writer
  // first announces its chunk boundaries (offsets into the source, from 0 to
  // size()), then asks to borrow each chunk. A source that cannot lend one
  // returns empty BorrowedBytes, and the writer Reads that chunk instead.
  virtual void PlanChunks(std::span<const uint64_t> bounds) { (void)bounds; }
  virtual Result<BorrowedBytes> Borrow(uint64_t offset, uint64_t n) {
    (void)offset;
    (void)n;
    return BorrowedBytes{};
  }
};

// A ShardSource over caller memory.
class HostSource final : public ShardSource {
 public:
  explicit HostSource(std::span<const std::byte> data) : data_(data) {}
  uint64_t size() const override { return data_.size(); }
  Status Read(uint64_t offset, std::span<std::byte> dst) override;
  const std::byte* HostData() const override { return data_.data(); }

 private:
  std::span<const std::byte> data_;
};

// A ShardSource over one span of host memory that `keep` holds, lent to
// the writer as it is (Borrow) for as long as the writer needs it.
class LentSource : public ShardSource {
 public:
  uint64_t size() const override { return data_.size(); }
  Status Read(uint64_t offset, std::span<std::byte> dst) override;
  Result<BorrowedBytes> Borrow(uint64_t offset, uint64_t n) override;
  bool RandomAccess() const override { return true; }

 protected:
  // `stable` and `resident` as in BorrowedBytes; `kind` names the source
  // in errors.
  LentSource(std::shared_ptr<const void> keep, std::span<const std::byte> data, bool stable, bool resident,
             const char* kind)
      : keep_(std::move(keep)), data_(data), stable_(stable), resident_(resident), kind_(kind) {}

 private:
  std::shared_ptr<const void> keep_;
  std::span<const std::byte> data_;
  bool stable_, resident_;
  const char* kind_;
};

// A ShardSource over bytes of a mapped file, which it lends to the writer:
// the writer's threads keep the mapping while they hash and encode them, so
// PutShard returns without waiting for them, and a caller putting many
// shards keeps every thread busy. Another process may rewrite the file, so
// the bytes are not stable: the writer copies each chunk it stores.
class MappedSource final : public LentSource {
 public:
  // Bytes [offset, offset + size) of `file`; InvalidArgument from Make when
  // they are not inside it.
  static Result<MappedSource> Make(std::shared_ptr<const MappedFile> file, uint64_t offset, uint64_t size);

 private:
  MappedSource(std::shared_ptr<const MappedFile> file, std::span<const std::byte> data)
      : LentSource(std::move(file), data, /*stable=*/false, /*resident=*/false, "mapped") {}
};

// A ShardSource over a private copy of a shard's bytes, such as an
// asynchronous save stages: nothing changes them while `keep` is held. They
// are lent to the writer as stable and resident, so its threads hash and
// encode them in place, with no copy of their own, and PutShard returns as
// soon as every chunk is queued.
//
// A source that is not `resident` (a buffer of a stream that goes on
// filling others) is lent as stable only: the writer then bounds how many
// of its chunks are in flight, and so how many buffers the stream holds.
class StableSource final : public LentSource {
 public:
  StableSource(std::shared_ptr<const void> keep, std::span<const std::byte> data, bool resident = true)
      : LentSource(std::move(keep), data, /*stable=*/true, resident, "staged") {}
};

// How AppendBlob cuts a piece of a streamed blob.
enum class BlobPiece {
  kContent,  // by content, with the bytes around it
  kUnit,     // at its ends, and at fixed offsets inside (see AppendBlob)
};

struct TensorInfo {
  std::string name;
  DType dtype = DType::kU8;
  Shape shape;
};

// A new save attempt for WriterOptions::attempt: 16 decimal digits of the
// wall clock's milliseconds, '-', 16 random hex digits. Attempts compare as
// strings in the order they were made, as long as the clocks of the hosts
// making them agree to within the time a restart takes.
std::string NewSaveAttempt();

struct CommitResult {
  bool checkpoint_visible = false;  // this commit was the last rank's
  uint64_t chunks_written = 0;      // new chunks stored by this rank
  uint64_t chunks_deduplicated = 0;
  uint64_t logical_bytes = 0;       // bytes this rank put
  uint64_t stored_bytes = 0;        // bytes this rank appended to packs
};

// Completion of an asynchronous commit.
class CommitHandle {
 public:
  CommitHandle() = default;
  CommitHandle(const CommitHandle&) = default;
  CommitHandle(CommitHandle&&) = default;
  // Assigning over a handle of a commit started before a fork, in the
  // child, leaves that commit's state alone, as destroying it does.
  CommitHandle& operator=(const CommitHandle& other);
  CommitHandle& operator=(CommitHandle&& other) noexcept;
  ~CommitHandle();
  // Blocks until the commit finished; its outcome. In a child forked after
  // the commit started: FailedPrecondition (the commit runs in the parent).
  Result<CommitResult> Wait();
  bool Ready() const;
  // Time the caller was blocked inside PutShard/PutBlob/Commit (the part of
  // the save that training waits for), and the time from the first put until
  // the commit was durable.
  std::chrono::nanoseconds blocking_time() const { return blocking_; }
  std::chrono::nanoseconds total_time() const;

 private:
  friend class CheckpointWriter;
  friend class WriterImpl;
  // A handle whose Wait returns `st` (not OK): a commit that never started.
  static CommitHandle Failed(Status st);
  // Lets go of future_; in a forked child, without destroying its state
  // (a thread of the parent, absent here, may have held its lock at the
  // fork).
  void ReleaseFuture();
  std::shared_future<Result<CommitResult>> future_;
  uint64_t fork_generation_ = ForkGeneration();
  std::chrono::nanoseconds blocking_{0};
  std::shared_ptr<std::atomic<int64_t>> total_ns_;
};

// A blob of a committed checkpoint that a new checkpoint takes, under a
// name of its own (Repository::ComposeCheckpoint).
struct BlobFrom {
  std::string checkpoint;  // a committed checkpoint of the same repository
  std::string blob;        // one of its blobs
  std::string as;          // the blob's name in the new checkpoint
};

// A shard of a tensor for Repository::ComposeCheckpoint whose bytes (its
// region's elements in row-major order) lie in a blob of another committed
// checkpoint, from `offset` on, starting and ending at chunk boundaries of
// the blob: a tensor inside a file written through ckptfs://, stored as a
// unit (BlobPiece::kUnit). The shard references the blob's chunks.
struct TensorFrom {
  TensorInfo tensor;
  Region region;
  std::string checkpoint;
  std::string blob;
  uint64_t offset = 0;
};

class RepositoryImpl;
class WriterImpl;
struct ChunkSlice;
class DirectFetcher;
class ThreadPool;
struct CopyCounters;

// Writes one rank's part of a checkpoint.
class CheckpointWriter {
 public:
  ~CheckpointWriter();  // aborts when not committed

  // Stores a shard of `tensor` covering `region` (a box or a flat range of
  // the global tensor). `source` yields the region's elements row-major.
  // A box that is not contiguous in row-major order is stored as the tiles
  // of the tensor's grid (GridTile) that it meets, one shard record each,
  // so that the same region gives the same chunks whatever the cut.
  // Returns once the source's bytes have been consumed (hashed and encoded or
  // copied into the pipeline); hashing, compression and pack writes run on
  // the worker pool. InvalidArgument for a region that does not fit the shape,
  // a source of the wrong size, or a tensor put twice with different dtype or
  // shape by this rank. Putting one region twice is allowed (the copies are
  // merged like replicas); different bytes for it fail the commit.
  Status PutShard(const TensorInfo& tensor, const Region& region, ShardSource& source);
  // The whole tensor from host memory.
  Status PutTensor(const TensorInfo& tensor, std::span<const std::byte> data);
  // Named non-tensor bytes (RNG state, data loader position, config).
  Status PutBlob(const std::string& name, std::span<const std::byte> data);
  // A blob whose bytes arrive in pieces (a file written through fsspec):
  // BeginBlob, AppendBlob as often as needed, EndBlob. Each piece is copied
  // into the writer's pooled buffers and cut by content there, with the
  // same chunks PutBlob would give the whole, so no piece is held whole and
  // no fresh memory is touched. AppendBlob returns once the piece is copied,
  // waiting only while the pipeline is full. One streamed blob at a time;
  // Commit fails while one is open.
  //
  // A piece given as BlobPiece::kUnit (a tensor's bytes inside a file of a
  // format ckptfs knows) is cut at both its ends and at fixed offsets of
  // the chunk size from its start, as a tensor's bytes are: the unit keeps
  // its chunks whatever came before it, needs no content cuts, and its
  // chunks are those of the same bytes put as a flat tensor. `dtype` (a
  // unit's elements, which its size must be a multiple of) lets the codec
  // group its bytes as a tensor's are; it does not change the chunks.
  Status BeginBlob(const std::string& name);
  Status AppendBlob(std::span<const std::byte> data, BlobPiece piece = BlobPiece::kContent,
                    DType dtype = DType::kU8);
  Status EndBlob();
  // Seals this rank's packs (durable), then records its part in the catalog.
  // The checkpoint becomes visible, atomically, with the last rank's commit;
  // that commit fails if the ranks' shards do not tile every tensor, and the
  // checkpoint then stays invisible. Runs in the background.
  CommitHandle Commit();
  // Drops everything put so far; nothing becomes visible.
  void Abort();

 private:
  friend class Repository;
  friend Status PutStoredRank(CheckpointWriter& writer, const RankRecord& part, std::span<const ChunkRef> send,
                              DirectFetcher& source, ThreadPool& io, size_t threads, CopyCounters& counters);
  explicit CheckpointWriter(std::shared_ptr<WriterImpl> impl);
  // The writer, unless it was aborted or this is a forked child (an error).
  Result<WriterImpl*> Usable() const;
  std::shared_ptr<WriterImpl> impl_;  // shared with a commit in flight
};

}  // namespace ckptfs
