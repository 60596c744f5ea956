// CheckpointWriter: a rank's save. Its bytes go through the save pipeline
// (pipeline.h: chunking, hashing, dedup, encoding, packs); what it saved
// joins its checkpoint through the repository's commit protocol (commit.h).
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
#include "ckpt/copy.h"
#include "ckpt/pipeline.h"
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

Result<MappedSource> MappedSource::Make(std::shared_ptr<const MappedFile> file, uint64_t offset, uint64_t size) {
  if (!file) return Status::InvalidArgument("a mapped source needs a file");
  if (offset > file->size() || size > file->size() - offset) {
    return Status::InvalidArgument(file->path() + ": bytes [" + std::to_string(offset) + ", +" + std::to_string(size) +
                                   ") are past its end (" + std::to_string(file->size()) + " bytes)");
  }
  std::span<const std::byte> data = file->bytes().subspan(offset, size);
  return MappedSource(std::move(file), data);
}

Status LentSource::Read(uint64_t offset, std::span<std::byte> dst) {
  if (offset > data_.size() || dst.size() > data_.size() - offset) {
    return Status::InvalidArgument(std::string("read past the end of a ") + kind_ + " source");
  }
  std::memcpy(dst.data(), data_.data() + offset, dst.size());
  return Status::OK();
}

