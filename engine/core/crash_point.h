// Crash points for crash-safety tests.
//
// Crash points sit between the durable steps of saves, removals and garbage
// collection (object appends and commits, fsyncs, renames, deletions,
// catalog commits). They do nothing until a test tool arms them: with
// `kill_at` N > 0, the N-th crash point this process passes kills it with
// SIGKILL, as a power cut or OOM kill would; with `count_file` given, the
// number of crash points passed is written to that file at exit, so a test
// can spread its kill points over a whole run. Unarmed, a crash point costs
// one relaxed load. The engine never arms them itself.
#pragma once

#include <string>

namespace ckptfs {

void CrashPoint();

// Call once, before any other thread runs.
void ArmCrashPoints(long kill_at, const std::string& count_file);

}  // namespace ckptfs
