// Internals shared by the repository, writer, reader and maintenance code.
// Not part of the public API.
#pragma once

#include <atomic>
#include <chrono>
#include <mutex>
#include <memory>
#include <string>

#include "backend/backend.h"
#include "ckpt/commit.h"
#include "ckpt/lease.h"
#include "ckpt/merge.h"
#include "ckpt/read_plan.h"
#include "ckpt/object_lock.h"
#include "ckpt/repository.h"
#include "core/buffer_pool.h"
#include "core/fork.h"
#include "core/thread_pool.h"
#include "meta/catalog_schema.h"
#include "ckpt/config.h"
#include "ckpt/layout.h"
#include "meta/lmdb_env.h"
#include "store/chunk_cache.h"
#include "store/chunk_fetcher.h"
#include "store/pack.h"

namespace ckptfs {


// Objects of an object store are fetched with this many requests in flight
// unless OpenOptions::io_threads says otherwise.
inline constexpr size_t kStoreRequestsInFlight = 16;

class RepositoryImpl {
 public:
  // Finishes the worker pool's queued tasks (prefetches use the fetcher,
  // the cache and the catalog) before any member they use is destroyed.
  // In a child forked after this was created, leaks the pool, the catalog,
  // the cache and the store instead (core/fork.h).
  ~RepositoryImpl();

  // The fork generation this repository was opened in (core/fork.h).
  const uint64_t fork_generation = ForkGeneration();
  bool Forked() const { return ForkGeneration() != fork_generation; }
  // FailedPrecondition in a child forked after the repository was opened:
  // every entry point of the public API calls it first.
  Status CheckProcess() const;

  std::string path;  // as given: a directory or s3://BUCKET/PREFIX
  RepositoryConfig config;
  // The objects live in an object store shared by hosts; the catalog is
  // this host's index of them, kept in `state_dir` and brought up to date
  // by the protocol's Sync (docs/DESIGN.md "Repositories on S3"). Read
  // when the repository opens, to choose its protocol and lease registry,
  // and by Repository::remote(); the code after that asks the protocol.
  bool remote = false;
  // Where the catalog and the local lock files live: the repository
  // directory, or the host's cache directory for a remote repository.
  std::string state_dir;
  ObjectLockOptions lock_options;  // remote only; `wait` is OpenOptions::lock_wait
  SyncReport opening_sync;  // what the open's sync brought in (set once)
  std::unique_ptr<Backend> backend;
  std::unique_ptr<LmdbEnv> catalog;
  // Chunk-sized buffers for decoded chunks (the cache holds them), encoded
  // chunks and staged source bytes. Declared before the cache, so it is
  // destroyed after it.
  std::unique_ptr<BufferPool> buffers;
  std::unique_ptr<ChunkCache> cache;
  FetchCounters fetched;  // chunks read from packs by fetcher_
  std::unique_ptr<ThreadPool> pool;
  // Threads for blocking store requests made in parallel (ParallelFor, up
  // to io_threads requests at once: the pool's io_threads - 1 and the
  // caller) and for commits, created at the first use: a local repository
  // starts one when it first commits.
  ThreadPool& IoPool();
  size_t io_threads = kStoreRequestsInFlight;
  // Read leases of this process (lease.h).
  std::unique_ptr<LeaseRegistry> leases;
  // How ranks commit and how this host's catalog follows the repository's
  // truth (commit.h): the catalog's protocol or the object store's, chosen
  // when the repository opens.
  std::unique_ptr<CommitProtocol> protocol;

  // Location of a committed chunk; NotFound when the catalog lacks it.
  Result<ChunkLocation> LookupChunk(const ChunkId& id) const;
  // Fetches through the shared cache.
  ChunkFetcher* fetcher() { return fetcher_.get(); }
  // After `protocol` is set.
  void InitFetcher();

  // Encoded chunks waiting for any pack writer of this process: the
  // adaptive codec's view of whether the disk keeps up.
  std::atomic<int64_t> queued_chunks{0};

