#include "ckpt/merge.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

namespace ckptfs {
namespace {

struct CopyOp {
  uint64_t chunk_offset;  // within the decoded chunk
  uint64_t length;
  uint64_t dst_offset;
};

struct ChunkGroup {
  const ShardRecord* shard;
  size_t chunk;
  std::vector<CopyOp> ops;
};

std::string RanksToString(const std::vector<uint32_t>& ranks) {
  std::string s = ranks.size() > 1 ? "ranks " : "rank ";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? "," : "") + std::to_string(ranks[i]);
  return s;
}

// Appends the ops that copy stream bytes [src, src + len) of `shard` to dst.
void PlanStreamCopy(const ShardRecord& shard, uint64_t src, uint64_t len, uint64_t dst,
                    std::vector<ChunkGroup>& groups,
                    std::unordered_map<uint64_t, size_t>& group_of, size_t shard_index) {
  const auto& st = shard.starts;
  size_t k = static_cast<size_t>(std::upper_bound(st.begin(), st.end(), src) - st.begin()) - 1;
  while (len > 0) {
    uint64_t in_chunk = src - st[k];
    uint64_t n = std::min<uint64_t>(len, st[k + 1] - src);
    uint64_t key = (static_cast<uint64_t>(shard_index) << 40) | k;
    auto [it, inserted] = group_of.try_emplace(key, groups.size());
    if (inserted) groups.push_back(ChunkGroup{&shard, k, {}});
    groups[it->second].ops.push_back(CopyOp{in_chunk, n, dst});
    src += n;
    dst += n;
    len -= n;
    ++k;
  }
}

Status RunGroup(const ChunkGroup& g, std::span<std::byte> dst, ChunkFetcher& fetcher) {
  const ChunkRef& ref = g.shard->chunks[g.chunk];
  if (g.ops.size() == 1 && g.ops[0].chunk_offset == 0 && g.ops[0].length == ref.raw_len) {
    return fetcher.FetchInto(ref, dst.subspan(g.ops[0].dst_offset, ref.raw_len));
  }
  CKPT_ASSIGN_OR_RETURN(ChunkData data, fetcher.Fetch(ref));
  uint64_t copied = 0;
  for (const CopyOp& op : g.ops) {
    std::memcpy(dst.data() + op.dst_offset, data->data() + op.chunk_offset, op.length);
    copied += op.length;
  }
  fetcher.Consumed(ref, copied);
  return Status::OK();
}

}  // namespace

Status ChunkFetcher::FetchInto(const ChunkRef& chunk, std::span<std::byte> dst) {
  CKPT_ASSIGN_OR_RETURN(ChunkData data, Fetch(chunk));
  if (data->size() != dst.size()) return Status::Internal("chunk size does not match its destination");
  std::memcpy(dst.data(), data->data(), dst.size());
  return Status::OK();
}

namespace {

// Plans the copies that fill `request` (row-major, starting `dst_base`
// bytes into the destination) from the tensor's shards.
Status PlanBox(const TensorRecord& tensor, const Box& request, std::vector<ChunkGroup>& groups,
               uint64_t dst_base = 0) {
  const uint64_t w = DTypeSize(tensor.dtype);
  std::unordered_map<uint64_t, size_t> group_of;
  const LinearSpace dst_space = SpaceOfBox(request);
  // Parts of the request not yet planned; each element is copied once even
  // where shards overlap.
  std::vector<Box> remaining = {request};
  for (size_t si = 0; si < tensor.shards.size() && !remaining.empty(); ++si) {
    const ShardRecord& shard = tensor.shards[si];
    const LinearSpace src_space = SpaceOfRegion(tensor.shape, shard.region);
    for (const Box& sb : RegionToBoxes(tensor.shape, shard.region)) {
      std::vector<Box> next;
      for (const Box& r : remaining) {
        auto piece = Intersect(sb, r);
        if (!piece) {
          next.push_back(r);
          continue;
        }
        ForEachRun(*piece, src_space, dst_space, [&](uint64_t s, uint64_t d, uint64_t n) {
          PlanStreamCopy(shard, s * w, n * w, dst_base + d * w, groups, group_of, si);
        });
        for (Box& rest : Subtract(r, sb)) next.push_back(std::move(rest));
      }
      remaining = std::move(next);
    }
  }
  if (!remaining.empty()) {
    return Status::Corruption("tensor '" + tensor.name + "': no stored shard covers " +
                              remaining.front().ToString());
  }
  return Status::OK();
}

// Plans elements [first, end) of the tensor's row-major image, the
// destination starting at element `first`.
Status PlanElements(const TensorRecord& tensor, uint64_t first, uint64_t end, std::vector<ChunkGroup>& groups) {
  const uint64_t w = DTypeSize(tensor.dtype);
  for (const Box& box : FlatRangeToBoxes(tensor.shape, {first, end})) {
    CKPT_RETURN_IF_ERROR(PlanBox(tensor, box, groups, (FlatIndexOf(tensor.shape, box.offsets) - first) * w));
  }
  return Status::OK();
}

}  // namespace

