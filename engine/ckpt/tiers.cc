// Two tiers (tiers.h): a host's fast repository drained to a shared one.
#include "ckpt/tiers.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "backend/durable_file.h"
#include "ckpt/copy.h"
#include "ckpt/layout.h"
#include "ckpt/repo_lock.h"
#include "core/encoding.h"
#include "store/pack.h"
#include "ckpt/repository_impl.h"

namespace ckptfs {

// The internals of the repositories the tier functions are given.
class TierAccess {
 public:
  static RepositoryImpl& Of(Repository& repo) { return *repo.impl_; }
};

namespace {

std::string SharedTierPath(const std::string& fast_path) { return fast_path + "/" + kSharedTierFile; }

// What a fast tier records of the copies its checkpoints have in peers'
// fast tiers: a file per checkpoint in replicated/ ('/' in the name as
// '+'), one line "<created_unix_ms> <world_size> <copies>" that ties it to
// one checkpoint of that name.
constexpr const char* kReplicatedDir = "replicated";

std::string ReplicatedPath(const std::string& fast_path, const std::string& name) {
  std::string file = name;
  std::replace(file.begin(), file.end(), '/', '+');
  return fast_path + "/" + kReplicatedDir + "/" + file;
}

// The copies the marker of checkpoint `c` records; 1 without a marker, or
// with one left by another checkpoint of that name.
uint32_t RecordedCopies(const std::string& fast_path, const CheckpointRecord& c) {
  std::ifstream in(ReplicatedPath(fast_path, c.name));
  uint64_t created = 0, world = 0, copies = 0;
  if (!(in >> created >> world >> copies)) return 1;
  if (created != c.created_unix_ms || world != c.world_size || copies < 1 || copies > c.world_size) return 1;
  return static_cast<uint32_t>(copies);
}

// The fast tier's record of checkpoint `name` among `list`: a pending save
// replacing it ("NAME~") first, else NAME itself; null when neither.
const CheckpointRecord* SaveHere(const std::vector<CheckpointRecord>& list, const std::string& name) {
  const CheckpointRecord* found = nullptr;
  for (const CheckpointRecord& c : list) {
    if (c.name == keys::ReplacementCheckpoint(name) && c.state == CheckpointState::kPending) return &c;
    if (c.name == name) found = &c;
  }
  return found;
}

Status RecordCopies(Repository& fast, const std::string& name, uint32_t copies, int rank) {
  CKPT_ASSIGN_OR_RETURN(std::vector<CheckpointRecord> list, fast.ListCheckpoints(/*include_pending=*/true));
  if (const CheckpointRecord* found = SaveHere(list, name)) {
    const CheckpointRecord& c = *found;
    std::error_code ec;
    std::filesystem::create_directories(fast.path() + "/" + kReplicatedDir, ec);
    if (ec) return Status::IOError("making " + fast.path() + "/" + kReplicatedDir + ": " + ec.message());
    const std::string path = ReplicatedPath(fast.path(), c.name);
    // The ranks of one host write the same line, each through a temporary of its own.
    CKPT_ASSIGN_OR_RETURN(auto file, DurableFile::Create(path, path + ".tmp-" + std::to_string(rank)));
    const std::string line = std::to_string(c.created_unix_ms) + " " + std::to_string(c.world_size) + " " +
                             std::to_string(copies) + "\n";
    CKPT_RETURN_IF_ERROR(file->Append(std::as_bytes(std::span(line.data(), line.size()))));
    return file->Commit(/*replace=*/true);
  }
  return Status::NotFound("the fast tier holds no checkpoint '" + name + "'");
}

// Removes the markers of checkpoints the fast tier no longer holds.
void ForgetGoneCopies(const std::string& fast_path, const std::vector<CheckpointRecord>& held) {
  std::set<std::string> files;
  for (const CheckpointRecord& c : held) files.insert(ReplicatedPath(fast_path, c.name));
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(fast_path + "/" + kReplicatedDir, ec)) {
    const std::string path = entry.path().string();
    if (!files.count(path) && path.find(".tmp-") == std::string::npos) std::filesystem::remove(path, ec);
  }
}

// The rank parts a fast tier's catalog holds of pending checkpoint `name`.
Result<std::vector<RankRecord>> PendingParts(RepositoryImpl& fast, const std::string& name) {
  std::vector<RankRecord> parts;
  Status inner;
  CKPT_RETURN_IF_ERROR(fast.catalog->Read([&](const ReadTxn& txn) -> Status {
    return txn.Scan(Table::kRanks, keys::MemberPrefix(name), [&](std::string_view, std::string_view v) {
      auto r = DecodeRank(v);
      if (!r.ok()) {
        inner = r.status().WithContext("pending checkpoint '" + name + "' of the fast tier");
        return false;
      }
      parts.push_back(std::move(r).value());
      return true;
    });
  }));
  CKPT_RETURN_IF_ERROR(inner);
  std::sort(parts.begin(), parts.end(), [](const RankRecord& a, const RankRecord& b) { return a.rank < b.rank; });
  return parts;
}

Status CheckTiers(Repository& fast_repo, Repository& shared_repo) {
  RepositoryImpl& fast = TierAccess::Of(fast_repo);
  RepositoryImpl& shared = TierAccess::Of(shared_repo);
  CKPT_RETURN_IF_ERROR(fast.CheckProcess());
  CKPT_RETURN_IF_ERROR(shared.CheckProcess());
  if (fast_repo.remote()) {
    return Status::InvalidArgument("the fast tier must be a local directory, not " + fast.path);
  }
  if (&fast == &shared || fast.path == shared.path) {
    return Status::InvalidArgument("the fast and the shared tier are the same repository (" + fast.path + ")");
  }
  return Status::OK();
}

}  // namespace

