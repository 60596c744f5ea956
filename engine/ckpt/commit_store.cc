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
// A commit that fails after step 2 began (the shards disagree, the store
// fails, an answer is lost) takes its own rank object and its claim back,
// each only if it still holds this commit's bytes: the checkpoint stays
// pending without this rank, which may commit again. A single lost answer
// never leaves a rank "already committed" that nobody completes.
// Ranks finishing together may all see every rank and all merge; the
// manifest is written with a conditional PUT (If-None-Match), so exactly one
// of them commits and the others stand down.
// A group's split commit (WriterOptions::await_ranks) changes who does
// step 3, not the objects: the ranks given the sharing rank's listing stop
// after step 2, and the sharing rank repeats its listing, with backoff,
// until every rank is in (or its wait runs out), then goes on as above.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <optional>
#include <set>
#include <thread>

#include "ckpt/commit.h"
#include "ckpt/lease.h"
#include "ckpt/repository_impl.h"
#include "ckpt/store_sync.h"
#include "core/json.h"
#include "core/random.h"
#include "core/text.h"

namespace ckptfs {
namespace {

class StoreCommit : public CommitProtocol {
 public:
  explicit StoreCommit(RepositoryImpl& repo) : repo_(repo), sync_(repo) {}

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

  // The store is the truth; this host's catalog catches up (sync.cc).
  Result<SyncReport> Sync(SyncScope scope, const PhaseFn& on_phase) override {
    if (on_phase && scope == SyncScope::kReferences) on_phase("reading every reference from the store");
    return sync_.Sync(scope);
  }
  Result<std::string> ShareSync(bool with_pack_indexes) override {
    StoreListing listing;
    CKPT_RETURN_IF_ERROR(sync_.Sync(SyncScope::kCheckpoints, &listing).status());
    if (with_pack_indexes) CKPT_RETURN_IF_ERROR(sync_.IndexPacks(&listing.pack_indexes));
    return EncodeStoreListing(listing);
  }
  Result<SyncReport> SyncFrom(std::string_view shared) override {
    auto listing = DecodeStoreListing(shared);
    if (!listing.ok()) return listing.status().WithContext("the shared store listing");
    return sync_.Sync(SyncScope::kCheckpoints, nullptr, &*listing);
  }
  Status IndexPacks() override { return sync_.IndexPacks(); }
  // A packs-only sync, after which the catalog knows where gc on another
  // host moved chunks.
  std::function<Status()> RelocationRefresh() override {
    return [this] { return sync_.Sync(SyncScope::kPacks).status(); };
  }

  Result<std::unique_ptr<ObjectLock>> LockHosts(ObjectLock::Mode mode, const PhaseFn& on_phase) override {
    if (mode == ObjectLock::Mode::kExclusive) {
      CKPT_RETURN_IF_ERROR(RemoveStaleObjectLocks(*repo_.backend, repo_.lock_options).status());
      if (on_phase) on_phase("waiting for saves and gc on other hosts (the store's exclusive lock)");
    }
    return ObjectLock::Acquire(*repo_.backend, mode, repo_.lock_options);
  }

