// The commit of a repository on an object store: no catalog is shared, so
// the store's objects carry the protocol.
//
// Steps (docs/DESIGN.md "Repositories on S3", with the outcome of a crash
// after each):
//   1. This rank's packs are durable (sealed before Commit is called).
//   2. Its record is PUT as pending/NAME/rank-R: its part is durable.
//   3. It LISTs pending/NAME/. Fewer than world-size ranks: done, the
//      checkpoint stays invisible. All of them: this rank commits.
//   4. Commit: read every rank's record, merge and check the tiling (an
//      overlap whose bytes must be compared syncs the packs first: every
//      pack a record names was durable before the record, so that listing
//      has it), PUT the manifest if none exists: the checkpoint is visible
//      on every host from this PUT on.
//   5. Delete the rank objects (leftovers are ignored once the manifest
//      exists, and removed by rm).
// Ranks finishing together may all see every rank and all merge; the
// manifest is written with a conditional PUT (If-None-Match), so exactly one
// of them commits and the others stand down.
#include <algorithm>
#include <atomic>
#include <set>

#include "ckpt/commit.h"
#include "ckpt/repository_impl.h"
#include "core/random.h"

namespace ckptfs {
namespace {

class StoreCommit : public CommitProtocol {
 public:
  explicit StoreCommit(RepositoryImpl& repo) : repo_(repo) {}

  void Begin(const std::string& name, uint32_t rank) override {
    // Where this rank runs, for `ckpt show` of the checkpoint while it is
    // pending.
    Json j = ThisProcess();
    j.Set("started_unix_ms", WallClockUnixMs());
    const std::string body = j.Dump();
    (void)repo_.backend->Put(keys::StartedRankObject(name, rank), std::as_bytes(std::span(body)));
  }

  // The packs stay for gc: another host may have listed them and
  // deduplicated against their chunks.
  void Abandon(const std::string& name, uint32_t rank, PackWriter&) override {
    (void)repo_.backend->Delete(keys::StartedRankObject(name, rank));
  }

  Status Commit(const RankCommit& rank, CommitResult* result) override;

 private:
  Result<Manifest> MergeStoredRanks(const RankCommit& rank);

