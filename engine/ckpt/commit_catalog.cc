// The commit of a local repository: ranks publish into the LMDB catalog.
//
// Steps (docs/DESIGN.md "Commit protocol"):
//   1. ReadView: a read transaction takes what the catalog holds for this
//      checkpoint (its record, the ranks committed, the next sequence).
//   2. CheckJoin and CheckTensorsAgree on that view. A pending checkpoint
//      of an older save attempt is started afresh: its ranks' records are
//      left out of the view and dropped by Publish.
//   3. Last rank only, outside any write transaction: MergeView merges the
//      ranks' records (reading the bytes where replicas overlap) and checks
//      the tiling; WriteManifest makes the manifest object durable.
//   4. Publish: one short write transaction re-reads the view; if another
//      commit changed it meanwhile, the commit starts over at 1 (and
//      removes a manifest it wrote for a view that no longer holds);
//      otherwise it records chunks, packs and this rank, and, for the last
//      rank, the merged records and the committed state.
#include <algorithm>
#include <map>

#include "ckpt/commit.h"
#include "ckpt/lease.h"
#include "ckpt/repository_impl.h"

namespace ckptfs {
namespace {

class CatalogCommit : public CommitProtocol {
 public:
  explicit CatalogCommit(RepositoryImpl& repo) : repo_(repo) {}

  // Every rank runs on this host and the catalog shows the pending ranks.
  void Begin(const std::string&, uint32_t) override {}

  // No other process has seen these packs: nothing deduplicates against
  // them before a commit records them.
  void Abandon(const std::string&, uint32_t, PackWriter& packs) override { packs.Discard(); }

  // The catalog is the truth: nothing to bring in, no other host to lock
  // out, and chunks move only under this host's locks.
  Result<SyncReport> Sync(SyncScope, const PhaseFn&) override { return SyncReport{}; }
  Result<std::string> ShareSync(bool) override { return std::string(); }
  Result<SyncReport> SyncFrom(std::string_view shared) override {
    if (!shared.empty()) return Status::InvalidArgument("a store listing was given to a local repository");
    return SyncReport{};
  }
  Status IndexPacks() override { return Status::OK(); }
  std::function<Status()> RelocationRefresh() override { return {}; }
  Result<std::unique_ptr<ObjectLock>> LockHosts(ObjectLock::Mode, const PhaseFn&) override {
    return std::unique_ptr<ObjectLock>();
  }

  Result<bool> IsCurrent(const std::string&, const CheckpointRecord*) override { return true; }

  // gc collects a name only while holding its lease file, and drops its
  // records then: the catalog, read under the lease, says whether it did.
  Status CheckLeased(const CheckpointRecord& rec, bool, bool read_under_lease) override {
    if (read_under_lease) return Status::OK();
    return repo_.catalog->Read([&](const ReadTxn& txn) -> Status {
      CKPT_ASSIGN_OR_RETURN(auto live, txn.Get(Table::kCheckpoints, keys::Checkpoint(rec.name)));
      if (live) {
        CKPT_ASSIGN_OR_RETURN(CheckpointRecord now, DecodeCheckpoint(*live));
        if (now.committed_unix_ms == rec.committed_unix_ms) return Status::OK();
      }
      CKPT_ASSIGN_OR_RETURN(auto retired,
                            txn.Get(Table::kCheckpoints, keys::RetiredCheckpoint(rec.name, rec.committed_unix_ms)));
      if (retired) return Status::OK();
      return Status::NotFound("checkpoint '" + rec.name + "' was removed and its data collected");
    });
  }

  Result<std::set<std::string>> Leased(const std::vector<std::string>& retired, LocalLeaseScan& scan) override {
    std::set<std::string> leased;
    std::map<std::string, bool> known;
    for (const auto& r : retired) {
      const std::string base = keys::BaseName(r);
      if (known.count(base)) continue;
      CKPT_ASSIGN_OR_RETURN(known[base], scan.Leased(base));
      if (known[base]) leased.insert(base);
    }
    return leased;
  }
  // The scan holds the free names locked: no reader came since.
  Result<std::set<std::string>> LeasedSinceDelete() override { return std::set<std::string>(); }
  bool KeepsDeadChunkLocations() const override { return false; }
  bool UnknownPacksAreLeftovers() const override { return true; }

