// Repositories written by ckptfs 0.1.0 (format version 1), kept in
// tests/fixtures/format-1: a local repository directory, and the objects of
// a repository on an object store as files (its keys as paths). Today's
// code opens each, reads every tensor and blob bit-exact, verifies, and
// collects garbage: a change that alters the on-disk format fails here.
//
// The fixture was made by this file's DISABLED_WriteTheFixture, built with
// the code of its time and run with CKPTFS_FIXTURE_OUT=DIR and
// --gtest_also_run_disabled_tests --gtest_filter='FormatFixture.DISABLED_*';
// tests/fixtures/format-1-boxes likewise by DISABLED_WriteTheBoxFixture.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "ckpt/repository.h"
#include "test_util.h"

namespace ckptfs {
namespace {

using testing::TempDir;
namespace fs = std::filesystem;

// The checkpoints' contents, computed: nothing but the fixture's bytes is
// kept on disk.
struct Expected {
  std::string name;  // tensor or blob
  DType dtype = DType::kU8;
  Shape shape;
  std::string bytes;
};

std::string Pattern(size_t n, uint64_t seed) {
  std::string out(n, '\0');
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    // Runs of repeats, so that zstd has something to do.
    out[i] = static_cast<char>((i / 64) % 3 == 0 ? 0 : (x & 0xff));
  }
  return out;
}

// step-1 and step-2 share "embed" (deduplicated) and differ in "w".
std::vector<Expected> Tensors(int step) {
  return {
      {"embed", DType::kBF16, {256, 300}, Pattern(256 * 300 * 2, 7)},
      {"layers.0/w", DType::kF32, {192, 128}, Pattern(192 * 128 * 4, 100 + step)},
      {"step", DType::kI64, {}, std::string(reinterpret_cast<const char*>(&step), sizeof(int)) + std::string(4, '\0')},
  };
}
Expected Blob(int step) { return {"rng", DType::kU8, {}, Pattern(1000, 50 + step)}; }

constexpr const char* kFixtures = CKPTFS_TEST_FIXTURES "/format-1";

// Two ranks: "embed" split in row boxes, "layers.0/w" in flat ranges,
// "step" replicated.
void SaveStep(Repository& repo, int step) {
  const auto tensors = Tensors(step);
  for (uint32_t rank = 0; rank < 2; ++rank) {
    WriterOptions wo;
    wo.rank = rank;
    wo.world_size = 2;
    wo.step = step;
    wo.tags = {{"run", "fixture"}};
    auto w = repo.BeginCheckpoint("step-" + std::to_string(step), wo);
    ASSERT_OK(w.status());
    for (const auto& t : tensors) {
      TensorInfo info{t.name, t.dtype, t.shape};
      const auto* data = reinterpret_cast<const std::byte*>(t.bytes.data());
      if (t.shape.empty()) {
        ASSERT_OK((*w)->PutTensor(info, std::span(data, t.bytes.size())));
      } else if (t.name == "embed") {
        const uint64_t rows = t.shape[0] / 2, row_bytes = t.bytes.size() / t.shape[0];
        HostSource src(std::span(data + rank * rows * row_bytes, rows * row_bytes));
        ASSERT_OK((*w)->PutShard(info, Region::OfBox({{rank * rows, 0}, {rows, t.shape[1]}}), src));
      } else {
        const uint64_t n = t.shape[0] * t.shape[1], half = n / 2 + 5;  // not at a row boundary
        const uint64_t begin = rank == 0 ? 0 : half, end = rank == 0 ? half : n;
        HostSource src(std::span(data + begin * 4, (end - begin) * 4));
        ASSERT_OK((*w)->PutShard(info, Region::OfFlat(begin, end), src));
      }
    }
    if (rank == 0) {
      const Expected b = Blob(step);
      ASSERT_OK((*w)->PutBlob(b.name, std::as_bytes(std::span(b.bytes))));
    }
    ASSERT_OK((*w)->Commit().Wait().status());
  }
}

void CheckStep(Repository& repo, int step) {
  SCOPED_TRACE("step-" + std::to_string(step));
  auto r = repo.OpenCheckpoint("step-" + std::to_string(step));
  ASSERT_OK(r.status());
  EXPECT_EQ((*r)->info().step, step);
  EXPECT_EQ((*r)->info().world_size, 2u);
  ASSERT_EQ((*r)->tensors().size(), 3u);
  for (const auto& t : Tensors(step)) {
    auto rec = (*r)->FindTarget(t.name, t.dtype, t.shape);
    ASSERT_OK(rec.status());
    std::string got(t.bytes.size(), '\0');
    uint64_t n = 1;
    for (uint64_t d : t.shape) n *= d;
    ASSERT_OK((*r)->ReadRegion(**rec, Region::OfFlat(0, n), std::as_writable_bytes(std::span(got))));
    EXPECT_TRUE(got == t.bytes) << t.name << " differs";
  }
  const Expected b = Blob(step);
  auto blob = (*r)->GetBlob(b.name);
  ASSERT_OK(blob.status());
  std::string got(b.bytes.size(), '\0');
  ASSERT_OK((*r)->ReadBlob(**blob, 0, std::as_writable_bytes(std::span(got))));
  EXPECT_TRUE(got == b.bytes);
}

// Opens, reads both steps, verifies, then gc keeping the newest: step-1
// goes, step-2 still reads, and verify still passes. On an object store the
// read leases just released linger a few seconds, so step-1's data is kept
// for that gc (lease.h) instead of reclaimed.
void CheckRepository(Repository& repo) {
  auto list = repo.ListCheckpoints(false);
  ASSERT_OK(list.status());
  ASSERT_EQ(list->size(), 2u);
  EXPECT_EQ((*list)[0].name, "step-1");
  EXPECT_EQ((*list)[1].name, "step-2");
  CheckStep(repo, 1);
  CheckStep(repo, 2);
  auto verified = repo.Verify(std::nullopt);
  ASSERT_OK(verified.status());
  EXPECT_TRUE(verified->ok());
  EXPECT_EQ(verified->tensors, 6u);
  GcOptions gc;
  gc.retention.keep_last = 1;
  gc.rewrite_below = 0.99;
  auto report = repo.CollectGarbage(gc);
  ASSERT_OK(report.status());
  EXPECT_EQ(report->removed, std::vector<std::string>{"step-1"});
  if (repo.remote()) {
    EXPECT_EQ(report->retired_kept, 1u);
  } else {
    EXPECT_EQ(report->retired_collected, 1u);
    EXPECT_GT(report->bytes_reclaimed(), 0u);
  }
  CheckStep(repo, 2);
  verified = repo.Verify(std::nullopt);
  ASSERT_OK(verified.status());
  EXPECT_TRUE(verified->ok());
}

// The objects of a store as files, keys as relative paths, and back.
void DumpStore(Backend& store, const fs::path& dir) {
  auto keys = store.List("");
  ASSERT_OK(keys.status());
  for (const auto& key : *keys) {
    auto body = store.ReadAll(key, 1ull << 30);
    ASSERT_OK(body.status());
    fs::create_directories((dir / key).parent_path());
    std::ofstream(dir / key, std::ios::binary) << *body;
  }
}

std::shared_ptr<Backend> LoadStore(const fs::path& dir) {
  std::shared_ptr<Backend> store = NewMemoryBackend();
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    std::ifstream f(e.path(), std::ios::binary);
    const std::string body((std::istreambuf_iterator<char>(f)), {});
    EXPECT_OK(store->Put(fs::relative(e.path(), dir).string(), std::as_bytes(std::span(body))));
  }
  return store;
}

