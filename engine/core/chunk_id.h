// ChunkId: the XXH3-128 of a chunk's raw (decoded) bytes.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace ckptfs {

struct ChunkId {
  // Big-endian canonical form of the 128-bit hash (XXH128_canonical_t).
  std::array<uint8_t, 16> bytes{};

  static ChunkId Of(std::span<const std::byte> data);
  std::string ToHex() const;
  static std::optional<ChunkId> FromHex(std::string_view hex);
  auto operator<=>(const ChunkId&) const = default;
};

// The ChunkId of bytes that arrive in pieces: Finish() equals ChunkId::Of
// of their concatenation. Holds its state inline (no allocation).
class ChunkHasher {
 public:
  ChunkHasher() { Reset(); }
  ChunkHasher(const ChunkHasher&) = delete;
  ChunkHasher& operator=(const ChunkHasher&) = delete;
  void Reset();
  void Update(std::span<const std::byte> piece);
  ChunkId Finish() const;

 private:
  alignas(64) unsigned char state_[640];
};

struct ChunkIdHash {
  size_t operator()(const ChunkId& id) const {
    size_t h;
    std::memcpy(&h, id.bytes.data(), sizeof h);
    return h;
  }
};

// XXH3-64 of bytes, for checksums of indexes and records.
uint64_t Checksum64(std::span<const std::byte> data);

}  // namespace ckptfs
