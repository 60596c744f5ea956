// The read planner: reading any region of a tensor, or any byte range of
// its byte image or of a blob, from whatever shards were saved, chunk by
// chunk through a ChunkFetcher (store/chunk_fetcher.h).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/region.h"
#include "core/status.h"
#include "core/thread_pool.h"
#include "meta/records.h"
#include "store/chunk_cache.h"
#include "store/chunk_fetcher.h"

namespace ckptfs {

class ShardIndex;

// Every read below plans from the tensor's shards: all of them, or those
// `index` (the tensor's ShardIndex, when given) says a region can meet.

// Copies the elements of `request` (a box in the tensor's index space) into
// `dst`, laid out row-major over the box. dst.size() must be
// request.NumElements() * element size. Chunks are loaded in parallel on
// `pool` when given (and when not already on a pool thread).
// Corruption if a chunk fails verification or the shards leave part of the
// request uncovered.
Status ReadTensorBox(const TensorRecord& tensor, const Box& request, std::span<std::byte> dst,
                     ChunkFetcher& fetcher, ThreadPool* pool, const ShardIndex* index = nullptr);

// Copies bytes [offset, offset + dst.size()) of the tensor's row-major
// little-endian byte image.
Status ReadTensorBytes(const TensorRecord& tensor, uint64_t offset, std::span<std::byte> dst,
                       ChunkFetcher& fetcher, ThreadPool* pool, const ShardIndex* index = nullptr);

// Bytes of a decoded chunk that a read uses in place: data->data() + offset,
// `length` bytes. `data` keeps them alive.
struct ChunkSlice {
  ChunkRef chunk;
  ChunkData data;
  uint64_t offset;
  uint64_t length;
};

// Appends to `out`, in order, the slices of decoded chunks (fetched through
// `fetcher`, i.e. its cache) that make up bytes [offset, offset + length)
// of the tensor's byte image, so a caller can hand them on without copying
// them. Returns false, appending nothing, when that would take more than
// `max_slices` slices or the range does not start and end on an element:
// the caller copies with ReadTensorBytes instead.
Result<bool> SliceTensorBytes(const TensorRecord& tensor, uint64_t offset, uint64_t length, ChunkFetcher& fetcher,
                              size_t max_slices, std::vector<ChunkSlice>& out, const ShardIndex* index = nullptr);

// The chunks that bytes [offset, offset + length) of the tensor need, each
// once, in the order a read would use them.
Result<std::vector<ChunkRef>> ChunksForBytes(const TensorRecord& tensor, uint64_t offset, uint64_t length,
                                             const ShardIndex* index = nullptr);

// Which of a tensor's shards a box can meet, found without looking at
// every shard. The shards' extents along one dimension (the one along which
// their starts differ most: rows for Shard(0), columns for Shard(1), the
// rows a flat range spans) are sorted by start, each with the largest end
// among it and the shards before it; a query walks back from the last shard
// starting before the box's end while that largest end reaches into the
// box. Built once, O(S log S) in the S shards; a query of a box that meets
// k of them costs O(log S + k) when the shards tile that dimension.
// A caller that plans many regions of one tensor builds one: a collective
// load (every rank's regions), a CheckpointReader (every read of a tensor
// with many shards, such as the mount's requests).
class ShardIndex {
 public:
  explicit ShardIndex(const TensorRecord& tensor);
  // Replaces `out` with the shards whose extent meets the box's along the
  // indexed dimension, in shard order (the order a read takes them in).
  void Candidates(const Box& box, std::vector<size_t>& out) const;

 private:
  struct Extent {
    uint64_t start;
    uint64_t end;
    size_t shard;
  };
  size_t dim_ = 0;
  size_t shards_ = 0;
  bool every_shard_ = false;   // a 0-d tensor
  std::vector<Extent> by_start_;
  std::vector<uint64_t> reach_;  // reach_[i]: the largest end of by_start_[0..i]
};

// The chunks that a read of `region` (a box or a flat element range) needs,
// each once, in the order the read would use them. InvalidArgument when the
// region does not lie inside the tensor. `index`, when given, is the
// tensor's ShardIndex.
Result<std::vector<ChunkRef>> ChunksForRegion(const TensorRecord& tensor, const Region& region,
                                              const ShardIndex* index = nullptr);

// Copies bytes [offset, offset + dst.size()) of a blob; a read of many
// chunks fetches and decodes them on `pool`'s threads too, as tensor reads do.
Status ReadBlobBytes(const BlobRecord& blob, uint64_t offset, std::span<std::byte> dst,
                     ChunkFetcher& fetcher, ThreadPool* pool = nullptr);

}  // namespace ckptfs
