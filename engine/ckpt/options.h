// Settings of the public C++ API (ckpt/repository.h): how a repository is
// made and opened, how a rank saves, how a checkpoint is read, which
// checkpoints a retention policy keeps and what gc does, which ones a copy
// takes.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "backend/store_options.h"
#include "codec/codec.h"
#include "core/chunk_id.h"
#include "core/dtype.h"
#include "core/status.h"

namespace ckptfs {

class Repository;

inline constexpr uint32_t kFormatVersion = 1;

struct RepositoryConfig {
  uint64_t chunk_size = 4 << 20;        // bytes; a multiple of 8 in [64 KiB, 256 MiB]
  uint64_t pack_size = 256ull << 20;    // a pack is sealed when it reaches this size
  CodecOptions codec;
  // Store every chunk raw while the pack writer is idle, compressing only
  // when the disk is the bottleneck (see docs/DESIGN.md).
  bool adaptive = true;
};

struct OpenOptions {
  size_t threads = 0;                     // workers; 0 = hardware concurrency
  size_t cache_bytes = 512ull << 20;      // decoded-chunk cache bound (the memory of its buffers)
  // Repositories on an object store: the directory where this host keeps
  // the repository's catalog. Empty: CACHE_ROOT/ID, a directory per
  // repository under `cache_root`; with that empty too, Open fails
  // (FailedPrecondition) rather than use a shared place such as /tmp.
  // Directories it creates are owner-only (0700); a symbolic link on the
  // way owned by another user (not root), or a final directory owned by
  // another user, is refused.
  std::string cache_dir;
  std::string cache_root;
  // Repositories on S3: how long a save or gc waits for a conflicting lock
  // (a gc on another host, or saves) before it fails naming the holder.
  std::chrono::milliseconds lock_wait = std::chrono::minutes(10);
  // Repositories on S3: how long a lock or read-lease object may go
  // unrefreshed before other hosts take its holder for crashed (at least
  // 100 ms; holders refresh theirs well within it).
  std::chrono::milliseconds lock_stale_after = std::chrono::minutes(30);
  // Repositories on S3: endpoint, credentials and retry settings. Unset,
  // they come from `s3_settings`, called only when the URL names an S3
  // store (so a local repository opens without them); with neither, Open
  // of an S3 URL fails naming what is missing.
  std::optional<ObjectStoreOptions> s3;
  std::function<Result<ObjectStoreOptions>()> s3_settings;
  // Requests to an object store one operation sends at once (reading
  // indexes and manifests, a commit's rank objects): the I/O pool's
  // io_threads - 1 threads, made at first use, and the caller. Commits run
  // on that pool too. 0 = 16. (Last, as new fields go: code that lists the
  // first fields positionally keeps its meaning.)
  size_t io_threads = 0;
  // Repositories on an object store: the wall clock (unix ms) this host
  // stamps its lock and lease objects with and judges other hosts' by
  // (stale after lock_stale_after). Empty: the system's. The protocol
  // assumes hosts' clocks agree to well within lock_stale_after; the
  // simulator (tools/sim) skews it within that bound.
  std::function<uint64_t()> wall_clock;
  // Repositories on an object store: whether Open brings the catalog up to
  // date with the store. Off for the processes of a job that apply the
  // listing one of them shares (Repository::ShareSync and SyncFrom).
  bool opening_sync = true;
};

// Open options as the command-line tool and the Python package take them
// from the environment, looked up through `env` (std::getenv for the
// process's own):
//   CKPT_CACHE_DIR            cache_dir
//   XDG_CACHE_HOME, HOME      cache_root: $XDG_CACHE_HOME/ckptfs, else
//                             $HOME/.cache/ckptfs
//   CKPT_LOCK_STALE_SECONDS   lock_stale_after (seconds, at least 0.1)
//   AWS_*, CKPT_S3_*          s3_settings: ObjectStoreOptions::FromEnvironment(env),
//                             read when an S3 repository is opened
// InvalidArgument naming a malformed variable.
Result<OpenOptions> OpenOptionsFromEnvironment(const Environment& env);

struct WriterOptions {
  uint32_t rank = 0;
  uint32_t world_size = 1;
  std::optional<int64_t> step;
  std::vector<std::pair<std::string, std::string>> tags;
  // One store sync for the ranks of a job that begin together, instead of
  // a listing of the store by each (object stores; nothing to sync on a
  // local repository). Begin lists the store under its shared store lock,
  // as always, and with `share_sync` also returns what it listed and
  // fetched there (ShareSync's encoding); a rank given that in
  // `shared_sync` applies it (SyncFrom) instead of listing. The sharing
  // rank must keep its writer open until every rank given its listing has
  // begun: its lock keeps gc away in between (SaveCollective does so).
  // Neither is owned.
  std::string* share_sync = nullptr;
  const std::string* shared_sync = nullptr;
  // With either of the above, not zero: the group's commit is split too,
  // so that a save costs the store requests of one rank, not of every
  // rank. A rank given `shared_sync` takes no store lock of its own, and
  // its commit makes its part durable without listing the store to see
  // whether every rank is in. The sharing rank's commit waits up to this
  // long for every rank's part (listing the rank objects with backoff),
  // then completes the checkpoint; its store lock, held from before any
  // rank began until then, keeps gc away from every rank's chunks. A part
  // missing after that fails the sharing rank's commit, naming the ranks,
  // and the checkpoint stays invisible. Zero: every rank takes its own
  // lock and the last rank in completes, as in a save without a group.
  // Local repositories need neither (their commits list nothing).
  std::chrono::milliseconds await_ranks{0};
  // Compress every chunk, as with the adaptive codec off
  // (RepositoryConfig::adaptive). For imports whose source is read from
  // the repository's own disk: the reads take bandwidth that the pack
  // writers' queue does not show, so the codec would take the disk for idle
  // and store low-yield chunks raw, writing more to a disk that is the
  // bottleneck (docs/PERFORMANCE.md).
  bool compress_every_chunk = false;
  // The save attempt this rank belongs to: every rank of one save gives the
  // same value, made once by NewSaveAttempt() and shared (a job restarted
  // after a crash makes a new one). The first commit of a newer attempt
  // abandons a pending checkpoint of an older one (a crashed job's): its
  // ranks' parts are dropped, never merged with this attempt's, whatever
  // their world size or step. A rank of an attempt older than the pending
  // one's is refused (FailedPrecondition). Empty, the rank joins a pending
  // checkpoint saved without an attempt, as before; one saved with an
  // attempt refuses it. At most kMaxAttemptSize printable bytes.
  std::string attempt;
  // Replace the checkpoint `name` holds, if any, when this save commits;
  // false: a committed `name` refuses the save (AlreadyExists). The ranks
  // save under "NAME~" (keys::ReplacementCheckpoint), hidden from listings,
  // and the commit that makes it visible renames it over NAME in one step,
  // retiring the old version as RemoveCheckpoints does: readers holding it
  // keep reading it, and gc collects it once they are gone. Every rank of
  // one save gives the same value. A save of more than one rank needs an
  // `attempt` (one rank makes its own). A replacement a crash left
  // committed but not renamed is dropped by the next replacing save of the
  // name, or by gc.
  bool overwrite = false;
  // With overwrite: this save thins the version of NAME whose commit made
  // it the `thins` sequence number, committed at `thins_committed_unix_ms`
  // (RetentionPolicy::thin_older_than). The thinned version keeps that
  // version's place in the commit order (sequence and creation time), and
  // its rename is refused (FailedPrecondition; the replacement is dropped)
  // when NAME holds another version by then, saved again or removed meanwhile.
  std::optional<uint64_t> thins;
  uint64_t thins_committed_unix_ms = 0;
  // Tags under "ckptfs." are the engine's (kThinnedTag): a save that gives
  // one is refused, but for a copy and a thinning, which pass on what the
  // source recorded.
  bool engine_tags = false;
};

// The tag a thinned checkpoint carries: when, what it dropped and by which
// rule ("2026-11-29 05:12 UTC: dropped 24 tensors and 2 blobs (1.1 GiB) of
// optimizer and RNG state").
inline constexpr char kThinnedTag[] = "ckptfs.thinned";
// The kThinnedTag line of a checkpoint with these tags; null when whole.
inline const std::string* ThinnedNote(const std::vector<std::pair<std::string, std::string>>& tags) {
  for (const auto& [key, value] : tags) {
    if (key == kThinnedTag) return &value;
  }
  return nullptr;
}
inline constexpr char kEngineTagPrefix[] = "ckptfs.";

struct ReadOptions {
  // Hold a read lease for the reader's lifetime. The mount opens its
  // directory views without one and leases a checkpoint per open file.
  bool lease = true;
  // Repositories to read chunks from first, nearest first (two tiers: this
  // host's fast tier in front of the shared one; tiers.h). A chunk one of
  // them holds is read there and checked against its id; a chunk none
  // holds, or none gives intact, is read from the checkpoint's own
  // repository. The reader keeps their internals alive as it does its own
  // repository's.
  std::vector<const Repository*> nearer;
};

// Which checkpoints to keep; the rest are removed by garbage collection. An
// empty policy removes nothing. keep_last counts the newest by step when
// every committed checkpoint has one, by commit order otherwise. keep_every
// keeps a checkpoint whose step is a multiple of K; of those without a
// step, every K-th in commit order from the first, counted among
// themselves, so that they never shift which stepped ones it keeps.
// keep_within is by commit time. Pending checkpoints are never removed by
// a policy.
//
// A policy that would remove the newest committed checkpoint (and so also
// one that would remove every checkpoint, such as keep_last = 0) is refused
// with FailedPrecondition and removes nothing, unless allow_removing_newest
// is set: with asynchronous saves, the newest committed checkpoint may be
// the only complete one while the next is still pending.
struct RetentionPolicy {
  std::optional<uint64_t> keep_last;    // the newest N
  std::optional<uint64_t> keep_every;   // step % K == 0 (without a step: every K-th of those in commit order)
  std::optional<uint64_t> keep_within_s;  // committed at most this many seconds before the newest commit
  std::vector<std::string> keep;        // by name
  // Checkpoints no rule removes, each with the reason shown for it (a fast
  // tier's checkpoints not yet durable in its shared tier: tiers.h). Unlike
  // `keep`, these alone make no policy: names that are not committed here
  // are ignored.
  std::vector<std::pair<std::string, std::string>> held;
  // Applied to the checkpoints of this group only ("run1": run1/step-100,
  // run1/eval/step-3, ...); the others stay. Empty: every checkpoint.
  std::string group;
  bool allow_removing_newest = false;
  // Thin retention: of the checkpoints the rules above keep, every one but
  // the newest `thin_older_than` (in keep_last's order, at least 1) keeps
  // only its model: the tensors and blobs ThinKeeps keeps under
  // `thin_keep`. The rest (optimizer state, RNG, schedulers) is dropped,
  // and its space reclaimed by the same gc. A thinned checkpoint replaces
  // the whole one atomically (readers of the whole one keep it until they
  // close it), keeps its place in the commit order, and carries kThinnedTag.
  // One whose thinning would keep no tensor stays whole.
  std::optional<uint64_t> thin_older_than;
  std::vector<std::string> thin_keep;  // shell patterns of names; empty: ThinKeeps's default rule
  // Whether a --keep-* rule is given (without one nothing is removed).
  bool removes() const { return keep_last || keep_every || keep_within_s || !keep.empty(); }
  bool empty() const { return !removes() && !thin_older_than; }
};

// Whether thinning keeps tensor (or blob) `name`. With `patterns`: when the
// name matches one of them (shell patterns as fnmatch(3) without flags:
// '*' also matches '.' and '/'). Without: unless it is optimizer, scheduler
// or RNG state, which is when a part of its name (split at '.' and '/') is
// one of optim, optimizer, optimizers, optim_state, optimizer_state,
// optimizer_states, lr_scheduler, lr_schedulers, scheduler, rng,
// rng_states or rng_tracker, or begins with "rng_state" (rng_state_3.pth),
// or when StateKindOf says it is an optimizer moment.
bool ThinKeeps(std::string_view name, DType dtype, bool blob, const std::vector<std::string>& patterns);

// Parses a duration such as "36h", "7d", "1w2d" or "90m" (units s, m, h, d,
// w, summed; a bare number is seconds) into seconds. InvalidArgument names
// the text.
Result<uint64_t> ParseDuration(std::string_view text);

// A chunk stored again from good bytes (Repository::Repair): how those
// bytes are encoded, and the encoded bytes.
struct ChunkReplacement {
  Codec codec = Codec::kRaw;
  uint32_t raw_len = 0;
  std::string stored;
};

struct GcOptions {
  RetentionPolicy retention;
  bool dry_run = false;
  // A pack whose live bytes fall below this fraction of its size is
  // rewritten (live chunks copied to a new pack, then the old one deleted).
  double rewrite_below = 0.5;
  // Called as each phase of the run starts, with a line saying what it
  // does ("waiting for saves in progress", "deleting 12 packs").
  std::function<void(const std::string&)> on_phase;
  // Chunks whose stored bytes are replaced (Repository::Repair, whose
  // caller checked each against its id): every pack holding one is
  // rewritten as a mostly dead pack is, with these bytes in the chunk's
  // place.
  std::map<ChunkId, ChunkReplacement> replace;
};

// Progress callback: done and total units (bytes or items).
using ProgressFn = std::function<void(uint64_t done, uint64_t total)>;

// Which checkpoints CopyCheckpoints copies: `names`, else the newest `last`
// committed ones, else (all) every committed one; in commit order.
struct CopyOptions {
  std::vector<std::string> names;
  std::optional<uint64_t> last;
  bool all = false;
  // Called as each checkpoint starts ("copying step-100 (4 ranks)") and
  // with its outcome.
  std::function<void(const std::string&)> on_phase;
  // Ranks of a checkpoint copied side by side (their packs written at
  // once), at least 1. Each holds its pipeline's buffers.
  size_t ranks_at_once = 4;
  // Asked before each group of ranks and, from the I/O threads, before each
  // chunk is fetched (so it must be thread-safe): true stops the copy with
  // FailedPrecondition ("cancelled"). A copy that stops, cancelled or
  // failing, removes the pending checkpoint it was making at the
  // destination (chunks of the ranks committed stay until gc, so a rerun
  // sends only what is missing); only a killed copy leaves one pending,
  // which the next copy completes.
  std::function<bool()> cancelled;
};

}  // namespace ckptfs