Status ReadTensorBox(const TensorRecord& tensor, const Box& request, std::span<std::byte> dst,
                     ChunkFetcher& fetcher, ThreadPool* pool) {
  const uint64_t w = DTypeSize(tensor.dtype);
  CKPT_RETURN_IF_ERROR(ValidateRegion(tensor.shape, Region::OfBox(request)));
  if (dst.size() != request.NumElements() * w) {
    return Status::InvalidArgument("destination of " + std::to_string(dst.size()) +
                                   " bytes does not match box " + request.ToString());
  }
  if (request.Empty()) return Status::OK();
  std::vector<ChunkGroup> groups;
  CKPT_RETURN_IF_ERROR(PlanBox(tensor, request, groups));

  // Small reads (a FUSE request) run inline: their callers are already
  // concurrent, and prefetching has usually decoded their chunks.
  constexpr uint64_t kParallelMinBytes = 8 << 20;
  if (pool == nullptr || groups.size() <= 1 || ThreadPool::OnPoolThread() || dst.size() < kParallelMinBytes) {
    for (const auto& g : groups) CKPT_RETURN_IF_ERROR(RunGroup(g, dst, fetcher));
    return Status::OK();
  }
  WaitGroup wg;
  std::mutex mu;
  Status first_error;
  wg.Add(groups.size());
  for (const auto& g : groups) {
    pool->Submit([&, gp = &g] {
      Status st = RunGroup(*gp, dst, fetcher);
      if (!st.ok()) {
        std::lock_guard lock(mu);
        if (first_error.ok()) first_error = st;
      }
      wg.Done();
    });
  }
  wg.Wait();
  return first_error;
}

Status ReadTensorBytes(const TensorRecord& tensor, uint64_t offset, std::span<std::byte> dst,
                       ChunkFetcher& fetcher, ThreadPool* pool) {
  const uint64_t w = DTypeSize(tensor.dtype);
  const uint64_t total = tensor.ByteSize();
  if (offset > total || dst.size() > total - offset) {
    return Status::InvalidArgument("byte range past the end of tensor '" + tensor.name + "'");
  }
  if (dst.empty()) return Status::OK();
  const uint64_t first = offset / w;
  const uint64_t end = (offset + dst.size() + w - 1) / w;
  const bool aligned = offset % w == 0 && dst.size() % w == 0;
  std::vector<std::byte> staging;
  std::span<std::byte> out = dst;
  if (!aligned) {
    staging.resize((end - first) * w);
    out = staging;
  }
  for (const Box& box : FlatRangeToBoxes(tensor.shape, {first, end})) {
    uint64_t at = (FlatIndexOf(tensor.shape, box.offsets) - first) * w;
    CKPT_RETURN_IF_ERROR(ReadTensorBox(tensor, box, out.subspan(at, box.NumElements() * w), fetcher, pool));
  }
  if (!aligned) std::memcpy(dst.data(), staging.data() + (offset - first * w), dst.size());
  return Status::OK();
}

