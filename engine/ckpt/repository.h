// The public C++ API of ckptfs: a Repository of checkpoints, a writer per
// rank, and a reader that serves any region of any tensor.
//
// Layout of a repository directory (docs/FORMAT.md):
//   ckptfs.json        config: format version, chunk size, codec settings
//   catalog/           LMDB catalog
//   objects/packs/     pack files
//   objects/manifests/ one manifest object per committed checkpoint
//   objects/retired/   removed checkpoints kept for their readers (lease.h)
//   leases/            read leases (flock files)
// A repository on S3 (s3://BUCKET/PREFIX) has the same ckptfs.json and
// objects/ under PREFIX, plus objects/pending/ (ranks of checkpoints not yet
// visible), objects/locks/ and objects/leases/; each host keeps its own
// catalog in a cache directory (OpenOptions::cache_dir).
//
// Thread safety: a Repository may be shared by threads. One Repository per
// path per process (LMDB's rule); several processes may open the same path.
// A CheckpointWriter is used by one thread; a CheckpointReader by many.
//
// Lifetimes: CheckpointWriters, CheckpointReaders and CommitHandles may
// outlive the Repository that made them. Each keeps the repository's
// internals (catalog, store, worker pool) alive, so a commit still running
// when the Repository is destroyed finishes, and its handle reports how it
// ended; the catalog, the files and the worker threads are released when
// the last of them is gone (until then, the path counts as open in this
// process).
//
// fork(): a Repository, and every writer, reader and handle made before a
// fork, belongs to the parent. In the child each entry point returns
// FailedPrecondition (a reader's Prefetch does nothing) and destroying them
// releases nothing the parent uses; a Repository opened in the child works
// as usual.
//
// The API by concept: ckpt/options.h (settings), ckpt/writer.h (saving a
// rank's part), ckpt/reader.h (reading a checkpoint), ckpt/reports.h (what
// operations report) and ckpt/names.h (valid names); this header includes
// them all and declares the Repository.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "backend/backend.h"
#include "ckpt/names.h"
#include "ckpt/options.h"
#include "ckpt/reader.h"
#include "ckpt/reports.h"
#include "ckpt/writer.h"
#include "core/buffer_pool.h"
#include "core/status.h"
#include "meta/records.h"

namespace ckptfs {

class Repository;
// Copies committed checkpoints of `source` to `destination` (any two
// repositories: local, S3, a Backend; not the same one), sending only the
// chunks the destination lacks, as they are stored (no encoding again).
// Each chunk read is checked (decoded and re-hashed) before it is written.
// A checkpoint keeps its name, step, tags, world size, tensors, shards and
// blobs; at the destination it is saved rank by rank and becomes visible
// atomically with its last rank's commit, so a copy that is interrupted
// leaves it pending, and a copy run again commits only the ranks still
// missing (and, on an object store, sends no chunk of a pack it finished).
// A checkpoint the destination has with the same content is skipped;
// AlreadyExists when it has a different one of that name, or a pending one
// of another world size or step. NotFound for a name the source lacks.
// `progress` counts the checkpoints' logical bytes.
Result<CopyReport> CopyCheckpoints(Repository& source, Repository& destination, const CopyOptions& options,
                                   const ProgressFn& progress = {});

class Repository {
 public:
  // Creates a repository in `path` (an empty or missing directory), or at
  // an s3:// URL (the bucket is created if missing; `options` give the S3
  // settings).
  static Status Init(const std::string& path, const RepositoryConfig& config, const OpenOptions& options = {});
  // AlreadyExists/NotFound/FailedPrecondition with a message saying what is
  // wrong with `path`; Unsupported for a newer format version.
  static Result<std::unique_ptr<Repository>> Open(const std::string& path,
                                                  const OpenOptions& options = {});
  // The Repository this process has open at `path` with the same
  // options.cache_dir, or else a new one (Open): LMDB allows one catalog
  // environment per file per process, so every caller of one process that
  // opens a repository this way shares one Repository (the Python package
  // does, for every object it opens). A repository this process let go and
  // whose catalog is still closing on another thread (its last reference
  // dropped there) is waited for, a few seconds at most. Another repository
  // made at the same local path since (the old one deleted or moved away)
  // is opened anew; the holders of the old one keep it. After a fork, the
  // child opens anew (the parent's belong to the parent). Thread-safe.
  static Result<std::shared_ptr<Repository>> OpenShared(const std::string& path, const OpenOptions& options = {});
  // A repository on an object store handed over as a Backend instead of
  // named by an s3:// URL (embedding ckptfs in a program that brings its
  // own store; tests over NewMemoryBackend()). Laid out as on S3: the
  // config object at the store's top, everything else under "objects/".
  // It behaves as a repository on S3 does (remote() is true, hosts sharing
  // the store see each other's checkpoints); this host's catalog is kept in
  // options.cache_dir, which must be given.
  static Status Init(Backend& store, const RepositoryConfig& config);
  static Result<std::unique_ptr<Repository>> Open(std::shared_ptr<Backend> store, const OpenOptions& options);
  // Rebuilds the catalog from packs and manifests alone. Run with no other
  // process using the repository. Pending (uncommitted) checkpoints are
  // dropped; their chunks become garbage. For a repository on S3 this
  // host's catalog is dropped and read again from the store (pending
  // checkpoints are kept there: their ranks are objects).
  static Result<ReindexReport> Reindex(const std::string& path, const ProgressFn& progress = {},
                                       const OpenOptions& options = {});
  ~Repository();

