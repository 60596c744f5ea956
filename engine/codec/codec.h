// Chunk codecs: raw, zstd, and byte-grouping + zstd.
//
// Byte grouping splits a chunk of W-byte elements (W = 2, 4 or 8) into W
// planes (all first bytes, all second bytes, ...). For floating-point data
// the sign/exponent planes are very compressible and the low mantissa planes
// are close to random; each plane is compressed or stored raw on its own, so
// the codec spends CPU only where it pays. The stored layout of every codec is
// specified in docs/FORMAT.md.
//
// Thread safety: a ChunkEncoder holds zstd state and belongs to one thread at
// a time. DecodeChunk is thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/buffer_pool.h"
#include "core/dtype.h"
#include "core/status.h"

namespace ckptfs {

// Numeric values are on disk; never renumber.
enum class Codec : uint8_t {
  kRaw = 0,
  kZstd = 1,
  kByteGroupZstd = 2,
};
const char* CodecName(Codec c);

enum class Compression : uint8_t {
  kNone = 0,  // every chunk raw
  kZstd = 1,  // byte-grouping + zstd for float types, zstd otherwise, raw when it does not pay
};

struct CodecOptions {
  Compression compression = Compression::kZstd;
  // zstd level; negative levels are zstd's fast modes. The default suits
  // a disk of about 1 GB/s on a few cores; see docs/PERFORMANCE.md.
  int level = 1;
  // A stream (or plane) is stored raw unless compression saves at least this
  // fraction of its bytes.
  double min_saving = 0.03;
};

// Byte planes are compressed in entropy-only mode (Huffman coding of
// literals, no real match search) at levels up to this one, and with zstd's
// own parameters for the level above it.
inline constexpr int kMaxEntropyOnlyLevel = 1;

// The codec ckptfs uses for a dtype when compression is on.
Codec PreferredCodec(DType dtype);

struct EncodedChunk {
  Codec codec;
  size_t size;  // stored bytes written
};

class ChunkEncoder {
 public:
  explicit ChunkEncoder(CodecOptions options);
  ~ChunkEncoder();
  ChunkEncoder(const ChunkEncoder&) = delete;
  ChunkEncoder& operator=(const ChunkEncoder&) = delete;

  // Encodes `raw` (elements of `dtype`) into the first bytes of `out`, which
  // must hold at least raw.size() bytes (a stored chunk is never larger than
  // its raw bytes: a codec that does not save `min_saving` is replaced by
  // kRaw). Never fails for valid input. `level` overrides options.level when
  // not INT32_MIN (used by the adaptive writer). Allocates nothing per call.
  Result<EncodedChunk> EncodeInto(std::span<const std::byte> raw, DType dtype, std::span<std::byte> out,
                                  int level = INT32_MIN);
  // The same into a string (replaced); for tests and tools.
  Result<Codec> Encode(std::span<const std::byte> raw, DType dtype, std::string* out,
                       int level = INT32_MIN);

  const CodecOptions& options() const { return options_; }

 private:
  // The zstd frame of `in` in `out`; nullopt when it does not fit.
  Result<std::optional<size_t>> Zstd(std::span<const std::byte> in, int level, bool entropy_only,
                                     std::span<std::byte> out);
  CodecOptions options_;
  void* cctx_ = nullptr;
  ScratchBuffer scratch_;    // byte planes
  ScratchBuffer split_tmp_;  // intermediate splits
  ScratchBuffer frame_;      // a compressed plane on its way into the output
};

// Decodes `stored` written with `codec` into `raw`, whose size must be the
// chunk's raw length. Corruption when the stored bytes are malformed or do not
// decode to exactly raw.size() bytes.
Status DecodeChunk(Codec codec, std::span<const std::byte> stored, std::span<std::byte> raw);

// Estimated fraction of `data` that encoding with `dtype`'s preferred codec
// would save (0..1), from per-byte-position entropy of a 64 KiB sample.
// Byte planes and chunks that would save less than `min_saving` count as 0.
double EstimateSaving(std::span<const std::byte> data, DType dtype, double min_saving);

// Estimated size after order-0 entropy coding, as a fraction of the input
// (0..1), from a sample of `data`. Cheap: it reads at most 64 KiB.
double EstimateEntropyRatio(std::span<const std::byte> data);

}  // namespace ckptfs
