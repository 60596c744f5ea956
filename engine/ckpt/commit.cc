// What the two commit protocols share: the merge of the ranks' records into
// a manifest, and the rules for joining a pending checkpoint.
#include "ckpt/commit.h"

#include <algorithm>
#include <cstdio>
#include <mutex>

#include "ckpt/repository_impl.h"
#include "core/random.h"

namespace ckptfs {

void AddTags(CheckpointRecord& ckpt, const std::vector<std::pair<std::string, std::string>>& tags) {
  for (const auto& tag : tags) {
    if (std::none_of(ckpt.tags.begin(), ckpt.tags.end(), [&](const auto& t) { return t.first == tag.first; })) {
      ckpt.tags.push_back(tag);
    }
  }
}

Result<Manifest> MergeView(RepositoryImpl& repo, const RankCommit& rank, const CommitView& view, bool index_on_miss) {
  // Chunks this rank stored are not in the catalog yet; the others' are,
  // locally. On an object store the other ranks' packs are indexed only
  // when the check of an overlap needs their bytes: most merges read none.
  std::once_flag indexed;
  Status index_status;
  DirectFetcher fetcher(repo.backend.get(), [&](const ChunkId& id) -> Result<ChunkLocation> {
    auto it = rank.stored.find(id);
    if (it != rank.stored.end()) return it->second;
    auto loc = repo.LookupChunk(id);
    if (!index_on_miss || !loc.status().IsNotFound()) return loc;
    std::call_once(indexed, [&] { index_status = repo.protocol->Sync(SyncScope::kPacks).status(); });
    CKPT_RETURN_IF_ERROR(index_status);
    return repo.LookupChunk(id);
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
  ckpt.attempt.clear();  // a committed checkpoint has none
  ckpt.sequence = seq;
  ckpt.committed_unix_ms = WallClockUnixMs();
  ckpt.tensor_count = manifest.tensors.size();
  ckpt.logical_bytes = 0;
  for (const auto& t : manifest.tensors) ckpt.logical_bytes += t.ByteSize();
  for (const auto& b : manifest.blobs) ckpt.logical_bytes += b.size;
  manifest.checkpoint = ckpt;
  return manifest;
}

AttemptOrder CompareAttempts(const std::string& mine, const std::string& theirs) {
  if (mine == theirs) return AttemptOrder::kSame;
  return mine > theirs ? AttemptOrder::kNewer : AttemptOrder::kOlder;
}

Status CheckpointExists(const std::string& name) {
  return Status::AlreadyExists("checkpoint '" + name +
                               "' already exists (an overwriting save replaces it: ckpt import --overwrite, "
                               "save(..., overwrite=True))");
}

Status SupersededAttempt(const std::string& name, const std::string& mine, const std::string& pending) {
  auto shown = [](const std::string& a) { return a.empty() ? std::string("(none)") : a; };
  return Status::FailedPrecondition("checkpoint '" + name + "' is being saved by a newer attempt (" + shown(pending) +
                                    ") than this rank's (" + shown(mine) +
                                    "): a restarted job took it over, and this rank's save is given up");
}

Result<bool> CheckJoin(const CheckpointRecord& rec, const WriterOptions& options) {
  const std::string& name = rec.name;
  if (rec.state == CheckpointState::kCommitted) return CheckpointExists(name);
  switch (CompareAttempts(options.attempt, rec.attempt)) {
    case AttemptOrder::kNewer: return true;  // the older attempt is abandoned
    case AttemptOrder::kOlder: return SupersededAttempt(name, options.attempt, rec.attempt);
    case AttemptOrder::kSame: break;
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
  return false;
}

std::string NewSaveAttempt() {
  char ms[24];
  std::snprintf(ms, sizeof ms, "%016llu", static_cast<unsigned long long>(WallClockUnixMs()));
  return std::string(ms) + "-" + RandomHex(16);
}

}  // namespace ckptfs
