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
// newest checkpoints and drops only durable ones (PlanFastTierTrim), and
// drained ones too when short of space.
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

#include "ckpt/communicator.h"
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
  std::string name;  // as the fast tier lists it: "NAME~" for a save replacing NAME (overwrite)
  std::string target;  // the name it has in the shared tier
  // The drain replaces the shared tier's checkpoint of that name: the save
  // replaced one (overwrite), or the shared tier holds an older version.
  bool overwrite = false;
  std::optional<int64_t> step;
  uint32_t world_size = 1;
  uint64_t created_unix_ms = 0;
  uint64_t logical_bytes = 0;  // of the ranks in the fast tier
  std::vector<std::pair<std::string, std::string>> tags;
  std::string attempt;  // a pending checkpoint's save attempt
  // The save attempt of this checkpoint's ranks the shared tier keeps
  // pending (drained before), if any.
  std::string shared_attempt;
  bool complete_here = false;  // committed in the fast tier: every rank saved on this host
  std::vector<uint32_t> ranks_here;    // ranks the fast tier holds (sorted)
  std::vector<uint32_t> ranks_shared;  // of those, the ones committed in the shared tier
  bool durable = false;                // visible in the shared tier
  // Copies of every rank's part in the job's fast tiers, as this host's
  // last ReplicateRankParts of it recorded (1: none but the ranks' own).
  uint32_t copies = 1;
  // Whether every rank of this host is in the shared tier (drained or durable).
  bool drained() const;
  // "local" (this host's ranks are in its fast tier only), "replicated"
  // (and every rank's part has copies in peers' fast tiers), "drained"
  // (this host's ranks are in the shared tier; other hosts' are still
  // missing there), "durable" (visible in the shared tier).
  std::string state() const;
};

// Every checkpoint of `fast` (committed or pending), oldest first, with its
// state in `shared` (which is synced first). InvalidArgument when `fast` is
// not a local directory or is `shared` itself.
//
// A checkpoint of the shared tier is this one (durable) when it was
// committed after this one's save began, or holds the same chunks in the
// same order for every rank here; else it is another version of the name
// (an older save the fast tier's save replaced, or one saved there before
// the name was saved again), which the drain replaces (`overwrite`).
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
// rest. A name `fast` no longer holds that is durable in `shared` (drained
// and trimmed before) counts as present; NotFound for a name neither
// holds. A checkpoint whose version in `shared` is another (TierStatus) is
// committed there as a replacing save (WriterOptions::overwrite): it
// becomes visible in place of the other, atomically, with the last rank.
// `progress` counts the logical bytes of the ranks drained.
Result<DrainReport> Drain(Repository& fast, Repository& shared, const DrainOptions& options,
                          const ProgressFn& progress = {});

// The fast tier's retention: the checkpoints of `fast` older than its
// newest `keep_last` (by step when every one has a step, by creation time
// otherwise) that are durable in `shared`. With `short_of_space`, drained
// ones too (this host's ranks are in `shared`, other hosts' not yet: the
// fast tier's copy adds nothing the shared tier lacks, so a save that
// would not fit may drop it). One with a rank not yet drained is never
// named, however old.
Result<std::vector<std::string>> PlanFastTierTrim(Repository& fast, Repository& shared, uint64_t keep_last,
                                                  bool short_of_space = false);
// The same from entries TierStatus gave.
std::vector<std::string> PlanFastTierTrim(std::vector<TierEntry> entries, uint64_t keep_last,
                                          bool short_of_space = false);

// ---- Replicas on peer hosts ----------------------------------------------

// Where the copies of a rank's part go: `replicas` copies in all, its own
// included. `jump` is the number of ranks per host (or per failure domain),
// so that the copies leave the host.
//   kRing: rank r's part goes to ranks r + jump, r + 2*jump, ... (mod the
//     world size); any world size.
//   kClique: ranks r, r + jump, ..., r + (replicas-1)*jump form a clique
//     (the ranks of one block of replicas*jump ranks that agree mod jump)
//     and each keeps every member's part; the world size must be a
//     multiple of replicas*jump. A clique loses its copies only when all
//     its hosts are lost; a ring loses one when any `replicas` hosts in a
//     row are.
enum class ReplicaStrategy { kRing, kClique };

struct ReplicaOptions {
  uint32_t replicas = 1;
  uint32_t jump = 1;
  ReplicaStrategy strategy = ReplicaStrategy::kRing;
};

// "ring" or "clique"; InvalidArgument for any other name.
Result<ReplicaStrategy> ParseReplicaStrategy(std::string_view name);

struct ReplicaReport {
  uint32_t parts_sent = 0, parts_received = 0;
  uint64_t chunks_sent = 0;        // chunks the peers lacked
  uint64_t stored_bytes_sent = 0;  // their stored bytes
  uint64_t stored_bytes_received = 0;
};

// Every rank of `comm` calls it once its part of checkpoint `name` is in
// its host's fast tier `fast`: each rank sends its part to its peers
// (ReplicaOptions) and takes theirs into `fast`, as the ranks they are
// (the fast tier then holds those ranks too: a drain from there, or a
// restore, finds them). Only the chunks a peer's fast tier lacks travel,
// as stored, and each is checked against its id before it is written.
// A part already there is left as it is. A rank whose part fails (its own
// or a peer's, or its own part missing from its fast tier) makes every
// rank return the error, naming the ranks. Once every rank succeeded, each
// records in its fast tier that the checkpoint has `replicas` copies of
// every part (TierEntry::copies, state "replicated").
Result<ReplicaReport> ReplicateRankParts(Repository& fast, const std::string& name, Communicator& comm,
                                         const ReplicaOptions& options);

// Every rank of `comm` calls it before restoring checkpoint `name` (the
// ReplicaOptions of the saves): a rank whose fast tier lacks its own part
// (a replaced host, a lost disk) gets it back from a peer that keeps a
// copy (ReplicateRankParts), only the chunks it lacks, each checked. A
// rank whose part no peer holds either goes without it (its restore reads
// the shared tier). Errors as ReplicateRankParts's.
Result<ReplicaReport> RestoreRankParts(Repository& fast, const std::string& name, Communicator& comm,
                                       const ReplicaOptions& options);

// The replica bundle of rank `rank` of checkpoint `name` in `fast`: its
// record and the stored bytes of the chunks `include` names (encoded ids,
// 16 bytes each), for ImportRankPart at another fast tier. NotFound when
// `fast` holds no such rank.
Result<std::string> ExportRankPart(Repository& fast, const std::string& name, uint32_t rank,
                                   std::string_view include);
// Commits the part a bundle holds in `fast` as its rank; its chunks not in
// the bundle must be in `fast` already. Nothing when the rank is there
// already. Corruption for a malformed bundle or a chunk that fails its id.
Status ImportRankPart(Repository& fast, std::string_view bundle);
// The ids (16 bytes each) of the chunks rank `rank`'s part of `name`
// references, each once; and of those in `ids`, the ones `fast` lacks.
Result<std::string> RankPartChunks(Repository& fast, const std::string& name, uint32_t rank);
Result<std::string> MissingChunks(Repository& fast, std::string_view ids);

// Adds to `policy.held` every checkpoint of `fast` not yet durable in
// `shared`, so that no retention rule run on the fast tier (ckpt gc)
// removes one.
Status HoldNotDurable(Repository& fast, Repository& shared, RetentionPolicy* policy);

}  // namespace ckptfs
