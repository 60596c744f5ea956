// Copying checkpoints between repositories (repository.h CopyCheckpoints):
// what the copy driver (copy.cc) asks of a destination writer (writer.cc).
#pragma once

#include <atomic>
#include <cstdint>
#include <unordered_set>

#include "ckpt/repository.h"
#include "core/thread_pool.h"
#include "store/chunk_fetcher.h"

namespace ckptfs {

// Counted while a rank is put; read by the copy's progress.
struct CopyCounters {
  std::atomic<uint64_t> chunks_sent{0}, raw_bytes_sent{0};
  std::atomic<uint64_t> chunks_present{0}, raw_bytes_present{0};
  // Chunks this copy handled already (sent, or found present), so that a
  // chunk several ranks hold counts once. The putting thread's only.
  std::unordered_set<ChunkId, ChunkIdHash> handled;
};

// Puts `part` (shards and blobs as another repository recorded them, their
// chunks named by id) as this writer's rank: the chunks the destination
// lacks are read as stored through `source` on up to `threads` threads of
// `io` and written to this writer's packs as they are; the rest are only
// referenced. The writer then commits as after PutShard.
Status PutStoredRank(CheckpointWriter& writer, const RankRecord& part, DirectFetcher& source, ThreadPool& io,
                     size_t threads, CopyCounters& counters);

}  // namespace ckptfs
