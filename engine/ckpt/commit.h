// How a repository's hosts and ranks share it: how a rank's save joins its
// checkpoint and the last rank in makes it visible, and how this host's
// catalog relates to the repository's truth (syncs, store locks, the leases
// gc must honour). One protocol per kind of repository, chosen once when the
// repository opens (RepositoryImpl::protocol); no code above it asks which:
//   - the local catalog (commit_catalog.cc): the catalog is the truth, and
//     ranks publish into it in short write transactions, the last one with
//     the merged manifest (docs/DESIGN.md "Commit protocol");
//   - an object store (commit_store.cc, sync.cc): the store is the truth and
//     the catalog this host's index of it. Each rank PUTs its record as an
//     object, and the rank that finds every rank's object merges them and
//     writes the manifest with a conditional PUT (docs/DESIGN.md
//     "Repositories on S3").
// The writer (writer.cc) runs the save pipeline and knows neither: it hands
// its finished rank to Commit. gc, rm and readers call the rest.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "ckpt/merge.h"
#include "ckpt/object_lock.h"
#include "ckpt/repository.h"
#include "core/status.h"
#include "store/pack.h"

namespace ckptfs {

class RepositoryImpl;
class LocalLeaseScan;

// What one sync of the catalog with an object store brought in.
struct SyncReport {
  uint64_t packs_added = 0, packs_removed = 0;
  uint64_t chunks_added = 0;
  uint64_t checkpoints_added = 0, checkpoints_removed = 0;
  uint64_t pending_ranks_added = 0, pending_ranks_removed = 0;
  uint64_t objects_read = 0;            // GETs besides the LISTs
  std::vector<std::string> problems;    // objects skipped, and why
};

// What a sync brings into the catalog.
enum class SyncScope {
  // Committed checkpoints, and pending checkpoints with the ranks that are
  // in (named by their objects; one rank object is read per pending
  // checkpoint the catalog does not know yet). New packs are listed but
  // their indexes are left for IndexPacks: a save deduplicates against the
  // packs this host knows, and does not read every other rank's new packs
  // at every step.
  kCheckpoints,
  // That, the indexes of all packs, and the records of every pending rank:
  // references gc must keep.
  kReferences,
  // The indexes of all packs only (a committer about to merge the ranks'
  // shards).
  kPacks,
};

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
  // Object stores: held since the save began; null for a collective
  // save's rank covered by the sharing rank's lock (WriterOptions::await_ranks).
  ObjectLock* store_lock;
  // WriterOptions::await_ranks's split: a part only (no listing), or the
  // sharing rank's commit, which waits for every part.
  enum class Role { kAny, kPartOnly, kCompleter } role = Role::kAny;
};

class CommitProtocol {
 public:
  virtual ~CommitProtocol() = default;

  // ---- saves
  // A writer of rank `rank` of `name` begins. A save does not fail for
  // what this records (where the rank runs, for `ckpt show`).
  virtual void Begin(const std::string& name, uint32_t rank) = 0;
  // That writer is gone without a commit; `packs` holds what it wrote.
  virtual void Abandon(const std::string& name, uint32_t rank, PackWriter& packs) = 0;
  // Makes the rank's part durable; the last rank in makes the checkpoint
  // visible (result->checkpoint_visible). Sets nothing else in `result`.
  virtual Status Commit(const RankCommit& rank, CommitResult* result) = 0;

  // ---- this host's catalog and the truth
  // Brings the catalog up to date with what other hosts did. Only objects
  // new since the last sync are read; LISTs otherwise. The catalog's
  // protocol has nothing to bring in.
  // `on_phase`, when given, hears what a long sync is doing.
  using PhaseFn = std::function<void(const std::string&)>;
  virtual Result<SyncReport> Sync(SyncScope scope = SyncScope::kCheckpoints, const PhaseFn& on_phase = {}) = 0;
  // One checkpoints sync for a group of processes: one makes it and gets
  // what it read, encoded (ShareSync); the others apply that (SyncFrom)
  // instead of listing the store. Empty and no-op for the catalog's
  // protocol, which has nothing to bring in. `with_pack_indexes`: the
  // sharer also reads the indexes of the packs new to it (IndexPacks) and
  // shares them, for a group about to read (not for one about to save,
  // which would wait for those reads at its start).
  virtual Result<std::string> ShareSync(bool with_pack_indexes) = 0;
  virtual Result<SyncReport> SyncFrom(std::string_view shared) = 0;
  // Reads the indexes of the packs the last sync listed but did not read,
  // so every chunk of every synced checkpoint has its location. Readers,
  // verify and du call it; no request when none is left.
  virtual Status IndexPacks() = 0;
  // For a fetcher whose chunk's pack is gone while the catalog still names
  // it: learns where gc on another host moved the chunk. Empty when no
  // other host moves chunks.
  virtual std::function<Status()> RelocationRefresh() = 0;