Result<BorrowedBytes> LentSource::Borrow(uint64_t offset, uint64_t n) {
  if (offset > data_.size() || n > data_.size() - offset) {
    return Status::InvalidArgument(std::string("borrow past the end of a ") + kind_ + " source");
  }
  BorrowedBytes lent{data_.subspan(offset, n), keep_};
  lent.stable = stable_;
  lent.resident = resident_;
  return lent;
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

namespace {
// A piece of a tile: `bytes` bytes at `from` in the source read from, at
// `to` in the tile.
struct TileRun {
  uint64_t from;
  uint64_t to;
  uint64_t bytes;
};

// One tile of a box shard, row-major over the tile, gathered from the box's
// row-major stream (or the band of it read into memory) by its runs.
class TileSource final : public ShardSource {
 public:
  TileSource(ShardSource& from, std::span<const TileRun> runs, uint64_t size)
      : from_(from), runs_(runs), size_(size) {}
  uint64_t size() const override { return size_; }
  bool RandomAccess() const override { return true; }
  Status Read(uint64_t offset, std::span<std::byte> dst) override {
    if (offset > size_ || dst.size() > size_ - offset) {
      return Status::InvalidArgument("read past the end of a tile");
    }
    auto it = std::upper_bound(runs_.begin(), runs_.end(), offset,
                               [](uint64_t off, const TileRun& r) { return off < r.to + r.bytes; });
    uint64_t done = 0;
    for (; done < dst.size() && it != runs_.end(); ++it) {
      const uint64_t skip = offset + done - it->to;
      const uint64_t n = std::min(it->bytes - skip, dst.size() - done);
      CKPT_RETURN_IF_ERROR(from_.Read(it->from + skip, dst.subspan(done, n)));
      done += n;
    }
    return Status::OK();
  }
  // Bytes of one run are lent as the source lends them (a tile of whole
  // rows is one run); bytes across runs are read.
  Result<BorrowedBytes> Borrow(uint64_t offset, uint64_t n) override {
    auto it = std::upper_bound(runs_.begin(), runs_.end(), offset,
                               [](uint64_t off, const TileRun& r) { return off < r.to + r.bytes; });
    if (it == runs_.end() || offset < it->to || n > it->bytes - (offset - it->to)) return BorrowedBytes{};
    return from_.Borrow(it->from + (offset - it->to), n);
  }

 private:
  ShardSource& from_;
  std::span<const TileRun> runs_;
  uint64_t size_;
};
}  // namespace

// A blob being streamed into a writer (BeginBlob ... EndBlob). Each round
// of cuts streams its chunks into a vector of its own, which the pipeline's
// jobs fill in: the blob's record is assembled from its rounds once they are
// done (WriterImpl::TakeStreamedBlobs, after the pipeline's Shutdown).
struct StreamedBlob {
  std::string name;
  uint64_t size = 0;
  std::shared_ptr<BufferPool::Lease> pending;  // the bytes since the last cut: first pending_len
  size_t pending_len = 0;
  std::vector<std::vector<ChunkRef>> rounds;
};

class WriterImpl : public std::enable_shared_from_this<WriterImpl> {
 public:
  WriterImpl(std::shared_ptr<RepositoryImpl> repo, std::string name, WriterOptions options, RepoLock lock,
             std::unique_ptr<ObjectLock> store_lock, RankCommit::Role role)
      : repo_(std::move(repo)),
        lock_(std::in_place, std::move(lock)),
        store_lock_(std::move(store_lock)),
        role_(role),
        name_(std::move(name)),
        options_(std::move(options)),
        pipeline_(PipelineSettingsOf(*repo_, options_)) {
    record_.rank = options_.rank;
  }

  ~WriterImpl() {
    pipeline_.Fail(Status::FailedPrecondition("checkpoint writer was aborted"));
    pipeline_.Shutdown();
    // A save given up before its commit: the protocol says what its packs
    // and records become.
    bool committed;
    {
      std::lock_guard lock(mu_);
      committed = committed_;
    }
    if (!committed) repo_->protocol->Abandon(name_, options_.rank, pipeline_.packs());
  }

  Status PutShard(const TensorInfo& info, const Region& region, ShardSource& source);
  // Stores one shard record's bytes: a flat range, or a box chunked from
  // its start.
  Status PutPiece(const TensorInfo& info, const Region& region, ShardSource& source);
  // Stores a box that is not contiguous as its grid tiles (GridTile).
  Status PutTiles(const TensorInfo& info, const Box& box, ShardSource& source);
  Status PutBlob(const std::string& name, std::span<const std::byte> data);
  Status PutStored(const RankRecord& part, std::span<const ChunkRef> send, DirectFetcher& source, ThreadPool& io,
                   size_t threads, CopyCounters& counters);
  CommitHandle Commit();
  Status BeginBlob(const std::string& name);
  Status AppendBlob(std::span<const std::byte> data, BlobPiece piece, DType dtype);
  Status EndBlob();
  const RepositoryImpl& repo() const { return *repo_; }

 private:
  Status CheckUsable() {
    {
      std::lock_guard lock(mu_);
      if (committed_) return Status::FailedPrecondition("checkpoint writer already committed");
    }
    return pipeline_.error();
  }
  // Streams the chunks of the open blob's pending bytes that end before
  // them (all of them when `last`), and keeps the rest pending.
  Status CutPending(bool last);
  // Adds the streamed blobs' records to record_; after pipeline_.Shutdown.
  void TakeStreamedBlobs();
  // Hands the finished rank to the repository's commit protocol.
  Status CommitRank(const std::vector<SealedPack>& sealed, CommitResult* result);
  static PipelineSettings PipelineSettingsOf(RepositoryImpl& repo, const WriterOptions& options) {
    PipelineSettings s;
    s.store = repo.backend.get();
    s.pool = repo.pool.get();
    s.buffers = repo.buffers.get();
    s.chunk_size = repo.config.chunk_size;
    s.pack_size = repo.config.pack_size;
    s.codec = repo.config.codec;
    s.adaptive = repo.config.adaptive && !options.compress_every_chunk;
    s.queued_chunks = &repo.queued_chunks;
    s.lookup = [r = &repo](const ChunkId& id) { return r->LookupChunk(id); };
    return s;
  }

  // Shared: a writer, and the commit handle that keeps it, may outlive the
  // Repository (repository.h, "Lifetimes"). Declared first, so it is released
  // last: the store lock below and the pack writer use its backend.
  const std::shared_ptr<RepositoryImpl> repo_;
  // Held shared until this writer's commit finished or it is gone: gc waits
  // for it (repo_lock.h).
  std::optional<RepoLock> lock_;
  // The same, across hosts, for a repository on an object store.
  std::unique_ptr<ObjectLock> store_lock_;
  const RankCommit::Role role_;  // in a group's split commit (WriterOptions::await_ranks)
  const std::string name_;
  const WriterOptions options_;
  // Chunks, dedup, encoding and packs; uses repo_'s store, pools and
  // catalog (its lookup), so it is declared after repo_.
  SavePipeline pipeline_;

  // Which lock guards what. The caller's thread (one per writer: PutShard,
  // PutBlob, Commit) and the commit task share this object; the pipeline
  // guards its own state. Once the commit task's pipeline_.Shutdown() has
  // returned, the commit task reads record_ alone.
  std::mutex mu_;
  bool committed_ = false;                        // guarded by mu_
  RankRecord record_;                             // guarded by mu_ (alone after Shutdown)
  std::map<std::string, size_t> tensor_index_;    // guarded by mu_
  std::set<std::string> blob_names_;              // guarded by mu_
  uint64_t logical_bytes_ = 0;                    // guarded by mu_
  // Streamed blobs (BeginBlob ... EndBlob; StreamedBlob above).
  std::optional<StreamedBlob> open_blob_;         // the caller's thread only
  std::vector<StreamedBlob> streamed_;            // guarded by mu_

  const uint64_t created_unix_ms_ = WallClockUnixMs();
  std::chrono::steady_clock::time_point first_put_{};  // the caller's thread only
  std::vector<TileRun> tile_runs_;                     // the caller's thread only (PutTiles)
  std::vector<std::byte> band_;                        // the caller's thread only (PutTiles)
  std::chrono::nanoseconds blocking_{0};               // the caller's thread only
};

namespace {
class BlockTimer {
 public:
  explicit BlockTimer(std::chrono::nanoseconds* sink) : sink_(sink), start_(std::chrono::steady_clock::now()) {}
  ~BlockTimer() { *sink_ += std::chrono::steady_clock::now() - start_; }

 private:
  std::chrono::nanoseconds* sink_;
  std::chrono::steady_clock::time_point start_;
};
}  // namespace

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
  if (region.kind == Region::Kind::kBox) {
    const Status st = PutTiles(info, region.box, source);
    // Tiles already put may still be on their way to a pack, so they stay;
    // this rank's save cannot go on without the rest.
    if (!st.ok()) pipeline_.Fail(st);
    return st;
  }
  return PutPiece(info, region, source);
}

