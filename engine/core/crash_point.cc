#include "core/crash_point.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <climits>
#include <cstdio>
#include <cstdlib>

namespace ckptfs {
namespace {
std::atomic<long> passed{0};

void WriteCount() {
  if (const char* path = std::getenv("CKPTFS_TEST_CRASH_COUNT_FILE")) {
    if (FILE* f = std::fopen(path, "w")) {
      std::fprintf(f, "%ld\n", passed.load());
      std::fclose(f);
    }
  }
}

long CrashTarget() {
  static const long target = [] {
    if (std::getenv("CKPTFS_TEST_CRASH_COUNT_FILE")) std::atexit(WriteCount);
    const char* v = std::getenv("CKPTFS_TEST_CRASH_AT");
    if (v) return std::atol(v);
    return std::getenv("CKPTFS_TEST_CRASH_COUNT_FILE") ? LONG_MAX : 0L;
  }();
  return target;
}
}  // namespace

void CrashPoint() {
  const long target = CrashTarget();
  if (target <= 0) return;
  if (passed.fetch_add(1, std::memory_order_relaxed) + 1 == target) {
    ::kill(::getpid(), SIGKILL);
    ::pause();
  }
}

}  // namespace ckptfs
