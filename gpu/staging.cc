#include "staging.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <functional>
#include <future>

namespace ckptfs::gpu {

// ---- PinnedPool ----------------------------------------------------------------

Result<std::unique_ptr<PinnedPool>> PinnedPool::Create(CopyEngine& engine, size_t count, size_t bytes_each) {
  if (count < 2) return Status::InvalidArgument("a staging pool needs at least two buffers to overlap copies");
  if (bytes_each == 0) return Status::InvalidArgument("staging buffers must not be empty");
  std::unique_ptr<PinnedPool> pool(new PinnedPool(engine, bytes_each));
  for (size_t i = 0; i < count; ++i) {
    CKPT_ASSIGN_OR_RETURN(std::byte* p, engine.AllocatePinned(bytes_each));
    pool->buffers_.push_back(p);
    pool->free_.push_back(i);
  }
  return pool;
}

PinnedPool::~PinnedPool() {
  for (std::byte* p : buffers_) engine_.FreePinned(p);
}

PinnedPool::Lease PinnedPool::Acquire() {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return !free_.empty(); });
  size_t i = free_.back();
  free_.pop_back();
  return Lease(this, i);
}

void PinnedPool::Release(size_t index) {
  {
    std::lock_guard lock(mu_);
    free_.push_back(index);
  }
  cv_.notify_one();
}

PinnedPool::Lease PinnedPool::TryAcquire() {
  std::lock_guard lock(mu_);
  if (free_.empty()) return Lease();
  size_t i = free_.back();
  free_.pop_back();
  return Lease(this, i);
}

PinnedPool::Lease& PinnedPool::Lease::operator=(Lease&& o) noexcept {
  if (this != &o) {
    if (pool_) pool_->Release(index_);
    pool_ = o.pool_;
    index_ = o.index_;
    o.pool_ = nullptr;
  }
  return *this;
}

PinnedPool::Lease::~Lease() {
  if (pool_) pool_->Release(index_);
}

std::span<std::byte> PinnedPool::Lease::buffer() const {
  return {pool_->buffers_[index_], pool_->bytes_each_};
}

// ---- streaming save --------------------------------------------------------------

DeviceSource::~DeviceSource() {
  // Copies still in flight write into leased buffers: let them finish, then
  // wait until the writer has returned every buffer it borrowed.
  for (auto& p : inflight_) {
    if (!p->waited) (void)engine_.Wait(p->ticket);
  }
  inflight_.clear();
  outstanding_.Wait();
}

void DeviceSource::PlanChunks(std::span<const uint64_t> bounds) {
  if (submitted_ == 0) bounds_.assign(bounds.begin(), bounds.end());
}

uint64_t DeviceSource::NextPieceEnd() const {
  const uint64_t limit = std::min<uint64_t>(size_, submitted_ + pool_.buffer_bytes());
  // As many whole chunks as fit; part of one when a chunk is bigger than a buffer.
  auto it = std::upper_bound(bounds_.begin(), bounds_.end(), limit);
  if (it != bounds_.begin() && *std::prev(it) > submitted_) return *std::prev(it);
  return limit;
}

Status DeviceSource::Prime() {
  while (submitted_ < size_) {
    PinnedPool::Lease lease = inflight_.empty() ? pool_.Acquire() : pool_.TryAcquire();
    if (!lease.valid()) break;
    const uint64_t end = NextPieceEnd();
    CKPT_ASSIGN_OR_RETURN(uint64_t ticket,
                     engine_.DeviceToHost(lease.buffer().data(), device_ + submitted_, end - submitted_));
    inflight_.push_back(std::make_shared<Piece>(std::move(lease), submitted_, end - submitted_, ticket, &outstanding_));
    submitted_ = end;
  }
  if (inflight_.empty()) return Status::Internal("read past the end of a staged device source");
  return Status::OK();
}

Result<DeviceSource::Piece*> DeviceSource::Front(uint64_t offset) {
  if (offset != consumed_) return Status::Internal("staged device sources are read in order");
  CKPT_RETURN_IF_ERROR(Prime());
  Piece& p = *inflight_.front();
  if (!p.waited) {
    CKPT_RETURN_IF_ERROR(engine_.Wait(p.ticket).WithContext("copying from the device"));
    p.waited = true;
  }
  return &p;
}

