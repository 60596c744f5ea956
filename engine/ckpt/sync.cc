// Bringing the catalog of a repository on an object store up to date with
// the store, which is the truth (docs/DESIGN.md "Repositories on S3").
//
// The catalog mirrors three listings: packs/ (chunk locations from each
// pack's index), manifests/ (committed checkpoints) and pending/ (the ranks
// of checkpoints not yet visible). Each sync reads only the objects the
// catalog lacks, and a plain sync (SyncScope::kCheckpoints) not even the
// indexes of new packs: it remembers them for IndexPacks, which readers
// call. A pending rank's records are read only for gc, which must count
// them as references (SyncScope::kReferences); other syncs read one rank
// object per new pending checkpoint, for its world size and step. So a
// save's requests grow neither with the ranks in flight nor with the packs
// other ranks wrote.
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
#include "ckpt/store_sync.h"
#include "core/encoding.h"
#include "core/thread_pool.h"
#include "store/pack.h"

namespace ckptfs {
namespace {

// The rank of a kRanks key (name \0 rank, u32 big-endian).
uint32_t RankOfKey(std::string_view key) {
  uint32_t r = 0;
  for (size_t i = key.size() - 4; i < key.size(); ++i) r = (r << 8) | static_cast<uint8_t>(key[i]);
  return r;
}

using RankSets = std::map<std::string, std::set<uint32_t>>;  // checkpoint -> ranks

struct KnownState {
  std::set<std::string> packs;
  std::set<std::string> reindex;  // known packs whose index must be read again (kReindexPackPrefix)
  std::set<std::string> committed;
  std::map<std::string, std::string> identity;  // of each committed one (CheckpointIdentity)
  std::map<std::string, std::string> tags;      // the listed tag each was read under
  std::set<std::string> retired;  // catalog names "NAME/TOKEN" (lease.h)
  RankSets pending;  // pending checkpoints and the ranks their records list
  RankSets records;  // pending ranks whose records are in kRanks
};

Result<KnownState> ReadKnown(LmdbEnv& catalog) {
  KnownState k;
  CKPT_RETURN_IF_ERROR(catalog.Read([&](const ReadTxn& txn) -> Status {
    CKPT_RETURN_IF_ERROR(txn.Scan(Table::kPacks, "", [&](std::string_view key, std::string_view) {
      k.packs.emplace(key);
      return true;
    }));
    CKPT_RETURN_IF_ERROR(ScanDecoded<CheckpointRecord>(txn, Table::kCheckpoints, "", DecodeCheckpoint,
                                                       [&](std::string_view key, CheckpointRecord&& c) {
                                                         if (keys::IsRetiredCheckpoint(key)) {
                                                           k.retired.emplace(key);
                                                         } else if (c.state == CheckpointState::kCommitted) {
                                                           k.identity.emplace(c.name, CheckpointIdentity(c));
                                                           k.committed.insert(c.name);
                                                         } else {
                                                           k.pending[c.name].insert(c.committed_ranks.begin(),
                                                                                    c.committed_ranks.end());
                                                         }
                                                         return true;
                                                       }));
    CKPT_RETURN_IF_ERROR(txn.Scan(Table::kMeta, keys::kManifestTagPrefix, [&](std::string_view key, std::string_view v) {
      k.tags.emplace(key.substr(std::strlen(keys::kManifestTagPrefix)), v);
      return true;
    }));
    CKPT_RETURN_IF_ERROR(txn.Scan(Table::kMeta, keys::kReindexPackPrefix, [&](std::string_view key, std::string_view) {
      k.reindex.emplace(key.substr(std::strlen(keys::kReindexPackPrefix)));
      return true;
    }));
    return txn.Scan(Table::kRanks, "", [&](std::string_view key, std::string_view) {
      if (key.size() > 5) k.records[keys::CheckpointOfKey(key)].insert(RankOfKey(key));
      return true;
    });
  }));
  return k;
}

// a - b: the elements of sorted `a` missing from sorted `b`.
template <typename Set>
std::vector<typename Set::value_type> Missing(const Set& a, const Set& b) {
  std::vector<typename Set::value_type> out;
  std::set_difference(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(out));
  return out;
}

// Fetches objects in parallel: out[i] = read(i).
template <typename T>
std::vector<Result<T>> FetchAll(RepositoryImpl& repo, size_t n, const std::function<Result<T>(size_t)>& read) {
  std::vector<Result<T>> out(n, Status::Internal("not read"));
  ParallelFor(repo.IoPool(), n, repo.io_threads, [&](size_t i) { out[i] = read(i); });
  return out;
}

}  // namespace

namespace {
Result<Manifest> DecodeManifestObject(std::string_view data, const std::string& name) {
  CKPT_ASSIGN_OR_RETURN(Manifest m, DecodeManifest(data));
  if (m.checkpoint.name != name) return Status::Corruption("it names checkpoint '" + m.checkpoint.name + "'");
  return m;
}

constexpr uint32_t kListingMagic = 0x334b4343;  // "CCK3"
}  // namespace

Result<Manifest> ReadManifestObject(Backend& backend, const std::string& key, const std::string& name) {
  CKPT_ASSIGN_OR_RETURN(std::string data, backend.ReadAll(key));
  return DecodeManifestObject(data, name);
}

std::string EncodeStoreListing(const StoreListing& listing) {
  Encoder e;
  e.U32(kListingMagic);
  for (const auto* keys : {&listing.pending, &listing.manifests, &listing.packs}) {
    e.Varint(keys->size());
    for (const auto& k : *keys) e.String(k);
  }
  e.Varint(listing.manifest_objects.size());
  for (const auto& [name, bytes] : listing.manifest_objects) {
    e.String(name);
    e.String(bytes);
  }
  e.Varint(listing.manifest_tags.size());
  for (const auto& t : listing.manifest_tags) e.String(t);
  e.Varint(listing.pack_indexes.size());
  for (const SealedPack& pack : listing.pack_indexes) {
    e.String(pack.id);
    e.U64(pack.size);
    e.Varint(pack.entries.size());
    for (const PackIndexEntry& entry : pack.entries) {
      e.Bytes(entry.id.bytes.data(), entry.id.bytes.size());
      e.U64(entry.location.offset);
      e.U32(entry.location.stored_len);
      e.U32(entry.location.raw_len);
      e.U8(static_cast<uint8_t>(entry.location.codec));
    }
  }
  return e.Take();
}

Result<StoreListing> DecodeStoreListing(std::string_view data) {
  Decoder d(data);
  uint32_t magic = 0;
  CKPT_RETURN_IF_ERROR(d.U32(&magic));
  if (magic != kListingMagic) return Status::Corruption("not a store listing");
  StoreListing out;
  // Each entry takes at least one byte: a count beyond what is left is
  // refused before anything is reserved.
  auto count = [&](uint64_t* n) -> Status {
    CKPT_RETURN_IF_ERROR(d.Varint(n));
    if (*n > d.remaining()) return Status::Corruption("a store listing's count exceeds its bytes");
    return Status::OK();
  };
  for (auto* keys : {&out.pending, &out.manifests, &out.packs}) {
    uint64_t n;
    CKPT_RETURN_IF_ERROR(count(&n));
    keys->resize(n);
    for (auto& k : *keys) CKPT_RETURN_IF_ERROR(d.String(&k));
  }
  uint64_t n;
  CKPT_RETURN_IF_ERROR(count(&n));
  out.manifest_objects.resize(n);
  for (auto& [name, bytes] : out.manifest_objects) {
    CKPT_RETURN_IF_ERROR(d.String(&name));
    CKPT_RETURN_IF_ERROR(d.String(&bytes));
  }
  CKPT_RETURN_IF_ERROR(count(&n));
  if (n != 0 && n != out.manifests.size()) return Status::Corruption("a store listing's tags do not match its manifests");
  out.manifest_tags.resize(n);
  for (auto& t : out.manifest_tags) CKPT_RETURN_IF_ERROR(d.String(&t));
  // The packs' indexes, checked as a pack's own index is (an entry takes
  // 33 bytes).
  CKPT_RETURN_IF_ERROR(count(&n));
  out.pack_indexes.resize(n);
  for (SealedPack& pack : out.pack_indexes) {
    CKPT_RETURN_IF_ERROR(d.String(&pack.id));
    CKPT_RETURN_IF_ERROR(d.U64(&pack.size));
    uint64_t entries = 0;
    CKPT_RETURN_IF_ERROR(d.Varint(&entries));
    if (entries > d.remaining() / 33 || pack.size < kPackHeaderSize + kPackFooterSize ||
        entries > (pack.size - kPackHeaderSize - kPackFooterSize) / kPackIndexEntrySize) {
      return Status::Corruption("a store listing's index of pack " + pack.id + " is malformed");
    }
    const uint64_t data_end = pack.size - kPackFooterSize - entries * kPackIndexEntrySize;
    pack.entries.resize(entries);
    for (uint64_t i = 0; i < entries; ++i) {
      PackIndexEntry& entry = pack.entries[i];
      uint8_t codec = 0;
      CKPT_RETURN_IF_ERROR(d.Bytes(entry.id.bytes.data(), entry.id.bytes.size()));
      CKPT_RETURN_IF_ERROR(d.U64(&entry.location.offset));
      CKPT_RETURN_IF_ERROR(d.U32(&entry.location.stored_len));
      CKPT_RETURN_IF_ERROR(d.U32(&entry.location.raw_len));
      CKPT_RETURN_IF_ERROR(d.U8(&codec));
      if (Status bad = CheckIndexEntry(entry, codec, data_end, i); !bad.ok()) {
        return Status::Corruption("a store listing's index of pack " + pack.id + ": " + bad.message());
      }
      entry.location.codec = static_cast<Codec>(codec);
      entry.location.pack = pack.id;
    }
  }
  if (!d.done()) return Status::Corruption("a store listing has trailing bytes");
  return out;
}

Result<PendingRank> ReadPendingRank(Backend& backend, const std::string& name, uint32_t rank) {
  const std::string key = keys::PendingRankObject(name, rank);
  CKPT_ASSIGN_OR_RETURN(std::string data, backend.ReadAll(key));
  auto m = DecodeManifest(data);
  if (m.ok() && (m->checkpoint.name != name || m->checkpoint.state != CheckpointState::kPending ||
                 m->checkpoint.committed_ranks != std::vector<uint32_t>{rank})) {
    m = Status::Corruption("it does not describe rank " + std::to_string(rank) + " of checkpoint '" + name + "'");
  }
  if (!m.ok()) return m.status().WithContext("rank object " + key);
  return PendingRank{std::move(m->checkpoint), RankRecord{rank, std::move(m->tensors), std::move(m->blobs)}};
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

Result<SyncReport> StoreSync::Sync(SyncScope scope, StoreListing* capture, const StoreListing* given) {
  if ((capture || given) && scope != SyncScope::kCheckpoints) {
    return Status::InvalidArgument("only a checkpoints sync is shared");
  }
  std::lock_guard lock(mu_);
  LmdbEnv* catalog = repo_.catalog.get();
  Backend* backend = repo_.backend.get();
  const bool checkpoints = scope != SyncScope::kPacks;
  CKPT_ASSIGN_OR_RETURN(KnownState known, ReadKnown(*catalog));
  std::vector<std::string> pending_keys, manifest_keys, manifest_tags, retired_keys, pack_keys;
  if (given) {
    pending_keys = given->pending;
    manifest_keys = given->manifests;
    manifest_tags = given->manifest_tags;
  } else if (checkpoints) {
    CKPT_ASSIGN_OR_RETURN(pending_keys, backend->List(keys::kPendingPrefix));
    CKPT_ASSIGN_OR_RETURN(auto listed, backend->ListTagged(keys::kManifestPrefix));
    for (ListedObject& o : listed) {
      manifest_keys.push_back(std::move(o.key));
      manifest_tags.push_back(std::move(o.tag));
    }
  }
  manifest_tags.resize(manifest_keys.size());  // a listing shared without tags
  // Removed checkpoints kept for their readers matter to gc only.
  const bool retired = scope == SyncScope::kReferences;
  if (retired) {
    CKPT_ASSIGN_OR_RETURN(retired_keys, backend->List(keys::kRetiredPrefix));
  }
  if (given) {
    pack_keys = given->packs;
  } else {
    CKPT_ASSIGN_OR_RETURN(pack_keys, backend->List(keys::kPackPrefix));
  }
  if (capture) {
    capture->pending = pending_keys;
    capture->manifests = manifest_keys;
    capture->manifest_tags = manifest_tags;
    capture->packs = pack_keys;
  }
  uint64_t objects_read = 0;
  // A listing taken elsewhere (SyncFrom) may predate what this host's
  // catalog recorded since: a commit of this host that finished after the
  // listing was taken (an asynchronous save's, or another rank's of the
  // same save). What the catalog knows and such a listing lacks is asked of
  // the store, one HEAD each (none in the usual case), and only what is
  // really gone counts as removed. A listing this process takes itself is
  // read after the catalog, so it needs no such check. `still_there`: of
  // `names`, those whose object (key_of(name)) the store still has, asked
  // in parallel.
  auto still_there = [&](const std::vector<std::string>& names,
                         const std::function<std::string(const std::string&)>& key_of) -> Result<std::vector<std::string>> {
    auto sizes = FetchAll<uint64_t>(repo_, names.size(), [&](size_t i) { return backend->Size(key_of(names[i])); });
    std::vector<std::string> there;
    for (size_t i = 0; i < names.size(); ++i) {
      if (sizes[i].ok()) {
        there.push_back(names[i]);
      } else if (!sizes[i].status().IsNotFound()) {
        return sizes[i].status().WithContext("checking " + key_of(names[i]) + " against a shared store listing");
      }
    }
    return there;
  };

  // ---- packs ----
  std::set<std::string> listed_packs;
  for (const auto& key : pack_keys) {
    std::string id;
    if (ParsePackKey(key, &id)) listed_packs.insert(id);
  }
  if (given) {
    CKPT_ASSIGN_OR_RETURN(auto there, still_there(Missing(known.packs, listed_packs), PackKey));
    listed_packs.insert(there.begin(), there.end());
  }
  const std::vector<std::string> gone_packs = Missing(known.packs, listed_packs);
  // Chunks of a removed pack may live on in others (gc moved them, or two
  // hosts stored the same chunk): re-read every index then, so the catalog
  // stays the union of the pack indexes.
  // So are known packs whose re-reading failed before (their markers):
  // until read, chunks that may live only in them are missing here.
  std::vector<std::string> fresh_packs;
  if (gone_packs.empty()) {
    std::set<std::string> fresh;
    for (const auto& id : Missing(listed_packs, known.packs)) fresh.insert(id);
    for (const auto& id : known.reindex) {
      if (listed_packs.count(id)) fresh.insert(id);
    }
    fresh_packs.assign(fresh.begin(), fresh.end());
  } else {
    fresh_packs.assign(listed_packs.begin(), listed_packs.end());
  }
  // Every listed pack the catalog lacks is read now, or left for IndexPacks.
  const bool reads_indexes = scope != SyncScope::kCheckpoints || !gone_packs.empty();
  std::vector<Result<SealedPack>> indexes;
  if (!reads_indexes) {
    // Those whose index the listing's sharer read are recorded from it;
    // the rest are read when needed (IndexPacks).
    std::map<std::string, const SealedPack*> shared;
    if (given) {
      for (const SealedPack& pack : given->pack_indexes) shared[pack.id] = &pack;
    }
    std::vector<std::string> from_sharer;
    unindexed_packs_.clear();
    for (auto& id : fresh_packs) {
      auto it = shared.find(id);
      if (it == shared.end()) {
        unindexed_packs_.push_back(std::move(id));
      } else {
        indexes.emplace_back(*it->second);
        from_sharer.push_back(std::move(id));
      }
    }
    fresh_packs = std::move(from_sharer);
  } else {
    indexes = FetchAll<SealedPack>(repo_, fresh_packs.size(),
                                   [&](size_t i) { return ReadPackIndex(backend, fresh_packs[i], repo_.config.chunk_size); });
    objects_read += fresh_packs.size();
  }

  // ---- manifests ----
  std::set<std::string> listed_committed;
  std::map<std::string, std::string> listed_tags;
  for (size_t i = 0; i < manifest_keys.size(); ++i) {
    std::string name;
    if (!keys::ParseManifestObject(manifest_keys[i], &name)) continue;
    listed_committed.insert(name);
    if (!manifest_tags[i].empty()) listed_tags[name] = manifest_tags[i];
  }
  if (given && checkpoints) {
    CKPT_ASSIGN_OR_RETURN(auto there, still_there(Missing(known.committed, listed_committed),
                                                  [](const std::string& name) { return keys::ManifestObject(name); }));
    listed_committed.insert(there.begin(), there.end());
  }
  const std::vector<std::string> removed = checkpoints ? Missing(known.committed, listed_committed)
                                                       : std::vector<std::string>{};
  const std::vector<std::string> added = Missing(listed_committed, known.committed);
  // A name this host knows may have been removed and saved again elsewhere
  // since: its manifest object then lists under another tag. Those, and
  // those known without a tag (recorded before tags were kept), are read
  // again, and the catalog's record is replaced where the manifest is of
  // another checkpoint (CheckpointIdentity). Names listed without a tag (a
  // backend that cannot tell) are taken as they are.
  std::vector<std::string> recheck;
  for (const auto& [name, tag] : listed_tags) {
    if (!known.committed.count(name)) continue;
    const auto had = known.tags.find(name);
    if (had == known.tags.end() || had->second != tag) recheck.push_back(name);
  }
  std::vector<std::string> fetch = added;
  fetch.insert(fetch.end(), recheck.begin(), recheck.end());
  std::map<std::string_view, std::string_view> given_manifests;
  if (given) {
    for (const auto& [name, bytes] : given->manifest_objects) given_manifests.emplace(name, bytes);
  }
  std::vector<std::string> fetched_bytes(capture ? fetch.size() : 0);
  std::atomic<uint64_t> manifest_gets{0};
  // A name this host knows is read from the store, not from a shared
  // listing that may predate this host's own commits.
  auto manifests = FetchAll<Manifest>(repo_, fetch.size(), [&](size_t i) -> Result<Manifest> {
    auto it = i < added.size() ? given_manifests.find(fetch[i]) : given_manifests.end();
    if (it != given_manifests.end()) {
      auto m = DecodeManifestObject(it->second, fetch[i]);
      if (!m.ok()) return m.status().WithContext("the shared manifest of '" + fetch[i] + "'");
      return m;
    }
    manifest_gets.fetch_add(1, std::memory_order_relaxed);
    auto data = backend->ReadAll(keys::ManifestObject(fetch[i]));
    if (!data.ok()) return data.status();
    if (capture) fetched_bytes[i] = *data;
    return DecodeManifestObject(*data, fetch[i]);
  });
  objects_read += manifest_gets.load();
  // A manifest listed but not read (a request that failed, throttling past
  // its retries) fails the sync: skipped, its checkpoint would look absent
  // to this host ("not found") until the next sync, though it is committed.
  // Only one removed since the listing (NotFound) or damaged (Corruption,
  // a problem of the report) is passed over.
  for (size_t i = 0; i < fetch.size(); ++i) {
    const Status& st = manifests[i].status();
    if (!st.ok() && !st.IsNotFound() && !st.IsCorruption()) {
      return st.WithContext("reading the manifest of checkpoint '" + fetch[i] + "'");
    }
  }
  if (capture) {
    for (size_t i = 0; i < fetch.size(); ++i) {
      if (manifests[i].ok() && !fetched_bytes[i].empty()) {
        capture->manifest_objects.emplace_back(fetch[i], std::move(fetched_bytes[i]));
      }
    }
  }

  // ---- removed checkpoints kept for readers ----
  std::set<std::string> listed_retired;
  for (const auto& key : retired_keys) {
    std::string name;
    if (keys::ParseRetiredObject(key, &name)) listed_retired.insert(name);
  }
  const std::vector<std::string> retired_gone = retired ? Missing(known.retired, listed_retired)
                                                        : std::vector<std::string>{};
  const std::vector<std::string> retired_new = Missing(listed_retired, known.retired);
  auto retired_manifests = FetchAll<Manifest>(repo_, retired_new.size(), [&](size_t i) -> Result<Manifest> {
    const std::string key = keys::RetiredObject(retired_new[i]);
    auto m = ReadManifestObject(*backend, key, keys::BaseName(retired_new[i]));
    if (!m.ok()) return m.status().WithContext("removed checkpoint " + key);
    return m;
  });
  objects_read += retired_new.size();

  // ---- pending checkpoints ----
  RankSets listed_pending;
  for (const auto& key : pending_keys) {
    std::string name;
    uint32_t rank;
    if (keys::ParsePendingRankObject(key, &name, &rank) && !listed_committed.count(name)) {
      listed_pending[name].insert(rank);
    }
  }
  if (given) {
    std::vector<std::string> unlisted;  // pending rank objects, by key
    for (const auto& [name, ranks] : known.pending) {
      if (listed_committed.count(name)) continue;
      const auto now = listed_pending.find(name);
      for (uint32_t rank : ranks) {
        if (now == listed_pending.end() || !now->second.count(rank)) {
          unlisted.push_back(keys::PendingRankObject(name, rank));
        }
      }
    }
    CKPT_ASSIGN_OR_RETURN(auto there, still_there(unlisted, [](const std::string& key) { return key; }));
    for (const auto& key : there) {
      std::string name;
      uint32_t rank;
      if (keys::ParsePendingRankObject(key, &name, &rank)) listed_pending[name].insert(rank);
    }
  }
  // Rank objects to read: every rank whose records the catalog lacks (for
  // gc), else the first rank of each pending checkpoint it does not know.
  std::vector<std::pair<std::string, uint32_t>> to_read;
  for (const auto& [name, ranks] : listed_pending) {
    const auto have = known.records.find(name);
    bool reading = false;
    if (scope == SyncScope::kReferences) {
      for (uint32_t r : ranks) {
        if (have == known.records.end() || !have->second.count(r)) {
          to_read.emplace_back(name, r);
          reading = true;
        }
      }
    }
    if (!reading && !known.pending.count(name)) to_read.emplace_back(name, *ranks.begin());
  }
  auto rank_objects = FetchAll<PendingRank>(repo_, to_read.size(), [&](size_t i) {
    return ReadPendingRank(*backend, to_read[i].first, to_read[i].second);
  });
  objects_read += to_read.size();

  // ---- one transaction ----
  SyncReport report;
  // Fresh packs whose index could not be read for a reason that may pass
  // (the store failing): IndexPacks tries them again. Gone and damaged
  // ones are not retried (the damaged show as missing chunks in verify).
  std::vector<std::string> retry;
  const std::set<std::string> gone_set(gone_packs.begin(), gone_packs.end());
  Status st = catalog->Update([&](WriteTxn& txn) -> Status {
    SyncReport r;
    r.objects_read = objects_read;
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
    // Markers of packs gone from the listing go with them.
    for (const auto& id : known.reindex) {
      if (!listed_packs.count(id)) CKPT_RETURN_IF_ERROR(txn.Delete(Table::kMeta, keys::ReindexPack(id)));
    }
    for (size_t i = 0; i < fresh_packs.size(); ++i) {
      const bool marked = known.reindex.count(fresh_packs[i]) > 0;
      if (!indexes[i].ok()) {
        // Removed since the listing (a gc elsewhere) is not a problem.
        const Status& bad = indexes[i].status();
        if (!bad.IsNotFound()) r.problems.push_back("skipped pack " + fresh_packs[i] + ": " + bad.message());
        const bool may_pass = !bad.IsNotFound() && !bad.IsCorruption();
        if (may_pass) retry.push_back(fresh_packs[i]);
        // A known pack read again (another pack went away, and chunks of
        // it may live only in this one now) stays marked until it is read,
        // whatever this process does meanwhile: a later sync would
        // otherwise take it for indexed, and those chunks stay missing.
        if (may_pass && known.packs.count(fresh_packs[i]) && !marked) {
          CKPT_RETURN_IF_ERROR(txn.Put(Table::kMeta, keys::ReindexPack(fresh_packs[i]), ""));
        } else if (!may_pass && marked) {
          CKPT_RETURN_IF_ERROR(txn.Delete(Table::kMeta, keys::ReindexPack(fresh_packs[i])));
        }
        continue;
      }
      if (marked) CKPT_RETURN_IF_ERROR(txn.Delete(Table::kMeta, keys::ReindexPack(fresh_packs[i])));
      CKPT_ASSIGN_OR_RETURN(uint64_t chunks, RecordPack(txn, *indexes[i]));
      r.chunks_added += chunks;
      if (!known.packs.count(fresh_packs[i])) ++r.packs_added;
    }
    if (!checkpoints) {
      report = std::move(r);
      return Status::OK();
    }

    for (const auto& name : removed) {
      CKPT_RETURN_IF_ERROR(DeleteCheckpointRecords(txn, name));
      CKPT_RETURN_IF_ERROR(txn.Delete(Table::kMeta, keys::ManifestTag(name)));
    }
    r.checkpoints_removed = removed.size();
    for (const auto& name : retired_gone) CKPT_RETURN_IF_ERROR(DeleteCheckpointRecords(txn, name));
    for (size_t i = 0; i < retired_new.size(); ++i) {
      if (!retired_manifests[i].ok()) {
        if (retired_manifests[i].status().IsNotFound()) continue;  // collected since the listing
        return retired_manifests[i].status();  // gc must know every reference
      }
      CKPT_RETURN_IF_ERROR(RecordManifestAs(txn, *retired_manifests[i], retired_new[i]));
    }
    CKPT_ASSIGN_OR_RETURN(auto raw_seq, txn.Get(Table::kMeta, keys::kNextSequenceKey));
    uint64_t next_seq = 1;
    if (raw_seq) {
      CKPT_ASSIGN_OR_RETURN(next_seq, DecodeSequence(*raw_seq));
    }
    const uint64_t seq_before = next_seq;
    for (size_t i = 0; i < fetch.size(); ++i) {
      const std::string& name = fetch[i];
      if (!manifests[i].ok()) {
        if (!manifests[i].status().IsNotFound()) {
          r.problems.push_back("skipped manifest " + keys::ManifestObject(name) + ": " +
                               manifests[i].status().message());
        }
        continue;
      }
      const auto tag = listed_tags.find(name);
      if (tag != listed_tags.end()) CKPT_RETURN_IF_ERROR(txn.Put(Table::kMeta, keys::ManifestTag(name), tag->second));
      const bool known_name = i >= added.size();
      if (known_name && known.identity[name] == CheckpointIdentity(manifests[i]->checkpoint)) continue;  // the same one
      // Its pending state, or the checkpoint of that name removed since.
      CKPT_RETURN_IF_ERROR(DeleteCheckpointRecords(txn, name));
      CKPT_RETURN_IF_ERROR(RecordManifest(txn, *manifests[i]));
      next_seq = std::max(next_seq, manifests[i]->checkpoint.sequence + 1);
      ++r.checkpoints_added;
      if (known_name) ++r.checkpoints_removed;
    }
    if (next_seq != seq_before) CKPT_RETURN_IF_ERROR(txn.Put(Table::kMeta, keys::kNextSequenceKey, EncodeSequence(next_seq)));

    // Pending ranks: records of ranks gone are dropped, records read are
    // added, and each pending checkpoint's record lists the ranks now in.
    for (const auto& [name, ranks] : known.records) {
      const auto now = listed_pending.find(name);
      for (uint32_t rank : ranks) {
        if (now == listed_pending.end() || !now->second.count(rank)) {
          CKPT_RETURN_IF_ERROR(txn.Delete(Table::kRanks, keys::Rank(name, rank)));
        }
      }
    }
    std::map<std::string, CheckpointRecord> headers;
    for (size_t i = 0; i < to_read.size(); ++i) {
      const auto& [name, rank] = to_read[i];
      if (!rank_objects[i].ok()) {
        const Status& bad = rank_objects[i].status();
        if (bad.IsNotFound()) continue;  // committed or removed since the listing
        // gc must know every reference: an unreadable rank stops it.
        if (scope == SyncScope::kReferences) return bad;
        r.problems.push_back("skipped " + bad.message());
        continue;
      }
      if (scope == SyncScope::kReferences) {
        CKPT_RETURN_IF_ERROR(txn.Put(Table::kRanks, keys::Rank(name, rank), EncodeRank(rank_objects[i]->record)));
      }
      headers.emplace(name, rank_objects[i]->header);
    }
    std::set<std::string> names;
    for (const auto& [name, ranks] : known.pending) names.insert(name);
    for (const auto& [name, ranks] : listed_pending) names.insert(name);
    for (const auto& name : names) {
      if (listed_committed.count(name)) continue;  // committed above
      const auto now = listed_pending.find(name);
      const auto before = known.pending.find(name);
      const std::set<uint32_t> none;
      const std::set<uint32_t>& ranks_now = now == listed_pending.end() ? none : now->second;
      const std::set<uint32_t>& ranks_before = before == known.pending.end() ? none : before->second;
      r.pending_ranks_added += Missing(ranks_now, ranks_before).size();
      r.pending_ranks_removed += Missing(ranks_before, ranks_now).size();
      if (ranks_now == ranks_before) continue;
      if (ranks_now.empty()) {
        CKPT_RETURN_IF_ERROR(DeleteCheckpointRecords(txn, name));
        continue;
      }
      CheckpointRecord rec;
      CKPT_ASSIGN_OR_RETURN(auto raw, txn.Get(Table::kCheckpoints, keys::Checkpoint(name)));
      if (raw) {
        CKPT_ASSIGN_OR_RETURN(rec, DecodeCheckpoint(*raw));
      } else if (auto h = headers.find(name); h != headers.end()) {
        rec = h->second;
      } else {
        continue;  // its rank object could not be read (reported above)
      }
      rec.committed_ranks.assign(ranks_now.begin(), ranks_now.end());
      if (rec.committed_ranks.back() >= rec.world_size) continue;  // a rank disagrees; its commit says so
      CKPT_RETURN_IF_ERROR(txn.Put(Table::kCheckpoints, keys::Checkpoint(name), EncodeCheckpoint(rec)));
    }
    report = std::move(r);
    return Status::OK();
  });
  CKPT_RETURN_IF_ERROR(st);
  // The rest are read. Packs left unindexed by an earlier sync that the
  // catalog came to know otherwise (this host's own commit recorded them)
  // were not fresh here, and are not left over either.
  if (reads_indexes) unindexed_packs_ = std::move(retry);
  if (report.packs_removed || report.checkpoints_removed) repo_.cache->Clear();
  return report;
}

Status StoreSync::IndexPacks(std::vector<SealedPack>* captured) {
  auto unreadable = [&](const std::string& why) {
    return Status::IOError("cannot read the index of " + std::to_string(unindexed_packs_.size()) + " pack(s) in " +
                           repo_.backend->Describe() + (why.empty() ? "" : ": " + why));
  };
  bool gone = false;
  {
    std::lock_guard lock(mu_);
    if (unindexed_packs_.empty()) return Status::OK();
    // The indexes of the packs the last sync listed, read without listing
    // again: a job whose ranks applied one shared listing lists nothing
    // here either. What was read is recorded; when one of them is gone (gc
    // on another host collected it, perhaps moving its chunks to packs
    // written since), the packs sync below lists and reads the indexes the
    // catalog still lacks.
    const std::vector<std::string> todo = unindexed_packs_;
    auto indexes = FetchAll<SealedPack>(repo_, todo.size(),
                                        [&](size_t i) {
                                          return ReadPackIndex(repo_.backend.get(), todo[i], repo_.config.chunk_size);
                                        });
    std::vector<std::string> failed;
    std::string first_failure;
    CKPT_RETURN_IF_ERROR(repo_.catalog->Update([&](WriteTxn& txn) -> Status {
      failed.clear();
      first_failure.clear();
      for (size_t i = 0; i < todo.size(); ++i) {
        if (!indexes[i].ok()) {
          // As in a sync: a damaged index is not read again (its chunks
          // show as missing in verify); other failures may pass.
          const Status& bad = indexes[i].status();
          gone = gone || bad.IsNotFound();
          if (bad.IsCorruption() || bad.IsNotFound()) continue;
          if (first_failure.empty()) first_failure = bad.message();
          failed.push_back(todo[i]);
          continue;
        }
        CKPT_RETURN_IF_ERROR(RecordPack(txn, *indexes[i]).status());
        CKPT_RETURN_IF_ERROR(txn.Delete(Table::kMeta, keys::ReindexPack(todo[i])));
      }
      return Status::OK();
    }));
    if (captured) {
      for (auto& index : indexes) {
        if (index.ok()) captured->push_back(std::move(index).value());
      }
    }
    unindexed_packs_ = std::move(failed);
    if (!gone) return unindexed_packs_.empty() ? Status::OK() : unreadable(first_failure);
  }
  // A packs-only sync reads every index the catalog lacks: those not read
  // above, and any pack written since.
  CKPT_ASSIGN_OR_RETURN(SyncReport report, Sync(SyncScope::kPacks));
  std::lock_guard lock(mu_);
  if (!unindexed_packs_.empty()) return unreadable(report.problems.empty() ? "" : report.problems.front());
  return Status::OK();
}

}  // namespace ckptfs
