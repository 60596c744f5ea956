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
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "backend/backend.h"
#include "backend/store_options.h"
#include "codec/codec.h"
#include "core/buffer_pool.h"
#include "core/fork.h"
#include "core/region.h"
#include "core/status.h"
#include "io/mapped_file.h"
#include "meta/records.h"

namespace ckptfs {

inline constexpr uint32_t kFormatVersion = 1;

struct RepositoryConfig {
  uint64_t chunk_size = 4 << 20;        // bytes; a multiple of 8 in [64 KiB, 256 MiB]
  uint64_t pack_size = 256ull << 20;    // a pack is sealed when it reaches this size
  CodecOptions codec;
  // Store every chunk raw while the pack writer is idle, compressing only
  // when the disk is the bottleneck (see docs/DESIGN.md).
  bool adaptive = true;
};

struct OpenOptions {
  size_t threads = 0;                     // workers; 0 = hardware concurrency
  size_t cache_bytes = 512ull << 20;      // decoded-chunk cache bound
  // Repositories on an object store: the directory where this host keeps
  // the repository's catalog. Empty: CACHE_ROOT/ID, a directory per
  // repository under `cache_root`; with that empty too, Open fails
  // (FailedPrecondition) rather than use a shared place such as /tmp.
  // Directories it creates are owner-only (0700); a symbolic link on the
  // way owned by another user (not root), or a final directory owned by
  // another user, is refused.
  std::string cache_dir;
  std::string cache_root;
  // Repositories on S3: how long a save or gc waits for a conflicting lock
  // (a gc on another host, or saves) before it fails naming the holder.
  std::chrono::milliseconds lock_wait = std::chrono::minutes(10);
  // Repositories on S3: how long a lock or read-lease object may go
  // unrefreshed before other hosts take its holder for crashed (at least
  // 100 ms; holders refresh theirs well within it).
  std::chrono::milliseconds lock_stale_after = std::chrono::minutes(30);
  // Repositories on S3: endpoint, credentials and retry settings. Unset,
  // they come from `s3_settings`, called only when the URL names an S3
  // store (so a local repository opens without them); with neither, Open
  // of an S3 URL fails naming what is missing.
  std::optional<ObjectStoreOptions> s3;
  std::function<Result<ObjectStoreOptions>()> s3_settings;
  // Requests to an object store one operation sends at once (reading
  // indexes and manifests, a commit's rank objects): the I/O pool's
  // io_threads - 1 threads, made at first use, and the caller. Commits run
  // on that pool too. 0 = 16. (Last, as new fields go: code that lists the
  // first fields positionally keeps its meaning.)
  size_t io_threads = 0;
  // Repositories on an object store: the wall clock (unix ms) this host
  // stamps its lock and lease objects with and judges other hosts' by
  // (stale after lock_stale_after). Empty: the system's. The protocol
  // assumes hosts' clocks agree to well within lock_stale_after; the
  // simulator (tools/sim) skews it within that bound.
  std::function<uint64_t()> wall_clock;
  // Repositories on an object store: whether Open brings the catalog up to
  // date with the store. Off for the processes of a job that apply the
  // listing one of them shares (Repository::ShareSync and SyncFrom).
  bool opening_sync = true;
};

// Open options as the command-line tool and the Python package take them
// from the environment, looked up through `env` (std::getenv for the
// process's own):
//   CKPT_CACHE_DIR            cache_dir
//   XDG_CACHE_HOME, HOME      cache_root: $XDG_CACHE_HOME/ckptfs, else
//                             $HOME/.cache/ckptfs
//   CKPT_LOCK_STALE_SECONDS   lock_stale_after (seconds, at least 0.1)
//   AWS_*, CKPT_S3_*          s3_settings: ObjectStoreOptions::FromEnvironment(env),
//                             read when an S3 repository is opened
// InvalidArgument naming a malformed variable.
Result<OpenOptions> OpenOptionsFromEnvironment(const Environment& env);

// Chunks read from packs and their stored bytes (Repository::fetch_counts).
struct FetchCounts {
  uint64_t chunks = 0;
  uint64_t stored_bytes = 0;
};

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

// A ShardSource over bytes of a mapped file, which it lends to the writer:
// the writer's threads keep the mapping while they hash and encode them, so
// PutShard returns without waiting for them, and a caller putting many
// shards keeps every thread busy.
class MappedSource final : public ShardSource {
 public:
  // Bytes [offset, offset + size) of `file`; InvalidArgument from Make when
  // they are not inside it.
  static Result<MappedSource> Make(std::shared_ptr<const MappedFile> file, uint64_t offset, uint64_t size);
  uint64_t size() const override { return data_.size(); }
  Status Read(uint64_t offset, std::span<std::byte> dst) override;
  Result<BorrowedBytes> Borrow(uint64_t offset, uint64_t n) override;