Status WriterImpl::PutPiece(const TensorInfo& info, const Region& region, ShardSource& source) {
  const uint64_t w = DTypeSize(info.dtype);
  const uint64_t bytes = region.NumElements() * w;
  const uint64_t global_start = region.kind == Region::Kind::kFlat ? region.flat.start * w : 0;
  ShardRecord shard;
  shard.region = region;
  shard.ranks = {options_.rank};
  CKPT_RETURN_IF_ERROR(pipeline_.Stream(pipeline_.ChunkBounds(global_start, bytes), info.dtype, source, shard.chunks));
  std::lock_guard lock(mu_);
  logical_bytes_ += bytes;
  record_.tensors[tensor_index_[info.name]].shards.push_back(std::move(shard));
  return Status::OK();
}

Status WriterImpl::PutTiles(const TensorInfo& info, const Box& box, ShardSource& source) {
  const size_t n = box.rank();
  const uint64_t w = DTypeSize(info.dtype);
  const Shape tile = GridTile(info.shape, w, repo_->config.chunk_size);
  // The grid cells the box meets: indices first[d] to last[d].
  std::vector<uint64_t> first(n), last(n);
  for (size_t d = 0; d < n; ++d) {
    first[d] = box.offsets[d] / tile[d];
    last[d] = (box.offsets[d] + box.lengths[d] - 1) / tile[d];
  }
  uint64_t row = w;  // bytes of one step along dimension 0 of the box
  for (size_t d = 1; d < n; ++d) row *= box.lengths[d];
  const LinearSpace box_space = SpaceOfBox(box);
  // A source that reads forward only gives a band of rows (the cells of
  // one index along dimension 0) at a time, in order.
  const bool banded = !source.RandomAccess();
  std::vector<uint64_t> index = first;
  Box cell;
  cell.offsets.resize(n);
  cell.lengths.resize(n);
  for (uint64_t i0 = first[0]; i0 <= last[0]; ++i0) {
    const uint64_t r0 = std::max(i0 * tile[0], box.offsets[0]);
    const uint64_t r1 = std::min((i0 + 1) * tile[0], box.offsets[0] + box.lengths[0]);
    ShardSource* from = &source;
    uint64_t from_base = 0;
    std::optional<HostSource> band;
    if (banded) {
      from_base = (r0 - box.offsets[0]) * row;
      band_.resize((r1 - r0) * row);
      CKPT_RETURN_IF_ERROR(source.Read(from_base, band_));
      band.emplace(band_);
      from = &*band;
    }
    index = first;
    index[0] = i0;
    while (true) {
      for (size_t d = 0; d < n; ++d) {
        const uint64_t lo = std::max(index[d] * tile[d], box.offsets[d]);
        const uint64_t hi = std::min((index[d] + 1) * tile[d], box.offsets[d] + box.lengths[d]);
        cell.offsets[d] = lo;
        cell.lengths[d] = hi - lo;
      }
      tile_runs_.clear();
      ForEachRun(cell, box_space, SpaceOfBox(cell), [&](uint64_t src, uint64_t dst, uint64_t count) {
        tile_runs_.push_back({src * w - from_base, dst * w, count * w});
      });
      TileSource piece(*from, tile_runs_, cell.NumElements() * w);
      CKPT_RETURN_IF_ERROR(PutPiece(info, Normalize(info.shape, Region::OfBox(cell)), piece));
      // The next cell of this band, last dimension fastest.
      size_t d = n;
      while (--d > 0) {
        if (++index[d] <= last[d]) break;
        index[d] = first[d];
      }
      if (d == 0) break;
    }
  }
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
  BlobRecord blob{name, data.size(), {}};
  HostSource source(data);
  CKPT_RETURN_IF_ERROR(pipeline_.Stream(pipeline_.ContentBounds(data), DType::kU8, source, blob.chunks));
  std::lock_guard lock(mu_);
  logical_bytes_ += data.size();
  record_.blobs.push_back(std::move(blob));
  return Status::OK();
}

