#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include "ckpt/repository.h"
#include "ckpt/repository_impl.h"

namespace ckptfs {

// Decoded chunks a reader holds for a collective load (HoldChunk,
// LendChunk): its reads take them from here before the cache and the store,
// and no cache eviction can make a read fetch them again.
class HeldChunks : public ChunkFetcher {
 public:
  explicit HeldChunks(ChunkFetcher* next) : next_(next) {}
  bool empty() const { return empty_.load(std::memory_order_acquire); }
  void Hold(const ChunkRef& chunk, ChunkData data) {
    std::lock_guard lock(mu_);
    held_.insert_or_assign(chunk.id, std::move(data));
    empty_.store(false, std::memory_order_release);
  }
  void Release(std::span<const ChunkRef> chunks) {
    std::lock_guard lock(mu_);
    for (const ChunkRef& c : chunks) held_.erase(c.id);
    if (held_.empty()) empty_.store(true, std::memory_order_release);
  }
  ChunkData Find(const ChunkId& id) const {
    std::lock_guard lock(mu_);
    auto it = held_.find(id);
    return it == held_.end() ? nullptr : it->second;
  }
  Result<ChunkData> Fetch(const ChunkRef& chunk) override {
    if (ChunkData data = Find(chunk.id)) return data;
    return next_->Fetch(chunk);
  }
  Status FetchInto(const ChunkRef& chunk, std::span<std::byte> dst) override {
    ChunkData data = Find(chunk.id);
    if (!data) return next_->FetchInto(chunk, dst);
    if (data->size() != dst.size()) return Status::Internal("held chunk size does not match its destination");
    std::memcpy(dst.data(), data->data(), dst.size());
    return Status::OK();
  }
  void Consumed(const ChunkRef& chunk, uint64_t bytes) override { next_->Consumed(chunk, bytes); }

 private:
  ChunkFetcher* next_;
  std::atomic<bool> empty_{true};
  mutable std::mutex mu_;
  std::unordered_map<ChunkId, ChunkData, ChunkIdHash> held_;
};

// Chunks from the nearest tier that has them (ReadOptions::nearer): each
// nearer repository whose catalog knows the chunk is asked first, in
// order, and the reader's own repository last. A chunk a nearer tier
// fails to give (its bytes do not match the id, its pack is gone or
// unreadable) is taken from the next tier: every fetcher checks what it
// decodes against the chunk's id. Each repository counts what it read.
class NearestTier : public ChunkFetcher {
 public:
  NearestTier(std::vector<std::shared_ptr<RepositoryImpl>> nearer, ChunkFetcher* last)
      : nearer_(std::move(nearer)), last_(last) {}
  Result<ChunkData> Fetch(const ChunkRef& chunk) override {
    for (const auto& tier : nearer_) {
      if (!tier->LookupChunk(chunk.id).ok()) continue;
      auto data = tier->fetcher()->Fetch(chunk);
      if (data.ok()) return data;
    }
    return last_->Fetch(chunk);
  }
  Status FetchInto(const ChunkRef& chunk, std::span<std::byte> dst) override {
    for (const auto& tier : nearer_) {
      if (!tier->LookupChunk(chunk.id).ok()) continue;
      if (tier->fetcher()->FetchInto(chunk, dst).ok()) return Status::OK();
    }
    return last_->FetchInto(chunk, dst);
  }
  void Consumed(const ChunkRef& chunk, uint64_t bytes) override {
    for (const auto& tier : nearer_) tier->fetcher()->Consumed(chunk, bytes);
    last_->Consumed(chunk, bytes);
  }

