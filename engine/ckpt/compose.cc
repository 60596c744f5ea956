// Repository::ComposeCheckpoint (repository.h): a checkpoint made of blobs
// already stored, as thinning (thin.cc) makes one of records already stored.
#include <algorithm>
#include <map>

#include "ckpt/copy.h"
#include "core/region.h"
#include "ckpt/repository.h"
#include "ckpt/repository_impl.h"
#include "core/thread_pool.h"

namespace ckptfs {

namespace {
// Where each chunk of a blob starts, and where the last one ends.
std::vector<uint64_t> ChunkStarts(const BlobRecord& blob) {
  std::vector<uint64_t> starts = {0};
  starts.reserve(blob.chunks.size() + 1);
  for (const ChunkRef& c : blob.chunks) starts.push_back(starts.back() + c.raw_len);
  return starts;
}

// The chunks of `blob` (whose ChunkStarts are `starts`) that hold bytes
// [offset, offset + size) exactly; `what` names the tensor in the error.
Result<std::vector<ChunkRef>> ChunksOfRange(const BlobRecord& blob, const std::vector<uint64_t>& starts,
                                            uint64_t offset, uint64_t size, const std::string& what) {
  if (size == 0 && offset <= blob.size) return std::vector<ChunkRef>{};  // an empty shard holds no chunk
  const uint64_t end = offset + size;
  const auto first = std::lower_bound(starts.begin(), starts.end(), offset);
  const auto last = std::lower_bound(starts.begin(), starts.end(), end);
  if (end < offset || first == starts.end() || *first != offset || last == starts.end() || *last != end) {
    return Status::InvalidArgument(what + ": bytes " + std::to_string(offset) + ".." + std::to_string(end) +
                                   " of blob '" + blob.name + "' (" + std::to_string(blob.size) +
                                   " bytes) do not start and end at chunk boundaries");
  }
  return std::vector<ChunkRef>(blob.chunks.begin() + (first - starts.begin()),
                               blob.chunks.begin() + (last - starts.begin()));
}
}  // namespace

Result<CommitResult> Repository::ComposeCheckpoint(const std::string& name, const std::vector<BlobFrom>& blobs,
                                                   WriterOptions options, const std::vector<TensorFrom>& tensors) {
  RepositoryImpl& impl = *impl_;
  options.rank = 0;
  options.world_size = 1;
  // Each source's record, read once: the manifest only, no chunk.
  std::map<std::string, std::unique_ptr<CheckpointReader>> sources;
  auto find_blob = [&](const std::string& checkpoint, const std::string& name) -> Result<const BlobRecord*> {
    auto it = sources.find(checkpoint);
    if (it == sources.end()) {
      ReadOptions manifest_only;
      manifest_only.lease = false;
      CKPT_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader, OpenCheckpoint(checkpoint, manifest_only));
      it = sources.emplace(checkpoint, std::move(reader)).first;
    }
    const BlobRecord* blob = it->second->FindBlob(name);
    if (blob == nullptr) return Status::NotFound("checkpoint '" + checkpoint + "' has no blob '" + name + "'");
    return blob;
  };
  RankRecord part;
  for (const BlobFrom& from : blobs) {
    CKPT_ASSIGN_OR_RETURN(const BlobRecord* blob, find_blob(from.checkpoint, from.blob));
    part.blobs.push_back(BlobRecord{from.as, blob->size, blob->chunks});
  }
  std::map<std::string, size_t> tensor_at;  // name -> index in part.tensors
  std::map<const BlobRecord*, std::vector<uint64_t>> chunk_starts;  // each blob's, found once (many tensors to a file)
  for (const TensorFrom& from : tensors) {
    const std::string what = "tensor '" + from.tensor.name + "'";
    CKPT_ASSIGN_OR_RETURN(const uint64_t elements, CheckedNumElements(from.tensor.shape));
    if (elements > (uint64_t{1} << 63) / DTypeSize(from.tensor.dtype)) {
      return Status::InvalidArgument(what + ": its shape " + ShapeToString(from.tensor.shape) + " is too large");
    }
    CKPT_RETURN_IF_ERROR(ValidateRegion(from.tensor.shape, from.region).WithContext(what));
    CKPT_ASSIGN_OR_RETURN(const BlobRecord* blob, find_blob(from.checkpoint, from.blob));
    const uint64_t size = from.region.NumElements() * DTypeSize(from.tensor.dtype);
    auto starts = chunk_starts.find(blob);
    if (starts == chunk_starts.end()) starts = chunk_starts.emplace(blob, ChunkStarts(*blob)).first;
    CKPT_ASSIGN_OR_RETURN(std::vector<ChunkRef> chunks, ChunksOfRange(*blob, starts->second, from.offset, size, what));
    auto [it, added] = tensor_at.emplace(from.tensor.name, part.tensors.size());
    if (added) {
      part.tensors.push_back(TensorRecord{from.tensor.name, from.tensor.dtype, from.tensor.shape, {}});
    }
    TensorRecord& t = part.tensors[it->second];
    if (t.dtype != from.tensor.dtype || t.shape != from.tensor.shape) {
      return Status::InvalidArgument(what + ": its shards disagree on its dtype or shape");
    }
    ShardRecord shard;
    shard.region = Normalize(t.shape, from.region);
    shard.ranks = {0};
    shard.chunks = std::move(chunks);
    shard.ComputeStarts();
    t.shards.push_back(std::move(shard));
  }
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointWriter> writer, BeginCheckpoint(name, options));
  // Under the writer's lock no gc deletes a chunk. Each source must still
  // be the version read: its chunks are then live, and stay so until the
  // commit records the new references.
  for (const auto& [source, reader] : sources) {
    const CheckpointRecord& read = reader->info();
    CKPT_ASSIGN_OR_RETURN(std::optional<CheckpointRecord> now, CommittedRecord(impl, source));
    if (!now || now->sequence != read.sequence || now->committed_unix_ms != read.committed_unix_ms) {
      return Status::FailedPrecondition("checkpoint '" + source + "' was removed or saved again while '" + name +
                                        "' was being made of its blobs");
    }
  }
  DirectFetcher unused(
      impl.backend.get(), [r = &impl](const ChunkId& id) { return r->LookupChunk(id); }, impl.buffers.get(),
      impl.protocol->RelocationRefresh());
  CopyCounters counters;
  CKPT_RETURN_IF_ERROR(PutStoredRank(*writer, part, {}, unused, impl.IoPool(), 1, counters)
                           .WithContext("checkpoint '" + name + "'"));
  return writer->Commit().Wait();
}

}  // namespace ckptfs
