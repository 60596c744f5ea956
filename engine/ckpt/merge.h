// The merge planner: reading any region of a tensor from whatever shards
// were saved, and the commit-time checks that shards tile a tensor exactly.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/region.h"
#include "core/status.h"
#include "core/thread_pool.h"
#include "meta/records.h"
#include "store/chunk_cache.h"

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

// Copies the elements of `request` (a box in the tensor's index space) into
// `dst`, laid out row-major over the box. dst.size() must be
// request.NumElements() * element size. Chunks are loaded in parallel on
// `pool` when given (and when not already on a pool thread).
// Corruption if a chunk fails verification or the shards leave part of the
// request uncovered.
Status ReadTensorBox(const TensorRecord& tensor, const Box& request, std::span<std::byte> dst,
                     ChunkFetcher& fetcher, ThreadPool* pool);

// Copies bytes [offset, offset + dst.size()) of the tensor's row-major
// little-endian byte image.
Status ReadTensorBytes(const TensorRecord& tensor, uint64_t offset, std::span<std::byte> dst,
                       ChunkFetcher& fetcher, ThreadPool* pool);

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
                              size_t max_slices, std::vector<ChunkSlice>& out);

// The chunks that bytes [offset, offset + length) of the tensor need, each
// once, in the order a read would use them.
Result<std::vector<ChunkRef>> ChunksForBytes(const TensorRecord& tensor, uint64_t offset, uint64_t length);

// Copies bytes [offset, offset + dst.size()) of a blob.
Status ReadBlobBytes(const BlobRecord& blob, uint64_t offset, std::span<std::byte> dst,
                     ChunkFetcher& fetcher);

// Checks that the tensor's shards cover it exactly: no gaps, and where two
// shards overlap their bytes agree (read through `fetcher`). The message of
// an error names the tensor and the ranks and regions involved.
Status CheckTiling(const TensorRecord& tensor, ChunkFetcher& fetcher);

// Checks that every rank that saved a tensor gave it the same dtype and
// global shape; InvalidArgument naming the tensor and two ranks otherwise.
// Runs at every rank's commit, so a disagreement is reported early.
Status CheckTensorsAgree(const std::vector<RankRecord>& ranks);

// Merges the contributions of all ranks into the tensors of a checkpoint:
// replicas (same region, same bytes) become one shard listing every rank;
// dtype or shape disagreement, different bytes for one region, overlaps with
// different bytes and gaps are InvalidArgument naming the tensor. Tensors
// come out sorted by name.
Result<std::vector<TensorRecord>> MergeRankTensors(const std::vector<RankRecord>& ranks,
                                                   ChunkFetcher& fetcher);
Result<std::vector<BlobRecord>> MergeRankBlobs(const std::vector<RankRecord>& ranks);

}  // namespace ckptfs