  // The catalog holds the pending ranks; rm drops them with the checkpoint.
  Status RemoveRankObjects(const std::string&) override { return Status::OK(); }
  Result<std::vector<RankProgress>> RankProgressOf(const std::string&, uint32_t) override {
    return std::vector<RankProgress>();
  }

  Status Commit(const RankCommit& rank, CommitResult* result) override {
    // Commits of other ranks may change the view between the steps; each
    // round trip means one of them got through, so this ends.
    for (;;) {
      CKPT_ASSIGN_OR_RETURN(CommitView view, ReadView(rank));
      std::optional<Manifest> manifest;
      if (view.last) {
        CKPT_ASSIGN_OR_RETURN(manifest, MergeView(repo_, rank, view, /*index_on_miss=*/false));
        CKPT_RETURN_IF_ERROR(WriteManifest(rank.name, *manifest));
      } else {
        // Dtype and shape disagreement shows now; tiling waits for the last rank.
        CKPT_RETURN_IF_ERROR(CheckTensorsAgree(view.ranks));
      }
      auto published = Publish(rank, view, manifest ? &*manifest : nullptr);
      if (manifest && !(published.ok() && *published)) {
        // The manifest describes a commit that did not happen: take it back,
        // or reindex would publish it.
        (void)repo_.backend->Delete(keys::ManifestObject(rank.name));
      }
      CKPT_RETURN_IF_ERROR(published.status());
      if (*published) {
        result->checkpoint_visible = view.last;
        return Status::OK();
      }
    }
  }

 private:
  Result<CommitView> ReadView(const RankCommit& rank);
  Status WriteManifest(const std::string& name, const Manifest& manifest);
  // False when the view changed since it was read (nothing was written).
  Result<bool> Publish(const RankCommit& rank, const CommitView& view, const Manifest* manifest);

