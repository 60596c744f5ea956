// Machine-readable descriptions of checkpoints: what `ckpt ls --json` and
// `ckpt show --json` print and what the mount serves as metadata.json.
#pragma once

#include <string>

#include "ckpt/repository.h"
#include "ckpt/tiers.h"
#include "core/json.h"

namespace ckptfs {

// "2026-11-21T18:09:03Z"; "-" for 0.
std::string FormatUnixMs(uint64_t unix_ms);
Json ShapeToJson(const Shape& shape);
// {"kind": "flat", "start", "end"} or {"kind": "box", "offsets", "lengths"}.
Json RegionToJson(const Region& region);
// name, state, step, world size, ranks committed, tensor count, logical
// bytes, times, tags.
// A pending checkpoint also gets ranks_committed and ranks_missing (lists).
Json DescribeRecord(const CheckpointRecord& record);
// The ranks of [0, world size) that have not committed `record` yet.
std::vector<uint32_t> MissingRanks(const CheckpointRecord& record);
// "0-3,5,7-9"; "-" for none.
std::string RanksToString(const std::vector<uint32_t>& ranks);
// DescribeRecord plus stored bytes and every tensor (dtype, shape, logical
// and stored bytes, shards with region, ranks, bytes, chunks) and blob.
// Reads the catalog (chunk sizes), never tensor data.
Result<Json> DescribeCheckpoint(const CheckpointReader& reader);
// How a tensor's shards lie, in a few words: "whole", "4 row blocks",
// "4 column blocks", "8 blocks along dim 2", "4 boxes", "4 slices" (1-d),
// "8 flat ranges" (shards that are not boxes), with ", replicated xK" when
// K ranks wrote the same region.
std::string DescribePlacement(const TensorRecord& tensor);
// Its parts: one tensor (with its stored bytes and placement) and one blob.
Json DescribeTensor(const TensorRecord& tensor, uint64_t stored_bytes);
Json DescribeBlob(const BlobRecord& blob);
// One tensor's statistics as `ckpt show --stats --json` prints them (and
// Python's Repository.stats returns them): name, dtype, elements,
// nan_count, inf_count, zero_count, min, max, mean, std (null when no
// element is finite), l2_norm.
Json DescribeTensorStats(const TensorStats& stats);
// What `ckpt gc --json` prints: dry_run, removed, dead chunks, packs
// deleted, rewritten and orphaned, bytes before, after, reclaimed and live.
Json DescribeGcReport(const GcReport& report, bool dry_run);
// {name, step (null when none), keep, why}: one entry of the report's "retention".
Json DescribeRetentionDecision(const RetentionDecision& decision);
// Repository::PendingRanks as `ckpt show NAME --json`'s ranks_started.
Json DescribePendingRanks(const std::vector<RankProgress>& ranks);
// A copy's report, as `ckpt copy --json` prints it and ckptfs.copy returns it.
Json DescribeCopyReport(const CopyReport& report);
// What `ckpt drain --json` prints: per checkpoint as DescribeCopyReport
// (outcome "drained" or "present") and whether it is durable, and totals.
Json DescribeDrainReport(const DrainReport& report);
// One checkpoint of a fast tier: name, step, world_size, tier_state
// ("local", "drained", "durable"), complete_here, ranks_here,
// ranks_in_shared_tier, logical_bytes, created.
Json DescribeTierEntry(const TierEntry& entry);
// What a rank's commit did, as `ckpt import --json` prints it (beside the
// checkpoint, rank and world size) and Python's save, commit handles and
// import_safetensors return it: checkpoint_visible, chunks_written,
// chunks_deduplicated, logical_bytes, stored_bytes.
Json DescribeCommitResult(const CommitResult& result);
// A verify report, as `ckpt verify --json` prints it and Python's
// Repository.verify returns it: ok, checkpoints, tensors, chunks, bytes,
// problems [{checkpoint, what, message}], bad_chunks [{chunk, checkpoints}].
Json DescribeVerifyReport(const VerifyReport& report);
// What a repair did (`ckpt verify --repair --json`'s "repair"): repaired
// [{chunk, from}], unrepaired [{chunk, checkpoints}], packs_rewritten.
Json DescribeRepairReport(const RepairReport& report);
// "unchanged", "changed", "removed" (only in A), "added" (only in B),
// "dtype/shape changed".
const char* DiffKindName(TensorDiff::Kind kind);
// One entry of a diff, as `ckpt diff --json` prints it and Python's
// Repository.diff returns it: name, kind ("tensor" or "blob"), status
// (DiffKindName), changed, shared_fraction, chunks, changed_chunks,
// max_abs_diff, mean_abs_diff, relative_l2 (null when not computed; an
// infinite difference is the string "inf", JSON having no infinity).
Json DescribeTensorDiff(const TensorDiff& diff);
// The space used by `names` (every committed checkpoint when empty), and a
// dry run of gc: what it would reclaim now (packs at least half live keep
// their dead chunks).
struct UsageFigures {
  UsageReport usage;
  GcReport dry_gc;
  std::vector<KindUsage> kinds;  // with `by_kind` only
};
Result<UsageFigures> MeasureUsage(Repository& repo, const std::vector<std::string>& names, bool by_kind = false);
// Space used, as `ckpt du --json` prints it and Python's Repository.du
// returns it: "checkpoints" [{name, logical_bytes, referenced_bytes,
// exclusive_bytes}] and "total" (logical, unique raw, referenced, pack,
// pending, unreferenced, removed bytes and checkpoints, garbage_bytes,
// reclaimable_bytes: what the dry run of gc would reclaim, dedup and
// compression ratios; on a local repository, the unrecorded packs of
// killed saves); with kinds measured, "kinds" [{kind, tensors,
// logical_bytes, unique_raw_bytes, stored_bytes, stored_fraction: stored
// over unique raw}].
Json DescribeUsage(const UsageFigures& figures, bool remote);
// Pack bytes the catalog records beyond what live, pending and removed
// checkpoints reference (dead chunks, whether or not gc reclaims them yet).
uint64_t GarbageBytes(const UsageReport& report);

}  // namespace ckptfs
