// Random identifiers (pack ids, temporary file names, repository ids).
#pragma once

#include <cstddef>
#include <string>

namespace ckptfs {

// `digits` random lowercase hex digits. Thread-safe; the generator is
// reseeded in a child after fork, so parent and child never draw the same ids.
std::string RandomHex(size_t digits);

}  // namespace ckptfs