  // A lease written before a removal is seen by every gc after it; one
  // written after must find the retired manifest still there (gc deletes it
  // before the chunks, and restores it when a lease shows up meanwhile).
  // Another process of this host verified it when it took the lease. The
  // catalog may lag the store (a gc elsewhere), so a record read under
  // the lease proves nothing.
  // One HEAD of the manifest object: its tag is the one this host's
  // catalog read the record under (sync.cc keeps it), or the name changed
  // hands since. The catalog's record and tag are read in one transaction,
  // so a sync of this process in between cannot pair one with the other.
  Result<bool> IsCurrent(const std::string& name, const CheckpointRecord* rec) override {
    auto tag = repo_.backend->Tag(keys::ManifestObject(name));
    if (tag.status().IsNotFound()) return rec == nullptr;  // removed on another host, or never saved
    CKPT_RETURN_IF_ERROR(tag.status().WithContext("checking that checkpoint '" + name + "' is current"));
    if (rec == nullptr) return false;  // saved on another host since
    bool current = false;
    CKPT_RETURN_IF_ERROR(repo_.catalog->Read([&](const ReadTxn& txn) -> Status {
      CKPT_ASSIGN_OR_RETURN(auto raw, txn.Get(Table::kCheckpoints, keys::Checkpoint(name)));
      if (!raw) return Status::OK();
      CKPT_ASSIGN_OR_RETURN(CheckpointRecord now, DecodeCheckpoint(*raw));
      if (CheckpointIdentity(now) != CheckpointIdentity(*rec)) return Status::OK();
      if (tag->empty()) {  // a store that cannot tell: the manifest is there
        current = true;
        return Status::OK();
      }
      CKPT_ASSIGN_OR_RETURN(auto known, txn.Get(Table::kMeta, keys::ManifestTag(name)));
      current = known && *known == *tag;
      return Status::OK();
    }));
    return current;
  }
  Status CheckLeased(const CheckpointRecord& rec, bool first, bool read_under_lease) override {
    // A reader's record was read under its lease and found current
    // (IsCurrent): its manifest object was there after the lease was, and
    // gc keeps a leased name's bytes.
    if (!first || read_under_lease) return Status::OK();
    Backend& store = *repo_.backend;
    auto live = store.Size(keys::ManifestObject(rec.name));
    if (live.ok()) return Status::OK();
    if (!live.status().IsNotFound()) return live.status();
    auto retired = store.Size(keys::RetiredObject(keys::RetiredCheckpoint(rec.name, rec.committed_unix_ms)));
    if (retired.ok()) return Status::OK();
    if (!retired.status().IsNotFound()) return retired.status();
    return Status::NotFound("checkpoint '" + rec.name + "' was removed and its data collected");
  }
  // Every host's leases are objects.
  Result<std::set<std::string>> Leased(const std::vector<std::string>&, LocalLeaseScan&) override {
    return ListStoreLeases(*repo_.backend, repo_.lock_options);
  }
  Result<std::set<std::string>> LeasedSinceDelete() override {
    return ListStoreLeases(*repo_.backend, repo_.lock_options);
  }
  bool KeepsDeadChunkLocations() const override { return true; }
  bool UnknownPacksAreLeftovers() const override { return false; }

  Status RemoveRankObjects(const std::string& name) override {
    CKPT_ASSIGN_OR_RETURN(auto pending, repo_.backend->List(keys::PendingPrefix(name)));
    for (const auto& key : pending) {
      if (!keys::IsPendingObjectOf(key, name)) continue;  // a checkpoint of group `name`
      Status st = repo_.backend->Delete(key);
      if (!st.ok() && !st.IsNotFound()) return st;
    }
    return Status::OK();
  }
  Result<std::vector<RankProgress>> RankProgressOf(const std::string& name, uint32_t world_size) override;

 private:
  Status PutOwnPart(const RankCommit& rank, const std::string& key, const std::string& encoded);
  // Deletes `key` if it holds exactly `ours` (best effort).
  void TakeBack(const std::string& key, const std::string& ours);
  Status AwaitOwnAttempt(const RankCommit& rank, const std::string& claim, CommitResult* result);
  std::vector<Result<PendingRank>> ReadParts(const std::string& name, uint32_t n);
  Result<bool> AllOfThisAttempt(const RankCommit& rank, const std::vector<Result<PendingRank>>& parts);
  // Steps 3 to 5, this rank's part being durable.
  Status CommitListed(const RankCommit& rank, const std::string& claim, CommitResult* result);
  Result<std::optional<Manifest>> MergeStoredRanks(const RankCommit& rank);