Result<std::optional<std::string>> ReadSharedTier(const std::string& fast_path) {
  std::ifstream in(SharedTierPath(fast_path));
  if (!in) return std::optional<std::string>();
  std::stringstream text;
  text << in.rdbuf();
  std::string url = text.str();
  while (!url.empty() && (url.back() == '\n' || url.back() == '\r' || url.back() == ' ')) url.pop_back();
  if (url.empty() || url.find('\n') != std::string::npos) {
    return Status::InvalidArgument(SharedTierPath(fast_path) + " must hold one line, the shared tier's URL");
  }
  return std::optional<std::string>(url);
}

Status WriteSharedTier(const std::string& fast_path, const std::string& url) {
  if (url.empty() || url.find('\n') != std::string::npos) {
    return Status::InvalidArgument("a shared tier's URL must be one non-empty line");
  }
  // A directory is named by its absolute path, whatever directory the
  // drain runs in later.
  std::error_code ec;
  const std::string shared_url =
      url.find("://") != std::string::npos ? url : std::filesystem::absolute(url, ec).lexically_normal().string();
  if (ec) return Status::InvalidArgument("the shared tier " + url + ": " + ec.message());
  CKPT_ASSIGN_OR_RETURN(std::optional<std::string> named, ReadSharedTier(fast_path));
  if (named) {
    if (*named == shared_url) return Status::OK();
    return Status::InvalidArgument("the fast tier " + fast_path + " drains to " + *named + ", not " + shared_url +
                                   " (a fast tier has one shared tier; remove " + SharedTierPath(fast_path) +
                                   " once it is drained to change it)");
  }
  const std::string path = SharedTierPath(fast_path);
  CKPT_ASSIGN_OR_RETURN(auto file, DurableFile::Create(path, path + ".tmp"));
  const std::string line = shared_url + "\n";
  CKPT_RETURN_IF_ERROR(file->Append(std::as_bytes(std::span(line.data(), line.size()))));
  Status st = file->Commit(/*replace=*/false);
  if (st.IsAlreadyExists()) return WriteSharedTier(fast_path, shared_url);  // another process named one meanwhile
  return st;
}

bool TierEntry::drained() const {
  return durable || (!ranks_here.empty() && ranks_shared.size() == ranks_here.size());
}

std::string TierEntry::state() const {
  if (durable) return "durable";
  if (drained()) return "drained";
  return copies > 1 ? "replicated" : "local";
}

Result<ReplicaStrategy> ParseReplicaStrategy(std::string_view name) {
  if (name == "ring") return ReplicaStrategy::kRing;
  if (name == "clique") return ReplicaStrategy::kClique;
  return Status::InvalidArgument("a replica strategy is 'ring' or 'clique', not '" + std::string(name) + "'");
}

namespace {

// The chunks a part references, each once, in the order first referenced.
std::vector<ChunkRef> ChunksOfPart(const RankRecord& part) {
  std::vector<ChunkRef> out;
  std::set<ChunkId> seen;
  auto add = [&](const ChunkRef& c) {
    if (seen.insert(c.id).second) out.push_back(c);
  };
  for (const TensorRecord& t : part.tensors) {
    for (const ShardRecord& sh : t.shards) {
      for (const ChunkRef& c : sh.chunks) add(c);
    }
  }
  for (const BlobRecord& b : part.blobs) {
    for (const ChunkRef& c : b.chunks) add(c);
  }
  return out;
}

std::vector<ChunkId> IdsOfPart(const RankRecord& part) {
  std::vector<ChunkId> ids;
  for (const ChunkRef& c : ChunksOfPart(part)) ids.push_back(c.id);
  return ids;
}

// The parts of entry `e`'s ranks the fast tier holds; `lease` keeps a
// committed checkpoint's bytes.
Result<std::vector<RankRecord>> PartsHere(Repository& fast, const TierEntry& e,
                                          std::unique_ptr<CheckpointReader>* lease) {
  std::vector<RankRecord> parts;
  if (e.complete_here) {
    CKPT_ASSIGN_OR_RETURN(*lease, fast.OpenCheckpoint(e.name));
    CKPT_RETURN_IF_ERROR(CheckShardRanks(**lease));
    for (uint32_t r : e.ranks_here) parts.push_back(PartOfRank((*lease)->tensors(), (*lease)->blobs(), r));
    return parts;
  }
  return PendingParts(TierAccess::Of(fast), e.name);
}

// Whether the shared tier's committed `e.target` holds, for each rank of
// `e` here, the chunks of the fast tier's part in the same order.
Result<bool> SameParts(Repository& fast, Repository& shared, const TierEntry& e) {
  std::unique_ptr<CheckpointReader> lease;
  CKPT_ASSIGN_OR_RETURN(std::vector<RankRecord> here, PartsHere(fast, e, &lease));
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> there, shared.OpenCheckpoint(e.target));
  if (there->info().world_size != e.world_size || here.empty()) return false;
  for (const RankRecord& p : here) {
    if (IdsOfPart(p) != IdsOfPart(PartOfRank(there->tensors(), there->blobs(), p.rank))) return false;
  }
  return true;
}

