// The save pipeline: chunking, hashing, dedup, encoding and pack writing,
// without a catalog or a checkpoint. A writer (writer.cc) runs one per rank
// and hands what it stored to the commit protocol (commit.h); the pipeline
// itself knows a store to write packs to, the threads and buffers to use,
// and how to ask whether a chunk is stored already.
//
// The caller's thread cuts a stream into chunks (aligned to the tensor's
// global byte offsets for flat ranges) and hands them to the compute pool,
// which hashes each chunk, skips chunks already stored, encodes the rest and
// queues them for a single pack-writer thread that appends to packs. A shard
// of one chunk in host memory is processed on the caller's thread, which
// waits for it anyway, and small encoded chunks reach the pack writer in
// batches: a state of many tiny tensors would otherwise pay thread wake-ups
// for every tensor. A chunk
// is stored under the id of exactly the bytes that were encoded: bytes the
// caller may still change are copied before they are hashed and encoded
// (Process), so a source changed during a save never stores a chunk that
// fails its id. Memory
// in flight is bounded: at most 2 * workers + 2 chunks are being hashed or
// encoded, and at most 2 * workers + 1 encoded chunks wait for the disk;
// chunks of a private copy staged for the save (StableSource) are queued
// all at once, since their bytes are in memory already.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <span>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "backend/backend.h"
#include "codec/codec.h"
#include "ckpt/repository.h"
#include "core/buffer_pool.h"
#include "core/chunk_id.h"
#include "core/status.h"
#include "core/thread_pool.h"
#include "store/chunk_ref.h"
#include "store/pack.h"

namespace ckptfs {

struct PipelineSettings {
  Backend* store = nullptr;      // packs are written here
  ThreadPool* pool = nullptr;    // hashing and encoding
  BufferPool* buffers = nullptr; // staged source bytes and encoded chunks
  uint64_t chunk_size = 0;
  uint64_t pack_size = 0;
  CodecOptions codec;
  // Store a chunk raw when the disk waits for the codec and the chunk would
  // compress poorly (RepositoryConfig::adaptive).
  bool adaptive = false;
  // Encoded chunks waiting for any pack writer of the process (shared by
  // the pipelines of one repository): the adaptive codec's view of whether
  // the disk keeps up. Null: this pipeline's own count.
  std::atomic<int64_t>* queued_chunks = nullptr;
  // Where a chunk is stored already; NotFound when it is not (it is then
  // stored). Called from the compute pool.
  std::function<Result<ChunkLocation>(const ChunkId&)> lookup;
};

struct PipelineStats {
  uint64_t chunks_written = 0;       // stored by this pipeline
  uint64_t chunks_deduplicated = 0;  // seen before in this pipeline, or stored already
  uint64_t stored_bytes = 0;         // appended to packs
};

class SavePipeline {
 public:
  explicit SavePipeline(PipelineSettings settings);
  // Shutdown(); the packs written stay (Finish, or packs().Discard()).
  ~SavePipeline();
  SavePipeline(const SavePipeline&) = delete;
  SavePipeline& operator=(const SavePipeline&) = delete;

  // Chunk boundaries of a stream of `size` bytes that starts at byte
  // `global_start` of its tensor: at multiples of chunk_size in the
  // tensor's coordinates, so a flat range chunks the same whatever the
  // world size. Starts with 0 and ends with size.
  std::vector<uint64_t> ChunkBounds(uint64_t global_start, uint64_t size) const;

  // Chunk boundaries of a blob's bytes: content-defined (core/content_cuts.h)
  // aiming at chunk_size/16 bytes a chunk (at most chunk_size/8), so a
  // region that did not change keeps its chunks when bytes before it were
  // inserted or removed. Starts with 0 and ends with data.size().
  std::vector<uint64_t> ContentBounds(std::span<const std::byte> data) const;
  static constexpr uint64_t kBlobChunkFraction = 16;

  // Chunks `source` at `bounds` and sets `chunks` to the chunks' refs.
  // Returns once it no longer needs the source's bytes; the chunks may
  // still be on their way to a pack. One caller thread at a time.
  Status Stream(const std::vector<uint64_t>& bounds, DType dtype, ShardSource& source, std::vector<ChunkRef>& chunks);

  // Chunks already encoded, as another repository stores them (a copy,
  // copy.h): after Start, StoreEncoded queues each for the pack writer as
  // it is (its hash checked by whoever read it; the caller sends each chunk
  // once), blocking while that queue is full. StoreEncoded may be called
  // from several threads at once; not together with Stream.
  void Start();
  void StoreEncoded(const ChunkId& id, Codec codec, uint32_t raw_len, BufferPool::Lease bytes, size_t size);

  // The first error of any step (sticky); after one nothing more is written.
  Status error();
  // Makes `st` the error, unless there is one already.
  void Fail(const Status& st);

