// CheckpointWriter: the save pipeline and the multi-rank commit protocol.
//
// Pipeline: the caller's thread cuts each shard into chunks (aligned to the
// tensor's global byte offsets for flat ranges) and hands them to the worker
// pool, which hashes each chunk, skips chunks already stored, encodes the
// rest and queues them for a single pack-writer thread that appends to packs.
// Memory in flight is bounded by a semaphore on chunks.
#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "ckpt/repository.h"
#include "ckpt/repo_lock.h"
#include "ckpt/repository_impl.h"
#include "core/random.h"
#include "core/thread_pool.h"
#include "core/encoding.h"

namespace ckptfs {

Status CheckJoin(const CheckpointRecord& rec, const WriterOptions& options);

// Ranks may each bring tags; the first rank to give a key sets its value.
void AddTags(CheckpointRecord& ckpt, const std::vector<std::pair<std::string, std::string>>& tags) {
  for (const auto& tag : tags) {
    if (std::none_of(ckpt.tags.begin(), ckpt.tags.end(), [&](const auto& t) { return t.first == tag.first; })) {
      ckpt.tags.push_back(tag);
    }
  }
}

Status HostSource::Read(uint64_t offset, std::span<std::byte> dst) {
  if (offset > data_.size() || dst.size() > data_.size() - offset) {
    return Status::InvalidArgument("read past the end of a host source");
  }
  std::memcpy(dst.data(), data_.data() + offset, dst.size());
  return Status::OK();
}

void CommitHandle::ReleaseFuture() {
  // In a forked child, the commit thread of the parent does not exist: the
  // future's state would wait for it forever (core/fork.h).
  if (future_.valid() && ForkGeneration() != fork_generation_) {
    new std::shared_future<Result<CommitResult>>(std::move(future_));
  }
  future_ = {};
}

CommitHandle::~CommitHandle() { ReleaseFuture(); }

CommitHandle& CommitHandle::operator=(const CommitHandle& other) {
  if (this != &other) {
    ReleaseFuture();
    future_ = other.future_;
    fork_generation_ = other.fork_generation_;
    blocking_ = other.blocking_;
    total_ns_ = other.total_ns_;
  }
  return *this;
}

CommitHandle& CommitHandle::operator=(CommitHandle&& other) noexcept {
  if (this != &other) {
    ReleaseFuture();
    future_ = std::move(other.future_);
    fork_generation_ = other.fork_generation_;
    blocking_ = other.blocking_;
    total_ns_ = std::move(other.total_ns_);
  }
  return *this;
}

Result<CommitResult> CommitHandle::Wait() {
  if (!future_.valid()) return Status::FailedPrecondition("commit handle is empty");
  if (ForkGeneration() != fork_generation_) {
    return Status::FailedPrecondition("this commit was started before the process was forked; only the parent "
                                      "process can wait for it");
  }
  return future_.get();
}

bool CommitHandle::Ready() const {
  if (ForkGeneration() != fork_generation_) return false;
  return future_.valid() && future_.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
}

std::chrono::nanoseconds CommitHandle::total_time() const {
  return std::chrono::nanoseconds(total_ns_ ? total_ns_->load() : 0);
}

class WriterImpl : public std::enable_shared_from_this<WriterImpl> {
 public:
  WriterImpl(std::shared_ptr<RepositoryImpl> repo, std::string name, WriterOptions options, RepoLock lock,
             std::unique_ptr<ObjectLock> store_lock)
      : repo_(std::move(repo)),
        lock_(std::in_place, std::move(lock)),
        store_lock_(std::move(store_lock)),
        name_(std::move(name)),
        options_(std::move(options)),
        packs_(repo_->backend.get(), repo_->config.pack_size),
        max_inflight_(2 * repo_->pool->size() + 2),
        queue_limit_(2 * repo_->pool->size() + 1) {
    record_.rank = options_.rank;
  }

  ~WriterImpl() {
    SetError(Status::FailedPrecondition("checkpoint writer was aborted"));
    Shutdown();
    // A save given up before its commit leaves no pack behind in a local
    // repository. On an object store its packs stay for gc: another host
    // may have listed them and deduplicated against their chunks.
    bool committed;
    {
      std::lock_guard lock(mu_);
      committed = committed_;
    }
    if (!committed && !repo_->remote) packs_.Discard();
    if (!committed && repo_->remote) (void)repo_->backend->Delete(keys::StartedRankObject(name_, options_.rank));
  }

  Status PutShard(const TensorInfo& info, const Region& region, ShardSource& source);
  Status PutBlob(const std::string& name, std::span<const std::byte> data);
  CommitHandle Commit();
  const RepositoryImpl& repo() const { return *repo_; }

  void Shutdown() {
    inflight_wg_.Wait();
    StopWriterThread();
  }

 private:
  struct Job {
    std::span<const std::byte> data;
    BufferPool::Lease owned;            // when the source is not host memory
    std::shared_ptr<const void> keep;   // holds bytes a source lent
    DType dtype;
    ChunkRef* slot;
    WaitGroup* shard_wg;  // waited on by PutShard for zero-copy jobs
  };
  struct Encoded {
    ChunkId id;
    Codec codec;
    uint32_t raw_len;
    BufferPool::Lease buffer;  // the stored bytes: buffer.first(size)
    size_t size = 0;
  };

