// Decoding of floating-point element types to double (for diffs and checks).
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/dtype.h"

namespace ckptfs {

// The value of element `i` of `data` (elements of `dtype`, little-endian).
// F8_E4M3 is the "fn" variant (no infinities; S.1111.111 is NaN), F8_E5M2
// follows IEEE 754 conventions. Integer and bool types convert exactly where
// a double can hold them.
double ElementAsDouble(DType dtype, const std::byte* data, size_t i);

}  // namespace ckptfs
