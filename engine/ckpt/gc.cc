// Retention, disk usage and garbage collection.
#include <algorithm>
#include <cstring>
#include <map>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "ckpt/object_lock.h"
#include "ckpt/repo_lock.h"
#include "ckpt/repository.h"
#include "ckpt/repository_impl.h"
#include "core/crash_point.h"

namespace ckptfs {
namespace {

using keys::CheckpointOfKey;

// Calls fn(checkpoint, chunk) for every chunk reference in the catalog:
// committed tensors and blobs, and the contributions of pending ranks.
Status ForEachReference(const ReadTxn& txn, const std::function<void(const std::string&, const ChunkRef&)>& fn) {
  Status inner;
  auto scan = [&](Table table) {
    return txn.Scan(table, "", [&](std::string_view k, std::string_view v) {
      const std::string ckpt = CheckpointOfKey(k);
      if (table == Table::kTensors) {
        auto t = DecodeTensor(v);
        if (!t.ok()) return (inner = t.status(), false);
        for (const auto& s : t->shards) for (const auto& c : s.chunks) fn(ckpt, c);
      } else if (table == Table::kBlobs) {
        auto b = DecodeBlob(v);
        if (!b.ok()) return (inner = b.status(), false);
        for (const auto& c : b->chunks) fn(ckpt, c);
      } else {
        auto r = DecodeRank(v);
        if (!r.ok()) return (inner = r.status(), false);
        for (const auto& t : r->tensors) for (const auto& s : t.shards) for (const auto& c : s.chunks) fn(ckpt, c);
        for (const auto& b : r->blobs) for (const auto& c : b.chunks) fn(ckpt, c);
      }
      return true;
    });
  };
  CKPT_RETURN_IF_ERROR(scan(Table::kTensors));
  CKPT_RETURN_IF_ERROR(inner);
  CKPT_RETURN_IF_ERROR(scan(Table::kBlobs));
  CKPT_RETURN_IF_ERROR(inner);
  CKPT_RETURN_IF_ERROR(scan(Table::kRanks));
  return inner;
}

}  // namespace

namespace {

// A duration as --keep-within takes it, in the largest units that fit.
std::string FormatDuration(uint64_t seconds) {
  if (seconds == 0) return "0s";
  static constexpr std::pair<uint64_t, char> kUnits[] = {{604800, 'w'}, {86400, 'd'}, {3600, 'h'}, {60, 'm'}, {1, 's'}};
  std::string out;
  for (const auto& [size, unit] : kUnits) {
    if (seconds >= size) {
      out += std::to_string(seconds / size) + unit;
      seconds %= size;
    }
  }
  return out;
}

std::string Ordinal(uint64_t n) {
  const uint64_t tens = n % 100, ones = n % 10;
  const char* suffix = (tens >= 11 && tens <= 13) ? "th" : ones == 1 ? "st" : ones == 2 ? "nd" : ones == 3 ? "rd" : "th";
  return std::to_string(n) + suffix;
}

}  // namespace

Result<std::vector<std::string>> Repository::PlanRetention(const RetentionPolicy& policy) {
  CKPT_ASSIGN_OR_RETURN(auto decisions, ExplainRetention(policy));
  std::vector<std::string> remove;
  for (const auto& d : decisions) {
    if (!d.keep) remove.push_back(d.name);
  }
  return remove;
}

Result<std::vector<RetentionDecision>> Repository::ExplainRetention(const RetentionPolicy& policy) {
  CKPT_RETURN_IF_ERROR(impl_->CheckProcess());
  if (policy.empty()) return std::vector<RetentionDecision>{};
  if (policy.keep_every && *policy.keep_every == 0) return Status::InvalidArgument("--keep-every must be at least 1");
  if (policy.thin_older_than && *policy.thin_older_than == 0) {
    return Status::InvalidArgument("--thin-older-than must be at least 1: the newest checkpoint stays whole");
  }
  CKPT_ASSIGN_OR_RETURN(auto list, ListCheckpoints(false));  // commit order
  std::erase_if(list, [&](const CheckpointRecord& c) { return !InGroup(c.name, policy.group); });
  for (const auto& name : policy.keep) {
    if (std::none_of(list.begin(), list.end(), [&](const CheckpointRecord& c) { return c.name == name; })) {
      return Status::InvalidArgument("--keep " + name + ": no committed checkpoint " +
                                     (policy.group.empty() ? "" : "of group '" + policy.group + "' ") + "has that name");
    }
  }
  if (list.empty()) return std::vector<RetentionDecision>{};
  // keep-last's order: by step when every checkpoint has one (a run that
  // went back to an earlier step counts by step), else by commit order.
  const bool by_step = std::all_of(list.begin(), list.end(), [](const CheckpointRecord& c) { return c.step.has_value(); });
  if (by_step) {
    std::stable_sort(list.begin(), list.end(), [](const CheckpointRecord& a, const CheckpointRecord& b) {
      return std::pair(*a.step, a.sequence) < std::pair(*b.step, b.sequence);
    });
  }
  uint64_t newest_ms = 0;
  for (const auto& c : list) newest_ms = std::max(newest_ms, c.committed_unix_ms);
  const std::set<std::string> named(policy.keep.begin(), policy.keep.end());
  // Thin retention, for checkpoint `c`, kept, the `from_newest`-th newest.
  auto decide_thin = [&](const CheckpointRecord& c, uint64_t from_newest, RetentionDecision& d) -> Status {
    const uint64_t n = *policy.thin_older_than;
    const std::string rule = "thin-older-than " + std::to_string(n) + ": ";
    const std::string order = by_step ? " by step" : " by commit order";
    if (from_newest <= n) {
      d.thin_why = rule + "among the newest " + std::to_string(n) + order + ", whole";
      return Status::OK();
    }
    ReadOptions manifest_only;
    manifest_only.lease = false;
    CKPT_ASSIGN_OR_RETURN(auto reader, OpenCheckpoint(c.name, manifest_only));
    const ThinPlan plan = PlanThin(reader->tensors(), reader->blobs(), policy.thin_keep);
    d.thin_why = rule + "the " + Ordinal(from_newest) + " newest" + order;
    if (!plan.drops()) {
      d.thin_why += ThinnedNote(c.tags) ? ", thinned before, nothing to drop" : ", nothing to drop";
    } else if (plan.tensors.empty()) {
      d.thin_why += ", left whole: thinning would keep none of its tensors (it drops " +
                    DescribeThinRule(policy.thin_keep) + ")";
    } else {
      d.thin = true;
      d.thin_tensors = plan.dropped_tensors;
      d.thin_blobs = plan.dropped_blobs;
      d.thin_bytes = plan.dropped_bytes;
      d.thin_why += ", drops " + DescribeDropped(plan) + " of " + DescribeThinRule(policy.thin_keep);
    }
    return Status::OK();
  };
  std::vector<RetentionDecision> out;
  uint64_t stepless_seen = 0;  // keep-every's count of checkpoints without a step, in commit order
  // Commit order of the ones without a step (list may be sorted by step).
  std::map<std::string, uint64_t> stepless_index;
  {
    std::vector<const CheckpointRecord*> stepless;
    for (const auto& c : list) {
      if (!c.step) stepless.push_back(&c);
    }
    std::sort(stepless.begin(), stepless.end(),
              [](const CheckpointRecord* a, const CheckpointRecord* b) { return a->sequence < b->sequence; });
    for (const auto* c : stepless) stepless_index[c->name] = stepless_seen++;
  }
  for (size_t i = 0; i < list.size(); ++i) {
    const CheckpointRecord& c = list[i];
    std::vector<std::string> kept, not_kept;
    if (named.count(c.name)) kept.push_back("--keep");
    for (const auto& [name, why] : policy.held) {
      if (name == c.name) kept.push_back(why);
    }
    if (policy.keep_last) {
      const uint64_t rank_from_newest = list.size() - i;  // 1 for the newest
      const std::string order = by_step ? "by step" : "by commit order";
      if (rank_from_newest <= *policy.keep_last) {
        kept.push_back("keep-last " + std::to_string(*policy.keep_last) + ": the " +
                       (rank_from_newest == 1 ? std::string("newest") : Ordinal(rank_from_newest) + " newest") + " " +
                       order);
      } else {
        not_kept.push_back("keep-last " + std::to_string(*policy.keep_last) + ": the " + Ordinal(rank_from_newest) +
                           " newest " + order);
      }
    }
    if (policy.keep_every) {
      const uint64_t k = *policy.keep_every;
      const std::string rule = "keep-every " + std::to_string(k) + ": ";
      if (c.step) {
        const bool hit = *c.step >= 0 && static_cast<uint64_t>(*c.step) % k == 0;
        (hit ? kept : not_kept).push_back(rule + "step " + std::to_string(*c.step) +
                                          (hit ? "" : " is not a multiple of " + std::to_string(k)));
      } else {
        const uint64_t index = stepless_index[c.name];
        const bool hit = index % k == 0;
        (hit ? kept : not_kept)
            .push_back(rule + "no step; the " + Ordinal(index + 1) + " of " + std::to_string(stepless_seen) +
                       " without one, in commit order" + (hit ? "" : ", not 1 more than a multiple of " + std::to_string(k)));
      }
    }
    if (policy.keep_within_s) {
      const uint64_t window_ms =
          *policy.keep_within_s > UINT64_MAX / 1000 ? UINT64_MAX : *policy.keep_within_s * 1000;
      const uint64_t age_s = (newest_ms - c.committed_unix_ms) / 1000;
      const bool hit = newest_ms - c.committed_unix_ms <= window_ms;
      (hit ? kept : not_kept)
          .push_back("keep-within " + FormatDuration(*policy.keep_within_s) + ": committed " + FormatDuration(age_s) +
                     " before the newest");
    }
    RetentionDecision d;
    d.name = c.name;
    d.step = c.step;
    d.keep = !kept.empty() || !policy.removes();
    const std::vector<std::string>& reasons = kept.empty() ? not_kept : kept;
    for (size_t r = 0; r < reasons.size(); ++r) d.why += (r ? "; " : "") + reasons[r];
    if (d.keep && d.why.empty()) d.why = "no --keep-* rule: nothing is removed";
    if (!d.keep && d.why.empty()) d.why = "no rule keeps it";
    if (policy.thin_older_than && d.keep) {
      CKPT_RETURN_IF_ERROR(decide_thin(c, list.size() - i, d));
    }
    out.push_back(std::move(d));
  }
  // The newest is the last in keep-last's order, the one keep-last 1 keeps.
  const RetentionDecision& newest = out.back();
  if (!newest.keep && !policy.allow_removing_newest) {
    const bool all = std::none_of(out.begin(), out.end(), [](const RetentionDecision& d) { return d.keep; });
    const std::string what = all ? "every checkpoint (" + std::to_string(out.size()) + ")"
                                 : "the newest committed checkpoint '" + newest.name + "'";
    return Status::FailedPrecondition("this retention policy would remove " + what +
                                      "; nothing was removed. Keep it (for example --keep-last 1), name it "
                                      "to rm, or pass --allow-removing-newest");
  }
  return out;
}

Result<uint64_t> ParseDuration(std::string_view text) {
  auto bad = [&] {
    return Status::InvalidArgument("'" + std::string(text) +
                                   "' is not a duration: give numbers with units s, m, h, d or w, such as 36h or 1w2d");
  };
  if (text.empty()) return bad();
  uint64_t total = 0;
  size_t i = 0;
  while (i < text.size()) {
    if (text[i] < '0' || text[i] > '9') return bad();
    uint64_t n = 0;
    while (i < text.size() && text[i] >= '0' && text[i] <= '9') {
      if (n > (UINT64_MAX - 9) / 10) return bad();
      n = n * 10 + static_cast<uint64_t>(text[i++] - '0');
    }
    uint64_t unit = 1;
    if (i < text.size()) {
      switch (text[i++]) {
        case 's': unit = 1; break;
        case 'm': unit = 60; break;
        case 'h': unit = 3600; break;
        case 'd': unit = 86400; break;
        case 'w': unit = 7 * 86400; break;
        default: return bad();
      }
    } else if (total != 0) {
      return bad();  // "1h30": a bare number only on its own
    }
    if (n > UINT64_MAX / unit || total > UINT64_MAX - n * unit) return bad();
    total += n * unit;
  }
  return total;
}

Result<UsageReport> Repository::DiskUsage(const std::vector<std::string>& names) {
  CKPT_RETURN_IF_ERROR(impl_->CheckProcess());
  CKPT_RETURN_IF_ERROR(impl_->protocol->IndexPacks());
  CKPT_ASSIGN_OR_RETURN(auto list, ListCheckpoints(false));
  std::map<std::string, const CheckpointRecord*> committed;
  for (const auto& c : list) committed[c.name] = &c;
  for (const auto& n : names) {
    if (!committed.count(n)) return Status::NotFound("no committed checkpoint named '" + n + "'");
  }
  UsageReport report;
  struct Use {
    std::vector<std::string> owners;  // committed checkpoints; "" for pending ones
    uint32_t raw_len = 0;
  };
  std::unordered_map<ChunkId, Use, ChunkIdHash> uses;
  std::unordered_map<ChunkId, uint32_t, ChunkIdHash> stored_len;
  std::unordered_set<std::string> recorded_packs;
  std::set<std::string> retired_names;
  CKPT_RETURN_IF_ERROR(impl_->catalog->Read([&](const ReadTxn& txn) -> Status {
    CKPT_RETURN_IF_ERROR(ForEachReference(txn, [&](const std::string& ckpt, const ChunkRef& c) {
      Use& u = uses[c.id];
      u.raw_len = c.raw_len;
      // "" for pending ranks, "/" for removed checkpoints kept for readers.
      const std::string owner = committed.count(ckpt) ? ckpt : keys::IsRetiredCheckpoint(ckpt) ? "/" : "";
      if (owner == "/") retired_names.insert(ckpt);
      if (std::find(u.owners.begin(), u.owners.end(), owner) == u.owners.end()) u.owners.push_back(owner);
    }));
    Status inner;
    CKPT_RETURN_IF_ERROR(ScanDecoded<ChunkLocation>(txn, Table::kChunks, "", DecodeChunkLocation,
                                                    [&](std::string_view k, ChunkLocation&& loc) {
                                                      auto id = keys::ChunkIdOfKey(k);
                                                      if (!id.ok()) return (inner = id.status(), false);
                                                      stored_len[*id] = loc.stored_len;
                                                      return true;
                                                    }));
    CKPT_RETURN_IF_ERROR(inner);
    return ScanDecoded<PackInfo>(txn, Table::kPacks, "", DecodePackInfo, [&](std::string_view k, PackInfo&& info) {
      report.pack_bytes += info.size;
      recorded_packs.insert(std::string(k));
      return true;
    });
  }));
  if (impl_->protocol->UnknownPacksAreLeftovers()) {
    CKPT_ASSIGN_OR_RETURN(auto keys, impl_->backend->List(keys::kPackPrefix));
    for (const auto& key : keys) {
      std::string id;
      if (!ParsePackKey(key, &id) || recorded_packs.count(id)) continue;
      auto size = impl_->backend->Size(key);
      if (!size.ok()) continue;  // gone meanwhile
      ++report.unrecorded_packs;
      report.unrecorded_pack_bytes += *size;
    }
  }
  for (const auto& [id, stored] : stored_len) {
    if (!uses.count(id)) report.unreferenced_bytes += stored;
  }
  std::map<std::string, UsageEntry> entries;
  for (const auto& c : list) {
    entries[c.name] = UsageEntry{c.name, c.logical_bytes, 0, 0};
    report.logical_bytes += c.logical_bytes;
  }
  for (const auto& [id, u] : uses) {
    auto it = stored_len.find(id);
    const uint64_t stored = it == stored_len.end() ? 0 : it->second;
    bool any_committed = false, any_retired = false;
    for (const auto& o : u.owners) {
      if (o == "/") any_retired = true;
      if (o.empty() || o == "/") continue;
      any_committed = true;
      entries[o].referenced_bytes += stored;
      if (u.owners.size() == 1) entries[o].exclusive_bytes += stored;
    }
    if (any_committed) {
      report.unique_raw_bytes += u.raw_len;
      report.referenced_bytes += stored;
    } else if (any_retired) {
      report.retired_bytes += stored;
    } else {
      report.pending_bytes += stored;
    }
  }
  report.retired_checkpoints = retired_names.size();
  for (const auto& c : list) {
    if (names.empty() || std::find(names.begin(), names.end(), c.name) != names.end()) {
      report.checkpoints.push_back(entries[c.name]);
    }
  }
  return report;
}

const char* StateKindOf(std::string_view name, DType dtype, bool blob) {
  if (blob) return "other";
  const size_t cut = name.find_last_of("./");
  const std::string_view last = cut == std::string_view::npos ? name : name.substr(cut + 1);
  if (last == "exp_avg_sq" || last == "max_exp_avg_sq") return "adam_exp_avg_sq";
  if (last == "exp_avg" || last == "momentum_buffer") return "adam_exp_avg";
  if (last == "step") return "other";
  if (dtype == DType::kBF16 || dtype == DType::kF16) return "weights_16bit";
  if (dtype == DType::kF32) return "weights_fp32";
  return "other";
}

Result<std::vector<KindUsage>> Repository::UsageByKind(const std::vector<std::string>& names) {
  CKPT_RETURN_IF_ERROR(impl_->CheckProcess());
  CKPT_ASSIGN_OR_RETURN(auto list, ListCheckpoints(false));
  std::vector<std::string> chosen = names;
  if (chosen.empty()) {
    for (const auto& c : list) chosen.push_back(c.name);
  }
  for (const auto& n : chosen) {
    if (std::none_of(list.begin(), list.end(), [&](const CheckpointRecord& c) { return c.name == n; })) {
      return Status::NotFound("no committed checkpoint named '" + n + "'");
    }
  }
  constexpr size_t kKinds = std::size(kStateKinds);
  std::vector<KindUsage> out(kKinds);
  for (size_t k = 0; k < kKinds; ++k) out[k].kind = kStateKinds[k];
  auto index = [&](const char* kind) {
    for (size_t k = 0; k < kKinds; ++k) {
      if (std::string_view(kStateKinds[k]) == kind) return k;
    }
    return kKinds - 1;
  };
  // The distinct chunks of each kind, with their decoded length.
  std::vector<std::unordered_map<ChunkId, uint32_t, ChunkIdHash>> chunks(kKinds);
  ReadOptions read;
  read.lease = false;  // the manifests only: no chunk is read
  for (const auto& n : chosen) {
    CKPT_ASSIGN_OR_RETURN(auto reader, OpenCheckpoint(n, read));
    for (const TensorRecord& t : reader->tensors()) {
      const size_t k = index(StateKindOf(t.name, t.dtype, false));
      ++out[k].tensors;
      out[k].logical_bytes += t.ByteSize();
      for (const ShardRecord& s : t.shards) {
        for (const ChunkRef& c : s.chunks) chunks[k].emplace(c.id, c.raw_len);
      }
    }
    for (const BlobRecord& b : reader->blobs()) {
      const size_t k = index(StateKindOf(b.name, DType::kU8, true));
      ++out[k].tensors;
      out[k].logical_bytes += b.size;
      for (const ChunkRef& c : b.chunks) chunks[k].emplace(c.id, c.raw_len);
    }
  }
  CKPT_RETURN_IF_ERROR(impl_->catalog->Read([&](const ReadTxn& txn) -> Status {
    for (size_t k = 0; k < kKinds; ++k) {
      for (const auto& [id, raw_len] : chunks[k]) {
        out[k].unique_raw_bytes += raw_len;
        CKPT_ASSIGN_OR_RETURN(auto value, txn.Get(Table::kChunks, keys::Chunk(id)));
        if (!value) continue;  // only another host's catalog records it yet
        CKPT_ASSIGN_OR_RETURN(ChunkLocation loc, DecodeChunkLocation(*value));
        out[k].stored_bytes += loc.stored_len;
      }
    }
    return Status::OK();
  }));
  return out;
}

namespace {

struct PackState {
  uint64_t size = 0;
  uint64_t live_bytes = 0;
  std::vector<std::pair<ChunkId, ChunkLocation>> live;
};

// The catalog's view of liveness: every pack with its live chunks, and the
// chunks no checkpoint outside `excluded` references.
struct Liveness {
  std::map<std::string, PackState> packs;
  std::vector<std::pair<ChunkId, std::string>> dead;  // with its pack
  std::unordered_set<ChunkId, ChunkIdHash> live;
  uint64_t live_bytes = 0;
};

Result<Liveness> Analyze(LmdbEnv& catalog, const std::set<std::string>& excluded,
                         const std::unordered_set<ChunkId, ChunkIdHash>& also_live = {}) {
  Liveness l;
  l.live.insert(also_live.begin(), also_live.end());
  CKPT_RETURN_IF_ERROR(catalog.Read([&](const ReadTxn& txn) -> Status {
    CKPT_RETURN_IF_ERROR(ForEachReference(txn, [&](const std::string& ckpt, const ChunkRef& c) {
      if (!excluded.count(ckpt)) l.live.insert(c.id);
    }));
    CKPT_RETURN_IF_ERROR(ScanDecoded<PackInfo>(txn, Table::kPacks, "", DecodePackInfo,
                                               [&](std::string_view k, PackInfo&& info) {
                                                 l.packs[std::string(k)].size = info.size;
                                                 return true;
                                               }));
    Status inner;
    CKPT_RETURN_IF_ERROR(ScanDecoded<ChunkLocation>(txn, Table::kChunks, "", DecodeChunkLocation,
                                                    [&](std::string_view k, ChunkLocation&& loc) {
                                                      auto id = keys::ChunkIdOfKey(k);
                                                      if (!id.ok()) return (inner = id.status(), false);
                                                      if (l.live.count(*id)) {
                                                        PackState& p = l.packs[loc.pack];
                                                        p.live_bytes += loc.stored_len;
                                                        p.live.emplace_back(*id, loc);
                                                        l.live_bytes += loc.stored_len;
                                                      } else {
                                                        l.dead.emplace_back(*id, loc.pack);
                                                      }
                                                      return true;
                                                    }));
    return inner;
  }));
  return l;
}

// What a collection deletes, seen from `l`: packs with nothing live (those
// not being rewritten) and orphans — pack files the catalog does not know and
// this run did not write — where such a pack is a leftover of a killed save
// (`orphans_are_leftovers`: a catalog that records every pack at commit).
// Where the catalog learns packs from listings, a pack it does not know is
// one whose index it could not read (damaged): kept, for verify to report,
// since it may hold the only copy of chunks someone references. Fills the
// report's counts and byte totals; what replaces the rewritten packs is
// added by the caller.
struct Disposal {
  std::vector<std::string> drop;
  std::vector<std::string> orphans;
};

Result<Disposal> Dispose(Backend* backend, const Liveness& l, const std::set<std::string>& rewrite,
                         const std::set<std::string>& written, bool orphans_are_leftovers, GcReport& report) {
  Disposal d;
  CKPT_ASSIGN_OR_RETURN(auto keys, backend->List(keys::kPackPrefix));
  for (const auto& key : keys) {
    std::string id;
    if (orphans_are_leftovers && ParsePackKey(key, &id) && !l.packs.count(id) && !written.count(id)) {
      d.orphans.push_back(id);
      auto size = backend->Size(key);
      report.bytes_before += size.ok() ? *size : 0;
      report.orphan_pack_bytes += size.ok() ? *size : 0;
    }
  }
  for (const auto& [id, p] : l.packs) {
    report.bytes_before += p.size;
    if (p.live_bytes == 0 && !rewrite.count(id)) {
      d.drop.push_back(id);
      report.dead_pack_bytes += p.size;
    } else if (rewrite.count(id)) {
      report.rewritten_pack_bytes += p.size;
      report.rewritten_live_bytes += p.live_bytes;
    } else {
      report.bytes_after += p.size;
    }
  }
  report.dead_chunks = l.dead.size();
  report.live_bytes = l.live_bytes;
  report.orphan_packs = d.orphans.size();
  report.packs_rewritten = rewrite.size();
  report.packs_deleted = d.drop.size() + rewrite.size() + d.orphans.size();
  return d;
}

// Removed checkpoints kept for their readers (lease.h), split by whether a
// read lease on their name is held now.
struct RetiredPlan {
  std::vector<std::string> doomed, kept;  // catalog names "NAME/TOKEN"
};

Result<std::vector<std::string>> RetiredInCatalog(LmdbEnv& catalog) {
  std::vector<std::string> out;
  CKPT_RETURN_IF_ERROR(catalog.Read([&](const ReadTxn& txn) {
    return txn.Scan(Table::kCheckpoints, "", [&](std::string_view k, std::string_view) {
      if (keys::IsRetiredCheckpoint(k)) out.emplace_back(k);
      return true;
    });
  }));
  return out;
}

// The protocol says which are leased (CommitProtocol::Leased; `scan` may
// keep the free names locked against new readers until it is destroyed).
Result<RetiredPlan> PlanRetired(RepositoryImpl& repo, LocalLeaseScan& scan) {
  RetiredPlan plan;
  CKPT_ASSIGN_OR_RETURN(auto retired, RetiredInCatalog(*repo.catalog));
  if (retired.empty()) return plan;
  CKPT_ASSIGN_OR_RETURN(std::set<std::string> leased, repo.protocol->Leased(retired, scan));
  for (auto& r : retired) (leased.count(keys::BaseName(r)) ? plan.kept : plan.doomed).push_back(std::move(r));
  return plan;
}

// Drops the retired checkpoints nobody reads: their retired manifests, then
// their records, so the liveness analysis after it frees their chunks. On an
// object store a reader may have written its lease after the leases were
// listed, then found the retired manifest still there: the protocol lists
// the leases again after the deletes (LeasedSinceDelete), and a checkpoint
// leased meanwhile gets its retired manifest back and is kept (lease.h).
Status CollectRetired(RepositoryImpl& repo, RetiredPlan& plan) {
  if (plan.doomed.empty()) return Status::OK();
  for (const auto& r : plan.doomed) {
    Status st = repo.backend->Delete(keys::RetiredObject(r));
    if (!st.ok() && !st.IsNotFound()) return st;
  }
  CKPT_ASSIGN_OR_RETURN(std::set<std::string> leased, repo.protocol->LeasedSinceDelete());
  if (!leased.empty()) {
    std::vector<std::string> doomed;
    for (auto& r : plan.doomed) {
      if (!leased.count(keys::BaseName(r))) {
        doomed.push_back(std::move(r));
        continue;
      }
      Manifest m;
      CKPT_RETURN_IF_ERROR(repo.catalog->Read([&](const ReadTxn& txn) -> Status {
        CKPT_ASSIGN_OR_RETURN(m, LoadManifest(txn, r));
        return Status::OK();
      }));
      const std::string body = EncodeManifest(m);
      CKPT_RETURN_IF_ERROR(repo.backend->Put(keys::RetiredObject(r), std::as_bytes(std::span(body))));
      plan.kept.push_back(std::move(r));
    }
    plan.doomed = std::move(doomed);
  }
  return repo.catalog->Update([&](WriteTxn& txn) -> Status {
    for (const auto& r : plan.doomed) CKPT_RETURN_IF_ERROR(DeleteCheckpointRecords(txn, r));
    return Status::OK();
  });
}

}  // namespace

Result<GcReport> Repository::CollectGarbage(const GcOptions& options, const ProgressFn& progress) {
  CKPT_RETURN_IF_ERROR(impl_->CheckProcess());
  auto phase = [&](const std::string& what) {
    if (options.on_phase) options.on_phase(what);
  };
  GcReport report;
  // Retention decides on what the store holds now (on an object store this
  // host's catalog may lag other hosts' saves and removals).
  if (!options.retention.empty()) CKPT_RETURN_IF_ERROR(impl_->protocol->Sync(SyncScope::kCheckpoints, phase).status());
  CKPT_ASSIGN_OR_RETURN(report.retention, ExplainRetention(options.retention));
  for (const auto& d : report.retention) {
    if (!d.keep) report.removed.push_back(d.name);
  }
  std::set<std::string> excluded;  // removed, or to be removed in a dry run
  if (!report.removed.empty()) {
    if (options.dry_run) {
      excluded.insert(report.removed.begin(), report.removed.end());
    } else {
      phase("removing " + std::to_string(report.removed.size()) + " checkpoints");
      // Another gc may have removed some since retention read the list.
      CKPT_RETURN_IF_ERROR(RemoveCheckpoints(report.removed, /*missing_ok=*/true));
    }
  }
  // Thin retention: each thinned checkpoint's whole version is retired as a
  // removed one is, and collected below once no reader holds it. A dry run
  // counts the chunks its kept tensors and blobs name as live instead.
  std::unordered_set<ChunkId, ChunkIdHash> kept_by_thinned;
  for (const auto& d : report.retention) {
    if (!d.keep || !d.thin) continue;
    if (options.dry_run) {
      ReadOptions manifest_only;
      manifest_only.lease = false;
      CKPT_ASSIGN_OR_RETURN(auto reader, OpenCheckpoint(d.name, manifest_only));
      const ThinPlan plan = PlanThin(reader->tensors(), reader->blobs(), options.retention.thin_keep);
      for (const TensorRecord& t : plan.tensors) {
        for (const ShardRecord& sh : t.shards) {
          for (const ChunkRef& c : sh.chunks) kept_by_thinned.insert(c.id);
        }
      }
      for (const BlobRecord& b : plan.blobs) {
        for (const ChunkRef& c : b.chunks) kept_by_thinned.insert(c.id);
      }
      excluded.insert(d.name);
      report.thinned.push_back(d.name);
      continue;
    }
    phase("thinning " + d.name);
    CKPT_ASSIGN_OR_RETURN(bool thinned, ThinCheckpoint(*this, d.name, options.retention.thin_keep));
    if (thinned) {
      report.thinned.push_back(d.name);
    } else {
      phase(d.name + " changed while it was being thinned (saved again or removed meanwhile): left as it is");
      report.thin_skipped.push_back(d.name);
    }
  }
  Backend* backend = impl_->backend.get();
  std::optional<RepoLock> run_lock;
  // On an object store, saves on other hosts hold shared lock objects: the
  // whole run holds the exclusive one (docs/DESIGN.md "Repositories on S3").
  std::unique_ptr<ObjectLock> store_lock;
  if (!options.dry_run) {
    phase("waiting for any other gc of this host");
    CKPT_ASSIGN_OR_RETURN(RepoLock l, RepoLock::Acquire(impl_->state_dir, RepoLock::Mode::kExclusive, RepoLock::Name::kGcRun));
    run_lock.emplace(std::move(l));
    CKPT_ASSIGN_OR_RETURN(store_lock, impl_->protocol->LockHosts(ObjectLock::Mode::kExclusive, phase));
  }
  CKPT_RETURN_IF_ERROR(impl_->protocol->Sync(SyncScope::kReferences, phase).status());
  // Every listed pack's index must be in the catalog before liveness is
  // decided: a pack whose index a failed request kept out would look like
  // a leftover, and its live chunks would go with it. IndexPacks reads
  // those again, and fails the run while one stays unreadable.
  CKPT_RETURN_IF_ERROR(impl_->protocol->IndexPacks().WithContext("gc reads every pack's index before it decides"));
  phase("finding live chunks");
  // Removed checkpoints nobody reads now count as gone when choosing packs
  // to rewrite (step 2 decides again, under the lock).
  {
    LocalLeaseScan probe(impl_->state_dir);
    CKPT_ASSIGN_OR_RETURN(RetiredPlan plan, PlanRetired(*impl_, probe));
    excluded.insert(plan.doomed.begin(), plan.doomed.end());
    report.retired_collected = plan.doomed.size();
    report.retired_kept = plan.kept.size();
  }

  // 1. Without the gc lock (saves go on): find the mostly-dead packs and copy
  //    their live chunks into new packs, durably. A dry run stops after the
  //    estimate.
  CKPT_ASSIGN_OR_RETURN(Liveness before, Analyze(*impl_->catalog, excluded, kept_by_thinned));
  std::set<std::string> rewrite;
  uint64_t rewrite_bytes = 0;
  for (const auto& [id, p] : before.packs) {
    const bool replaces = std::any_of(p.live.begin(), p.live.end(),
                                      [&](const auto& chunk) { return options.replace.count(chunk.first) > 0; });
    if (replaces ||
        (p.live_bytes > 0 && static_cast<double>(p.live_bytes) < options.rewrite_below * static_cast<double>(p.size))) {
      rewrite.insert(id);
      rewrite_bytes += p.live_bytes;
    }
  }
  if (options.dry_run) {
    CKPT_RETURN_IF_ERROR(
        Dispose(backend, before, rewrite, {}, impl_->protocol->UnknownPacksAreLeftovers(), report).status());
    report.bytes_after += rewrite_bytes;  // estimate: the live bytes move to new packs
    return report;
  }
  if (!rewrite.empty()) phase("rewriting " + std::to_string(rewrite.size()) + " mostly dead packs");
  PackWriter writer(backend, impl_->config.pack_size);
  std::unordered_map<ChunkId, std::pair<ChunkLocation, ChunkLocation>, ChunkIdHash> moved;  // old, new
  std::vector<std::byte> buf;
  uint64_t copied = 0;
  auto copy = [&](const ChunkId& chunk, const ChunkLocation& loc) -> Status {
    ChunkLocation nloc;
    if (auto good = options.replace.find(chunk); good != options.replace.end()) {
      const ChunkReplacement& r = good->second;
      CKPT_ASSIGN_OR_RETURN(nloc, writer.Add(chunk, r.codec, r.raw_len, std::as_bytes(std::span(r.stored))));
    } else {
      buf.resize(loc.stored_len);
      CKPT_RETURN_IF_ERROR(backend->ReadRange(PackKey(loc.pack), loc.offset, buf));
      CKPT_ASSIGN_OR_RETURN(nloc, writer.Add(chunk, loc.codec, loc.raw_len, buf));
    }
    moved[chunk] = {loc, nloc};
    copied += loc.stored_len;
    if (progress) progress(copied, rewrite_bytes);
    return Status::OK();
  };
  for (const auto& id : rewrite) {
    for (const auto& [chunk, loc] : before.packs[id].live) CKPT_RETURN_IF_ERROR(copy(chunk, loc));
  }

  // 2. Under the exclusive lock no save is in flight: look again, since
  //    saves may have committed meanwhile (a chunk that was dead may be
  //    referenced again) and removals may have freed more.
  phase("waiting for saves in progress");
  CKPT_ASSIGN_OR_RETURN(RepoLock lock, RepoLock::Acquire(impl_->state_dir, RepoLock::Mode::kExclusive));
  phase("checking liveness again");
  //    A replacing save renames its replacement over the name under its
  //    own locks: one still there was left by a save that died in between.
  {
    std::vector<std::string> stranded;
    CKPT_RETURN_IF_ERROR(impl_->catalog->Read([&](const ReadTxn& txn) -> Status {
      return txn.Scan(Table::kCheckpoints, "", [&](std::string_view k, std::string_view) {
        if (keys::IsReplacementCheckpoint(k)) stranded.push_back(keys::ReplacedName(k));
        return true;
      });
    }));
    for (const auto& name : stranded) CKPT_RETURN_IF_ERROR(DropCommittedReplacement(*impl_, name));
  }
  //    Removed checkpoints nobody reads now go; those read stay live (and
  //    their chunks move with the rest).
  LocalLeaseScan lease_scan(impl_->state_dir);
  CKPT_ASSIGN_OR_RETURN(RetiredPlan retired, PlanRetired(*impl_, lease_scan));
  CKPT_RETURN_IF_ERROR(CollectRetired(*impl_, retired));
  report.retired_collected = retired.doomed.size();
  report.retired_kept = retired.kept.size();
  CKPT_ASSIGN_OR_RETURN(Liveness now, Analyze(*impl_->catalog, {}));
  for (const auto& id : rewrite) {
    for (const auto& [chunk, loc] : now.packs[id].live) {
      if (!moved.count(chunk)) CKPT_RETURN_IF_ERROR(copy(chunk, loc));  // became live since step 1
    }
  }
  CKPT_ASSIGN_OR_RETURN(std::vector<SealedPack> sealed, writer.Finish());
  std::set<std::string> written;
  for (const auto& p : sealed) {
    written.insert(p.id);
    report.bytes_after += p.size;
  }
  report.packs_written = sealed.size();
  // Packs on disk the catalog does not know were left by killed saves or a
  // killed gc: under the exclusive lock no save is writing one.
  CKPT_ASSIGN_OR_RETURN(Disposal disposal,
                        Dispose(backend, now, rewrite, written, impl_->protocol->UnknownPacksAreLeftovers(), report));
  const std::vector<std::string>& drop = disposal.drop;
  const std::vector<std::string>& orphans = disposal.orphans;
  // The live bytes left the rewritten packs as the new packs, whose sizes
  // (with their indexes) are what the pack bytes keep.
  report.rewritten_live_bytes = 0;
  for (const auto& p : sealed) report.rewritten_live_bytes += p.size;

  // 3. One catalog transaction: forget dead chunks and old packs, point
  //    live moved chunks at their new packs.
  // A catalog that mirrors the pack indexes (an object store's, sync.cc)
  // keeps a dead chunk's entry while its pack stays, as every other host's
  // does.
  std::set<std::string> leaving(drop.begin(), drop.end());
  leaving.insert(rewrite.begin(), rewrite.end());
  const bool keep_dead = impl_->protocol->KeepsDeadChunkLocations();
  if (store_lock) CKPT_RETURN_IF_ERROR(store_lock->Check());
  CKPT_RETURN_IF_ERROR(impl_->catalog->Update([&](WriteTxn& txn) -> Status {
    for (const auto& [id, pack] : now.dead) {
      if (keep_dead && !leaving.count(pack)) continue;
      CKPT_RETURN_IF_ERROR(txn.Delete(Table::kChunks, keys::Chunk(id)));
    }
    for (const auto& [id, locs] : moved) {
      if (!now.live.count(id)) continue;  // died since it was copied; its entry is gone
      CKPT_RETURN_IF_ERROR(txn.Put(Table::kChunks, keys::Chunk(id), EncodeChunkLocation(locs.second)));
    }
    for (const auto& id : drop) CKPT_RETURN_IF_ERROR(txn.Delete(Table::kPacks, id));
    for (const auto& id : rewrite) CKPT_RETURN_IF_ERROR(txn.Delete(Table::kPacks, id));
    for (const auto& p : sealed) CKPT_RETURN_IF_ERROR(txn.Put(Table::kPacks, p.id, EncodePackInfo({p.size, p.entries.size()})));
    return Status::OK();
  }));
  impl_->cache->Clear();
  // 4. Only now delete files; a crash before this leaves orphans for the next gc.
  auto remove = [&](const std::string& id) -> Status {
    Status st = backend->Delete(PackKey(id));
    return st.IsNotFound() ? Status::OK() : st;
  };
  phase("deleting " + std::to_string(drop.size() + rewrite.size() + orphans.size()) + " packs");
  for (const auto& id : drop) CKPT_RETURN_IF_ERROR(remove(id));
  for (const auto& id : rewrite) CKPT_RETURN_IF_ERROR(remove(id));
  for (const auto& id : orphans) CKPT_RETURN_IF_ERROR(remove(id));
  CKPT_ASSIGN_OR_RETURN(report.temporary_bytes, backend->RemoveIncomplete());
  return report;
}

}  // namespace ckptfs