// Fills e.durable, e.overwrite and e.ranks_shared from the shared tier's
// records `there`.
Status Classify(Repository& fast, Repository& shared, const std::vector<CheckpointRecord>& there, TierEntry& e) {
  e.durable = false;
  e.overwrite = e.name != e.target;
  e.ranks_shared.clear();
  e.shared_attempt.clear();
  const CheckpointRecord* committed = nullptr;
  const CheckpointRecord* pending = nullptr;
  const std::string staged = keys::ReplacementCheckpoint(e.target);
  for (const CheckpointRecord& s : there) {
    if (s.name == e.target && s.state == CheckpointState::kCommitted) committed = &s;
    // This save's ranks drained before, under the name or (replacing) its "~" name.
    if ((s.name == e.target || s.name == staged) && s.state == CheckpointState::kPending &&
        s.world_size == e.world_size && s.step == e.step && (s.attempt == e.attempt || e.complete_here)) {
      pending = &s;
    }
  }
  if (committed) {
    if (committed->committed_unix_ms >= e.created_unix_ms) {
      e.durable = true;  // committed after this save began: its drain, or a newer save of the name
    } else {
      // Older than this save: another version, unless it holds these very
      // parts (a host that got its parts back from peers keeps them as a
      // save begun after the drain's commit).
      CKPT_ASSIGN_OR_RETURN(e.durable, SameParts(fast, shared, e));
    }
    if (!e.durable) e.overwrite = true;
  }
  if (e.durable) {
    e.ranks_shared = e.ranks_here;
  } else if (pending) {
    e.shared_attempt = pending->attempt;
    std::set_intersection(e.ranks_here.begin(), e.ranks_here.end(), pending->committed_ranks.begin(),
                          pending->committed_ranks.end(), std::back_inserter(e.ranks_shared));
  }
  return Status::OK();
}

}  // namespace

Result<std::vector<TierEntry>> TierStatus(Repository& fast, Repository& shared) {
  CKPT_RETURN_IF_ERROR(CheckTiers(fast, shared));
  CKPT_RETURN_IF_ERROR(shared.Refresh());
  CKPT_ASSIGN_OR_RETURN(std::vector<CheckpointRecord> here, fast.ListCheckpoints(/*include_pending=*/true));
  CKPT_ASSIGN_OR_RETURN(std::vector<CheckpointRecord> there, shared.ListCheckpoints(/*include_pending=*/true));
  std::vector<TierEntry> entries;
  for (const CheckpointRecord& c : here) {
    TierEntry e;
    e.name = c.name;
    e.target = keys::ReplacedName(c.name);
    e.step = c.step;
    e.world_size = c.world_size;
    e.created_unix_ms = c.created_unix_ms;
    e.logical_bytes = c.logical_bytes;
    e.tags = c.tags;
    e.attempt = c.attempt;
    e.copies = RecordedCopies(fast.path(), c);
    e.complete_here = c.state == CheckpointState::kCommitted;
    if (e.complete_here) {
      for (uint32_t r = 0; r < c.world_size; ++r) e.ranks_here.push_back(r);
    } else {
      e.ranks_here = c.committed_ranks;
    }
    CKPT_RETURN_IF_ERROR(Classify(fast, shared, there, e).WithContext("checkpoint '" + c.name + "'"));
    entries.push_back(std::move(e));
  }
  return entries;
}

