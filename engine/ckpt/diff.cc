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

std::unordered_set<ChunkId, ChunkIdHash> ChunkSet(const TensorRecord& t) {
  std::unordered_set<ChunkId, ChunkIdHash> ids;
  for (const auto& s : t.shards) for (const auto& c : s.chunks) ids.insert(c.id);
  return ids;
}

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
      // Shared fraction: A's bytes in chunks that B also holds.
      auto bset = ChunkSet(*tb);
      uint64_t shared = 0, total = 0;
      for (const auto& s : ta->shards) {
        for (const auto& c : s.chunks) {
          total += c.raw_len;
          if (bset.count(c.id)) shared += c.raw_len;
        }
      }
      d.shared_fraction = total ? static_cast<double>(shared) / total : 1.0;
      if (SameLayoutAndChunks(*ta, *tb)) {
        d.kind = TensorDiff::Kind::kUnchanged;
        if (IsFloat(ta->dtype)) d.max_abs_diff = 0.0;
      } else {
        // Different chunks or sharding: compare the bytes.
        const uint64_t w = DTypeSize(ta->dtype), size = ta->ByteSize();
        std::vector<std::byte> x, y;
        bool equal = true;
        double max_diff = 0;
        for (uint64_t off = 0; off < size; off += kPiece) {
          const uint64_t n = std::min(kPiece, size - off);
          x.resize(n);
          y.resize(n);
          CKPT_RETURN_IF_ERROR(a->ReadBytes(*ta, off, x));
          CKPT_RETURN_IF_ERROR(b->ReadBytes(*tb, off, y));
          if (x == y) continue;
          equal = false;
          if (!IsFloat(ta->dtype)) break;
          for (uint64_t i = 0; i < n / w; ++i) {
            double da = ElementAsDouble(ta->dtype, x.data(), i), db = ElementAsDouble(tb->dtype, y.data(), i);
            double diff = std::fabs(da - db);
            if (std::isnan(diff)) {
              if (std::isnan(da) != std::isnan(db)) max_diff = std::numeric_limits<double>::infinity();
            } else {
              max_diff = std::max(max_diff, diff);
            }
          }
        }
        d.kind = equal ? TensorDiff::Kind::kUnchanged : TensorDiff::Kind::kChanged;
        if (IsFloat(ta->dtype)) d.max_abs_diff = equal ? 0.0 : max_diff;
      }
    }
    out.push_back(std::move(d));
  }
  return out;
}

}  // namespace ckptfs
