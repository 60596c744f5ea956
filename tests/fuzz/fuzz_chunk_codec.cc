// Chunk codecs. The first byte picks a dtype and a mode:
//   decode:     the rest is a stored chunk of codec (byte 1 % 3) and raw
//               length (bytes 2-3); decoding fills exactly that many bytes or
//               gives an error;
//   round trip: the rest is raw data; it encodes with the dtype's codec, and
//               decodes back to the same bytes; a damaged copy of the encoded
//               chunk (byte flipped where the input says) decodes to the same
//               bytes or to different bytes whose XXH3-128 differs, which is
//               what the read path checks, or gives an error.
#include <memory>
#include <string>
#include <vector>

#include "codec/codec.h"
#include "core/chunk_id.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ckptfs;
  if (size < 4) return 0;
  const DType dtype = *DTypeFromCode(data[0] % kDTypeCount);
  const bool round_trip = data[0] & 0x80;
  if (!round_trip) {
    const Codec codec = static_cast<Codec>(data[1] % 3);
    const size_t raw_len = data[2] | (size_t{data[3]} << 8);
    std::vector<std::byte> raw(raw_len);
    std::span<const std::byte> stored(reinterpret_cast<const std::byte*>(data + 4), size - 4);
    (void)DecodeChunk(codec, stored, raw);
    return 0;
  }
  const size_t flip_at = data[1] | (size_t{data[2]} << 8);
  const int level = static_cast<int8_t>(data[3]) % 8;
  std::span<const std::byte> raw(reinterpret_cast<const std::byte*>(data + 4), size - 4);
  // One encoder per level, reused like the writer's per-thread encoders.
  static std::unique_ptr<ChunkEncoder> encoders[15];
  auto& slot = encoders[level + 7];
  if (!slot) slot = std::make_unique<ChunkEncoder>(CodecOptions{Compression::kZstd, level, 0.03});
  ChunkEncoder& encoder = *slot;
  std::string stored;
  auto codec = encoder.Encode(raw, dtype, &stored);
  FUZZ_CHECK(codec.ok(), codec.status().ToString());
  std::vector<std::byte> back(raw.size());
  Status st = DecodeChunk(*codec, std::as_bytes(std::span(stored)), back);
  FUZZ_CHECK(st.ok(), st.ToString());
  FUZZ_CHECK(std::equal(back.begin(), back.end(), raw.begin(), raw.end()));
  if (stored.empty()) return 0;
  stored[flip_at % stored.size()] ^= static_cast<char>(0x5a);
  if (DecodeChunk(*codec, std::as_bytes(std::span(stored)), back).ok()) {
    const bool same = std::equal(back.begin(), back.end(), raw.begin(), raw.end());
    FUZZ_CHECK(same || ChunkId::Of(back) != ChunkId::Of(raw));
  }
  return 0;
}