  RepositoryImpl& repo_;
  StoreSync sync_;
};

// The ranks that started (their started/ objects name host, pid and time)
// and which of them committed (their pending/ objects).
Result<std::vector<RankProgress>> StoreCommit::RankProgressOf(const std::string& name, uint32_t world_size) {
  std::vector<RankProgress> out;
  CKPT_ASSIGN_OR_RETURN(auto listed, repo_.backend->List(keys::PendingPrefix(name)));
  std::set<uint32_t> committed, started;
  for (const auto& key : listed) {
    std::string n;
    uint32_t r;
    if (keys::ParsePendingRankObject(key, &n, &r) && n == name) committed.insert(r);
    if (keys::ParseStartedRankObject(key, name, &r) && r < world_size) started.insert(r);
  }
  for (uint32_t r : started) out.push_back(RankProgress{r, committed.count(r) > 0, "", 0, 0});
  ParallelFor(repo_.IoPool(), out.size(), repo_.io_threads, [&](size_t i) {
    auto body = repo_.backend->ReadAll(keys::StartedRankObject(name, out[i].rank), kMaxSmallObject);
    auto j = body.ok() ? Json::Parse(*body, 64) : Result<Json>(body.status());
    if (!j.ok()) return;  // gone meanwhile, or not ours: shown without a host
    const Json* host = j->Find("host");
    const Json* pid = j->Find("pid");
    const Json* at = j->Find("started_unix_ms");
    if (host && host->is_string()) out[i].host = ToValidUtf8(host->as_string().substr(0, 255));
    if (pid && pid->is_uint()) out[i].pid = pid->as_uint();
    if (at && at->is_uint()) out[i].started_unix_ms = at->as_uint();
  });
  return out;
}

// This rank's part, PUT unless a part of this rank's attempt or a newer
// one is there: one of an older attempt (a crashed job's) is replaced.
// A part PUT only where none is keeps a rank of an older attempt from
// replacing a newer one's between its check and its PUT.
Status StoreCommit::PutOwnPart(const RankCommit& rank, const std::string& key, const std::string& encoded) {
  Backend& store = *repo_.backend;
  const std::string& name = rank.name;
  const auto bytes = std::as_bytes(std::span(encoded));
  for (;;) {
    // A HEAD first: a part is there only after a crash (or from a rank
    // run twice), so the usual save costs no GET.
    auto size = store.Size(key);
    if (size.status().IsNotFound()) {
      Status put = store.PutIfAbsent(key, bytes);
      if (!put.IsAlreadyExists()) return put;
      auto raw = store.ReadAll(key, encoded.size() + 1);
      if (raw.ok() && *raw == encoded) return Status::OK();  // ours, the answer lost and retried
      continue;  // another's, PUT meanwhile: look at it
    }
    CKPT_RETURN_IF_ERROR(size.status());
    auto there = ReadPendingRank(store, name, rank.options.rank);
    if (there.status().IsNotFound()) continue;  // gone meanwhile
    // A part that cannot be read is replaced only by a rank of an attempt.
    if (!there.ok() && rank.options.attempt.empty()) return there.status();
    const std::string theirs = there.ok() ? there->header.attempt : std::string();
    switch (there.ok() ? CompareAttempts(rank.options.attempt, theirs) : AttemptOrder::kNewer) {
      case AttemptOrder::kSame:
        return Status::AlreadyExists("rank " + std::to_string(rank.options.rank) + " of checkpoint '" + name +
                                     "' already committed");
      case AttemptOrder::kOlder: return SupersededAttempt(name, rank.options.attempt, theirs);
      case AttemptOrder::kNewer: return store.Put(key, bytes);
    }
  }
}

// Every rank's part of checkpoint `name` (world size `n`), read in parallel.
std::vector<Result<PendingRank>> StoreCommit::ReadParts(const std::string& name, uint32_t n) {
  std::vector<Result<PendingRank>> parts(n, Status::Internal("not read"));
  ParallelFor(repo_.IoPool(), n, repo_.io_threads,
              [&](size_t r) { parts[r] = ReadPendingRank(*repo_.backend, name, static_cast<uint32_t>(r)); });
  return parts;
}

// Whether every part (all read) is of this rank's save attempt: false
// while an older attempt's part stands for some rank; FailedPrecondition
// when one is a newer attempt's.
Result<bool> StoreCommit::AllOfThisAttempt(const RankCommit& rank, const std::vector<Result<PendingRank>>& parts) {
  bool all = true;
  for (const auto& part : parts) {
    switch (CompareAttempts(rank.options.attempt, part->header.attempt)) {
      case AttemptOrder::kSame: break;
      case AttemptOrder::kNewer: all = false; break;
      case AttemptOrder::kOlder: return SupersededAttempt(rank.name, rank.options.attempt, part->header.attempt);
    }
  }
  return all;
}

// A split commit's completer whose listing showed every rank in, one or
// more of them an older attempt's part: waits, reading the parts again
// with backoff, until this attempt's ranks have replaced them (then
// commits as the last rank would) or the wait runs out.
Status StoreCommit::AwaitOwnAttempt(const RankCommit& rank, const std::string& claim, CommitResult* result) {
  const auto deadline = rank.options.await_ranks + std::chrono::steady_clock::now();
  for (int attempt = 0;; ++attempt) {
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) {
      return Status::IOError("checkpoint '" + rank.name + "': an earlier save attempt's parts were not all replaced "
                             "by this attempt's ranks in time; it stays invisible");
    }
    std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(
        std::chrono::milliseconds(std::min<int64_t>(10ll << std::min(attempt, 7), 1000)), deadline - now));
    const auto parts = ReadParts(rank.name, rank.options.world_size);
    bool missing = false;
    for (const auto& part : parts) {
      if (part.status().IsNotFound()) {
        missing = true;
      } else {
        CKPT_RETURN_IF_ERROR(part.status());
      }
    }
    if (missing) continue;
    CKPT_ASSIGN_OR_RETURN(bool ours, AllOfThisAttempt(rank, parts));
    if (!ours) continue;
    RankCommit again = rank;
    again.role = RankCommit::Role::kAny;  // every part is in: commit as the last rank would
    return CommitListed(again, claim, result);
  }
}

