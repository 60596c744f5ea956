#include "core/dtype.h"

namespace ckptfs {
namespace {
struct DTypeInfo {
  std::string_view name;
  uint32_t size;
  bool is_float;
  std::string_view numpy;
};
constexpr DTypeInfo kInfo[kDTypeCount] = {
    {"BOOL", 1, false, "|b1"}, {"U8", 1, false, "|u1"},   {"I8", 1, false, "|i1"},
    {"U16", 2, false, "<u2"},  {"I16", 2, false, "<i2"},  {"U32", 4, false, "<u4"},
    {"I32", 4, false, "<i4"},  {"U64", 8, false, "<u8"},  {"I64", 8, false, "<i8"},
    {"F16", 2, true, "<f2"},   {"BF16", 2, true, "<u2"},  {"F32", 4, true, "<f4"},
    {"F64", 8, true, "<f8"},   {"F8_E4M3", 1, true, "|u1"}, {"F8_E5M2", 1, true, "|u1"},
};
}  // namespace

uint32_t DTypeSize(DType t) { return kInfo[static_cast<int>(t)].size; }
std::string_view DTypeName(DType t) { return kInfo[static_cast<int>(t)].name; }
bool IsFloat(DType t) { return kInfo[static_cast<int>(t)].is_float; }
std::string_view NumpyDescr(DType t) { return kInfo[static_cast<int>(t)].numpy; }

std::optional<DType> ParseDType(std::string_view name) {
  for (int i = 0; i < kDTypeCount; ++i) {
    if (kInfo[i].name == name) return static_cast<DType>(i);
  }
  return std::nullopt;
}

std::optional<DType> DTypeFromCode(uint32_t code) {
  if (code >= static_cast<uint32_t>(kDTypeCount)) return std::nullopt;
  return static_cast<DType>(code);
}

}  // namespace ckptfs