 private:
  MappedSource(std::shared_ptr<const MappedFile> file, std::span<const std::byte> data)
      : file_(std::move(file)), data_(data) {}
  std::shared_ptr<const MappedFile> file_;
  std::span<const std::byte> data_;
};

struct TensorInfo {
  std::string name;
  DType dtype = DType::kU8;
  Shape shape;
};

struct WriterOptions {
  uint32_t rank = 0;
  uint32_t world_size = 1;
  std::optional<int64_t> step;
  std::vector<std::pair<std::string, std::string>> tags;
  // One store sync for the ranks of a job that begin together, instead of
  // a listing of the store by each (object stores; nothing to sync on a
  // local repository). Begin lists the store under its shared store lock,
  // as always, and with `share_sync` also returns what it listed and
  // fetched there (ShareSync's encoding); a rank given that in
  // `shared_sync` applies it (SyncFrom) instead of listing. The sharing
  // rank must keep its writer open until every rank given its listing has
  // begun: its lock keeps gc away in between (SaveCollective does so).
  // Neither is owned.
  std::string* share_sync = nullptr;
  const std::string* shared_sync = nullptr;
  // With either of the above, not zero: the group's commit is split too,
  // so that a save costs the store requests of one rank, not of every
  // rank. A rank given `shared_sync` takes no store lock of its own, and
  // its commit makes its part durable without listing the store to see
  // whether every rank is in. The sharing rank's commit waits up to this
  // long for every rank's part (listing the rank objects with backoff),
  // then completes the checkpoint; its store lock, held from before any
  // rank began until then, keeps gc away from every rank's chunks. A part
  // missing after that fails the sharing rank's commit, naming the ranks,
  // and the checkpoint stays invisible. Zero: every rank takes its own
  // lock and the last rank in completes, as in a save without a group.
  // Local repositories need neither (their commits list nothing).
  std::chrono::milliseconds await_ranks{0};
  // Compress every chunk, as with the adaptive codec off
  // (RepositoryConfig::adaptive). For imports whose source is read from
  // the repository's own disk: the reads take bandwidth that the pack
  // writers' queue does not show, so the codec would take the disk for idle
  // and store low-yield chunks raw, writing more to a disk that is the
  // bottleneck (docs/PERFORMANCE.md).
  bool compress_every_chunk = false;
  // The save attempt this rank belongs to: every rank of one save gives the
  // same value, made once by NewSaveAttempt() and shared (a job restarted
  // after a crash makes a new one). The first commit of a newer attempt
  // abandons a pending checkpoint of an older one (a crashed job's): its
  // ranks' parts are dropped, never merged with this attempt's, whatever
  // their world size or step. A rank of an attempt older than the pending
  // one's is refused (FailedPrecondition). Empty, the rank joins a pending
  // checkpoint saved without an attempt, as before; one saved with an
  // attempt refuses it. At most kMaxAttemptSize printable bytes.
  std::string attempt;
  // Replace the checkpoint `name` holds, if any, when this save commits;
  // false: a committed `name` refuses the save (AlreadyExists). The ranks
  // save under "NAME~" (keys::ReplacementCheckpoint), hidden from listings,
  // and the commit that makes it visible renames it over NAME in one step,
  // retiring the old version as RemoveCheckpoints does: readers holding it
  // keep reading it, and gc collects it once they are gone. Every rank of
  // one save gives the same value. A save of more than one rank needs an
  // `attempt` (one rank makes its own). A replacement a crash left
  // committed but not renamed is dropped by the next replacing save of the
  // name, or by gc.
  bool overwrite = false;
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
  // Lets go of future_; in a forked child, without destroying its state
  // (a thread of the parent, absent here, may have held its lock at the
  // fork).
  void ReleaseFuture();
  std::shared_future<Result<CommitResult>> future_;
  uint64_t fork_generation_ = ForkGeneration();
  std::chrono::nanoseconds blocking_{0};
  std::shared_ptr<std::atomic<int64_t>> total_ns_;
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
  std::shared_ptr<WriterImpl> impl_;  // shared with a commit in flight
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

struct ReadOptions {
  // Hold a read lease for the reader's lifetime. The mount opens its
  // directory views without one and leases a checkpoint per open file.
  bool lease = true;
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

struct VerifyProblem {
  std::string checkpoint;  // empty for repository-level problems
  std::string what;        // tensor, blob, chunk or pack concerned
  std::string message;
  // A stored chunk that fails its id (one of VerifyReport::bad_chunks): the
  // problem a repair of that chunk mends.
  std::optional<ChunkId> bad_chunk;
};

struct VerifyReport {
  uint64_t checkpoints = 0;
  uint64_t tensors = 0;
  uint64_t chunks = 0;
  uint64_t bytes = 0;  // raw bytes re-hashed
  std::vector<VerifyProblem> problems;
  // Stored chunks whose bytes cannot be read or fail their id, each with
  // every checkpoint verified that uses it (in the order they were
  // verified). Repository::Repair stores them again from a good copy.
  struct BadChunk {
    ChunkId id;
    std::vector<std::string> checkpoints;
  };
  std::vector<BadChunk> bad_chunks;
  bool ok() const { return problems.empty(); }
};

// What Repository::Repair did with the bad chunks of a verify report.
struct RepairReport {
  struct Repaired {
    ChunkId id;
    std::string from;  // where the good bytes came from ("pack ID", or another repository's path)
  };
  std::vector<Repaired> repaired;
  // No good copy was found: each with every checkpoint that uses it.
  std::vector<VerifyReport::BadChunk> unrepaired;
  uint64_t packs_rewritten = 0;
};

struct ReindexReport {
  uint64_t packs = 0;
  uint64_t chunks = 0;
  uint64_t checkpoints = 0;
  std::vector<std::string> problems;  // skipped packs or manifests, and why
};

// Which checkpoints to keep; the rest are removed by garbage collection. An
// empty policy removes nothing. keep_last counts the newest by step when
// every committed checkpoint has one, by commit order otherwise. keep_every
// keeps a checkpoint whose step is a multiple of K; of those without a
// step, every K-th in commit order from the first, counted among
// themselves, so that they never shift which stepped ones it keeps.
// keep_within is by commit time. Pending checkpoints are never removed by
// a policy.
//
// A policy that would remove the newest committed checkpoint (and so also
// one that would remove every checkpoint, such as keep_last = 0) is refused
// with FailedPrecondition and removes nothing, unless allow_removing_newest
// is set: with asynchronous saves, the newest committed checkpoint may be
// the only complete one while the next is still pending.
struct RetentionPolicy {
  std::optional<uint64_t> keep_last;    // the newest N
  std::optional<uint64_t> keep_every;   // step % K == 0 (without a step: every K-th of those in commit order)
  std::optional<uint64_t> keep_within_s;  // committed at most this many seconds before the newest commit
  std::vector<std::string> keep;        // by name
  // Applied to the checkpoints of this group only ("run1": run1/step-100,
  // run1/eval/step-3, ...); the others stay. Empty: every checkpoint.
  std::string group;
  bool allow_removing_newest = false;
  bool empty() const { return !keep_last && !keep_every && !keep_within_s && keep.empty(); }
};

// What a retention policy does with one committed checkpoint, and why:
// `why` names each rule that keeps it ("keep-last 2", "keep-every 10: step
// 20", "keep-within 36h", "--keep"), or, for one removed, says of each
// rule why it does not keep it.
struct RetentionDecision {
  std::string name;
  std::optional<int64_t> step;
  bool keep = true;
  std::string why;
};

// Parses a duration such as "36h", "7d", "1w2d" or "90m" (units s, m, h, d,
// w, summed; a bare number is seconds) into seconds. InvalidArgument names
// the text.
Result<uint64_t> ParseDuration(std::string_view text);

// A rank of a pending checkpoint on an object store that began its save.
struct RankProgress {
  uint32_t rank = 0;
  bool committed = false;
  std::string host;  // as the rank's host names itself
  uint64_t pid = 0;
  uint64_t started_unix_ms = 0;
};

// A chunk stored again from good bytes (Repository::Repair): how those
// bytes are encoded, and the encoded bytes.
struct ChunkReplacement {
  Codec codec = Codec::kRaw;
  uint32_t raw_len = 0;
  std::string stored;
};

struct GcOptions {
  RetentionPolicy retention;
  bool dry_run = false;
  // A pack whose live bytes fall below this fraction of its size is
  // rewritten (live chunks copied to a new pack, then the old one deleted).
  double rewrite_below = 0.5;
  // Called as each phase of the run starts, with a line saying what it
  // does ("waiting for saves in progress", "deleting 12 packs").
  std::function<void(const std::string&)> on_phase;
  // Chunks whose stored bytes are replaced (Repository::Repair, whose
  // caller checked each against its id): every pack holding one is
  // rewritten as a mostly dead pack is, with these bytes in the chunk's
  // place.
  std::map<ChunkId, ChunkReplacement> replace;
};

struct GcReport {
  std::vector<std::string> removed;  // by the retention policy
  std::vector<RetentionDecision> retention;  // every committed checkpoint, when a policy was given
  uint64_t dead_chunks = 0;
  uint64_t orphan_packs = 0;         // packs no catalog entry refers to (killed saves)
  uint64_t packs_deleted = 0;        // wholly dead, rewritten or orphaned
  uint64_t packs_rewritten = 0;
  uint64_t packs_written = 0;
  uint64_t bytes_before = 0;         // pack bytes on disk
  uint64_t bytes_after = 0;
  uint64_t live_bytes = 0;           // stored bytes the remaining checkpoints reference
  uint64_t temporary_bytes = 0;      // temporary files of interrupted writes, removed (local repositories)
  // Where the pack bytes reclaimed come from: packs with no live chunk,
  // packs no catalog entry refers to, and the packs rewritten (their size,
  // and what their live chunks take in the new packs, the live bytes in a
  // dry run). bytes_reclaimed() is the sum of the four, less that last,
  // plus temporary_bytes.
  uint64_t dead_pack_bytes = 0;
  uint64_t orphan_pack_bytes = 0;
  uint64_t rewritten_pack_bytes = 0;
  uint64_t rewritten_live_bytes = 0;
  // Removed checkpoints (rm, retention) whose data this run reclaimed, and
  // those kept because a reader still holds a lease on them.
  uint64_t retired_collected = 0;
  uint64_t retired_kept = 0;
  uint64_t bytes_reclaimed() const {
    return (bytes_before > bytes_after ? bytes_before - bytes_after : 0) + temporary_bytes;
  }
};

struct UsageEntry {
  std::string name;
  uint64_t logical_bytes = 0;     // tensors and blobs as saved
  uint64_t referenced_bytes = 0;  // stored bytes of the distinct chunks it references
  uint64_t exclusive_bytes = 0;   // stored bytes no other checkpoint references: what removing it alone frees
};

struct UsageReport {
  std::vector<UsageEntry> checkpoints;
  uint64_t logical_bytes = 0;     // all committed checkpoints
  uint64_t unique_raw_bytes = 0;  // distinct referenced chunks, decoded
  uint64_t referenced_bytes = 0;  // distinct referenced chunks, stored
  uint64_t pack_bytes = 0;        // in the packs the catalog records, including what gc would reclaim
  uint64_t pending_bytes = 0;     // stored chunks only pending ranks reference (kept by gc)
  // Stored chunks only removed checkpoints reference: kept while a reader
  // holds a lease on them, reclaimed by the first gc after.
  uint64_t retired_bytes = 0;
  uint64_t retired_checkpoints = 0;
  uint64_t unreferenced_bytes = 0;  // stored chunks nothing references (gc reclaims them)
  // Local repositories: pack files no catalog entry records, left by saves
  // that were killed (gc deletes them). Not counted on an object store,
  // where other hosts' saves in flight have such packs too.
  uint64_t unrecorded_packs = 0;
  uint64_t unrecorded_pack_bytes = 0;
  double dedup_ratio() const { return unique_raw_bytes ? double(logical_bytes) / unique_raw_bytes : 1.0; }
  double compression_ratio() const { return referenced_bytes ? double(unique_raw_bytes) / referenced_bytes : 1.0; }
};

// One tensor (or blob) of two checkpoints compared. The figures of a float
// tensor count NaN against NaN as equal and NaN against a number, or an
// infinity against anything else, as an infinite difference.
struct TensorDiff {
  std::string name;
  bool blob = false;                   // a blob (bytes), not a tensor
  enum class Kind { kUnchanged, kChanged, kOnlyInA, kOnlyInB, kTypeChanged } kind = Kind::kUnchanged;
  double shared_fraction = 0;          // of A's bytes, in chunks B also has
  uint64_t chunks = 0;                 // A's chunks
  uint64_t changed_chunks = 0;         // of those, the ones B does not hold
  std::optional<double> max_abs_diff;  // floating-point tensors present in both with one dtype and shape
  std::optional<double> mean_abs_diff;
  std::optional<double> relative_l2;   // ||b - a|| / ||a|| (0 when equal; infinite when a is zero and b not)
};

// What one streaming pass over a tensor finds: the element count, NaN,
// infinite and zero counts, and over the finite elements min, max, mean,
// (population) standard deviation and L2 norm. Integer and bool tensors
// are read as numbers. min, max, mean and std are absent when no element
// is finite.
struct TensorStats {
  std::string name;
  DType dtype = DType::kU8;
  uint64_t elements = 0;
  uint64_t nan_count = 0, inf_count = 0, zero_count = 0;
  std::optional<double> min, max, mean, std;
  double l2_norm = 0;
};

// Progress callback: done and total units (bytes or items).
using ProgressFn = std::function<void(uint64_t done, uint64_t total)>;

// Which checkpoints CopyCheckpoints copies: `names`, else the newest `last`
// committed ones, else (all) every committed one; in commit order.
struct CopyOptions {
  std::vector<std::string> names;
  std::optional<uint64_t> last;
  bool all = false;
  // Called as each checkpoint starts ("copying step-100 (4 ranks)") and
  // with its outcome.
  std::function<void(const std::string&)> on_phase;
  // Ranks of a checkpoint copied side by side (their packs written at
  // once), at least 1. Each holds its pipeline's buffers.
  size_t ranks_at_once = 4;
  // Asked before each group of ranks and, from the I/O threads, before each
  // chunk is fetched (so it must be thread-safe): true stops the copy with
  // FailedPrecondition ("cancelled"). A copy that stops, cancelled or
  // failing, removes the pending checkpoint it was making at the
  // destination (chunks of the ranks committed stay until gc, so a rerun
  // sends only what is missing); only a killed copy leaves one pending,
  // which the next copy completes.
  std::function<bool()> cancelled;
};

struct CopiedCheckpoint {
  std::string name;
  // copied: made visible at the destination by this copy; present: the
  // destination had it, with the same content, and nothing was sent.
  enum class Outcome { kCopied, kPresent } outcome = Outcome::kCopied;
  uint32_t ranks_copied = 0;        // ranks committed by this copy (others were by an interrupted one)
  uint64_t chunks_sent = 0;         // chunks the destination lacked
  uint64_t raw_bytes_sent = 0;      // their decoded size
  uint64_t stored_bytes_sent = 0;   // their stored (encoded) size: what went into the destination's packs
  uint64_t chunks_present = 0;      // chunks the destination had already
  uint64_t raw_bytes_present = 0;
};

struct CopyReport {
  std::vector<CopiedCheckpoint> checkpoints;
  uint64_t chunks_sent = 0, raw_bytes_sent = 0, stored_bytes_sent = 0;
  uint64_t chunks_present = 0, raw_bytes_present = 0;
};

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
  // `shared` is not what ShareSync returned.
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
  Status RemoveCheckpoints(const std::vector<std::string>& names);
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
  friend Result<CopyReport> CopyCheckpoints(Repository& source, Repository& destination, const CopyOptions& options,
                                            const ProgressFn& progress);
  explicit Repository(std::unique_ptr<RepositoryImpl> impl);
  // What every Open does once the catalog and backend are open.
  static Result<std::unique_ptr<Repository>> FinishOpen(std::unique_ptr<RepositoryImpl> impl,
                                                        const OpenOptions& options);
  // Shared with the writers, readers and commit handles it made, which may
  // outlive it.
  std::shared_ptr<RepositoryImpl> impl_;
};

// Checkpoint names: 1-200 characters of [A-Za-z0-9._-], not starting with '.'.
Status ValidateCheckpointName(const std::string& name);
// Whether checkpoint `name` is in group `group` ('/'-separated prefix of its
// name: "run1/eval/step-3" is in "run1" and "run1/eval"); every name is in
// the empty group. A group given with a trailing '/' ("run1/") is the same.
bool InGroup(std::string_view name, std::string_view group);

// Tensor, blob and tag names (tag values too, which may be empty): at most
// kMaxMemberName bytes of valid UTF-8 without control characters. With the
// longest checkpoint name, a catalog key stays under LMDB's 511 bytes.
// InvalidArgument naming `kind` ("tensor name", "blob name", "tag"), the
// name (escaped) and what is wrong. PutShard, PutBlob and BeginCheckpoint
// check before any byte is written; callers importing many may check first.
inline constexpr size_t kMaxMemberName = 300;
Status ValidateMemberName(std::string_view kind, std::string_view name, bool allow_empty = false);

}  // namespace ckptfs
