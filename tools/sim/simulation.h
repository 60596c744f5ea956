// Simulated multi-host histories of one repository on an object store, with
// injected faults, checked against a model of what the protocol promises.
//
// Hosts are Repository instances in one process, each with its own catalog
// directory, sharing one in-memory object store through a fault-injecting
// wrapper (FaultyStore) of its own. A driver thread picks, from a seeded
// generator, operations for random hosts: saves by one rank or by several
// ranks on different hosts whose begins, puts and commits interleave with
// other hosts' operations (some ranks never commit: a crashed rank), rm, a
// name saved again after rm or replaced by an overwriting save, gc with
// retention and thin retention (older versions keep their "w" alone),
// readers opened and held
// across gc and read later, saves whose source another thread rewrites
// meanwhile, mount-style reads (an open without a lease,
// then a lease per file), copies into a second repository, collective
// restores by ranks on several hosts, refreshes and verifies. The store wrapper fails requests before they take effect,
// after they took effect (the client sees an error for a write that
// happened), throttles (an error that says 503), delays (up to 20 ms),
// and crashes a host
// between two requests: every later request of that host fails, and the
// driver drops the host (its threads and in-memory state; its catalog
// directory kept or wiped) and opens it again. Each host's wall clock (what
// its lock and lease objects are stamped and judged with) is skewed by up
// to a tenth of the lock stale time, either way.
//
// Every operation and its result is recorded. The checker (a model of
// each name's possible current versions) reports an anomaly when
//   - a checkpoint whose commit returned success, and that no rm or gc
//     may have removed since, is not found on some host;
//   - a reader gets bytes other than those of the version it opened (each
//     version's bytes are a function of its id, which it carries as a
//     tag), or a version the model says is not current (removed, or never
//     fully committed); a thinned version has "w" alone, a whole one both
//     tensors;
//   - a listed checkpoint is a version some rank of which never committed;
//   - a reader held across gc cannot read its checkpoint (with faults
//     paused);
//   - after faults stop and every host syncs, hosts list different
//     checkpoints, a checkpoint does not read back bit-exact, or verify
//     finds a problem;
//   - an operation takes longer than its deadline;
//   - a commit that failed from one fault on its pending objects left its
//     rank's part behind (one lost answer strands no checkpoint);
//   - resident memory grows past a bound per host.
// Listings come in pages, each a request of its own, so a listing is no
// snapshot of the store (as on S3).
// The first operations' choices are a function of the seed alone, so a
// failing seed is shrunk by running shorter prefixes of its history.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ckptfs::sim {

struct SimOptions {
  uint64_t seed = 1;
  int hosts = 8;
  int operations = 1000;
  bool faults = true;
  // Per request: failed before it takes effect, failed after it took
  // effect (writes only), throttled (503); and, per host operation, the
  // chance that the host crashes at one of its requests.
  double fail_before = 0.01;
  double fail_after = 0.01;
  double throttle = 0.01;
  double crash = 0.01;
  // Some saves read a source another thread rewrites meanwhile (a data
  // race by design: off under ThreadSanitizer).
  bool racy_sources = true;
  // How long a lock or lease object may go unrefreshed before other hosts
  // take its holder for gone (hosts refresh every tenth of it; clocks are
  // skewed by up to a tenth). The lease design assumes refreshes land well
  // within it: a build under a sanitizer, several times slower, needs more.
  int64_t lock_stale_ms = 400;
  // An operation that takes longer is an anomaly.
  double deadline_s = 60;
  // Resident memory may grow by at most this much per host over the run
  // (beyond what the process held once every host was open); 0: no bound.
  uint64_t max_growth_mib_per_host = 32;
  // Lines of history kept for a failure's report.
  size_t history_lines = 400;
};

struct SimResult {
  uint64_t seed = 0;
  uint64_t operations = 0;     // run, the final checks included
  uint64_t failed = 0;         // ended with an error (injected faults, refusals)
  uint64_t reads_checked = 0;  // reads compared with the model, bit for bit
  uint64_t crashes = 0;
  uint64_t faults_injected = 0;
  uint64_t listing_pages = 0;    // listings' pages after their first
  uint64_t peak_growth_mib = 0;  // resident memory, over what it was with every host open
  double seconds = 0;
  std::vector<std::string> anomalies;
  std::vector<std::string> history;  // the last history_lines operations and results
  bool ok() const { return anomalies.empty(); }
};

// Runs one history. Thread-compatible: one call per thread at a time.
SimResult RunSimulation(const SimOptions& options);

// Runs `options` and, when it finds an anomaly, shorter prefixes of the
// same history (binary search on the operation count) down to the
// shortest that still finds one; returns that run.
SimResult RunAndShrink(const SimOptions& options);

}  // namespace ckptfs::sim
