// The LLM-like training state the save/load benchmarks share: per layer a
// bf16 weight [2048, 4096] drawn from N(0, 0.02) and its fp32 Adam moments;
// and how ranks shard it (weights as column boxes, i.e. tensor parallel;
// moments as flat ranges cut at uneven points, i.e. ZeRO/FSDP).
#pragma once

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "bench_util.h"
#include "ckpt/repository.h"

namespace ckptfs::bench {

struct Tensor {
  TensorInfo info;
  std::vector<std::byte> bytes;
  bool is_weight;
};

inline std::vector<Tensor> BuildState(double gib) {
  // Per parameter: 2 bytes bf16 weight + 4 + 4 bytes of fp32 moments.
  const uint64_t cols = 4096;
  const uint64_t rows_per_tensor = 2048;
  const uint64_t params = static_cast<uint64_t>(gib * (1ull << 30) / 10);
  const uint64_t layers = std::max<uint64_t>(1, params / (rows_per_tensor * cols));
  std::vector<Tensor> state;
  Rng rng{12345};
  std::vector<float> tmp(rows_per_tensor * cols);
  for (uint64_t l = 0; l < layers; ++l) {
    const Shape shape = {rows_per_tensor, cols};
    const std::string base = "layers." + std::to_string(l) + ".mlp.weight";
    Tensor w{{base, DType::kBF16, shape}, std::vector<std::byte>(tmp.size() * 2), true};
    rng.Normals(tmp.data(), tmp.size(), 0.02f);
    for (size_t i = 0; i < tmp.size(); ++i) {
      uint16_t h = ToBf16(tmp[i]);
      std::memcpy(&w.bytes[2 * i], &h, 2);
    }
    Tensor m{{"optim." + base + ".exp_avg", DType::kF32, shape}, std::vector<std::byte>(tmp.size() * 4), false};
    rng.Normals(tmp.data(), tmp.size(), 1e-3f);
    std::memcpy(m.bytes.data(), tmp.data(), m.bytes.size());
    Tensor v{{"optim." + base + ".exp_avg_sq", DType::kF32, shape}, std::vector<std::byte>(tmp.size() * 4), false};
    rng.Normals(tmp.data(), tmp.size(), 1e-3f);
    for (auto& x : tmp) x *= x;
    std::memcpy(v.bytes.data(), tmp.data(), v.bytes.size());
    state.push_back(std::move(w));
    state.push_back(std::move(m));
    state.push_back(std::move(v));
  }
  return state;
}

// Weights are split by columns (tensor parallel, non-contiguous boxes);
// moments by flat ranges at uneven cuts (ZeRO/FSDP style).
inline Region RankRegion(const Tensor& t, int rank, int world) {
  const Shape& s = t.info.shape;
  if (t.is_weight) {
    uint64_t c0 = s[1] * rank / world, c1 = s[1] * (rank + 1) / world;
    return Region::OfBox(Box{{0, c0}, {s[0], c1 - c0}});
  }
  uint64_t n = NumElements(s);
  auto cut = [&](int r) -> uint64_t { return r == 0 ? 0 : r == world ? n : n * r / world + 12345 * r; };
  return Region::OfFlat(cut(rank), cut(rank + 1));
}

inline std::vector<std::byte> Extract(const Tensor& t, const Region& r) {
  const uint64_t w = DTypeSize(t.info.dtype);
  std::vector<std::byte> out(r.NumElements() * w);
  if (r.kind == Region::Kind::kFlat) {
    std::memcpy(out.data(), t.bytes.data() + r.flat.start * w, out.size());
    return out;
  }
  ForEachRun(r.box, SpaceOfBox(FullBox(t.info.shape)), SpaceOfBox(r.box), [&](uint64_t s, uint64_t d, uint64_t n) {
    std::memcpy(out.data() + d * w, t.bytes.data() + s * w, n * w);
  });
  return out;
}

// Rank r's own copies of its box shards (tensor parallel: each rank holds
// its columns in its own memory); empty for flat shards, which the rank
// reads in place from the state.
inline std::vector<std::vector<std::byte>> RankBoxes(const std::vector<Tensor>& state, int r, int world) {
  std::vector<std::vector<std::byte>> out;
  for (const auto& t : state) {
    Region region = RankRegion(t, r, world);
    out.push_back(region.kind == Region::Kind::kBox ? Extract(t, region) : std::vector<std::byte>{});
  }
  return out;
}

// Rank r of `world` saves its part of the state as checkpoint `name`.
inline void SaveRank(Repository& repo, const std::string& name, const std::vector<Tensor>& state,
                     const std::vector<std::vector<std::byte>>& boxes, int r, int world) {
  auto w = std::move(repo.BeginCheckpoint(name, {uint32_t(r), uint32_t(world), 1, {}})).value();
  for (size_t i = 0; i < state.size(); ++i) {
    const Tensor& t = state[i];
    Region region = RankRegion(t, r, world);
    const uint64_t e = DTypeSize(t.info.dtype);
    HostSource src(region.kind == Region::Kind::kFlat
                       ? std::span<const std::byte>(t.bytes.data() + region.flat.start * e, region.flat.size() * e)
                       : std::span<const std::byte>(boxes[i]));
    Check(w->PutShard(t.info, region, src), "put");
  }
  Check(w->Commit().Wait().status(), "commit");
}

// Rank r's destination buffers for a load at `world` (already allocated,
// as parameters are when load_state_dict runs).
inline std::vector<std::vector<std::byte>> RankBuffers(const std::vector<Tensor>& state, int r, int world) {
  std::vector<std::vector<std::byte>> out;
  for (const auto& t : state) {
    out.emplace_back(RankRegion(t, r, world).NumElements() * DTypeSize(t.info.dtype), std::byte{1});
  }
  return out;
}

// Rank r of `world` loads its part of every tensor into `out`.
inline void LoadRank(const CheckpointReader& reader, const std::vector<Tensor>& state, int r, int world,
                     std::vector<std::vector<std::byte>>& out) {
  for (size_t i = 0; i < state.size(); ++i) {
    const Tensor& t = state[i];
    Region region = RankRegion(t, r, world);
    const TensorRecord* rec = reader.FindTensor(t.info.name);
    if (region.kind == Region::Kind::kFlat) {
      Check(reader.ReadFlat(*rec, region.flat, out[i]), "load");
    } else {
      Check(reader.ReadBox(*rec, region.box, out[i]), "load");
    }
  }
}

// Whether every rank's buffers hold exactly its part of the state; names
// the first mismatch on stderr.
inline bool LoadedRight(const std::vector<Tensor>& state, const std::vector<std::vector<std::vector<std::byte>>>& loaded) {
  const int world = static_cast<int>(loaded.size());
  for (int r = 0; r < world; ++r) {
    for (size_t i = 0; i < state.size(); ++i) {
      if (loaded[r][i] != Extract(state[i], RankRegion(state[i], r, world))) {
        std::fprintf(stderr, "MISMATCH: rank %d tensor %s\n", r, state[i].info.name.c_str());
        return false;
      }
    }
  }
  return true;
}

}  // namespace ckptfs::bench