Result<DrainReport> Drain(Repository& fast, Repository& shared, const DrainOptions& options,
                          const ProgressFn& progress) {
  RepositoryImpl& src = TierAccess::Of(fast);
  RepositoryImpl& dst = TierAccess::Of(shared);
  CKPT_RETURN_IF_ERROR(CheckTiers(fast, shared));
  // One drain of this fast tier at a time: the ranks of one host each run
  // one, and a rank must not be committed in the shared tier twice.
  CKPT_ASSIGN_OR_RETURN(RepoLock alone, RepoLock::Acquire(src.state_dir, RepoLock::Mode::kExclusive,
                                                           RepoLock::Name::kDrain));
  CKPT_ASSIGN_OR_RETURN(std::vector<TierEntry> entries, TierStatus(fast, shared));
  {
    CKPT_ASSIGN_OR_RETURN(std::vector<CheckpointRecord> held, fast.ListCheckpoints(/*include_pending=*/true));
    ForgetGoneCopies(fast.path(), held);
  }
  auto phase = [&](const std::string& what) {
    if (options.on_phase) options.on_phase(what);
  };
  std::vector<const TierEntry*> selected;
  std::vector<TierEntry> gone;  // named, no longer in the fast tier, durable in the shared one
  if (options.names.empty()) {
    for (const TierEntry& e : entries) {
      if (!e.durable) selected.push_back(&e);
    }
  } else {
    std::map<std::string, const TierEntry*> by_name;
    for (const TierEntry& e : entries) by_name[e.name] = &e;
    for (const TierEntry& e : entries) by_name.emplace(e.target, &e);  // a replacing save, by its name
    gone.reserve(options.names.size());
    for (const std::string& n : options.names) {
      auto it = by_name.find(n);
      if (it != by_name.end()) {
        selected.push_back(it->second);
        continue;
      }
      // Drained and trimmed since (the same command run again).
      auto there = shared.GetCheckpoint(n);
      if (there.status().IsNotFound()) return Status::NotFound("the fast tier holds no checkpoint '" + n + "'");
      CKPT_RETURN_IF_ERROR(there.status());
      TierEntry e;
      e.name = e.target = n;
      e.durable = true;
      gone.push_back(std::move(e));
      selected.push_back(&gone.back());
    }
  }
  uint64_t total = 0, done_before = 0;
  for (const TierEntry* e : selected) total += e->logical_bytes;
  if (progress) progress(0, total);

  DirectFetcher fetcher(
      src.backend.get(), [r = &src](const ChunkId& id) { return r->LookupChunk(id); }, src.buffers.get(),
      src.protocol->RelocationRefresh());
  DrainReport report;
  for (const TierEntry* e : selected) {
    DrainedCheckpoint out;
    out.sent.name = e->target;
    if (e->durable || e->ranks_shared.size() == e->ranks_here.size()) {
      out.sent.outcome = CopiedCheckpoint::Outcome::kPresent;
      out.durable = e->durable;
      phase(e->name + (e->durable ? ": durable in the shared tier" : ": drained; waiting for other hosts' ranks"));
      report.checkpoints.push_back(out);
      done_before += e->logical_bytes;
      continue;
    }
    // The parts of this host's ranks, and the save's attempt.
    std::unique_ptr<CheckpointReader> reader;  // its lease keeps a committed checkpoint's bytes
    CKPT_ASSIGN_OR_RETURN(std::vector<RankRecord> parts, PartsHere(fast, *e, &reader));
    std::erase_if(parts, [&](const RankRecord& p) {
      return std::binary_search(e->ranks_shared.begin(), e->ranks_shared.end(), p.rank);
    });
    phase("draining " + e->target + " (" + std::to_string(parts.size()) + (parts.size() == 1 ? " rank" : " ranks") +
          (e->ranks_shared.empty() ? "" : ", " + std::to_string(e->ranks_shared.size()) + " drained before") +
          (e->overwrite ? ", replacing the shared tier's version" : "") + ")");
    WriterOptions header;
    header.world_size = e->world_size;
    header.step = e->step;
    header.attempt = e->attempt;
    header.tags = e->tags;
    header.engine_tags = true;
    header.overwrite = e->overwrite;
    // A replacing save of several ranks needs an attempt; the ranks of a
    // checkpoint complete here are all drained by this host, under one:
    // the one of the ranks an earlier drain of it left there, or a new one.
    if (header.overwrite && header.attempt.empty() && e->complete_here) {
      header.attempt = e->shared_attempt.empty() ? NewSaveAttempt() : e->shared_attempt;
    }
    CopyCounters counters;
    counters.cancelled = options.cancelled;
    HandledChunks handled;
    auto put = [&] {
      return PutRanks(src, fetcher, shared, dst, e->target, header, parts, options.ranks_at_once, handled, counters,
                      &out.sent.ranks_copied, &out.sent.stored_bytes_sent, [&] {
                        if (!progress) return;
                        const uint64_t handled_bytes =
                            counters.raw_bytes_sent.load() + counters.raw_bytes_present.load();
                        progress(done_before + std::min(handled_bytes, e->logical_bytes), total);
                      });
    };
    Status st = put();
    // Another host may commit one of these ranks meanwhile: one holding a
    // replica of it (ReplicateRankParts). Its part is the same; the ranks
    // still missing are put again.
    TierEntry now = *e;
    // `refresh`: another host may have committed meanwhile. After this
    // drain's own commits the catalog knows them already.
    auto reclassify = [&](bool refresh) -> Status {
      if (refresh) CKPT_RETURN_IF_ERROR(shared.Refresh());
      CKPT_ASSIGN_OR_RETURN(std::vector<CheckpointRecord> there, shared.ListCheckpoints(/*include_pending=*/true));
      return Classify(fast, shared, there, now);
    };
    for (int again = 0; again < 3 && st.IsAlreadyExists(); ++again) {
      CKPT_RETURN_IF_ERROR(reclassify(true));
      if (now.durable) {
        st = Status::OK();
        break;
      }
      std::erase_if(parts, [&](const RankRecord& p) {
        return std::binary_search(now.ranks_shared.begin(), now.ranks_shared.end(), p.rank);
      });
      handled.clear();
      header.overwrite = now.overwrite;
      st = put();
    }
    if (!st.ok()) {
      return st.WithContext("draining '" + e->name + "' to the shared tier stopped after " +
                            std::to_string(out.sent.ranks_copied) +
                            " ranks (they stay there; draining again sends the rest)");
    }
    out.sent.chunks_sent = counters.chunks_sent.load();
    out.sent.raw_bytes_sent = counters.raw_bytes_sent.load();
    out.sent.chunks_present = counters.chunks_present.load();
    out.sent.raw_bytes_present = counters.raw_bytes_present.load();
    CKPT_RETURN_IF_ERROR(reclassify(false));
    out.durable = now.durable;
    phase(e->target + (out.durable ? ": durable in the shared tier" : ": drained; waiting for other hosts' ranks"));
    report.chunks_sent += out.sent.chunks_sent;
    report.raw_bytes_sent += out.sent.raw_bytes_sent;
    report.stored_bytes_sent += out.sent.stored_bytes_sent;
    report.chunks_present += out.sent.chunks_present;
    report.raw_bytes_present += out.sent.raw_bytes_present;
    report.checkpoints.push_back(out);
    done_before += e->logical_bytes;
    if (progress) progress(done_before, total);
  }
  return report;
}

