#include "codec/codec.h"

#define ZSTD_STATIC_LINKING_ONLY  // ZSTD_c_literalCompressionMode
#include <zstd.h>

#include <climits>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#include <cmath>
#include <cstring>

#include "core/encoding.h"

namespace ckptfs {

const char* CodecName(Codec c) {
  switch (c) {
    case Codec::kRaw: return "raw";
    case Codec::kZstd: return "zstd";
    case Codec::kByteGroupZstd: return "bytegroup-zstd";
  }
  return "unknown";
}

Codec PreferredCodec(DType dtype) {
  uint32_t w = DTypeSize(dtype);
  if (IsFloat(dtype) && w >= 2) return Codec::kByteGroupZstd;
  return Codec::kZstd;
}

double EstimateEntropyRatio(std::span<const std::byte> data) {
  if (data.empty()) return 1.0;
  // Sample 16 evenly spaced 4 KiB windows.
  constexpr size_t kWindow = 4096, kWindows = 16;
  uint32_t hist[256] = {};
  size_t counted = 0;
  auto add = [&](size_t off, size_t len) {
    const auto* p = reinterpret_cast<const uint8_t*>(data.data()) + off;
    for (size_t i = 0; i < len; ++i) ++hist[p[i]];
    counted += len;
  };
  if (data.size() <= kWindow * kWindows) {
    add(0, data.size());
  } else {
    size_t stride = data.size() / kWindows;
    for (size_t w = 0; w < kWindows; ++w) add(w * stride, kWindow);
  }
  double bits = 0;
  for (uint32_t c : hist) {
    if (c) {
      double p = static_cast<double>(c) / counted;
      bits -= p * std::log2(p);
    }
  }
  return bits / 8.0;
}

namespace {

// Splits n 2-byte elements into a low-byte plane and a high-byte plane.
void Split2(const uint8_t* src, size_t n, uint8_t* p0, uint8_t* p1) {
  size_t i = 0;
#if defined(__SSE2__)
  const __m128i mask = _mm_set1_epi16(0x00ff);
  for (; i + 16 <= n; i += 16) {
    __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i));
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i + 16));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p0 + i),
                     _mm_packus_epi16(_mm_and_si128(a, mask), _mm_and_si128(b, mask)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p1 + i),
                     _mm_packus_epi16(_mm_srli_epi16(a, 8), _mm_srli_epi16(b, 8)));
  }
#endif
  for (; i < n; ++i) {
    p0[i] = src[2 * i];
    p1[i] = src[2 * i + 1];
  }
}

// Inverse of Split2.
void Join2(const uint8_t* p0, const uint8_t* p1, size_t n, uint8_t* dst) {
  size_t i = 0;
#if defined(__SSE2__)
  for (; i + 16 <= n; i += 16) {
    __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p0 + i));
    __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p1 + i));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * i), _mm_unpacklo_epi8(lo, hi));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * i + 16), _mm_unpackhi_epi8(lo, hi));
  }
#endif
  for (; i < n; ++i) {
    dst[2 * i] = p0[i];
    dst[2 * i + 1] = p1[i];
  }
}

// Splits n elements of `width` bytes into `width` planes of n bytes.
void SplitPlanes(const uint8_t* src, size_t n, uint32_t width, uint8_t* planes) {
  if (width == 2) return Split2(src, n, planes, planes + n);
  for (size_t i = 0; i < n; ++i) {
    for (uint32_t b = 0; b < width; ++b) planes[b * n + i] = src[i * width + b];
  }
}

void JoinPlanes(const uint8_t* planes, size_t n, uint32_t width, uint8_t* dst) {
  if (width == 2) return Join2(planes, planes + n, n, dst);
  for (size_t i = 0; i < n; ++i) {
    for (uint32_t b = 0; b < width; ++b) dst[i * width + b] = planes[b * n + i];
  }
}

}  // namespace

