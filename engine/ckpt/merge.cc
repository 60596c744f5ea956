// The commit merge (merge.h).
#include "ckpt/merge.h"

#include <algorithm>
#include <map>
#include <unordered_map>
#include <unordered_set>

#include "ckpt/read_plan.h"

namespace ckptfs {
namespace {

std::string RanksToString(const std::vector<uint32_t>& ranks) {
  std::string s = ranks.size() > 1 ? "ranks " : "rank ";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? "," : "") + std::to_string(ranks[i]);
  return s;
}

TensorRecord OnlyShard(const TensorRecord& t, const ShardRecord& s) {
  TensorRecord one{t.name, t.dtype, t.shape, {s}};
  return one;
}

// Compares the bytes two shards hold for `box`.
Status CompareOverlap(const TensorRecord& t, const ShardRecord& a, const ShardRecord& b,
                      const Box& box, ChunkFetcher& fetcher) {
  const size_t n = box.NumElements() * DTypeSize(t.dtype);
  std::vector<std::byte> x(n), y(n);
  CKPT_RETURN_IF_ERROR(ReadTensorBox(OnlyShard(t, a), box, x, fetcher, nullptr));
  CKPT_RETURN_IF_ERROR(ReadTensorBox(OnlyShard(t, b), box, y, fetcher, nullptr));
  if (x != y) {
    return Status::InvalidArgument("tensor '" + t.name + "': shards of " + RanksToString(a.ranks) +
                                   " (" + a.region.ToString() + ") and " + RanksToString(b.ranks) +
                                   " (" + b.region.ToString() + ") overlap at " + box.ToString() +
                                   " with different bytes");
  }
  return Status::OK();
}

// Regions as keys: the merge finds a region's earlier replica among a
// tensor's shards (thousands, for tiles) by hashing, not by walking them.
struct RegionHash {
  size_t operator()(const Region& r) const {
    uint64_t h = 0x9e3779b97f4a7c15ULL * (static_cast<uint64_t>(r.kind) + 1);
    auto mix = [&h](uint64_t v) { h = (h ^ v) * 0xff51afd7ed558ccdULL; h ^= h >> 32; };
    if (r.kind == Region::Kind::kFlat) {
      mix(r.flat.start);
      mix(r.flat.end);
    } else {
      for (uint64_t v : r.box.offsets) mix(v);
      for (uint64_t v : r.box.lengths) mix(v);
    }
    return static_cast<size_t>(h);
  }
};

// Whether two of the tensor's shards overlap, found through its ShardIndex:
// a tensor saved as grid tiles has thousands of shards, which the walk of
// every pair in CheckTiling would take quadratic time over.
bool AnyOverlap(const TensorRecord& t) {
  const ShardIndex index(t);
  std::vector<std::vector<Box>> boxes;
  boxes.reserve(t.shards.size());
  for (const ShardRecord& s : t.shards) boxes.push_back(RegionToBoxes(t.shape, s.region));
  std::vector<size_t> candidates;
  for (size_t i = 0; i < boxes.size(); ++i) {
    for (const Box& b : boxes[i]) {
      index.Candidates(b, candidates);
      // Meeting is symmetric: each pair once, from its first shard.
      for (size_t j : candidates) {
        if (j <= i) continue;
        for (const Box& o : boxes[j]) {
          if (Intersect(b, o)) return true;
        }
      }
    }
  }
  return false;
}

Status GapError(const TensorRecord& t, const std::string& where, uint64_t missing) {
  return Status::InvalidArgument("tensor '" + t.name + "' " + ShapeToString(t.shape) +
                                 " is not fully covered by its shards: " + std::to_string(missing) +
                                 " elements missing, first at " + where);
}

}  // namespace