Result<std::vector<std::string>> PlanFastTierTrim(Repository& fast, Repository& shared, uint64_t keep_last,
                                                  bool short_of_space) {
  CKPT_ASSIGN_OR_RETURN(std::vector<TierEntry> entries, TierStatus(fast, shared));
  return PlanFastTierTrim(std::move(entries), keep_last, short_of_space);
}

std::vector<std::string> PlanFastTierTrim(std::vector<TierEntry> entries, uint64_t keep_last, bool short_of_space) {
  const bool by_step = std::all_of(entries.begin(), entries.end(), [](const TierEntry& e) { return e.step.has_value(); });
  std::stable_sort(entries.begin(), entries.end(), [&](const TierEntry& a, const TierEntry& b) {
    return by_step ? *a.step < *b.step : a.created_unix_ms < b.created_unix_ms;
  });
  std::vector<std::string> drop;
  const size_t older = entries.size() > keep_last ? entries.size() - keep_last : 0;
  for (size_t i = 0; i < older; ++i) {
    if (entries[i].durable || (short_of_space && entries[i].drained())) drop.push_back(entries[i].name);
  }
  return drop;
}

// ---- Replicas -----------------------------------------------------------------

namespace {

constexpr std::string_view kReplicaMagic = "CKPTRPL1";
constexpr size_t kIdBytes = 16;

// The fast tier's record of rank `rank` of checkpoint `name`: the
// checkpoint as a rank's commit states it, and the rank's part. `lease`
// keeps a committed checkpoint's bytes while they are read.
Result<PendingRank> RankPartHere(Repository& fast, const std::string& name, uint32_t rank,
                                 std::unique_ptr<CheckpointReader>* lease) {
  CKPT_ASSIGN_OR_RETURN(std::vector<CheckpointRecord> list, fast.ListCheckpoints(/*include_pending=*/true));
  if (const CheckpointRecord* found = SaveHere(list, name)) {
    const CheckpointRecord& c = *found;  // named "NAME~" in the bundle when it replaces NAME
    if (c.state == CheckpointState::kCommitted) {
      if (rank >= c.world_size) return Status::NotFound("checkpoint '" + name + "' has no rank " + std::to_string(rank));
      CKPT_ASSIGN_OR_RETURN(*lease, fast.OpenCheckpoint(name));
      PendingRank part{c, PartOfRank((*lease)->tensors(), (*lease)->blobs(), rank)};
      part.header.attempt.clear();
      return part;
    }
    CKPT_ASSIGN_OR_RETURN(std::vector<RankRecord> parts, PendingParts(TierAccess::Of(fast), c.name));
    for (RankRecord& r : parts) {
      if (r.rank == rank) return PendingRank{c, std::move(r)};
    }
  }
  return Status::NotFound("the fast tier holds no rank " + std::to_string(rank) + " of checkpoint '" + name + "'");
}

Result<std::set<ChunkId>> DecodeIds(std::string_view ids) {
  if (ids.size() % kIdBytes != 0) return Status::InvalidArgument("a list of chunk ids is not a multiple of 16 bytes");
  std::set<ChunkId> out;
  for (size_t at = 0; at < ids.size(); at += kIdBytes) {
    ChunkId id;
    std::memcpy(id.bytes.data(), ids.data() + at, kIdBytes);
    out.insert(id);
  }
  return out;
}

// `data` to rank `to` while a message comes from rank `from` (two rounds:
// the sizes, then the bytes).
Result<std::string> Swap(Communicator& comm, int to, int from, const std::string& data) {
  uint64_t out_size = data.size(), in_size = 0;
  std::vector<Communicator::Transfer> sizes = {
      {true, to, {reinterpret_cast<std::byte*>(&out_size), sizeof out_size}, 0},
      {false, from, {reinterpret_cast<std::byte*>(&in_size), sizeof in_size}, 0}};
  CKPT_RETURN_IF_ERROR(comm.Exchange(sizes));
  if (in_size > (uint64_t{1} << 40)) return Status::Corruption("rank " + std::to_string(from) + " sent a size of " +
                                                               std::to_string(in_size) + " bytes");
  std::string in(in_size, '\0');
  std::vector<Communicator::Transfer> bytes;
  if (out_size > 0) {
    bytes.push_back({true, to, {reinterpret_cast<std::byte*>(const_cast<char*>(data.data())), data.size()}, 1});
  }
  if (in_size > 0) bytes.push_back({false, from, {reinterpret_cast<std::byte*>(in.data()), in.size()}, 1});
  if (!bytes.empty()) CKPT_RETURN_IF_ERROR(comm.Exchange(bytes));
  return in;
}

}  // namespace