Status WriterImpl::BeginBlob(const std::string& name) {
  CKPT_RETURN_IF_ERROR(CheckUsable());
  if (first_put_ == std::chrono::steady_clock::time_point{}) first_put_ = std::chrono::steady_clock::now();
  CKPT_RETURN_IF_ERROR(ValidateMemberName("blob name", name));
  if (open_blob_) return Status::FailedPrecondition("blob '" + open_blob_->name + "' is still being written");
  {
    std::lock_guard lock(mu_);
    if (!blob_names_.insert(name).second) return Status::InvalidArgument("blob '" + name + "' was put twice");
  }
  open_blob_.emplace();
  open_blob_->name = name;
  return Status::OK();
}

Status WriterImpl::AppendBlob(std::span<const std::byte> data, BlobPiece piece, DType dtype) {
  BlockTimer timer(&blocking_);
  CKPT_RETURN_IF_ERROR(CheckUsable());
  if (!open_blob_) return Status::FailedPrecondition("no blob is being written (BeginBlob first)");
  StreamedBlob& b = *open_blob_;
  BufferPool& buffers = *repo_->buffers;
  if (piece == BlobPiece::kUnit) {
    if (data.size() % DTypeSize(dtype) != 0) {
      return Status::InvalidArgument("a unit of " + std::to_string(data.size()) + " bytes is not whole " +
                                     std::string(DTypeName(dtype)) + " elements");
    }
    // The bytes before the unit end where it starts; each pooled buffer
    // (the chunk size, a multiple of every element size) then holds one
    // chunk of it, and the bytes after it start afresh.
    CKPT_RETURN_IF_ERROR(CutPending(true));
    while (!data.empty()) {
      auto lease = std::make_shared<BufferPool::Lease>(buffers.Acquire(buffers.buffer_size()));
      const size_t n = std::min<size_t>(data.size(), lease->capacity());
      std::memcpy(lease->data(), data.data(), n);
      b.size += n;
      data = data.subspan(n);
      StableSource source(lease, std::span<const std::byte>(lease->data(), n), /*resident=*/false);
      b.rounds.emplace_back();
      CKPT_RETURN_IF_ERROR(pipeline_.Stream({0, n}, dtype, source, b.rounds.back()));
    }
    return Status::OK();
  }
  while (!data.empty()) {
    if (!b.pending) b.pending = std::make_shared<BufferPool::Lease>(buffers.Acquire(buffers.buffer_size()));
    const size_t n = std::min(data.size(), b.pending->capacity() - b.pending_len);
    std::memcpy(b.pending->data() + b.pending_len, data.data(), n);
    b.pending_len += n;
    b.size += n;
    data = data.subspan(n);
    if (b.pending_len == b.pending->capacity()) CKPT_RETURN_IF_ERROR(CutPending(false));
  }
  return Status::OK();
}