ChunkEncoder::ChunkEncoder(CodecOptions options) : options_(options) {
  cctx_ = ZSTD_createCCtx();
}

ChunkEncoder::~ChunkEncoder() { ZSTD_freeCCtx(static_cast<ZSTD_CCtx*>(cctx_)); }

Status ChunkEncoder::Zstd(std::span<const std::byte> in, int level, bool entropy_only,
                          std::string* out) {
  auto* cctx = static_cast<ZSTD_CCtx*>(cctx_);
  ZSTD_CCtx_reset(cctx, ZSTD_reset_session_and_parameters);
  if (entropy_only) {
    // Byte planes of floats have almost no repeats: a tiny, fast match finder
    // that finds only long matches leaves zstd doing Huffman coding of
    // literals, about three times faster than level 1 at the same ratio.
    ZSTD_CCtx_setParameter(cctx, ZSTD_c_compressionLevel, -100);
    ZSTD_CCtx_setParameter(cctx, ZSTD_c_minMatch, 7);
    ZSTD_CCtx_setParameter(cctx, ZSTD_c_hashLog, 8);
  } else {
    ZSTD_CCtx_setParameter(cctx, ZSTD_c_compressionLevel, level);
  }
  // zstd's fast (negative) levels skip Huffman coding of literals; floats'
  // exponent planes are almost all literals, so keep it on.
  ZSTD_CCtx_setParameter(cctx, ZSTD_c_literalCompressionMode, ZSTD_ps_enable);
  ZSTD_CCtx_setParameter(cctx, ZSTD_c_contentSizeFlag, 0);
  ZSTD_CCtx_setParameter(cctx, ZSTD_c_checksumFlag, 0);
  size_t bound = ZSTD_compressBound(in.size());
  size_t old = out->size();
  out->resize(old + bound);
  size_t n = ZSTD_compress2(cctx, out->data() + old, bound, in.data(), in.size());
  if (ZSTD_isError(n)) {
    out->resize(old);
    return Status::Internal(std::string("zstd compression failed: ") + ZSTD_getErrorName(n));
  }
  out->resize(old + n);
  return Status::OK();
}

Result<Codec> ChunkEncoder::Encode(std::span<const std::byte> raw, DType dtype, std::string* out,
                                   int level) {
  out->clear();
  if (level == INT32_MIN) level = options_.level;
  const size_t keep_limit = static_cast<size_t>(raw.size() * (1.0 - options_.min_saving));
  auto store_raw = [&]() {
    if (raw.empty()) {
      out->clear();
    } else {
      out->assign(reinterpret_cast<const char*>(raw.data()), raw.size());
    }
    return Codec::kRaw;
  };
  if (options_.compression == Compression::kNone || raw.empty()) return store_raw();

  Codec codec = PreferredCodec(dtype);
  const uint32_t width = DTypeSize(dtype);
  if (codec == Codec::kZstd) {
    RETURN_IF_ERROR(Zstd(raw, level, false, out));
    if (out->size() > keep_limit) return store_raw();
    return Codec::kZstd;
  }

  // Byte grouping. Layout: u8 width, u8 plane_mask (bit p: plane p is zstd),
  // width x u32 stored plane sizes, planes, then the raw tail bytes that do
  // not fill a whole element.
  const size_t n = raw.size() / width;
  const size_t tail = raw.size() - n * width;
  scratch_.resize(n * width);
  const auto* src = reinterpret_cast<const uint8_t*>(raw.data());
  SplitPlanes(src, n, width, reinterpret_cast<uint8_t*>(scratch_.data()));
  Encoder header;
  header.U8(static_cast<uint8_t>(width));
  header.U8(0);
  for (uint32_t b = 0; b < width; ++b) header.U32(0);
  *out = header.Take();
  uint8_t mask = 0;
  std::vector<uint32_t> sizes(width);
  for (uint32_t b = 0; b < width; ++b) {
    std::span<const std::byte> plane(scratch_.data() + b * n, n);
    size_t before = out->size();
    bool compressed = false;
    if (EstimateEntropyRatio(plane) < 1.0 - options_.min_saving) {
      RETURN_IF_ERROR(Zstd(plane, level, level <= kMaxEntropyOnlyLevel, out));
      if (out->size() - before <= n * (1.0 - options_.min_saving)) {
        compressed = true;
      } else {
        out->resize(before);
      }
    }
    if (!compressed) out->append(reinterpret_cast<const char*>(plane.data()), n);
    if (compressed) mask |= static_cast<uint8_t>(1u << b);
    sizes[b] = static_cast<uint32_t>(out->size() - before);
  }
  out->append(reinterpret_cast<const char*>(raw.data()) + n * width, tail);
  (*out)[1] = static_cast<char>(mask);
  std::memcpy(out->data() + 2, sizes.data(), 4 * width);
  if (mask == 0 || out->size() > keep_limit) return store_raw();
  return Codec::kByteGroupZstd;
}

