#include "ckpt/describe.h"

#include <algorithm>
#include <cmath>
#include <ctime>
#include <set>

namespace ckptfs {

std::string FormatUnixMs(uint64_t unix_ms) {
  if (unix_ms == 0) return "-";
  time_t t = static_cast<time_t>(unix_ms / 1000);
  struct tm tm;
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

Json ShapeToJson(const Shape& shape) {
  Json j = Json::MakeArray();
  for (uint64_t d : shape) j.Push(d);
  return j;
}

Json RegionToJson(const Region& r) {
  Json j = Json::MakeObject();
  if (r.kind == Region::Kind::kFlat) {
    j.Set("kind", "flat");
    j.Set("start", r.flat.start);
    j.Set("end", r.flat.end);
  } else {
    j.Set("kind", "box");
    j.Set("offsets", ShapeToJson(r.box.offsets));
    j.Set("lengths", ShapeToJson(r.box.lengths));
  }
  return j;
}

Json DescribeRecord(const CheckpointRecord& c) {
  const bool committed = c.state == CheckpointState::kCommitted;
  Json j = Json::MakeObject();
  j.Set("name", c.name);
  j.Set("state", committed ? "committed" : "pending");
  j.Set("step", c.step ? Json(*c.step) : Json());
  j.Set("world_size", static_cast<uint64_t>(c.world_size));
  j.Set("committed_ranks", static_cast<uint64_t>(c.committed_ranks.size()));
  j.Set("tensors", c.tensor_count);
  j.Set("logical_bytes", c.logical_bytes);
  j.Set("created", FormatUnixMs(c.created_unix_ms));
  j.Set("committed", committed ? Json(FormatUnixMs(c.committed_unix_ms)) : Json());
  Json tags = Json::MakeObject();
  for (const auto& [k, v] : c.tags) tags.Set(k, v);
  j.Set("tags", std::move(tags));
  // A thinned checkpoint (thin retention) says when and what it dropped.
  const std::string* thinned = ThinnedNote(c.tags);
  j.Set("thinned", thinned ? Json(*thinned) : Json());
  if (!committed) {
    // What a pending checkpoint waits for; "created" is its first rank's commit.
    Json in = Json::MakeArray(), missing = Json::MakeArray();
    for (uint32_t r : c.committed_ranks) in.Push(static_cast<uint64_t>(r));
    for (uint32_t r : MissingRanks(c)) missing.Push(static_cast<uint64_t>(r));
    j.Set("ranks_committed", std::move(in));
    j.Set("ranks_missing", std::move(missing));
  }
  return j;
}

std::vector<uint32_t> MissingRanks(const CheckpointRecord& c) {
  std::vector<uint32_t> out;
  size_t k = 0;
  for (uint32_t r = 0; r < c.world_size; ++r) {
    while (k < c.committed_ranks.size() && c.committed_ranks[k] < r) ++k;
    if (k == c.committed_ranks.size() || c.committed_ranks[k] != r) out.push_back(r);
  }
  return out;
}

std::string RanksToString(const std::vector<uint32_t>& ranks) {
  std::string out;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (!out.empty()) out += ',';
    out += std::to_string(ranks[i]);
    if (j > i) out += "-" + std::to_string(ranks[j]);
    i = j + 1;
  }
  return out.empty() ? "-" : out;
}

namespace {
// The boxes the writers were given, where the shards say: a box shard
// that is not contiguous is stored as the grid tiles it meets (GridTile),
// one record each, consecutive in the record, of the same ranks, in
// row-major order of their cells; what a user asks is how the tensor was
// cut. So a run of box records of the same ranks whose corners increase
// (lexicographically) is one box as far as it fills its bounding box
// exactly: the longest such run that does. Every other shard is one piece.
// Empty when a shard is not one box (flat ranges, as FSDP's).
std::vector<Box> PiecesOf(const TensorRecord& t) {
  std::vector<Box> out;
  const auto& shards = t.shards;
  auto bounding = [](Box& all, const Box& b) {
    for (size_t d = 0; d < b.rank(); ++d) {
      const uint64_t lo = std::min(all.offsets[d], b.offsets[d]);
      const uint64_t hi = std::max(all.offsets[d] + all.lengths[d], b.offsets[d] + b.lengths[d]);
      all.offsets[d] = lo;
      all.lengths[d] = hi - lo;
    }
  };
  for (size_t i = 0; i < shards.size();) {
    const std::vector<Box> boxes = RegionToBoxes(t.shape, shards[i].region);
    if (boxes.size() != 1) return {};
    Box best = boxes[0], all = boxes[0];
    size_t next = i + 1;
    uint64_t filled = all.NumElements();
    for (size_t j = i + 1; j < shards.size(); ++j) {
      const ShardRecord& s = shards[j];
      if (s.region.kind != Region::Kind::kBox || shards[i].region.kind != Region::Kind::kBox ||
          s.ranks != shards[i].ranks || !(shards[j - 1].region.box.offsets < s.region.box.offsets)) {
        break;
      }
      bounding(all, s.region.box);
      filled += s.region.box.NumElements();
      if (filled == all.NumElements()) {
        best = all;
        next = j + 1;
      }
    }
    out.push_back(std::move(best));
    i = next;
  }
  return out;
}
}  // namespace

std::string DescribePlacement(const TensorRecord& t) {
  if (t.shards.empty()) return "no shards";
  size_t copies = 1;
  for (const auto& s : t.shards) copies = std::max(copies, s.ranks.size());
  const std::string replicated = copies > 1 ? ", replicated x" + std::to_string(copies) : "";
  const std::vector<Box> boxes = PiecesOf(t);
  if (boxes.empty()) return std::to_string(t.shards.size()) + " flat ranges" + replicated;
  const size_t n = boxes.size();
  // The dimensions the boxes split.
  std::set<size_t> split;
  for (const Box& b : boxes) {
    for (size_t d = 0; d < t.shape.size(); ++d) {
      if (b.offsets[d] != 0 || b.lengths[d] != t.shape[d]) split.insert(d);
    }
  }
  const std::string count = std::to_string(n);
  if (split.empty()) return (n == 1 ? std::string("whole") : count + " whole copies") + replicated;
  if (split.size() > 1) return count + " boxes" + replicated;
  const size_t d = *split.begin();
  if (t.shape.size() == 1) return count + " slices" + replicated;
  if (d == 0) return count + " row blocks" + replicated;
  if (d == 1 && t.shape.size() == 2) return count + " column blocks" + replicated;
  return count + " blocks along dim " + std::to_string(d) + replicated;
}

Json DescribeTensor(const TensorRecord& t, uint64_t stored_bytes) {
  Json tj = Json::MakeObject();
  tj.Set("name", t.name);
  tj.Set("dtype", DTypeName(t.dtype));
  tj.Set("shape", ShapeToJson(t.shape));
  tj.Set("placement", DescribePlacement(t));
  tj.Set("logical_bytes", t.ByteSize());
  tj.Set("stored_bytes", stored_bytes);
  Json shards = Json::MakeArray();
  for (const auto& s : t.shards) {
    Json sj = RegionToJson(s.region);
    Json ranks = Json::MakeArray();
    for (uint32_t r : s.ranks) ranks.Push(static_cast<uint64_t>(r));
    sj.Set("ranks", std::move(ranks));
    sj.Set("bytes", s.ByteSize());
    sj.Set("chunks", static_cast<uint64_t>(s.chunks.size()));
    shards.Push(std::move(sj));
  }
  tj.Set("shards", std::move(shards));
  return tj;
}

Json DescribeBlob(const BlobRecord& b) {
  Json bj = Json::MakeObject();
  bj.Set("name", b.name);
  bj.Set("bytes", b.size);
  return bj;
}

Result<Json> DescribeCheckpoint(const CheckpointReader& reader) {
  CKPT_ASSIGN_OR_RETURN(StoredSizes stored, reader.StoredBytes());
  Json j = DescribeRecord(reader.info());
  j.Set("stored_bytes", stored.total);
  Json tensors = Json::MakeArray();
  for (size_t i = 0; i < reader.tensors().size(); ++i) tensors.Push(DescribeTensor(reader.tensors()[i], stored.tensors[i]));
  j.Set("tensors", std::move(tensors));
  Json blobs = Json::MakeArray();
  for (const auto& b : reader.blobs()) blobs.Push(DescribeBlob(b));
  j.Set("blobs", std::move(blobs));
  return j;
}

Json DescribeTensorStats(const TensorStats& s) {
  auto opt = [](const std::optional<double>& v) { return v ? Json(*v) : Json(); };
  Json j = Json::MakeObject();
  j.Set("name", s.name);
  j.Set("dtype", DTypeName(s.dtype));
  j.Set("elements", s.elements);
  j.Set("nan_count", s.nan_count);
  j.Set("inf_count", s.inf_count);
  j.Set("zero_count", s.zero_count);
  j.Set("min", opt(s.min));
  j.Set("max", opt(s.max));
  j.Set("mean", opt(s.mean));
  j.Set("std", opt(s.std));
  j.Set("l2_norm", s.l2_norm);
  return j;
}

Json DescribePendingRanks(const std::vector<RankProgress>& ranks) {
  Json list = Json::MakeArray();
  for (const auto& r : ranks) {
    Json j = Json::MakeObject();
    j.Set("rank", static_cast<uint64_t>(r.rank));
    j.Set("committed", r.committed);
    j.Set("host", r.host);
    j.Set("pid", r.pid);
    j.Set("started_unix_ms", r.started_unix_ms);
    list.Push(std::move(j));
  }
  return list;
}

Json DescribeRetentionDecision(const RetentionDecision& d) {
  Json j = Json::MakeObject();
  j.Set("name", d.name);
  if (d.step) {
    j.Set("step", *d.step);
  } else {
    j.Set("step", Json());
  }
  j.Set("keep", d.keep);
  j.Set("why", d.why);
  j.Set("thin", d.thin);
  j.Set("thin_why", d.thin_why);
  j.Set("thin_tensors", d.thin_tensors);
  j.Set("thin_blobs", d.thin_blobs);
  j.Set("thin_bytes", d.thin_bytes);
  return j;
}

Json DescribeGcReport(const GcReport& r, bool dry_run) {
  Json j = Json::MakeObject();
  j.Set("dry_run", dry_run);
  Json removed = Json::MakeArray();
  for (const auto& n : r.removed) removed.Push(n);
  j.Set("removed", std::move(removed));
  Json thinned = Json::MakeArray();
  for (const auto& n : r.thinned) thinned.Push(n);
  j.Set("thinned", std::move(thinned));
  Json skipped = Json::MakeArray();
  for (const auto& n : r.thin_skipped) skipped.Push(n);
  j.Set("thin_skipped", std::move(skipped));
  Json retention = Json::MakeArray();
  for (const auto& d : r.retention) retention.Push(DescribeRetentionDecision(d));
  j.Set("retention", std::move(retention));
  j.Set("dead_chunks", r.dead_chunks);
  j.Set("orphan_packs", r.orphan_packs);
  j.Set("temporary_bytes", r.temporary_bytes);
  j.Set("dead_pack_bytes", r.dead_pack_bytes);
  j.Set("orphan_pack_bytes", r.orphan_pack_bytes);
  j.Set("rewritten_pack_bytes", r.rewritten_pack_bytes);
  j.Set("rewritten_live_bytes", r.rewritten_live_bytes);
  j.Set("packs_deleted", r.packs_deleted);
  j.Set("packs_rewritten", r.packs_rewritten);
  j.Set("bytes_before", r.bytes_before);
  j.Set("bytes_after", r.bytes_after);
  j.Set("bytes_reclaimed", r.bytes_reclaimed());
  j.Set("live_bytes", r.live_bytes);
  j.Set("removed_collected", r.retired_collected);
  j.Set("removed_kept_for_readers", r.retired_kept);
  return j;
}

namespace {
// One checkpoint a copy or a drain handled, and their totals.
Json DescribeCopied(const CopiedCheckpoint& c) {
  Json cj = Json::MakeObject();
  cj.Set("name", c.name);
  cj.Set("outcome", c.outcome == CopiedCheckpoint::Outcome::kCopied ? "copied" : "present");
  cj.Set("ranks_copied", uint64_t{c.ranks_copied});
  cj.Set("chunks_sent", c.chunks_sent);
  cj.Set("raw_bytes_sent", c.raw_bytes_sent);
  cj.Set("stored_bytes_sent", c.stored_bytes_sent);
  cj.Set("chunks_present", c.chunks_present);
  cj.Set("raw_bytes_present", c.raw_bytes_present);
  return cj;
}
template <typename Report>
void SetSentTotals(Json& j, const Report& r) {
  j.Set("chunks_sent", r.chunks_sent);
  j.Set("raw_bytes_sent", r.raw_bytes_sent);
  j.Set("stored_bytes_sent", r.stored_bytes_sent);
  j.Set("chunks_present", r.chunks_present);
  j.Set("raw_bytes_present", r.raw_bytes_present);
}
}  // namespace

Json DescribeCopyReport(const CopyReport& r) {
  Json j = Json::MakeObject();
  Json list = Json::MakeArray();
  for (const CopiedCheckpoint& c : r.checkpoints) list.Push(DescribeCopied(c));
  j.Set("checkpoints", std::move(list));
  SetSentTotals(j, r);
  return j;
}

Json DescribeDrainReport(const DrainReport& r) {
  Json j = Json::MakeObject();
  Json list = Json::MakeArray();
  for (const DrainedCheckpoint& c : r.checkpoints) {
    Json cj = DescribeCopied(c.sent);
    cj.Set("outcome", c.sent.outcome == CopiedCheckpoint::Outcome::kCopied ? "drained" : "present");
    cj.Set("durable", c.durable);
    list.Push(std::move(cj));
  }
  j.Set("checkpoints", std::move(list));
  SetSentTotals(j, r);
  return j;
}

Json DescribeTierEntry(const TierEntry& e) {
  Json j = Json::MakeObject();
  j.Set("name", e.name);
  j.Set("target", e.target);
  j.Set("overwrite", e.overwrite);
  j.Set("step", e.step ? Json(*e.step) : Json());
  j.Set("world_size", uint64_t{e.world_size});
  j.Set("tier_state", e.state());
  j.Set("copies", uint64_t{e.copies});
  j.Set("complete_here", e.complete_here);
  Json here = Json::MakeArray(), shared = Json::MakeArray();
  for (uint32_t r : e.ranks_here) here.Push(uint64_t{r});
  for (uint32_t r : e.ranks_shared) shared.Push(uint64_t{r});
  j.Set("ranks_here", std::move(here));
  j.Set("ranks_in_shared_tier", std::move(shared));
  j.Set("logical_bytes", e.logical_bytes);
  j.Set("created", FormatUnixMs(e.created_unix_ms));
  return j;
}

Json DescribeCommitResult(const CommitResult& r) {
  Json j = Json::MakeObject();
  j.Set("checkpoint_visible", r.checkpoint_visible);
  j.Set("chunks_written", r.chunks_written);
  j.Set("chunks_deduplicated", r.chunks_deduplicated);
  j.Set("logical_bytes", r.logical_bytes);
  j.Set("stored_bytes", r.stored_bytes);
  return j;
}

namespace {
Json DescribeBadChunks(const std::vector<VerifyReport::BadChunk>& chunks) {
  Json out = Json::MakeArray();
  for (const auto& bad : chunks) {
    Json b = Json::MakeObject();
    b.Set("chunk", bad.id.ToHex());
    Json users = Json::MakeArray();
    for (const auto& c : bad.checkpoints) users.Push(Json(c));
    b.Set("checkpoints", std::move(users));
    out.Push(std::move(b));
  }
  return out;
}
}  // namespace

Json DescribeVerifyReport(const VerifyReport& report) {
  Json j = Json::MakeObject();
  j.Set("ok", report.ok());
  j.Set("checkpoints", report.checkpoints);
  j.Set("tensors", report.tensors);
  j.Set("chunks", report.chunks);
  j.Set("bytes", report.bytes);
  Json problems = Json::MakeArray();
  for (const auto& p : report.problems) {
    Json pj = Json::MakeObject();
    pj.Set("checkpoint", p.checkpoint);
    pj.Set("what", p.what);
    pj.Set("message", p.message);
    problems.Push(std::move(pj));
  }
  j.Set("problems", std::move(problems));
  j.Set("bad_chunks", DescribeBadChunks(report.bad_chunks));
  return j;
}

Json DescribeRepairReport(const RepairReport& report) {
  Json r = Json::MakeObject();
  Json done = Json::MakeArray();
  for (const auto& c : report.repaired) {
    Json cj = Json::MakeObject();
    cj.Set("chunk", c.id.ToHex());
    cj.Set("from", c.from);
    done.Push(std::move(cj));
  }
  r.Set("repaired", std::move(done));
  r.Set("unrepaired", DescribeBadChunks(report.unrepaired));
  r.Set("packs_rewritten", report.packs_rewritten);
  return r;
}

const char* DiffKindName(TensorDiff::Kind k) {
  switch (k) {
    case TensorDiff::Kind::kUnchanged: return "unchanged";
    case TensorDiff::Kind::kChanged: return "changed";
    case TensorDiff::Kind::kOnlyInA: return "removed";
    case TensorDiff::Kind::kOnlyInB: return "added";
    case TensorDiff::Kind::kTypeChanged: return "dtype/shape changed";
  }
  return "?";
}

Json DescribeTensorDiff(const TensorDiff& d) {
  auto number = [](const std::optional<double>& v) {
    if (!v) return Json();
    return std::isinf(*v) ? Json("inf") : Json(*v);
  };
  Json dj = Json::MakeObject();
  dj.Set("name", d.name);
  dj.Set("kind", d.blob ? "blob" : "tensor");
  dj.Set("status", DiffKindName(d.kind));
  dj.Set("changed", d.kind != TensorDiff::Kind::kUnchanged);
  dj.Set("shared_fraction", d.shared_fraction);
  dj.Set("chunks", d.chunks);
  dj.Set("changed_chunks", d.changed_chunks);
  dj.Set("max_abs_diff", number(d.max_abs_diff));
  dj.Set("mean_abs_diff", number(d.mean_abs_diff));
  dj.Set("relative_l2", number(d.relative_l2));
  return dj;
}

uint64_t GarbageBytes(const UsageReport& r) {
  const uint64_t kept = r.referenced_bytes + r.pending_bytes + r.retired_bytes;
  return r.pack_bytes > kept ? r.pack_bytes - kept : 0;
}

Json DescribeUsage(const UsageFigures& figures, bool remote) {
  const UsageReport& r = figures.usage;
  Json j = Json::MakeObject();
  Json list = Json::MakeArray();
  for (const auto& e : r.checkpoints) {
    Json ej = Json::MakeObject();
    ej.Set("name", e.name);
    ej.Set("logical_bytes", e.logical_bytes);
    ej.Set("referenced_bytes", e.referenced_bytes);
    ej.Set("exclusive_bytes", e.exclusive_bytes);
    list.Push(std::move(ej));
  }
  j.Set("checkpoints", std::move(list));
  Json t = Json::MakeObject();
  t.Set("logical_bytes", r.logical_bytes);
  t.Set("unique_raw_bytes", r.unique_raw_bytes);
  t.Set("referenced_bytes", r.referenced_bytes);
  t.Set("pack_bytes", r.pack_bytes);
  t.Set("pending_bytes", r.pending_bytes);
  t.Set("unreferenced_bytes", r.unreferenced_bytes);
  t.Set("removed_bytes", r.retired_bytes);
  t.Set("removed_checkpoints", r.retired_checkpoints);
  t.Set("garbage_bytes", GarbageBytes(r));
  t.Set("reclaimable_bytes", figures.dry_gc.bytes_reclaimed());
  if (!remote) {
    t.Set("unrecorded_packs", r.unrecorded_packs);
    t.Set("unrecorded_pack_bytes", r.unrecorded_pack_bytes);
  }
  t.Set("dedup_ratio", r.dedup_ratio());
  t.Set("compression_ratio", r.compression_ratio());
  j.Set("total", std::move(t));
  if (!figures.kinds.empty()) {
    Json kinds = Json::MakeArray();
    for (const KindUsage& k : figures.kinds) {
      Json kj = Json::MakeObject();
      kj.Set("kind", k.kind);
      kj.Set("tensors", k.tensors);
      kj.Set("logical_bytes", k.logical_bytes);
      kj.Set("unique_raw_bytes", k.unique_raw_bytes);
      kj.Set("stored_bytes", k.stored_bytes);
      kj.Set("stored_fraction", k.stored_fraction());
      kinds.Push(std::move(kj));
    }
    j.Set("kinds", std::move(kinds));
  }
  return j;
}

Result<UsageFigures> MeasureUsage(Repository& repo, const std::vector<std::string>& names, bool by_kind) {
  UsageFigures f;
  CKPT_ASSIGN_OR_RETURN(f.usage, repo.DiskUsage(names));
  if (by_kind) {
    CKPT_ASSIGN_OR_RETURN(f.kinds, repo.UsageByKind(names));
  }
  GcOptions dry;
  dry.dry_run = true;
  CKPT_ASSIGN_OR_RETURN(f.dry_gc, repo.CollectGarbage(dry));
  return f;
}

}  // namespace ckptfs