  RepositoryImpl& repo_;
};

Result<CommitView> CatalogCommit::ReadView(const RankCommit& rank) {
  CommitView view;
  Status st = repo_.catalog->Read([&](const ReadTxn& txn) -> Status {
    CKPT_ASSIGN_OR_RETURN(auto raw, txn.Get(Table::kCheckpoints, keys::Checkpoint(rank.name)));
    if (raw) view.raw_checkpoint = std::string(*raw);
    CKPT_ASSIGN_OR_RETURN(auto seq, txn.Get(Table::kMeta, keys::kNextSequenceKey));
    if (seq) view.raw_sequence = std::string(*seq);
    Status inner;
    CKPT_RETURN_IF_ERROR(txn.Scan(Table::kRanks, keys::MemberPrefix(rank.name), [&](std::string_view, std::string_view v) {
      auto r = DecodeRank(v);
      if (!r.ok()) {
        inner = r.status();
        return false;
      }
      view.ranks.push_back(std::move(r).value());
      return true;
    }));
    return inner;
  });
  CKPT_RETURN_IF_ERROR(st);
  CheckpointRecord& ckpt = view.checkpoint;
  bool fresh = !view.raw_checkpoint;
  if (view.raw_checkpoint) {
    CKPT_ASSIGN_OR_RETURN(ckpt, DecodeCheckpoint(*view.raw_checkpoint));
    CKPT_ASSIGN_OR_RETURN(bool supersedes, CheckJoin(ckpt, rank.options));
    if (supersedes) {
      // An older attempt's ranks: Publish drops their records.
      for (const auto& r : view.ranks) view.abandoned.push_back(r.rank);
      view.ranks.clear();
      ckpt = CheckpointRecord();
      fresh = true;
    } else if (!ckpt.step) {
      ckpt.step = rank.options.step;
    }
  }
  if (fresh) {
    ckpt.name = rank.name;
    ckpt.step = rank.options.step;
    ckpt.world_size = rank.options.world_size;
    ckpt.created_unix_ms = rank.created_unix_ms;
    ckpt.attempt = rank.options.attempt;
  }
  view.ranks.push_back(rank.record);
  ckpt.committed_ranks.push_back(rank.options.rank);
  std::sort(ckpt.committed_ranks.begin(), ckpt.committed_ranks.end());
  AddTags(ckpt, rank.options.tags);
  view.last = ckpt.committed_ranks.size() >= ckpt.world_size;
  return view;
}

Status CatalogCommit::WriteManifest(const std::string& name, const Manifest& manifest) {
  // Durable before the catalog makes the checkpoint visible: reindex trusts
  // manifests, so both views agree after a crash.
  std::string encoded = EncodeManifest(manifest);
  return repo_.backend->Put(keys::ManifestObject(name), std::as_bytes(std::span(encoded)));
}

Result<bool> CatalogCommit::Publish(const RankCommit& rank, const CommitView& view, const Manifest* manifest) {
  const std::string& name = rank.name;
  bool unchanged = true;
  Status st = repo_.catalog->Update([&](WriteTxn& txn) -> Status {
    CKPT_ASSIGN_OR_RETURN(auto raw, txn.Get(Table::kCheckpoints, keys::Checkpoint(name)));
    CKPT_ASSIGN_OR_RETURN(auto seq, txn.Get(Table::kMeta, keys::kNextSequenceKey));
    auto same = [](const std::optional<std::string_view>& now, const std::optional<std::string>& then) {
      return now.has_value() == then.has_value() && (!now || *now == *then);
    };
    if (!same(raw, view.raw_checkpoint) || (manifest && !same(seq, view.raw_sequence))) {
      unchanged = false;
      return Status::OK();  // nothing written; the caller starts over
    }
    // Chunks first: a chunk another process stored meanwhile keeps its entry.
    for (const auto& p : rank.sealed) CKPT_RETURN_IF_ERROR(RecordPack(txn, p).status());
    // Every chunk this rank references must be in the catalog now: one that
    // was deduplicated against a chunk since removed fails the commit rather
    // than leave a dangling reference. The chunks it stored itself were
    // just recorded with its packs.
    auto check_present = [&](const std::vector<ChunkRef>& chunks, const std::string& what) -> Status {
      for (const auto& c : chunks) {
        if (rank.stored.count(c.id)) continue;
        CKPT_ASSIGN_OR_RETURN(auto v, txn.Get(Table::kChunks, keys::Chunk(c.id)));
        if (!v) return Status::Internal(what + ": chunk " + c.id.ToHex() + " was neither stored nor found in the catalog");
      }
      return Status::OK();
    };
    for (const auto& t : rank.record.tensors) {
      for (const auto& s : t.shards) CKPT_RETURN_IF_ERROR(check_present(s.chunks, "tensor '" + t.name + "'"));
    }
    for (const auto& b : rank.record.blobs) CKPT_RETURN_IF_ERROR(check_present(b.chunks, "blob '" + b.name + "'"));
    for (uint32_t r : view.abandoned) CKPT_RETURN_IF_ERROR(txn.Delete(Table::kRanks, keys::Rank(name, r)));
    if (!manifest) {
      CKPT_RETURN_IF_ERROR(txn.Put(Table::kRanks, keys::Rank(name, rank.options.rank), EncodeRank(rank.record)));
      return txn.Put(Table::kCheckpoints, keys::Checkpoint(name), EncodeCheckpoint(view.checkpoint));
    }
    for (const auto& r : view.ranks) {
      CKPT_RETURN_IF_ERROR(txn.Delete(Table::kRanks, keys::Rank(name, r.rank)));
    }
    CKPT_RETURN_IF_ERROR(txn.Put(Table::kMeta, keys::kNextSequenceKey, EncodeSequence(manifest->checkpoint.sequence + 1)));
    return RecordManifest(txn, *manifest);
  });
  CKPT_RETURN_IF_ERROR(st);
  return unchanged;
}

}  // namespace

std::unique_ptr<CommitProtocol> MakeCatalogCommit(RepositoryImpl& repo) { return std::make_unique<CatalogCommit>(repo); }

}  // namespace ckptfs