Status CheckTiling(const TensorRecord& t, ChunkFetcher& fetcher) {
  CKPT_ASSIGN_OR_RETURN(const uint64_t total, CheckedNumElements(t.shape));
  const uint64_t w = DTypeSize(t.dtype);
  for (const auto& s : t.shards) {
    CKPT_RETURN_IF_ERROR(ValidateRegion(t.shape, s.region).WithContext("tensor '" + t.name + "'"));
    if (s.ByteSize() != s.region.NumElements() * w) {
      return Status::Corruption("tensor '" + t.name + "': shard " + s.region.ToString() + " holds " +
                                std::to_string(s.ByteSize()) + " bytes, expected " +
                                std::to_string(s.region.NumElements() * w));
    }
  }
  if (total == 0) return Status::OK();

  bool all_flat = std::all_of(t.shards.begin(), t.shards.end(),
                              [](const ShardRecord& s) { return s.region.kind == Region::Kind::kFlat; });
  if (all_flat) {
    std::vector<const ShardRecord*> order;
    for (const auto& s : t.shards) {
      if (s.region.flat.size() > 0) order.push_back(&s);
    }
    std::sort(order.begin(), order.end(), [](const ShardRecord* a, const ShardRecord* b) {
      return std::pair(a->region.flat.start, a->region.flat.end) < std::pair(b->region.flat.start, b->region.flat.end);
    });
    uint64_t covered_to = 0;
    const ShardRecord* reach = nullptr;  // the shard that reaches covered_to
    for (const ShardRecord* s : order) {
      const FlatRange r = s->region.flat;
      if (r.start > covered_to) {
        return GapError(t, "flat index " + std::to_string(covered_to), r.start - covered_to);
      }
      if (r.start < covered_to && reach != nullptr) {
        FlatRange both{r.start, std::min(covered_to, r.end)};
        for (const Box& b : FlatRangeToBoxes(t.shape, both)) {
          CKPT_RETURN_IF_ERROR(CompareOverlap(t, *reach, *s, b, fetcher));
        }
      }
      if (r.end > covered_to) {
        covered_to = r.end;
        reach = s;
      }
    }
    if (covered_to < total) return GapError(t, "flat index " + std::to_string(covered_to), total - covered_to);
    return Status::OK();
  }

  // Shards that do not overlap (tiles, one box per rank) cover the tensor
  // when their sizes add up to it.
  if (!AnyOverlap(t)) {
    uint64_t sum = 0;
    for (const auto& s : t.shards) sum += s.region.NumElements();
    if (sum == total) return Status::OK();
  }
  // General case (and where a gap is, for the error): keep a list of
  // disjoint covered boxes, each owned by the shard that first covered it.
  struct Covered {
    Box box;
    const ShardRecord* shard;
  };
  std::vector<Covered> covered;
  for (const auto& s : t.shards) {
    for (const Box& b : RegionToBoxes(t.shape, s.region)) {
      std::vector<Box> pieces = {b};
      for (const Covered& c : covered) {
        std::vector<Box> next;
        for (const Box& p : pieces) {
          if (auto inter = Intersect(p, c.box)) {
            CKPT_RETURN_IF_ERROR(CompareOverlap(t, *c.shard, s, *inter, fetcher));
            for (Box& rest : Subtract(p, c.box)) next.push_back(std::move(rest));
          } else {
            next.push_back(p);
          }
        }
        pieces = std::move(next);
        if (pieces.empty()) break;
      }
      for (Box& p : pieces) covered.push_back({std::move(p), &s});
    }
  }
  uint64_t sum = 0;
  for (const auto& c : covered) sum += c.box.NumElements();
  if (sum != total) {
    std::vector<Box> gaps = {FullBox(t.shape)};
    for (const auto& c : covered) {
      std::vector<Box> next;
      for (const Box& g : gaps) {
        for (Box& rest : Subtract(g, c.box)) next.push_back(std::move(rest));
      }
      gaps = std::move(next);
      if (gaps.empty() || gaps.size() > 100000) break;
    }
    return GapError(t, gaps.empty() ? "?" : gaps.front().ToString(), total - sum);
  }
  return Status::OK();
}

