// ckpt-sim: runs simulated multi-host histories with injected faults
// (simulation.h) for N seeds or for T minutes, and reports operations per
// second and every anomaly, with the shortest history that shows it.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "simulation.h"

namespace {
void Usage(FILE* to) {
  std::fprintf(to,
               "usage: ckpt-sim [--seeds N] [--first-seed S] [--minutes T] [--ops N] [--hosts N]\n"
               "                [--no-faults] [--no-racy-sources] [--no-shrink] [--history] [--history-lines N]\n"
               "                [--lock-stale-ms MS] [--max-growth-mib-per-host N]\n"
               "Runs simulated histories of many hosts sharing one object store (in memory),\n"
               "with requests failing before and after they take effect, throttling and host\n"
               "crashes, and checks each against a model of what the protocol promises.\n"
               "Seeds S, S+1, ... run until N seeds or T minutes are done (default: 10 seeds).\n"
               "A seed that finds an anomaly is shrunk to the shortest history that still\n"
               "does and printed. Exits 1 when any seed finds one.\n"
               "--lock-stale-ms sets how long a lock or lease may go unrefreshed before\n"
               "other hosts take its holder for gone (default 400; shorter makes leases\n"
               "expire under load more often).\n"
               "--max-growth-mib-per-host bounds how far resident memory may grow over a\n"
               "run, per host, beyond what it was with every host open (default 32; 0: off).\n");
}
}  // namespace

int main(int argc, char** argv) {
  ckptfs::sim::SimOptions options;
  uint64_t seeds = 0, first = 1;
  double minutes = 0;
  bool shrink = true, history = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "ckpt-sim: error: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    auto number = [&](const char* v) {
      char* end = nullptr;
      const double d = std::strtod(v, &end);
      if (!end || *end || d < 0) {
        std::fprintf(stderr, "ckpt-sim: error: %s takes a number, not '%s'\n", a.c_str(), v);
        std::exit(2);
      }
      return d;
    };
    if (a == "--help" || a == "-h") {
      Usage(stdout);
      return 0;
    } else if (a == "--seeds") {
      seeds = static_cast<uint64_t>(number(value()));
    } else if (a == "--first-seed") {
      first = static_cast<uint64_t>(number(value()));
    } else if (a == "--minutes") {
      minutes = number(value());
    } else if (a == "--ops") {
      options.operations = static_cast<int>(number(value()));
    } else if (a == "--hosts") {
      options.hosts = static_cast<int>(number(value()));
      if (options.hosts < 1) options.hosts = 1;
    } else if (a == "--history-lines") {
      options.history_lines = static_cast<size_t>(number(value()));
    } else if (a == "--lock-stale-ms") {
      options.lock_stale_ms = static_cast<int64_t>(number(value()));
      if (options.lock_stale_ms < 10) options.lock_stale_ms = 10;
    } else if (a == "--max-growth-mib-per-host") {
      options.max_growth_mib_per_host = static_cast<uint64_t>(number(value()));
    } else if (a == "--no-racy-sources") {
      options.racy_sources = false;
    } else if (a == "--no-faults") {
      options.faults = false;
    } else if (a == "--no-shrink") {
      shrink = false;
    } else if (a == "--history") {
      history = true;
    } else {
      std::fprintf(stderr, "ckpt-sim: error: unknown argument '%s'\n", a.c_str());
      Usage(stderr);
      return 2;
    }
  }
  if (seeds == 0 && minutes == 0) seeds = 10;
  const auto start = std::chrono::steady_clock::now();
  auto elapsed_min = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / 60; };
  uint64_t ops = 0, failed = 0, reads = 0, crashes = 0, faults = 0, bad = 0, ran = 0, pages = 0, growth = 0;
  double busy = 0;
  for (uint64_t seed = first;; ++seed) {
    if (seeds && ran >= seeds) break;
    if (minutes && elapsed_min() >= minutes) break;
    options.seed = seed;
    auto r = shrink ? ckptfs::sim::RunAndShrink(options) : ckptfs::sim::RunSimulation(options);
    ++ran;
    ops += r.operations;
    failed += r.failed;
    reads += r.reads_checked;
    crashes += r.crashes;
    faults += r.faults_injected;
    pages += r.listing_pages;
    growth = std::max(growth, r.peak_growth_mib);
    busy += r.seconds;
    std::printf("seed %llu: %llu operations (%llu ended in an error), %llu reads checked, %llu faults, %llu crashes, "
                "%llu later listing pages, memory +%llu MiB, %.1f s: %s\n",
                static_cast<unsigned long long>(seed), static_cast<unsigned long long>(r.operations),
                static_cast<unsigned long long>(r.failed), static_cast<unsigned long long>(r.reads_checked),
                static_cast<unsigned long long>(r.faults_injected), static_cast<unsigned long long>(r.crashes),
                static_cast<unsigned long long>(r.listing_pages), static_cast<unsigned long long>(r.peak_growth_mib),
                r.seconds, r.ok() ? "ok" : "ANOMALY");
    if (!r.ok() || history) {
      if (!r.ok()) {
        ++bad;
        std::printf("  shortest failing history: %llu operations\n", static_cast<unsigned long long>(r.operations));
        for (const auto& a : r.anomalies) std::printf("  anomaly: %s\n", a.c_str());
      }
      for (const auto& line : r.history) std::printf("    %s\n", line.c_str());
    }
    std::fflush(stdout);
  }
  std::printf("%llu seeds, %llu operations in %.1f s (%.0f operations/s), %llu reads checked, %llu faults injected, "
              "%llu host crashes, %llu later listing pages, peak memory growth %llu MiB: %llu seeds with anomalies\n",
              static_cast<unsigned long long>(ran), static_cast<unsigned long long>(ops), busy,
              busy > 0 ? ops / busy : 0.0, static_cast<unsigned long long>(reads), static_cast<unsigned long long>(faults),
              static_cast<unsigned long long>(crashes), static_cast<unsigned long long>(pages),
              static_cast<unsigned long long>(growth), static_cast<unsigned long long>(bad));
  (void)failed;
  return bad ? 1 : 0;
}
