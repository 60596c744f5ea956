// CheckpointWriter: the save pipeline. What it saved joins its checkpoint
// through the repository's commit protocol (commit.h).
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

#include "ckpt/commit.h"
#include "ckpt/repository.h"
#include "ckpt/repo_lock.h"
#include "ckpt/repository_impl.h"
#include "core/thread_pool.h"

namespace ckptfs {

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
    // A save given up before its commit: the protocol says what its packs
    // and records become.
    bool committed;
    {
      std::lock_guard lock(mu_);
      committed = committed_;
    }
    if (!committed) repo_->protocol->Abandon(name_, options_.rank, packs_);
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
  // Hands the finished rank to the repository's commit protocol.
  Status CommitRank(const std::vector<SealedPack>& sealed, CommitResult* result);
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
                       st = sealed.ok() ? CommitRank(*sealed, &result) : sealed.status();
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

Status WriterImpl::CommitRank(const std::vector<SealedPack>& sealed, CommitResult* result) {
  for (auto& t : record_.tensors) {
    for (auto& s : t.shards) s.ComputeStarts();
  }
  {
    std::lock_guard lock(mu_);
    *result = stats_;
  }
  result->checkpoint_visible = false;
  const RankCommit rank{name_, options_, created_unix_ms_, record_, sealed, stored_, store_lock_.get()};
  return repo_->protocol->Commit(rank, result);
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
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<ObjectLock> store_lock, impl_->protocol->LockHosts(ObjectLock::Mode::kShared));
  CKPT_RETURN_IF_ERROR(impl_->protocol->Sync().status());
  // Nothing is written here: the checkpoint's record appears with the first
  // rank's commit, so an aborted or killed writer leaves no trace.
  CKPT_RETURN_IF_ERROR(impl_->catalog->Read([&](const ReadTxn& txn) -> Status {
    CKPT_ASSIGN_OR_RETURN(auto raw, txn.Get(Table::kCheckpoints, keys::Checkpoint(name)));
    if (!raw) return Status::OK();
    CKPT_ASSIGN_OR_RETURN(CheckpointRecord rec, DecodeCheckpoint(*raw));
    return CheckJoin(rec, options);
  }));
  auto impl = std::make_shared<WriterImpl>(impl_, name, options, std::move(lock), std::move(store_lock));
  impl_->protocol->Begin(name, options.rank);
  return std::unique_ptr<CheckpointWriter>(new CheckpointWriter(std::move(impl)));
}

}  // namespace ckptfs
