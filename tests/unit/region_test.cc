#include "core/region.h"

#include <gtest/gtest.h>

#include <random>

namespace ckptfs {
namespace {

TEST(Region, NumElementsOfZeroDimAndZeroSize) {
  EXPECT_EQ(NumElements({}), 1u);
  EXPECT_EQ(NumElements({3, 0, 5}), 0u);
  EXPECT_EQ(*CheckedNumElements({1u << 31, 1u << 31}), uint64_t{1} << 62);
  EXPECT_FALSE(CheckedNumElements({1ull << 40, 1ull << 40}).ok());
}

TEST(Region, ValidateRejectsOutOfBoundsAndRankMismatch) {
  EXPECT_TRUE(ValidateRegion({4, 4}, Region::OfBox({{2, 0}, {2, 4}})).ok());
  EXPECT_FALSE(ValidateRegion({4, 4}, Region::OfBox({{3, 0}, {2, 4}})).ok());
  EXPECT_FALSE(ValidateRegion({4, 4}, Region::OfBox({{0}, {4}})).ok());
  EXPECT_TRUE(ValidateRegion({4, 4}, Region::OfFlat(3, 16)).ok());
  EXPECT_FALSE(ValidateRegion({4, 4}, Region::OfFlat(3, 17)).ok());
  EXPECT_FALSE(ValidateRegion({4, 4}, Region::OfFlat(5, 4)).ok());
}

TEST(Region, ContiguousBoxNormalizesToFlatRange) {
  // Rows 1..2 of a [4, 3] tensor are elements [3, 9).
  EXPECT_EQ(Normalize({4, 3}, Region::OfBox({{1, 0}, {2, 3}})), Region::OfFlat(3, 9));
  // A part of one row is contiguous too.
  EXPECT_EQ(Normalize({4, 3}, Region::OfBox({{2, 1}, {1, 2}})), Region::OfFlat(7, 9));
  // A column block is not.
  Region cols = Region::OfBox({{0, 1}, {4, 2}});
  EXPECT_EQ(Normalize({4, 3}, cols), cols);
  // 0-d tensor: the single element.
  EXPECT_EQ(Normalize({}, Region::OfBox({{}, {}})), Region::OfFlat(0, 1));
}

TEST(Region, SubtractYieldsDisjointRemainder) {
  Box a{{0, 0}, {4, 4}}, b{{1, 1}, {2, 2}};
  auto parts = Subtract(a, b);
  uint64_t n = 0;
  for (const auto& p : parts) {
    n += p.NumElements();
    EXPECT_FALSE(Intersect(p, b).has_value());
  }
  EXPECT_EQ(n, 12u);
  EXPECT_TRUE(Subtract(b, a).empty());
}

// Property: the boxes of a flat range are disjoint, in increasing flat order,
// contiguous, and cover exactly the range.
TEST(Region, FlatRangeToBoxesCoversExactly) {
  std::mt19937 rng(7);
  for (int iter = 0; iter < 2000; ++iter) {
    int rank = 1 + rng() % 4;
    Shape shape;
    for (int d = 0; d < rank; ++d) shape.push_back(1 + rng() % 5);
    uint64_t n = NumElements(shape);
    uint64_t s = rng() % (n + 1), e = rng() % (n + 1);
    if (s > e) std::swap(s, e);
    auto boxes = FlatRangeToBoxes(shape, {s, e});
    EXPECT_LE(boxes.size(), static_cast<size_t>(2 * rank - 1));
    uint64_t pos = s;
    for (const auto& b : boxes) {
      ASSERT_TRUE(ValidateRegion(shape, Region::OfBox(b)).ok());
      EXPECT_EQ(Normalize(shape, Region::OfBox(b)), Region::OfFlat(pos, pos + b.NumElements()))
          << "shape " << ShapeToString(shape) << " box " << b.ToString();
      pos += b.NumElements();
    }
    EXPECT_EQ(pos, e);
  }
}

// Property: ForEachRun visits every element of the piece exactly once with
// the right linear indices in both spaces.
TEST(Region, ForEachRunMatchesElementwiseMapping) {
  std::mt19937 rng(11);
  for (int iter = 0; iter < 500; ++iter) {
    int rank = 1 + rng() % 3;
    Shape shape;
    for (int d = 0; d < rank; ++d) shape.push_back(1 + rng() % 6);
    auto random_box = [&]() {
      Box b;
      for (int d = 0; d < rank; ++d) {
        uint64_t lo = rng() % shape[d], hi = lo + 1 + rng() % (shape[d] - lo);
        b.offsets.push_back(lo);
        b.lengths.push_back(hi - lo);
      }
      return b;
    };
    Box src = random_box(), dst = random_box();
    auto piece = Intersect(src, dst);
    if (!piece) continue;
    std::vector<int> seen(dst.NumElements(), 0);
    ForEachRun(*piece, SpaceOfBox(src), SpaceOfBox(dst), [&](uint64_t s, uint64_t d, uint64_t count) {
      for (uint64_t k = 0; k < count; ++k) {
        // Recover coordinates from the dst index and check the src index.
        uint64_t idx = d + k;
        std::vector<uint64_t> c(rank);
        for (int dd = rank - 1; dd >= 0; --dd) {
          c[dd] = dst.offsets[dd] + idx % dst.lengths[dd];
          idx /= dst.lengths[dd];
        }
        uint64_t want = 0;
        for (int dd = 0; dd < rank; ++dd) want = want * src.lengths[dd] + (c[dd] - src.offsets[dd]);
        ASSERT_EQ(s + k, want);
        seen[d + k]++;
      }
    });
    uint64_t visited = 0;
    for (int v : seen) {
      ASSERT_LE(v, 1);
      visited += v;
    }
    EXPECT_EQ(visited, piece->NumElements());
  }
}

// The grid box shards are chunked on: a function of the shape, element
// size and chunk size alone; up to 8 equal parts a dimension while tiles
// keep chunk_size / 4 bytes, and never a tile larger than a chunk.
TEST(Region, GridTilesSplitEachDimensionInEqualPartsAndFitAChunk) {
  EXPECT_EQ(GridTile({4096, 4096}, 2, 4 << 20), (Shape{1024, 512}));       // 4 x 8 tiles of 1 MiB
  EXPECT_EQ(GridTile({4096, 11008}, 4, 4 << 20), (Shape{512, 1376}));      // 2.7 MiB
  EXPECT_EQ(GridTile({2048, 512}, 4, 64 << 10), (Shape{256, 64}));
  EXPECT_EQ(GridTile({100, 70}, 4, 64 << 10), (Shape{100, 70}));           // 16 KiB at least
  EXPECT_EQ(GridTile({8, 4096, 4096}, 2, 4 << 20), (Shape{2, 512, 512}));  // 4 x 8 x 8
  EXPECT_EQ(GridTile({1 << 20, 8}, 4, 64 << 10), (Shape{2048, 8}));        // rows of 128 B at least
  EXPECT_EQ(GridTile({64, 4096}, 1, 1024), (Shape{8, 128}));               // a chunk at most
  EXPECT_EQ(GridTile({1, 4096}, 1, 64), (Shape{1, 64}));                   // short rows when nothing else is left
  EXPECT_EQ(GridTile({3, 5}, 8, 4 << 20), (Shape{3, 5}));                  // small: one tile
  std::mt19937_64 rng(5);
  for (int i = 0; i < 2000; ++i) {
    Shape shape(2 + rng() % 3);
    for (auto& d : shape) d = 1 + rng() % (rng() % 2 ? 100000 : 64);
    const uint64_t w = uint64_t{1} << (rng() % 4), chunk = uint64_t{8} << (rng() % 20);
    const Shape tile = GridTile(shape, w, chunk);
    ASSERT_EQ(tile.size(), shape.size());
    uint64_t bytes = w;
    for (size_t d = 0; d < shape.size(); ++d) {
      ASSERT_GE(tile[d], 1u);
      ASSERT_LE(tile[d], shape[d]);
      // ceil(shape / parts) for a power-of-two number of parts
      bool found = false;
      for (uint64_t parts = 1; parts <= shape[d] * 2 && !found; parts *= 2) {
        found = tile[d] == (shape[d] + parts - 1) / parts;
      }
      ASSERT_TRUE(found) << ShapeToString(shape) << " " << ShapeToString(tile);
      bytes *= tile[d];
    }
    ASSERT_LE(bytes, chunk) << ShapeToString(shape) << " " << ShapeToString(tile);
    EXPECT_EQ(GridTile(shape, w, chunk), tile);
  }
}

}  // namespace
}  // namespace ckptfs