RepositoryConfig FixtureConfig() {
  RepositoryConfig c;
  c.chunk_size = 64 << 10;
  c.pack_size = 256 << 10;
  c.adaptive = false;  // compressed, whatever the disk does
  return c;
}

TEST(FormatFixture, DISABLED_WriteTheFixture) {
  const char* out = std::getenv("CKPTFS_FIXTURE_OUT");
  ASSERT_TRUE(out) << "set CKPTFS_FIXTURE_OUT to an empty directory";
  const fs::path dir = out;
  {
    ASSERT_OK(Repository::Init((dir / "local").string(), FixtureConfig()));
    auto repo = Repository::Open((dir / "local").string());
    ASSERT_OK(repo.status());
    SaveStep(**repo, 1);
    SaveStep(**repo, 2);
  }
  // Lease and lock files are runtime state: not part of the fixture.
  fs::remove_all(dir / "local" / "leases");
  fs::remove_all(dir / "local" / "locks");
  fs::remove(dir / "local" / "catalog" / "lock.mdb");
  TempDir cache;
  std::shared_ptr<Backend> store = NewMemoryBackend();
  ASSERT_OK(Repository::Init(*store, FixtureConfig()));
  {
    OpenOptions o;
    o.cache_dir = cache.path();
    auto repo = Repository::Open(store, o);
    ASSERT_OK(repo.status());
    SaveStep(**repo, 1);
    SaveStep(**repo, 2);
  }
  DumpStore(*store, dir / "store");
}

