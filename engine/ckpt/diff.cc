// Comparing two checkpoints tensor by tensor.
#include <algorithm>
#include <cmath>
#include <map>
#include <unordered_set>

#include "ckpt/repository.h"
#include "ckpt/repository_impl.h"
#include "core/float_convert.h"

namespace ckptfs {
namespace {

std::unordered_set<ChunkId, ChunkIdHash> ChunkSet(const std::vector<const std::vector<ChunkRef>*>& lists) {
  std::unordered_set<ChunkId, ChunkIdHash> ids;
  for (const auto* l : lists) for (const auto& c : *l) ids.insert(c.id);
  return ids;
}

std::vector<const std::vector<ChunkRef>*> ChunkLists(const TensorRecord& t) {
  std::vector<const std::vector<ChunkRef>*> out;
  for (const auto& s : t.shards) out.push_back(&s.chunks);
  return out;
}

// Fills the chunk figures: how many of A's chunks, and of A's bytes, B holds.
void CompareChunks(const std::vector<const std::vector<ChunkRef>*>& a,
                   const std::vector<const std::vector<ChunkRef>*>& b, TensorDiff& d) {
  auto bset = ChunkSet(b);
  uint64_t shared = 0, total = 0;
  for (const auto* l : a) {
    for (const auto& c : *l) {
      total += c.raw_len;
      ++d.chunks;
      if (bset.count(c.id)) {
        shared += c.raw_len;
      } else {
        ++d.changed_chunks;
      }
    }
  }
  d.shared_fraction = total ? static_cast<double>(shared) / total : 1.0;
}

// Running |a - b| statistics of float elements.
struct Deviation {
  double max = 0, sum_abs = 0, sum_sq_diff = 0, sum_sq_a = 0;
  uint64_t count = 0;
  bool infinite = false;
  void Add(double x, double y) {
    ++count;
    const bool nx = std::isnan(x), ny = std::isnan(y);
    if (nx || ny) {
      if (nx != ny) infinite = true;
      return;
    }
    if (std::isinf(x) || std::isinf(y)) {
      if (x != y) infinite = true;
      return;
    }
    const double diff = std::fabs(x - y);
    max = std::max(max, diff);
    sum_abs += diff;
    sum_sq_diff += diff * diff;
    sum_sq_a += x * x;
  }
  void Fill(TensorDiff& d) const {
    const double inf = std::numeric_limits<double>::infinity();
    d.max_abs_diff = infinite ? inf : max;
    d.mean_abs_diff = infinite ? inf : count ? sum_abs / static_cast<double>(count) : 0.0;
    if (infinite) {
      d.relative_l2 = inf;
    } else if (sum_sq_diff == 0) {
      d.relative_l2 = 0.0;
    } else {
      d.relative_l2 = sum_sq_a > 0 ? std::sqrt(sum_sq_diff / sum_sq_a) : inf;
    }
  }
};

bool SameLayoutAndChunks(const TensorRecord& a, const TensorRecord& b) {
  if (a.shards.size() != b.shards.size()) return false;
  for (size_t i = 0; i < a.shards.size(); ++i) {
    if (!(a.shards[i].region == b.shards[i].region) || a.shards[i].chunks != b.shards[i].chunks) return false;
  }
  return true;
}

}  // namespace

Result<std::vector<TensorDiff>> Repository::Diff(const std::string& a_name, const std::string& b_name) {
  CKPT_RETURN_IF_ERROR(impl_->CheckProcess());
  CKPT_ASSIGN_OR_RETURN(auto a, OpenCheckpoint(a_name));
  CKPT_ASSIGN_OR_RETURN(auto b, OpenCheckpoint(b_name));
  std::map<std::string, std::pair<const TensorRecord*, const TensorRecord*>> all;
  for (const auto& t : a->tensors()) all[t.name].first = &t;
  for (const auto& t : b->tensors()) all[t.name].second = &t;
  std::vector<TensorDiff> out;
  constexpr uint64_t kPiece = 16 << 20;  // bytes compared at a time
  for (const auto& [name, pair] : all) {
    TensorDiff d;
    d.name = name;
    const TensorRecord* ta = pair.first;
    const TensorRecord* tb = pair.second;
    if (!tb) {
      d.kind = TensorDiff::Kind::kOnlyInA;
    } else if (!ta) {
      d.kind = TensorDiff::Kind::kOnlyInB;
    } else if (ta->dtype != tb->dtype || ta->shape != tb->shape) {
      d.kind = TensorDiff::Kind::kTypeChanged;
    } else {
      CompareChunks(ChunkLists(*ta), ChunkLists(*tb), d);
      const bool is_float = IsFloat(ta->dtype);
      if (SameLayoutAndChunks(*ta, *tb)) {
        d.kind = TensorDiff::Kind::kUnchanged;
        if (is_float) Deviation{}.Fill(d);
      } else {
        // Different chunks or sharding: compare the bytes (all of them for
        // a float tensor, whose figures need every element).
        const uint64_t w = DTypeSize(ta->dtype), size = ta->ByteSize();
        std::vector<std::byte> x, y;
        bool equal = true;
        Deviation dev;
        for (uint64_t off = 0; off < size; off += kPiece) {
          const uint64_t n = std::min(kPiece, size - off);
          x.resize(n);
          y.resize(n);
          CKPT_RETURN_IF_ERROR(a->ReadBytes(*ta, off, x));
          CKPT_RETURN_IF_ERROR(b->ReadBytes(*tb, off, y));
          const bool same = x == y;
          equal = equal && same;
          if (!same && !is_float) break;
          if (!is_float) continue;
          for (uint64_t i = 0; i < n / w; ++i) {
            dev.Add(ElementAsDouble(ta->dtype, x.data(), i), ElementAsDouble(tb->dtype, y.data(), i));
          }
        }
        d.kind = equal ? TensorDiff::Kind::kUnchanged : TensorDiff::Kind::kChanged;
        if (is_float) dev.Fill(d);
      }
    }
    out.push_back(std::move(d));
  }
  // Blobs: by their chunks, then their bytes.
  std::map<std::string, std::pair<const BlobRecord*, const BlobRecord*>> blobs;
  for (const auto& x : a->blobs()) blobs[x.name].first = &x;
  for (const auto& x : b->blobs()) blobs[x.name].second = &x;
  for (const auto& [name, pair] : blobs) {
    TensorDiff d;
    d.name = name;
    d.blob = true;
    const BlobRecord* ba = pair.first;
    const BlobRecord* bb = pair.second;
    if (!bb) {
      d.kind = TensorDiff::Kind::kOnlyInA;
    } else if (!ba) {
      d.kind = TensorDiff::Kind::kOnlyInB;
    } else {
      CompareChunks({&ba->chunks}, {&bb->chunks}, d);
      bool equal = ba->size == bb->size;
      if (equal && ba->chunks != bb->chunks) {
        std::vector<std::byte> x, y;
        for (uint64_t off = 0; off < ba->size && equal; off += kPiece) {
          const uint64_t n = std::min(kPiece, ba->size - off);
          x.resize(n);
          y.resize(n);
          CKPT_RETURN_IF_ERROR(a->ReadBlob(*ba, off, x));
          CKPT_RETURN_IF_ERROR(b->ReadBlob(*bb, off, y));
          equal = x == y;
        }
      }
      d.kind = equal ? TensorDiff::Kind::kUnchanged : TensorDiff::Kind::kChanged;
    }
    out.push_back(std::move(d));
  }
  return out;
}

}  // namespace ckptfs
