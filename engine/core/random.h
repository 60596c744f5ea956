// Random identifiers (pack ids, temporary file names, repository ids).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace ckptfs {

// `digits` random lowercase hex digits. Thread-safe; the generator is
// reseeded in a child after fork, so parent and child never draw the same ids.
std::string RandomHex(size_t digits);
// A random 64-bit value from the same per-thread generator (retry jitter):
// no OS call after a thread's first.
uint64_t RandomU64();

}  // namespace ckptfs
