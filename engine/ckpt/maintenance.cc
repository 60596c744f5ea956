// Verify and reindex.
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <unordered_map>

#include "backend/store_url.h"
#include "ckpt/repo_lock.h"
#include "ckpt/repository.h"
#include "ckpt/repository_impl.h"
#include "core/encoding.h"
#include "core/thread_pool.h"

namespace ckptfs {

namespace {
struct ChunkUse {
  std::string checkpoint;
  std::string member;
  uint32_t raw_len;
};
}  // namespace

Result<VerifyReport> Repository::Verify(const std::optional<std::string>& name, const ProgressFn& progress) {
  CKPT_RETURN_IF_ERROR(impl_->CheckProcess());
  // On an object store, verify what the store holds now: packs gc on
  // another host rewrote since this host's last sync are read where they
  // went, not reported missing at their old place.
  CKPT_RETURN_IF_ERROR(impl_->protocol->Sync().status());
  CKPT_RETURN_IF_ERROR(impl_->protocol->IndexPacks());
  VerifyReport report;
  std::vector<std::string> names;
  if (name) {
    names.push_back(*name);
  } else {
    CKPT_ASSIGN_OR_RETURN(auto all, ListCheckpoints(false));
    for (const auto& c : all) names.push_back(c.name);
  }
  // Chunk id -> every reference to it (checkpoint, member, length): a bad
  // chunk is reported against every checkpoint that uses it, and each
  // reference's length is checked against the stored chunk's.
  std::unordered_map<ChunkId, std::vector<ChunkUse>, ChunkIdHash> chunks;
  DirectFetcher direct(impl_->backend.get(), [this](const ChunkId& id) { return impl_->LookupChunk(id); },
                       impl_->buffers.get());
  for (const auto& n : names) {
    auto opened = OpenCheckpoint(n);
    if (!opened.ok() && opened.status().IsCorruption()) {
      // A damaged record is one problem; the other checkpoints still count.
      report.problems.push_back({n, "catalog", opened.status().message()});
      continue;
    }
    CKPT_ASSIGN_OR_RETURN(auto reader, std::move(opened));
    ++report.checkpoints;
    for (const auto& t : reader->tensors()) {
      ++report.tensors;
      Status st = CheckTiling(t, direct);
      if (!st.ok()) report.problems.push_back({n, "tensor '" + t.name + "'", st.message()});
      for (const auto& s : t.shards) {
        for (const auto& c : s.chunks) chunks[c.id].push_back(ChunkUse{n, "tensor '" + t.name + "'", c.raw_len});
      }
    }
    for (const auto& b : reader->blobs()) {
      for (const auto& c : b.chunks) chunks[c.id].push_back(ChunkUse{n, "blob '" + b.name + "'", c.raw_len});
    }
  }
  struct Item {
    ChunkId id;
    ChunkLocation loc;
    const std::vector<ChunkUse>* uses;  // null: no checkpoint references it
  };
  std::vector<Item> items;
  Status inner;
  CKPT_RETURN_IF_ERROR(impl_->catalog->Read([&](const ReadTxn& txn) -> Status {
    for (const auto& [id, uses] : chunks) {
      CKPT_ASSIGN_OR_RETURN(auto v, txn.Get(Table::kChunks, keys::Chunk(id)));
      if (!v) {
        for (const ChunkUse& use : uses) {
          report.problems.push_back({use.checkpoint, use.member, "chunk " + id.ToHex() + " is missing from the catalog"});
        }
        continue;
      }
      CKPT_ASSIGN_OR_RETURN(ChunkLocation loc, DecodeChunkLocation(*v));
      items.push_back({id, loc, &uses});
    }
    if (name) return Status::OK();
    // The whole repository: also chunks no checkpoint references, and packs.
    CKPT_RETURN_IF_ERROR(txn.Scan(Table::kChunks, "", [&](std::string_view k, std::string_view v) {
      auto key_id = keys::ChunkIdOfKey(k);
      if (!key_id.ok()) {
        inner = key_id.status();
        return false;
      }
      const ChunkId id = *key_id;
      if (chunks.count(id)) return true;
      auto loc = DecodeChunkLocation(v);
      if (!loc.ok()) {
        inner = loc.status();
        return false;
      }
      items.push_back({id, *loc, nullptr});
      return true;
    }));
    return txn.Scan(Table::kPacks, "", [&](std::string_view k, std::string_view v) {
      std::string pack(k);
      auto info = DecodePackInfo(v);
      Status st = info.status();
      const uint64_t size = info.ok() ? info->size : 0, count = info.ok() ? info->chunks : 0;
      if (st.ok()) {
        auto index = ReadPackIndex(impl_->backend.get(), pack);
        if (!index.ok()) {
          st = index.status();
        } else if (index->size != size || index->entries.size() != count) {
          st = Status::Corruption("pack " + pack + " does not match its catalog entry");
        }
      }
      if (!st.ok()) report.problems.push_back({"", "pack " + pack, st.message()});
      return true;
    });
  }));
  CKPT_RETURN_IF_ERROR(inner);
  if (!name) {
    // Manifests are what reindex rebuilds from: one that does not decode
    // would be skipped there, so it is a problem here.
    CKPT_ASSIGN_OR_RETURN(auto manifest_keys, impl_->backend->List(keys::kManifestPrefix));
    for (const auto& key : manifest_keys) {
      std::string checkpoint;
      if (!keys::ParseManifestObject(key, &checkpoint)) continue;
      auto data = impl_->backend->ReadAll(key);
      Status st = data.ok() ? DecodeManifest(*data).status() : data.status();
      if (!st.ok()) report.problems.push_back({checkpoint, "manifest " + key, st.message()});
    }
  }

  uint64_t total_bytes = 0;
  for (const auto& it : items) total_bytes += it.loc.raw_len;
  std::atomic<uint64_t> done{0};
  std::mutex mu;
  WaitGroup wg;
  wg.Add(items.size());
  for (const auto& it : items) {
    impl_->pool->Submit([&, item = &it] {
      BufferPool::Lease raw = impl_->buffers->Acquire(item->loc.raw_len);
      Status st = ReadChunk(impl_->backend.get(), item->id, item->loc, raw.first(item->loc.raw_len));
      uint64_t d = done.fetch_add(item->loc.raw_len) + item->loc.raw_len;
      static const std::vector<ChunkUse> kNoUse;
      const std::vector<ChunkUse>& uses = item->uses ? *item->uses : kNoUse;  // no copy per chunk
      {
        std::lock_guard lock(mu);
        if (!st.ok()) {
          VerifyReport::BadChunk bad{item->id, {}};
          std::optional<ChunkId> bad_id;
          if (st.IsCorruption()) bad_id = item->id;
          if (!item->uses) report.problems.push_back({"", "chunk", st.message(), bad_id});
          for (const ChunkUse& use : uses) {
            if (bad.checkpoints.empty() || bad.checkpoints.back() != use.checkpoint) {
              bad.checkpoints.push_back(use.checkpoint);
              report.problems.push_back({use.checkpoint, use.member, st.message(), bad_id});
            }
          }
          if (st.IsCorruption()) report.bad_chunks.push_back(std::move(bad));
        }
        for (const ChunkUse& use : uses) {
          if (use.raw_len == item->loc.raw_len) continue;
          report.problems.push_back({use.checkpoint, use.member,
                                     "references chunk " + item->id.ToHex() + " with length " +
                                         std::to_string(use.raw_len) + ", but the stored chunk has length " +
                                         std::to_string(item->loc.raw_len)});
        }
        if (progress) progress(d, total_bytes);
      }
      wg.Done();
    });
  }
  wg.Wait();
  report.chunks = items.size();
  report.bytes = total_bytes;
  return report;
}

namespace {
Status DeleteIfPresent(Backend& backend, const std::string& key) {
  Status st = backend.Delete(key);
  return st.IsNotFound() ? Status::OK() : st;
}
// The retired manifest object of committed checkpoint `m`, durable.
Status PutRetiredManifest(Backend& backend, const Manifest& m) {
  const std::string body = EncodeManifest(m);
  const std::string retired = keys::RetiredCheckpoint(m.checkpoint.name, m.checkpoint.committed_unix_ms);
  return backend.Put(keys::RetiredObject(retired), std::as_bytes(std::span(body)));
}
// Its records under the retired name.
Status RecordRetired(WriteTxn& txn, const Manifest& m) {
  return RecordManifestAs(txn, m, keys::RetiredCheckpoint(m.checkpoint.name, m.checkpoint.committed_unix_ms));
}
// Brings the catalog up to the store when what it holds under `name` is
// not what the store holds now (another host saved, removed or replaced
// it since this host's last sync): one request tells
// (CommitProtocol::IsCurrent). True when it synced.
Result<bool> CatchUpOn(RepositoryImpl& repo, const std::string& name) {
  CKPT_ASSIGN_OR_RETURN(auto rec, CommittedRecord(repo, name));
  CKPT_ASSIGN_OR_RETURN(bool current, repo.protocol->IsCurrent(name, rec ? &*rec : nullptr));
  if (current) return false;
  CKPT_RETURN_IF_ERROR(repo.protocol->Sync().status());
  return true;
}
}  // namespace

Result<std::optional<CheckpointRecord>> CommittedRecord(RepositoryImpl& repo, const std::string& name) {
  std::optional<CheckpointRecord> rec;
  CKPT_RETURN_IF_ERROR(repo.catalog->Read([&](const ReadTxn& txn) -> Status {
    CKPT_ASSIGN_OR_RETURN(auto v, txn.Get(Table::kCheckpoints, keys::Checkpoint(name)));
    if (!v) return Status::OK();
    CKPT_ASSIGN_OR_RETURN(CheckpointRecord r, DecodeCheckpoint(*v));
    if (r.state == CheckpointState::kCommitted) rec = std::move(r);
    return Status::OK();
  }));
  return rec;
}

Status Repository::RemoveCheckpoints(const std::vector<std::string>& names, bool missing_ok) {
  CKPT_RETURN_IF_ERROR(impl_->CheckProcess());
  std::set<std::string> unique(names.begin(), names.end());
  // What is removed is what the store holds under each name now: a host
  // whose catalog still had a version another host removed (and perhaps
  // saved again since) would otherwise retire that old version and delete
  // the manifest object of whatever the name holds now. A stale catalog
  // syncs first (CatchUpOn).
  for (const auto& n : unique) {
    if (keys::IsRetiredCheckpoint(n) || !ValidateCheckpointName(n).ok()) continue;
    CKPT_ASSIGN_OR_RETURN(bool synced, CatchUpOn(*impl_, n));
    if (synced) break;  // the catalog is the store's now, for every name
  }
  // All must exist before anything is touched. Committed ones are retired
  // (lease.h): their manifests, as the catalog has them, go to retired/.
  std::map<std::string, Manifest> committed;
  std::set<std::string> gone;  // with missing_ok: names no longer there
  CKPT_RETURN_IF_ERROR(impl_->catalog->Read([&](const ReadTxn& txn) -> Status {
    for (const auto& n : unique) {
      if (keys::IsRetiredCheckpoint(n)) return Status::NotFound("no checkpoint named '" + n + "'; nothing was removed");
      CKPT_ASSIGN_OR_RETURN(auto v, txn.Get(Table::kCheckpoints, keys::Checkpoint(n)));
      if (!v && missing_ok) {
        gone.insert(n);
        continue;
      }
      if (!v) return Status::NotFound("no checkpoint named '" + n + "'; nothing was removed");
      CKPT_ASSIGN_OR_RETURN(CheckpointRecord rec, DecodeCheckpoint(*v));
      if (rec.state != CheckpointState::kCommitted) continue;
      // One whose records are damaged cannot be read anyway: it is deleted.
      auto m = LoadManifest(txn, n);
      if (m.ok()) {
        committed[n] = std::move(m).value();
      } else if (!m.status().IsCorruption()) {
        return m.status();
      }
    }
    return Status::OK();
  }));
  for (const auto& n : gone) unique.erase(n);
  if (unique.empty()) return Status::OK();
  // Writing retired manifests is writing objects: like a save, rm holds the
  // gc lock shared (and on an object store a shared lock object), so gc's
  // sweep of temporary files never takes one it is writing.
  CKPT_ASSIGN_OR_RETURN(RepoLock gc_lock, RepoLock::Acquire(impl_->state_dir, RepoLock::Mode::kShared));
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<ObjectLock> store_lock, impl_->protocol->LockHosts(ObjectLock::Mode::kShared));
  // The retired manifest is durable before the manifest goes, and both
  // before the catalog changes: a crash in between leaves a checkpoint still
  // listed (rm again finishes it), never one whose readers lose their bytes.
  // A crash after the retired manifest was written leaves it for gc.
  for (const auto& n : unique) {
    if (auto it = committed.find(n); it != committed.end()) {
      CKPT_RETURN_IF_ERROR(PutRetiredManifest(*impl_->backend, it->second));
    }
    CKPT_RETURN_IF_ERROR(DeleteIfPresent(*impl_->backend, keys::ManifestObject(n)));
    // The ranks of a pending checkpoint, and those a crashed committer left.
    CKPT_RETURN_IF_ERROR(impl_->protocol->RemoveRankObjects(n));
  }
  return impl_->catalog->Update([&](WriteTxn& txn) -> Status {
    for (const auto& n : unique) {
      CKPT_RETURN_IF_ERROR(DeleteCheckpointRecords(txn, n));
      if (auto it = committed.find(n); it != committed.end()) CKPT_RETURN_IF_ERROR(RecordRetired(txn, it->second));
    }
    return Status::OK();
  });
}

