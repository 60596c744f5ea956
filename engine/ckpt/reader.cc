#include <unordered_set>

#include "ckpt/repository.h"
#include "ckpt/repository_impl.h"

namespace ckptfs {

class ReaderImpl {
 public:
  RepositoryImpl* repo;
  Manifest manifest;
  std::unordered_map<std::string, size_t> tensor_index;
  std::unordered_map<std::string, size_t> blob_index;
};

CheckpointReader::CheckpointReader(std::unique_ptr<ReaderImpl> impl) : impl_(std::move(impl)) {}
CheckpointReader::~CheckpointReader() = default;

const CheckpointRecord& CheckpointReader::info() const { return impl_->manifest.checkpoint; }
const std::vector<TensorRecord>& CheckpointReader::tensors() const { return impl_->manifest.tensors; }
const std::vector<BlobRecord>& CheckpointReader::blobs() const { return impl_->manifest.blobs; }

const TensorRecord* CheckpointReader::FindTensor(std::string_view name) const {
  auto it = impl_->tensor_index.find(std::string(name));
  return it == impl_->tensor_index.end() ? nullptr : &impl_->manifest.tensors[it->second];
}

const BlobRecord* CheckpointReader::FindBlob(std::string_view name) const {
  auto it = impl_->blob_index.find(std::string(name));
  return it == impl_->blob_index.end() ? nullptr : &impl_->manifest.blobs[it->second];
}

Status CheckpointReader::ReadBox(const TensorRecord& tensor, const Box& box, std::span<std::byte> dst) const {
  return ReadTensorBox(tensor, box, dst, *impl_->repo->fetcher(), impl_->repo->pool.get());
}

Status CheckpointReader::ReadFlat(const TensorRecord& tensor, FlatRange range, std::span<std::byte> dst) const {
  const uint64_t w = DTypeSize(tensor.dtype);
  if (range.end < range.start || range.end > NumElements(tensor.shape)) {
    return Status::InvalidArgument("flat range does not fit tensor '" + tensor.name + "'");
  }
  if (dst.size() != range.size() * w) return Status::InvalidArgument("destination size does not match the range");
  return ReadBytes(tensor, range.start * w, dst);
}

Status CheckpointReader::ReadBytes(const TensorRecord& tensor, uint64_t offset, std::span<std::byte> dst) const {
  return ReadTensorBytes(tensor, offset, dst, *impl_->repo->fetcher(), impl_->repo->pool.get());
}

Status CheckpointReader::ReadBlob(const BlobRecord& blob, uint64_t offset, std::span<std::byte> dst) const {
  return ReadBlobBytes(blob, offset, dst, *impl_->repo->fetcher());
}

void CheckpointReader::Prefetch(const TensorRecord& tensor, uint64_t offset, uint64_t length) const {
  auto chunks = ChunksForBytes(tensor, offset, length);
  if (!chunks.ok()) return;
  RepositoryImpl* repo = impl_->repo;
  for (const ChunkRef& c : *chunks) {
    if (repo->cache->Contains(c.id)) continue;
    // Errors surface to the reader that needs the chunk; a prefetch only warms.
    repo->pool->Submit([repo, c] { (void)repo->fetcher()->Fetch(c); });
  }
}

Result<uint64_t> CheckpointReader::StoredBytes() const {
  std::unordered_set<ChunkId, ChunkIdHash> ids;
  for (const auto& t : tensors()) {
    for (const auto& s : t.shards) {
      for (const auto& c : s.chunks) ids.insert(c.id);
    }
  }
  for (const auto& b : blobs()) {
    for (const auto& c : b.chunks) ids.insert(c.id);
  }
  uint64_t total = 0;
  Status st = impl_->repo->catalog->Read([&](const ReadTxn& txn) -> Status {
    for (const auto& id : ids) {
      ASSIGN_OR_RETURN(auto v, txn.Get(Table::kChunks, keys::Chunk(id)));
      if (!v) continue;
      ASSIGN_OR_RETURN(ChunkLocation loc, DecodeChunkLocation(*v));
      total += loc.stored_len;
    }
    return Status::OK();
  });
  RETURN_IF_ERROR(st);
  return total;
}

Result<std::unique_ptr<CheckpointReader>> Repository::OpenCheckpoint(const std::string& name) {
  auto impl = std::make_unique<ReaderImpl>();
  impl->repo = impl_.get();
  Manifest& m = impl->manifest;
  Status inner;
  RETURN_IF_ERROR(impl_->catalog->Read([&](const ReadTxn& txn) -> Status {
    ASSIGN_OR_RETURN(auto raw, txn.Get(Table::kCheckpoints, keys::Checkpoint(name)));
    if (!raw) return Status::NotFound("no checkpoint named '" + name + "'");
    ASSIGN_OR_RETURN(m.checkpoint, DecodeCheckpoint(*raw));
    if (m.checkpoint.state != CheckpointState::kCommitted) {
      return Status::NotFound("checkpoint '" + name + "' is not committed (" +
                              std::to_string(m.checkpoint.committed_ranks.size()) + " of " +
                              std::to_string(m.checkpoint.world_size) + " ranks have committed)");
    }
    const std::string prefix = keys::MemberPrefix(name);
    RETURN_IF_ERROR(txn.Scan(Table::kTensors, prefix, [&](std::string_view, std::string_view v) {
      auto t = DecodeTensor(v);
      if (!t.ok()) {
        inner = t.status().WithContext("checkpoint '" + name + "'");
        return false;
      }
      m.tensors.push_back(std::move(t).value());
      return true;
    }));
    return txn.Scan(Table::kBlobs, prefix, [&](std::string_view, std::string_view v) {
      auto b = DecodeBlob(v);
      if (!b.ok()) {
        inner = b.status().WithContext("checkpoint '" + name + "'");
        return false;
      }
      m.blobs.push_back(std::move(b).value());
      return true;
    });
  }));
  RETURN_IF_ERROR(inner);
  for (size_t i = 0; i < m.tensors.size(); ++i) impl->tensor_index[m.tensors[i].name] = i;
  for (size_t i = 0; i < m.blobs.size(); ++i) impl->blob_index[m.blobs[i].name] = i;
  return std::unique_ptr<CheckpointReader>(new CheckpointReader(std::move(impl)));
}

}  // namespace ckptfs