  Status CheckUsable() {
    std::lock_guard lock(mu_);
    if (committed_) return Status::FailedPrecondition("checkpoint writer already committed");
    return error_;
  }
  Status PipelineError() {
    std::lock_guard lock(mu_);
    return error_;
  }
  void SetError(const Status& st) {
    std::lock_guard lock(mu_);
    if (error_.ok()) error_ = st;
  }
  void Submit(Job job);
  void Process(Job& job);
  void WriterLoop();
  void StopWriterThread();
  Status CommitToCatalog(const std::vector<SealedPack>& sealed, CommitResult* result);
  // The commit of a repository on an object store (docs/DESIGN.md
  // "Repositories on S3"): this rank's record becomes an object; the rank
  // that finds every rank's object merges them and writes the manifest.
  Status CommitToStore(const std::vector<SealedPack>& sealed, CommitResult* result);
  Result<Manifest> MergeStoredRanks();
  // The steps of CommitToCatalog.
  struct CommitView;
  Result<CommitView> ReadCommitView();
  Result<Manifest> MergeRanks(const CommitView& view);
  Status WriteManifest(const Manifest& manifest);
  // False when the view changed since it was read (nothing was written).
  Result<bool> PublishInCatalog(const CommitView& view, const Manifest* manifest,
                                const std::vector<SealedPack>& sealed);
  Status ChunkStream(const std::vector<uint64_t>& bounds, DType dtype, ShardSource& source,
                     std::vector<ChunkRef>& chunks);
  std::vector<uint64_t> ChunkBounds(uint64_t global_start, uint64_t size) const;

  // Shared: a writer, and the commit handle that keeps it, may outlive the
  // Repository (repository.h, "Lifetimes"). Declared first, so it is released
  // last: the store lock below and the pack writer use its backend.
  const std::shared_ptr<RepositoryImpl> repo_;
  // Held shared until this writer's commit finished or it is gone: gc waits
  // for it (repo_lock.h).
  std::optional<RepoLock> lock_;
  // The same, across hosts, for a repository on an object store.
  std::unique_ptr<ObjectLock> store_lock_;
  const std::string name_;
  const WriterOptions options_;
  PackWriter packs_;

  // Which lock guards what. The caller's thread (one per writer: PutShard,
  // PutBlob, Commit), the compute workers (hashing, encoding), the
  // pack-writer thread and the commit task share this object. Once the
  // commit task's Shutdown() has returned, no worker or pack-writer thread
  // is left, and the commit task reads record_ and stored_ alone.
  std::mutex mu_;
  Status error_;                                  // guarded by mu_
  bool committed_ = false;                        // guarded by mu_
  RankRecord record_;                             // guarded by mu_ (alone after Shutdown)
  std::map<std::string, size_t> tensor_index_;    // guarded by mu_
  std::set<std::string> blob_names_;              // guarded by mu_
  // Chunks this writer has handled: the first job with an id stores or
  // deduplicates it, later ones only reference it.
  std::unordered_set<ChunkId, ChunkIdHash> seen_;                       // guarded by mu_
  std::unordered_map<ChunkId, ChunkLocation, ChunkIdHash> stored_;      // guarded by mu_ (alone after Shutdown)
  CommitResult stats_;                            // guarded by mu_

  // In-flight bound.
  const size_t max_inflight_;
  std::condition_variable inflight_cv_;           // with mu_
  size_t inflight_ = 0;                           // guarded by mu_
  WaitGroup inflight_wg_;                         // its own lock

  // Encoded chunks waiting for the pack-writer thread.
  const size_t queue_limit_;
  std::mutex queue_mu_;
  std::condition_variable queue_cv_;              // with queue_mu_
  std::deque<Encoded> queue_;                     // guarded by queue_mu_
  bool stop_writer_ = false;                      // guarded by queue_mu_
  std::thread writer_thread_;                     // the caller's thread starts it; Shutdown joins it

  const uint64_t created_unix_ms_ = WallClockUnixMs();
  std::chrono::steady_clock::time_point first_put_{};  // the caller's thread only
  std::chrono::nanoseconds blocking_{0};               // the caller's thread only
};

namespace {
// While the disk waits for the codec, only chunks estimated to save at least
// this fraction are compressed.
constexpr double kAdaptiveMinSaving = 0.25;

thread_local std::unique_ptr<ChunkEncoder> tls_encoder;
thread_local CodecOptions tls_encoder_options;

ChunkEncoder& EncoderFor(const CodecOptions& options) {
  if (!tls_encoder || tls_encoder_options.compression != options.compression ||
      tls_encoder_options.level != options.level || tls_encoder_options.min_saving != options.min_saving) {
    tls_encoder = std::make_unique<ChunkEncoder>(options);
    tls_encoder_options = options;
  }
  return *tls_encoder;
}

class BlockTimer {
 public:
  explicit BlockTimer(std::chrono::nanoseconds* sink) : sink_(sink), start_(std::chrono::steady_clock::now()) {}
  ~BlockTimer() { *sink_ += std::chrono::steady_clock::now() - start_; }