// A replacement is renamed over its name the way rm retires a checkpoint
// (the old version's retired manifest durable first), then the name's
// manifest object is written over, and the catalog changes in one
// transaction: readers that hold the old version keep it (lease.h), and
// every other reader sees the old or the new version, whole.
Status PromoteReplacement(RepositoryImpl& repo, const std::string& name, const WriterOptions& options) {
  const std::string staged = keys::ReplacementCheckpoint(name);
  // What the name holds on the store now (another host may have saved or
  // removed it since this host's last sync): the version to retire.
  CKPT_RETURN_IF_ERROR(CatchUpOn(repo, name).status());
  CKPT_ASSIGN_OR_RETURN(std::optional<CheckpointRecord> had, CommittedRecord(repo, name));
  // A thinning replaces the version it read, and only that one.
  if (options.thins && (!had || had->sequence != *options.thins ||
                        had->committed_unix_ms != options.thins_committed_unix_ms)) {
    CKPT_RETURN_IF_ERROR(DropCommittedReplacement(repo, name));
    return Status::FailedPrecondition(std::string("checkpoint '") + name +
                                      "' changed while it was being thinned (" +
                                      (had ? "saved again" : "removed") + " meanwhile): it was left as it is");
  }
  std::optional<Manifest> old;
  Manifest fresh;
  CKPT_RETURN_IF_ERROR(repo.catalog->Read([&](const ReadTxn& txn) -> Status {
    if (had) {
      auto m = LoadManifest(txn, name);
      if (m.ok()) {
        old = std::move(m).value();
      } else if (!m.status().IsCorruption()) {  // a damaged one cannot be read anyway
        return m.status();
      }
    }
    CKPT_ASSIGN_OR_RETURN(fresh, LoadManifest(txn, staged));
    return Status::OK();
  }));
  if (fresh.checkpoint.state != CheckpointState::kCommitted) {
    return Status::Internal("the replacement of checkpoint '" + name + "' is not committed");
  }
  fresh.checkpoint.name = name;
  // Versions of one name retire under their commit times: distinct, and in
  // the order they were saved.
  if (old && options.thins) {
    // A thinned version keeps the whole one's place among the checkpoints.
    fresh.checkpoint.sequence = old->checkpoint.sequence;
    fresh.checkpoint.created_unix_ms = old->checkpoint.created_unix_ms;
    fresh.checkpoint.committed_unix_ms = old->checkpoint.committed_unix_ms + 1;
  }
  if (old) fresh.checkpoint.committed_unix_ms = std::max(fresh.checkpoint.committed_unix_ms, old->checkpoint.committed_unix_ms + 1);
  if (old) CKPT_RETURN_IF_ERROR(PutRetiredManifest(*repo.backend, *old));
  const std::string body = EncodeManifest(fresh);
  CKPT_RETURN_IF_ERROR(repo.backend->Put(keys::ManifestObject(name), std::as_bytes(std::span(body))));
  CKPT_RETURN_IF_ERROR(DeleteIfPresent(*repo.backend, keys::ManifestObject(staged)));
  return repo.catalog->Update([&](WriteTxn& txn) -> Status {
    CKPT_RETURN_IF_ERROR(DeleteCheckpointRecords(txn, name));
    if (old) CKPT_RETURN_IF_ERROR(RecordRetired(txn, *old));
    CKPT_RETURN_IF_ERROR(DeleteCheckpointRecords(txn, staged));
    CKPT_RETURN_IF_ERROR(RecordManifest(txn, fresh));
    // The name's manifest object changed: the next sync reads it again.
    CKPT_RETURN_IF_ERROR(txn.Delete(Table::kMeta, keys::ManifestTag(name)));
    return txn.Delete(Table::kMeta, keys::ManifestTag(staged));
  });
}

