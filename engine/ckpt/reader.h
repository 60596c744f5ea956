// Reading a committed checkpoint (ckpt/repository.h): the reader, which
// serves any region of any tensor, and the read lease that keeps the
// checkpoint's bytes from gc while it is held.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/region.h"
#include "core/status.h"
#include "meta/records.h"

namespace ckptfs {

class RepositoryImpl;
struct ChunkSlice;

// Chunks read from packs and their stored bytes (Repository::fetch_counts).
struct FetchCounts {
  uint64_t chunks = 0;
  uint64_t stored_bytes = 0;
};

struct StoredSizes {
  uint64_t total = 0;
  std::vector<uint64_t> tensors;
  std::vector<uint64_t> blobs;
};

class ReaderImpl;

// A read lease on a checkpoint (docs/DESIGN.md "Removal and read leases"):
// while one is held anywhere, removing the checkpoint (rm, gc's retention)
// takes its name away but gc keeps its bytes. Released when destroyed.
// A CheckpointReader holds one unless opened with ReadOptions::lease false.
class CheckpointLease {
 public:
  CheckpointLease() = default;
  ~CheckpointLease() { Release(); }
  CheckpointLease(CheckpointLease&& other) noexcept;
  CheckpointLease& operator=(CheckpointLease&& other) noexcept;
  CheckpointLease(const CheckpointLease&) = delete;
  CheckpointLease& operator=(const CheckpointLease&) = delete;
  bool held() const { return repo_ != nullptr; }
  // On an object store a released lease lingers a few seconds (lease.h);
  // `linger` false lets it go at once.
  void Release(bool linger = true);

 private:
  friend class Repository;
  CheckpointLease(std::shared_ptr<RepositoryImpl> repo, std::string name)
      : repo_(std::move(repo)), name_(std::move(name)) {}
  std::shared_ptr<RepositoryImpl> repo_;
  std::string name_;
};

// A committed checkpoint, readable by many threads at once.
class CheckpointReader {
 public:
  ~CheckpointReader();
  const CheckpointRecord& info() const;
  const std::vector<TensorRecord>& tensors() const;  // sorted by name
  const std::vector<BlobRecord>& blobs() const;
  const TensorRecord* FindTensor(std::string_view name) const;
  const BlobRecord* FindBlob(std::string_view name) const;
  // The repository's chunk size (prefetch windows are counted in chunks).
  uint64_t chunk_size() const;

  // The tensor or blob `name`, NotFound ("checkpoint 'c' has no tensor 'x'")
  // when the checkpoint has none.
  Result<const TensorRecord*> GetTensor(std::string_view name) const;
  Result<const BlobRecord*> GetBlob(std::string_view name) const;
  // The tensor a load target names, checked against the target's element
  // type and the global shape the caller expects: NotFound as GetTensor;
  // InvalidArgument naming the tensor and both values when either differs.
  Result<const TensorRecord*> FindTarget(std::string_view name, DType dtype, const Shape& shape) const;

  // Any region (box or flat range) of a tensor, row-major into dst.
  // InvalidArgument when the region does not lie inside the tensor or dst
  // is not exactly its size.
  Status ReadRegion(const TensorRecord& tensor, const Region& region, std::span<std::byte> dst) const;
  // Any box of a tensor, row-major into dst (load-time resharding).
  Status ReadBox(const TensorRecord& tensor, const Box& box, std::span<std::byte> dst) const;
  // A flat element range, e.g. this rank's part of a flattened parameter.
  Status ReadFlat(const TensorRecord& tensor, FlatRange range, std::span<std::byte> dst) const;
  // Bytes of the tensor's row-major image.
  Status ReadBytes(const TensorRecord& tensor, uint64_t offset, std::span<std::byte> dst) const;
  Status ReadBlob(const BlobRecord& blob, uint64_t offset, std::span<std::byte> dst) const;
  // Decoded chunks held for a collective load (ckpt/collective.h): this
  // reader's reads take a held chunk before the cache and the store.
  // HoldChunk fetches it from the store (verified, decoded) unless held
  // already; CopyHeldChunk copies a held chunk out (chunk.raw_len bytes) to
  // send it to another rank; ReleaseChunks lets held chunks go.
  Status HoldChunk(const ChunkRef& chunk) const;
  Status CopyHeldChunk(const ChunkRef& chunk, std::span<std::byte> dst) const;
  void ReleaseChunks(std::span<const ChunkRef> chunks) const;
  // A decoded chunk another rank fetched: checked against its id
  // (Corruption when it differs), then held so this reader's reads use it
  // and never fetch it from the store.
  Status LendChunk(const ChunkRef& chunk, std::span<const std::byte> data) const;
  // Starts loading, in the background, the chunks that bytes
  // [offset, offset + length) of the tensor need into the chunk cache, so a
  // sequential reader finds them decoded. Returns at once.
  void Prefetch(const TensorRecord& tensor, uint64_t offset, uint64_t length) const;
  // How many of the chunks that bytes [offset, offset + length) of the
  // tensor need are in the chunk cache, decoded or being loaded (what
  // Prefetch has reached; for tests and diagnostics).
  size_t ChunksCached(const TensorRecord& tensor, uint64_t offset, uint64_t length) const;
  // Drops these chunks from the chunk cache (a sequential reader is past
  // them), so their buffers serve the chunks ahead instead of new memory.
  void DropCached(std::span<const ChunkRef> chunks) const;
  // Bytes [offset, offset + length) of the tensor's image as slices of
  // decoded chunks in the chunk cache, appended to `out` in order, for a
  // caller that passes them on without copying (the mount's replies).
  // False, appending nothing, when that takes more than max_slices slices
  // or the range is not element-aligned: use ReadBytes then.
  Result<bool> SliceBytes(const TensorRecord& tensor, uint64_t offset, uint64_t length, size_t max_slices,
                          std::vector<ChunkSlice>& out) const;
  // The caller has used these slices: their bytes count as read, so chunks
  // used up leave the cache (ChunkCache::Consumed).
  void Consumed(std::span<const ChunkSlice> slices) const;
  // Stored (compressed) bytes of the distinct chunks the checkpoint
  // references, in total and per tensor and blob (in tensors()/blobs()
  // order). Reads the catalog only.
  Result<StoredSizes> StoredBytes() const;
  // A reader of part of this checkpoint: the tensors whose names begin with
  // `prefix`, named without it, and the blobs `keep_blob` admits. Its info()
  // is this checkpoint's record (so a lease taken through it is this
  // checkpoint's) with the part's tensor count and logical bytes. It holds
  // no lease of its own, and reads through the same repository.
  std::unique_ptr<CheckpointReader> Subset(std::string_view prefix,
                                           const std::function<bool(const BlobRecord&)>& keep_blob) const;

 private:
  friend class Repository;
  explicit CheckpointReader(std::unique_ptr<ReaderImpl> impl);
  std::unique_ptr<ReaderImpl> impl_;
};

}  // namespace ckptfs
