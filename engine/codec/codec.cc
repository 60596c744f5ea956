#include "codec/codec.h"

#define ZSTD_STATIC_LINKING_ONLY  // ZSTD_c_literalCompressionMode
#include <zstd.h>
#include <zstd_errors.h>

#include <algorithm>
#include <climits>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#include <cmath>
#include <cstring>
#include <memory>
#include <optional>

#include "core/buffer_pool.h"
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
#if defined(__SSE2__)
// Of the 16 2-byte units in a and b: their low bytes, and their high bytes.
inline __m128i LowBytes(__m128i a, __m128i b) {
  const __m128i mask = _mm_set1_epi16(0x00ff);
  return _mm_packus_epi16(_mm_and_si128(a, mask), _mm_and_si128(b, mask));
}
inline __m128i HighBytes(__m128i a, __m128i b) {
  return _mm_packus_epi16(_mm_srli_epi16(a, 8), _mm_srli_epi16(b, 8));
}
#endif

void Split2(const uint8_t* src, size_t n, uint8_t* p0, uint8_t* p1) {
  size_t i = 0;
#if defined(__SSE2__)
  for (; i + 16 <= n; i += 16) {
    __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i));
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i + 16));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p0 + i), LowBytes(a, b));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p1 + i), HighBytes(a, b));
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

// Splits n 4-byte elements into 4 planes of n bytes in one pass: the two
// levels of the 2-way split (even and odd bytes give the (b0, b2) and
// (b1, b3) pairs, which split into the planes) done in registers, 16
// elements at a time, so the bytes go through memory once, not three times.
// Plane b goes to p[b]; the planes may lie anywhere.
void Split4(const uint8_t* src, size_t n, uint8_t* const* p) {
  size_t i = 0;
#if defined(__SSE2__)
  for (; i + 16 <= n; i += 16) {
    const auto* in = reinterpret_cast<const __m128i*>(src + 4 * i);
    const __m128i v0 = _mm_loadu_si128(in), v1 = _mm_loadu_si128(in + 1);
    const __m128i v2 = _mm_loadu_si128(in + 2), v3 = _mm_loadu_si128(in + 3);
    const __m128i e01 = LowBytes(v0, v1), o01 = HighBytes(v0, v1);  // (b0 b2), (b1 b3) of elements i..i+7
    const __m128i e23 = LowBytes(v2, v3), o23 = HighBytes(v2, v3);  // ... of elements i+8..i+15
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p[0] + i), LowBytes(e01, e23));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p[1] + i), LowBytes(o01, o23));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p[2] + i), HighBytes(e01, e23));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p[3] + i), HighBytes(o01, o23));
  }
#endif
  for (; i < n; ++i) {
    for (size_t b = 0; b < 4; ++b) p[b][i] = src[4 * i + b];
  }
}

// Splits n elements of `width` bytes (2, 4 or 8) into `width` planes of n
// bytes, as compositions of the 2-way split: splitting 4-byte elements at even
// and odd byte positions gives (b0, b2) and (b1, b3) pairs, and splitting
// those pairs gives the planes. `tmp` holds 2 * n * width bytes.
void SplitPlanes(const uint8_t* src, size_t n, uint32_t width, uint8_t* p, uint8_t* tmp) {
  if (width == 2) {
    Split2(src, n, p, p + n);
  } else if (width == 4) {
    uint8_t* const planes[4] = {p, p + n, p + 2 * n, p + 3 * n};
    Split4(src, n, planes);
  } else {
    uint8_t* t = tmp;          // 8n: even bytes (b0 b2 b4 b6), odd bytes (b1 b3 b5 b7)
    uint8_t* u = tmp + 8 * n;  // 4n
    Split2(src, 4 * n, t, t + 4 * n);
    for (int parity = 0; parity < 2; ++parity) {
      Split2(t + parity * 4 * n, 2 * n, u, u + 2 * n);  // (b0 b4) (b2 b6), or (b1 b5) (b3 b7)
      Split2(u, n, p + parity * n, p + (4 + parity) * n);
      Split2(u + 2 * n, n, p + (2 + parity) * n, p + (6 + parity) * n);
    }
  }
}

