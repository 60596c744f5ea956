// Read leases: what keeps a removed checkpoint's bytes while someone still
// reads them (docs/DESIGN.md "Removal and read leases").
//
// Removing a checkpoint (rm, or gc's retention) takes its name away at once
// but retires its records instead of deleting them: the manifest moves to
// retired/NAME/TOKEN and the catalog keeps its records under NAME/TOKEN
// (TOKEN: the commit time in unix ms, which tells two checkpoints of one name
// apart). A retired checkpoint's chunks are live for gc while any process on
// any host holds a lease on NAME; the first gc after the last lease went
// drops the retired records and reclaims the chunks.
//
// A lease is held per process and checkpoint name, counted: the first
// reader of a name in a process takes it, the last one to go releases it.
//   - On every repository, it is a shared flock(2) on STATE/leases/NAME
//     (STATE: the repository directory, or this host's state directory for
//     an object store). gc takes that file exclusively, without waiting, to
//     learn that nobody on the host reads NAME, and holds it while it
//     collects, so a reader arriving then waits until gc is done.
//   - On an object store, each host also keeps one object leases/NAME/HOST
//     while any of its processes holds the flock, re-written every
//     `refresh_interval` by each holder. gc on any host lists leases/; an
//     object not refreshed for `stale_after` belongs to a crashed host and is
//     ignored and deleted. Requests do not grow with the number of readers:
//     one PUT per host and name, and refreshes.
// The flock dies with its process, so a crashed reader's lease goes at once
// on its own host and after `stale_after` on others.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <chrono>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>

#include "backend/backend.h"
#include "ckpt/layout.h"
#include "ckpt/object_lock.h"
#include "core/status.h"

namespace ckptfs {


class LeaseRegistry {
 public:
  // `backend` is null for a local repository (flocks only). `state_dir`
  // holds leases/ and, for an object store, the host's id.
  LeaseRegistry(std::string state_dir, Backend* backend, ObjectLockOptions options);
  // Stops the refresher. Leases still counted are left to expire.
  ~LeaseRegistry();
  LeaseRegistry(const LeaseRegistry&) = delete;
  LeaseRegistry& operator=(const LeaseRegistry&) = delete;

  // Counts one more holder of NAME in this process; the first takes the
  // flock (waiting while gc collects NAME) and writes the host's object.
  // Sets *first when this call took the lease for the process.
  Status Acquire(const std::string& name, bool* first = nullptr);
  // One holder fewer; the last releases the flock, and deletes the host's
  // object when no other process of the host holds NAME. On an object
  // store the lease lingers for kLinger first, so a loop of short reads
  // (repo.tensor per tensor) takes it once, not once per read.
  // `linger` false: a lease taken for nothing (the checkpoint was not
  // there) goes at once.
  void Release(const std::string& name, bool linger = true);

  static constexpr std::chrono::milliseconds kLinger{5000};

 private:
  struct Held {
    int fd = -1;
    uint64_t count = 0;
    // When the count fell to 0 (object stores: it lingers); unset in use.
    std::optional<std::chrono::steady_clock::time_point> idle_since;
  };
  Status PutObject(const std::string& name);
  // Lets go of `it` (mu_ held): flock, the host's object, the descriptor.
  void Drop(std::map<std::string, Held>::iterator it);
  void RefreshLoop();

  const std::string state_dir_;
  Backend* const backend_;
  const ObjectLockOptions options_;
  std::string host_;  // object stores: this host's id (STATE/host-id)
  std::mutex mu_;
  std::map<std::string, Held> held_;  // guarded by mu_
  std::condition_variable cv_;        // with mu_
  bool stop_ = false;                 // guarded by mu_
  bool idle_changed_ = false;  // guarded by mu_; a lease started lingering: the refresher's next wake moves
  std::thread refresher_;  // object stores, from the first lease on
};

// gc's side. Local: for each name, whether a process of this host holds it;
// those nobody holds stay locked (exclusively) until the LeaseScan is gone,
// so no reader takes them meanwhile.
class LocalLeaseScan {
 public:
  explicit LocalLeaseScan(std::string state_dir) : state_dir_(std::move(state_dir)) {}
  ~LocalLeaseScan();
  LocalLeaseScan(const LocalLeaseScan&) = delete;
  LocalLeaseScan& operator=(const LocalLeaseScan&) = delete;
  // True when some process reads NAME; false, and NAME locked against new
  // readers until this scan is destroyed, otherwise.
  Result<bool> Leased(const std::string& name);

 private:
  std::string state_dir_;
  std::vector<int> fds_;
};

// Object stores: the names some host holds a lease on now. Lease objects not
// refreshed for options.stale_after are deleted (best effort) and ignored;
// one that cannot be read or parsed counts as held (its owner is unknown).
Result<std::set<std::string>> ListStoreLeases(Backend& backend, const ObjectLockOptions& options);

}  // namespace ckptfs