Result<std::string> RankPartChunks(Repository& fast, const std::string& name, uint32_t rank) {
  std::unique_ptr<CheckpointReader> lease;
  CKPT_ASSIGN_OR_RETURN(PendingRank part, RankPartHere(fast, name, rank, &lease));
  std::string out;
  for (const ChunkRef& c : ChunksOfPart(part.record)) out.append(reinterpret_cast<const char*>(c.id.bytes.data()), kIdBytes);
  return out;
}

Result<std::string> MissingChunks(Repository& fast, std::string_view ids) {
  RepositoryImpl& impl = TierAccess::Of(fast);
  CKPT_ASSIGN_OR_RETURN(std::set<ChunkId> wanted, DecodeIds(ids));
  std::string out;
  for (const ChunkId& id : wanted) {
    auto known = impl.LookupChunk(id);
    if (known.ok()) continue;
    if (!known.status().IsNotFound()) return known.status();
    out.append(reinterpret_cast<const char*>(id.bytes.data()), kIdBytes);
  }
  return out;
}

Result<std::string> ExportRankPart(Repository& fast, const std::string& name, uint32_t rank,
                                   std::string_view include) {
  RepositoryImpl& impl = TierAccess::Of(fast);
  CKPT_RETURN_IF_ERROR(impl.CheckProcess());
  CKPT_ASSIGN_OR_RETURN(std::set<ChunkId> wanted, DecodeIds(include));
  std::unique_ptr<CheckpointReader> lease;
  CKPT_ASSIGN_OR_RETURN(PendingRank part, RankPartHere(fast, name, rank, &lease));
  std::vector<ChunkRef> chunks = ChunksOfPart(part.record);
  std::erase_if(chunks, [&](const ChunkRef& c) { return !wanted.count(c.id); });
  Encoder e;
  e.Bytes(kReplicaMagic.data(), kReplicaMagic.size());
  e.String(EncodePendingRank(part.header, part.record));
  e.Varint(chunks.size());
  DirectFetcher fetcher(
      impl.backend.get(), [r = &impl](const ChunkId& id) { return r->LookupChunk(id); }, impl.buffers.get(),
      impl.protocol->RelocationRefresh());
  BufferPool::Lease stored;
  for (const ChunkRef& c : chunks) {
    CKPT_ASSIGN_OR_RETURN(ChunkLocation loc, fetcher.FetchStored(c, *impl.buffers, &stored));
    e.Bytes(c.id.bytes.data(), kIdBytes);
    e.Varint(c.raw_len);
    e.U8(static_cast<uint8_t>(loc.codec));
    e.String(std::string_view(reinterpret_cast<const char*>(stored.data()), loc.stored_len));
  }
  return e.Take();
}

