// Shapes and the region math of shards.
//
// A tensor has a global shape (row-major, 0-d and zero-size allowed). A shard
// covers a region of it:
//   - a box: N-d offsets + lengths in the global index space, or
//   - a flat range: elements [start, end) of the row-major flattened tensor.
// All counts are in elements, not bytes. Functions that take a shape and a
// region validate nothing unless their name says so; callers validate once
// with ValidateRegion().
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "core/status.h"

namespace ckptfs {

using Shape = std::vector<uint64_t>;

// Number of elements; 1 for a 0-d shape. Fails on overflow of 2^63.
Result<uint64_t> CheckedNumElements(const Shape& shape);
uint64_t NumElements(const Shape& shape);  // caller knows it does not overflow
std::string ShapeToString(const Shape& shape);  // "[2, 3]"

struct Box {
  std::vector<uint64_t> offsets;
  std::vector<uint64_t> lengths;

  size_t rank() const { return offsets.size(); }
  uint64_t NumElements() const;
  bool Empty() const { return NumElements() == 0; }
  bool operator==(const Box&) const = default;
  std::string ToString() const;  // "[0:2, 4:8]"
};

struct FlatRange {
  uint64_t start = 0;
  uint64_t end = 0;  // exclusive
  uint64_t size() const { return end - start; }
  bool operator==(const FlatRange&) const = default;
};

// A shard's region: exactly one of box or flat.
struct Region {
  enum class Kind : uint8_t { kBox = 0, kFlat = 1 };
  Kind kind = Kind::kFlat;
  Box box;
  FlatRange flat;

  static Region OfBox(Box b) { Region r; r.kind = Kind::kBox; r.box = std::move(b); return r; }
  static Region OfFlat(uint64_t start, uint64_t end) {
    Region r; r.kind = Kind::kFlat; r.flat = {start, end}; return r;
  }
  uint64_t NumElements() const { return kind == Kind::kBox ? box.NumElements() : flat.size(); }
  bool operator==(const Region&) const = default;
  std::string ToString() const;
};

// The whole tensor as a box.
Box FullBox(const Shape& shape);
// Checks that the region lies inside `shape` (ranks agree, bounds hold).
Status ValidateRegion(const Shape& shape, const Region& region);
// A box that is contiguous in row-major order becomes a flat range (the
// storage form, whose chunks align to the tensor's global byte offsets);
// a flat range or a non-contiguous box is returned unchanged.
Region Normalize(const Shape& shape, const Region& region);
// The grid that a box shard which is not contiguous is chunked on
// (docs/FORMAT.md, "Chunks"): a tile's extent along each dimension. It
// depends on the tensor's shape, its element size and the chunk size only,
// never on the shards, so a region of a tensor is cut into the same tiles
// whatever the world size and placements that saved it. Each dimension is
// split into up to kGridParts equal parts (ceil(extent / parts) elements,
// the last dimension first) while a tile keeps at least chunk_size /
// kGridMinFraction bytes; then the longest extent is halved until a tile
// holds at most chunk_size bytes. The last dimension is not cut into rows
// shorter than kGridMinRow bytes unless nothing else can be cut.
// chunk_size >= element_size.
inline constexpr uint64_t kGridParts = 8;
inline constexpr uint64_t kGridMinFraction = 4;
inline constexpr uint64_t kGridMinRow = 128;
Shape GridTile(const Shape& shape, uint64_t element_size, uint64_t chunk_size);
// Row-major flat index of the box's first element.
uint64_t FlatIndexOf(const Shape& shape, const std::vector<uint64_t>& coords);
// Splits a flat range into the fewest boxes (at most 2*rank-1) whose union it
// is, in increasing flat order. Empty range -> no boxes.
std::vector<Box> FlatRangeToBoxes(const Shape& shape, FlatRange range);
// The region as disjoint boxes.
std::vector<Box> RegionToBoxes(const Shape& shape, const Region& region);
// Intersection of two boxes of the same rank; nullopt when empty.
std::optional<Box> Intersect(const Box& a, const Box& b);
// a minus b as disjoint boxes.
std::vector<Box> Subtract(const Box& a, const Box& b);

// A linear element space laid over part of the global index space: element
// at global coordinates c has linear index RowMajor(c - origin, extents) - base.
// A box shard's stream is {box.offsets, box.lengths, 0}; a flat shard's is
// {0, global shape, start}; a caller's destination box is {box.offsets,
// box.lengths, 0}.
struct LinearSpace {
  std::vector<uint64_t> origin;
  std::vector<uint64_t> extents;
  uint64_t base = 0;
};
LinearSpace SpaceOfRegion(const Shape& shape, const Region& region);
LinearSpace SpaceOfBox(const Box& box);

// Calls fn(src_index, dst_index, count) for each maximal run of elements of
// `piece` that is contiguous in both spaces, in row-major order of `piece`.
// `piece` must lie inside both spaces.
void ForEachRun(const Box& piece, const LinearSpace& src, const LinearSpace& dst,
                const std::function<void(uint64_t, uint64_t, uint64_t)>& fn);

}  // namespace ckptfs
