#include "core/crash_point.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>

namespace ckptfs {
namespace {
long CrashTarget() {
  static const long target = [] {
    const char* v = std::getenv("CKPTFS_TEST_CRASH_AT");
    return v ? std::atol(v) : 0L;
  }();
  return target;
}
std::atomic<long> passed{0};
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
