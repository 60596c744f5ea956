// Simulated multi-host histories with injected faults (tools/sim): fixed
// seeds, checked against the model. A seed that finds an anomaly prints its
// shortest failing history; `ckpt-sim --first-seed S --seeds 1` replays it.
#include <gtest/gtest.h>

#include <span>
#include <string>

#include "simulation.h"
#include "test_util.h"

namespace ckptfs {
namespace {

void RunSeeds(uint64_t first, int seeds, int operations, int64_t lock_stale_ms) {
  uint64_t total = 0;
  for (uint64_t seed = first; seed < first + seeds; ++seed) {
    sim::SimOptions o;
    o.seed = seed;
    o.operations = operations;
    o.lock_stale_ms = lock_stale_ms;
    o.racy_sources = !testing::kThreadSanitizer;  // its racing writer is a data race by design
    // A sanitizer's quarantine and shadow memory make resident memory no
    // measure of what the engine holds.
    if (testing::kAddressSanitizer || testing::kThreadSanitizer) o.max_growth_mib_per_host = 0;
    const sim::SimResult r = sim::RunAndShrink(o);
    total += r.operations;
    if (r.ok()) continue;
    std::string report = "seed " + std::to_string(seed) + ": shortest failing history of " +
                         std::to_string(r.operations) + " operations\n";
    for (const auto& a : r.anomalies) report += "  anomaly: " + a + "\n";
    for (const auto& line : r.history) report += "    " + line + "\n";
    ADD_FAILURE() << report;
  }
  ::testing::Test::RecordProperty("operations", std::to_string(total));
}

// 8 hosts, faults before and after requests take effect, throttling and
// crashes; at least 10^4 operations in all. Under a sanitizer, which slows
// every thread several times, fewer (its timing draws other interleavings)
// and a lock stale time the slowed refreshes land well within.
TEST(Simulation, FixedSeedsOfEightHostsWithInjectedFaultsRunClean) {
  if (testing::kAddressSanitizer || testing::kThreadSanitizer) {
    RunSeeds(1, 3, 400, 2000);
  } else {
    RunSeeds(1, 10, 1000, 400);
  }
}

}  // namespace
}  // namespace ckptfs
