// The read planner (read_plan.h).
#include "ckpt/read_plan.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <limits>
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


namespace {

// Plans the copies that fill `request` (row-major, starting `dst_base`
// bytes into the destination) from the tensor's shards: every shard, or
// those `index` says the request can meet.
Status PlanBox(const TensorRecord& tensor, const Box& request, std::vector<ChunkGroup>& groups,
               uint64_t dst_base = 0, const ShardIndex* index = nullptr) {
  const uint64_t w = DTypeSize(tensor.dtype);
  std::unordered_map<uint64_t, size_t> group_of;
  const LinearSpace dst_space = SpaceOfBox(request);
  std::vector<size_t> candidates;
  if (index != nullptr) index->Candidates(request, candidates);
  const size_t n = index != nullptr ? candidates.size() : tensor.shards.size();
  // Parts of the request not yet planned; each element is copied once even
  // where shards overlap (the first shard in shard order wins).
  std::vector<Box> remaining = {request};
  for (size_t at = 0; at < n && !remaining.empty(); ++at) {
    const size_t si = index != nullptr ? candidates[at] : at;
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
Status PlanElements(const TensorRecord& tensor, uint64_t first, uint64_t end, std::vector<ChunkGroup>& groups,
                    const ShardIndex* index = nullptr) {
  const uint64_t w = DTypeSize(tensor.dtype);
  for (const Box& box : FlatRangeToBoxes(tensor.shape, {first, end})) {
    CKPT_RETURN_IF_ERROR(PlanBox(tensor, box, groups, (FlatIndexOf(tensor.shape, box.offsets) - first) * w, index));
  }
  return Status::OK();
}

// fn(i) for i in [0, n): inline for a small read (`bytes` under 8 MiB: a
// FUSE request, a header, whose callers are already concurrent and whose
// chunks prefetching has usually decoded), else on `pool`'s threads.
// Returns the first error.
Status ForEachPart(ThreadPool* pool, size_t n, uint64_t bytes, const std::function<Status(size_t)>& fn) {
  constexpr uint64_t kParallelMinBytes = 8 << 20;
  if (pool == nullptr || n <= 1 || ThreadPool::OnPoolThread() || bytes < kParallelMinBytes) {
    for (size_t i = 0; i < n; ++i) CKPT_RETURN_IF_ERROR(fn(i));
    return Status::OK();
  }
  WaitGroup wg;
  std::mutex mu;
  Status first_error;
  wg.Add(n);
  for (size_t i = 0; i < n; ++i) {
    pool->Submit([&, i] {
      Status st = fn(i);
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

}  // namespace

Status ReadTensorBox(const TensorRecord& tensor, const Box& request, std::span<std::byte> dst,
                     ChunkFetcher& fetcher, ThreadPool* pool, const ShardIndex* index) {
  const uint64_t w = DTypeSize(tensor.dtype);
  CKPT_RETURN_IF_ERROR(ValidateRegion(tensor.shape, Region::OfBox(request)));
  if (dst.size() != request.NumElements() * w) {
    return Status::InvalidArgument("destination of " + std::to_string(dst.size()) +
                                   " bytes does not match box " + request.ToString());
  }
  if (request.Empty()) return Status::OK();
  std::vector<ChunkGroup> groups;
  CKPT_RETURN_IF_ERROR(PlanBox(tensor, request, groups, 0, index));

  return ForEachPart(pool, groups.size(), dst.size(), [&](size_t i) { return RunGroup(groups[i], dst, fetcher); });
}

Status ReadTensorBytes(const TensorRecord& tensor, uint64_t offset, std::span<std::byte> dst,
                       ChunkFetcher& fetcher, ThreadPool* pool, const ShardIndex* index) {
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
    CKPT_RETURN_IF_ERROR(ReadTensorBox(tensor, box, out.subspan(at, box.NumElements() * w), fetcher, pool, index));
  }
  if (!aligned) std::memcpy(dst.data(), staging.data() + (offset - first * w), dst.size());
  return Status::OK();
}

Result<bool> SliceTensorBytes(const TensorRecord& tensor, uint64_t offset, uint64_t length, ChunkFetcher& fetcher,
                              size_t max_slices, std::vector<ChunkSlice>& out, const ShardIndex* index) {
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
  CKPT_RETURN_IF_ERROR(PlanElements(tensor, offset / w, (offset + length) / w, groups, index));
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

namespace {
// The chunks the planned groups read, each once, in plan order.
std::vector<ChunkRef> DistinctChunks(const std::vector<ChunkGroup>& groups) {
  std::vector<ChunkRef> out;
  std::unordered_set<ChunkId, ChunkIdHash> seen;
  for (const auto& g : groups) {
    const ChunkRef& c = g.shard->chunks[g.chunk];
    if (seen.insert(c.id).second) out.push_back(c);
  }
  return out;
}
}  // namespace

Result<std::vector<ChunkRef>> ChunksForBytes(const TensorRecord& tensor, uint64_t offset, uint64_t length,
                                             const ShardIndex* index) {
  const uint64_t w = DTypeSize(tensor.dtype);
  const uint64_t total = tensor.ByteSize();
  if (offset >= total || length == 0) return std::vector<ChunkRef>();
  length = std::min(length, total - offset);
  const uint64_t first = offset / w, end = (offset + length + w - 1) / w;
  std::vector<ChunkGroup> groups;
  CKPT_RETURN_IF_ERROR(PlanElements(tensor, first, end, groups, index));
  return DistinctChunks(groups);
}

Result<std::vector<ChunkRef>> ChunksForRegion(const TensorRecord& tensor, const Region& region,
                                              const ShardIndex* index) {
  CKPT_RETURN_IF_ERROR(ValidateRegion(tensor.shape, region).WithContext("tensor '" + tensor.name + "'"));
  std::vector<ChunkGroup> groups;
  if (region.kind == Region::Kind::kFlat) {
    CKPT_RETURN_IF_ERROR(PlanElements(tensor, region.flat.start, region.flat.end, groups, index));
  } else if (!region.box.Empty()) {
    CKPT_RETURN_IF_ERROR(PlanBox(tensor, region.box, groups, 0, index));
  }
  return DistinctChunks(groups);
}

ShardIndex::ShardIndex(const TensorRecord& tensor) : shards_(tensor.shards.size()) {
  const size_t rank = tensor.shape.size();
  if (rank == 0) {
    every_shard_ = true;
    return;
  }
  // Each shard's extent along every dimension (a flat range spans the
  // union of its boxes); a shard that is empty or does not fit the tensor
  // meets nothing and is left out, as a read would skip it.
  std::vector<std::vector<Extent>> extents(rank);
  for (size_t si = 0; si < tensor.shards.size(); ++si) {
    const Region& region = tensor.shards[si].region;
    if (region.NumElements() == 0 || !ValidateRegion(tensor.shape, region).ok()) continue;
    std::vector<uint64_t> lo(rank, std::numeric_limits<uint64_t>::max()), hi(rank, 0);
    for (const Box& b : RegionToBoxes(tensor.shape, region)) {
      for (size_t d = 0; d < rank; ++d) {
        lo[d] = std::min(lo[d], b.offsets[d]);
        hi[d] = std::max(hi[d], b.offsets[d] + b.lengths[d]);
      }
    }
    for (size_t d = 0; d < rank; ++d) extents[d].push_back({lo[d], hi[d], si});
  }
  // The dimension whose sorted starts take the most distinct values.
  size_t best = 0;
  for (size_t d = 0; d < rank; ++d) {
    std::sort(extents[d].begin(), extents[d].end(), [](const Extent& a, const Extent& b) {
      return a.start != b.start ? a.start < b.start : a.shard < b.shard;
    });
    size_t distinct = 0;
    for (size_t i = 0; i < extents[d].size(); ++i) {
      if (i == 0 || extents[d][i].start != extents[d][i - 1].start) ++distinct;
    }
    if (d == 0 || distinct > best) {
      best = distinct;
      dim_ = d;
    }
  }
  by_start_ = std::move(extents[dim_]);
  reach_.resize(by_start_.size());
  for (size_t i = 0; i < by_start_.size(); ++i) {
    reach_[i] = std::max(by_start_[i].end, i == 0 ? 0 : reach_[i - 1]);
  }
}

void ShardIndex::Candidates(const Box& box, std::vector<size_t>& out) const {
  out.clear();
  if (every_shard_) {
    for (size_t si = 0; si < shards_; ++si) out.push_back(si);
    return;
  }
  if (box.rank() <= dim_ || box.Empty()) return;
  const uint64_t start = box.offsets[dim_], end = start + box.lengths[dim_];
  // Shards starting before the box ends; of those, walk back while some
  // shard at or before the position still reaches past the box's start.
  size_t i = static_cast<size_t>(
      std::lower_bound(by_start_.begin(), by_start_.end(), end,
                       [](const Extent& e, uint64_t v) { return e.start < v; }) -
      by_start_.begin());
  while (i > 0 && reach_[i - 1] > start) {
    --i;
    if (by_start_[i].end > start) out.push_back(by_start_[i].shard);
  }
  std::sort(out.begin(), out.end());
}

Status ReadBlobBytes(const BlobRecord& blob, uint64_t offset, std::span<std::byte> dst,
                     ChunkFetcher& fetcher, ThreadPool* pool) {
  if (offset > blob.size || dst.size() > blob.size - offset) {
    return Status::InvalidArgument("byte range past the end of blob '" + blob.name + "'");
  }
  // The chunks the range touches: each one's part of it, and where that
  // goes in `dst`.
  struct Piece {
    const ChunkRef* chunk;
    uint64_t from;  // in the chunk
    uint64_t to;    // in dst
    uint64_t n;
  };
  std::vector<Piece> pieces;
  uint64_t chunk_start = 0, done = 0;
  for (const ChunkRef& c : blob.chunks) {
    const uint64_t chunk_end = chunk_start + c.raw_len;
    const uint64_t pos = offset + done;
    if (done < dst.size() && pos < chunk_end) {
      const uint64_t n = std::min<uint64_t>(chunk_end - pos, dst.size() - done);
      pieces.push_back({&c, pos - chunk_start, done, n});
      done += n;
    }
    chunk_start = chunk_end;
  }
  if (done != dst.size()) return Status::Corruption("blob '" + blob.name + "' is shorter than recorded");
  auto copy = [&](const Piece& p) -> Status {
    CKPT_ASSIGN_OR_RETURN(ChunkData data, fetcher.Fetch(*p.chunk));
    if (data->size() < p.from + p.n) return Status::Corruption("a chunk of blob '" + blob.name + "' is short");
    std::memcpy(dst.data() + p.to, data->data() + p.from, p.n);
    fetcher.Consumed(*p.chunk, p.n);
    return Status::OK();
  };
  return ForEachPart(pool, pieces.size(), dst.size(), [&](size_t i) { return copy(pieces[i]); });
}

}  // namespace ckptfs