 private:
  std::unique_ptr<ChunkFetcher> fetcher_;
  std::once_flag io_pool_once_;
  std::unique_ptr<ThreadPool> io_pool_;  // set once, under io_pool_once_
};

// Records a sealed pack in the catalog: its PackInfo, and the location of
// each of its chunks that has none yet (a chunk stored in another pack too
// keeps the entry it has). Returns how many chunk entries it added.
Result<uint64_t> RecordPack(WriteTxn& txn, const SealedPack& pack);
// Records a committed checkpoint from its manifest: record, tensors, blobs.
Status RecordManifest(WriteTxn& txn, const Manifest& manifest);
// Removes every catalog record of checkpoint `name` (committed or pending:
// its record, tensors, blobs and pending ranks).
Status DeleteCheckpointRecords(WriteTxn& txn, const std::string& name);
// A save that replaces checkpoint `name` (WriterOptions::overwrite) was
// committed as "NAME~" (keys::ReplacementCheckpoint): renames it over
// `name`, retiring the version `name` holds on the store now, if any.
// Called by the commit that made the replacement visible, under its locks,
// with the save's options: a thinning (WriterOptions::thins) renames only
// over the version it thinned, and keeps its place in the commit order.
Status PromoteReplacement(RepositoryImpl& repo, const std::string& name, const WriterOptions& options);
// The committed record the catalog keeps under catalog name `name`, if any.
Result<std::optional<CheckpointRecord>> CommittedRecord(RepositoryImpl& repo, const std::string& name);
// What thinning keeps of a checkpoint's tensors and blobs (ThinKeeps
// under `patterns`), and what it drops.
struct ThinPlan {
  std::vector<TensorRecord> tensors;
  std::vector<BlobRecord> blobs;
  uint64_t dropped_tensors = 0;
  uint64_t dropped_blobs = 0;
  uint64_t dropped_bytes = 0;  // logical
  bool drops() const { return dropped_tensors > 0 || dropped_blobs > 0; }
  // Thinning happens: something is dropped and a tensor stays (one that
  // would lose every tensor stays whole).
  bool thins() const { return drops() && !tensors.empty(); }
};
ThinPlan PlanThin(const std::vector<TensorRecord>& tensors, const std::vector<BlobRecord>& blobs,
                  const std::vector<std::string>& patterns);
// What `plan` drops, counted in words ("3 tensors and 1 blob").
std::string DescribeDropped(const ThinPlan& plan);
// What a thinning under `patterns` drops, in words.
std::string DescribeThinRule(const std::vector<std::string>& patterns);
// Thins committed checkpoint `name` under `patterns` (thin.cc): its
// ranks put again the kept tensors and blobs by reference (nothing is read
// or written but records) as a replacing save whose rename checks that the
// name still holds the version planned. False, with nothing changed, when
// it does not (saved again or removed meanwhile) or nothing is left to drop.
Result<bool> ThinCheckpoint(Repository& repo, const std::string& name, const std::vector<std::string>& patterns);
// Removes a replacement of `name` that was committed but never renamed (its
// save crashed in between); nothing when there is none. A save replacing
// `name` begins with it, and gc runs it for every one it finds.
Status DropCommittedReplacement(RepositoryImpl& repo, const std::string& name);
// The checkpoint the catalog keeps under `catalog_name` (a live name, or a
// retired "NAME/TOKEN"), whole: its record, tensors and blobs by name.
Result<Manifest> LoadManifest(const ReadTxn& txn, const std::string& catalog_name);
// Records `m` under catalog name `catalog_name` (RecordManifest records it
// under its own name).
Status RecordManifestAs(WriteTxn& txn, const Manifest& m, const std::string& catalog_name);
// A rank's part of a checkpoint not yet visible, as its pending/ object
// holds it: the checkpoint as this rank saw it (pending, world size, step,
// tags; committed_ranks is just this rank) and the rank's records. Encoded
// like a manifest (docs/FORMAT.md).
struct PendingRank {
  CheckpointRecord header;
  RankRecord record;
};
std::string EncodePendingRank(const CheckpointRecord& header, const RankRecord& record);
// NotFound when the object is missing; Corruption naming the key.
Result<PendingRank> ReadPendingRank(Backend& backend, const std::string& name, uint32_t rank);

// A manifest object (manifests/ or retired/) that must describe checkpoint
// `name`: NotFound when missing, Corruption when damaged or naming another.
Result<Manifest> ReadManifestObject(Backend& backend, const std::string& key, const std::string& name);

// Reindex of a repository on S3: drops this host's catalog and syncs anew.
Result<ReindexReport> ReindexRemote(const std::string& url, const OpenOptions& options);

}  // namespace ckptfs