Result<BorrowedBytes> DeviceSource::Borrow(uint64_t offset, uint64_t n) {
  if (n == 0) return BorrowedBytes{};
  CKPT_ASSIGN_OR_RETURN(Piece * p, Front(offset));
  if (offset + n > p->offset + p->length) return BorrowedBytes{};  // spans buffers: Read copies it
  BorrowedBytes out;
  out.bytes = {p->lease.buffer().data() + (offset - p->offset), n};
  out.keep = inflight_.front();
  out.stable = true;  // the staging buffer is this source's own copy
  consumed_ += n;
  lent_ += n;
  if (consumed_ == p->offset + p->length) inflight_.pop_front();  // the writer's jobs hold it now
  return out;
}

Status DeviceSource::Read(uint64_t offset, std::span<std::byte> dst) {
  size_t copied = 0;
  while (copied < dst.size()) {
    CKPT_ASSIGN_OR_RETURN(Piece * p, Front(offset + copied));
    const uint64_t pos = offset + copied;
    const uint64_t n = std::min<uint64_t>(dst.size() - copied, p->offset + p->length - pos);
    std::memcpy(dst.data() + copied, p->lease.buffer().data() + (pos - p->offset), n);
    copied += n;
    consumed_ += n;
    if (consumed_ == p->offset + p->length) inflight_.pop_front();  // the buffer goes back to the pool
  }
  return Status::OK();
}

Status PutShardFromDevice(CheckpointWriter& writer, const DeviceShard& shard, CopyEngine& engine, PinnedPool& pool) {
  const uint64_t bytes = shard.region.NumElements() * DTypeSize(shard.tensor.dtype);
  DeviceSource source(engine, pool, shard.device, bytes);
  return writer.PutShard(shard.tensor, shard.region, source);
}

Result<CommitResult> SaveStreaming(Repository& repo, const std::string& name, const WriterOptions& options,
                                   const std::vector<DeviceShard>& shards, CopyEngine& engine, PinnedPool& pool) {
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointWriter> writer, repo.BeginCheckpoint(name, options));
  for (const auto& shard : shards) {
    CKPT_RETURN_IF_ERROR(PutShardFromDevice(*writer, shard, engine, pool));  // the writer aborts when dropped
  }
  return writer->Commit().Wait();
}

// ---- snapshot save -----------------------------------------------------------------

SnapshotBuffer::~SnapshotBuffer() {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return !busy_; });
  if (data_) engine_.FreePinned(data_);
}

uint64_t SnapshotBuffer::capacity() const {
  std::lock_guard lock(mu_);
  return capacity_;
}

Status SnapshotBuffer::GrowLocked(std::unique_lock<std::mutex>& lock, uint64_t bytes) {
  cv_.wait(lock, [&] { return !busy_; });
  if (bytes <= capacity_) return Status::OK();
  if (data_) engine_.FreePinned(data_);
  data_ = nullptr;
  capacity_ = 0;
  CKPT_ASSIGN_OR_RETURN(data_, engine_.AllocatePinned(bytes));
  capacity_ = bytes;
  return Status::OK();
}

Status SnapshotBuffer::Reserve(uint64_t bytes) {
  std::unique_lock lock(mu_);
  return GrowLocked(lock, bytes);
}

// Holds a SnapshotBuffer for one snapshot, from its copies until it is durable.
class SnapshotBufferUse {
 public:
  // Waits for the previous snapshot, grows the buffer if needed, takes it.
  static Result<std::shared_ptr<SnapshotBufferUse>> Acquire(SnapshotBuffer& b, uint64_t bytes) {
    std::unique_lock lock(b.mu_);
    CKPT_RETURN_IF_ERROR(b.GrowLocked(lock, bytes));
    b.busy_ = true;
    return std::make_shared<SnapshotBufferUse>(b);
  }
  explicit SnapshotBufferUse(SnapshotBuffer& b) : b_(b) {}
  ~SnapshotBufferUse() {
    // Notified under the lock: the buffer's destructor may be waiting, and
    // must not destroy the condition variable before this is done with it.
    std::lock_guard lock(b_.mu_);
    b_.busy_ = false;
    b_.cv_.notify_all();
  }
  std::byte* data() const { return b_.data_; }