  const RepositoryConfig& config() const;
  const std::string& path() const;
  // Whether the repository is on an object store (s3://).
  bool remote() const;
  // For a repository on an object store: brings this host's catalog up to
  // date with the store, so checkpoints committed, removed or collected by
  // other hosts show. Open does it once; long-lived users (the mount) call
  // it to poll. OK and nothing to do for a local repository.
  Status Refresh();
  // Refresh once for a group of processes (the ranks of a job): one calls
  // ShareSync, which refreshes and returns what it listed and fetched
  // (empty for a local repository), and passes it to the others, whose
  // SyncFrom brings their catalogs to the same state without listing the
  // store; what a host's catalog recorded after the listing was taken stays
  // (a HEAD confirms it). A manifest a host's catalog lacks that the sharer
  // already had is read by that host. Corruption naming the listing when
  // `shared` is not what ShareSync returned. The sharer also reads the
  // indexes of the packs new to its catalog and shares them, so that a
  // job's ranks read each new pack's index once between them, not once
  // each (the packs new to another host and not to the sharer are read by
  // that host).
  Result<std::string> ShareSync();
  Status SyncFrom(std::string_view shared);
  // The chunk-buffer pool's counters (allocations, reuses, bytes held): in
  // steady state reads and saves reuse buffers and allocate none.
  BufferPoolStats buffer_stats() const;
  // Requests this repository object has sent to its object store (retries
  // included; zero for a local repository).
  RequestCounts store_requests() const;
  // Chunks this repository object's loads have read from packs (chunks
  // served by its cache are not counted again), and their stored bytes:
  // what restores cost the store.
  FetchCounts fetch_counts() const;