  // Waits for every chunk in flight and stops the pack writer. Idempotent;
  // nothing may be streamed afterwards.
  void Shutdown();
  // After Shutdown: seals the last pack and returns every pack written.
  Result<std::vector<SealedPack>> Finish() { return packs_.Finish(); }
  PackWriter& packs() { return packs_; }
  // After Shutdown: where each chunk this pipeline stored went.
  const std::unordered_map<ChunkId, ChunkLocation, ChunkIdHash>& stored() const { return stored_; }
  PipelineStats stats();

 private:
  struct Job {
    std::span<const std::byte> data;
    BufferPool::Lease owned;            // when the source is not host memory
    std::shared_ptr<const void> keep;   // holds bytes a source lent
    // Nothing changes `data` while the job runs (a buffer of the pipeline's,
    // or bytes lent as stable): hashed and encoded in place. Otherwise a new
    // chunk is copied first, and the copy is hashed and encoded.
    bool stable = false;
    // Lent as resident (BorrowedBytes::resident): not counted against the
    // in-flight bound.
    bool resident = false;
    DType dtype;
    ChunkRef* slot;
    WaitGroup* shard_wg;  // waited on by Stream for zero-copy jobs
  };
  // One of the chunks an Encoded batch holds: buffer.data() + offset.
  struct Small {
    ChunkId id;
    Codec codec;
    uint32_t raw_len;
    size_t offset, size;
  };
  struct Encoded {
    ChunkId id;
    Codec codec;
    uint32_t raw_len;
    BufferPool::Lease buffer;  // the stored bytes: buffer.first(size)
    size_t size = 0;
    // A batch of small chunks instead (id, codec and raw_len unused): one
    // hand-off to the pack writer for many of them.
    std::vector<Small> batch;
  };
  void Submit(Job job);
  void Process(Job& job);
  // Whether chunk `id` is stored already or claimed by another job of this
  // pipeline (counted as deduplicated then); an error of the lookup.
  Result<bool> Known(const ChunkId& id);
  // Counts a chunk as new or stored already, for the choice of copying a
  // changeable source before or after hashing it (Process).
  void NoteNew(bool is_new);
  void Enqueue(Encoded enc);
  // Adds a small encoded chunk to the batch, queueing the batch when it is
  // full; Flush queues what the batch holds.
  void AddSmall(Encoded enc);
  void FlushSmall();
  // Appends one encoded chunk to a pack and notes where it went.
  void Store(const ChunkId& id, Codec codec, uint32_t raw_len, std::span<const std::byte> bytes);
  void WriterLoop();

  const PipelineSettings settings_;
  std::atomic<int64_t> own_queued_{0};
  // How many of the last chunks were new, as a score from 0 to
  // 2 * kRecentNewHalf. A save starts just below the half: its first chunk
  // is hashed in place, and one new chunk turns it to copying first. A
  // save after a save (most chunks stored already) then copies none of
  // its stored chunks, where starting from "new" copied the first
  // kRecentNewHalf + 1 chunks of every writer; a first save pays one
  // extra hash of one chunk.
  static constexpr int kRecentNewHalf = 8;
  // New chunks encoded to at most this size reach the pack writer in
  // batches (a pooled buffer's worth), not one hand-off each.
  static constexpr size_t kBatchBytes = 64 << 10;
  std::atomic<int> recent_new_{kRecentNewHalf - 1};
  std::atomic<int64_t>& queued_;
  PackWriter packs_;

  // The caller's thread (Stream), the compute workers (Process) and the
  // pack-writer thread (WriterLoop) share what follows. Once Shutdown has
  // returned, no worker task or pack-writer thread is left.
  std::mutex mu_;
  Status error_;                                                    // guarded by mu_
  // Chunks handled: the first job with an id stores or deduplicates it,
  // later ones only reference it.
  std::unordered_set<ChunkId, ChunkIdHash> seen_;                   // guarded by mu_
  std::unordered_map<ChunkId, ChunkLocation, ChunkIdHash> stored_;  // guarded by mu_ (alone after Shutdown)
  PipelineStats stats_;                                             // guarded by mu_

  // In-flight bound.
  const size_t max_inflight_;
  std::condition_variable inflight_cv_;  // with mu_
  size_t inflight_ = 0;                  // guarded by mu_
  WaitGroup inflight_wg_;                // its own lock

  // Encoded chunks waiting for the pack-writer thread.
  const size_t queue_limit_;
  std::mutex queue_mu_;
  std::condition_variable queue_cv_;  // with queue_mu_
  std::deque<Encoded> queue_;         // guarded by queue_mu_
  bool stop_writer_ = false;          // guarded by queue_mu_
  // Small chunks not yet queued (a batch, kBatchBytes).
  std::mutex small_mu_;
  Encoded small_;  // guarded by small_mu_
  // Started by the first Stream or by Start (the caller's thread);
  // Shutdown joins it.
  // A thread of its own rather than a pool task: it runs as long as the
  // pipeline, and would otherwise hold a pool thread that other writers'
  // chunks or commits wait for.
  std::thread writer_thread_;
};

}  // namespace ckptfs
