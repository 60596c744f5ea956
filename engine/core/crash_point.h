// Crash points for crash-safety tests.
//
// When the environment variable CKPTFS_TEST_CRASH_AT is set to N, the N-th
// crash point this process passes kills it with SIGKILL, as a power cut or
// OOM kill would. Crash points sit between the durable steps of saves,
// removals and garbage collection (object appends and commits, fsyncs,
// renames, deletions, catalog commits). With CKPTFS_TEST_CRASH_COUNT_FILE
// set, the number of crash points passed is written to that file at exit, so
// a test can spread its kill points over a whole run. Unset, a crash point
// costs one load of a static.
#pragma once

namespace ckptfs {

void CrashPoint();

}  // namespace ckptfs