// Null when an older attempt's part still stands for some rank.
Result<std::optional<Manifest>> StoreCommit::MergeStoredRanks(const RankCommit& rank) {
  const std::string& name = rank.name;
  const uint32_t n = rank.options.world_size;
  std::vector<Result<PendingRank>> objects = ReadParts(name, n);
  CommitView view;
  view.checkpoint.name = name;
  view.checkpoint.world_size = n;
  view.checkpoint.created_unix_ms = rank.created_unix_ms;
  for (uint32_t r = 0; r < n; ++r) {
    if (!objects[r].ok()) return objects[r].status().WithContext("committing checkpoint '" + name + "'");
  }
  CKPT_ASSIGN_OR_RETURN(bool ours, AllOfThisAttempt(rank, objects));
  if (!ours) return std::optional<Manifest>();
  for (uint32_t r = 0; r < n; ++r) {
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
  CKPT_ASSIGN_OR_RETURN(Manifest merged, MergeView(repo_, rank, view, /*index_on_miss=*/true));
  return std::optional<Manifest>(std::move(merged));
}

Status StoreCommit::Commit(const RankCommit& rank, CommitResult* result) {
  const std::string& name = rank.name;
  const WriterOptions& options = rank.options;
  Backend& store = *repo_.backend;
  // Were the lock's refreshes failing, a gc elsewhere may have taken it for
  // stale and removed chunks this save deduplicated against. (A rank of a
  // split commit has none: the sharing rank's lock covers it, and that
  // rank checks it before completing.)
  if (rank.store_lock != nullptr) CKPT_RETURN_IF_ERROR(rank.store_lock->Check());
  const std::string own_key = keys::PendingRankObject(name, options.rank);
  auto committed = store.Size(keys::ManifestObject(name));
  if (committed.ok()) return CheckpointExists(name);
  if (!committed.status().IsNotFound()) return committed.status();
  CheckpointRecord header;
  header.name = name;
  header.step = options.step;
  header.world_size = options.world_size;
  header.created_unix_ms = rank.created_unix_ms;
  header.tags = options.tags;
  header.attempt = options.attempt;
  const std::string encoded = EncodePendingRank(header, rank.record);
  // The claim names this commit, so an answer lost on the way and a retry
  // that finds the object still tell whose claim it is.
  const std::string claim = "rank " + std::to_string(options.rank) + " " + RandomHex(16);
  Status st = PutOwnPart(rank, own_key, encoded);
  // The catalog is this host's index of the store: the packs just written
  // go in as a sync would put them.
  if (st.ok()) {
    st = repo_.catalog->Update([&](WriteTxn& txn) -> Status {
      for (const auto& p : rank.sealed) CKPT_RETURN_IF_ERROR(RecordPack(txn, p).status());
      return Status::OK();
    });
  }
  if (st.ok() && rank.role == RankCommit::Role::kPartOnly) return Status::OK();  // the sharing rank completes
  if (st.ok()) st = CommitListed(rank, claim, result);
  if (!st.ok()) {
    // Failed, maybe with this rank's part or claim in the store (a PUT
    // whose answer was lost, a merge that failed): both are taken back, as
    // a failed commit of a local repository leaves its rank out, so that
    // the rank may commit again. A part or claim that is not this
    // commit's (another rank run twice, a newer attempt's) stays.
    TakeBack(own_key, encoded);
    TakeBack(keys::CommitClaimObject(name), claim);
  }
  return st;
}

void StoreCommit::TakeBack(const std::string& key, const std::string& ours) {
  auto there = repo_.backend->ReadAll(key, ours.size() + 1);
  if (there.ok() && *there == ours) (void)repo_.backend->Delete(key);
}

Status StoreCommit::CommitListed(const RankCommit& rank, const std::string& claim, CommitResult* result) {
  const std::string& name = rank.name;
  const WriterOptions& options = rank.options;
  Backend& store = *repo_.backend;
  std::set<uint32_t> ranks;
  std::vector<std::string> beyond;  // parts of ranks past the world size: an older attempt's
  const auto deadline = std::chrono::steady_clock::now() + options.await_ranks;
  for (int attempt = 0;; ++attempt) {
    CKPT_ASSIGN_OR_RETURN(auto present, store.List(keys::PendingPrefix(name)));
    ranks.clear();
    beyond.clear();
    for (const auto& key : present) {
      std::string n;
      uint32_t r;
      if (!keys::ParsePendingRankObject(key, &n, &r) || n != name) continue;
      if (r < options.world_size) {
        ranks.insert(r);
      } else {
        beyond.push_back(key);
      }
    }
    if (ranks.size() >= options.world_size) break;
    if (rank.role != RankCommit::Role::kCompleter) return Status::OK();  // another rank completes later
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) {
      std::string missing;
      size_t shown = 0;
      for (uint32_t r = 0; r < options.world_size && shown < 8; ++r) {
        if (ranks.count(r)) continue;
        missing += (shown++ ? ", " : "") + std::to_string(r);
      }
      const size_t absent = options.world_size - ranks.size();
      if (absent > shown) missing += " and " + std::to_string(absent - shown) + " more";
      char waited[32];
      std::snprintf(waited, sizeof waited, "%.1f s", static_cast<double>(options.await_ranks.count()) / 1000.0);
      return Status::IOError("checkpoint '" + name + "': rank" + (absent > 1 ? "s " : " ") + missing + " of " +
                             std::to_string(options.world_size) + " did not commit " +
                             (absent > 1 ? "their parts" : "its part") + " within " +
                             waited + "; it stays invisible");
    }
    // 10 ms, doubling to a second: parts committing together are seen
    // within a few listings, a slow one costs one listing a second.
    const auto pause = std::chrono::milliseconds(std::min<int64_t>(10ll << std::min(attempt, 7), 1000));
    std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(pause, deadline - now));
  }

  // Ranks finishing together may all see every rank in: the one whose
  // claim lands first (a conditional PUT) commits, the others are done.
  //
  // A claim another attempt holds is not taken for a commit: a committer
  // that failed after its claim, and whose clean-up failed too (or whose
  // host died), leaves a claim nobody will honour, and a rank that
  // returned success on seeing it would report a checkpoint committed that
  // never becomes visible (the simulator found this). So this rank returns
  // success only once the manifest is published, by anyone; it waits for
  // it while the claim's holder may still be at work, and takes over a
  // claim unchanged for as long as a lock object goes stale.
  const std::string claim_key = keys::CommitClaimObject(name);
  const std::string manifest_key = keys::ManifestObject(name);
  for (;;) {
    Status claimed = store.PutIfAbsent(claim_key, std::as_bytes(std::span(claim)));
    if (!claimed.IsAlreadyExists()) {
      CKPT_RETURN_IF_ERROR(claimed);
      break;  // ours
    }
    auto holder = store.ReadAll(claim_key, kMaxSmallObject);
    if (holder.status().IsNotFound()) continue;  // let go meanwhile: claim again
    CKPT_RETURN_IF_ERROR(holder.status());
    if (*holder == claim) break;  // ours, the answer to our PUT lost and retried
    // Another attempt's: wait for its manifest (a HEAD a poll, 10 ms
    // doubling to a second), for as long as a lock object takes to go stale.
    const auto since = std::chrono::steady_clock::now();
    bool stale = false;
    for (int attempt = 0;; ++attempt) {
      auto published = store.Size(manifest_key);
      if (published.ok()) return Status::OK();  // another rank committed it
      if (!published.status().IsNotFound()) return published.status();
      if (std::chrono::steady_clock::now() - since >= repo_.lock_options.stale_after) {
        stale = true;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(std::min<int64_t>(10ll << std::min(attempt, 7), 1000)));
    }
    if (!stale) continue;
    // Nothing published for that long: unless the claim changed meanwhile,
    // its holder is gone, and this rank takes it over.
    auto again = store.ReadAll(claim_key, kMaxSmallObject);
    if (again.ok() && *again == *holder) {
      Status dropped = store.Delete(claim_key);
      if (!dropped.ok() && !dropped.IsNotFound()) return dropped;
    } else if (!again.ok() && !again.status().IsNotFound()) {
      return again.status();
    }
  }
  // A rank that saw every rank in, but claims only after the committer has
  // published the manifest, tidied the rank objects and let go of its
  // claim, holds a claim to a checkpoint that is already committed: it is
  // done, and must not merge rank objects that are gone.
  auto published = store.Size(manifest_key);
  if (published.ok()) {
    (void)store.Delete(claim_key);
    return Status::OK();
  }
  if (!published.status().IsNotFound()) return published.status();
  // A commit that fails from here on (the ranks' shards disagree, the store
  // fails) gets its rank object and its claim taken back by Commit.
  auto manifest = MergeStoredRanks(rank);
  if (manifest.ok() && !*manifest) {
    // An older attempt's part still stands for some rank: this attempt's
    // rank replaces it when it commits, and completes the checkpoint then.
    (void)store.Delete(claim_key);
    if (rank.role != RankCommit::Role::kCompleter) return Status::OK();
    return AwaitOwnAttempt(rank, claim, result);
  }
  CKPT_RETURN_IF_ERROR(manifest.status());
  if (rank.store_lock != nullptr) CKPT_RETURN_IF_ERROR(rank.store_lock->Check());
  const std::string manifest_bytes = EncodeManifest(**manifest);
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
  for (const auto& key : beyond) (void)store.Delete(key);
  if (!failing) (void)store.Delete(claim_key);
  (void)sync_.Sync(SyncScope::kCheckpoints);
  return Status::OK();
}

}  // namespace

std::unique_ptr<CommitProtocol> MakeStoreCommit(RepositoryImpl& repo) { return std::make_unique<StoreCommit>(repo); }

}  // namespace ckptfs