  // Starts (or joins) checkpoint `name` as rank `options.rank` of
  // `options.world_size`. AlreadyExists if `name` is committed or this rank
  // already committed; InvalidArgument for a bad name, a rank out of range, or
  // a world size or step that disagrees with the ranks that committed. Writes
  // nothing to the catalog: the checkpoint is recorded (pending) by the first
  // rank's commit and made visible by the last one's. The same checks run
  // again at commit, since other ranks may commit meanwhile.
  Result<std::unique_ptr<CheckpointWriter>> BeginCheckpoint(const std::string& name,
                                                            const WriterOptions& options);
  // Commits checkpoint `name` (rank 0 of world size 1; the other fields of
  // `options` as for BeginCheckpoint) made of blobs of other committed
  // checkpoints of this repository, each under the name `as` gives it.
  // Nothing is read or written but the manifests: the new checkpoint
  // references the same chunks, whatever their size, so that renaming a
  // directory of files (ckptfs.filesystem) costs one commit. NotFound for
  // an unknown checkpoint or blob; InvalidArgument for two blobs of one
  // name; FailedPrecondition when a source was removed or saved again
  // before the commit (nothing is committed then). `tensors` adds tensors
  // whose shards are byte ranges of such blobs (TensorFrom): InvalidArgument
  // when a range does not start and end at chunk boundaries, or one
  // tensor's shards disagree on its dtype or shape; the commit fails, as a
  // save's does, when the shards do not tile each tensor.
  Result<CommitResult> ComposeCheckpoint(const std::string& name, const std::vector<BlobFrom>& blobs,
                                         WriterOptions options, const std::vector<TensorFrom>& tensors = {});
  // Committed checkpoints only; NotFound otherwise. The reader holds a read
  // lease (unless options.lease is false): removing the checkpoint while it
  // is open takes the name away, but its bytes stay until the reader goes.
  Result<std::unique_ptr<CheckpointReader>> OpenCheckpoint(const std::string& name, const ReadOptions& options = {});
  // A read lease on the checkpoint `reader` reads, for as long as the lease
  // lives (the mount takes one per open file). NotFound when the checkpoint
  // was removed and its bytes were already collected.
  Result<CheckpointLease> LeaseCheckpoint(const CheckpointReader& reader);
  // The record of committed checkpoint `name`; NotFound otherwise.
  Result<CheckpointRecord> GetCheckpoint(const std::string& name);
  // Committed checkpoints in commit order; pending ones too when asked (a
  // pending save that replaces NAME is listed as "NAME~").
  Result<std::vector<CheckpointRecord>> ListCheckpoints(bool include_pending = false);
  // Removes checkpoints (committed or pending), all or none: NotFound when
  // any name is unknown, and then nothing is removed. The names go at once;
  // a committed checkpoint is retired (its manifest moved to retired/, its
  // records kept under a retired name) and gc drops it, and reclaims its
  // chunks, once no read lease on it is held. Pending ones are deleted.
  // With `missing_ok`, names that are gone already (another process removed
  // them meanwhile, as when two gc runs' retention race) are skipped.
  Status RemoveCheckpoints(const std::vector<std::string>& names, bool missing_ok = false);
  // Applies the retention policy (unless dry_run), copies the live chunks of
  // mostly-dead packs into new packs while saves go on, then, holding the gc
  // lock (repo_lock.h), re-checks liveness, deletes chunks no checkpoint
  // references, switches moved chunks to their new packs and deletes old
  // packs and packs of killed saves. Crash-safe at every step: new packs are
  // durable before the catalog refers to them, and old packs are deleted only
  // after the catalog stopped referring to them. Gc runs never overlap.
  Result<GcReport> CollectGarbage(const GcOptions& options, const ProgressFn& progress = {});
  // For pending checkpoint `name` of an object store: each rank that began
  // its save, where (host, pid) and since when, and whether it committed
  // (a sync, one LIST and one small GET per rank). Ranks not listed never began,
  // or gave their save up. Empty for a local repository, whose ranks all run
  // on this host. NotFound when no checkpoint of that name is pending.
  Result<std::vector<RankProgress>> PendingRanks(const std::string& name);
  // The checkpoints `policy` would remove.
  Result<std::vector<std::string>> PlanRetention(const RetentionPolicy& policy);
  // Every committed checkpoint, oldest first in the policy's order, with
  // what `policy` does with it and why (empty for an empty policy). The
  // errors of PlanRetention.
  Result<std::vector<RetentionDecision>> ExplainRetention(const RetentionPolicy& policy);
  // Space per checkpoint (`names`, or every committed one) and in total.
  Result<UsageReport> DiskUsage(const std::vector<std::string>& names);
  // Space per kind of state of `names` (every committed checkpoint when
  // empty), one entry per kind in kStateKinds's order.
  Result<std::vector<KindUsage>> UsageByKind(const std::vector<std::string>& names);
  // Statistics of the named tensors of committed checkpoint `name` (every
  // tensor when `tensors` is empty), each in one pass of 4 MiB at a time.
  // NotFound for a checkpoint or tensor that does not exist.
  Result<std::vector<TensorStats>> Stats(const std::string& name, const std::vector<std::string>& tensors,
                                         const ProgressFn& progress = {});
  // Per tensor (by name), then per blob: changed or not, chunks shared and
  // changed, and for float tensors max and mean |a - b| and the relative
  // L2 change. Tensors whose chunk lists are the same are not read.
  Result<std::vector<TensorDiff>> Diff(const std::string& a, const std::string& b);
  // Re-reads and re-hashes every chunk (of `name`, or of the repository),
  // checks every tensor is tiled exactly and every pack index is sound.
  Result<VerifyReport> Verify(const std::optional<std::string>& name,
                              const ProgressFn& progress = {});
  // Stores the bad chunks of `verified` (VerifyReport::bad_chunks) again
  // from a good copy: another pack of this repository that holds the same
  // chunk, or one of `sources` (other repositories: another tier, a copy).
  // Each copy is read and checked against the chunk's id before it is
  // used. The packs holding a bad chunk are then rewritten with the good
  // bytes in its place, as gc rewrites packs (crash-safe; other hosts of
  // an object store learn the new packs by their next sync). Chunks with no
  // good copy anywhere are listed as unrepaired, with the checkpoints that
  // use them.
  Result<RepairReport> Repair(const VerifyReport& verified, std::span<Repository* const> sources = {},
                              const std::function<void(const std::string&)>& on_phase = {});


 private:
  friend Result<ReindexReport> ReindexRemote(const std::string& url, const OpenOptions& options);
  friend Result<bool> ThinCheckpoint(Repository& repo, const std::string& name,
                                     const std::vector<std::string>& patterns);
  friend Result<CopyReport> CopyCheckpoints(Repository& source, Repository& destination, const CopyOptions& options,
                                            const ProgressFn& progress);
  friend class TierAccess;  // two tiers (tiers.cc)
  explicit Repository(std::unique_ptr<RepositoryImpl> impl);
  // What every Open does once the catalog and backend are open.
  static Result<std::unique_ptr<Repository>> FinishOpen(std::unique_ptr<RepositoryImpl> impl,
                                                        const OpenOptions& options);
  // Shared with the writers, readers and commit handles it made, which may
  // outlive it.
  std::shared_ptr<RepositoryImpl> impl_;
};

}  // namespace ckptfs
