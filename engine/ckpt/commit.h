// How a rank's save joins its checkpoint, and how the last rank in makes
// the checkpoint visible. One protocol per kind of repository, chosen once
// when the repository opens (RepositoryImpl::commits):
//   - the local catalog (commit_catalog.cc): ranks publish into this host's
//     LMDB catalog in short write transactions, the last one with the
//     merged manifest (docs/DESIGN.md "Commit protocol");
//   - an object store (commit_store.cc): each rank PUTs its record as an
//     object, and the rank that finds every rank's object merges them and
//     writes the manifest with a conditional PUT (docs/DESIGN.md
//     "Repositories on S3").
// The writer (writer.cc) runs the save pipeline and knows neither: it hands
// its finished rank to Commit.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "ckpt/merge.h"
#include "ckpt/object_lock.h"
#include "ckpt/repository.h"
#include "core/status.h"
#include "store/pack.h"

namespace ckptfs {

class RepositoryImpl;

// A rank's save, finished: what its commit publishes.
struct RankCommit {
  const std::string& name;
  const WriterOptions& options;
  uint64_t created_unix_ms;
  const RankRecord& record;                 // shard starts computed
  const std::vector<SealedPack>& sealed;    // this rank's packs, durable
  // Chunks this rank stored: not in the catalog until the commit records
  // its packs, and needed before that where a merge compares replicas.
  const std::unordered_map<ChunkId, ChunkLocation, ChunkIdHash>& stored;
  ObjectLock* store_lock;                   // object stores: held since the save began
};

class CommitProtocol {
 public:
  virtual ~CommitProtocol() = default;
  // A writer of rank `rank` of `name` begins. A save does not fail for
  // what this records (where the rank runs, for `ckpt show`).
  virtual void Begin(const std::string& name, uint32_t rank) = 0;
  // That writer is gone without a commit; `packs` holds what it wrote.
  virtual void Abandon(const std::string& name, uint32_t rank, PackWriter& packs) = 0;
  // Makes the rank's part durable; the last rank in makes the checkpoint
  // visible (result->checkpoint_visible). Sets nothing else in `result`.
  virtual Status Commit(const RankCommit& rank, CommitResult* result) = 0;
};

// The protocol of a local repository and of one on an object store; both
// keep a reference to `repo`, which owns them.
std::unique_ptr<CommitProtocol> MakeCatalogCommit(RepositoryImpl& repo);
std::unique_ptr<CommitProtocol> MakeStoreCommit(RepositoryImpl& repo);

// ---- shared by the two protocols ------------------------------------------------

// What a commit knows of its checkpoint before the merge.
struct CommitView {
  std::optional<std::string> raw_checkpoint;  // as stored, to see changes
  std::optional<std::string> raw_sequence;
  CheckpointRecord checkpoint;                // this rank added
  std::vector<RankRecord> ranks;              // this rank last
  bool last = false;
};

// Merges the ranks of `view` into the checkpoint's manifest, checking that
// their shards tile every tensor (merge.h). Replicas that overlap are
// compared byte for byte: the chunks come from `rank.stored`, else the
// catalog; with `index_on_miss`, a chunk the catalog lacks makes it read
// every pack index once (another rank's packs on an object store).
Result<Manifest> MergeView(RepositoryImpl& repo, const RankCommit& rank, const CommitView& view, bool index_on_miss);

// Whether `options` may join the pending checkpoint `rec`.
Status CheckJoin(const CheckpointRecord& rec, const WriterOptions& options);
// Ranks may each bring tags; the first rank to give a key sets its value.
void AddTags(CheckpointRecord& ckpt, const std::vector<std::pair<std::string, std::string>>& tags);

}  // namespace ckptfs