 private:
  std::chrono::nanoseconds* sink_;
  std::chrono::steady_clock::time_point start_;
};
}  // namespace

std::vector<uint64_t> WriterImpl::ChunkBounds(uint64_t global_start, uint64_t size) const {
  // Boundaries sit at multiples of chunk_size in the coordinates the stream
  // starts at, so a flat range chunks the same whatever the world size.
  const uint64_t c = repo_->config.chunk_size;
  std::vector<uint64_t> bounds = {0};
  uint64_t pos = 0;
  while (pos < size) {
    uint64_t next_global = (global_start + pos) / c * c + c;
    pos = std::min(size, next_global - global_start);
    bounds.push_back(pos);
  }
  return bounds;
}

void WriterImpl::Submit(Job job) {
  {
    std::unique_lock lock(mu_);
    inflight_cv_.wait(lock, [&] { return inflight_ < max_inflight_; });
    ++inflight_;
  }
  inflight_wg_.Add();
  if (job.shard_wg) job.shard_wg->Add();
  // Shared: the pool's tasks must be copyable, and a job owns a lease.
  repo_->pool->Submit([this, shared = std::make_shared<Job>(std::move(job))] {
    Job& job = *shared;
    Process(job);
    job.keep.reset();  // lent bytes go back to their source now, not when the task is freed
    job.owned.Reset();
    if (job.shard_wg) job.shard_wg->Done();
    {
      std::lock_guard lock(mu_);
      --inflight_;
    }
    inflight_cv_.notify_one();
    inflight_wg_.Done();
  });
}

void WriterImpl::Process(Job& job) {
  if (!PipelineError().ok()) return;
  const ChunkId id = ChunkId::Of(job.data);
  job.slot->id = id;
  job.slot->raw_len = static_cast<uint32_t>(job.data.size());
  {
    std::lock_guard lock(mu_);
    if (!seen_.insert(id).second) {
      ++stats_.chunks_deduplicated;
      return;
    }
  }
  auto known = repo_->LookupChunk(id);
  if (known.ok()) {
    std::lock_guard lock(mu_);
    ++stats_.chunks_deduplicated;
    return;
  }
  if (!known.status().IsNotFound()) {
    SetError(known.status());
    return;
  }
  // Adaptive: unless encoded chunks are queueing for the disk, the disk is
  // waiting for the codec; store this chunk raw rather than make it wait.
  // The disk keeps up when encoded chunks do not pile up in front of it.
  const bool disk_starving =
      repo_->config.adaptive && repo_->queued_chunks.load() < static_cast<int64_t>(repo_->pool->size());
  // Even then, chunks that compress well (bf16 weights: about a third) are
  // worth the CPU; only the low-yield ones (fp32 moments) are passed raw.
  const bool skip = disk_starving && EstimateSaving(job.data, job.dtype, repo_->config.codec.min_saving) <
                                         kAdaptiveMinSaving;
  Encoded enc{id, Codec::kRaw, static_cast<uint32_t>(job.data.size()), repo_->buffers->Acquire(job.data.size())};
  if (skip || repo_->config.codec.compression == Compression::kNone) {
    std::memcpy(enc.buffer.data(), job.data.data(), job.data.size());
    enc.size = job.data.size();
  } else {
    auto encoded = EncoderFor(repo_->config.codec).EncodeInto(job.data, job.dtype, enc.buffer.first(job.data.size()));
    if (!encoded.ok()) {
      SetError(encoded.status());
      return;
    }
    enc.codec = encoded->codec;
    enc.size = encoded->size;
  }
  // The encoded bytes are a copy: lent source bytes go back now, not after
  // a wait for the disk.
  job.keep.reset();
  {
    std::unique_lock lock(queue_mu_);
    queue_cv_.wait(lock, [&] { return queue_.size() < queue_limit_ || stop_writer_; });
    queue_.push_back(std::move(enc));
    repo_->queued_chunks.fetch_add(1);
  }
  queue_cv_.notify_all();
}

void WriterImpl::WriterLoop() {
  while (true) {
    Encoded enc;
    {
      std::unique_lock lock(queue_mu_);
      queue_cv_.wait(lock, [&] { return !queue_.empty() || stop_writer_; });
      if (queue_.empty()) return;
      enc = std::move(queue_.front());
      queue_.pop_front();
      repo_->queued_chunks.fetch_sub(1);
    }
    queue_cv_.notify_all();
    if (!PipelineError().ok()) continue;  // drain without writing after an error
    auto loc = packs_.Add(enc.id, enc.codec, enc.raw_len, enc.buffer.first(enc.size));
    enc.buffer.Reset();  // back to the pool for the next chunk
    if (!loc.ok()) {
      SetError(loc.status());
      continue;
    }
    std::lock_guard lock(mu_);
    stored_[enc.id] = *loc;
    ++stats_.chunks_written;
    stats_.stored_bytes += enc.size;
  }
}

void WriterImpl::StopWriterThread() {
  {
    std::lock_guard lock(queue_mu_);
    stop_writer_ = true;
  }
  queue_cv_.notify_all();
  if (writer_thread_.joinable()) writer_thread_.join();
}

Status WriterImpl::ChunkStream(const std::vector<uint64_t>& bounds, DType dtype, ShardSource& source,
                               std::vector<ChunkRef>& chunks) {
  chunks.resize(bounds.size() - 1);
  const std::byte* host = source.HostData();
  if (!host) source.PlanChunks(bounds);
  WaitGroup shard_wg;
  Status st;
  for (size_t i = 0; i + 1 < bounds.size(); ++i) {
    Job job;
    job.dtype = dtype;
    job.slot = &chunks[i];
    const uint64_t len = bounds[i + 1] - bounds[i];
    if (host) {
      job.data = {host + bounds[i], len};
      job.shard_wg = &shard_wg;
    } else {
      auto lent = source.Borrow(bounds[i], len);
      if (!lent.ok()) {
        st = lent.status();
        break;
      }
      if (lent->keep) {
        if (lent->bytes.size() != len) {
          st = Status::Internal("a shard source lent the wrong number of bytes");
          break;
        }
        job.data = lent->bytes;
        job.keep = std::move(lent->keep);
      } else {
        job.owned = repo_->buffers->Acquire(len);
        st = source.Read(bounds[i], job.owned.first(len));
        if (!st.ok()) break;
        job.data = job.owned.first(len);
      }
      job.shard_wg = nullptr;
    }
    Submit(std::move(job));
  }
  // Zero-copy jobs read the caller's memory: wait until they are done with it.
  shard_wg.Wait();
  if (st.ok()) st = PipelineError();
  if (!st.ok()) {
    // Jobs already submitted still write into `chunks`, which the caller
    // drops on an error: let them finish first.
    inflight_wg_.Wait();
  }
  return st;
}

Status WriterImpl::PutShard(const TensorInfo& info, const Region& region_in, ShardSource& source) {
  BlockTimer timer(&blocking_);
  CKPT_RETURN_IF_ERROR(CheckUsable());
  if (first_put_ == std::chrono::steady_clock::time_point{}) first_put_ = std::chrono::steady_clock::now();
  CKPT_RETURN_IF_ERROR(ValidateMemberName("tensor name", info.name));
  CKPT_RETURN_IF_ERROR(ValidateRegion(info.shape, region_in).WithContext("tensor '" + info.name + "'"));
  const Region region = Normalize(info.shape, region_in);
  const uint64_t w = DTypeSize(info.dtype);
  const uint64_t bytes = region.NumElements() * w;
  if (source.size() != bytes) {
    return Status::InvalidArgument("tensor '" + info.name + "': shard " + region.ToString() + " of " +
                                   std::string(DTypeName(info.dtype)) + " needs " + std::to_string(bytes) +
                                   " bytes, the source has " + std::to_string(source.size()));
  }
  TensorRecord* tensor;
  {
    std::lock_guard lock(mu_);
    auto it = tensor_index_.find(info.name);
    if (it == tensor_index_.end()) {
      tensor_index_[info.name] = record_.tensors.size();
      record_.tensors.push_back(TensorRecord{info.name, info.dtype, info.shape, {}});
      it = tensor_index_.find(info.name);
    }
    tensor = &record_.tensors[it->second];
    if (tensor->dtype != info.dtype || tensor->shape != info.shape) {
      return Status::InvalidArgument("tensor '" + info.name + "' was put with " +
                                     std::string(DTypeName(tensor->dtype)) + " " + ShapeToString(tensor->shape) +
                                     " and now with " + std::string(DTypeName(info.dtype)) + " " +
                                     ShapeToString(info.shape));
    }
  }
  if (!writer_thread_.joinable()) writer_thread_ = std::thread([this] { WriterLoop(); });
  const uint64_t global_start = region.kind == Region::Kind::kFlat ? region.flat.start * w : 0;
  ShardRecord shard;
  shard.region = region;
  shard.ranks = {options_.rank};
  CKPT_RETURN_IF_ERROR(ChunkStream(ChunkBounds(global_start, bytes), info.dtype, source, shard.chunks));
  std::lock_guard lock(mu_);
  stats_.logical_bytes += bytes;
  record_.tensors[tensor_index_[info.name]].shards.push_back(std::move(shard));
  return Status::OK();
}

Status WriterImpl::PutBlob(const std::string& name, std::span<const std::byte> data) {
  BlockTimer timer(&blocking_);
  CKPT_RETURN_IF_ERROR(CheckUsable());
  if (first_put_ == std::chrono::steady_clock::time_point{}) first_put_ = std::chrono::steady_clock::now();
  CKPT_RETURN_IF_ERROR(ValidateMemberName("blob name", name));
  {
    std::lock_guard lock(mu_);
    if (!blob_names_.insert(name).second) return Status::InvalidArgument("blob '" + name + "' was put twice");
  }
  if (!writer_thread_.joinable()) writer_thread_ = std::thread([this] { WriterLoop(); });
  BlobRecord blob{name, data.size(), {}};
  HostSource source(data);
  CKPT_RETURN_IF_ERROR(ChunkStream(ChunkBounds(0, data.size()), DType::kU8, source, blob.chunks));
  std::lock_guard lock(mu_);
  stats_.logical_bytes += data.size();
  record_.blobs.push_back(std::move(blob));
  return Status::OK();
}

CommitHandle WriterImpl::Commit() {
  CommitHandle handle;
  handle.total_ns_ = std::make_shared<std::atomic<int64_t>>(0);
  {
    std::lock_guard lock(mu_);
    if (committed_) {
      std::promise<Result<CommitResult>> p;
      p.set_value(Status::FailedPrecondition("checkpoint writer already committed"));
      handle.future_ = p.get_future().share();
      return handle;
    }
    committed_ = true;
  }
  if (first_put_ == std::chrono::steady_clock::time_point{}) first_put_ = std::chrono::steady_clock::now();
  handle.blocking_ = blocking_;
  auto total = handle.total_ns_;
  auto start = first_put_;
  // On the repository's I/O pool: a commit waits on the disk or the store,
  // never on the compute workers' tasks. The task may be the last owner of
  // the repository's internals (their Repository gone, the handle kept):
  // it lets them go before the handle reports, and the pool lets a worker
  // destroy it (thread_pool.h).
  auto promise = std::make_shared<std::promise<Result<CommitResult>>>();
  handle.future_ = promise->get_future().share();
  ThreadPool& io = repo_->IoPool();
  io.Submit([this, self = shared_from_this(), total, start, promise]() mutable {
    promise->set_value([&]() -> Result<CommitResult> {
                     Shutdown();
                     Status st;
                     {
                       std::lock_guard lock(mu_);
                       st = error_;
                     }
                     CommitResult result;
                     if (st.ok()) {
                       auto sealed = packs_.Finish();
                       st = sealed.ok() ? CommitToCatalog(*sealed, &result) : sealed.status();
                     }
                     total->store((std::chrono::steady_clock::now() - start).count());
                     // Done with the catalog: let gc run even if the caller
                     // keeps the handle (which keeps this closure) around.
                     lock_.reset();
                     store_lock_.reset();
                     self.reset();
                     if (!st.ok()) return st;
                     return result;
                   }());
  });
  return handle;
}

// The commit, in the steps docs/DESIGN.md names ("Commit protocol"):
//   1. ReadCommitView: a read transaction takes what the catalog holds for
//      this checkpoint (its record, the ranks committed, the next sequence).
//   2. CheckJoin and CheckTensorsAgree on that view.
//   3. Last rank only, outside any write transaction: MergeRanks merges the
//      ranks' records (reading the bytes where replicas overlap) and checks
//      the tiling; WriteManifest makes the manifest object durable.
//   4. PublishInCatalog: one short write transaction re-reads the view; if
//      another commit changed it meanwhile, the commit starts over at 1
//      (and removes a manifest it wrote for a view that no longer holds);
//      otherwise it records chunks, packs and this rank, and, for the last
//      rank, the merged records and the committed state.
struct WriterImpl::CommitView {
  std::optional<std::string> raw_checkpoint;  // as stored, to see changes
  std::optional<std::string> raw_sequence;
  CheckpointRecord checkpoint;                // this rank added
  std::vector<RankRecord> ranks;              // this rank last
  bool last = false;
};

Result<WriterImpl::CommitView> WriterImpl::ReadCommitView() {
  CommitView view;
  Status st = repo_->catalog->Read([&](const ReadTxn& txn) -> Status {
    CKPT_ASSIGN_OR_RETURN(auto raw, txn.Get(Table::kCheckpoints, keys::Checkpoint(name_)));
    if (raw) view.raw_checkpoint = std::string(*raw);
    CKPT_ASSIGN_OR_RETURN(auto seq, txn.Get(Table::kMeta, keys::kNextSequenceKey));
    if (seq) view.raw_sequence = std::string(*seq);
    Status inner;
    CKPT_RETURN_IF_ERROR(txn.Scan(Table::kRanks, keys::MemberPrefix(name_), [&](std::string_view, std::string_view v) {
      auto r = DecodeRank(v);
      if (!r.ok()) {
        inner = r.status();
        return false;
      }
      view.ranks.push_back(std::move(r).value());
      return true;
    }));
    return inner;
  });
  CKPT_RETURN_IF_ERROR(st);
  CheckpointRecord& ckpt = view.checkpoint;
  if (view.raw_checkpoint) {
    CKPT_ASSIGN_OR_RETURN(ckpt, DecodeCheckpoint(*view.raw_checkpoint));
    CKPT_RETURN_IF_ERROR(CheckJoin(ckpt, options_));
    if (!ckpt.step) ckpt.step = options_.step;
  } else {
    ckpt.name = name_;
    ckpt.step = options_.step;
    ckpt.world_size = options_.world_size;
    ckpt.created_unix_ms = created_unix_ms_;
  }
  view.ranks.push_back(record_);
  ckpt.committed_ranks.push_back(options_.rank);
  std::sort(ckpt.committed_ranks.begin(), ckpt.committed_ranks.end());
  AddTags(ckpt, options_.tags);
  view.last = ckpt.committed_ranks.size() >= ckpt.world_size;
  return view;
}

Result<Manifest> WriterImpl::MergeRanks(const CommitView& view) {
  // Chunks this rank stored are not in the catalog yet; the others' are,
  // locally. On an object store the other ranks' packs are indexed only
  // when the check of an overlap needs their bytes: most merges read none.
  std::once_flag indexed;
  Status index_status;
  DirectFetcher fetcher(repo_->backend.get(), [&](const ChunkId& id) -> Result<ChunkLocation> {
    auto it = stored_.find(id);
    if (it != stored_.end()) return it->second;
    auto loc = repo_->LookupChunk(id);
    if (!repo_->remote || !loc.status().IsNotFound()) return loc;
    std::call_once(indexed, [&] { index_status = repo_->Sync(RepositoryImpl::SyncScope::kPacks).status(); });
    CKPT_RETURN_IF_ERROR(index_status);
    return repo_->LookupChunk(id);
  });
  Manifest manifest;
  CKPT_ASSIGN_OR_RETURN(manifest.tensors, MergeRankTensors(view.ranks, fetcher));
  CKPT_ASSIGN_OR_RETURN(manifest.blobs, MergeRankBlobs(view.ranks));
  CheckpointRecord ckpt = view.checkpoint;
  uint64_t seq = 1;
  if (view.raw_sequence) {
    CKPT_ASSIGN_OR_RETURN(seq, DecodeSequence(*view.raw_sequence));
  }
  ckpt.state = CheckpointState::kCommitted;
  ckpt.sequence = seq;
  ckpt.committed_unix_ms = WallClockUnixMs();
  ckpt.tensor_count = manifest.tensors.size();
  ckpt.logical_bytes = 0;
  for (const auto& t : manifest.tensors) ckpt.logical_bytes += t.ByteSize();
  for (const auto& b : manifest.blobs) ckpt.logical_bytes += b.size;
  manifest.checkpoint = ckpt;
  return manifest;
}

Status WriterImpl::WriteManifest(const Manifest& manifest) {
  // Durable before the catalog makes the checkpoint visible: reindex trusts
  // manifests, so both views agree after a crash.
  std::string encoded = EncodeManifest(manifest);
  return repo_->backend->Put(keys::ManifestObject(name_), std::as_bytes(std::span(encoded)));
}

Result<bool> WriterImpl::PublishInCatalog(const CommitView& view, const Manifest* manifest,
                                          const std::vector<SealedPack>& sealed) {
  bool unchanged = true;
  Status st = repo_->catalog->Update([&](WriteTxn& txn) -> Status {
    CKPT_ASSIGN_OR_RETURN(auto raw, txn.Get(Table::kCheckpoints, keys::Checkpoint(name_)));
    CKPT_ASSIGN_OR_RETURN(auto seq, txn.Get(Table::kMeta, keys::kNextSequenceKey));
    auto same = [](const std::optional<std::string_view>& now, const std::optional<std::string>& then) {
      return now.has_value() == then.has_value() && (!now || *now == *then);
    };
    if (!same(raw, view.raw_checkpoint) || (manifest && !same(seq, view.raw_sequence))) {
      unchanged = false;
      return Status::OK();  // nothing written; the caller starts over
    }
    // Chunks first: a chunk another process stored meanwhile keeps its entry.
    for (const auto& p : sealed) CKPT_RETURN_IF_ERROR(RecordPack(txn, p).status());
    // Every chunk this rank references must be in the catalog now: one that
    // was deduplicated against a chunk since removed fails the commit rather
    // than leave a dangling reference.
    auto check_present = [&](const std::vector<ChunkRef>& chunks, const std::string& what) -> Status {
      for (const auto& c : chunks) {
        CKPT_ASSIGN_OR_RETURN(auto v, txn.Get(Table::kChunks, keys::Chunk(c.id)));
        if (!v) return Status::Internal(what + ": chunk " + c.id.ToHex() + " was neither stored nor found in the catalog");
      }
      return Status::OK();
    };
    for (const auto& t : record_.tensors) {
      for (const auto& s : t.shards) CKPT_RETURN_IF_ERROR(check_present(s.chunks, "tensor '" + t.name + "'"));
    }
    for (const auto& b : record_.blobs) CKPT_RETURN_IF_ERROR(check_present(b.chunks, "blob '" + b.name + "'"));
    if (!manifest) {
      CKPT_RETURN_IF_ERROR(txn.Put(Table::kRanks, keys::Rank(name_, options_.rank), EncodeRank(record_)));
      return txn.Put(Table::kCheckpoints, keys::Checkpoint(name_), EncodeCheckpoint(view.checkpoint));
    }
    for (const auto& r : view.ranks) {
      CKPT_RETURN_IF_ERROR(txn.Delete(Table::kRanks, keys::Rank(name_, r.rank)));
    }
    CKPT_RETURN_IF_ERROR(txn.Put(Table::kMeta, keys::kNextSequenceKey, EncodeSequence(manifest->checkpoint.sequence + 1)));
    return RecordManifest(txn, *manifest);
  });
  CKPT_RETURN_IF_ERROR(st);
  return unchanged;
}

Status WriterImpl::CommitToCatalog(const std::vector<SealedPack>& sealed, CommitResult* result) {
  for (auto& t : record_.tensors) {
    for (auto& s : t.shards) s.ComputeStarts();
  }
  {
    std::lock_guard lock(mu_);
    *result = stats_;
  }
  result->checkpoint_visible = false;
  if (repo_->remote) return CommitToStore(sealed, result);
  // Commits of other ranks may change the view between the steps; each
  // round trip means one of them got through, so this ends.
  for (;;) {
    CKPT_ASSIGN_OR_RETURN(CommitView view, ReadCommitView());
    std::optional<Manifest> manifest;
    if (view.last) {
      CKPT_ASSIGN_OR_RETURN(manifest, MergeRanks(view));
      CKPT_RETURN_IF_ERROR(WriteManifest(*manifest));
    } else {
      // Dtype and shape disagreement shows now; tiling waits for the last rank.
      CKPT_RETURN_IF_ERROR(CheckTensorsAgree(view.ranks));
    }
    auto published = PublishInCatalog(view, manifest ? &*manifest : nullptr, sealed);
    if (manifest && !(published.ok() && *published)) {
      // The manifest describes a commit that did not happen: take it back,
      // or reindex would publish it.
      (void)repo_->backend->Delete(keys::ManifestObject(name_));
    }
    CKPT_RETURN_IF_ERROR(published.status());
    if (*published) {
      result->checkpoint_visible = view.last;
      return Status::OK();
    }
  }
}

// ---- commit to an object store ---------------------------------------------------
//
// Steps (docs/DESIGN.md "Repositories on S3", with the outcome of a crash
// after each):
//   1. This rank's packs are durable (sealed before this is called).
//   2. Its record is PUT as pending/NAME/rank-R: its part is durable.
//   3. It LISTs pending/NAME/. Fewer than world-size ranks: done, the
//      checkpoint stays invisible. All of them: this rank commits.
//   4. Commit: read every rank's record, merge and check the tiling (an
//      overlap whose bytes must be compared syncs the packs first: every
//      pack a record names was durable before the record, so that listing
//      has it), PUT the manifest if none exists: the checkpoint is visible
//      on every host from this PUT on.
//   5. Delete the rank objects (leftovers are ignored once the manifest
//      exists, and removed by rm).
// Ranks finishing together may all see every rank and all merge; the
// manifest is written with a conditional PUT (If-None-Match), so exactly one
// of them commits and the others stand down.

Result<Manifest> WriterImpl::MergeStoredRanks() {
  const uint32_t n = options_.world_size;
  std::vector<Result<PendingRank>> objects(n, Status::Internal("not read"));
  ParallelFor(repo_->IoPool(), n, kStoreRequestsInFlight,
              [&](size_t r) { objects[r] = ReadPendingRank(*repo_->backend, name_, static_cast<uint32_t>(r)); });
  CommitView view;
  view.checkpoint.name = name_;
  view.checkpoint.world_size = n;
  view.checkpoint.created_unix_ms = created_unix_ms_;
  for (uint32_t r = 0; r < n; ++r) {
    if (!objects[r].ok()) return objects[r].status().WithContext("committing checkpoint '" + name_ + "'");
    const CheckpointRecord& h = objects[r]->header;
    if (h.world_size != n) {
      return Status::InvalidArgument("checkpoint '" + name_ + "': rank " + std::to_string(r) + " was saved with world size " +
                                     std::to_string(h.world_size) + ", rank " + std::to_string(options_.rank) + " with " +
                                     std::to_string(n));
    }
    if (h.step) {
      if (view.checkpoint.step && *view.checkpoint.step != *h.step) {
        return Status::InvalidArgument("checkpoint '" + name_ + "': ranks disagree on the step (" +
                                       std::to_string(*view.checkpoint.step) + " and " + std::to_string(*h.step) + ")");
      }
      view.checkpoint.step = h.step;
    }
    view.checkpoint.created_unix_ms = std::min(view.checkpoint.created_unix_ms, h.created_unix_ms);
    AddTags(view.checkpoint, h.tags);
    view.checkpoint.committed_ranks.push_back(r);
    view.ranks.push_back(std::move(objects[r]->record));
  }
  CKPT_RETURN_IF_ERROR(repo_->catalog->Read([&](const ReadTxn& txn) -> Status {
    CKPT_ASSIGN_OR_RETURN(auto seq, txn.Get(Table::kMeta, keys::kNextSequenceKey));
    if (seq) view.raw_sequence = std::string(*seq);
    return Status::OK();
  }));
  view.last = true;
  return MergeRanks(view);
}

Status WriterImpl::CommitToStore(const std::vector<SealedPack>& sealed, CommitResult* result) {
  Backend& store = *repo_->backend;
  // Were the lock's refreshes failing, a gc elsewhere may have taken it for
  // stale and removed chunks this save deduplicated against.
  CKPT_RETURN_IF_ERROR(store_lock_->Check());
  const std::string own_key = keys::PendingRankObject(name_, options_.rank);
  auto committed = store.Size(keys::ManifestObject(name_));
  if (committed.ok()) return Status::AlreadyExists("checkpoint '" + name_ + "' already exists");
  if (!committed.status().IsNotFound()) return committed.status();
  auto mine = store.Size(own_key);
  if (mine.ok()) {
    return Status::AlreadyExists("rank " + std::to_string(options_.rank) + " of checkpoint '" + name_ + "' already committed");
  }
  if (!mine.status().IsNotFound()) return mine.status();

  CheckpointRecord header;
  header.name = name_;
  header.step = options_.step;
  header.world_size = options_.world_size;
  header.created_unix_ms = created_unix_ms_;
  header.tags = options_.tags;
  const std::string encoded = EncodePendingRank(header, record_);
  CKPT_RETURN_IF_ERROR(store.Put(own_key, std::as_bytes(std::span(encoded))));
  // The catalog is this host's index of the store: the packs just written
  // go in as a sync would put them.
  CKPT_RETURN_IF_ERROR(repo_->catalog->Update([&](WriteTxn& txn) -> Status {
    for (const auto& p : sealed) CKPT_RETURN_IF_ERROR(RecordPack(txn, p).status());
    return Status::OK();
  }));

  CKPT_ASSIGN_OR_RETURN(auto present, store.List(keys::PendingPrefix(name_)));
  std::set<uint32_t> ranks;
  for (const auto& key : present) {
    std::string n;
    uint32_t r;
    if (keys::ParsePendingRankObject(key, &n, &r) && n == name_ && r < options_.world_size) ranks.insert(r);
  }
  if (ranks.size() < options_.world_size) return Status::OK();

  // Ranks finishing together may all see every rank in: the one whose
  // claim lands first (a conditional PUT) commits, the others are done.
  // The claim names this attempt, so an answer lost on the way and a retry
  // that finds the object still tell whose claim it is.
  const std::string claim_key = keys::CommitClaimObject(name_);
  const std::string claim = "rank " + std::to_string(options_.rank) + " " + RandomHex(16);
  Status claimed = store.PutIfAbsent(claim_key, std::as_bytes(std::span(claim)));
  if (claimed.IsAlreadyExists()) {
    auto holder = store.ReadAll(claim_key, kMaxSmallObject);
    if (!holder.ok() && !holder.status().IsNotFound()) return holder.status();
    if (!holder.ok() || *holder != claim) return Status::OK();  // another rank commits (or did)
  } else {
    CKPT_RETURN_IF_ERROR(claimed);
  }
  const std::string manifest_key = keys::ManifestObject(name_);
  CKPT_ASSIGN_OR_RETURN(Manifest manifest, MergeStoredRanks());
  CKPT_RETURN_IF_ERROR(store_lock_->Check());
  const std::string manifest_bytes = EncodeManifest(manifest);
  Status put = store.PutIfAbsent(manifest_key, std::as_bytes(std::span(manifest_bytes)));
  // Exists: this PUT's own, its answer lost and retried.
  if (put.IsAlreadyExists()) return Status::OK();
  CKPT_RETURN_IF_ERROR(put);
  result->checkpoint_visible = true;
  // The checkpoint is committed: what follows is tidying, and its failure
  // (the store going away now) does not undo the commit. Rank objects left
  // behind are ignored by sync and removed by rm; the next sync brings the
  // checkpoint into this host's catalog.
  std::atomic<bool> failing{false};
  ParallelFor(repo_->IoPool(), options_.world_size, kStoreRequestsInFlight, [&](size_t r) {
    if (failing) return;
    Status st = store.Delete(keys::PendingRankObject(name_, static_cast<uint32_t>(r)));
    if (!st.ok() && !st.IsNotFound()) failing = true;
    (void)store.Delete(keys::StartedRankObject(name_, static_cast<uint32_t>(r)));
  });
  if (!failing) (void)store.Delete(claim_key);
  (void)repo_->Sync();
  return Status::OK();
}

// ---- public wrappers -------------------------------------------------------------

CheckpointWriter::CheckpointWriter(std::shared_ptr<WriterImpl> impl) : impl_(std::move(impl)) {}
CheckpointWriter::~CheckpointWriter() { Abort(); }

Status CheckpointWriter::PutShard(const TensorInfo& tensor, const Region& region, ShardSource& source) {
  if (!impl_) return Status::FailedPrecondition("checkpoint writer was aborted");
  CKPT_RETURN_IF_ERROR(impl_->repo().CheckProcess());
  return impl_->PutShard(tensor, region, source);
}

Status CheckpointWriter::PutTensor(const TensorInfo& tensor, std::span<const std::byte> data) {
  HostSource source(data);
  return PutShard(tensor, Region::OfBox(FullBox(tensor.shape)), source);
}

Status CheckpointWriter::PutBlob(const std::string& name, std::span<const std::byte> data) {
  if (!impl_) return Status::FailedPrecondition("checkpoint writer was aborted");
  CKPT_RETURN_IF_ERROR(impl_->repo().CheckProcess());
  return impl_->PutBlob(name, data);
}

CommitHandle CheckpointWriter::Commit() {
  if (!impl_) {
    CommitHandle h;
    return h;
  }
  if (Status forked = impl_->repo().CheckProcess(); !forked.ok()) {
    CommitHandle h;
    std::promise<Result<CommitResult>> p;
    p.set_value(forked);
    h.future_ = p.get_future().share();
    return h;
  }
  return impl_->Commit();
}

void CheckpointWriter::Abort() {
  // In a forked child the writer's threads do not exist and its pack files
  // are the parent's: it is left alone (core/fork.h).
  if (impl_ && impl_->repo().Forked()) {
    new std::shared_ptr<WriterImpl>(std::move(impl_));
    return;
  }
  // A committing writer finishes its commit first (the future holds it).
  impl_.reset();
}

// Whether `options` may join the pending checkpoint `rec`.
Status CheckJoin(const CheckpointRecord& rec, const WriterOptions& options) {
  const std::string& name = rec.name;
  if (rec.state == CheckpointState::kCommitted) {
    return Status::AlreadyExists("checkpoint '" + name + "' already exists");
  }
  if (rec.world_size != options.world_size) {
    return Status::InvalidArgument("checkpoint '" + name + "' is being written with world size " +
                                   std::to_string(rec.world_size) + ", not " + std::to_string(options.world_size));
  }
  if (options.step && rec.step && *options.step != *rec.step) {
    return Status::InvalidArgument("checkpoint '" + name + "' is being written as step " + std::to_string(*rec.step) +
                                   ", not " + std::to_string(*options.step));
  }
  if (std::binary_search(rec.committed_ranks.begin(), rec.committed_ranks.end(), options.rank)) {
    return Status::AlreadyExists("rank " + std::to_string(options.rank) + " of checkpoint '" + name +
                                 "' already committed");
  }
  return Status::OK();
}

Result<std::unique_ptr<CheckpointWriter>> Repository::BeginCheckpoint(const std::string& name,
                                                                      const WriterOptions& options) {
  CKPT_RETURN_IF_ERROR(impl_->CheckProcess());
  CKPT_RETURN_IF_ERROR(ValidateCheckpointName(name));
  if (name == "latest") {
    return Status::InvalidArgument("'latest' is reserved: the mount shows it as a link to the newest checkpoint");
  }
  for (const auto& [key, value] : options.tags) {
    CKPT_RETURN_IF_ERROR(ValidateMemberName("tag", key));
    CKPT_RETURN_IF_ERROR(ValidateMemberName("tag '" + key + "' value", value, /*allow_empty=*/true));
  }
  if (options.world_size == 0) return Status::InvalidArgument("world size must be at least 1");
  if (options.rank >= options.world_size) {
    return Status::InvalidArgument("rank " + std::to_string(options.rank) + " is out of range for world size " +
                                   std::to_string(options.world_size));
  }
  // Taken before the catalog is consulted, so gc cannot remove a chunk
  // between our dedup lookups and our commit.
  CKPT_ASSIGN_OR_RETURN(RepoLock lock, RepoLock::Acquire(impl_->state_dir, RepoLock::Mode::kShared));
  // On an object store, the same across hosts; then the catalog catches up
  // with the store (chunks to deduplicate against, ranks already in).
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<ObjectLock> store_lock, impl_->LockStore(ObjectLock::Mode::kShared));
  CKPT_RETURN_IF_ERROR(impl_->Sync().status());
  // Nothing is written here: the checkpoint's record appears with the first
  // rank's commit, so an aborted or killed writer leaves no trace.
  CKPT_RETURN_IF_ERROR(impl_->catalog->Read([&](const ReadTxn& txn) -> Status {
    CKPT_ASSIGN_OR_RETURN(auto raw, txn.Get(Table::kCheckpoints, keys::Checkpoint(name)));
    if (!raw) return Status::OK();
    CKPT_ASSIGN_OR_RETURN(CheckpointRecord rec, DecodeCheckpoint(*raw));
    return CheckJoin(rec, options);
  }));
  auto impl = std::make_shared<WriterImpl>(impl_, name, options, std::move(lock), std::move(store_lock));
  if (impl_->remote) {
    // Where this rank runs, for `ckpt show` of the checkpoint while it is
    // pending; a save does not fail for want of it.
    Json j = ThisProcess();
    j.Set("started_unix_ms", WallClockUnixMs());
    const std::string body = j.Dump();
    (void)impl_->backend->Put(keys::StartedRankObject(name, options.rank), std::as_bytes(std::span(body)));
  }
  return std::unique_ptr<CheckpointWriter>(new CheckpointWriter(std::move(impl)));
}

}  // namespace ckptfs
