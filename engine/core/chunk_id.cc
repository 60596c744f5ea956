#include "core/chunk_id.h"

#define XXH_STATIC_LINKING_ONLY  // XXH3_state_t's size, to hold it inline
#include <xxhash.h>
#if CKPTFS_XXH_DISPATCH
// XXH3_128bits and XXH3_128bits_update become the library's dispatching
// versions, which use AVX2 or AVX-512 where the CPU has them: the same
// hashes, several times as fast as the SSE2 default on a hot chunk.
#include <xxh_x86dispatch.h>
#endif

namespace ckptfs {

namespace {
ChunkId FromHash(XXH128_hash_t h) {
  XXH128_canonical_t c;
  XXH128_canonicalFromHash(&c, h);
  ChunkId id;
  std::memcpy(id.bytes.data(), c.digest, 16);
  return id;
}
}  // namespace

static_assert(sizeof(XXH3_state_t) <= 640 && alignof(XXH3_state_t) <= 64, "ChunkHasher's state is too small");

void ChunkHasher::Reset() { XXH3_128bits_reset(reinterpret_cast<XXH3_state_t*>(state_)); }

void ChunkHasher::Update(std::span<const std::byte> piece) {
  XXH3_128bits_update(reinterpret_cast<XXH3_state_t*>(state_), piece.data(), piece.size());
}

ChunkId ChunkHasher::Finish() const {
  return FromHash(XXH3_128bits_digest(reinterpret_cast<const XXH3_state_t*>(state_)));
}

ChunkId ChunkId::Of(std::span<const std::byte> data) { return FromHash(XXH3_128bits(data.data(), data.size())); }

std::string ChunkId::ToHex() const {
  static const char* kDigits = "0123456789abcdef";
  std::string s(32, '0');
  for (int i = 0; i < 16; ++i) {
    s[2 * i] = kDigits[bytes[i] >> 4];
    s[2 * i + 1] = kDigits[bytes[i] & 15];
  }
  return s;
}

std::optional<ChunkId> ChunkId::FromHex(std::string_view hex) {
  if (hex.size() != 32) return std::nullopt;
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  ChunkId id;
  for (int i = 0; i < 16; ++i) {
    int hi = nibble(hex[2 * i]), lo = nibble(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return std::nullopt;
    id.bytes[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  return id;
}

uint64_t Checksum64(std::span<const std::byte> data) { return XXH3_64bits(data.data(), data.size()); }

}  // namespace ckptfs
