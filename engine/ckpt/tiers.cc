// Two tiers (tiers.h): a host's fast repository drained to a shared one.
#include "ckpt/tiers.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "backend/durable_file.h"
#include "ckpt/copy.h"
#include "ckpt/layout.h"
#include "ckpt/repo_lock.h"
#include "ckpt/repository_impl.h"

namespace ckptfs {
namespace {

std::string SharedTierPath(const std::string& fast_path) { return fast_path + "/" + kSharedTierFile; }

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

Status CheckTiers(RepositoryImpl& fast, RepositoryImpl& shared) {
  CKPT_RETURN_IF_ERROR(fast.CheckProcess());
  CKPT_RETURN_IF_ERROR(shared.CheckProcess());
  if (fast.remote) {
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

std::string TierEntry::state() const {
  if (durable) return "durable";
  return !ranks_here.empty() && ranks_shared.size() == ranks_here.size() ? "drained" : "local";
}

Result<std::vector<TierEntry>> TierStatus(Repository& fast, Repository& shared) {
  CKPT_RETURN_IF_ERROR(CheckTiers(*fast.impl_, *shared.impl_));
  CKPT_RETURN_IF_ERROR(shared.Refresh());
  CKPT_ASSIGN_OR_RETURN(std::vector<CheckpointRecord> here, fast.ListCheckpoints(/*include_pending=*/true));
  CKPT_ASSIGN_OR_RETURN(std::vector<CheckpointRecord> there, shared.ListCheckpoints(/*include_pending=*/true));
  std::map<std::string, const CheckpointRecord*> shared_by_name;
  for (const CheckpointRecord& c : there) shared_by_name[c.name] = &c;
  std::vector<TierEntry> entries;
  for (const CheckpointRecord& c : here) {
    if (keys::IsReplacementCheckpoint(c.name)) continue;  // a save replacing a name, not yet renamed
    TierEntry e;
    e.name = c.name;
    e.step = c.step;
    e.world_size = c.world_size;
    e.created_unix_ms = c.created_unix_ms;
    e.logical_bytes = c.logical_bytes;
    e.tags = c.tags;
    e.attempt = c.attempt;
    e.complete_here = c.state == CheckpointState::kCommitted;
    if (e.complete_here) {
      for (uint32_t r = 0; r < c.world_size; ++r) e.ranks_here.push_back(r);
    } else {
      e.ranks_here = c.committed_ranks;
    }
    if (auto it = shared_by_name.find(c.name); it != shared_by_name.end()) {
      const CheckpointRecord& s = *it->second;
      const bool same = s.world_size == c.world_size && s.step == c.step;
      if (same && s.state == CheckpointState::kCommitted) {
        e.durable = true;
        e.ranks_shared = e.ranks_here;
      } else if (same && (s.attempt == c.attempt || e.complete_here)) {
        std::set_intersection(e.ranks_here.begin(), e.ranks_here.end(), s.committed_ranks.begin(),
                              s.committed_ranks.end(), std::back_inserter(e.ranks_shared));
      }
    }
    entries.push_back(std::move(e));
  }
  return entries;
}

Result<DrainReport> Drain(Repository& fast, Repository& shared, const DrainOptions& options,
                          const ProgressFn& progress) {
  RepositoryImpl& src = *fast.impl_;
  RepositoryImpl& dst = *shared.impl_;
  CKPT_RETURN_IF_ERROR(CheckTiers(src, dst));
  // One drain of this fast tier at a time: the ranks of one host each run
  // one, and a rank must not be committed in the shared tier twice.
  CKPT_ASSIGN_OR_RETURN(RepoLock alone, RepoLock::Acquire(src.state_dir, RepoLock::Mode::kExclusive,
                                                           RepoLock::Name::kDrain));
  CKPT_ASSIGN_OR_RETURN(std::vector<TierEntry> entries, TierStatus(fast, shared));
  auto phase = [&](const std::string& what) {
    if (options.on_phase) options.on_phase(what);
  };
  std::vector<const TierEntry*> selected;
  if (options.names.empty()) {
    for (const TierEntry& e : entries) {
      if (!e.durable) selected.push_back(&e);
    }
  } else {
    std::map<std::string, const TierEntry*> by_name;
    for (const TierEntry& e : entries) by_name[e.name] = &e;
    for (const std::string& n : options.names) {
      auto it = by_name.find(n);
      if (it == by_name.end()) return Status::NotFound("the fast tier holds no checkpoint '" + n + "'");
      selected.push_back(it->second);
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
    out.sent.name = e->name;
    if (e->durable || e->ranks_shared.size() == e->ranks_here.size()) {
      out.sent.outcome = CopiedCheckpoint::Outcome::kPresent;
      out.durable = e->durable;
      phase(e->name + (e->durable ? ": durable in the shared tier" : ": drained; waiting for other hosts' ranks"));
      report.checkpoints.push_back(out);
      done_before += e->logical_bytes;
      continue;
    }
    // The parts of this host's ranks, and the save's attempt.
    std::vector<RankRecord> parts;
    std::unique_ptr<CheckpointReader> reader;  // its lease keeps a committed checkpoint's bytes
    if (e->complete_here) {
      CKPT_ASSIGN_OR_RETURN(reader, fast.OpenCheckpoint(e->name));
      CKPT_RETURN_IF_ERROR(CheckShardRanks(*reader));
      for (uint32_t r : e->ranks_here) parts.push_back(PartOfRank(reader->tensors(), reader->blobs(), r));
    } else {
      CKPT_ASSIGN_OR_RETURN(parts, PendingParts(src, e->name));
    }
    std::erase_if(parts, [&](const RankRecord& p) {
      return std::binary_search(e->ranks_shared.begin(), e->ranks_shared.end(), p.rank);
    });
    phase("draining " + e->name + " (" + std::to_string(parts.size()) + (parts.size() == 1 ? " rank" : " ranks") +
          (e->ranks_shared.empty() ? "" : ", " + std::to_string(e->ranks_shared.size()) + " drained before") + ")");
    WriterOptions header;
    header.world_size = e->world_size;
    header.step = e->step;
    header.attempt = e->attempt;
    header.tags = e->tags;
    header.engine_tags = true;
    CopyCounters counters;
    counters.cancelled = options.cancelled;
    HandledChunks handled;
    Status st = PutRanks(src, fetcher, shared, dst, e->name, header, parts, options.ranks_at_once, handled, counters,
                         &out.sent.ranks_copied, &out.sent.stored_bytes_sent, [&] {
                           if (!progress) return;
                           const uint64_t handled_bytes =
                               counters.raw_bytes_sent.load() + counters.raw_bytes_present.load();
                           progress(done_before + std::min(handled_bytes, e->logical_bytes), total);
                         });
    if (!st.ok()) {
      return st.WithContext("draining '" + e->name + "' to the shared tier stopped after " +
                            std::to_string(out.sent.ranks_copied) +
                            " ranks (they stay there; draining again sends the rest)");
    }
    out.sent.chunks_sent = counters.chunks_sent.load();
    out.sent.raw_bytes_sent = counters.raw_bytes_sent.load();
    out.sent.chunks_present = counters.chunks_present.load();
    out.sent.raw_bytes_present = counters.raw_bytes_present.load();
    out.durable = shared.GetCheckpoint(e->name).ok();
    phase(e->name + (out.durable ? ": durable in the shared tier" : ": drained; waiting for other hosts' ranks"));
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

Result<std::vector<std::string>> PlanFastTierTrim(Repository& fast, Repository& shared, uint64_t keep_last) {
  CKPT_ASSIGN_OR_RETURN(std::vector<TierEntry> entries, TierStatus(fast, shared));
  const bool by_step = std::all_of(entries.begin(), entries.end(), [](const TierEntry& e) { return e.step.has_value(); });
  std::stable_sort(entries.begin(), entries.end(), [&](const TierEntry& a, const TierEntry& b) {
    return by_step ? *a.step < *b.step : a.created_unix_ms < b.created_unix_ms;
  });
  std::vector<std::string> drop;
  const size_t older = entries.size() > keep_last ? entries.size() - keep_last : 0;
  for (size_t i = 0; i < older; ++i) {
    if (entries[i].durable) drop.push_back(entries[i].name);
  }
  return drop;
}

Status HoldUndrained(Repository& fast, Repository& shared, RetentionPolicy* policy) {
  CKPT_ASSIGN_OR_RETURN(std::vector<TierEntry> entries, TierStatus(fast, shared));
  for (const TierEntry& e : entries) {
    if (!e.durable) policy->held.emplace_back(e.name, "not yet durable in the shared tier (" + e.state() + ")");
  }
  return Status::OK();
}

}  // namespace ckptfs