Status ImportRankPart(Repository& fast, std::string_view bundle) {
  RepositoryImpl& impl = TierAccess::Of(fast);
  CKPT_RETURN_IF_ERROR(impl.CheckProcess());
  auto bad = [](const std::string& why) { return Status::Corruption("a replica bundle " + why); };
  if (bundle.substr(0, kReplicaMagic.size()) != kReplicaMagic) return bad("does not start with its magic");
  Decoder d(bundle.substr(kReplicaMagic.size()));
  std::string encoded;
  CKPT_RETURN_IF_ERROR(d.String(&encoded).WithContext("replica bundle"));
  CKPT_ASSIGN_OR_RETURN(Manifest m, DecodeManifest(encoded));
  if (m.checkpoint.state != CheckpointState::kPending || m.checkpoint.committed_ranks.size() != 1 ||
      m.checkpoint.committed_ranks[0] >= m.checkpoint.world_size) {
    return bad("does not describe one rank of a checkpoint");
  }
  // A part of a save replacing NAME comes as "NAME~", and is kept as one.
  const std::string name = keys::ReplacedName(m.checkpoint.name);
  CKPT_RETURN_IF_ERROR(ValidateCheckpointName(name));
  const uint32_t rank = m.checkpoint.committed_ranks[0];
  // The chunks, as a pack of their own in memory.
  uint64_t n = 0;
  CKPT_RETURN_IF_ERROR(d.Varint(&n));
  if (n > d.remaining() / (kIdBytes + 3)) return bad("counts more chunks than it holds");
  std::string pack;
  std::map<ChunkId, ChunkLocation> where;
  for (uint64_t i = 0; i < n; ++i) {
    ChunkId id;
    uint64_t raw_len = 0;
    uint8_t codec = 0;
    std::string stored;
    CKPT_RETURN_IF_ERROR(d.Bytes(id.bytes.data(), kIdBytes));
    CKPT_RETURN_IF_ERROR(d.Varint(&raw_len));
    CKPT_RETURN_IF_ERROR(d.U8(&codec));
    CKPT_RETURN_IF_ERROR(d.String(&stored));
    if (codec > static_cast<uint8_t>(Codec::kByteGroupZstd)) return bad("names an unknown codec");
    if (raw_len > UINT32_MAX || stored.size() > UINT32_MAX) return bad("holds a chunk too large");
    where[id] = ChunkLocation{"replica", pack.size(), static_cast<uint32_t>(stored.size()),
                              static_cast<uint32_t>(raw_len), static_cast<Codec>(codec)};
    pack += stored;
  }
  if (!d.done()) return bad("has trailing bytes");
  std::shared_ptr<Backend> memory = NewMemoryBackend();
  CKPT_RETURN_IF_ERROR(memory->Put(PackKey("replica"), std::as_bytes(std::span(pack.data(), pack.size()))));
  DirectFetcher fetcher(memory.get(), [&](const ChunkId& id) -> Result<ChunkLocation> {
    auto it = where.find(id);
    if (it == where.end()) return Status::NotFound("chunk " + id.ToHex() + " is neither in the fast tier nor sent");
    return it->second;
  });
  WriterOptions header;
  header.rank = rank;
  header.world_size = m.checkpoint.world_size;
  header.step = m.checkpoint.step;
  header.tags = m.checkpoint.tags;
  header.attempt = m.checkpoint.attempt;
  header.engine_tags = true;
  header.overwrite = m.checkpoint.name != name;
  std::vector<RankRecord> parts = {RankRecord{rank, std::move(m.tensors), std::move(m.blobs)}};
  HandledChunks handled;
  CopyCounters counters;
  uint32_t committed = 0;
  uint64_t stored_bytes = 0;
  Status st = PutRanks(impl, fetcher, fast, impl, name, header, parts, 1, handled, counters, &committed, &stored_bytes, {});
  if (st.IsAlreadyExists()) {
    // The rank is here already (this host saved it, or kept its replica
    // before), or the checkpoint is committed here.
    CKPT_ASSIGN_OR_RETURN(std::vector<CheckpointRecord> list, fast.ListCheckpoints(true));
    for (const CheckpointRecord& c : list) {
      if (c.name != m.checkpoint.name) continue;
      if (c.state == CheckpointState::kCommitted ||
          std::binary_search(c.committed_ranks.begin(), c.committed_ranks.end(), rank)) {
        return Status::OK();
      }
    }
  }
  return st.WithContext("keeping rank " + std::to_string(rank) + "'s replica of checkpoint '" + name + "'");
}