 private:
  std::vector<std::shared_ptr<RepositoryImpl>> nearer_;  // kept alive while the reader lives
  ChunkFetcher* last_;
};

// Reads of a tensor stored in at least this many shards find the shards a
// region meets through the tensor's ShardIndex; fewer are scanned.
constexpr size_t kIndexedShards = 16;

class ReaderImpl {
 public:
  std::shared_ptr<RepositoryImpl> repo;  // a reader may outlive its Repository
  Manifest manifest;  // tensors and blobs sorted by name (catalog key order)
  std::unique_ptr<HeldChunks> held;  // set when the reader opens
  std::shared_ptr<ChunkFetcher> tiers;  // set when the reader reads nearer tiers first
  // Where chunks come from: the nearer tiers, then the repository.
  ChunkFetcher* source() const { return tiers ? tiers.get() : repo->fetcher(); }
  // What reads go through: the held chunks when there are any.
  ChunkFetcher* fetcher() const { return held->empty() ? source() : held.get(); }
  // The ShardIndex of one of this checkpoint's tensors with many shards,
  // built at its first read (by one thread; the others wait for it), or
  // null: few shards, or a record that is not this reader's (a caller's
  // copy), whose shards are then scanned. A tensor saved by 512 ranks in
  // row shards would otherwise have all 512 looked at for every read of
  // it, and the mount reads in requests of 128 KiB.
  const ShardIndex* IndexOf(const TensorRecord& tensor) {
    const std::vector<TensorRecord>& all = manifest.tensors;
    std::less<const TensorRecord*> before;
    if (tensor.shards.size() < kIndexedShards || all.empty() || before(&tensor, all.data()) ||
        !before(&tensor, all.data() + all.size())) {
      return nullptr;
    }
    std::call_once(slots_made_, [&] { slots_ = std::make_unique<IndexSlot[]>(all.size()); });
    IndexSlot& slot = slots_[static_cast<size_t>(&tensor - all.data())];
    std::call_once(slot.built, [&] { slot.index = std::make_unique<ShardIndex>(tensor); });
    return slot.index.get();
  }
  CheckpointLease lease;  // declared last: released before the rest goes

