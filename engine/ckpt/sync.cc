// Bringing the catalog of a repository on an object store up to date with
// the store, which is the truth (docs/DESIGN.md "Repositories on S3").
//
// The catalog mirrors three listings: packs/ (chunk locations from each
// pack's index), manifests/ (committed checkpoints) and pending/ (the ranks
// of checkpoints not yet visible, which gc must count as references). Each
// sync lists all three and reads only the objects the catalog lacks.
//
// Order matters. What the catalog knows is read before listing, so an
// object missing from a listing was really removed, not added by another
// process of this host meanwhile. pending/ and manifests/ are listed before
// packs/: every pack a rank record or manifest references was durable
// before that object was written, so it is in the later packs listing, and
// a synced checkpoint never lacks a chunk.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <set>

#include "ckpt/repository_impl.h"
#include "core/thread_pool.h"
#include "store/pack.h"

namespace ckptfs {
namespace {

// Objects are fetched with this many requests in flight.
constexpr size_t kSyncFetchThreads = 16;

// The rank of a kRanks key (name \0 rank, u32 big-endian).
uint32_t RankOfKey(std::string_view key) {
  uint32_t r = 0;
  for (size_t i = key.size() - 4; i < key.size(); ++i) r = (r << 8) | static_cast<uint8_t>(key[i]);
  return r;
}

struct KnownState {
  std::set<std::string> packs;
  std::set<std::string> committed;
  std::map<std::string, std::set<uint32_t>> pending;  // checkpoint -> ranks
};

Result<KnownState> ReadKnown(LmdbEnv& catalog) {
  KnownState k;
  CKPT_RETURN_IF_ERROR(catalog.Read([&](const ReadTxn& txn) -> Status {
    CKPT_RETURN_IF_ERROR(txn.Scan(Table::kPacks, "", [&](std::string_view key, std::string_view) {
      k.packs.emplace(key);
      return true;
    }));
    CKPT_RETURN_IF_ERROR(ScanDecoded<CheckpointRecord>(txn, Table::kCheckpoints, "", DecodeCheckpoint,
                                                       [&](std::string_view, CheckpointRecord&& c) {
                                                         if (c.state == CheckpointState::kCommitted) k.committed.insert(c.name);
                                                         return true;
                                                       }));
    return txn.Scan(Table::kRanks, "", [&](std::string_view key, std::string_view) {
      if (key.size() > 5) k.pending[keys::CheckpointOfKey(key)].insert(RankOfKey(key));
      return true;
    });
  }));
  return k;
}

// A pending rank object: a manifest whose checkpoint record is pending and
// names only its rank.
struct PendingRank {
  CheckpointRecord header;
  RankRecord record;
};

Result<PendingRank> DecodePendingRank(std::string_view data, const std::string& name, uint32_t rank) {
  CKPT_ASSIGN_OR_RETURN(Manifest m, DecodeManifest(data));
  if (m.checkpoint.name != name || m.checkpoint.state != CheckpointState::kPending ||
      m.checkpoint.committed_ranks != std::vector<uint32_t>{rank}) {
    return Status::Corruption("it does not describe rank " + std::to_string(rank) + " of checkpoint '" + name + "'");
  }
  PendingRank p;
  p.header = std::move(m.checkpoint);
  p.record.rank = rank;
  p.record.tensors = std::move(m.tensors);
  p.record.blobs = std::move(m.blobs);
  return p;
}

}  // namespace

Result<PendingRankObject> ReadPendingRank(Backend& backend, const std::string& name, uint32_t rank) {
  const std::string key = keys::PendingRankObject(name, rank);
  CKPT_ASSIGN_OR_RETURN(std::string data, backend.ReadAll(key));
  auto p = DecodePendingRank(data, name, rank);
  if (!p.ok()) return p.status().WithContext("rank object " + key);
  return PendingRankObject{std::move(p->header), std::move(p->record)};
}

std::string EncodePendingRank(const CheckpointRecord& header, const RankRecord& record) {
  Manifest m;
  m.checkpoint = header;
  m.checkpoint.state = CheckpointState::kPending;
  m.checkpoint.committed_ranks = {record.rank};
  m.tensors = record.tensors;
  m.blobs = record.blobs;
  return EncodeManifest(m);
}

Result<SyncReport> RepositoryImpl::Sync() {
  if (!remote) return SyncReport{};
  std::lock_guard lock(sync_mu_);
  SyncReport report;
  CKPT_ASSIGN_OR_RETURN(KnownState known, ReadKnown(*catalog));
  CKPT_ASSIGN_OR_RETURN(auto pending_keys, backend->List(keys::kPendingPrefix));
  CKPT_ASSIGN_OR_RETURN(auto manifest_keys, backend->List(keys::kManifestPrefix));
  CKPT_ASSIGN_OR_RETURN(auto pack_keys, backend->List(keys::kPackPrefix));

  // ---- packs ----
  std::set<std::string> listed_packs;
  for (const auto& key : pack_keys) {
    std::string id;
    if (ParsePackKey(key, &id)) listed_packs.insert(id);
  }
  std::vector<std::string> gone_packs, fresh_packs;
  std::set_difference(known.packs.begin(), known.packs.end(), listed_packs.begin(), listed_packs.end(),
                      std::back_inserter(gone_packs));
  // Chunks of a removed pack may live on in others (gc moved them, or two
  // hosts stored the same chunk): re-read every index then, so the catalog
  // stays the union of the pack indexes.
  if (gone_packs.empty()) {
    std::set_difference(listed_packs.begin(), listed_packs.end(), known.packs.begin(), known.packs.end(),
                        std::back_inserter(fresh_packs));
  } else {
    fresh_packs.assign(listed_packs.begin(), listed_packs.end());
  }
  std::vector<Result<SealedPack>> indexes(fresh_packs.size(), Status::Internal("not read"));
  ParallelFor(fresh_packs.size(), kSyncFetchThreads,
              [&](size_t i) { indexes[i] = ReadPackIndex(backend.get(), fresh_packs[i]); });
  report.objects_read += fresh_packs.size();

  // ---- manifests ----
  std::set<std::string> listed_committed;
  for (const auto& key : manifest_keys) {
    std::string name;
    if (keys::ParseManifestObject(key, &name)) listed_committed.insert(name);
  }
  std::vector<std::string> removed, added;
  std::set_difference(known.committed.begin(), known.committed.end(), listed_committed.begin(), listed_committed.end(),
                      std::back_inserter(removed));
  std::set_difference(listed_committed.begin(), listed_committed.end(), known.committed.begin(), known.committed.end(),
                      std::back_inserter(added));
  std::vector<Result<Manifest>> manifests(added.size(), Status::Internal("not read"));
  ParallelFor(added.size(), kSyncFetchThreads, [&](size_t i) {
    auto data = backend->ReadAll(keys::ManifestObject(added[i]));
    manifests[i] = data.ok() ? DecodeManifest(*data) : Result<Manifest>(data.status());
    if (manifests[i].ok() && manifests[i]->checkpoint.name != added[i]) {
      manifests[i] = Status::Corruption("it names checkpoint '" + manifests[i]->checkpoint.name + "'");
    }
  });
  report.objects_read += added.size();

  // ---- pending ranks (of checkpoints not committed) ----
  std::map<std::string, std::set<uint32_t>> listed_pending;
  for (const auto& key : pending_keys) {
    std::string name;
    uint32_t rank;
    if (keys::ParsePendingRankObject(key, &name, &rank) && !listed_committed.count(name)) {
      listed_pending[name].insert(rank);
    }
  }
  std::vector<std::pair<std::string, uint32_t>> ranks_gone, ranks_new;
  for (const auto& [name, ranks] : known.pending) {
    auto it = listed_pending.find(name);
    for (uint32_t r : ranks) {
      if (it == listed_pending.end() || !it->second.count(r)) ranks_gone.emplace_back(name, r);
    }
  }
  for (const auto& [name, ranks] : listed_pending) {
    auto it = known.pending.find(name);
    for (uint32_t r : ranks) {
      if (it == known.pending.end() || !it->second.count(r)) ranks_new.emplace_back(name, r);
    }
  }
  std::vector<Result<PendingRankObject>> rank_objects(ranks_new.size(), Status::Internal("not read"));
  ParallelFor(ranks_new.size(), kSyncFetchThreads,
              [&](size_t i) { rank_objects[i] = ReadPendingRank(*backend, ranks_new[i].first, ranks_new[i].second); });
  report.objects_read += ranks_new.size();

  // ---- one transaction ----
  std::set<std::string> gone_set(gone_packs.begin(), gone_packs.end());
  Status st = catalog->Update([&](WriteTxn& txn) -> Status {
    SyncReport r;
    if (!gone_set.empty()) {
      std::vector<std::string> doomed;
      CKPT_RETURN_IF_ERROR(ScanDecoded<ChunkLocation>(txn, Table::kChunks, "", DecodeChunkLocation,
                                                      [&](std::string_view k, ChunkLocation&& loc) {
                                                        if (gone_set.count(loc.pack)) doomed.emplace_back(k);
                                                        return true;
                                                      }));
      for (const auto& k : doomed) CKPT_RETURN_IF_ERROR(txn.Delete(Table::kChunks, k));
      for (const auto& id : gone_packs) CKPT_RETURN_IF_ERROR(txn.Delete(Table::kPacks, id));
      r.packs_removed = gone_packs.size();
    }
    for (size_t i = 0; i < fresh_packs.size(); ++i) {
      if (!indexes[i].ok()) {
        // Removed since the listing (a gc elsewhere) is not a problem.
        if (!indexes[i].status().IsNotFound()) {
          r.problems.push_back("skipped pack " + fresh_packs[i] + ": " + indexes[i].status().message());
        }
        continue;
      }
      const SealedPack& pack = *indexes[i];
      for (const auto& e : pack.entries) {
        CKPT_ASSIGN_OR_RETURN(auto existing, txn.Get(Table::kChunks, keys::Chunk(e.id)));
        if (existing) continue;
        CKPT_RETURN_IF_ERROR(txn.Put(Table::kChunks, keys::Chunk(e.id), EncodeChunkLocation(e.location)));
        ++r.chunks_added;
      }
      CKPT_RETURN_IF_ERROR(txn.Put(Table::kPacks, fresh_packs[i], EncodePackInfo({pack.size, pack.entries.size()})));
      if (!known.packs.count(fresh_packs[i])) ++r.packs_added;
    }

    for (const auto& name : removed) CKPT_RETURN_IF_ERROR(DeleteCheckpointRecords(txn, name));
    r.checkpoints_removed = removed.size();
    CKPT_ASSIGN_OR_RETURN(auto raw_seq, txn.Get(Table::kMeta, keys::kNextSequenceKey));
    uint64_t next_seq = 1;
    if (raw_seq) {
      CKPT_ASSIGN_OR_RETURN(next_seq, DecodeSequence(*raw_seq));
    }
    const uint64_t seq_before = next_seq;
    for (size_t i = 0; i < added.size(); ++i) {
      if (!manifests[i].ok()) {
        if (!manifests[i].status().IsNotFound()) {
          r.problems.push_back("skipped manifest " + keys::ManifestObject(added[i]) + ": " +
                               manifests[i].status().message());
        }
        continue;
      }
      const Manifest& m = *manifests[i];
      const std::string& name = added[i];
      CKPT_RETURN_IF_ERROR(DeleteCheckpointRecords(txn, name));  // its pending state
      CKPT_RETURN_IF_ERROR(txn.Put(Table::kCheckpoints, keys::Checkpoint(name), EncodeCheckpoint(m.checkpoint)));
      for (const auto& t : m.tensors) CKPT_RETURN_IF_ERROR(txn.Put(Table::kTensors, keys::Member(name, t.name), EncodeTensor(t)));
      for (const auto& b : m.blobs) CKPT_RETURN_IF_ERROR(txn.Put(Table::kBlobs, keys::Member(name, b.name), EncodeBlob(b)));
      next_seq = std::max(next_seq, m.checkpoint.sequence + 1);
      ++r.checkpoints_added;
    }
    if (next_seq != seq_before) CKPT_RETURN_IF_ERROR(txn.Put(Table::kMeta, keys::kNextSequenceKey, EncodeSequence(next_seq)));

    // Pending ranks: drop those gone, add the new, then rewrite the pending
    // record of every checkpoint touched from the ranks now present.
    std::map<std::string, std::optional<CheckpointRecord>> touched;
    for (const auto& [name, rank] : ranks_gone) {
      CKPT_RETURN_IF_ERROR(txn.Delete(Table::kRanks, keys::Rank(name, rank)));
      touched[name];
      ++r.pending_ranks_removed;
    }
    for (size_t i = 0; i < ranks_new.size(); ++i) {
      const auto& [name, rank] = ranks_new[i];
      if (!rank_objects[i].ok()) {
        if (!rank_objects[i].status().IsNotFound()) r.problems.push_back("skipped " + rank_objects[i].status().message());
        continue;
      }
      CKPT_RETURN_IF_ERROR(txn.Put(Table::kRanks, keys::Rank(name, rank), EncodeRank(rank_objects[i]->record)));
      auto& header = touched[name];
      if (!header) header = rank_objects[i]->header;
      ++r.pending_ranks_added;
    }
    for (auto& [name, header] : touched) {
      CKPT_ASSIGN_OR_RETURN(auto raw, txn.Get(Table::kCheckpoints, keys::Checkpoint(name)));
      std::optional<CheckpointRecord> current;
      if (raw) {
        CKPT_ASSIGN_OR_RETURN(current, DecodeCheckpoint(*raw));
      }
      if (current && current->state == CheckpointState::kCommitted) continue;
      if (!current && !header) continue;
      std::vector<uint32_t> ranks;
      CKPT_RETURN_IF_ERROR(txn.Scan(Table::kRanks, keys::MemberPrefix(name), [&](std::string_view k, std::string_view) {
        ranks.push_back(RankOfKey(k));
        return true;
      }));
      if (ranks.empty()) {
        CKPT_RETURN_IF_ERROR(txn.Delete(Table::kCheckpoints, keys::Checkpoint(name)));
        continue;
      }
      CheckpointRecord rec = current ? *current : *header;
      rec.state = CheckpointState::kPending;
      std::sort(ranks.begin(), ranks.end());
      rec.committed_ranks = std::move(ranks);
      if (rec.committed_ranks.back() >= rec.world_size) continue;  // a rank object disagrees; commit reports it
      CKPT_RETURN_IF_ERROR(txn.Put(Table::kCheckpoints, keys::Checkpoint(name), EncodeCheckpoint(rec)));
    }
    report.packs_added = r.packs_added;
    report.packs_removed = r.packs_removed;
    report.chunks_added = r.chunks_added;
    report.checkpoints_added = r.checkpoints_added;
    report.checkpoints_removed = r.checkpoints_removed;
    report.pending_ranks_added = r.pending_ranks_added;
    report.pending_ranks_removed = r.pending_ranks_removed;
    report.problems = std::move(r.problems);
    return Status::OK();
  });
  CKPT_RETURN_IF_ERROR(st);
  if (report.packs_removed || report.checkpoints_removed) cache->Clear();
  last_sync = report;
  return report;
}

}  // namespace ckptfs
