#include "core/content_cuts.h"

#include <algorithm>
#include <bit>

namespace ckptfs {
namespace {

// 256 fixed pseudo-random values (splitmix64 from a fixed seed). They are
// part of the chunking, so of which chunks two saves share: changing them
// makes the next save of every blob store new chunks once.
struct GearTable {
  uint64_t value[256];
  constexpr GearTable() : value() {
    uint64_t x = 0x6a09e667f3bcc908ull;
    for (auto& v : value) {
      x += 0x9e3779b97f4a7c15ull;
      uint64_t z = x;
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
      v = z ^ (z >> 31);
    }
  }
};
constexpr GearTable kGear;

size_t PowerOfTwoTarget(size_t target) { return std::bit_floor(std::max<size_t>(target, 64)); }

}  // namespace

size_t ContentCutsMaxChunk(size_t target) { return 2 * PowerOfTwoTarget(target); }

void ContentCuts(std::span<const std::byte> data, size_t target, std::vector<uint64_t>& ends) {
  ends.clear();
  const size_t t = PowerOfTwoTarget(target);
  const size_t min = t / 8, max = 2 * t;
  const int bits = std::countr_zero(t);
  const uint64_t mask = ~uint64_t{0} << (64 - bits);
  const auto* p = reinterpret_cast<const uint8_t*>(data.data());
  const size_t n = data.size();
  size_t start = 0;
  while (start < n) {
    const size_t limit = std::min(n, start + max);
    size_t end = limit;
    uint64_t h = 0;
    for (size_t i = std::min(n, start + min); i < limit; ++i) {
      h = (h << 1) + kGear.value[p[i]];
      if ((h & mask) == 0) {
        end = i + 1;
        break;
      }
    }
    ends.push_back(end);
    start = end;
  }
}

}  // namespace ckptfs
