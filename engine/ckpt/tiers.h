// Two tiers: a fast repository on each host (a local directory: node-local
// NVMe, /dev/shm) in front of a shared one (S3, or any repository URL).
//
// Ranks save to their host's fast tier at local speed. Each host then
// drains its ranks' parts to the shared tier: every rank part the fast
// tier holds is committed there as that rank, through the shared tier's
// own commit, sending only the chunks it lacks, each checked against its
// id. The checkpoint becomes visible in the shared tier with the last rank
// any host drains (durable). Reads take each chunk from the nearest tier
// that holds it intact (ReadOptions::nearer). The fast tier keeps the
// newest checkpoints and drops only durable ones (PlanFastTierTrim).
//
// On a job of several hosts each host's fast tier holds its own ranks: the
// checkpoint stays pending there (its other ranks are on other hosts), and
// is "local" once every rank of this host is in.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/repository.h"

namespace ckptfs {

// The name of the file in a fast tier's directory that names its shared
// tier (one line: the URL), so that ckpt drain, ls and gc find it.
inline constexpr const char* kSharedTierFile = "shared-tier";

// The shared tier a fast tier's directory names; nullopt when it names
// none (a repository of one tier). InvalidArgument for an empty or
// multi-line file.
Result<std::optional<std::string>> ReadSharedTier(const std::string& fast_path);
// Names `shared_url` as the shared tier of the fast tier at `fast_path`
// (written atomically; a relative directory is recorded as an absolute
// path). InvalidArgument when it names another already:
// a fast tier drains to one shared tier.
Status WriteSharedTier(const std::string& fast_path, const std::string& url);

// Where one checkpoint of a fast tier stands.
struct TierEntry {
  std::string name;
  std::optional<int64_t> step;
  uint32_t world_size = 1;
  uint64_t created_unix_ms = 0;
  uint64_t logical_bytes = 0;  // of the ranks in the fast tier
  std::vector<std::pair<std::string, std::string>> tags;
  std::string attempt;  // a pending checkpoint's save attempt
  bool complete_here = false;  // committed in the fast tier: every rank saved on this host
  std::vector<uint32_t> ranks_here;    // ranks the fast tier holds (sorted)
  std::vector<uint32_t> ranks_shared;  // of those, the ones committed in the shared tier
  bool durable = false;                // visible in the shared tier
  // "local" (not every rank of this host is in the shared tier), "drained"
  // (they are; other hosts' ranks are still missing there), "durable".
  std::string state() const;
};

// Every checkpoint of `fast` (committed or pending), oldest first, with its
// state in `shared` (which is synced first). InvalidArgument when `fast` is
// not a local directory or is `shared` itself.
Result<std::vector<TierEntry>> TierStatus(Repository& fast, Repository& shared);

struct DrainOptions {
  // Checkpoints to drain; empty: every one of the fast tier not durable.
  std::vector<std::string> names;
  size_t ranks_at_once = 4;
  // Called as each checkpoint starts and with its outcome.
  std::function<void(const std::string&)> on_phase;
  // Asked before each group of ranks and before each chunk is fetched:
  // true stops the drain with FailedPrecondition ("cancelled").
  std::function<bool()> cancelled;
};

struct DrainedCheckpoint {
  CopiedCheckpoint sent;  // outcome kPresent: nothing was left to drain
  bool durable = false;   // visible in the shared tier after the drain
};

struct DrainReport {
  std::vector<DrainedCheckpoint> checkpoints;
  uint64_t chunks_sent = 0, raw_bytes_sent = 0, stored_bytes_sent = 0;
  uint64_t chunks_present = 0, raw_bytes_present = 0;
};

// Commits in `shared` every rank part `fast` holds of the checkpoints
// asked for (oldest first) and `shared` lacks, rank by rank, as a save of
// that rank would: a pending checkpoint's save attempt goes with it. Only
// chunks `shared` lacks are sent, as stored, each checked against its id
// first. A drain stopped at any point (failure, cancel, kill) leaves the
// ranks it committed there and no other trace; the next drain commits the
// rest. NotFound for a name `fast` does not hold; AlreadyExists when
// `shared` holds a checkpoint of that name of another world size or step.
// `progress` counts the logical bytes of the ranks drained.
Result<DrainReport> Drain(Repository& fast, Repository& shared, const DrainOptions& options,
                          const ProgressFn& progress = {});

// The fast tier's retention: the checkpoints of `fast` older than its
// newest `keep_last` (by step when every one has a step, by creation time
// otherwise) that are durable in `shared`. One that is not durable is never
// named, however old.
Result<std::vector<std::string>> PlanFastTierTrim(Repository& fast, Repository& shared, uint64_t keep_last);

// Adds to `policy.held` every checkpoint of `fast` that is not durable in
// `shared`, so that no retention rule run on the fast tier (ckpt gc)
// removes one.
Status HoldUndrained(Repository& fast, Repository& shared, RetentionPolicy* policy);

}  // namespace ckptfs