 private:
  SnapshotBuffer& b_;
};

struct SnapshotHandle::State {
  struct Counters {
    std::atomic<int64_t> total_ns{0};
    std::atomic<bool> durable{false};
  };
  std::shared_future<Result<CommitResult>> result;
  std::shared_ptr<Counters> counters = std::make_shared<Counters>();
};

Result<CommitResult> SnapshotHandle::Wait() {
  if (!state_) return Status::FailedPrecondition("empty snapshot handle");
  return state_->result.get();
}

std::chrono::nanoseconds SnapshotHandle::total_time() const {
  return std::chrono::nanoseconds(state_ ? state_->counters->total_ns.load() : 0);
}

bool SnapshotHandle::durable() const { return state_ && state_->counters->durable.load(); }

Result<SnapshotHandle> SaveSnapshot(Repository& repo, const std::string& name, const WriterOptions& options,
                                    const std::vector<DeviceShard>& shards, CopyEngine& engine,
                                    SnapshotBuffer& buffer) {
  const auto start = std::chrono::steady_clock::now();
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointWriter> writer, repo.BeginCheckpoint(name, options));
  return SnapshotAndCommit(std::move(writer), shards, engine, buffer, start);
}

Result<SnapshotHandle> SnapshotAndCommit(std::unique_ptr<CheckpointWriter> writer,
                                         const std::vector<DeviceShard>& shards, CopyEngine& engine,
                                         SnapshotBuffer& buffer, std::chrono::steady_clock::time_point start) {
  // Shards lie back to back in the buffer, each 256-byte aligned.
  std::vector<uint64_t> offsets, sizes;
  uint64_t total = 0;
  for (const auto& s : shards) {
    CKPT_RETURN_IF_ERROR(ValidateRegion(s.tensor.shape, s.region).WithContext("tensor '" + s.tensor.name + "'"));
    const uint64_t n = Normalize(s.tensor.shape, s.region).NumElements() * DTypeSize(s.tensor.dtype);
    offsets.push_back(total);
    sizes.push_back(n);
    total += (n + 255) / 256 * 256;
  }
  CKPT_ASSIGN_OR_RETURN(std::shared_ptr<SnapshotBufferUse> use, SnapshotBufferUse::Acquire(buffer, std::max<uint64_t>(total, 1)));
  // Every copy is queued at once so the transfers run back to back.
  uint64_t last = 0;
  Status copied;
  for (size_t i = 0; i < shards.size() && copied.ok(); ++i) {
    if (sizes[i] == 0) continue;
    auto t = engine.DeviceToHost(use->data() + offsets[i], shards[i].device, sizes[i]);
    if (t.ok()) {
      last = *t;
    } else {
      copied = t.status();
    }
  }
  // Even after an error, the copies queued before it finish before the
  // buffer is given back.
  if (last) {
    Status waited = engine.Wait(last);
    if (copied.ok()) copied = waited;
  }
  CKPT_RETURN_IF_ERROR(copied.WithContext("snapshot copy from the device"));
  SnapshotHandle handle;
  handle.blocking_ = std::chrono::steady_clock::now() - start;
  handle.state_ = std::make_shared<SnapshotHandle::State>();
  std::shared_ptr<CheckpointWriter> w(std::move(writer));
  // The task holds only the counters, never the state that holds its own
  // future (that would be a cycle), and releases the writer and the buffer
  // when done.
  handle.state_->result =
      std::async(std::launch::async, [w, use, shards, offsets, sizes, counters = handle.state_->counters,
                                      start]() mutable -> Result<CommitResult> {
        Status st;
        for (size_t i = 0; i < shards.size() && st.ok(); ++i) {
          HostSource source({use->data() + offsets[i], sizes[i]});
          st = w->PutShard(shards[i].tensor, shards[i].region, source);
        }
        Result<CommitResult> r = st.ok() ? w->Commit().Wait() : Result<CommitResult>(st);
        if (!st.ok()) w->Abort();
        w.reset();
        counters->total_ns = (std::chrono::steady_clock::now() - start).count();
        counters->durable = r.ok();
        use.reset();  // the next snapshot may use the buffer now
        return r;
      }).share();
  return handle;
}