// Interleaves 4 planes of n bytes into n 4-byte elements in one pass.
void Join4(const uint8_t* const* p, size_t n, uint8_t* dst) {
  size_t i = 0;
#if defined(__SSE2__)
  for (; i + 16 <= n; i += 16) {
    __m128i b0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p[0] + i));
    __m128i b1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p[1] + i));
    __m128i b2 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p[2] + i));
    __m128i b3 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p[3] + i));
    __m128i lo01 = _mm_unpacklo_epi8(b0, b1), hi01 = _mm_unpackhi_epi8(b0, b1);
    __m128i lo23 = _mm_unpacklo_epi8(b2, b3), hi23 = _mm_unpackhi_epi8(b2, b3);
    auto* out = reinterpret_cast<__m128i*>(dst + 4 * i);
    _mm_storeu_si128(out + 0, _mm_unpacklo_epi16(lo01, lo23));
    _mm_storeu_si128(out + 1, _mm_unpackhi_epi16(lo01, lo23));
    _mm_storeu_si128(out + 2, _mm_unpacklo_epi16(hi01, hi23));
    _mm_storeu_si128(out + 3, _mm_unpackhi_epi16(hi01, hi23));
  }
#endif
  for (; i < n; ++i) {
    for (int b = 0; b < 4; ++b) dst[4 * i + b] = p[b][i];
  }
}

// Inverse of SplitPlanes; planes may live anywhere. `tmp` holds 8 * n bytes.
void JoinPlanes(const uint8_t* const* p, size_t n, uint32_t width, uint8_t* dst, uint8_t* tmp) {
  if (width == 2) {
    Join2(p[0], p[1], n, dst);
  } else if (width == 4) {
    Join4(p, n, dst);
  } else {
    // Elements of 8 bytes: the low and high 4-byte halves, then interleave
    // them as 4-byte units (two 2-byte joins).
    uint8_t* lo = tmp;
    uint8_t* hi = tmp + 4 * n;
    Join4(p, n, lo);
    Join4(p + 4, n, hi);
    for (size_t i = 0; i < n; ++i) {
      std::memcpy(dst + 8 * i, lo + 4 * i, 4);
      std::memcpy(dst + 8 * i + 4, hi + 4 * i, 4);
    }
  }
}

// Adds `whole` records of W bytes at `p` to the per-position histograms:
// no division per byte (this runs on every chunk an adaptive save sees).
template <uint32_t W>
void CountRecords(const uint8_t* p, size_t whole, uint32_t (*hist)[256]) {
  for (size_t k = 0; k < whole; ++k, p += W) {
    for (uint32_t b = 0; b < W; ++b) ++hist[b][p[b]];
  }
}

}  // namespace

double EstimateSaving(std::span<const std::byte> data, DType dtype, double min_saving) {
  if (data.empty()) return 0;
  const uint32_t width = PreferredCodec(dtype) == Codec::kByteGroupZstd ? DTypeSize(dtype) : 1;
  // Histograms per byte position of 16 evenly spaced 4 KiB windows.
  constexpr size_t kWindow = 4096, kWindows = 16;
  uint32_t hist[8][256] = {};
  size_t counted[8] = {};
  const auto* base = reinterpret_cast<const uint8_t*>(data.data());
  auto add = [&](size_t off, size_t len) {
    off -= off % width;  // windows start on a record, so position = index % width
    len = std::min(len, data.size() - off);
    const uint8_t* p = base + off;
    const size_t whole = len / width;
    switch (width) {
      case 1: CountRecords<1>(p, whole, hist); break;
      case 2: CountRecords<2>(p, whole, hist); break;
      case 4: CountRecords<4>(p, whole, hist); break;
      case 8: CountRecords<8>(p, whole, hist); break;
      default:
        for (size_t k = 0; k < whole; ++k) {
          for (uint32_t b = 0; b < width; ++b) ++hist[b][p[k * width + b]];
        }
    }
    for (uint32_t b = 0; b < width; ++b) counted[b] += whole;
    for (size_t i = whole * width; i < len; ++i) {  // a last, partial record
      ++hist[i - whole * width][p[i]];
      ++counted[i - whole * width];
    }
  };
  if (data.size() <= kWindow * kWindows) {
    add(0, data.size());
  } else {
    size_t stride = data.size() / kWindows;
    for (size_t w = 0; w < kWindows; ++w) add(w * stride, kWindow);
  }
  double saving = 0;
  for (uint32_t b = 0; b < width; ++b) {
    if (!counted[b]) continue;
    double bits = 0;
    for (uint32_t c : hist[b]) {
      if (c) {
        double p = static_cast<double>(c) / counted[b];
        bits -= p * std::log2(p);
      }
    }
    double plane_saving = 1.0 - bits / 8.0;
    if (plane_saving >= min_saving) saving += plane_saving / width;
  }
  return saving >= min_saving ? saving : 0;
}

ChunkEncoder::ChunkEncoder(CodecOptions options) : options_(options) {
  cctx_ = ZSTD_createCCtx();
}

