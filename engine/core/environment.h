// Where settings from the environment come from. The engine reads no
// environment variable on its own: the functions that take settings from
// the environment (OpenOptionsFromEnvironment, ObjectStoreOptions::FromEnvironment)
// are handed a lookup by their caller, std::getenv in the command-line tool
// and the Python package, a table in tests.
#pragma once

#include <functional>

namespace ckptfs {

// The value of an environment variable, or nullptr when it is unset.
using Environment = std::function<const char*(const char*)>;

}  // namespace ckptfs