Status DropCommittedReplacement(RepositoryImpl& repo, const std::string& name) {
  const std::string staged = keys::ReplacementCheckpoint(name);
  CKPT_ASSIGN_OR_RETURN(auto committed, CommittedRecord(repo, staged));
  if (!committed) return Status::OK();
  // No reader opens a replacement by its name: nothing to retire.
  CKPT_RETURN_IF_ERROR(DeleteIfPresent(*repo.backend, keys::ManifestObject(staged)));
  CKPT_RETURN_IF_ERROR(repo.protocol->RemoveRankObjects(staged));
  return repo.catalog->Update([&](WriteTxn& txn) -> Status {
    CKPT_RETURN_IF_ERROR(DeleteCheckpointRecords(txn, staged));
    return txn.Delete(Table::kMeta, keys::ManifestTag(staged));
  });
}

Result<std::vector<RankProgress>> Repository::PendingRanks(const std::string& name) {
  CKPT_RETURN_IF_ERROR(impl_->CheckProcess());
  CKPT_RETURN_IF_ERROR(impl_->protocol->Sync().status());  // object stores: what the other hosts' ranks did
  CKPT_ASSIGN_OR_RETURN(auto all, ListCheckpoints(true));
  auto it = std::find_if(all.begin(), all.end(), [&](const CheckpointRecord& c) {
    return c.name == name && c.state != CheckpointState::kCommitted;
  });
  if (it == all.end()) return Status::NotFound("no pending checkpoint named '" + name + "'");
  return impl_->protocol->RankProgressOf(name, it->world_size);
}

