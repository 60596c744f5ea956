// Repository::ComposeCheckpoint (repository.h): a checkpoint made of blobs
// already stored, as thinning (thin.cc) makes one of records already stored.
#include <map>

#include "ckpt/copy.h"
#include "ckpt/repository.h"
#include "ckpt/repository_impl.h"
#include "core/thread_pool.h"

namespace ckptfs {

Result<CommitResult> Repository::ComposeCheckpoint(const std::string& name, const std::vector<BlobFrom>& blobs,
                                                   WriterOptions options) {
  RepositoryImpl& impl = *impl_;
  options.rank = 0;
  options.world_size = 1;
  // Each source's record, read once: the manifest only, no chunk.
  std::map<std::string, std::unique_ptr<CheckpointReader>> sources;
  RankRecord part;
  for (const BlobFrom& from : blobs) {
    auto it = sources.find(from.checkpoint);
    if (it == sources.end()) {
      ReadOptions manifest_only;
      manifest_only.lease = false;
      CKPT_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader, OpenCheckpoint(from.checkpoint, manifest_only));
      it = sources.emplace(from.checkpoint, std::move(reader)).first;
    }
    const BlobRecord* blob = it->second->FindBlob(from.blob);
    if (blob == nullptr) {
      return Status::NotFound("checkpoint '" + from.checkpoint + "' has no blob '" + from.blob + "'");
    }
    part.blobs.push_back(BlobRecord{from.as, blob->size, blob->chunks});
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