TEST(FormatFixture, TodaysCodeReadsVerifiesAndCollectsALocalRepositoryOfFormat1) {
  ASSERT_TRUE(fs::exists(fs::path(kFixtures) / "local" / "ckptfs.json")) << kFixtures;
  TempDir dir;
  fs::copy(fs::path(kFixtures) / "local", dir / "repo", fs::copy_options::recursive);
  auto repo = Repository::Open(dir / "repo");
  ASSERT_OK(repo.status());
  CheckRepository(**repo);
}

TEST(FormatFixture, TodaysCodeReadsVerifiesAndCollectsAStoreRepositoryOfFormat1) {
  ASSERT_TRUE(fs::exists(fs::path(kFixtures) / "store" / "ckptfs.json")) << kFixtures;
  std::shared_ptr<Backend> store = LoadStore(fs::path(kFixtures) / "store");
  TempDir cache;
  OpenOptions o;
  o.cache_dir = cache.path();
  auto repo = Repository::Open(store, o);
  ASSERT_OK(repo.status());
  CheckRepository(**repo);
}

// Box shards that are not contiguous, as builds before the tile grid
// stored them (tests/fixtures/format-1-boxes): each chunked from its own
// start, rows running on from one chunk into the next. Four ranks: "tp"
// in column blocks (each box two chunks, cut inside a row), "mesh" in the
// boxes of a 2 x 2 mesh.
constexpr const char* kBoxFixtures = CKPTFS_TEST_FIXTURES "/format-1-boxes";
constexpr uint32_t kBoxRanks = 4;

std::vector<Expected> BoxTensors() {
  return {{"tp", DType::kBF16, {1536, 96}, Pattern(1536 * 96 * 2, 31)},
          {"mesh", DType::kF32, {32, 40}, Pattern(32 * 40 * 4, 32)}};
}

Box BoxOfRank(const Expected& t, uint32_t rank) {
  if (t.name == "tp") return Box{{0, 24 * rank}, {1536, 24}};
  return Box{{16 * (rank / 2), 20 * (rank % 2)}, {16, 20}};
}

RepositoryConfig BoxFixtureConfig() {
  RepositoryConfig c;
  c.chunk_size = 64 << 10;
  c.pack_size = 256 << 10;
  c.adaptive = false;
  return c;
}

// Row-major bytes of a box of a 2-d tensor.
std::string BoxBytes(const Expected& t, const Box& box) {
  const uint64_t width = DTypeSize(t.dtype);
  std::string out;
  for (uint64_t r = 0; r < box.lengths[0]; ++r) {
    out += t.bytes.substr(((box.offsets[0] + r) * t.shape[1] + box.offsets[1]) * width, box.lengths[1] * width);
  }
  return out;
}