Result<bool> SliceTensorBytes(const TensorRecord& tensor, uint64_t offset, uint64_t length, ChunkFetcher& fetcher,
                              size_t max_slices, std::vector<ChunkSlice>& out) {
  const uint64_t w = DTypeSize(tensor.dtype);
  const uint64_t total = tensor.ByteSize();
  if (offset > total || length > total - offset) {
    return Status::InvalidArgument("byte range past the end of tensor '" + tensor.name + "'");
  }
  if (offset % w != 0 || length % w != 0) return false;
  if (length == 0) return true;
  struct Run {
    uint64_t dst;
    size_t group;
    uint64_t chunk_offset;
    uint64_t length;
  };
  std::vector<ChunkGroup> groups;
  CKPT_RETURN_IF_ERROR(PlanElements(tensor, offset / w, (offset + length) / w, groups));
  std::vector<Run> runs;
  for (size_t g = 0; g < groups.size(); ++g) {
    for (const CopyOp& op : groups[g].ops) {
      if (runs.size() == max_slices) return false;
      runs.push_back({op.dst_offset, g, op.chunk_offset, op.length});
    }
  }
  std::sort(runs.begin(), runs.end(), [](const Run& a, const Run& b) { return a.dst < b.dst; });
  // Each destination byte is planned exactly once, so sorted runs abut.
  uint64_t at = 0;
  for (const Run& r : runs) {
    if (r.dst != at) return Status::Internal("tensor '" + tensor.name + "': read plan has a hole");
    at += r.length;
  }
  if (at != length) return Status::Internal("tensor '" + tensor.name + "': read plan is short");
  std::vector<ChunkData> fetched(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) {
    CKPT_ASSIGN_OR_RETURN(fetched[g], fetcher.Fetch(groups[g].shard->chunks[groups[g].chunk]));
  }
  for (const Run& r : runs) {
    out.push_back({groups[r.group].shard->chunks[groups[r.group].chunk], fetched[r.group], r.chunk_offset, r.length});
  }
  return true;
}

Result<std::vector<ChunkRef>> ChunksForBytes(const TensorRecord& tensor, uint64_t offset, uint64_t length) {
  const uint64_t w = DTypeSize(tensor.dtype);
  const uint64_t total = tensor.ByteSize();
  std::vector<ChunkRef> out;
  if (offset >= total || length == 0) return out;
  length = std::min(length, total - offset);
  const uint64_t first = offset / w, end = (offset + length + w - 1) / w;
  std::vector<ChunkGroup> groups;
  CKPT_RETURN_IF_ERROR(PlanElements(tensor, first, end, groups));
  std::unordered_set<ChunkId, ChunkIdHash> seen;
  for (const auto& g : groups) {
    const ChunkRef& c = g.shard->chunks[g.chunk];
    if (seen.insert(c.id).second) out.push_back(c);
  }
  return out;
}

Status ReadBlobBytes(const BlobRecord& blob, uint64_t offset, std::span<std::byte> dst,
                     ChunkFetcher& fetcher) {
  if (offset > blob.size || dst.size() > blob.size - offset) {
    return Status::InvalidArgument("byte range past the end of blob '" + blob.name + "'");
  }
  uint64_t chunk_start = 0, done = 0;
  for (const ChunkRef& c : blob.chunks) {
    uint64_t chunk_end = chunk_start + c.raw_len;
    uint64_t pos = offset + done;
    if (done < dst.size() && pos < chunk_end) {
      CKPT_ASSIGN_OR_RETURN(ChunkData data, fetcher.Fetch(c));
      uint64_t n = std::min<uint64_t>(chunk_end - pos, dst.size() - done);
      std::memcpy(dst.data() + done, data->data() + (pos - chunk_start), n);
      fetcher.Consumed(c, n);
      done += n;
    }
    chunk_start = chunk_end;
  }
  if (done != dst.size()) return Status::Corruption("blob '" + blob.name + "' is shorter than recorded");
  return Status::OK();
}

namespace {

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

  // General case: keep a list of disjoint covered boxes, each owned by the
  // shard that first covered it.
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
      for (const ShardRecord& s : t.shards) {
        auto same = std::find_if(m.shards.begin(), m.shards.end(),
                                 [&](const ShardRecord& x) { return x.region == s.region; });
        if (same == m.shards.end()) {
          ShardRecord copy = s;
          copy.ranks = {rank.rank};
          m.shards.push_back(std::move(copy));
        } else if (same->chunks == s.chunks) {
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