  // ---- locks beside this host's lock files (repo_lock.h)
  // The lock hosts share (object_lock.h), waiting as the repository's lock
  // options say: shared by saves and rm, exclusive for gc, which first
  // removes the stale ones of holders that died; `on_phase` hears before it
  // may wait. Null where the host's lock files are every lock there is.
  virtual Result<std::unique_ptr<ObjectLock>> LockHosts(ObjectLock::Mode mode, const PhaseFn& on_phase = {}) = 0;

  // ---- readers and removed checkpoints (lease.h)
  // Whether what this host's catalog holds under checkpoint name `name`
  // (`rec`, its committed record; null when it has none) is what the truth
  // holds under it now. A catalog that is the truth vouches for itself (no
  // request). On an object store, another host may have saved the name,
  // removed it, or removed it and saved it again since this host's last
  // sync: one request (the manifest object's tag, against the tag the
  // catalog read it under) tells. False sends the reader to Sync first.
  virtual Result<bool> IsCurrent(const std::string& name, const CheckpointRecord* rec) = 0;
  // A reader of `rec` holds its lease (`first`: no other reader of this
  // process did). OK while no gc can collect its data now; NotFound when
  // it was removed and collected meanwhile. `read_under_lease`: `rec` was
  // read from this host's catalog after the lease was taken and IsCurrent
  // confirmed it, which already vouches for it.
  virtual Status CheckLeased(const CheckpointRecord& rec, bool first, bool read_under_lease) = 0;
  // Of the removed checkpoints `retired` (catalog names "NAME/TOKEN"), the
  // base names some reader holds a lease on. `scan` keeps the local names
  // it found unleased locked against new readers until it is destroyed.
  virtual Result<std::set<std::string>> Leased(const std::vector<std::string>& retired, LocalLeaseScan& scan) = 0;
  // After gc deleted the retired manifests of names Leased found free: the
  // names a reader leased meanwhile (it then found the retired manifest
  // still there, so gc writes it back and keeps the checkpoint). Empty
  // where Leased's scan kept new readers out.
  virtual Result<std::set<std::string>> LeasedSinceDelete() = 0;
  // Whether the catalog keeps a dead chunk's location while its pack stays,
  // as a mirror of the pack indexes must (every other host's catalog does).
  virtual bool KeepsDeadChunkLocations() const = 0;
  // Whether a pack on the store that the catalog lacks was left by a killed
  // save or gc (the catalog records every pack a commit made): false where
  // the catalog learns packs from listings and may lag them.
  virtual bool UnknownPacksAreLeftovers() const = 0;

  // ---- pending checkpoints
  // rm of `name`: removes what its ranks left beside the catalog (the rank
  // objects of a pending checkpoint, those a crashed committer left).
  virtual Status RemoveRankObjects(const std::string& name) = 0;
  // Where the ranks of the pending checkpoint `name` (world size
  // `world_size`) run and which have committed, as far as the protocol
  // records it; empty where every rank runs on this host.
  virtual Result<std::vector<RankProgress>> RankProgressOf(const std::string& name, uint32_t world_size) = 0;
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
  std::vector<uint32_t> abandoned;            // an older attempt's ranks, to drop
  bool last = false;
};

// Merges the ranks of `view` into the checkpoint's manifest, checking that
// their shards tile every tensor (merge.h). Replicas that overlap are
// compared byte for byte: the chunks come from `rank.stored`, else the
// catalog; with `index_on_miss`, a chunk the catalog lacks makes it read
// every pack index once (another rank's packs on an object store).
Result<Manifest> MergeView(RepositoryImpl& repo, const RankCommit& rank, const CommitView& view, bool index_on_miss);

// Whether `options` may join the pending checkpoint `rec`: true when it
// starts it afresh, `rec` being an older save attempt's (whose ranks' parts
// the commit then drops); false when it joins it. AlreadyExists for a
// committed `rec` or a rank already in; FailedPrecondition for a rank of an
// older attempt than `rec`'s; InvalidArgument for a world size or step that
// disagrees.
Result<bool> CheckJoin(const CheckpointRecord& rec, const WriterOptions& options);
// How attempt `mine` relates to `theirs`: the same, newer or older.
enum class AttemptOrder { kSame, kNewer, kOlder };
AttemptOrder CompareAttempts(const std::string& mine, const std::string& theirs);
// The refusal of a save of a committed name (without WriterOptions::overwrite).
Status CheckpointExists(const std::string& name);
// The refusal of a rank of an attempt older than the pending one's.
Status SupersededAttempt(const std::string& name, const std::string& mine, const std::string& pending);
// Ranks may each bring tags; the first rank to give a key sets its value.
void AddTags(CheckpointRecord& ckpt, const std::vector<std::pair<std::string, std::string>>& tags);

}  // namespace ckptfs
