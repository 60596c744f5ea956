#include "core/float_convert.h"

#include <cmath>
#include <cstring>
#include <limits>

namespace ckptfs {
namespace {

template <typename T>
T Load(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// A small float with `e` exponent and `m` mantissa bits.
double SmallFloat(uint32_t bits, int e, int m, bool has_inf) {
  const uint32_t sign = bits >> (e + m);
  const uint32_t exp = (bits >> m) & ((1u << e) - 1);
  const uint32_t man = bits & ((1u << m) - 1);
  const int bias = (1 << (e - 1)) - 1;
  double v;
  if (exp == 0) {
    v = std::ldexp(static_cast<double>(man), 1 - bias - m);
  } else if (exp == (1u << e) - 1 && has_inf) {
    v = man ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  } else {
    v = std::ldexp(static_cast<double>(man | (1u << m)), static_cast<int>(exp) - bias - m);
  }
  return sign ? -v : v;
}

}  // namespace

double ElementAsDouble(DType dtype, const std::byte* data, size_t i) {
  const std::byte* p = data + i * DTypeSize(dtype);
  switch (dtype) {
    case DType::kBool: return Load<uint8_t>(p) ? 1.0 : 0.0;
    case DType::kU8: return Load<uint8_t>(p);
    case DType::kI8: return Load<int8_t>(p);
    case DType::kU16: return Load<uint16_t>(p);
    case DType::kI16: return Load<int16_t>(p);
    case DType::kU32: return Load<uint32_t>(p);
    case DType::kI32: return Load<int32_t>(p);
    case DType::kU64: return static_cast<double>(Load<uint64_t>(p));
    case DType::kI64: return static_cast<double>(Load<int64_t>(p));
    case DType::kF16: return SmallFloat(Load<uint16_t>(p), 5, 10, true);
    case DType::kBF16: {
      uint32_t bits = static_cast<uint32_t>(Load<uint16_t>(p)) << 16;
      float f;
      std::memcpy(&f, &bits, 4);
      return f;
    }
    case DType::kF32: return Load<float>(p);
    case DType::kF64: return Load<double>(p);
    case DType::kF8E4M3: {
      uint32_t b = Load<uint8_t>(p);
      if ((b & 0x7f) == 0x7f) return std::numeric_limits<double>::quiet_NaN();
      return SmallFloat(b, 4, 3, false);
    }
    case DType::kF8E5M2: return SmallFloat(Load<uint8_t>(p), 5, 2, true);
  }
  return 0;
}

}  // namespace ckptfs