ChunkEncoder::~ChunkEncoder() { ZSTD_freeCCtx(static_cast<ZSTD_CCtx*>(cctx_)); }

Result<std::optional<size_t>> ChunkEncoder::Zstd(std::span<const std::byte> in, int level, bool entropy_only,
                                                  std::span<std::byte> out) {
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
  // `out` is only as large as a result worth keeping: a frame that does not
  // fit is not worth it.
  size_t n = ZSTD_compress2(cctx, out.data(), out.size(), in.data(), in.size());
  if (ZSTD_isError(n)) {
    if (ZSTD_getErrorCode(n) == ZSTD_error_dstSize_tooSmall) return std::optional<size_t>();
    return Status::Internal(std::string("zstd compression failed: ") + ZSTD_getErrorName(n));
  }
  return std::optional<size_t>(n);
}

Result<Codec> ChunkEncoder::Encode(std::span<const std::byte> raw, DType dtype, std::string* out, int level) {
  out->resize(raw.size());
  auto encoded = EncodeInto(raw, dtype, std::as_writable_bytes(std::span(out->data(), out->size())), level);
  if (!encoded.ok()) return encoded.status();
  out->resize(encoded->size);
  return encoded->codec;
}

Result<EncodedChunk> ChunkEncoder::EncodeInto(std::span<const std::byte> raw, DType dtype, std::span<std::byte> out,
                                              int level) {
  if (out.size() < raw.size()) return Status::Internal("encoder output smaller than the chunk");
  if (level == INT32_MIN) level = options_.level;
  // Compressed forms larger than this are not worth keeping: the chunk is
  // stored raw instead.
  const size_t keep_limit = static_cast<size_t>(raw.size() * (1.0 - options_.min_saving));
  auto store_raw = [&]() -> Result<EncodedChunk> {
    if (!raw.empty()) std::memcpy(out.data(), raw.data(), raw.size());
    return EncodedChunk{Codec::kRaw, raw.size()};
  };
  if (options_.compression == Compression::kNone || raw.empty()) return store_raw();

  Codec codec = PreferredCodec(dtype);
  const uint32_t width = DTypeSize(dtype);
  if (codec == Codec::kZstd) {
    CKPT_ASSIGN_OR_RETURN(auto n, Zstd(raw, level, false, out.first(keep_limit)));
    if (!n) return store_raw();
    return EncodedChunk{Codec::kZstd, *n};
  }

  // Byte grouping. Layout: u8 width, u8 plane_mask (bit p: plane p is zstd),
  // width x u32 stored plane sizes, planes, then the raw tail bytes that do
  // not fill a whole element.
  const size_t n = raw.size() / width;
  const size_t tail = raw.size() - n * width;
  const size_t header = 2 + 4 * width;
  if (header >= keep_limit) return store_raw();
  // Where the planes are split to. For 2- and 4-byte elements, every plane
  // but the last goes straight to its place in `out` as if stored raw, and
  // the last (the sign and exponent of little-endian floats, the plane that
  // compresses) to scratch, from which it is compressed into `out`: the
  // planes stored raw (the mantissa bytes) are then never copied again.
  // This needs room for the header before them, which a chunk of fewer
  // elements than the header's bytes lacks; other widths split to scratch.
  const auto* src = reinterpret_cast<const uint8_t*>(raw.data());
  auto* dst = reinterpret_cast<uint8_t*>(out.data());
  uint8_t* planes[8] = {};
  const bool in_out = (width == 2 || width == 4) && header + (width - 1) * n <= out.size();
  if (in_out) {
    for (uint32_t b = 0; b + 1 < width; ++b) planes[b] = dst + header + b * n;
    planes[width - 1] = reinterpret_cast<uint8_t*>(scratch_.Reserve(n));
    if (width == 2) {
      Split2(src, n, planes[0], planes[1]);
    } else {
      Split4(src, n, planes);
    }
  } else {
    auto* base = reinterpret_cast<uint8_t*>(scratch_.Reserve(n * width));
    SplitPlanes(src, n, width, base, reinterpret_cast<uint8_t*>(split_tmp_.Reserve(2 * n * width)));
    for (uint32_t b = 0; b < width; ++b) planes[b] = base + b * n;
  }
  uint8_t mask = 0;
  uint32_t sizes[8] = {};
  size_t pos = header;
  const size_t plane_limit = static_cast<size_t>(n * (1.0 - options_.min_saving));
  for (uint32_t b = 0; b < width; ++b) {
    std::span<const std::byte> plane(reinterpret_cast<const std::byte*>(planes[b]), n);
    // A plane split into `out` lies at or after `pos`: everything written
    // before it ends at or before its start.
    const bool inside = in_out && b + 1 < width;
    const size_t budget = keep_limit - pos;  // pos <= keep_limit holds throughout
    bool compressed = false;
    if (EstimateEntropyRatio(plane) < 1.0 - options_.min_saving) {
      const size_t limit = std::min(budget, plane_limit);
      // zstd cannot write over its own input: a plane inside `out` is
      // compressed to scratch and its (smaller) frame copied into place.
      std::span<std::byte> dst = inside ? std::span(frame_.Reserve(limit), limit) : out.subspan(pos, limit);
      CKPT_ASSIGN_OR_RETURN(auto z, Zstd(plane, level, level <= kMaxEntropyOnlyLevel, dst));
      if (z) {
        compressed = true;
        mask |= static_cast<uint8_t>(1u << b);
        sizes[b] = static_cast<uint32_t>(*z);
        if (inside) std::memmove(out.data() + pos, dst.data(), *z);
      }
    }
    if (!compressed) {
      if (n > budget) return store_raw();  // the whole would not save enough
      if (planes[b] != dst + pos) std::memmove(dst + pos, planes[b], n);
      sizes[b] = static_cast<uint32_t>(n);
    }
    pos += sizes[b];
  }
  if (mask == 0 || tail > keep_limit - pos) return store_raw();
  std::memcpy(out.data() + pos, raw.data() + n * width, tail);
  pos += tail;
  out[0] = static_cast<std::byte>(width);
  out[1] = static_cast<std::byte>(mask);
  std::memcpy(out.data() + 2, sizes, 4 * width);
  return EncodedChunk{Codec::kByteGroupZstd, pos};
}

