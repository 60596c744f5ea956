// ckpt with its crash points armed, for the crash-safety tests: with
// CKPTFS_TEST_CRASH_AT=N the N-th crash point passed kills the process with
// SIGKILL; with CKPTFS_TEST_CRASH_COUNT_FILE=PATH the number passed is
// written to PATH at exit. Otherwise it is ckpt itself.
#include <cstdlib>
#include <string>

#include "commands.h"
#include "core/crash_point.h"

int main(int argc, char** argv) {
  const char* at = std::getenv("CKPTFS_TEST_CRASH_AT");
  const char* count = std::getenv("CKPTFS_TEST_CRASH_COUNT_FILE");
  ckptfs::ArmCrashPoints(at ? std::atol(at) : 0, count ? std::string(count) : std::string());
  return ckptfs::cli::Main(argc, argv);
}
