// A small repository with one checkpoint of varied tensors, built the same
// way every time: the structure-aware target mutates its pack, and the seed
// generator writes that pack as the target's seed.
#pragma once

#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "ckpt/repository.h"

namespace ckptfs::fuzz {

struct SmallRepository {
  std::string path;
  std::string pack_file;  // the only pack
  std::map<std::string, std::vector<std::byte>> tensors;  // name -> whole bytes
  std::map<std::string, std::vector<std::byte>> blobs;
};

inline std::vector<std::byte> Bytes(size_t n, uint32_t seed, int mode) {
  std::vector<std::byte> v(n);
  uint32_t x = seed;
  for (size_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    uint8_t b = mode == 0 ? static_cast<uint8_t>(x >> 24)                          // noise: stored raw
                          : mode == 1 ? static_cast<uint8_t>((i % 2) ? 0x3c + (x >> 30) : x >> 24)  // bf16-like
                                      : static_cast<uint8_t>(i / 7);               // repetitive: zstd
    v[i] = static_cast<std::byte>(b);
  }
  return v;
}

// Creates the repository under `dir` (which must not exist). Aborts on error:
// the harness cannot run without it.
inline SmallRepository MakeSmallRepository(const std::string& dir) {
  SmallRepository r;
  r.path = dir;
  RepositoryConfig config;
  config.chunk_size = 64 << 10;
  config.adaptive = false;  // every chunk compressed where it pays: same bytes every run
  auto check = [](const Status& st) {
    if (!st.ok()) {
      std::fprintf(stderr, "building the fuzz repository: %s\n", st.ToString().c_str());
      std::abort();
    }
  };
  check(Repository::Init(dir, config));
  auto repo = Repository::Open(dir, OpenOptions{1, 0});
  check(repo.status());
  auto w = (*repo)->BeginCheckpoint("c", {});
  check(w.status());
  struct T {
    const char* name;
    DType dtype;
    Shape shape;
    int mode;
  };
  const T whole[] = {{"w", DType::kBF16, {48, 64}, 1}, {"b", DType::kF32, {300}, 0}, {"ids", DType::kI32, {400}, 2},
                     {"s", DType::kF64, {}, 0}};
  uint32_t seed = 1;
  for (const T& t : whole) {
    auto data = Bytes(NumElements(t.shape) * DTypeSize(t.dtype), seed++, t.mode);
    check((*w)->PutTensor({t.name, t.dtype, t.shape}, data));
    r.tensors[t.name] = std::move(data);
  }
  // A tensor saved as two column halves (box shards), merged on read.
  const Shape shape = {16, 40};
  auto m = Bytes(16 * 40 * 2, seed++, 1);
  for (uint64_t half = 0; half < 2; ++half) {
    std::vector<std::byte> part;
    for (uint64_t row = 0; row < 16; ++row) {
      const std::byte* src = m.data() + (row * 40 + half * 20) * 2;
      part.insert(part.end(), src, src + 40);
    }
    HostSource source(part);
    check((*w)->PutShard({"m", DType::kF16, shape}, Region::OfBox(Box{{0, half * 20}, {16, 20}}), source));
  }
  r.tensors["m"] = std::move(m);
  r.blobs["rng"] = Bytes(300, seed++, 2);
  check((*w)->PutBlob("rng", r.blobs["rng"]));
  check((*w)->Commit().Wait().status());
  for (const auto& e : std::filesystem::directory_iterator(dir + "/objects/packs")) r.pack_file = e.path();
  if (r.pack_file.empty()) std::abort();
  return r;
}

}  // namespace ckptfs::fuzz