  RepositoryImpl& repo_;
};

Result<Manifest> StoreCommit::MergeStoredRanks(const RankCommit& rank) {
  const std::string& name = rank.name;
  const uint32_t n = rank.options.world_size;
  std::vector<Result<PendingRank>> objects(n, Status::Internal("not read"));
  ParallelFor(repo_.IoPool(), n, repo_.io_threads,
              [&](size_t r) { objects[r] = ReadPendingRank(*repo_.backend, name, static_cast<uint32_t>(r)); });
  CommitView view;
  view.checkpoint.name = name;
  view.checkpoint.world_size = n;
  view.checkpoint.created_unix_ms = rank.created_unix_ms;
  for (uint32_t r = 0; r < n; ++r) {
    if (!objects[r].ok()) return objects[r].status().WithContext("committing checkpoint '" + name + "'");
    const CheckpointRecord& h = objects[r]->header;
    if (h.world_size != n) {
      return Status::InvalidArgument("checkpoint '" + name + "': rank " + std::to_string(r) + " was saved with world size " +
                                     std::to_string(h.world_size) + ", rank " + std::to_string(rank.options.rank) +
                                     " with " + std::to_string(n));
    }
    if (h.step) {
      if (view.checkpoint.step && *view.checkpoint.step != *h.step) {
        return Status::InvalidArgument("checkpoint '" + name + "': ranks disagree on the step (" +
                                       std::to_string(*view.checkpoint.step) + " and " + std::to_string(*h.step) + ")");
      }
      view.checkpoint.step = h.step;
    }
    view.checkpoint.created_unix_ms = std::min(view.checkpoint.created_unix_ms, h.created_unix_ms);
    AddTags(view.checkpoint, h.tags);
    view.checkpoint.committed_ranks.push_back(r);
    view.ranks.push_back(std::move(objects[r]->record));
  }
  CKPT_RETURN_IF_ERROR(repo_.catalog->Read([&](const ReadTxn& txn) -> Status {
    CKPT_ASSIGN_OR_RETURN(auto seq, txn.Get(Table::kMeta, keys::kNextSequenceKey));
    if (seq) view.raw_sequence = std::string(*seq);
    return Status::OK();
  }));
  view.last = true;
  return MergeView(repo_, rank, view, /*index_on_miss=*/true);
}

Status StoreCommit::Commit(const RankCommit& rank, CommitResult* result) {
  const std::string& name = rank.name;
  const WriterOptions& options = rank.options;
  Backend& store = *repo_.backend;
  // Were the lock's refreshes failing, a gc elsewhere may have taken it for
  // stale and removed chunks this save deduplicated against.
  CKPT_RETURN_IF_ERROR(rank.store_lock->Check());
  const std::string own_key = keys::PendingRankObject(name, options.rank);
  auto committed = store.Size(keys::ManifestObject(name));
  if (committed.ok()) return Status::AlreadyExists("checkpoint '" + name + "' already exists");
  if (!committed.status().IsNotFound()) return committed.status();
  auto mine = store.Size(own_key);
  if (mine.ok()) {
    return Status::AlreadyExists("rank " + std::to_string(options.rank) + " of checkpoint '" + name + "' already committed");
  }
  if (!mine.status().IsNotFound()) return mine.status();

  CheckpointRecord header;
  header.name = name;
  header.step = options.step;
  header.world_size = options.world_size;
  header.created_unix_ms = rank.created_unix_ms;
  header.tags = options.tags;
  const std::string encoded = EncodePendingRank(header, rank.record);
  CKPT_RETURN_IF_ERROR(store.Put(own_key, std::as_bytes(std::span(encoded))));
  // The catalog is this host's index of the store: the packs just written
  // go in as a sync would put them.
  CKPT_RETURN_IF_ERROR(repo_.catalog->Update([&](WriteTxn& txn) -> Status {
    for (const auto& p : rank.sealed) CKPT_RETURN_IF_ERROR(RecordPack(txn, p).status());
    return Status::OK();
  }));

  CKPT_ASSIGN_OR_RETURN(auto present, store.List(keys::PendingPrefix(name)));
  std::set<uint32_t> ranks;
  for (const auto& key : present) {
    std::string n;
    uint32_t r;
    if (keys::ParsePendingRankObject(key, &n, &r) && n == name && r < options.world_size) ranks.insert(r);
  }
  if (ranks.size() < options.world_size) return Status::OK();

  // Ranks finishing together may all see every rank in: the one whose
  // claim lands first (a conditional PUT) commits, the others are done.
  // The claim names this attempt, so an answer lost on the way and a retry
  // that finds the object still tell whose claim it is.
  const std::string claim_key = keys::CommitClaimObject(name);
  const std::string claim = "rank " + std::to_string(options.rank) + " " + RandomHex(16);
  Status claimed = store.PutIfAbsent(claim_key, std::as_bytes(std::span(claim)));
  if (claimed.IsAlreadyExists()) {
    auto holder = store.ReadAll(claim_key, kMaxSmallObject);
    if (!holder.ok() && !holder.status().IsNotFound()) return holder.status();
    if (!holder.ok() || *holder != claim) return Status::OK();  // another rank commits (or did)
  } else {
    CKPT_RETURN_IF_ERROR(claimed);
  }
  const std::string manifest_key = keys::ManifestObject(name);
  CKPT_ASSIGN_OR_RETURN(Manifest manifest, MergeStoredRanks(rank));
  CKPT_RETURN_IF_ERROR(rank.store_lock->Check());
  const std::string manifest_bytes = EncodeManifest(manifest);
  Status put = store.PutIfAbsent(manifest_key, std::as_bytes(std::span(manifest_bytes)));
  // Exists: this PUT's own, its answer lost and retried.
  if (put.IsAlreadyExists()) return Status::OK();
  CKPT_RETURN_IF_ERROR(put);
  result->checkpoint_visible = true;
  // The checkpoint is committed: what follows is tidying, and its failure
  // (the store going away now) does not undo the commit. Rank objects left
  // behind are ignored by sync and removed by rm; the next sync brings the
  // checkpoint into this host's catalog.
  std::atomic<bool> failing{false};
  ParallelFor(repo_.IoPool(), options.world_size, repo_.io_threads, [&](size_t r) {
    if (failing) return;
    Status st = store.Delete(keys::PendingRankObject(name, static_cast<uint32_t>(r)));
    if (!st.ok() && !st.IsNotFound()) failing = true;
    (void)store.Delete(keys::StartedRankObject(name, static_cast<uint32_t>(r)));
  });
  if (!failing) (void)store.Delete(claim_key);
  (void)repo_.Sync();
  return Status::OK();
}

}  // namespace

std::unique_ptr<CommitProtocol> MakeStoreCommit(RepositoryImpl& repo) { return std::make_unique<StoreCommit>(repo); }

}  // namespace ckptfs
