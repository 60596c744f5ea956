// The locks of a repository, flock(2)s on files in REPO/locks/.
//
// gc.lock, the garbage-collection lock:
//
// Checkpoint writers hold it shared from BeginCheckpoint until their commit
// has finished (or they are aborted); garbage collection holds it exclusively
// while it decides what is dead and deletes it. So gc never runs while a save
// that may have deduplicated against an old chunk is in flight, and every
// pack a save is still writing belongs to a save gc waited for. The lock is
// an flock(2): it is released when its holder exits, however it exits.
//
// gc-run.lock: held exclusively for a whole garbage collection, so two runs
// never overlap (one would take the other's freshly written packs, not yet in
// the catalog, for orphans). Saves never take it.
#pragma once

#include <string>

#include "core/status.h"

namespace ckptfs {

class RepoLock {
 public:
  enum class Mode { kShared, kExclusive };
  enum class Name { kGc, kGcRun, kDrain };
  // Blocks until the lock is granted.
  static Result<RepoLock> Acquire(const std::string& repository, Mode mode, Name name = Name::kGc);
  // Like Acquire, but returns FailedPrecondition at once when another holder
  // conflicts.
  static Result<RepoLock> TryAcquire(const std::string& repository, Mode mode, Name name = Name::kGc);
  RepoLock(RepoLock&& other) noexcept : fd_(other.fd_) { other.fd_ = -1; }
  RepoLock& operator=(RepoLock&& other) noexcept;
  RepoLock(const RepoLock&) = delete;
  RepoLock& operator=(const RepoLock&) = delete;
  ~RepoLock();

 private:
  explicit RepoLock(int fd) : fd_(fd) {}
  static Result<RepoLock> Lock(const std::string& repository, Mode mode, Name name, bool wait);
  int fd_;
};

}  // namespace ckptfs
