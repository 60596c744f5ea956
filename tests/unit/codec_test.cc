#include "codec/codec.h"

#include <gtest/gtest.h>

#include <thread>

#include <cmath>
#include <cstring>
#include <random>

namespace ckptfs {
namespace {

std::vector<std::byte> Normal(size_t bytes, DType dtype, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0, 0.02f);
  std::vector<std::byte> out(bytes);
  const uint32_t w = DTypeSize(dtype);
  for (size_t i = 0; i + w <= bytes; i += w) {
    float f = nd(rng);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if (w == 2) {
      uint16_t h = static_cast<uint16_t>(u >> 16);
      std::memcpy(&out[i], &h, 2);
    } else if (w == 4) {
      std::memcpy(&out[i], &f, 4);
    } else if (w == 8) {
      double d = f;
      std::memcpy(&out[i], &d, 8);
    } else {
      out[i] = static_cast<std::byte>(u >> 24);
    }
  }
  return out;
}

std::vector<std::byte> RoundTrip(const std::vector<std::byte>& raw, DType dtype, Codec* used, size_t* stored,
                                 CodecOptions opts = {}) {
  ChunkEncoder enc(opts);
  std::string out;
  auto codec = enc.Encode(raw, dtype, &out);
  EXPECT_TRUE(codec.ok());
  *used = *codec;
  *stored = out.size();
  std::vector<std::byte> back(raw.size());
  Status st = DecodeChunk(*codec, std::as_bytes(std::span(out)), back);
  EXPECT_TRUE(st.ok()) << st.ToString();
  return back;
}

TEST(Codec, EveryDTypeRoundTripsBitExact) {
  for (int code = 0; code < kDTypeCount; ++code) {
    DType dt = *DTypeFromCode(code);
    for (size_t size : {size_t{0}, size_t{8}, size_t{1000}, size_t{1 << 20}}) {
      auto raw = Normal(size, dt, code);
      Codec used;
      size_t stored;
      EXPECT_EQ(RoundTrip(raw, dt, &used, &stored), raw) << DTypeName(dt) << " " << size;
    }
  }
}

// The encoder splits 2- and 4-byte elements with every plane but the last
// already in its place in the output. Planes that compress anywhere, raw
// planes after a compressed one (moved down), odd tails, chunks too small
// to split in place, and a size just short of the header: each round trips,
// and the stored form is the layout DecodeChunk reads.
TEST(Codec, PlanesCompressedOrRawInAnyPositionRoundTrip) {
  std::mt19937 rng(11);
  for (DType dt : {DType::kBF16, DType::kF32}) {
    const uint32_t w = DTypeSize(dt);
    for (uint32_t pattern = 1; pattern < (1u << w); ++pattern) {  // bit b: plane b is constant
      for (size_t n : {size_t{5}, size_t{17}, size_t{18}, size_t{33}, size_t{34}, size_t{35}, size_t{4096}}) {
        for (size_t tail : {size_t{0}, size_t{w - 1}}) {
          std::vector<std::byte> raw(n * w + tail);
          for (size_t i = 0; i < raw.size(); ++i) {
            const bool constant = i < n * w && (pattern >> (i % w)) & 1;
            raw[i] = static_cast<std::byte>(constant ? 0x3c : rng());
          }
          Codec used;
          size_t stored;
          EXPECT_EQ(RoundTrip(raw, dt, &used, &stored), raw)
              << DTypeName(dt) << " planes " << pattern << " n " << n << " tail " << tail;
          EXPECT_LE(stored, raw.size());
          if (n == 4096) {
            EXPECT_EQ(used, Codec::kByteGroupZstd) << DTypeName(dt) << " planes " << pattern;
            // Each constant plane shrinks to a few bytes; the others are kept.
            const size_t constant = static_cast<size_t>(__builtin_popcount(pattern));
            EXPECT_LT(stored, (w - constant) * n + tail + 2 + 4 * w + constant * 64);
          }
        }
      }
    }
  }
}

TEST(Codec, Bf16WeightsShrinkWithByteGrouping) {
  auto raw = Normal(4 << 20, DType::kBF16, 1);
  Codec used;
  size_t stored;
  EXPECT_EQ(RoundTrip(raw, DType::kBF16, &used, &stored), raw);
  EXPECT_EQ(used, Codec::kByteGroupZstd);
  EXPECT_LT(stored, raw.size() * 0.75);
}

TEST(Codec, IncompressibleDataIsStoredRaw) {
  std::mt19937 rng(3);
  std::vector<std::byte> raw(1 << 20);
  for (auto& b : raw) b = static_cast<std::byte>(rng());
  Codec used;
  size_t stored;
  EXPECT_EQ(RoundTrip(raw, DType::kU8, &used, &stored), raw);
  EXPECT_EQ(used, Codec::kRaw);
  EXPECT_EQ(stored, raw.size());
  EXPECT_EQ(RoundTrip(raw, DType::kF32, &used, &stored), raw);
  EXPECT_EQ(used, Codec::kRaw);
}

TEST(Codec, ZerosCompressWithEveryCodecPath) {
  std::vector<std::byte> raw(1 << 20);
  Codec used;
  size_t stored;
  EXPECT_EQ(RoundTrip(raw, DType::kI64, &used, &stored), raw);
  EXPECT_EQ(used, Codec::kZstd);
  EXPECT_LT(stored, 1000u);
  CodecOptions high;
  high.level = 9;  // not the entropy-only mode
  EXPECT_EQ(RoundTrip(raw, DType::kF16, &used, &stored, high), raw);
  EXPECT_EQ(used, Codec::kByteGroupZstd);
}

TEST(Codec, CompressionNoneStoresRaw) {
  auto raw = Normal(1 << 16, DType::kBF16, 2);
  CodecOptions none;
  none.compression = Compression::kNone;
  Codec used;
  size_t stored;
  EXPECT_EQ(RoundTrip(raw, DType::kBF16, &used, &stored, none), raw);
  EXPECT_EQ(used, Codec::kRaw);
}

TEST(Codec, CorruptInputIsReportedNotDecodedWrong) {
  auto raw = Normal(1 << 16, DType::kBF16, 5);
  ChunkEncoder enc({});
  std::string out;
  ASSERT_EQ(*enc.Encode(raw, DType::kBF16, &out), Codec::kByteGroupZstd);
  std::vector<std::byte> back(raw.size());
  // Truncated, wrong sizes, garbage: never OK with the wrong bytes.
  std::string truncated = out.substr(0, out.size() / 2);
  EXPECT_TRUE(DecodeChunk(Codec::kByteGroupZstd, std::as_bytes(std::span(truncated)), back).IsCorruption());
  std::string bad_width = out;
  bad_width[0] = 3;
  EXPECT_TRUE(DecodeChunk(Codec::kByteGroupZstd, std::as_bytes(std::span(bad_width)), back).IsCorruption());
  std::vector<std::byte> wrong_len(raw.size() + 2);
  EXPECT_FALSE(DecodeChunk(Codec::kByteGroupZstd, std::as_bytes(std::span(out)), wrong_len).ok());
  std::string garbage(100, 'x');
  EXPECT_TRUE(DecodeChunk(Codec::kZstd, std::as_bytes(std::span(garbage)), back).IsCorruption());
  EXPECT_TRUE(DecodeChunk(static_cast<Codec>(9), std::as_bytes(std::span(garbage)), back).IsCorruption());
}

TEST(Codec, EntropyEstimate) {
  std::vector<std::byte> zeros(1 << 16);
  EXPECT_LT(EstimateEntropyRatio(zeros), 0.01);
  std::mt19937 rng(1);
  std::vector<std::byte> noise(1 << 20);
  for (auto& b : noise) b = static_cast<std::byte>(rng());
  EXPECT_GT(EstimateEntropyRatio(noise), 0.98);
}

// The estimate as first written (a division per byte), kept as the
// reference the counting by whole records must match exactly.
double EstimateSavingReference(std::span<const std::byte> data, DType dtype, double min_saving) {
  if (data.empty()) return 0;
  const uint32_t width = PreferredCodec(dtype) == Codec::kByteGroupZstd ? DTypeSize(dtype) : 1;
  constexpr size_t kWindow = 4096, kWindows = 16;
  uint32_t hist[8][256] = {};
  size_t counted[8] = {};
  const auto* base = reinterpret_cast<const uint8_t*>(data.data());
  auto add = [&](size_t off, size_t len) {
    off -= off % width;
    for (size_t i = 0; i < len && off + i < data.size(); ++i) {
      size_t pos = (off + i) % width;
      ++hist[pos][base[off + i]];
      ++counted[pos];
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

TEST(Codec, SavingEstimateMatchesTheReferenceForEveryWidthAndLength) {
  const DType dtypes[] = {DType::kU8, DType::kI8, DType::kF16, DType::kBF16, DType::kF32, DType::kF64};
  // Lengths below, at and above one sample, and ones that end inside a
  // record or make the windows start off a record.
  const size_t lengths[] = {1, 3, 7, 4096, 65535, 65536, 65537, 65536 * 3 + 5, (1u << 20) + 3, (4u << 20) + 6};
  for (DType dtype : dtypes) {
    for (size_t n : lengths) {
      for (uint32_t seed : {1u, 2u}) {
        std::vector<std::byte> data = Normal(n, dtype, seed);
        if (seed == 2) {  // half noise: planes that save and planes that do not
          std::mt19937 rng(n);
          for (size_t i = 0; i < n; i += 2) data[i] = static_cast<std::byte>(rng());
        }
        for (double min_saving : {0.0, 0.05}) {
          EXPECT_EQ(EstimateSaving(data, dtype, min_saving), EstimateSavingReference(data, dtype, min_saving))
              << DTypeName(dtype) << " " << n << " " << seed << " " << min_saving;
        }
      }
    }
  }
}

TEST(Codec, DecodingOnShortLivedThreadsLeaksNothing) {
  // Each thread's zstd context is freed when the thread exits; the ASan
  // stage's leak check fails this test otherwise.
  ChunkEncoder enc({});
  std::vector<std::byte> raw(1 << 16, std::byte{7});
  std::string stored;
  const Codec codec = *enc.Encode(raw, DType::kU8, &stored);
  ASSERT_EQ(codec, Codec::kZstd);
  for (int i = 0; i < 8; ++i) {
    std::thread([&] {
      std::vector<std::byte> back(raw.size());
      EXPECT_TRUE(DecodeChunk(codec, std::as_bytes(std::span(stored)), back).ok());
      EXPECT_EQ(back, raw);
    }).join();
  }
}

TEST(Codec, ByteGroupedPlaneMaskBeyondTheWidthIsCorrupt) {
  ChunkEncoder enc({});
  std::vector<std::byte> raw(4096);
  for (size_t i = 0; i < raw.size(); ++i) raw[i] = static_cast<std::byte>(i % 2 ? 0x3f : (i * 7) & 0xff);
  std::string stored;
  ASSERT_EQ(*enc.Encode(raw, DType::kBF16, &stored), Codec::kByteGroupZstd);
  stored[1] = static_cast<char>(stored[1] | 0x80);  // plane 7 of a 2-byte type
  std::vector<std::byte> back(raw.size());
  EXPECT_TRUE(DecodeChunk(Codec::kByteGroupZstd, std::as_bytes(std::span(stored)), back).IsCorruption());
}

}  // namespace
}  // namespace ckptfs
