// Copying checkpoints between repositories (repository.h CopyCheckpoints):
// what the copy driver (copy.cc) asks of a destination writer (writer.cc).
#pragma once

#include <atomic>
#include <functional>
#include <cstdint>
#include <span>
#include <unordered_map>

#include "ckpt/repository.h"
#include "core/thread_pool.h"
#include "store/chunk_fetcher.h"

namespace ckptfs {

class RepositoryImpl;

// Counted while a rank is put; read by the copy's progress. `cancelled`,
// when set, is asked (from the I/O threads) before each chunk is fetched:
// true fails the put with FailedPrecondition ("cancelled").
struct CopyCounters {
  std::atomic<uint64_t> chunks_sent{0}, raw_bytes_sent{0};
  std::atomic<uint64_t> chunks_present{0}, raw_bytes_present{0};
  std::function<bool()> cancelled;
};

// Puts `part` (shards and blobs as another repository recorded them, their
// chunks named by id) as this writer's rank: the chunks of `send` are read
// as stored through `source` on up to `threads` threads of `io` and written
// to this writer's packs as they are; every other chunk the records name is
// only referenced, and must be at the destination by this rank's commit
// (there already, or sent by a rank that commits first). The writer then
// commits as after PutShard.
Status PutStoredRank(CheckpointWriter& writer, const RankRecord& part, std::span<const ChunkRef> send,
                     DirectFetcher& source, ThreadPool& io, size_t threads, CopyCounters& counters);

// Chunks one checkpoint's copy handled already (sent, or found present),
// each with the length it was first referenced with.
using HandledChunks = std::unordered_map<ChunkId, uint32_t, ChunkIdHash>;

// Puts `parts` (ranks of checkpoint `name` as the repository `src` stored
// them; `fetcher` reads its chunks as stored) at `destination` (whose internals `dst` are) as ranks of
// checkpoint `name` with `header`'s world size, step, tags and attempt:
// `ranks_at_once` ranks side by side, committed in the order given. Each
// chunk the destination lacks (and `handled` does not name) is read,
// checked and sent once; the others are only referenced. Counts the ranks
// committed and their stored bytes, and calls `after_wave` after each
// group of ranks. The first failure stops it; the ranks committed before
// it stay committed. FailedPrecondition ("cancelled") when
// counters.cancelled says so.
Status PutRanks(RepositoryImpl& src, DirectFetcher& fetcher, Repository& destination, RepositoryImpl& dst,
                const std::string& name,
                const WriterOptions& header, std::span<const RankRecord> parts, size_t ranks_at_once,
                HandledChunks& handled, CopyCounters& counters, uint32_t* ranks_committed, uint64_t* stored_sent,
                const std::function<void()>& after_wave);

// Rank `rank`'s part of a checkpoint of these tensors and blobs: the
// shards whose record names the rank (so that putting every rank's part
// gives each shard the same ranks, in the same order), and, for rank 0,
// the blobs.
RankRecord PartOfRank(const std::vector<TensorRecord>& tensors, const std::vector<BlobRecord>& blobs, uint32_t rank);

// Corruption unless every shard of `reader`'s checkpoint names ranks of its
// world size (or no rank would put it).
Status CheckShardRanks(const CheckpointReader& reader);

}  // namespace ckptfs