namespace {
Status ZstdDecode(std::span<const std::byte> in, std::span<std::byte> out) {
  // One context per thread, freed when the thread exits.
  struct FreeDCtx {
    void operator()(ZSTD_DCtx* c) const { ZSTD_freeDCtx(c); }
  };
  thread_local std::unique_ptr<ZSTD_DCtx, FreeDCtx> dctx(ZSTD_createDCtx());
  if (!dctx) return Status::ResourceExhausted("cannot allocate a zstd decompression context");
  size_t n = ZSTD_decompressDCtx(dctx.get(), out.data(), out.size(), in.data(), in.size());
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
      CKPT_RETURN_IF_ERROR(d.U8(&width));
      CKPT_RETURN_IF_ERROR(d.U8(&mask));
      if (width != 2 && width != 4 && width != 8) {
        return Status::Corruption("byte-grouped chunk has element width " + std::to_string(width));
      }
      if (width < 8 && (mask >> width) != 0) {
        return Status::Corruption("byte-grouped chunk marks planes beyond its width");
      }
      uint32_t sizes[8];
      uint64_t total = 2 + 4 * width;
      for (int b = 0; b < width; ++b) {
        CKPT_RETURN_IF_ERROR(d.U32(&sizes[b]));
        total += sizes[b];
      }
      const size_t n = raw.size() / width;
      const size_t tail = raw.size() - n * width;
      if (total + tail != stored.size()) {
        return Status::Corruption("byte-grouped chunk sizes do not add up");
      }
      // Compressed planes decode into this thread's scratch (reused, never
      // zero-filled); raw planes are used in place.
      thread_local ScratchBuffer decoded_buffer, join_buffer;
      std::byte* decoded = decoded_buffer.Reserve(n * width);
      std::byte* join_tmp = width == 8 ? join_buffer.Reserve(8 * n) : nullptr;  // only 8-byte joins need it
      const uint8_t* plane_ptr[8];
      const std::byte* p = stored.data() + 2 + 4 * width;
      for (int b = 0; b < width; ++b) {
        if (mask & (1u << b)) {
          std::span<std::byte> plane(decoded + b * n, n);
          CKPT_RETURN_IF_ERROR(ZstdDecode({p, sizes[b]}, plane));
          plane_ptr[b] = reinterpret_cast<const uint8_t*>(plane.data());
        } else {
          if (sizes[b] != n) return Status::Corruption("raw plane has the wrong size");
          plane_ptr[b] = reinterpret_cast<const uint8_t*>(p);
        }
        p += sizes[b];
      }
      auto* dst = reinterpret_cast<uint8_t*>(raw.data());
      JoinPlanes(plane_ptr, n, width, dst, reinterpret_cast<uint8_t*>(join_tmp));
      if (tail) std::memcpy(dst + n * width, p, tail);
      return Status::OK();
    }
  }
  return Status::Corruption("unknown codec " + std::to_string(static_cast<int>(codec)));
}

}  // namespace ckptfs