Status WriterImpl::CutPending(bool last) {
  StreamedBlob& b = *open_blob_;
  if (b.pending_len == 0) return Status::OK();
  std::span<const std::byte> bytes(b.pending->data(), b.pending_len);
  // Cuts depend only on the bytes since the chunk's start, so a cut found
  // before the end of the pending bytes is where the whole blob's would
  // be; the last end is only where the bytes stop, unless this is the end.
  std::vector<uint64_t> bounds = pipeline_.ContentBounds(bytes);
  if (!last && bounds.size() > 2) bounds.pop_back();
  const uint64_t taken = bounds.back();
  std::shared_ptr<BufferPool::Lease> full = std::move(b.pending);
  b.pending_len -= taken;
  if (b.pending_len > 0) {
    b.pending = std::make_shared<BufferPool::Lease>(repo_->buffers->Acquire(repo_->buffers->buffer_size()));
    std::memcpy(b.pending->data(), full->data() + taken, b.pending_len);
  }
  // Not resident: the pipeline bounds the chunks in flight, and with them
  // the buffers a stream holds.
  StableSource source(full, bytes.first(taken), /*resident=*/false);
  b.rounds.emplace_back();
  return pipeline_.Stream(bounds, DType::kU8, source, b.rounds.back());
}

Status WriterImpl::EndBlob() {
  BlockTimer timer(&blocking_);
  CKPT_RETURN_IF_ERROR(CheckUsable());
  if (!open_blob_) return Status::FailedPrecondition("no blob is being written (BeginBlob first)");
  Status st = CutPending(true);
  StreamedBlob done = std::move(*open_blob_);
  open_blob_.reset();
  CKPT_RETURN_IF_ERROR(st);
  std::lock_guard lock(mu_);
  logical_bytes_ += done.size;
  streamed_.push_back(std::move(done));
  return Status::OK();
}

void WriterImpl::TakeStreamedBlobs() {
  std::lock_guard lock(mu_);
  for (StreamedBlob& b : streamed_) {
    BlobRecord blob{b.name, b.size, {}};
    for (const auto& round : b.rounds) blob.chunks.insert(blob.chunks.end(), round.begin(), round.end());
    record_.blobs.push_back(std::move(blob));
  }
  streamed_.clear();
}

