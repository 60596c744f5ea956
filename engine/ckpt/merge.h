// The commit merge: the ranks' records of a checkpoint become its tensors
// and blobs, with the checks that shards tile each tensor exactly and that
// replicas and overlaps hold the same bytes (read through the read planner).
#pragma once

#include <vector>

#include "core/status.h"
#include "meta/records.h"
#include "store/chunk_fetcher.h"

namespace ckptfs {

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
