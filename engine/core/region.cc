#include "core/region.h"

#include <algorithm>
#include <sstream>

namespace ckptfs {

Result<uint64_t> CheckedNumElements(const Shape& shape) {
  uint64_t n = 1;
  for (uint64_t d : shape) {
    if (d == 0) return uint64_t{0};
  }
  for (uint64_t d : shape) {
    if (n > (uint64_t{1} << 63) / d) {
      return Status::InvalidArgument("shape " + ShapeToString(shape) + " has too many elements");
    }
    n *= d;
  }
  return n;
}

uint64_t NumElements(const Shape& shape) {
  uint64_t n = 1;
  for (uint64_t d : shape) n *= d;
  return n;
}

std::string ShapeToString(const Shape& shape) {
  std::ostringstream os;
  os << '[';
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << ']';
  return os.str();
}

uint64_t Box::NumElements() const {
  uint64_t n = 1;
  for (uint64_t l : lengths) n *= l;
  return n;
}

std::string Box::ToString() const {
  std::ostringstream os;
  os << '[';
  // Safe on a malformed box too (it may describe one in an error message).
  for (size_t i = 0; i < std::min(offsets.size(), lengths.size()); ++i) {
    os << (i ? ", " : "") << offsets[i] << ':' << offsets[i] + lengths[i];
  }
  if (offsets.size() != lengths.size()) os << (offsets.empty() ? "" : ", ") << "rank mismatch";
  os << ']';
  return os.str();
}

std::string Region::ToString() const {
  if (kind == Kind::kBox) return "box " + box.ToString();
  return "flat [" + std::to_string(flat.start) + ", " + std::to_string(flat.end) + ")";
}

Box FullBox(const Shape& shape) {
  Box b;
  b.offsets.assign(shape.size(), 0);
  b.lengths = shape;
  return b;
}

Status ValidateRegion(const Shape& shape, const Region& region) {
  CKPT_ASSIGN_OR_RETURN(uint64_t total, CheckedNumElements(shape));
  if (region.kind == Region::Kind::kFlat) {
    if (region.flat.start > region.flat.end || region.flat.end > total) {
      return Status::InvalidArgument("flat range [" + std::to_string(region.flat.start) + ", " +
                                     std::to_string(region.flat.end) +
                                     ") does not fit a tensor of " + std::to_string(total) +
                                     " elements");
    }
    return Status::OK();
  }
  const Box& b = region.box;
  if (b.offsets.size() != shape.size() || b.lengths.size() != shape.size()) {
    return Status::InvalidArgument("box of rank " + std::to_string(b.offsets.size()) +
                                   " does not match a tensor of shape " + ShapeToString(shape));
  }
  for (size_t d = 0; d < shape.size(); ++d) {
    if (b.offsets[d] > shape[d] || b.lengths[d] > shape[d] - b.offsets[d]) {
      return Status::InvalidArgument("box " + b.ToString() + " exceeds shape " +
                                     ShapeToString(shape) + " in dimension " + std::to_string(d));
    }
  }
  return Status::OK();
}

uint64_t FlatIndexOf(const Shape& shape, const std::vector<uint64_t>& coords) {
  uint64_t idx = 0;
  for (size_t d = 0; d < shape.size(); ++d) idx = idx * shape[d] + coords[d];
  return idx;
}

Region Normalize(const Shape& shape, const Region& region) {
  if (region.kind == Region::Kind::kFlat) return region;
  const Box& b = region.box;
  uint64_t n = b.NumElements();
  if (n == 0) return Region::OfFlat(0, 0);
  // Contiguous iff every dimension after the first one with length > 1 is full.
  size_t d = 0;
  while (d < b.rank() && b.lengths[d] == 1) ++d;
  for (size_t e = d + 1; e < b.rank(); ++e) {
    if (b.lengths[e] != shape[e]) return region;
  }
  uint64_t start = FlatIndexOf(shape, b.offsets);
  return Region::OfFlat(start, start + n);
}

namespace {
// Bytes of a tile of these extents, saturating at 2^64 - 1.
uint64_t TileBytes(const Shape& tile, uint64_t element_size) {
  unsigned __int128 bytes = element_size;
  for (uint64_t e : tile) {
    bytes *= e;
    if (bytes > UINT64_MAX) return UINT64_MAX;
  }
  return static_cast<uint64_t>(bytes);
}
uint64_t CeilDiv(uint64_t a, uint64_t b) { return a / b + (a % b != 0); }
}  // namespace

Shape GridTile(const Shape& shape, uint64_t element_size, uint64_t chunk_size) {
  const size_t n = shape.size();
  Shape tile = shape;
  if (n == 0) return tile;
  std::vector<uint64_t> parts(n, 1);
  const uint64_t least = std::max<uint64_t>(chunk_size / kGridMinFraction, 1);
  // Whether dimension i may be halved again: a tile's rows (its extent
  // along the last dimension) stay at least kGridMinRow bytes long, so
  // that gathering and scattering a tile copies runs, not elements.
  auto halved = [&](size_t i) { return CeilDiv(shape[i], parts[i] * 2); };
  auto may_halve = [&](size_t i) {
    return tile[i] >= 2 && (i + 1 < n || halved(i) * element_size >= kGridMinRow);
  };
  // Equal parts first, up to kGridParts a dimension, while tiles stay large
  // enough to compress well and cost little to index.
  for (uint64_t round = 1; round < kGridParts; round *= 2) {
    for (size_t i = n; i-- > 0;) {
      if (!may_halve(i)) continue;
      Shape next = tile;
      next[i] = halved(i);
      if (TileBytes(next, element_size) < least) continue;
      tile[i] = next[i];
      parts[i] *= 2;
    }
  }
  // Then no tile larger than a chunk: halve the longest extent that may be
  // halved (the last such dimension), which keeps the parts a power of two;
  // rows shorter than kGridMinRow only when nothing else is left.
  auto longest_of = [&](auto&& eligible) {
    size_t best = n;
    for (size_t i = 0; i < n; ++i) {
      if (eligible(i) && (best == n || tile[i] >= tile[best])) best = i;
    }
    return best;
  };
  while (TileBytes(tile, element_size) > chunk_size) {
    size_t longest = longest_of(may_halve);
    if (longest == n) longest = longest_of([&](size_t i) { return tile[i] >= 2; });
    if (longest == n) break;
    tile[longest] = halved(longest);
    parts[longest] *= 2;
  }
  return tile;
}

namespace {
void Decompose(const Shape& shape, size_t dim, std::vector<uint64_t>& prefix, uint64_t s,
               uint64_t e, std::vector<Box>& out) {
  if (s >= e) return;
  const size_t n = shape.size();
  auto emit = [&](uint64_t first, uint64_t count, bool rest_full) {
    Box b;
    b.offsets = prefix;
    b.lengths.assign(prefix.size(), 1);
    b.offsets.push_back(first);
    b.lengths.push_back(count);
    for (size_t d = dim + 1; d < n; ++d) {
      b.offsets.push_back(0);
      b.lengths.push_back(rest_full ? shape[d] : 1);
    }
    out.push_back(std::move(b));
  };
  if (dim == n - 1) {
    emit(s, e - s, true);
    return;
  }
  uint64_t inner = 1;
  for (size_t d = dim + 1; d < n; ++d) inner *= shape[d];
  uint64_t first_row = s / inner;
  uint64_t last_row = (e - 1) / inner;
  if (first_row == last_row) {
    if (s % inner == 0 && e % inner == 0) {
      emit(first_row, 1, true);
      return;
    }
    prefix.push_back(first_row);
    Decompose(shape, dim + 1, prefix, s - first_row * inner, e - first_row * inner, out);
    prefix.pop_back();
    return;
  }
  uint64_t full_begin = first_row;
  if (s % inner != 0) {
    prefix.push_back(first_row);
    Decompose(shape, dim + 1, prefix, s % inner, inner, out);
    prefix.pop_back();
    full_begin = first_row + 1;
  }
  uint64_t full_end = e / inner;
  if (full_end > full_begin) emit(full_begin, full_end - full_begin, true);
  if (e % inner != 0) {
    prefix.push_back(full_end);
    Decompose(shape, dim + 1, prefix, 0, e % inner, out);
    prefix.pop_back();
  }
}
}  // namespace

std::vector<Box> FlatRangeToBoxes(const Shape& shape, FlatRange range) {
  std::vector<Box> out;
  if (range.start >= range.end) return out;
  if (shape.empty()) {
    out.push_back(Box{});
    return out;
  }
  std::vector<uint64_t> prefix;
  Decompose(shape, 0, prefix, range.start, range.end, out);
  return out;
}

std::vector<Box> RegionToBoxes(const Shape& shape, const Region& region) {
  if (region.kind == Region::Kind::kFlat) return FlatRangeToBoxes(shape, region.flat);
  if (region.box.Empty()) return {};
  return {region.box};
}

std::optional<Box> Intersect(const Box& a, const Box& b) {
  Box r;
  r.offsets.resize(a.rank());
  r.lengths.resize(a.rank());
  for (size_t d = 0; d < a.rank(); ++d) {
    uint64_t lo = std::max(a.offsets[d], b.offsets[d]);
    uint64_t hi = std::min(a.offsets[d] + a.lengths[d], b.offsets[d] + b.lengths[d]);
    if (hi <= lo) return std::nullopt;
    r.offsets[d] = lo;
    r.lengths[d] = hi - lo;
  }
  if (a.Empty() || b.Empty()) return std::nullopt;
  return r;
}

std::vector<Box> Subtract(const Box& a, const Box& b) {
  auto inter = Intersect(a, b);
  if (!inter) return a.Empty() ? std::vector<Box>{} : std::vector<Box>{a};
  std::vector<Box> out;
  Box cur = a;
  for (size_t d = 0; d < a.rank(); ++d) {
    uint64_t lo = inter->offsets[d], hi = lo + inter->lengths[d];
    uint64_t cur_end = cur.offsets[d] + cur.lengths[d];
    if (cur.offsets[d] < lo) {
      Box p = cur;
      p.lengths[d] = lo - cur.offsets[d];
      out.push_back(std::move(p));
    }
    if (hi < cur_end) {
      Box p = cur;
      p.offsets[d] = hi;
      p.lengths[d] = cur_end - hi;
      out.push_back(std::move(p));
    }
    cur.offsets[d] = lo;
    cur.lengths[d] = hi - lo;
  }
  return out;
}

LinearSpace SpaceOfRegion(const Shape& shape, const Region& region) {
  if (region.kind == Region::Kind::kBox) return SpaceOfBox(region.box);
  LinearSpace s;
  s.origin.assign(shape.size(), 0);
  s.extents = shape;
  s.base = region.flat.start;
  return s;
}

LinearSpace SpaceOfBox(const Box& box) { return LinearSpace{box.offsets, box.lengths, 0}; }

void ForEachRun(const Box& piece, const LinearSpace& src, const LinearSpace& dst,
                const std::function<void(uint64_t, uint64_t, uint64_t)>& fn) {
  const size_t n = piece.rank();
  if (piece.Empty()) return;
  if (n == 0) {
    fn(0 - src.base, 0 - dst.base, 1);
    return;
  }
  // Dimensions j..n-1 form one run when every dimension after j is full in
  // the piece and in both spaces.
  size_t j = n - 1;
  while (j > 0 && piece.lengths[j] == src.extents[j] && piece.lengths[j] == dst.extents[j]) --j;
  uint64_t run = 1;
  for (size_t d = j; d < n; ++d) run *= piece.lengths[d];

  auto linear = [n](const LinearSpace& sp, const std::vector<uint64_t>& c) {
    uint64_t idx = 0;
    for (size_t d = 0; d < n; ++d) idx = idx * sp.extents[d] + (c[d] - sp.origin[d]);
    return idx - sp.base;
  };
  std::vector<uint64_t> coord = piece.offsets;
  // Strides of dimension j-1 .. 0 in each space, to step without recomputing.
  while (true) {
    fn(linear(src, coord), linear(dst, coord), run);
    // Advance the odometer over dimensions [0, j).
    size_t d = j;
    while (d > 0) {
      --d;
      if (++coord[d] < piece.offsets[d] + piece.lengths[d]) break;
      coord[d] = piece.offsets[d];
      if (d == 0) return;
    }
    if (j == 0) return;
  }
}

}  // namespace ckptfs