// ---- load ------------------------------------------------------------------------

namespace {

// Splits `box` into sub-boxes of at most `max_bytes` whose destinations in
// the row-major image of `box` are contiguous: ranges along the first
// dimension longer than 1, recursing into single slices that are still too
// big. Calls fn(sub_box, byte offset in the image).
void SplitBox(const Box& whole, const Box& box, uint64_t w, uint64_t max_bytes,
              const std::function<void(const Box&, uint64_t)>& fn) {
  auto offset_in_whole = [&](const Box& b) {
    uint64_t idx = 0;
    for (size_t d = 0; d < whole.rank(); ++d) idx = idx * whole.lengths[d] + (b.offsets[d] - whole.offsets[d]);
    return idx * w;
  };
  if (box.NumElements() * w <= max_bytes) {
    fn(box, offset_in_whole(box));
    return;
  }
  size_t d = 0;
  while (d < box.rank() && box.lengths[d] == 1) ++d;
  uint64_t inner = w;
  for (size_t e = d + 1; e < box.rank(); ++e) inner *= box.lengths[e];
  const uint64_t step = std::max<uint64_t>(1, max_bytes / inner);
  for (uint64_t i = 0; i < box.lengths[d]; i += step) {
    Box sub = box;
    sub.offsets[d] = box.offsets[d] + i;
    sub.lengths[d] = std::min(step, box.lengths[d] - i);
    if (sub.NumElements() * w <= max_bytes || step > 1) {
      fn(sub, offset_in_whole(sub));
    } else {
      SplitBox(whole, sub, w, max_bytes, fn);
    }
  }
}

}  // namespace

Status LoadToDevice(const CheckpointReader& reader, const TensorRecord& tensor, const Region& region_in,
                    std::byte* device, CopyEngine& engine, PinnedPool& pool) {
  CKPT_RETURN_IF_ERROR(ValidateRegion(tensor.shape, region_in));
  const Region region = Normalize(tensor.shape, region_in);
  const uint64_t w = DTypeSize(tensor.dtype);
  const uint64_t max_bytes = pool.buffer_bytes() / w * w;
  if (max_bytes == 0) return Status::InvalidArgument("staging buffers are smaller than one element");
  struct InFlight {
    PinnedPool::Lease lease;
    uint64_t ticket;
  };
  std::deque<InFlight> inflight;
  Status st;
  // Reads one piece into a pinned buffer, then queues its copy to the device;
  // the next piece is read while that copy runs.
  auto piece = [&](uint64_t dst_offset, uint64_t bytes, const std::function<Status(std::span<std::byte>)>& fill) {
    if (!st.ok()) return;
    if (inflight.size() == pool.count()) {
      st = engine.Wait(inflight.front().ticket);
      inflight.pop_front();
      if (!st.ok()) return;
    }
    PinnedPool::Lease lease = pool.Acquire();
    std::span<std::byte> buf = lease.buffer().first(bytes);
    st = fill(buf);
    if (!st.ok()) return;
    auto t = engine.HostToDevice(device + dst_offset, buf.data(), bytes);
    if (!t.ok()) {
      st = t.status();
      return;
    }
    inflight.push_back({std::move(lease), *t});
  };
  if (region.kind == Region::Kind::kFlat) {
    const uint64_t begin = region.flat.start * w, end = region.flat.end * w;
    for (uint64_t off = begin; off < end && st.ok(); off += max_bytes) {
      const uint64_t n = std::min(max_bytes, end - off);
      piece(off - begin, n, [&](std::span<std::byte> buf) { return reader.ReadBytes(tensor, off, buf); });
    }
  } else if (!region.box.Empty()) {
    SplitBox(region.box, region.box, w, max_bytes, [&](const Box& sub, uint64_t dst_offset) {
      piece(dst_offset, sub.NumElements() * w, [&](std::span<std::byte> buf) { return reader.ReadBox(tensor, sub, buf); });
    });
  }
  while (!inflight.empty()) {
    Status wst = engine.Wait(inflight.front().ticket);
    if (st.ok()) st = wst;
    inflight.pop_front();
  }
  return st.WithContext("loading '" + tensor.name + "' to the device");
}

}  // namespace ckptfs::gpu