Status WriterImpl::PutStored(const RankRecord& part, std::span<const ChunkRef> send, DirectFetcher& source,
                             ThreadPool& io, size_t threads, CopyCounters& counters) {
  BlockTimer timer(&blocking_);
  CKPT_RETURN_IF_ERROR(CheckUsable());
  if (first_put_ == std::chrono::steady_clock::time_point{}) first_put_ = std::chrono::steady_clock::now();
  // The records come from a manifest that validated itself; what a rank may
  // put is checked here as PutShard and PutBlob check it.
  uint64_t logical = 0;
  for (const TensorRecord& t : part.tensors) {
    CKPT_RETURN_IF_ERROR(ValidateMemberName("tensor name", t.name));
    for (const ShardRecord& shard : t.shards) {
      CKPT_RETURN_IF_ERROR(ValidateRegion(t.shape, shard.region).WithContext("tensor '" + t.name + "'"));
      logical += shard.region.NumElements() * DTypeSize(t.dtype);
    }
  }
  for (const BlobRecord& b : part.blobs) {
    CKPT_RETURN_IF_ERROR(ValidateMemberName("blob name", b.name));
    logical += b.size;
  }
  pipeline_.Start();
  std::atomic<bool> failed{false};
  ParallelFor(io, send.size(), threads, [&](size_t i) {
    if (failed.load() || !pipeline_.error().ok()) return;
    if (counters.cancelled && counters.cancelled()) {
      failed.store(true);
      pipeline_.Fail(Status::FailedPrecondition("cancelled"));
      return;
    }
    BufferPool::Lease stored;
    auto loc = source.FetchStored(send[i], *repo_->buffers, &stored);
    if (!loc.ok()) {
      failed.store(true);
      pipeline_.Fail(loc.status().WithContext("reading chunk " + send[i].id.ToHex() + " from the source"));
      return;
    }
    pipeline_.StoreEncoded(send[i].id, loc->codec, loc->raw_len, std::move(stored), loc->stored_len);
    counters.chunks_sent.fetch_add(1);
    counters.raw_bytes_sent.fetch_add(send[i].raw_len);
  });
  CKPT_RETURN_IF_ERROR(pipeline_.error());
  std::lock_guard lock(mu_);
  for (const TensorRecord& t : part.tensors) {
    auto it = tensor_index_.find(t.name);
    if (it == tensor_index_.end()) {
      it = tensor_index_.emplace(t.name, record_.tensors.size()).first;
      record_.tensors.push_back(TensorRecord{t.name, t.dtype, t.shape, {}});
    }
    TensorRecord& mine = record_.tensors[it->second];
    if (mine.dtype != t.dtype || mine.shape != t.shape) {
      return Status::InvalidArgument("tensor '" + t.name + "' was put twice with different dtype or shape");
    }
    for (const ShardRecord& shard : t.shards) {
      ShardRecord copy;
      copy.region = Normalize(t.shape, shard.region);
      copy.ranks = {options_.rank};
      copy.chunks = shard.chunks;
      mine.shards.push_back(std::move(copy));
    }
  }
  for (const BlobRecord& b : part.blobs) {
    if (!blob_names_.insert(b.name).second) return Status::InvalidArgument("blob '" + b.name + "' was put twice");
    record_.blobs.push_back(BlobRecord{b.name, b.size, b.chunks});
  }
  logical_bytes_ += logical;
  return Status::OK();
}

