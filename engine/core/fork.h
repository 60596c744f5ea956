// fork() and the engine's threads.
//
// A child made by fork() has only the thread that called fork(): the
// parent's worker pools, pack writers and commit threads do not exist in it,
// and its copy of their mutexes, condition variables and counters may stay
// locked or non-zero forever. Objects created before the fork therefore must
// not be used in the child (they refuse, see RepositoryImpl::CheckProcess),
// nor destroyed there (joining a thread that does not exist hangs; closing
// the parent's catalog would drop the parent's LMDB reader slots): the child
// leaks them instead. Objects created in the child work as usual.
#pragma once

#include <cstdint>

namespace ckptfs {

// How many fork()s lie between the process that first called this function
// and the calling process: 0 in that process, 1 in its child, and so on.
// Objects record it when created and compare it before use. Registers a
// pthread_atfork handler on its first call; cheap (an atomic load) after.
uint64_t ForkGeneration();

}  // namespace ckptfs
