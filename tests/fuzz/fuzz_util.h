// Helpers shared by the libFuzzer targets.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "ckpt/merge.h"
#include "ckpt/read_plan.h"
#include "meta/records.h"

namespace ckptfs::fuzz {

// Stops the run with a message: libFuzzer records the input as a crash.
[[noreturn]] inline void Fail(const char* what, const std::string& detail = "") {
  std::fprintf(stderr, "fuzz check failed: %s %s\n", what, detail.c_str());
  std::abort();
}

#define FUZZ_CHECK(cond, ...) \
  do {                        \
    if (!(cond)) ::ckptfs::fuzz::Fail(#cond, ##__VA_ARGS__); \
  } while (0)

inline std::string_view AsText(const uint8_t* data, size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

// Serves every chunk as raw_len bytes derived from its id, without a store:
// enough to drive the merge planner over a decoded record.
class PatternFetcher : public ChunkFetcher {
 public:
  Result<ChunkData> Fetch(const ChunkRef& chunk) override {
    auto buf = std::make_shared<ChunkBuffer>(chunk.raw_len);
    std::memset(buf->data(), chunk.id.bytes[0], buf->size());
    return ChunkData(std::move(buf));
  }
};

// Reads from a decoded (and so validated) tensor record the way cat, export
// and the mount do: whole, by box and by unaligned byte ranges. Records that
// would need much memory are skipped; the point is that planning never reads
// out of bounds, whatever the record says.
inline void ExerciseTensorReads(const TensorRecord& t) {
  constexpr uint64_t kMaxBytes = 1 << 20;
  uint64_t chunk_bytes = 0;
  for (const auto& s : t.shards) chunk_bytes += s.ByteSize();
  if (t.ByteSize() > kMaxBytes || chunk_bytes > kMaxBytes) return;
  PatternFetcher fetcher;
  std::string out(t.ByteSize(), '\0');
  std::span<std::byte> dst(reinterpret_cast<std::byte*>(out.data()), out.size());
  (void)ReadTensorBytes(t, 0, dst, fetcher, nullptr);
  (void)ReadTensorBox(t, FullBox(t.shape), dst, fetcher, nullptr);
  if (out.size() > 3) {
    (void)ReadTensorBytes(t, 1, dst.subspan(1, out.size() - 3), fetcher, nullptr);
    (void)ChunksForBytes(t, out.size() / 2, out.size());
  }
  (void)CheckTiling(t, fetcher);
}

inline void ExerciseBlobReads(const BlobRecord& b) {
  if (b.size > (1 << 20)) return;
  PatternFetcher fetcher;
  std::string out(b.size, '\0');
  (void)ReadBlobBytes(b, 0, std::as_writable_bytes(std::span(out)), fetcher);
}

}  // namespace ckptfs::fuzz