CommitHandle WriterImpl::Commit() {
  CommitHandle handle;
  handle.total_ns_ = std::make_shared<std::atomic<int64_t>>(0);
  {
    std::lock_guard lock(mu_);
    if (committed_) return CommitHandle::Failed(Status::FailedPrecondition("checkpoint writer already committed"));
    if (open_blob_) {
      return CommitHandle::Failed(
          Status::FailedPrecondition("blob '" + open_blob_->name + "' is still being written"));
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
                     pipeline_.Shutdown();
                     TakeStreamedBlobs();
                     Status st = pipeline_.error();
                     CommitResult result;
                     if (st.ok()) {
                       auto sealed = pipeline_.Finish();
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
  const PipelineStats stats = pipeline_.stats();
  result->chunks_written = stats.chunks_written;
  result->chunks_deduplicated = stats.chunks_deduplicated;
  result->stored_bytes = stats.stored_bytes;
  {
    std::lock_guard lock(mu_);
    result->logical_bytes = logical_bytes_;
  }
  result->checkpoint_visible = false;
  const RankCommit rank{name_, options_, created_unix_ms_, record_, sealed, pipeline_.stored(), store_lock_.get(),
                        role_};
  CKPT_RETURN_IF_ERROR(repo_->protocol->Commit(rank, result));
  if (!options_.overwrite || !result->checkpoint_visible) return Status::OK();
  const std::string replaced = keys::ReplacedName(name_);
  return PromoteReplacement(*repo_, replaced, options_).WithContext("replacing checkpoint '" + replaced + "'");
}

// ---- public wrappers -------------------------------------------------------------

CheckpointWriter::CheckpointWriter(std::shared_ptr<WriterImpl> impl) : impl_(std::move(impl)) {}
CheckpointWriter::~CheckpointWriter() { Abort(); }

Status CheckpointWriter::PutShard(const TensorInfo& tensor, const Region& region, ShardSource& source) {
  CKPT_ASSIGN_OR_RETURN(WriterImpl * w, Usable());
  return w->PutShard(tensor, region, source);
}

Status CheckpointWriter::PutTensor(const TensorInfo& tensor, std::span<const std::byte> data) {
  HostSource source(data);
  return PutShard(tensor, Region::OfBox(FullBox(tensor.shape)), source);
}

Status CheckpointWriter::PutBlob(const std::string& name, std::span<const std::byte> data) {
  CKPT_ASSIGN_OR_RETURN(WriterImpl * w, Usable());
  return w->PutBlob(name, data);
}

Status CheckpointWriter::BeginBlob(const std::string& name) {
  CKPT_ASSIGN_OR_RETURN(WriterImpl * w, Usable());
  return w->BeginBlob(name);
}

Status CheckpointWriter::AppendBlob(std::span<const std::byte> data, BlobPiece piece, DType dtype) {
  CKPT_ASSIGN_OR_RETURN(WriterImpl * w, Usable());
  return w->AppendBlob(data, piece, dtype);
}

Status CheckpointWriter::EndBlob() {
  CKPT_ASSIGN_OR_RETURN(WriterImpl * w, Usable());
  return w->EndBlob();
}

CommitHandle CheckpointWriter::Commit() {
  if (!impl_) return CommitHandle();
  if (Status forked = impl_->repo().CheckProcess(); !forked.ok()) return CommitHandle::Failed(forked);
  return impl_->Commit();
}

CommitHandle CommitHandle::Failed(Status st) {
  CommitHandle h;
  std::promise<Result<CommitResult>> p;
  p.set_value(std::move(st));
  h.future_ = p.get_future().share();
  return h;
}

Result<WriterImpl*> CheckpointWriter::Usable() const {
  if (!impl_) return Status::FailedPrecondition("checkpoint writer was aborted");
  CKPT_RETURN_IF_ERROR(impl_->repo().CheckProcess());
  return impl_.get();
}

Status PutStoredRank(CheckpointWriter& writer, const RankRecord& part, std::span<const ChunkRef> send,
                     DirectFetcher& source, ThreadPool& io, size_t threads, CopyCounters& counters) {
  CKPT_ASSIGN_OR_RETURN(WriterImpl * w, writer.Usable());
  return w->PutStored(part, send, source, io, threads, counters);
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

namespace {
// A name is a checkpoint or a group of checkpoints, not both: the mount
// shows either as a directory of that name.
Status CheckGroups(const ReadTxn& txn, const std::string& name) {
  for (size_t slash = name.find('/'); slash != std::string::npos; slash = name.find('/', slash + 1)) {
    const std::string group = name.substr(0, slash);
    CKPT_ASSIGN_OR_RETURN(auto raw, txn.Get(Table::kCheckpoints, keys::Checkpoint(group)));
    if (raw) {
      return Status::InvalidArgument("checkpoint name '" + name + "' puts it in group '" + group +
                                     "', which is a checkpoint: a name is a checkpoint or a group, not both");
    }
  }
  std::string member;
  CKPT_RETURN_IF_ERROR(txn.Scan(Table::kCheckpoints, name + "/", [&](std::string_view k, std::string_view) {
    if (keys::IsRetiredCheckpoint(k)) return true;
    member = std::string(k);
    return false;
  }));
  if (!member.empty()) {
    return Status::InvalidArgument("'" + name + "' is a group of checkpoints ('" + keys::ReplacedName(member) +
                                   "'): a name is a checkpoint or a group, not both");
  }
  return Status::OK();
}
}  // namespace

Result<std::unique_ptr<CheckpointWriter>> Repository::BeginCheckpoint(const std::string& name,
                                                                      const WriterOptions& options) {
  CKPT_RETURN_IF_ERROR(impl_->CheckProcess());
  CKPT_RETURN_IF_ERROR(ValidateCheckpointName(name));
  if (name == "latest") {
    return Status::InvalidArgument("'latest' is reserved: the mount shows it as a link to the newest checkpoint");
  }
  for (const auto& [key, value] : options.tags) {
    CKPT_RETURN_IF_ERROR(ValidateMemberName("tag", key));
    if (key.starts_with(kEngineTagPrefix) && !options.engine_tags) {
      return Status::InvalidArgument("tag '" + key + "': tags beginning with '" + kEngineTagPrefix +
                                     "' are ckptfs's own (" + kThinnedTag + " marks a thinned checkpoint)");
    }
    CKPT_RETURN_IF_ERROR(ValidateMemberName("tag '" + key + "' value", value, /*allow_empty=*/true));
  }
  if (options.world_size == 0) return Status::InvalidArgument("world size must be at least 1");
  if (options.rank >= options.world_size) {
    return Status::InvalidArgument("rank " + std::to_string(options.rank) + " is out of range for world size " +
                                   std::to_string(options.world_size));
  }
  if (options.share_sync != nullptr && options.shared_sync != nullptr) {
    return Status::InvalidArgument("a writer either shares its store listing or is given one, not both");
  }
  if (options.await_ranks.count() < 0 ||
      (options.await_ranks.count() > 0 && options.share_sync == nullptr && options.shared_sync == nullptr)) {
    return Status::InvalidArgument("await_ranks splits a group's commit: it needs share_sync or shared_sync");
  }
  if (!IsValidSaveAttempt(options.attempt)) {
    return Status::InvalidArgument("a save attempt is at most " + std::to_string(kMaxAttemptSize) +
                                   " printable characters without spaces");
  }
  if (options.thins && !options.overwrite) {
    return Status::InvalidArgument("a thinning of checkpoint '" + name + "' replaces it: it needs overwrite");
  }
  if (options.overwrite && options.attempt.empty() && options.world_size > 1) {
    return Status::InvalidArgument("replacing checkpoint '" + name + "' with a save of " +
                                   std::to_string(options.world_size) +
                                   " ranks needs a save attempt that every rank shares");
  }
  const bool split = options.await_ranks.count() > 0;
  // Taken before the catalog is consulted, so gc cannot remove a chunk
  // between our dedup lookups and our commit.
  CKPT_ASSIGN_OR_RETURN(RepoLock lock, RepoLock::Acquire(impl_->state_dir, RepoLock::Mode::kShared));
  // On an object store, the same across hosts (but for a rank covered by
  // the sharing rank's lock); then the catalog catches up with the store
  // (chunks to deduplicate against, ranks already in).
  std::unique_ptr<ObjectLock> store_lock;
  if (!(split && options.shared_sync != nullptr)) {
    CKPT_ASSIGN_OR_RETURN(store_lock, impl_->protocol->LockHosts(ObjectLock::Mode::kShared));
  }
  if (options.shared_sync != nullptr) {
    CKPT_RETURN_IF_ERROR(impl_->protocol->SyncFrom(*options.shared_sync).status());
  } else if (options.share_sync != nullptr) {
    CKPT_ASSIGN_OR_RETURN(*options.share_sync, impl_->protocol->ShareSync(/*with_pack_indexes=*/false));
  } else {
    CKPT_RETURN_IF_ERROR(impl_->protocol->Sync().status());
  }
  WriterOptions kept = options;
  kept.share_sync = nullptr;  // the caller's, used above only
  kept.shared_sync = nullptr;
  // A replacing save runs under "NAME~" (WriterOptions::overwrite). A
  // replacement a crash left committed is this save's to drop.
  const std::string target = options.overwrite ? keys::ReplacementCheckpoint(name) : name;
  if (options.overwrite) {
    if (kept.attempt.empty()) kept.attempt = NewSaveAttempt();
    CKPT_RETURN_IF_ERROR(DropCommittedReplacement(*impl_, name));
  }
  // Nothing is written here: the checkpoint's record appears with the first
  // rank's commit, so an aborted or killed writer leaves no trace.
  CKPT_RETURN_IF_ERROR(impl_->catalog->Read([&](const ReadTxn& txn) -> Status {
    CKPT_RETURN_IF_ERROR(CheckGroups(txn, name));
    CKPT_ASSIGN_OR_RETURN(auto raw, txn.Get(Table::kCheckpoints, keys::Checkpoint(target)));
    if (!raw) return Status::OK();
    CKPT_ASSIGN_OR_RETURN(CheckpointRecord rec, DecodeCheckpoint(*raw));
    return CheckJoin(rec, kept).status();
  }));
  const RankCommit::Role role = !split                          ? RankCommit::Role::kAny
                                : options.share_sync != nullptr ? RankCommit::Role::kCompleter
                                                                : RankCommit::Role::kPartOnly;
  auto impl =
      std::make_shared<WriterImpl>(impl_, target, std::move(kept), std::move(lock), std::move(store_lock), role);
  impl_->protocol->Begin(target, options.rank);
  return std::unique_ptr<CheckpointWriter>(new CheckpointWriter(std::move(impl)));
}

}  // namespace ckptfs