namespace {
Status ZstdDecode(std::span<const std::byte> in, std::span<std::byte> out) {
  thread_local ZSTD_DCtx* dctx = ZSTD_createDCtx();
  size_t n = ZSTD_decompressDCtx(dctx, out.data(), out.size(), in.data(), in.size());
  if (ZSTD_isError(n)) {
    return Status::Corruption(std::string("zstd frame does not decode: ") + ZSTD_getErrorName(n));
  }
  if (n != out.size()) {
    return Status::Corruption("zstd frame decodes to " + std::to_string(n) + " bytes, expected " +
                              std::to_string(out.size()));
  }
  return Status::OK();
}
}  // namespace

Status DecodeChunk(Codec codec, std::span<const std::byte> stored, std::span<std::byte> raw) {
  switch (codec) {
    case Codec::kRaw:
      if (stored.size() != raw.size()) {
        return Status::Corruption("raw chunk has " + std::to_string(stored.size()) +
                                  " bytes, expected " + std::to_string(raw.size()));
      }
      if (!raw.empty()) std::memcpy(raw.data(), stored.data(), raw.size());
      return Status::OK();
    case Codec::kZstd:
      return ZstdDecode(stored, raw);
    case Codec::kByteGroupZstd: {
      Decoder d(stored.data(), stored.size());
      uint8_t width = 0, mask = 0;
      RETURN_IF_ERROR(d.U8(&width));
      RETURN_IF_ERROR(d.U8(&mask));
      if (width != 2 && width != 4 && width != 8) {
        return Status::Corruption("byte-grouped chunk has element width " + std::to_string(width));
      }
      uint32_t sizes[8];
      uint64_t total = 2 + 4 * width;
      for (int b = 0; b < width; ++b) {
        RETURN_IF_ERROR(d.U32(&sizes[b]));
        total += sizes[b];
      }
      const size_t n = raw.size() / width;
      const size_t tail = raw.size() - n * width;
      if (total + tail != stored.size()) {
        return Status::Corruption("byte-grouped chunk sizes do not add up");
      }
      std::vector<std::byte> planes(n * width);
      const std::byte* p = stored.data() + 2 + 4 * width;
      for (int b = 0; b < width; ++b) {
        std::span<std::byte> plane(planes.data() + b * n, n);
        if (mask & (1u << b)) {
          RETURN_IF_ERROR(ZstdDecode({p, sizes[b]}, plane));
        } else {
          if (sizes[b] != n) return Status::Corruption("raw plane has the wrong size");
          std::memcpy(plane.data(), p, n);
        }
        p += sizes[b];
      }
      auto* dst = reinterpret_cast<uint8_t*>(raw.data());
      JoinPlanes(reinterpret_cast<const uint8_t*>(planes.data()), n, width, dst);
      if (tail) std::memcpy(dst + n * width, p, tail);
      return Status::OK();
    }
  }
  return Status::Corruption("unknown codec " + std::to_string(static_cast<int>(codec)));
}

}  // namespace ckptfs
