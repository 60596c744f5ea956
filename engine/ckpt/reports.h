// What the repository's operations report (ckpt/repository.h): verify,
// repair, reindex, retention and gc, usage, diff, statistics and copy.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/chunk_id.h"
#include "core/dtype.h"

namespace ckptfs {

struct VerifyProblem {
  std::string checkpoint;  // empty for repository-level problems
  std::string what;        // tensor, blob, chunk or pack concerned
  std::string message;
  // A stored chunk that fails its id (one of VerifyReport::bad_chunks): the
  // problem a repair of that chunk mends.
  std::optional<ChunkId> bad_chunk;
};

struct VerifyReport {
  uint64_t checkpoints = 0;
  uint64_t tensors = 0;
  uint64_t chunks = 0;
  uint64_t bytes = 0;  // raw bytes re-hashed
  std::vector<VerifyProblem> problems;
  // Stored chunks whose bytes cannot be read or fail their id, each with
  // every checkpoint verified that uses it (in the order they were
  // verified). Repository::Repair stores them again from a good copy.
  struct BadChunk {
    ChunkId id;
    std::vector<std::string> checkpoints;
  };
  std::vector<BadChunk> bad_chunks;
  bool ok() const { return problems.empty(); }
};

// What Repository::Repair did with the bad chunks of a verify report.
struct RepairReport {
  struct Repaired {
    ChunkId id;
    std::string from;  // where the good bytes came from ("pack ID", or another repository's path)
  };
  std::vector<Repaired> repaired;
  // No good copy was found: each with every checkpoint that uses it.
  std::vector<VerifyReport::BadChunk> unrepaired;
  uint64_t packs_rewritten = 0;
};

struct ReindexReport {
  uint64_t packs = 0;
  uint64_t chunks = 0;
  uint64_t checkpoints = 0;
  std::vector<std::string> problems;  // skipped packs or manifests, and why
};

// What a retention policy does with one committed checkpoint, and why:
// `why` names each rule that keeps it ("keep-last 2", "keep-every 10: step
// 20", "keep-within 36h", "--keep"), or, for one removed, says of each
// rule why it does not keep it.
struct RetentionDecision {
  std::string name;
  std::optional<int64_t> step;
  bool keep = true;
  std::string why;
  // Thin retention (RetentionPolicy::thin_older_than), for a checkpoint the
  // policy keeps: whether it is thinned, why or why not ("the 3rd newest by
  // step", "among the newest 2", "nothing to drop"), and what it drops.
  bool thin = false;
  std::string thin_why;
  uint64_t thin_tensors = 0;  // tensors and blobs dropped
  uint64_t thin_blobs = 0;
  uint64_t thin_bytes = 0;    // their logical bytes
};

// A rank of a pending checkpoint on an object store that began its save.
struct RankProgress {
  uint32_t rank = 0;
  bool committed = false;
  std::string host;  // as the rank's host names itself
  uint64_t pid = 0;
  uint64_t started_unix_ms = 0;
};

struct GcReport {
  std::vector<std::string> removed;  // by the retention policy
  std::vector<std::string> thinned;  // by thin retention
  // Checkpoints that were to be thinned but changed meanwhile (saved again
  // or removed on another host): left as they are.
  std::vector<std::string> thin_skipped;
  std::vector<RetentionDecision> retention;  // every committed checkpoint, when a policy was given
  uint64_t dead_chunks = 0;
  uint64_t orphan_packs = 0;         // packs no catalog entry refers to (killed saves)
  uint64_t packs_deleted = 0;        // wholly dead, rewritten or orphaned
  uint64_t packs_rewritten = 0;
  uint64_t packs_written = 0;
  uint64_t bytes_before = 0;         // pack bytes on disk
  uint64_t bytes_after = 0;
  uint64_t live_bytes = 0;           // stored bytes the remaining checkpoints reference
  uint64_t temporary_bytes = 0;      // temporary files of interrupted writes, removed (local repositories)
  // Where the pack bytes reclaimed come from: packs with no live chunk,
  // packs no catalog entry refers to, and the packs rewritten (their size,
  // and what their live chunks take in the new packs, the live bytes in a
  // dry run). bytes_reclaimed() is the sum of the four, less that last,
  // plus temporary_bytes.
  uint64_t dead_pack_bytes = 0;
  uint64_t orphan_pack_bytes = 0;
  uint64_t rewritten_pack_bytes = 0;
  uint64_t rewritten_live_bytes = 0;
  // Removed checkpoints (rm, retention) whose data this run reclaimed, and
  // those kept because a reader still holds a lease on them.
  uint64_t retired_collected = 0;
  uint64_t retired_kept = 0;
  uint64_t bytes_reclaimed() const {
    return (bytes_before > bytes_after ? bytes_before - bytes_after : 0) + temporary_bytes;
  }
};

struct UsageEntry {
  std::string name;
  uint64_t logical_bytes = 0;     // tensors and blobs as saved
  uint64_t referenced_bytes = 0;  // stored bytes of the distinct chunks it references
  uint64_t exclusive_bytes = 0;   // stored bytes no other checkpoint references: what removing it alone frees
};

struct UsageReport {
  std::vector<UsageEntry> checkpoints;
  uint64_t logical_bytes = 0;     // all committed checkpoints
  uint64_t unique_raw_bytes = 0;  // distinct referenced chunks, decoded
  uint64_t referenced_bytes = 0;  // distinct referenced chunks, stored
  uint64_t pack_bytes = 0;        // in the packs the catalog records, including what gc would reclaim
  uint64_t pending_bytes = 0;     // stored chunks only pending ranks reference (kept by gc)
  // Stored chunks only removed checkpoints reference: kept while a reader
  // holds a lease on them, reclaimed by the first gc after.
  uint64_t retired_bytes = 0;
  uint64_t retired_checkpoints = 0;
  uint64_t unreferenced_bytes = 0;  // stored chunks nothing references (gc reclaims them)
  // Local repositories: pack files no catalog entry records, left by saves
  // that were killed (gc deletes them). Not counted on an object store,
  // where other hosts' saves in flight have such packs too.
  uint64_t unrecorded_packs = 0;
  uint64_t unrecorded_pack_bytes = 0;
  double dedup_ratio() const { return unique_raw_bytes ? double(logical_bytes) / unique_raw_bytes : 1.0; }
  double compression_ratio() const { return referenced_bytes ? double(unique_raw_bytes) / referenced_bytes : 1.0; }
};

// Space per kind of training state (`ckpt du --by-kind`), each tensor
// sorted by its name and dtype (StateKindOf). A chunk that tensors of two
// kinds reference counts in both.
struct KindUsage {
  std::string kind;
  uint64_t tensors = 0;           // tensors and blobs, each checkpoint's counted
  uint64_t logical_bytes = 0;     // their bytes, each checkpoint's counted
  uint64_t unique_raw_bytes = 0;  // the distinct chunks they reference, decoded
  uint64_t stored_bytes = 0;      // the same chunks as stored (compressed)
  // Stored over decoded: the kind's compression (0 without chunks).
  double stored_fraction() const { return unique_raw_bytes ? double(stored_bytes) / double(unique_raw_bytes) : 0.0; }
};
// The kinds, in the order reports list them.
inline constexpr const char* kStateKinds[] = {"weights_16bit", "weights_fp32", "adam_exp_avg", "adam_exp_avg_sq",
                                              "other"};
// A tensor's kind: by the last part of its name (after the last '.' or
// '/'), Adam's moments ("exp_avg", SGD's "momentum_buffer"; "exp_avg_sq",
// "max_exp_avg_sq"); then by dtype, 16-bit floats as "weights_16bit" and
// 32-bit as "weights_fp32" (model weights or an optimizer's fp32 master
// copy), except counters named "step"; everything else (other dtypes,
// blobs) "other".
const char* StateKindOf(std::string_view name, DType dtype, bool blob);

// One tensor (or blob) of two checkpoints compared. The figures of a float
// tensor count NaN against NaN as equal and NaN against a number, or an
// infinity against anything else, as an infinite difference.
struct TensorDiff {
  std::string name;
  bool blob = false;                   // a blob (bytes), not a tensor
  enum class Kind { kUnchanged, kChanged, kOnlyInA, kOnlyInB, kTypeChanged } kind = Kind::kUnchanged;
  double shared_fraction = 0;          // of A's bytes, in chunks B also has
  uint64_t chunks = 0;                 // A's chunks
  uint64_t changed_chunks = 0;         // of those, the ones B does not hold
  std::optional<double> max_abs_diff;  // floating-point tensors present in both with one dtype and shape
  std::optional<double> mean_abs_diff;
  std::optional<double> relative_l2;   // ||b - a|| / ||a|| (0 when equal; infinite when a is zero and b not)
};

// What one streaming pass over a tensor finds: the element count, NaN,
// infinite and zero counts, and over the finite elements min, max, mean,
// (population) standard deviation and L2 norm. Integer and bool tensors
// are read as numbers. min, max, mean and std are absent when no element
// is finite.
struct TensorStats {
  std::string name;
  DType dtype = DType::kU8;
  uint64_t elements = 0;
  uint64_t nan_count = 0, inf_count = 0, zero_count = 0;
  std::optional<double> min, max, mean, std;
  double l2_norm = 0;
};

struct CopiedCheckpoint {
  std::string name;
  // copied: made visible at the destination by this copy; present: the
  // destination had it, with the same content, and nothing was sent.
  enum class Outcome { kCopied, kPresent } outcome = Outcome::kCopied;
  uint32_t ranks_copied = 0;        // ranks committed by this copy (others were by an interrupted one)
  uint64_t chunks_sent = 0;         // chunks the destination lacked
  uint64_t raw_bytes_sent = 0;      // their decoded size
  uint64_t stored_bytes_sent = 0;   // their stored (encoded) size: what went into the destination's packs
  uint64_t chunks_present = 0;      // chunks the destination had already
  uint64_t raw_bytes_present = 0;
};

struct CopyReport {
  std::vector<CopiedCheckpoint> checkpoints;
  uint64_t chunks_sent = 0, raw_bytes_sent = 0, stored_bytes_sent = 0;
  uint64_t chunks_present = 0, raw_bytes_present = 0;
};

}  // namespace ckptfs