Status DeleteCheckpointRecords(WriteTxn& txn, const std::string& name) {
  std::vector<std::pair<Table, std::string>> doomed;
  const std::string prefix = keys::MemberPrefix(name);
  for (Table t : {Table::kTensors, Table::kBlobs, Table::kRanks}) {
    CKPT_RETURN_IF_ERROR(txn.Scan(t, prefix, [&](std::string_view k, std::string_view) {
      doomed.emplace_back(t, std::string(k));
      return true;
    }));
  }
  for (const auto& [t, k] : doomed) CKPT_RETURN_IF_ERROR(txn.Delete(t, k));
  return txn.Delete(Table::kCheckpoints, keys::Checkpoint(name));
}

Result<ReindexReport> Repository::Reindex(const std::string& path, const ProgressFn& progress,
                                         const OpenOptions& options) {
  if (IsObjectStoreUrl(path)) return ReindexRemote(path, options);
  CKPT_ASSIGN_OR_RETURN(RepositoryConfig config, ReadRepositoryConfig(path));
  (void)config;
  ReindexReport report;
  CKPT_ASSIGN_OR_RETURN(auto backend, OpenLocalBackend(path + "/objects"));
  const std::string fresh = path + "/catalog.rebuild";
  std::error_code ec;
  std::filesystem::remove_all(fresh, ec);
  CKPT_ASSIGN_OR_RETURN(auto env, LmdbEnv::Open(fresh, true, 64ull << 20));

  CKPT_ASSIGN_OR_RETURN(auto pack_keys, backend->List(keys::kPackPrefix));
  CKPT_ASSIGN_OR_RETURN(auto manifest_keys, backend->List(keys::kManifestPrefix));
  const uint64_t total = pack_keys.size() + manifest_keys.size();
  uint64_t done = 0;
  uint64_t max_seq = 0;
  for (const auto& key : pack_keys) {
    std::string id;
    if (!ParsePackKey(key, &id)) continue;
    auto pack = ReadPackIndex(backend.get(), id);
    if (progress) progress(++done, total);
    if (!pack.ok()) {
      report.problems.push_back("skipped pack " + id + ": " + pack.status().message());
      continue;
    }
    CKPT_RETURN_IF_ERROR(env->Update([&](WriteTxn& txn) { return RecordPack(txn, *pack).status(); }));
    ++report.packs;
    report.chunks += pack->entries.size();
  }
  for (const auto& key : manifest_keys) {
    std::string name;
    if (progress) progress(++done, total);
    if (!keys::ParseManifestObject(key, &name)) continue;
    auto data = backend->ReadAll(key);
    if (!data.ok()) {
      report.problems.push_back("skipped manifest " + key + ": " + data.status().message());
      continue;
    }
    auto m = DecodeManifest(*data);
    if (!m.ok()) {
      report.problems.push_back("skipped manifest " + key + ": " + m.status().message());
      continue;
    }
    if (m->checkpoint.name != name) {
      report.problems.push_back("skipped manifest " + key + ": it names checkpoint '" + m->checkpoint.name + "'");
      continue;
    }
    CKPT_RETURN_IF_ERROR(env->Update([&](WriteTxn& txn) { return RecordManifest(txn, *m); }));
    max_seq = std::max(max_seq, m->checkpoint.sequence);
    ++report.checkpoints;
  }
  // Removed checkpoints kept for readers: their chunks stay live for gc.
  CKPT_ASSIGN_OR_RETURN(auto retired_keys, backend->List(keys::kRetiredPrefix));
  for (const auto& key : retired_keys) {
    std::string catalog_name;
    if (!keys::ParseRetiredObject(key, &catalog_name)) continue;
    auto m = ReadManifestObject(*backend, key, keys::BaseName(catalog_name));
    if (!m.ok()) {
      report.problems.push_back("skipped removed checkpoint " + key + ": " + m.status().message());
      continue;
    }
    CKPT_RETURN_IF_ERROR(env->Update([&](WriteTxn& txn) { return RecordManifestAs(txn, *m, catalog_name); }));
  }
  CKPT_RETURN_IF_ERROR(env->Update([&](WriteTxn& txn) -> Status {
    CKPT_RETURN_IF_ERROR(txn.Put(Table::kMeta, keys::kFormatVersionKey, EncodeFormatVersion(kFormatVersion)));
    return txn.Put(Table::kMeta, keys::kNextSequenceKey, EncodeSequence(max_seq + 1));
  }));
  env.reset();
  // Swap the rebuilt catalog in; the old one (if any) is removed last.
  const std::string current = path + "/catalog", old = path + "/catalog.old";
  std::filesystem::remove_all(old, ec);
  std::filesystem::rename(current, old, ec);
  std::filesystem::rename(fresh, current, ec);
  if (ec) return Status::IOError("installing the rebuilt catalog: " + ec.message());
  std::filesystem::remove_all(old, ec);
  return report;
}

}  // namespace ckptfs