 private:
  struct IndexSlot {
    std::once_flag built;
    std::unique_ptr<ShardIndex> index;
  };
  std::once_flag slots_made_;
  std::unique_ptr<IndexSlot[]> slots_;  // one a tensor, made at the first indexed read
};

namespace {
// The record named `name` in `list` (sorted by name), or null: a binary
// search, so a checkpoint of millions of tensors needs no index beside it.
template <typename Record>
const Record* FindByName(const std::vector<Record>& list, std::string_view name) {
  auto it = std::lower_bound(list.begin(), list.end(), name,
                             [](const Record& r, std::string_view n) { return std::string_view(r.name) < n; });
  return it != list.end() && it->name == name ? &*it : nullptr;
}
}  // namespace

CheckpointReader::CheckpointReader(std::unique_ptr<ReaderImpl> impl) : impl_(std::move(impl)) {}
CheckpointReader::~CheckpointReader() {
  // In a forked child, the last reader must not close its parent's
  // repository (core/fork.h).
  if (impl_->repo->Forked()) new std::shared_ptr<RepositoryImpl>(std::move(impl_->repo));
}

const CheckpointRecord& CheckpointReader::info() const { return impl_->manifest.checkpoint; }
const std::vector<TensorRecord>& CheckpointReader::tensors() const { return impl_->manifest.tensors; }
const std::vector<BlobRecord>& CheckpointReader::blobs() const { return impl_->manifest.blobs; }

uint64_t CheckpointReader::chunk_size() const { return impl_->repo->config.chunk_size; }

const TensorRecord* CheckpointReader::FindTensor(std::string_view name) const {
  return FindByName(impl_->manifest.tensors, name);
}

const BlobRecord* CheckpointReader::FindBlob(std::string_view name) const {
  return FindByName(impl_->manifest.blobs, name);
}

Result<const TensorRecord*> CheckpointReader::GetTensor(std::string_view name) const {
  const TensorRecord* t = FindTensor(name);
  if (!t) return Status::NotFound("checkpoint '" + info().name + "' has no tensor '" + std::string(name) + "'");
  return t;
}

Result<const BlobRecord*> CheckpointReader::GetBlob(std::string_view name) const {
  const BlobRecord* b = FindBlob(name);
  if (!b) return Status::NotFound("checkpoint '" + info().name + "' has no blob '" + std::string(name) + "'");
  return b;
}

Result<const TensorRecord*> CheckpointReader::FindTarget(std::string_view name, DType dtype,
                                                         const Shape& shape) const {
  CKPT_ASSIGN_OR_RETURN(const TensorRecord* t, GetTensor(name));
  if (t->dtype != dtype) {
    return Status::InvalidArgument("tensor '" + t->name + "' of checkpoint '" + info().name + "' is " +
                                   std::string(DTypeName(t->dtype)) + ", the target is " +
                                   std::string(DTypeName(dtype)));
  }
  if (t->shape != shape) {
    return Status::InvalidArgument("tensor '" + t->name + "' of checkpoint '" + info().name + "' has shape " +
                                   ShapeToString(t->shape) + ", the target expects " + ShapeToString(shape));
  }
  return t;
}

Status CheckpointReader::ReadRegion(const TensorRecord& tensor, const Region& region, std::span<std::byte> dst) const {
  CKPT_RETURN_IF_ERROR(impl_->repo->CheckProcess());
  CKPT_RETURN_IF_ERROR(ValidateRegion(tensor.shape, region).WithContext("tensor '" + tensor.name + "'"));
  if (dst.size() != region.NumElements() * DTypeSize(tensor.dtype)) {
    return Status::InvalidArgument("tensor '" + tensor.name + "': the destination holds " +
                                   std::to_string(dst.size()) + " bytes, region " + region.ToString() + " is " +
                                   std::to_string(region.NumElements() * DTypeSize(tensor.dtype)));
  }
  if (region.kind == Region::Kind::kFlat) return ReadFlat(tensor, region.flat, dst);
  return ReadBox(tensor, region.box, dst);
}

Status CheckpointReader::ReadBox(const TensorRecord& tensor, const Box& box, std::span<std::byte> dst) const {
  CKPT_RETURN_IF_ERROR(impl_->repo->CheckProcess());
  // A box that is contiguous in row-major order (a whole tensor, whole rows)
  // is one byte range: read it as such, without the box walk.
  if (box.rank() == tensor.shape.size() && ValidateRegion(tensor.shape, Region::OfBox(box)).ok()) {
    const Region normal = Normalize(tensor.shape, Region::OfBox(box));
    if (normal.kind == Region::Kind::kFlat) return ReadFlat(tensor, normal.flat, dst);
  }
  return ReadTensorBox(tensor, box, dst, *impl_->fetcher(), impl_->repo->pool.get(), impl_->IndexOf(tensor));
}

Status CheckpointReader::ReadFlat(const TensorRecord& tensor, FlatRange range, std::span<std::byte> dst) const {
  CKPT_RETURN_IF_ERROR(impl_->repo->CheckProcess());
  const uint64_t w = DTypeSize(tensor.dtype);
  if (range.end < range.start || range.end > NumElements(tensor.shape)) {
    return Status::InvalidArgument("flat range does not fit tensor '" + tensor.name + "'");
  }
  if (dst.size() != range.size() * w) return Status::InvalidArgument("destination size does not match the range");
  return ReadBytes(tensor, range.start * w, dst);
}

Status CheckpointReader::ReadBytes(const TensorRecord& tensor, uint64_t offset, std::span<std::byte> dst) const {
  CKPT_RETURN_IF_ERROR(impl_->repo->CheckProcess());
  return ReadTensorBytes(tensor, offset, dst, *impl_->fetcher(), impl_->repo->pool.get(), impl_->IndexOf(tensor));
}

Status CheckpointReader::ReadBlob(const BlobRecord& blob, uint64_t offset, std::span<std::byte> dst) const {
  CKPT_RETURN_IF_ERROR(impl_->repo->CheckProcess());
  return ReadBlobBytes(blob, offset, dst, *impl_->fetcher(), impl_->repo->pool.get());
}

Status CheckpointReader::HoldChunk(const ChunkRef& chunk) const {
  CKPT_RETURN_IF_ERROR(impl_->repo->CheckProcess());
  HeldChunks& held = *impl_->held;
  if (held.Find(chunk.id)) return Status::OK();
  CKPT_ASSIGN_OR_RETURN(ChunkData data, impl_->source()->Fetch(chunk));
  held.Hold(chunk, std::move(data));
  return Status::OK();
}

Status CheckpointReader::CopyHeldChunk(const ChunkRef& chunk, std::span<std::byte> dst) const {
  ChunkData data = impl_->held->Find(chunk.id);
  if (!data) return Status::FailedPrecondition("chunk " + chunk.id.ToHex() + " is not held");
  if (data->size() != dst.size()) {
    return Status::InvalidArgument("chunk " + chunk.id.ToHex() + " is " + std::to_string(data->size()) +
                                   " bytes, the buffer " + std::to_string(dst.size()));
  }
  std::memcpy(dst.data(), data->data(), dst.size());
  return Status::OK();
}

void CheckpointReader::ReleaseChunks(std::span<const ChunkRef> chunks) const {
  impl_->held->Release(chunks);
}

Status CheckpointReader::LendChunk(const ChunkRef& chunk, std::span<const std::byte> data) const {
  if (data.size() != chunk.raw_len || ChunkId::Of(data) != chunk.id) {
    return Status::Corruption("chunk " + chunk.id.ToHex() + " handed over by another rank does not match its id (" +
                              std::to_string(data.size()) + " bytes)");
  }
  auto buffer = std::make_shared<ChunkBuffer>(data.size());
  if (!data.empty()) std::memcpy(buffer->data(), data.data(), data.size());
  impl_->held->Hold(chunk, std::move(buffer));
  return Status::OK();
}

void CheckpointReader::Prefetch(const TensorRecord& tensor, uint64_t offset, uint64_t length) const {
  if (impl_->repo->Forked()) return;
  auto chunks = ChunksForBytes(tensor, offset, length, impl_->IndexOf(tensor));
  if (!chunks.ok()) return;
  RepositoryImpl* repo = impl_->repo.get();
  for (const ChunkRef& c : *chunks) {
    if (repo->cache->Contains(c.id)) continue;
    // Errors surface to the reader that needs the chunk; a prefetch only warms.
    if (impl_->tiers) {
      repo->pool->Submit([tiers = impl_->tiers, c] { (void)tiers->Fetch(c); });
    } else {
      repo->pool->Submit([repo, c] { (void)repo->fetcher()->Fetch(c); });
    }
  }
}

size_t CheckpointReader::ChunksCached(const TensorRecord& tensor, uint64_t offset, uint64_t length) const {
  if (impl_->repo->Forked()) return 0;
  auto chunks = ChunksForBytes(tensor, offset, length, impl_->IndexOf(tensor));
  if (!chunks.ok()) return 0;
  return static_cast<size_t>(std::count_if(chunks->begin(), chunks->end(),
                                           [&](const ChunkRef& c) { return impl_->repo->cache->Contains(c.id); }));
}

Result<bool> CheckpointReader::SliceBytes(const TensorRecord& tensor, uint64_t offset, uint64_t length,
                                          size_t max_slices, std::vector<ChunkSlice>& out) const {
  CKPT_RETURN_IF_ERROR(impl_->repo->CheckProcess());
  return SliceTensorBytes(tensor, offset, length, *impl_->fetcher(), max_slices, out, impl_->IndexOf(tensor));
}

void CheckpointReader::Consumed(std::span<const ChunkSlice> slices) const {
  if (impl_->repo->Forked()) return;
  for (const ChunkSlice& s : slices) impl_->fetcher()->Consumed(s.chunk, s.length);
}

void CheckpointReader::DropCached(std::span<const ChunkRef> chunks) const {
  if (impl_->repo->Forked()) return;
  for (const ChunkRef& c : chunks) impl_->repo->cache->Drop(c.id);
}

std::unique_ptr<CheckpointReader> CheckpointReader::Subset(
    std::string_view prefix, const std::function<bool(const BlobRecord&)>& keep_blob) const {
  auto impl = std::make_unique<ReaderImpl>();
  impl->repo = impl_->repo;
  impl->tiers = impl_->tiers;
  impl->held = std::make_unique<HeldChunks>(impl->source());
  Manifest& m = impl->manifest;
  m.checkpoint = impl_->manifest.checkpoint;
  m.checkpoint.logical_bytes = 0;
  // Names that share the prefix keep their order without it.
  for (const auto& t : impl_->manifest.tensors) {
    if (t.name.size() <= prefix.size() || !std::string_view(t.name).starts_with(prefix)) continue;
    m.tensors.push_back(t);
    m.tensors.back().name.erase(0, prefix.size());
    m.checkpoint.logical_bytes += t.ByteSize();
  }
  for (const auto& b : impl_->manifest.blobs) {
    if (!keep_blob(b)) continue;
    m.blobs.push_back(b);
    m.checkpoint.logical_bytes += b.size;
  }
  m.checkpoint.tensor_count = m.tensors.size();
  return std::unique_ptr<CheckpointReader>(new CheckpointReader(std::move(impl)));
}

Result<StoredSizes> CheckpointReader::StoredBytes() const {
  CKPT_RETURN_IF_ERROR(impl_->repo->CheckProcess());
  // One catalog lookup per distinct chunk.
  std::unordered_map<ChunkId, uint64_t, ChunkIdHash> sizes;
  auto collect = [&](const std::vector<ChunkRef>& chunks) {
    for (const auto& c : chunks) sizes.emplace(c.id, 0);
  };
  for (const auto& t : tensors()) {
    for (const auto& s : t.shards) collect(s.chunks);
  }
  for (const auto& b : blobs()) collect(b.chunks);
  StoredSizes out;
  CKPT_RETURN_IF_ERROR(impl_->repo->catalog->Read([&](const ReadTxn& txn) -> Status {
    for (auto& [id, size] : sizes) {
      CKPT_ASSIGN_OR_RETURN(auto v, txn.Get(Table::kChunks, keys::Chunk(id)));
      if (!v) continue;  // verify reports missing chunks
      CKPT_ASSIGN_OR_RETURN(ChunkLocation loc, DecodeChunkLocation(*v));
      size = loc.stored_len;
      out.total += size;
    }
    return Status::OK();
  }));
  auto sum = [&](const std::vector<ChunkRef>& chunks, std::unordered_set<ChunkId, ChunkIdHash>& seen) {
    uint64_t n = 0;
    for (const auto& c : chunks) {
      if (seen.insert(c.id).second) n += sizes[c.id];
    }
    return n;
  };
  for (const auto& t : tensors()) {
    std::unordered_set<ChunkId, ChunkIdHash> seen;
    uint64_t n = 0;
    for (const auto& s : t.shards) n += sum(s.chunks, seen);
    out.tensors.push_back(n);
  }
  for (const auto& b : blobs()) {
    std::unordered_set<ChunkId, ChunkIdHash> seen;
    out.blobs.push_back(sum(b.chunks, seen));
  }
  return out;
}

namespace {
// The record of `name` when it is committed; NotFound (saying how far a
// pending one got) otherwise.
Result<CheckpointRecord> CommittedRecord(const ReadTxn& txn, const std::string& name) {
  if (keys::IsRetiredCheckpoint(name)) return Status::NotFound("no checkpoint named '" + name + "'");
  CKPT_ASSIGN_OR_RETURN(auto raw, txn.Get(Table::kCheckpoints, keys::Checkpoint(name)));
  if (!raw) return Status::NotFound("no checkpoint named '" + name + "'");
  CKPT_ASSIGN_OR_RETURN(CheckpointRecord rec, DecodeCheckpoint(*raw));
  if (rec.state != CheckpointState::kCommitted) {
    return Status::NotFound("checkpoint '" + name + "' is not committed (" + std::to_string(rec.committed_ranks.size()) +
                            " of " + std::to_string(rec.world_size) + " ranks have committed)");
  }
  return rec;
}
}  // namespace

Result<CheckpointRecord> Repository::GetCheckpoint(const std::string& name) {
  CKPT_RETURN_IF_ERROR(impl_->CheckProcess());
  CheckpointRecord rec;
  CKPT_RETURN_IF_ERROR(impl_->catalog->Read([&](const ReadTxn& txn) -> Status {
    CKPT_ASSIGN_OR_RETURN(rec, CommittedRecord(txn, name));
    return Status::OK();
  }));
  return rec;
}

Result<Manifest> LoadManifest(const ReadTxn& txn, const std::string& catalog_name) {
  Manifest m;
  if (keys::IsRetiredCheckpoint(catalog_name)) {
    CKPT_ASSIGN_OR_RETURN(auto raw, txn.Get(Table::kCheckpoints, keys::Checkpoint(catalog_name)));
    if (!raw) return Status::NotFound("no removed checkpoint '" + catalog_name + "' is kept");
    CKPT_ASSIGN_OR_RETURN(m.checkpoint, DecodeCheckpoint(*raw));
  } else {
    CKPT_ASSIGN_OR_RETURN(m.checkpoint, CommittedRecord(txn, catalog_name));
  }
  const std::string prefix = keys::MemberPrefix(catalog_name);
  Status st = ScanDecoded<TensorRecord>(txn, Table::kTensors, prefix, DecodeTensor, [&](std::string_view, TensorRecord&& t) {
    m.tensors.push_back(std::move(t));
    return true;
  });
  if (st.ok()) {
    st = ScanDecoded<BlobRecord>(txn, Table::kBlobs, prefix, DecodeBlob, [&](std::string_view, BlobRecord&& b) {
      m.blobs.push_back(std::move(b));
      return true;
    });
  }
  if (!st.ok()) return st.WithContext("checkpoint '" + m.checkpoint.name + "'");
  // The catalog's keys hold the names after a common prefix, so a scan
  // yields them in byte order already; sorted again only if not (cheap).
  auto by_name = [](const auto& a, const auto& b) { return a.name < b.name; };
  if (!std::is_sorted(m.tensors.begin(), m.tensors.end(), by_name)) std::sort(m.tensors.begin(), m.tensors.end(), by_name);
  if (!std::is_sorted(m.blobs.begin(), m.blobs.end(), by_name)) std::sort(m.blobs.begin(), m.blobs.end(), by_name);
  return m;
}

Result<std::unique_ptr<CheckpointReader>> Repository::OpenCheckpoint(const std::string& name, const ReadOptions& options) {
  CKPT_RETURN_IF_ERROR(impl_->CheckProcess());
  // On an object store: the chunks of checkpoints other hosts saved may be
  // in packs whose indexes this host has not read yet.
  CKPT_RETURN_IF_ERROR(impl_->protocol->IndexPacks());
  auto impl = std::make_unique<ReaderImpl>();
  impl->repo = impl_;
  if (!options.nearer.empty()) {
    std::vector<std::shared_ptr<RepositoryImpl>> nearer;
    for (const Repository* tier : options.nearer) {
      if (tier == nullptr || tier->impl_ == impl_) return Status::InvalidArgument("a nearer tier must be another repository");
      CKPT_RETURN_IF_ERROR(tier->impl_->CheckProcess());
      nearer.push_back(tier->impl_);
    }
    impl->tiers = std::make_shared<NearestTier>(std::move(nearer), impl_->fetcher());
  }
  impl->held = std::make_unique<HeldChunks>(impl->source());
  // The lease comes first: what the catalog says afterwards stays readable
  // (a local gc collects a name only while holding its lease file).
  bool first = false;
  if (options.lease) {
    // No checkpoint has a name that is not one (nor a lease file).
    if (!ValidateCheckpointName(name).ok()) return Status::NotFound("no checkpoint named '" + name + "'");
    CKPT_RETURN_IF_ERROR(impl_->leases->Acquire(name, &first));
    impl->lease = CheckpointLease(impl_, name);
  }
  auto load = [&] {
    return impl_->catalog->Read([&](const ReadTxn& txn) -> Status {
      CKPT_ASSIGN_OR_RETURN(impl->manifest, LoadManifest(txn, name));
      return Status::OK();
    });
  };
  Status st = load();
  // A reader reads the checkpoint the store holds under the name now, never
  // one another host removed (or replaced by a new save of the name) since
  // this host's last sync, and finds one saved there since: on an object
  // store one request tells, and a stale catalog catches up before the
  // record is read again. Retired names are no checkpoint's.
  if ((st.ok() || st.IsNotFound()) && !keys::IsRetiredCheckpoint(name) && ValidateCheckpointName(name).ok()) {
    auto current = impl_->protocol->IsCurrent(name, st.ok() ? &impl->manifest.checkpoint : nullptr);
    if (!current.ok()) {
      st = current.status();
    } else if (!*current) {
      st = impl_->protocol->Sync().status();
      if (st.ok()) st = impl_->protocol->IndexPacks();
      if (st.ok()) st = load();
    }
  }
  if (st.ok() && options.lease) st = impl_->protocol->CheckLeased(impl->manifest.checkpoint, first, /*read_under_lease=*/true);
  if (!st.ok()) {
    impl->lease.Release(/*linger=*/false);  // held for nothing
    return st;
  }
  Manifest& m = impl->manifest;
  m.tensors.shrink_to_fit();  // a reader of millions of tensors keeps no spare capacity
  m.blobs.shrink_to_fit();
  return std::unique_ptr<CheckpointReader>(new CheckpointReader(std::move(impl)));
}

Result<CheckpointLease> Repository::LeaseCheckpoint(const CheckpointReader& reader) {
  CKPT_RETURN_IF_ERROR(impl_->CheckProcess());
  const CheckpointRecord& rec = reader.info();
  bool first = false;
  CKPT_RETURN_IF_ERROR(impl_->leases->Acquire(rec.name, &first));
  CheckpointLease lease(impl_, rec.name);
  Status st = impl_->protocol->CheckLeased(rec, first, /*read_under_lease=*/false);
  if (!st.ok()) {
    lease.Release(/*linger=*/false);
    return st;
  }
  return lease;
}


CheckpointLease::CheckpointLease(CheckpointLease&& other) noexcept
    : repo_(std::move(other.repo_)), name_(std::move(other.name_)) {}

CheckpointLease& CheckpointLease::operator=(CheckpointLease&& other) noexcept {
  if (this != &other) {
    Release();
    repo_ = std::move(other.repo_);
    name_ = std::move(other.name_);
  }
  return *this;
}

void CheckpointLease::Release(bool linger) {
  if (!repo_) return;
  // In a forked child the lease is the parent's (core/fork.h).
  if (repo_->Forked()) {
    new std::shared_ptr<RepositoryImpl>(std::move(repo_));
    return;
  }
  repo_->leases->Release(name_, linger);
  repo_.reset();
}

}  // namespace ckptfs