Status CheckTensorsAgree(const std::vector<RankRecord>& ranks) {
  std::map<std::string, std::pair<const TensorRecord*, uint32_t>> first;  // by name: record, rank
  for (const RankRecord& r : ranks) {
    for (const TensorRecord& t : r.tensors) {
      auto [it, inserted] = first.try_emplace(t.name, &t, r.rank);
      const TensorRecord& f = *it->second.first;
      if (!inserted && (f.dtype != t.dtype || f.shape != t.shape)) {
        return Status::InvalidArgument("tensor '" + t.name + "': rank " + std::to_string(r.rank) + " saved it as " +
                                       std::string(DTypeName(t.dtype)) + " " + ShapeToString(t.shape) + " but rank " +
                                       std::to_string(it->second.second) + " as " + std::string(DTypeName(f.dtype)) +
                                       " " + ShapeToString(f.shape));
      }
    }
  }
  return Status::OK();
}

Result<std::vector<TensorRecord>> MergeRankTensors(const std::vector<RankRecord>& ranks,
                                                   ChunkFetcher& fetcher) {
  CKPT_RETURN_IF_ERROR(CheckTensorsAgree(ranks));
  std::map<std::string, TensorRecord> merged;
  std::map<std::string, std::unordered_map<Region, size_t, RegionHash>> regions;  // by tensor: shard index
  // Ranks in rank order, whatever order they committed in: the merged
  // records are the same for the same inputs.
  std::vector<const RankRecord*> ordered;
  for (const RankRecord& r : ranks) ordered.push_back(&r);
  std::sort(ordered.begin(), ordered.end(), [](const RankRecord* a, const RankRecord* b) { return a->rank < b->rank; });
  for (const RankRecord* rank_ptr : ordered) {
    const RankRecord& rank = *rank_ptr;
    for (const TensorRecord& t : rank.tensors) {
      auto [it, inserted] = merged.try_emplace(t.name);
      TensorRecord& m = it->second;
      if (inserted) m = TensorRecord{t.name, t.dtype, t.shape, {}};
      auto& where = regions[t.name];
      for (const ShardRecord& s : t.shards) {
        auto [at, fresh] = where.try_emplace(s.region, m.shards.size());
        if (fresh) {
          ShardRecord copy = s;
          copy.ranks = {rank.rank};
          m.shards.push_back(std::move(copy));
          continue;
        }
        ShardRecord* same = &m.shards[at->second];
        if (same->chunks == s.chunks) {
          if (std::find(same->ranks.begin(), same->ranks.end(), rank.rank) == same->ranks.end()) {
            same->ranks.push_back(rank.rank);
          }
        } else {
          return Status::InvalidArgument("tensor '" + t.name + "': " + RanksToString(same->ranks) +
                                         (same->ranks == std::vector<uint32_t>{rank.rank} ? " (twice)" : " and rank " + std::to_string(rank.rank)) +
                                         " saved different bytes for the same region " +
                                         s.region.ToString());
        }
      }
    }
  }
  std::vector<TensorRecord> out;
  out.reserve(merged.size());
  for (auto& [name, t] : merged) {
    CKPT_RETURN_IF_ERROR(CheckTiling(t, fetcher));
    out.push_back(std::move(t));
  }
  return out;
}

Result<std::vector<BlobRecord>> MergeRankBlobs(const std::vector<RankRecord>& ranks) {
  std::map<std::string, BlobRecord> merged;
  for (const RankRecord& rank : ranks) {
    for (const BlobRecord& b : rank.blobs) {
      auto [it, inserted] = merged.try_emplace(b.name, b);
      if (!inserted && (it->second.size != b.size || it->second.chunks != b.chunks)) {
        return Status::InvalidArgument("blob '" + b.name + "': rank " + std::to_string(rank.rank) +
                                       " saved different bytes than another rank");
      }
    }
  }
  std::vector<BlobRecord> out;
  for (auto& [name, b] : merged) out.push_back(std::move(b));
  return out;
}

}  // namespace ckptfs