namespace {

// Whether `fast` holds rank `rank`'s part of checkpoint `name`.
Result<bool> HoldsPart(Repository& fast, const std::string& name, uint32_t rank) {
  CKPT_ASSIGN_OR_RETURN(std::vector<CheckpointRecord> list, fast.ListCheckpoints(/*include_pending=*/true));
  const CheckpointRecord* c = SaveHere(list, name);
  if (!c) return false;
  if (c->state == CheckpointState::kCommitted) return rank < c->world_size;
  return std::binary_search(c->committed_ranks.begin(), c->committed_ranks.end(), rank);
}

// One round between peers: this rank offers rank `offer`'s part (when its
// fast tier holds it) to rank `to`, and takes the part rank `from` offers
// when `take`. Three swaps: the offered part's chunk ids ("1" + ids, or
// "0": not held), the ids the taker lacks ("1" + ids, or "0": not wanted),
// and the part with those chunks. Sends and receives what its peers expect
// even after a failure of its own (kept in `local`), so that no peer waits.
Status SwapParts(Repository& fast, const std::string& name, Communicator& comm, int to, int from,
                 uint32_t offer, bool take, Status* local, ReplicaReport* report) {
  std::string ids = "0";
  if (local->ok()) {
    auto held = HoldsPart(fast, name, offer);
    if (!held.ok()) {
      *local = held.status();
    } else if (*held) {
      auto chunks = RankPartChunks(fast, name, offer);
      if (chunks.ok()) ids = "1" + *chunks; else *local = chunks.status();
    }
  }
  CKPT_ASSIGN_OR_RETURN(std::string offered, Swap(comm, to, from, ids));
  std::string lacking = "0";
  if (local->ok() && take && !offered.empty() && offered[0] == '1') {
    auto missing = MissingChunks(fast, std::string_view(offered).substr(1));
    if (missing.ok()) lacking = "1" + *missing; else *local = missing.status();
  }
  CKPT_ASSIGN_OR_RETURN(std::string wanted, Swap(comm, from, to, lacking));
  std::string bundle;
  if (local->ok() && ids[0] == '1' && !wanted.empty() && wanted[0] == '1') {
    auto made = ExportRankPart(fast, name, offer, std::string_view(wanted).substr(1));
    if (made.ok()) bundle = std::move(made).value(); else *local = made.status();
  }
  CKPT_ASSIGN_OR_RETURN(std::string got, Swap(comm, to, from, bundle));
  if (!bundle.empty()) {
    ++report->parts_sent;
    report->chunks_sent += (wanted.size() - 1) / kIdBytes;
    report->stored_bytes_sent += bundle.size();
  }
  if (local->ok() && !got.empty()) {
    *local = ImportRankPart(fast, got).WithContext("from rank " + std::to_string(from));
    if (local->ok()) {
      ++report->parts_received;
      report->stored_bytes_received += got.size();
    }
  }
  return Status::OK();
}

// The rounds of ReplicateRankParts (`back` false: each rank's part to its
// peers) or RestoreRankParts (`back` true: each peer's copy to the rank
// whose part it is, when that rank lacks it), and the agreement after.
Result<ReplicaReport> ExchangeParts(Repository& fast, const std::string& name, Communicator& comm,
                                    const ReplicaOptions& options, bool back) {
  ReplicaReport report;
  const int n = comm.size(), r = comm.rank();
  if (options.replicas <= 1) return report;
  const uint64_t jump = std::max<uint32_t>(1, options.jump), copies = options.replicas;
  const bool clique = options.strategy == ReplicaStrategy::kClique;
  if (copies * jump > static_cast<uint64_t>(n) || (clique && n % (copies * jump) != 0)) {
    const std::string need = clique ? "a multiple of " + std::to_string(copies * jump)
                                    : "at least " + std::to_string(copies * jump);
    return Status::InvalidArgument("replicas " + std::to_string(copies) + " with a jump of " + std::to_string(jump) +
                                   " in a " + (clique ? "clique" : "ring") + " need a job of " + need +
                                   " ranks, not " + std::to_string(n) +
                                   " (fewer would put copies back on their own host)");
  }
  // Round k's peers: the rank ahead gets my part, the one behind sends
  // its own. In a ring they are k jumps away; in a clique k places away
  // among the clique's members, around the clique.
  auto peers = [&](uint64_t k) -> std::pair<int, int> {
    if (!clique) {
      const int step = static_cast<int>(k * jump);
      return {(r + step) % n, (r + n - step) % n};
    }
    const uint64_t block = copies * jump, base = r - r % block, lane = r % jump, place = (r % block) / jump;
    return {static_cast<int>(base + ((place + k) % copies) * jump + lane),
            static_cast<int>(base + ((place + copies - k) % copies) * jump + lane)};
  };
  Status local = fast.remote()
                     ? Status::InvalidArgument("the fast tier must be a local directory, not " + fast.path())
                     : Status::OK();
  bool take = true;
  if (local.ok()) {
    auto mine = HoldsPart(fast, name, static_cast<uint32_t>(r));
    if (!mine.ok()) {
      local = mine.status();
    } else if (back) {
      take = !*mine;
    } else if (!*mine) {
      local = Status::FailedPrecondition("its part of checkpoint '" + name + "' is not in its fast tier " +
                                         fast.path() + " (save it first)");
    }
  }
  for (uint32_t k = 1; k < copies; ++k) {
    const auto [ahead, behind] = peers(k);
    // Replicas: my part goes ahead, the one behind me comes here. Back:
    // the copy I keep of the rank behind me goes back to it, mine comes
    // from the rank ahead.
    if (back) {
      CKPT_RETURN_IF_ERROR(SwapParts(fast, name, comm, behind, ahead, static_cast<uint32_t>(behind), take, &local,
                                     &report));
      if (local.ok() && take) {
        auto mine = HoldsPart(fast, name, static_cast<uint32_t>(r));
        if (mine.ok()) take = !*mine; else local = mine.status();
      }
    } else {
      CKPT_RETURN_IF_ERROR(SwapParts(fast, name, comm, ahead, behind, static_cast<uint32_t>(r), true, &local, &report));
    }
  }
  std::vector<uint64_t> ok = {local.ok() ? 1u : 0u};
  CKPT_RETURN_IF_ERROR(comm.AllReduceMin(ok));
  const std::string what = back ? "restoring the parts of checkpoint '" + name + "' from peers"
                                : "replicas of checkpoint '" + name + "'";
  if (!local.ok()) return local.WithContext(what + " at rank " + std::to_string(r));
  if (ok[0] == 0) {
    return Status::FailedPrecondition(what + ": another rank failed (its error names it)");
  }
  if (!back) {
    // Every rank's part now has its copies: this host records it.
    CKPT_RETURN_IF_ERROR(RecordCopies(fast, name, options.replicas, r).WithContext(what));
  }
  return report;
}

}  // namespace

Result<ReplicaReport> ReplicateRankParts(Repository& fast, const std::string& name, Communicator& comm,
                                         const ReplicaOptions& options) {
  return ExchangeParts(fast, name, comm, options, /*back=*/false);
}

Result<ReplicaReport> RestoreRankParts(Repository& fast, const std::string& name, Communicator& comm,
                                       const ReplicaOptions& options) {
  return ExchangeParts(fast, name, comm, options, /*back=*/true);
}

Status HoldNotDurable(Repository& fast, Repository& shared, RetentionPolicy* policy) {
  CKPT_ASSIGN_OR_RETURN(std::vector<TierEntry> entries, TierStatus(fast, shared));
  for (const TierEntry& e : entries) {
    if (!e.durable) policy->held.emplace_back(e.name, "not yet durable in the shared tier");
  }
  return Status::OK();
}

}  // namespace ckptfs