namespace ckptfs {
namespace {
// The stored bytes of chunk `id` at `loc` of `backend`, when they decode to
// the chunk's bytes; an error otherwise.
Result<ChunkReplacement> ReadGoodCopy(Backend* backend, const ChunkId& id, const ChunkLocation& loc) {
  ChunkReplacement good{loc.codec, loc.raw_len, std::string(loc.stored_len, '\0')};
  CKPT_RETURN_IF_ERROR(ReadStoredChunk(backend, id, loc, std::as_writable_bytes(std::span(good.stored))));
  return good;
}
}  // namespace

Result<RepairReport> Repository::Repair(const VerifyReport& verified, std::span<Repository* const> sources,
                                        const std::function<void(const std::string&)>& on_phase) {
  CKPT_RETURN_IF_ERROR(impl_->CheckProcess());
  auto phase = [&](const std::string& what) {
    if (on_phase) on_phase(what);
  };
  RepairReport report;
  if (verified.bad_chunks.empty()) return report;
  CKPT_RETURN_IF_ERROR(impl_->protocol->IndexPacks());
  std::map<ChunkId, const VerifyReport::BadChunk*> wanted;
  std::map<ChunkId, ChunkLocation> bad_at;  // where the catalog has each now
  for (const auto& bad : verified.bad_chunks) {
    auto loc = impl_->LookupChunk(bad.id);
    if (loc.status().IsNotFound()) continue;  // collected since it was verified: nothing to repair
    CKPT_RETURN_IF_ERROR(loc.status());
    wanted.emplace(bad.id, &bad);
    bad_at.emplace(bad.id, *loc);
  }
  GcOptions gc;
  gc.on_phase = on_phase;
  auto found = [&](const ChunkId& id, ChunkReplacement good, std::string from) {
    gc.replace.emplace(id, std::move(good));
    report.repaired.push_back({id, std::move(from)});
    wanted.erase(id);
  };
  // 1. Other packs of this repository that hold the same chunk (two hosts,
  //    or two saves racing, may each have stored it).
  if (!wanted.empty()) {
    phase("looking for good copies in the repository's other packs");
    std::vector<std::string> packs;
    CKPT_RETURN_IF_ERROR(impl_->catalog->Read([&](const ReadTxn& txn) {
      return txn.Scan(Table::kPacks, "", [&](std::string_view k, std::string_view) {
        packs.emplace_back(k);
        return true;
      });
    }));
    for (const std::string& pack : packs) {
      if (wanted.empty()) break;
      auto index = ReadPackIndex(impl_->backend.get(), pack);
      if (!index.ok()) continue;  // verify reports a damaged pack on its own
      for (const PackIndexEntry& e : index->entries) {
        auto bad = bad_at.find(e.id);
        if (!wanted.count(e.id) || (e.location.pack == bad->second.pack && e.location.offset == bad->second.offset)) {
          continue;
        }
        auto good = ReadGoodCopy(impl_->backend.get(), e.id, e.location);
        if (good.ok()) found(e.id, std::move(good).value(), "pack " + pack);
      }
    }
  }
  // 2. Other repositories.
  for (Repository* source : sources) {
    if (wanted.empty()) break;
    RepositoryImpl& src = *source->impl_;
    CKPT_RETURN_IF_ERROR(src.CheckProcess());
    phase("looking for good copies in " + src.path);
    CKPT_RETURN_IF_ERROR(src.protocol->IndexPacks());
    for (auto it = wanted.begin(); it != wanted.end();) {
      const ChunkId id = (it++)->first;
      auto loc = src.LookupChunk(id);
      if (!loc.ok()) continue;
      auto good = ReadGoodCopy(src.backend.get(), id, *loc);
      if (good.ok()) found(id, std::move(good).value(), src.path);
    }
  }
  for (const auto& [id, bad] : wanted) report.unrepaired.push_back(*bad);
  if (gc.replace.empty()) return report;
  phase("storing " + std::to_string(gc.replace.size()) + " chunks again");
  gc.rewrite_below = 0;  // only the packs that hold a bad chunk
  CKPT_ASSIGN_OR_RETURN(GcReport rewritten, CollectGarbage(gc));
  report.packs_rewritten = rewritten.packs_rewritten;
  return report;
}

}  // namespace ckptfs
