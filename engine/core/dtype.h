// Element types: every dtype of the safetensors format.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

namespace ckptfs {

// The numeric values are part of the on-disk format (docs/FORMAT.md): never
// renumber, only append.
enum class DType : uint8_t {
  kBool = 0,
  kU8 = 1,
  kI8 = 2,
  kU16 = 3,
  kI16 = 4,
  kU32 = 5,
  kI32 = 6,
  kU64 = 7,
  kI64 = 8,
  kF16 = 9,
  kBF16 = 10,
  kF32 = 11,
  kF64 = 12,
  kF8E4M3 = 13,
  kF8E5M2 = 14,
};
inline constexpr int kDTypeCount = 15;

// Bytes per element (1, 2, 4 or 8).
uint32_t DTypeSize(DType t);
// The safetensors spelling: "BOOL", "BF16", "F8_E4M3", ...
std::string_view DTypeName(DType t);
// Parses a safetensors spelling; nullopt for anything else.
std::optional<DType> ParseDType(std::string_view name);
// Converts a stored numeric value; nullopt when out of range.
std::optional<DType> DTypeFromCode(uint32_t code);
// True for F16, BF16, F32, F64, F8*.
bool IsFloat(DType t);
// The NumPy `descr` used in .npy headers. Types without a NumPy equivalent
// (BF16, F8_*) map to the unsigned integer of the same width, which keeps
// the bits exactly (see docs/FORMAT.md).
std::string_view NumpyDescr(DType t);

}  // namespace ckptfs
