// Locks kept as objects in a repository's store, for hosts that share
// nothing but the store (an S3 bucket): the lock objects of restic's design.
//
// A lock is an object locks/shared-<id> or locks/exclusive-<id> holding who
// took it and when it was last refreshed. To take one, a process writes its
// object, then lists locks/: a shared lock conflicts with any exclusive one,
// an exclusive lock with any other. On a conflict it deletes its object and
// tries again (with backoff) until its wait runs out. Because the store gives
// read-after-write consistency for PUT and LIST, of two processes that take
// conflicting locks at once at least one sees the other; both may back off,
// but both can never proceed.
//
// A holder refreshes its object in the background. A lock not refreshed for
// `stale_after` belongs to a holder that crashed (or lost the store): it is
// ignored, and RemoveStaleObjectLocks deletes it, so a crashed saver never
// blocks collection forever. The other side of that bargain: a holder whose
// refreshes fail must stop before others may take its lock for stale; Check
// says when (savers call it before their commit point).
//
// Times are the hosts' wall clocks; stale_after (30 minutes by default) must
// exceed any clock skew between hosts by far.
//
// Thread safety: an ObjectLock may be used from several threads.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "backend/backend.h"
#include "core/json.h"
#include "core/status.h"

namespace ckptfs {

// This host's name ("unknown host" when it has none), the wall clock in
// unix ms, and {"host", "pid"} of this process: who holds a lock, a lease or
// a rank's started- object.
std::string HostName();
uint64_t WallClockUnixMs();
Json ThisProcess();

struct ObjectLockOptions {
  std::chrono::milliseconds refresh_interval = std::chrono::minutes(1);
  std::chrono::milliseconds stale_after = std::chrono::minutes(30);
  // How long Acquire keeps trying while conflicting locks exist (0: once).
  std::chrono::milliseconds wait = std::chrono::milliseconds(0);
  // Who holds the lock, for messages ("host pid 1234"); default: host and pid.
  std::string holder;
  // The clock (unix ms); tests replace it.
  std::function<uint64_t()> now_unix_ms;
};

class ObjectLock {
 public:
  enum class Mode { kShared, kExclusive };

  // Takes a lock. FailedPrecondition naming a conflicting holder when the
  // wait runs out; the backend's error when the store fails.
  static Result<std::unique_ptr<ObjectLock>> Acquire(Backend& backend, Mode mode, const ObjectLockOptions& options);
  // Stops refreshing and deletes the lock object (best effort: one left
  // behind goes stale).
  ~ObjectLock();
  ObjectLock(const ObjectLock&) = delete;
  ObjectLock& operator=(const ObjectLock&) = delete;

  // OK while the lock is certainly still held: its last successful refresh
  // is recent enough that nobody can have taken it for stale. Otherwise
  // FailedPrecondition saying since when it could not be refreshed.
  Status Check() const;
  const std::string& key() const { return key_; }
  Mode mode() const { return mode_; }

 private:
  ObjectLock(Backend& backend, Mode mode, std::string key, ObjectLockOptions options, uint64_t taken_ms);
  void RefreshLoop();

  Backend& backend_;
  const Mode mode_;
  const std::string key_;
  const ObjectLockOptions options_;
  mutable std::mutex mu_;
  std::condition_variable cv_;  // with mu_
  bool stop_ = false;           // guarded by mu_
  uint64_t last_refresh_ms_;    // guarded by mu_
  std::thread refresher_;
};

struct ObjectLockInfo {
  std::string key;
  ObjectLock::Mode mode = ObjectLock::Mode::kShared;
  std::string holder;
  uint64_t refreshed_unix_ms = 0;
  bool stale = false;
  bool readable = true;  // false: the object is not a lock ckptfs wrote
};

// The lock objects under locks/, with their staleness by `options`' clock.
Result<std::vector<ObjectLockInfo>> ListObjectLocks(Backend& backend, const ObjectLockOptions& options);
// Deletes the stale ones; returns how many.
Result<size_t> RemoveStaleObjectLocks(Backend& backend, const ObjectLockOptions& options);

}  // namespace ckptfs