void SaveBoxes(Repository& repo, const std::string& name = "boxes") {
  for (uint32_t rank = 0; rank < kBoxRanks; ++rank) {
    WriterOptions wo;
    wo.rank = rank;
    wo.world_size = kBoxRanks;
    auto w = repo.BeginCheckpoint(name, wo);
    ASSERT_OK(w.status());
    for (const auto& t : BoxTensors()) {
      const Box box = BoxOfRank(t, rank);
      const std::string bytes = BoxBytes(t, box);
      HostSource src(std::as_bytes(std::span(bytes)));
      ASSERT_OK((*w)->PutShard(TensorInfo{t.name, t.dtype, t.shape}, Region::OfBox(box), src));
    }
    ASSERT_OK((*w)->Commit().Wait().status());
  }
}

TEST(FormatFixture, DISABLED_WriteTheBoxFixture) {
  const char* out = std::getenv("CKPTFS_FIXTURE_OUT");
  ASSERT_TRUE(out) << "set CKPTFS_FIXTURE_OUT to an empty directory";
  const fs::path dir = out;
  ASSERT_OK(Repository::Init((dir / "local").string(), BoxFixtureConfig()));
  {
    auto repo = Repository::Open((dir / "local").string());
    ASSERT_OK(repo.status());
    SaveBoxes(**repo);
  }
  fs::remove_all(dir / "local" / "leases");
  fs::remove_all(dir / "local" / "locks");
  fs::remove(dir / "local" / "catalog" / "lock.mdb");
}

// The old box shards read back whole and in any region, verify, and a save
// of the same state today stores it as tiles beside them.
TEST(FormatFixture, TodaysCodeReadsBoxShardsChunkedFromTheirStart) {
  ASSERT_TRUE(fs::exists(fs::path(kBoxFixtures) / "local" / "ckptfs.json")) << kBoxFixtures;
  TempDir dir;
  fs::copy(fs::path(kBoxFixtures) / "local", dir / "repo", fs::copy_options::recursive);
  auto repo = Repository::Open(dir / "repo");
  ASSERT_OK(repo.status());
  auto reader = (*repo)->OpenCheckpoint("boxes");
  ASSERT_OK(reader.status());
  std::mt19937 rng(3);
  for (const auto& t : BoxTensors()) {
    SCOPED_TRACE(t.name);
    auto rec = (*reader)->FindTarget(t.name, t.dtype, t.shape);
    ASSERT_OK(rec.status());
    // As the old builds stored them: one shard a rank, chunked from its start.
    ASSERT_EQ((*rec)->shards.size(), kBoxRanks);
    if (t.name == "tp") {
      EXPECT_EQ((*rec)->shards[0].chunks.size(), 2u);
    }
    std::string got(t.bytes.size(), '\0');
    ASSERT_OK((*reader)->ReadRegion(**rec, Region::OfFlat(0, t.bytes.size() / DTypeSize(t.dtype)),
                                    std::as_writable_bytes(std::span(got))));
    EXPECT_TRUE(got == t.bytes);
    for (int i = 0; i < 50; ++i) {
      Box box;
      for (uint64_t d : t.shape) {
        const uint64_t lo = rng() % d;
        box.offsets.push_back(lo);
        box.lengths.push_back(1 + rng() % (d - lo));
      }
      const std::string want = BoxBytes(t, box);
      std::string part(want.size(), '\0');
      ASSERT_OK((*reader)->ReadBox(**rec, box, std::as_writable_bytes(std::span(part))));
      ASSERT_TRUE(part == want) << box.ToString();
    }
  }
  reader->reset();
  SaveBoxes(**repo, "again");  // the same state today: in tiles
  auto again = (*repo)->OpenCheckpoint("again");
  ASSERT_OK(again.status());
  EXPECT_GT((*again)->FindTensor("tp")->shards.size(), kBoxRanks);
  auto verified = (*repo)->Verify(std::nullopt);
  ASSERT_OK(verified.status());
  EXPECT_TRUE(verified->ok());
}

}  // namespace
}  // namespace ckptfs
