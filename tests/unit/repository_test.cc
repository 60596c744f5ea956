// Save and load through the public API: sharding, resharding, dedup, the
// multi-rank protocol, bad input and damaged repositories.
#include "ckpt/repository.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstring>
#include <functional>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "backend/store_url.h"
#include "ckpt/describe.h"
#include "ckpt/repository_impl.h"
#include "test_repositories.h"
#include "test_util.h"

namespace ckptfs {
namespace {

using testing::RandomBytes;
using testing::TempDir;
using testing::RepoKind;

// A whole tensor in memory, the reference the store is checked against.
struct Ref {
  TensorInfo info;
  std::vector<std::byte> bytes;
  uint64_t w() const { return DTypeSize(info.dtype); }

  // Row-major bytes of `box`.
  std::vector<std::byte> Box(const ckptfs::Box& b) const {
    std::vector<std::byte> out(b.NumElements() * w());
    ForEachRun(b, SpaceOfBox(FullBox(info.shape)), SpaceOfBox(b), [&](uint64_t s, uint64_t d, uint64_t n) {
      std::memcpy(out.data() + d * w(), bytes.data() + s * w(), n * w());
    });
    return out;
  }
  std::vector<std::byte> Flat(uint64_t s, uint64_t e) const {
    return std::vector<std::byte>(bytes.begin() + s * w(), bytes.begin() + e * w());
  }
};

Ref MakeRef(const std::string& name, DType dtype, Shape shape, uint32_t seed) {
  Ref r{{name, dtype, shape}, {}};
  r.bytes = RandomBytes(NumElements(shape) * DTypeSize(dtype), seed);
  return r;
}

// A repository of one kind (test_repositories.h), opened as repo_.
class RepositoryFixture : public testing::RepositoryTest {
 protected:
  void Create(RepoKind kind) {
    OpenOptions opts;
    opts.threads = 3;
    opts.cache_bytes = 1 << 20;
    RepositoryTest::Create(kind, opts);
  }
  std::unique_ptr<CheckpointWriter> Begin(const std::string& name, uint32_t rank = 0, uint32_t world = 1) {
    auto w = repo_->BeginCheckpoint(name, {rank, world, 7, {}});
    EXPECT_OK(w);
    return w.ok() ? std::move(w).value() : nullptr;
  }
  void PutBox(CheckpointWriter& w, const Ref& r, const Box& b) {
    auto data = r.Box(b);
    HostSource src(data);
    ASSERT_OK(w.PutShard(r.info, Region::OfBox(b), src));
  }
  void PutFlat(CheckpointWriter& w, const Ref& r, uint64_t s, uint64_t e) {
    auto data = r.Flat(s, e);
    HostSource src(data);
    ASSERT_OK(w.PutShard(r.info, Region::OfFlat(s, e), src));
  }
  void ExpectWhole(const std::string& ckpt, const Ref& r) {
    auto reader = repo_->OpenCheckpoint(ckpt);
    ASSERT_OK(reader);
    const TensorRecord* t = (*reader)->FindTensor(r.info.name);
    ASSERT_NE(t, nullptr) << r.info.name;
    EXPECT_EQ(t->dtype, r.info.dtype);
    EXPECT_EQ(t->shape, r.info.shape);
    std::vector<std::byte> got(r.bytes.size());
    ASSERT_OK((*reader)->ReadBytes(*t, 0, got));
    EXPECT_TRUE(got == r.bytes) << r.info.name;
  }

};

// The conformance suite: what every kind of repository does alike, through
// the public API.
class SaveAndLoad : public testing::EachKind<RepositoryFixture> {};
INSTANTIATE_TEST_SUITE_P(Repositories, SaveAndLoad, testing::AllRepositoryKinds(), testing::RepoKindNamer());

// What a local repository does on its own: its files, processes on one
// host, its catalog.
class LocalRepository : public testing::LocalKind<RepositoryFixture> {};

TEST_P(SaveAndLoad, EveryDTypeWholeTensorsRoundTrip) {
  auto w = Begin("all-dtypes");
  std::vector<Ref> refs;
  for (int code = 0; code < kDTypeCount; ++code) {
    DType dt = *DTypeFromCode(code);
    refs.push_back(MakeRef(std::string("t.") + std::string(DTypeName(dt)), dt, {37, 129}, code));
  }
  refs.push_back(MakeRef("scalar", DType::kF32, {}, 99));
  refs.push_back(MakeRef("empty", DType::kBF16, {0, 8}, 98));
  refs.push_back(MakeRef("big", DType::kBF16, {300, 1000}, 97));  // spans many chunks and packs
  for (const auto& r : refs) ASSERT_OK(w->PutTensor(r.info, r.bytes));
  auto res = w->Commit().Wait();
  ASSERT_OK(res);
  EXPECT_TRUE(res->checkpoint_visible);
  w.reset();  // a writer keeps the repository open (repository.h, "Lifetimes")
  Reopen();
  for (const auto& r : refs) ExpectWhole("all-dtypes", r);
}

TEST_P(SaveAndLoad, BoxAndFlatShardsFromManyRanksReshardOnLoad) {
  Ref a = MakeRef("attn.qkv", DType::kF32, {64, 48}, 1);   // tensor parallel: column blocks
  Ref b = MakeRef("mlp.flat", DType::kBF16, {33, 77}, 2);  // FSDP: flat, uneven cuts
  Ref c = MakeRef("norm", DType::kF16, {48}, 3);           // replicated
  const uint32_t world = 4;
  const uint64_t nb = NumElements(b.info.shape);
  const uint64_t cuts[] = {0, 5, nb / 2 + 3, nb - 1, nb};
  std::vector<std::thread> ranks;
  for (uint32_t r = 0; r < world; ++r) {
    auto w = Begin("tp-fsdp", r, world);
    PutBox(*w, a, Box{{0, 12 * r}, {64, 12}});
    PutFlat(*w, b, cuts[r], cuts[r + 1]);
    PutBox(*w, c, FullBox(c.info.shape));
    auto res = w->Commit().Wait();
    ASSERT_OK(res);
    EXPECT_EQ(res->checkpoint_visible, r == world - 1);
    if (r + 1 < world) {
      EXPECT_TRUE(repo_->OpenCheckpoint("tp-fsdp").status().IsNotFound());
    }
  }
  ExpectWhole("tp-fsdp", a);
  ExpectWhole("tp-fsdp", b);
  ExpectWhole("tp-fsdp", c);
  auto reader = std::move(repo_->OpenCheckpoint("tp-fsdp")).value();
  // The replicated tensor is stored once, listing every rank.
  const TensorRecord* norm = reader->FindTensor("norm");
  ASSERT_EQ(norm->shards.size(), 1u);
  EXPECT_EQ(norm->shards[0].ranks.size(), world);
  // Random boxes and flat ranges (a new sharding) read back exactly.
  std::mt19937 rng(5);
  for (int i = 0; i < 200; ++i) {
    const Ref& r = i % 2 ? a : b;
    const TensorRecord* t = reader->FindTensor(r.info.name);
    ckptfs::Box box;
    for (uint64_t d : r.info.shape) {
      uint64_t lo = rng() % d, len = 1 + rng() % (d - lo);
      box.offsets.push_back(lo);
      box.lengths.push_back(len);
    }
    std::vector<std::byte> got(box.NumElements() * r.w());
    ASSERT_OK(reader->ReadBox(*t, box, got));
    ASSERT_TRUE(got == r.Box(box)) << r.info.name << " " << box.ToString();
    uint64_t n = NumElements(r.info.shape), s = rng() % n, e = s + rng() % (n - s + 1);
    std::vector<std::byte> flat((e - s) * r.w());
    ASSERT_OK(reader->ReadFlat(*t, {s, e}, flat));
    ASSERT_TRUE(flat == r.Flat(s, e));
    // Unaligned byte ranges.
    uint64_t bytes = r.bytes.size(), off = rng() % bytes, len = rng() % (bytes - off + 1);
    std::vector<std::byte> part(len);
    ASSERT_OK(reader->ReadBytes(*t, off, part));
    ASSERT_TRUE(std::equal(part.begin(), part.end(), r.bytes.begin() + off));
  }
}

TEST_P(SaveAndLoad, StagedCopiesOfBoxShardsAreLentTileByTileOrReadAndReadBackWhole) {
  // Row blocks: each tile of the grid is a run of whole rows, lent as it
  // is. Column blocks of rows longer than a chunk: tiles gather pieces of
  // many rows, read into buffers of the writer's.
  Ref rows = MakeRef("rows", DType::kF32, {512, 64}, 4);
  Ref wide = MakeRef("wide", DType::kF32, {8, 40000}, 5);
  const uint32_t world = 2;
  for (uint32_t r = 0; r < world; ++r) {
    auto w = Begin("staged", r, world);
    for (auto [ref, box] : {std::pair{&rows, Box{{256 * r, 0}, {256, 64}}},
                            std::pair{&wide, Box{{0, 20000 * r}, {8, 20000}}}}) {
      auto copy = std::make_shared<std::vector<std::byte>>(ref->Box(box));
      StableSource src(copy, *copy);
      ASSERT_OK(w->PutShard(ref->info, Region::OfBox(box), src));
    }  // the writer keeps the copies while it needs them
    ASSERT_OK(w->Commit().Wait());
  }
  ExpectWhole("staged", rows);
  ExpectWhole("staged", wide);
}

// A source that reads forward only, as one streaming from a device does:
// a read before the end of the one before fails.
class ForwardOnlySource final : public ShardSource {
 public:
  explicit ForwardOnlySource(std::span<const std::byte> data) : data_(data) {}
  uint64_t size() const override { return data_.size(); }
  Status Read(uint64_t offset, std::span<std::byte> dst) override {
    if (offset < next_) return Status::Internal("read backwards, at " + std::to_string(offset));
    if (offset > data_.size() || dst.size() > data_.size() - offset) return Status::InvalidArgument("past the end");
    std::memcpy(dst.data(), data_.data() + offset, dst.size());
    next_ = offset + dst.size();
    return Status::OK();
  }

 private:
  std::span<const std::byte> data_;
  uint64_t next_ = 0;
};

// Column blocks and the boxes of a 2-D mesh are stored as the tiles of
// their tensor's grid: saved again at another world size they are the same
// chunks, whatever the source, and every cut reads back exactly.
TEST_P(SaveAndLoad, ColumnAndMeshShardsShareTheirChunksAcrossWorldSizes) {
  Ref tp = MakeRef("tp", DType::kBF16, {256, 512}, 41);     // Shard(1)
  Ref mesh = MakeRef("mesh", DType::kF32, {128, 256}, 42);  // (Shard(0), Shard(1)) on a (world / 2, 2) mesh
  Ref odd = MakeRef("odd", DType::kF32, {100, 70}, 43);     // Shard(1), uneven (torch.chunk's cuts)
  const uint64_t logical = tp.bytes.size() + mesh.bytes.size();
  auto save = [&](const std::string& name, uint32_t world, bool forward_only) -> uint64_t {
    uint64_t stored = 0;
    for (uint32_t r = 0; r < world; ++r) {
      auto w = Begin(name, r, world);
      const uint64_t cols = 512 / world, rows = 128 / (world / 2), each = (70 + world - 1) / world;
      for (const auto& [ref, box] : {std::pair{&tp, Box{{0, cols * r}, {256, cols}}},
                                     std::pair{&mesh, Box{{rows * (r / 2), 128 * (r % 2)}, {rows, 128}}},
                                     std::pair{&odd, Box{{0, each * r}, {100, std::min(each, 70 - each * r)}}}}) {
        const std::vector<std::byte> data = ref->Box(box);
        HostSource host(data);
        ForwardOnlySource forward(data);
        ShardSource& src = forward_only ? static_cast<ShardSource&>(forward) : host;
        EXPECT_OK(w->PutShard(ref->info, Region::OfBox(box), src));
      }
      auto res = w->Commit().Wait();
      EXPECT_OK(res);
      if (res.ok()) stored += res->stored_bytes;
    }
    return stored;
  };
  const uint64_t at4 = save("w4", 4, false);
  const uint64_t at2 = save("w2", 2, false);
  const uint64_t streamed = save("streamed", 2, true);
  EXPECT_GT(at4, logical * 9 / 10);  // random bytes: stored as they are
  // Nothing new but the uneven tensor's tiles that the other cut splits.
  EXPECT_LT(at2, odd.bytes.size() + logical / 100);
  EXPECT_LT(streamed, logical / 100);
  for (const char* name : {"w4", "w2", "streamed"}) {
    SCOPED_TRACE(name);
    for (const Ref* ref : {&tp, &mesh, &odd}) ExpectWhole(name, *ref);
  }
  auto reader = std::move(repo_->OpenCheckpoint("w4")).value();
  const TensorRecord* cut = reader->FindTensor("tp");
  EXPECT_GT(cut->shards.size(), 4u);  // tiles
  EXPECT_EQ(DescribePlacement(*cut), "4 column blocks");
  EXPECT_EQ(DescribePlacement(*reader->FindTensor("mesh")), "4 boxes");
  EXPECT_EQ(DescribePlacement(*reader->FindTensor("odd")), "4 column blocks");
  auto half = std::move(repo_->OpenCheckpoint("w2")).value();
  EXPECT_EQ(DescribePlacement(*half->FindTensor("mesh")), "2 column blocks");
  // Any box of a tiled tensor reads back exactly.
  std::mt19937 rng(9);
  for (int i = 0; i < 100; ++i) {
    const Ref& ref = i % 2 ? tp : odd;
    ckptfs::Box box;
    for (uint64_t d : ref.info.shape) {
      const uint64_t lo = rng() % d;
      box.offsets.push_back(lo);
      box.lengths.push_back(1 + rng() % (d - lo));
    }
    std::vector<std::byte> got(box.NumElements() * ref.w());
    ASSERT_OK(reader->ReadBox(*reader->FindTensor(ref.info.name), box, got));
    ASSERT_TRUE(got == ref.Box(box)) << ref.info.name << " " << box.ToString();
  }
  auto verified = repo_->Verify(std::nullopt);
  ASSERT_OK(verified);
  EXPECT_TRUE(verified->ok());
}

TEST_P(SaveAndLoad, LoadTargetsAreCheckedAgainstTheRecordAndAnyRegionReads) {
  Ref a = MakeRef("w", DType::kBF16, {40, 30}, 21);
  auto w = Begin("targets");
  PutBox(*w, a, FullBox(a.info.shape));
  ASSERT_OK(w->Commit().Wait());
  auto reader = std::move(repo_->OpenCheckpoint("targets")).value();
  auto missing = reader->FindTarget("nope", DType::kBF16, {40, 30});
  EXPECT_TRUE(missing.status().IsNotFound());
  EXPECT_EQ(missing.status().message(), "checkpoint 'targets' has no tensor 'nope'");
  auto dtype = reader->FindTarget("w", DType::kF32, {40, 30});
  EXPECT_EQ(dtype.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(dtype.status().message(), "tensor 'w' of checkpoint 'targets' is BF16, the target is F32");
  auto shape = reader->FindTarget("w", DType::kBF16, {30, 40});
  EXPECT_EQ(shape.status().message(),
            "tensor 'w' of checkpoint 'targets' has shape [40, 30], the target expects [30, 40]");
  auto t = reader->FindTarget("w", DType::kBF16, {40, 30});
  ASSERT_OK(t);
  EXPECT_TRUE(reader->GetBlob("w").status().IsNotFound());
  // Contiguous boxes (whole rows), non-contiguous boxes and flat ranges.
  for (const Region& region : {Region::OfBox(FullBox(a.info.shape)), Region::OfBox(Box{{3, 0}, {10, 30}}),
                               Region::OfBox(Box{{3, 5}, {10, 7}}), Region::OfFlat(17, 901)}) {
    std::vector<std::byte> got(region.NumElements() * a.w());
    ASSERT_OK(reader->ReadRegion(**t, region, got));
    const auto want = region.kind == Region::Kind::kFlat ? a.Flat(region.flat.start, region.flat.end) : a.Box(region.box);
    EXPECT_TRUE(got == want) << region.ToString();
    if (region.kind == Region::Kind::kBox) {
      ASSERT_OK(reader->ReadBox(**t, region.box, got));
      EXPECT_TRUE(got == want) << region.ToString();
    }
  }
  std::vector<std::byte> small(8);
  EXPECT_EQ(reader->ReadRegion(**t, Region::OfFlat(0, 5), small).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(reader->ReadRegion(**t, Region::OfBox(Box{{39, 0}, {2, 30}}), small).code(),
            StatusCode::kInvalidArgument);
}

// Reads of a tensor in many shards go through the reader's index of them
// (built at the first read); a copy of the record, which is not the
// reader's, is read by scanning every shard. Both give the saved bytes.
TEST_P(SaveAndLoad, ATensorInManyShardsReadsTheSameThroughItsIndexAndByAScan) {
  Ref rows = MakeRef("rows", DType::kF32, {96, 40}, 31);   // 48 row shards over 4 ranks
  Ref cols = MakeRef("cols", DType::kBF16, {32, 80}, 32);  // 20 column shards, the first 4 twice
  const uint32_t world = 4;
  for (uint32_t r = 0; r < world; ++r) {
    auto w = Begin("many", r, world);
    for (uint64_t s = r; s < 48; s += world) PutBox(*w, rows, Box{{2 * s, 0}, {2, 40}});
    for (uint64_t s = r; s < 20; s += world) PutBox(*w, cols, Box{{0, 4 * s}, {32, 4}});
    if (r == 1) {
      for (uint64_t s = 0; s < 4; ++s) PutBox(*w, cols, Box{{0, 4 * s}, {32, 4}});  // replicas
    }
    ASSERT_OK(w->Commit().Wait());
  }
  {
    // Readers racing on a tensor's first read: one builds its index, the
    // others wait for it.
    auto fresh = std::move(repo_->OpenCheckpoint("many")).value();
    const TensorRecord* t = fresh->FindTensor("rows");
    ASSERT_NE(t, nullptr);
    std::vector<std::vector<std::byte>> got(4, std::vector<std::byte>(rows.bytes.size()));
    std::vector<Status> st(got.size());
    std::vector<std::thread> threads;
    for (size_t i = 0; i < got.size(); ++i) threads.emplace_back([&, i] { st[i] = fresh->ReadBytes(*t, 0, got[i]); });
    for (auto& th : threads) th.join();
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_OK(st[i]);
      EXPECT_TRUE(got[i] == rows.bytes) << "reader " << i;
    }
  }
  auto reader = std::move(repo_->OpenCheckpoint("many")).value();
  std::mt19937_64 rng(11);
  for (const Ref* ref : {&rows, &cols}) {
    const TensorRecord* t = reader->FindTensor(ref->info.name);
    ASSERT_NE(t, nullptr);
    ASSERT_GE(t->shards.size(), 20u);
    const TensorRecord copy = *t;
    const uint64_t total = ref->bytes.size();
    for (int q = 0; q < 60; ++q) {
      const uint64_t off = q == 0 ? 0 : rng() % total;
      const uint64_t len = q == 0 ? total : 1 + rng() % (total - off);
      const std::vector<std::byte> want(ref->bytes.begin() + off, ref->bytes.begin() + off + len);
      std::vector<std::byte> indexed(len), scanned(len);
      ASSERT_OK(reader->ReadBytes(*t, off, indexed));
      ASSERT_OK(reader->ReadBytes(copy, off, scanned));
      ASSERT_TRUE(indexed == want) << ref->info.name << " bytes " << off << "+" << len;
      ASSERT_TRUE(scanned == want) << ref->info.name << " bytes " << off << "+" << len;
      // The mount's path: slices of the decoded chunks.
      const uint64_t w = ref->w();
      const uint64_t a = off / w * w, alen = std::max<uint64_t>(w, len / w * w);
      if (a + alen <= total) {
        std::vector<ChunkSlice> slices;
        auto sliced = reader->SliceBytes(*t, a, alen, 1 << 20, slices);
        ASSERT_OK(sliced);
        ASSERT_TRUE(*sliced);
        std::vector<std::byte> joined;
        for (const ChunkSlice& sl : slices) {
          joined.insert(joined.end(), sl.data->data() + sl.offset, sl.data->data() + sl.offset + sl.length);
        }
        ASSERT_TRUE(joined == std::vector<std::byte>(ref->bytes.begin() + a, ref->bytes.begin() + a + alen));
      }
      const uint64_t r0 = rng() % ref->info.shape[0], c0 = rng() % ref->info.shape[1];
      const Box box{{r0, c0}, {1 + rng() % (ref->info.shape[0] - r0), 1 + rng() % (ref->info.shape[1] - c0)}};
      std::vector<std::byte> got(box.NumElements() * w);
      ASSERT_OK(reader->ReadBox(*t, box, got));
      ASSERT_TRUE(got == ref->Box(box)) << ref->info.name << " " << box.ToString();
    }
  }
}

TEST_P(SaveAndLoad, RanksCommittingAtOnceMakeOneVisibleCheckpoint) {
  // Commits read the catalog, merge outside the write transaction and
  // publish only if nothing changed meanwhile: ranks racing each other must
  // still end with exactly one last rank and every part recorded.
  Ref a = MakeRef("w", DType::kF32, {64, 40}, 31);
  const uint32_t world = 8;
  for (int round = 0; round < 3; ++round) {
    const std::string name = "race-" + std::to_string(round);
    std::vector<std::unique_ptr<CheckpointWriter>> writers;
    for (uint32_t r = 0; r < world; ++r) {
      writers.push_back(Begin(name, r, world));
      PutBox(*writers.back(), a, Box{{8 * r, 0}, {8, 40}});
    }
    std::vector<CommitHandle> handles;
    for (auto& w : writers) handles.push_back(w->Commit());
    int visible = 0;
    for (auto& h : handles) {
      auto res = h.Wait();
      ASSERT_OK(res);
      visible += res->checkpoint_visible ? 1 : 0;
    }
    EXPECT_EQ(visible, 1) << name;
    ExpectWhole(name, a);
  }
  auto list = repo_->ListCheckpoints();
  ASSERT_OK(list);
  ASSERT_EQ(list->size(), 3u);
  // Commit order is the sequence, without gaps.
  for (size_t i = 0; i < list->size(); ++i) EXPECT_EQ((*list)[i].sequence, i + 1);
}

// A job killed during a save leaves some ranks of it pending; the job
// restarted (at another world size too) saves the same name as a new
// attempt, which abandons the crashed one's parts and never merges them.
TEST_P(SaveAndLoad, ASaveAttemptAfterACrashAbandonsTheCrashedAttemptsParts) {
  Ref old_bytes = MakeRef("w", DType::kF32, {64, 40}, 41);
  Ref new_bytes = MakeRef("w", DType::kF32, {64, 40}, 42);
  // Rank `rank` of `world` of checkpoint step-STEP, as save attempt `attempt`.
  auto begin = [&](int64_t step, uint32_t rank, uint32_t world, const std::string& attempt) {
    WriterOptions o{rank, world, step, {}};
    o.attempt = attempt;
    return repo_->BeginCheckpoint("step-" + std::to_string(step), o);
  };
  // That rank's rows of `ref` (the world's equal row blocks), committed.
  auto save_rows = [&](int64_t step, uint32_t rank, uint32_t world, const std::string& attempt,
                       const Ref& ref) -> Result<CommitResult> {
    CKPT_ASSIGN_OR_RETURN(auto w, begin(step, rank, world, attempt));
    const uint64_t rows = 64 / world;
    PutBox(*w, ref, Box{{rows * rank, 0}, {rows, 40}});
    return w->Commit().Wait();
  };
  // A later attempt than `than`, even on a clock that did not move.
  auto later = [](const std::string& than) {
    std::string a = NewSaveAttempt();
    return a > than ? a : than + "0";
  };

  const std::string crashed = NewSaveAttempt();
  for (uint32_t r : {0u, 2u}) ASSERT_OK(save_rows(8, r, 4, crashed, old_bytes));  // 2 of 4 in, then the job dies
  auto straggler = begin(8, 1, 4, crashed);  // a rank of the crashed job still at work
  ASSERT_OK(straggler);
  PutBox(**straggler, old_bytes, Box{{16, 0}, {16, 40}});
  // Ranks without an attempt do not join, nor does an attempt older than
  // the pending one's.
  EXPECT_EQ(begin(8, 1, 4, "").status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(begin(8, 1, 4, "0000000000000001-00").status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(begin(8, 0, 2, std::string(kMaxAttemptSize + 1, 'a')).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(begin(8, 0, 2, "two words").status().code(), StatusCode::kInvalidArgument);

  // The restarted job, at world size 2.
  const std::string restarted = later(crashed);
  auto first = save_rows(8, 0, 2, restarted, new_bytes);
  ASSERT_OK(first);
  EXPECT_FALSE(first->checkpoint_visible);
  // The straggler's commit never makes its part count: the catalog refuses
  // it; on a store, whose listing does not show attempts, its part is
  // recorded but never merged with the new attempt's.
  auto late = (*straggler)->Commit().Wait();
  if (late.ok()) {
    EXPECT_NE(GetParam(), RepoKind::kLocal);
    EXPECT_FALSE(late->checkpoint_visible);
  } else {
    EXPECT_EQ(late.status().code(), StatusCode::kFailedPrecondition) << late.status().ToString();
  }
  auto last = save_rows(8, 1, 2, restarted, new_bytes);
  ASSERT_OK(last);
  EXPECT_TRUE(last->checkpoint_visible);
  ExpectWhole("step-8", new_bytes);
  auto rec = repo_->GetCheckpoint("step-8");
  ASSERT_OK(rec);
  EXPECT_EQ(rec->world_size, 2u);
  EXPECT_EQ(rec->step, 8);
  EXPECT_TRUE(rec->attempt.empty());
  EXPECT_EQ(begin(8, 1, 4, crashed).status().code(), StatusCode::kAlreadyExists);
  ExpectVerifies();
  // gc finds nothing of the crashed attempt still referenced.
  ASSERT_OK(repo_->CollectGarbage(GcOptions{}));
  ExpectWhole("step-8", new_bytes);

  // Restarted at the same world size, the new attempt's ranks replace the
  // crashed one's parts rank by rank, in any order.
  const std::string crashed_again = NewSaveAttempt();
  for (uint32_t r : {1u, 3u}) ASSERT_OK(save_rows(9, r, 4, crashed_again, old_bytes));
  const std::string again = later(crashed_again);
  int visible = 0;
  for (uint32_t r : {3u, 0u, 2u, 1u}) {
    auto res = save_rows(9, r, 4, again, new_bytes);
    ASSERT_OK(res);
    visible += res->checkpoint_visible;
  }
  EXPECT_EQ(visible, 1);
  ExpectWhole("step-9", new_bytes);
}

// A save with WriterOptions::overwrite replaces a committed name when it
// commits, in one step: until then the old version is the name's, after it
// the new one, and a reader holding the old version keeps reading it until
// it lets go and gc runs.
TEST_P(SaveAndLoad, AnOverwritingSaveReplacesTheNameAtItsCommitAndOldReadersKeepTheirVersion) {
  Ref old_bytes = MakeRef("w", DType::kF32, {64, 40}, 51);
  Ref new_bytes = MakeRef("w", DType::kF32, {64, 40}, 52);
  auto begin = [&](uint32_t rank, uint32_t world, bool overwrite, const std::string& attempt = "") {
    WriterOptions o{rank, world, 5, {}};
    o.overwrite = overwrite;
    o.attempt = attempt;
    return repo_->BeginCheckpoint("m", o);
  };
  {
    auto w = begin(0, 1, /*overwrite=*/true);  // nothing to replace yet
    ASSERT_OK(w);
    PutBox(**w, old_bytes, Box{{0, 0}, {64, 40}});
    auto res = (*w)->Commit().Wait();
    ASSERT_OK(res);
    EXPECT_TRUE(res->checkpoint_visible);
  }
  ExpectWhole("m", old_bytes);
  auto old_reader = repo_->OpenCheckpoint("m");
  ASSERT_OK(old_reader);

  // Refused without overwrite, and a save of many ranks needs its attempt.
  EXPECT_EQ(begin(0, 1, false).status().code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(begin(0, 2, true).status().code(), StatusCode::kInvalidArgument);

  const std::string attempt = NewSaveAttempt();
  std::vector<std::unique_ptr<CheckpointWriter>> writers;
  for (uint32_t r = 0; r < 2; ++r) {
    auto w = begin(r, 2, true, attempt);
    ASSERT_OK(w);
    PutBox(**w, new_bytes, Box{{32 * r, 0}, {32, 40}});
    writers.push_back(std::move(w).value());
  }
  auto first = writers[0]->Commit().Wait();
  ASSERT_OK(first);
  EXPECT_FALSE(first->checkpoint_visible);
  // Half way: the name is the old version; the replacement is pending.
  ExpectWhole("m", old_bytes);
  auto pending = repo_->PendingRanks("m~");  // syncs first, on a store
  ASSERT_OK(pending);
  auto all = repo_->ListCheckpoints(/*include_pending=*/true);
  ASSERT_OK(all);
  ASSERT_EQ(all->size(), 2u);
  EXPECT_EQ((*all)[0].name, "m");
  EXPECT_EQ((*all)[1].name, "m~");
  EXPECT_NE((*all)[1].state, CheckpointState::kCommitted);
  auto last = writers[1]->Commit().Wait();
  ASSERT_OK(last);
  EXPECT_TRUE(last->checkpoint_visible);

  ExpectWhole("m", new_bytes);
  auto listed = repo_->ListCheckpoints(/*include_pending=*/true);
  ASSERT_OK(listed);
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].name, "m");
  EXPECT_EQ((*listed)[0].world_size, 2u);
  EXPECT_EQ((*listed)[0].state, CheckpointState::kCommitted);
  if (GetParam() != RepoKind::kLocal) {
    // Another host sees the new version too.
    auto other = where_.Open(open_, "host2");
    ASSERT_OK(other);
    auto r = (*other)->OpenCheckpoint("m");
    ASSERT_OK(r);
    std::vector<std::byte> got(new_bytes.bytes.size());
    ASSERT_OK((*r)->ReadBytes(*(*r)->FindTensor("w"), 0, got));
    EXPECT_TRUE(got == new_bytes.bytes);
  }

  // The old version's reader, across a gc: its bytes stay while it reads.
  auto read_old = [&] {
    std::vector<std::byte> got(old_bytes.bytes.size());
    ASSERT_OK((*old_reader)->ReadBytes(*(*old_reader)->FindTensor("w"), 0, got));
    EXPECT_TRUE(got == old_bytes.bytes);
  };
  auto gc = repo_->CollectGarbage(GcOptions{});
  ASSERT_OK(gc);
  EXPECT_EQ(gc->retired_kept, 1u);
  read_old();
  old_reader->reset();
  writers.clear();
  LeasesLetGo();
  gc = repo_->CollectGarbage(GcOptions{});
  ASSERT_OK(gc);
  EXPECT_EQ(gc->retired_collected, 1u);
  ExpectWhole("m", new_bytes);
  ExpectVerifies();
  // Nothing of the old version is left: its chunks went with it.
  auto du = repo_->DiskUsage({});
  ASSERT_OK(du);
  EXPECT_EQ(du->unreferenced_bytes, 0u);
  EXPECT_EQ(du->retired_bytes, 0u);
  EXPECT_EQ(du->pending_bytes, 0u);
}

// A replacing save whose process dies after its commit but before the
// rename leaves the replacement committed under "NAME~": the name keeps its
// old version, and the next replacing save (or gc) drops the leftover.
TEST(Overwrite, AReplacementLeftByACrashBeforeItsRenameIsDroppedByTheNextSaveAndByGc) {
  class NoRename : public BackendWrapper {
   public:
    using BackendWrapper::BackendWrapper;
    Status Put(std::string_view key, std::span<const std::byte> data) override {
      if (failing && key.ends_with("manifests/m.manifest")) return Status::IOError("the host died");
      return BackendWrapper::Put(key, data);
    }
    bool failing = false;
  };
  TempDir dir;
  auto store = std::make_shared<NoRename>(NewMemoryBackend());
  ASSERT_OK(Repository::Init(*store, RepositoryConfig{}));
  OpenOptions o;
  o.cache_dir = dir.path() + "/cache";
  auto repo = Repository::Open(store, o);
  ASSERT_OK(repo);
  auto save = [&](uint8_t fill, const std::string& name = "m") -> Result<CommitResult> {
    WriterOptions w;
    w.overwrite = true;
    CKPT_ASSIGN_OR_RETURN(auto writer, (*repo)->BeginCheckpoint(name, w));
    std::vector<std::byte> bytes(1000, std::byte{fill});
    CKPT_RETURN_IF_ERROR(writer->PutTensor({"t", DType::kU8, {1000}}, bytes));
    return writer->Commit().Wait();
  };
  auto holds = [&](uint8_t fill) {
    auto r = (*repo)->OpenCheckpoint("m");
    ASSERT_OK(r);
    std::vector<std::byte> got(1000);
    ASSERT_OK((*r)->ReadBytes(*(*r)->FindTensor("t"), 0, got));
    EXPECT_EQ(got[0], std::byte{fill});
  };
  ASSERT_OK(save(1));
  store->failing = true;
  auto crashed = save(2);
  EXPECT_EQ(crashed.status().code(), StatusCode::kIOError);
  EXPECT_NE(crashed.status().message().find("replacing checkpoint 'm'"), std::string::npos) << crashed.status().ToString();
  store->failing = false;
  holds(1);
  auto listed = (*repo)->ListCheckpoints(true);
  ASSERT_OK(listed);
  EXPECT_EQ(listed->size(), 1u);  // the leftover is not listed
  ASSERT_OK(store->Size("objects/manifests/m~.manifest"));
  ASSERT_OK(save(3));
  holds(3);
  EXPECT_TRUE(store->Size("objects/manifests/m~.manifest").status().IsNotFound());

  store->failing = true;
  EXPECT_FALSE(save(4).ok());
  store->failing = false;
  ASSERT_OK((*repo)->CollectGarbage(GcOptions{}));
  EXPECT_TRUE(store->Size("objects/manifests/m~.manifest").status().IsNotFound());
  holds(3);
  auto du = (*repo)->DiskUsage({});  // the dropped replacement's bytes are nobody's now
  ASSERT_OK(du);
  EXPECT_EQ(du->pending_bytes, 0u);
  auto v = (*repo)->Verify(std::nullopt);
  ASSERT_OK(v);
  EXPECT_TRUE(v->ok());
}

TEST_P(SaveAndLoad, FlatShardsDeduplicateAcrossWorldSizes) {
  Ref p = MakeRef("flat.param", DType::kF32, {1000, 257}, 11);  // ~1 MiB, 16 chunks
  const uint64_t n = NumElements(p.info.shape);
  {
    auto w = Begin("ws2", 0, 1);
    PutFlat(*w, p, 0, n / 2 + 17);
    PutFlat(*w, p, n / 2 + 17, n);
    ASSERT_OK(w->Commit().Wait());
  }
  uint64_t written = 0, deduped = 0;
  for (uint32_t r = 0; r < 3; ++r) {
    auto w = Begin("ws3", r, 3);
    PutFlat(*w, p, n * r / 3 + r, r == 2 ? n : n * (r + 1) / 3 + r + 1);
    auto res = w->Commit().Wait();
    ASSERT_OK(res);
    written += res->chunks_written;
    deduped += res->chunks_deduplicated;
  }
  // Chunk boundaries follow global byte offsets: every chunk but those cut by
  // a rank boundary is found again.
  EXPECT_GE(deduped, 12u);
  EXPECT_LE(written, 6u);
  ExpectWhole("ws3", p);
}

TEST_P(SaveAndLoad, SecondSaveOfSameStateStoresNothingNew) {
  Ref a = MakeRef("w", DType::kBF16, {512, 512}, 1);
  for (const char* name : {"v1", "v2"}) {
    auto w = Begin(name);
    ASSERT_OK(w->PutTensor(a.info, a.bytes));
    auto res = w->Commit().Wait();
    ASSERT_OK(res);
    if (std::string(name) == "v2") {
      EXPECT_EQ(res->chunks_written, 0u);
      EXPECT_EQ(res->stored_bytes, 0u);
    }
  }
  ExpectWhole("v2", a);
}

TEST_P(SaveAndLoad, BlobsRoundTrip) {
  auto w = Begin("with-blobs");
  auto rng_state = RandomBytes(200 << 10, 4);
  ASSERT_OK(w->PutBlob("rng/rank0", rng_state));
  ASSERT_OK(w->PutBlob("empty", {}));
  EXPECT_FALSE(w->PutBlob("empty", {}).ok());
  ASSERT_OK(w->Commit().Wait());
  auto reader = std::move(repo_->OpenCheckpoint("with-blobs")).value();
  const BlobRecord* b = reader->FindBlob("rng/rank0");
  ASSERT_NE(b, nullptr);
  std::vector<std::byte> got(b->size);
  ASSERT_OK(reader->ReadBlob(*b, 0, got));
  EXPECT_EQ(got, rng_state);
  EXPECT_EQ(reader->FindBlob("empty")->size, 0u);
}

// A blob written in pieces of any size (a file written through fsspec)
// has the chunks of the same bytes put whole, so each dedups against the
// other.
TEST_P(SaveAndLoad, ABlobStreamedInPiecesHasTheChunksOfTheWholeAndReadsBack) {
  const auto bytes = RandomBytes(3 << 20, 43);
  auto whole = Begin("whole");
  ASSERT_OK(whole->PutBlob("state.bin", bytes));
  ASSERT_OK(whole->Commit().Wait());
  auto w = Begin("streamed");
  EXPECT_EQ(w->AppendBlob(bytes).code(), StatusCode::kFailedPrecondition);  // no blob begun
  ASSERT_OK(w->BeginBlob("state.bin"));
  EXPECT_EQ(w->BeginBlob("other").code(), StatusCode::kFailedPrecondition);  // one at a time
  std::mt19937 rng(44);
  for (size_t at = 0; at < bytes.size();) {
    // Mostly small writes, some larger than a pooled buffer.
    const size_t n = std::min<size_t>(bytes.size() - at, rng() % 8 == 0 ? rng() % (3 << 20) : rng() % 5000);
    ASSERT_OK(w->AppendBlob(std::span(bytes).subspan(at, n)));
    at += n;
  }
  ASSERT_OK(w->EndBlob());
  ASSERT_OK(w->BeginBlob("empty"));
  ASSERT_OK(w->EndBlob());
  EXPECT_EQ(w->BeginBlob("state.bin").code(), StatusCode::kInvalidArgument);  // put twice
  auto res = w->Commit().Wait();
  ASSERT_OK(res);
  EXPECT_EQ(res->chunks_written, 0u);  // every chunk was the whole blob's
  EXPECT_EQ(res->logical_bytes, bytes.size());
  auto a = std::move(repo_->OpenCheckpoint("whole")).value();
  auto b = std::move(repo_->OpenCheckpoint("streamed")).value();
  ASSERT_NE(b->FindBlob("state.bin"), nullptr);
  EXPECT_EQ(b->FindBlob("state.bin")->chunks, a->FindBlob("state.bin")->chunks);
  std::vector<std::byte> got(bytes.size());
  ASSERT_OK(b->ReadBlob(*b->FindBlob("state.bin"), 0, got));
  EXPECT_EQ(got, bytes);
  EXPECT_EQ(b->FindBlob("empty")->size, 0u);
  // A writer whose blob is still open cannot commit, and leaves nothing.
  auto open = Begin("open");
  ASSERT_OK(open->BeginBlob("x"));
  ASSERT_OK(open->AppendBlob(std::span(bytes).first(1000)));
  EXPECT_EQ(open->Commit().Wait().status().code(), StatusCode::kFailedPrecondition);
  open.reset();
  EXPECT_TRUE(repo_->OpenCheckpoint("open").status().IsNotFound());
}

// A unit inside a streamed blob (a tensor's bytes in a torch.save or
// safetensors file) is cut at its ends and at fixed offsets from its start:
// it keeps its chunks when the bytes before it change length, and they are
// the chunks of the same bytes put as a flat tensor.
TEST_P(SaveAndLoad, AUnitInAStreamedBlobHasTheChunksOfTheSameBytesPutAsATensor) {
  const uint64_t chunk_size = repo_->config().chunk_size;
  const auto unit = RandomBytes(2 * chunk_size + 12345, 45);
  auto t = Begin("tensor");
  ASSERT_OK(t->PutTensor({"u", DType::kU8, {unit.size()}}, unit));
  ASSERT_OK(t->Commit().Wait());
  const std::vector<ChunkRef> tensor_chunks =
      std::move(repo_->OpenCheckpoint("tensor")).value()->FindTensor("u")->shards.at(0).chunks;
  ASSERT_EQ(tensor_chunks.size(), 3u);
  std::vector<std::byte> whole[2];
  for (int round = 0; round < 2; ++round) {
    const auto head = RandomBytes(round == 0 ? 1000 : 1777, 46 + round);  // other bytes, another length
    const auto tail = RandomBytes(5000, 48);
    const std::string name = "file-" + std::to_string(round);
    auto w = Begin(name);
    ASSERT_OK(w->BeginBlob("f"));
    ASSERT_OK(w->AppendBlob(std::span(head).first(600)));
    ASSERT_OK(w->AppendBlob(std::span(head).subspan(600)));
    ASSERT_OK(w->AppendBlob(unit, BlobPiece::kUnit));
    ASSERT_OK(w->AppendBlob(tail));
    ASSERT_OK(w->EndBlob());
    auto res = w->Commit().Wait();
    ASSERT_OK(res);
    auto reader = std::move(repo_->OpenCheckpoint(name)).value();
    const BlobRecord* b = reader->FindBlob("f");
    ASSERT_NE(b, nullptr);
    // The head's chunks end where the unit starts, and the unit's are the tensor's.
    size_t at = 0;
    for (uint64_t bytes = 0; bytes < head.size() && at < b->chunks.size(); ++at) bytes += b->chunks[at].raw_len;
    ASSERT_LE(at + 3, b->chunks.size());
    uint64_t head_bytes = 0;
    for (size_t i = 0; i < at; ++i) head_bytes += b->chunks[i].raw_len;
    EXPECT_EQ(head_bytes, head.size());
    EXPECT_EQ(std::vector<ChunkRef>(b->chunks.begin() + at, b->chunks.begin() + at + 3), tensor_chunks);
    // New chunks: the head and the tail the first time, the head alone the second.
    EXPECT_EQ(res->chunks_written, round == 0 ? b->chunks.size() - 3 : at);
    whole[round] = head;
    whole[round].insert(whole[round].end(), unit.begin(), unit.end());
    whole[round].insert(whole[round].end(), tail.begin(), tail.end());
    std::vector<std::byte> got(whole[round].size());
    ASSERT_OK(reader->ReadBlob(*b, 0, got));
    EXPECT_EQ(got, whole[round]);
  }
}

// A read of a blob of many chunks (a file of a checkpoint read through
// ckptfs://) fetches and decodes them on the repository's threads: the
// bytes are the blob's, from any offset.
TEST_P(SaveAndLoad, ALargeBlobReadAcrossManyChunksIsItsBytes) {
  const auto bytes = RandomBytes(20 << 20, 57);
  auto w = Begin("big");
  ASSERT_OK(w->PutBlob("f", bytes));
  ASSERT_OK(w->Commit().Wait());
  auto reader = std::move(repo_->OpenCheckpoint("big")).value();
  const BlobRecord* b = reader->FindBlob("f");
  ASSERT_NE(b, nullptr);
  ASSERT_GT(b->chunks.size(), 8u);
  for (const auto& [offset, n] : {std::pair<uint64_t, uint64_t>{0, bytes.size()}, {12345, (9 << 20) + 7},
                                  {bytes.size() - (8 << 20), 8 << 20}}) {
    std::vector<std::byte> got(n);
    ASSERT_OK(reader->ReadBlob(*b, offset, got));
    EXPECT_TRUE(std::equal(got.begin(), got.end(), bytes.begin() + offset)) << offset;
  }
  std::vector<std::byte> past(2);
  EXPECT_EQ(reader->ReadBlob(*b, bytes.size() - 1, past).code(), StatusCode::kInvalidArgument);
}

// Blobs are chunked by their content: bytes inserted or removed in one
// place cost the chunks around that place, and every other chunk is the
// one the last save stored (a file whose header grew, a log with lines
// added in the middle).
TEST_P(SaveAndLoad, ABlobKeepsTheChunksOfItsUnchangedBytesWhenBytesBeforeThemChangeLength) {
  const auto first = RandomBytes(1 << 20, 41);
  std::vector<std::byte> second(first.begin(), first.begin() + (300 << 10));
  const auto inserted = RandomBytes(1000, 42);
  second.insert(second.end(), inserted.begin(), inserted.end());
  second.insert(second.end(), first.begin() + (300 << 10), first.begin() + (700 << 10));
  second.insert(second.end(), first.begin() + (700 << 10) + 2000, first.end());  // 2000 bytes removed
  const uint64_t chunk_size = repo_->config().chunk_size;
  std::vector<std::vector<ChunkRef>> chunks;
  for (const std::vector<std::byte>* bytes : {&first, const_cast<const std::vector<std::byte>*>(&second)}) {
    const std::string name = "cdc-" + std::to_string(chunks.size());
    auto w = Begin(name);
    ASSERT_OK(w->PutBlob("log", *bytes));
    ASSERT_OK(w->Commit().Wait());
    auto reader = std::move(repo_->OpenCheckpoint(name)).value();
    const BlobRecord* b = reader->FindBlob("log");
    ASSERT_NE(b, nullptr);
    std::vector<std::byte> got(b->size);
    ASSERT_OK(reader->ReadBlob(*b, 0, got));
    EXPECT_TRUE(got == *bytes);
    for (size_t i = 0; i < b->chunks.size(); ++i) {
      EXPECT_LE(b->chunks[i].raw_len, chunk_size / 8);
      if (i + 1 < b->chunks.size()) {
        EXPECT_GE(b->chunks[i].raw_len, chunk_size / 16 / 8);
      }
    }
    chunks.push_back(b->chunks);
  }
  std::set<ChunkId> before;
  for (const ChunkRef& c : chunks[0]) before.insert(c.id);
  uint64_t new_bytes = 0;
  for (const ChunkRef& c : chunks[1]) {
    if (!before.count(c.id)) new_bytes += c.raw_len;
  }
  // Each edit costs the chunk it falls in and, at worst, a few after it
  // until the cuts agree again: here at most 4 of the largest chunks each.
  EXPECT_LE(new_bytes, 1000 + 2 * 4 * (chunk_size / 8)) << new_bytes << " new bytes";
  EXPECT_LT(new_bytes, second.size() / 10);
}

// A checkpoint made of blobs other checkpoints stored (a directory of
// staged files renamed into place): nothing but the manifest is written,
// it reads back bit-exact, and it keeps its chunks when its sources go.
TEST_P(SaveAndLoad, AComposedCheckpointTakesStoredBlobsWithoutStoringAByte) {
  const auto x = RandomBytes(300 << 10, 51), y = RandomBytes(5000, 52), z = RandomBytes(100 << 10, 53);
  auto a = Begin("staged/a");
  ASSERT_OK(a->PutBlob("x", x));
  ASSERT_OK(a->PutBlob("y", y));
  ASSERT_OK(a->Commit().Wait());
  auto b = Begin("staged/b");
  ASSERT_OK(b->PutBlob("z", z));
  ASSERT_OK(b->Commit().Wait());
  a.reset();
  b.reset();
  WriterOptions o;
  o.step = 9;
  auto made = repo_->ComposeCheckpoint("run/step-9", {{"staged/a", "x", "one"}, {"staged/b", "z", "sub/two"}}, o);
  ASSERT_OK(made);
  EXPECT_TRUE(made->checkpoint_visible);
  EXPECT_EQ(made->chunks_written, 0u);
  EXPECT_EQ(made->stored_bytes, 0u);
  EXPECT_EQ(made->logical_bytes, x.size() + z.size());
  ASSERT_OK(repo_->RemoveCheckpoints({"staged/a", "staged/b"}));
  ASSERT_OK(repo_->CollectGarbage(GcOptions{}));
  Reopen();
  auto reader = std::move(repo_->OpenCheckpoint("run/step-9")).value();
  EXPECT_EQ(reader->info().step, std::optional<int64_t>(9));
  for (const auto& [name, bytes] : {std::pair{"one", &x}, std::pair{"sub/two", &z}}) {
    const BlobRecord* rec = reader->FindBlob(name);
    ASSERT_NE(rec, nullptr) << name;
    std::vector<std::byte> got(rec->size);
    ASSERT_OK(reader->ReadBlob(*rec, 0, got));
    EXPECT_TRUE(got == *bytes) << name;
  }
  EXPECT_EQ(reader->blobs().size(), 2u);
  auto verified = repo_->Verify(std::nullopt);
  ASSERT_OK(verified);
  EXPECT_TRUE(verified->ok());

  // What is refused, with nothing committed.
  EXPECT_TRUE(repo_->ComposeCheckpoint("c", {{"gone", "x", "x"}}, {}).status().IsNotFound());
  EXPECT_TRUE(repo_->ComposeCheckpoint("c", {{"run/step-9", "nothing", "x"}}, {}).status().IsNotFound());
  EXPECT_EQ(repo_->ComposeCheckpoint("c", {{"run/step-9", "one", "same"}, {"run/step-9", "sub/two", "same"}}, {})
                .status()
                .code(),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE(repo_->ComposeCheckpoint("run/step-9", {{"run/step-9", "one", "one"}}, {}).status().IsAlreadyExists());
  EXPECT_TRUE(repo_->OpenCheckpoint("c").status().IsNotFound());
  // With overwrite, a checkpoint made again of its own blobs (one dropped).
  WriterOptions replace;
  replace.overwrite = true;
  ASSERT_OK(repo_->ComposeCheckpoint("run/step-9", {{"run/step-9", "sub/two", "two"}}, replace));
  auto again = std::move(repo_->OpenCheckpoint("run/step-9")).value();
  ASSERT_EQ(again->blobs().size(), 1u);
  std::vector<std::byte> got(z.size());
  ASSERT_OK(again->ReadBlob(*again->FindBlob("two"), 0, got));
  EXPECT_TRUE(got == z);
}

// Tensors of a checkpoint made of files (a DCP directory written through
// ckptfs://): each shard is a unit of a streamed blob, referenced in place,
// and reads back as the tensor; a range off the chunk boundaries, shards
// that disagree, or shards that do not tile the tensor are refused.
TEST_P(SaveAndLoad, AComposedCheckpointTakesTensorsFromUnitsOfStoredBlobs) {
  const uint64_t chunk_size = repo_->config().chunk_size;
  const uint64_t rows = 3, cols = chunk_size / 4 / 2 + 5;  // f32 rows: a shard of 2 rows spans 2 chunks and a bit
  const auto all = RandomBytes(rows * cols * 4, 54);
  const auto head = RandomBytes(777, 55);
  const uint64_t split = 2 * cols * 4;  // rows [0, 2) in the first unit, row 2 in the second
  auto w = Begin("_fsspec/f");
  ASSERT_OK(w->BeginBlob("file"));
  ASSERT_OK(w->AppendBlob(head));
  ASSERT_OK(w->AppendBlob(std::span(all).first(split), BlobPiece::kUnit));
  ASSERT_OK(w->AppendBlob(head));
  ASSERT_OK(w->AppendBlob(std::span(all).subspan(split), BlobPiece::kUnit));
  ASSERT_OK(w->EndBlob());
  ASSERT_OK(w->Commit().Wait());
  w.reset();
  const TensorInfo info{"layer.weight", DType::kF32, {rows, cols}};
  auto box = [&](uint64_t row, uint64_t n) { return Region::OfBox(Box{{row, 0}, {n, cols}}); };
  const uint64_t second = head.size() + split + head.size();
  const std::vector<TensorFrom> shards = {{info, box(0, 2), "_fsspec/f", "file", head.size()},
                                          {info, box(2, 1), "_fsspec/f", "file", second}};
  std::vector<TensorFrom> with_empty = shards;  // an empty tensor holds no chunk, wherever it is said to lie
  with_empty.push_back({TensorInfo{"empty", DType::kF32, {0, 3}}, Region::OfBox(Box{{0, 0}, {0, 3}}), "_fsspec/f",
                        "file", 1});
  auto made = repo_->ComposeCheckpoint("dcp/step-1", {{"_fsspec/f", "file", "__0_0.distcp"}}, {}, with_empty);
  ASSERT_OK(made);
  EXPECT_EQ(made->chunks_written, 0u);
  auto reader = std::move(repo_->OpenCheckpoint("dcp/step-1")).value();
  const TensorRecord* t = reader->FindTensor("layer.weight");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->shape, info.shape);
  std::vector<std::byte> got(all.size());
  ASSERT_OK(reader->ReadRegion(*t, Region::OfFlat(0, rows * cols), got));
  EXPECT_TRUE(got == all);
  ASSERT_NE(reader->FindBlob("__0_0.distcp"), nullptr);
  ASSERT_NE(reader->FindTensor("empty"), nullptr);
  auto verified = repo_->Verify(std::nullopt);
  ASSERT_OK(verified);
  EXPECT_TRUE(verified->ok());

  // What is refused, with nothing committed.
  const std::vector<BlobFrom> file = {{"_fsspec/f", "file", "f"}};
  auto refused = [&](std::vector<TensorFrom> tensors) {
    return repo_->ComposeCheckpoint("bad", file, {}, tensors).status().code();
  };
  EXPECT_EQ(refused({{info, box(0, 2), "_fsspec/f", "file", head.size() + 4}, shards[1]}),
            StatusCode::kInvalidArgument);  // not at a chunk boundary
  EXPECT_EQ(refused({{info, box(0, 1), "_fsspec/f", "file", head.size()}, shards[1]}),
            StatusCode::kInvalidArgument);  // ends inside a chunk
  TensorInfo other = info;
  other.dtype = DType::kI32;
  EXPECT_EQ(refused({shards[0], {other, box(2, 1), "_fsspec/f", "file", second}}), StatusCode::kInvalidArgument);
  EXPECT_EQ(refused({{info, box(2, 2), "_fsspec/f", "file", second}}), StatusCode::kInvalidArgument);  // outside
  EXPECT_NE(refused({shards[0]}), StatusCode::kOk);  // row 2 missing: the shards do not tile the tensor
  EXPECT_TRUE(repo_->ComposeCheckpoint("bad", file, {}, {{info, box(2, 1), "_fsspec/f", "nothing", 0}})
                  .status()
                  .IsNotFound());
  EXPECT_TRUE(repo_->OpenCheckpoint("bad").status().IsNotFound());
}

TEST_P(SaveAndLoad, HandlesWritersAndReadersOutliveTheirRepository) {
  auto first = MakeRef("w", DType::kF32, {4 << 20}, 21);  // 16 MiB
  auto w = Begin("first");
  PutFlat(*w, first, 0, first.info.shape[0]);
  ASSERT_OK(w->Commit().Wait());
  w.reset();
  auto reader = std::move(repo_->OpenCheckpoint("first")).value();
  // 48 MiB in flight when the repository goes: the commit finishes, and the
  // handle, the writer and the reader stay usable.
  auto big = MakeRef("big", DType::kBF16, {24 << 20}, 22);
  auto second = Begin("second");
  PutFlat(*second, big, 0, big.info.shape[0]);
  CommitHandle handle = second->Commit();
  repo_.reset();
  ASSERT_OK(handle.Wait());
  EXPECT_FALSE(second->PutBlob("late", {}).ok());  // committed: refused, not a crash
  second.reset();
  std::vector<std::byte> got(first.bytes.size());
  ASSERT_OK(reader->ReadBytes(*reader->FindTensor("w"), 0, got));
  EXPECT_TRUE(got == first.bytes);
  reader.reset();
  handle = CommitHandle();
  Reopen();  // everything released: the path opens again
  ExpectWhole("second", big);
}

// The commit is the last owner of everything: the repository and the
// writer are gone before it ends. It releases them on its own thread (the
// repository's I/O pool, which it thereby destroys) before the handle
// reports, so the path opens again at once.
TEST_P(SaveAndLoad, ACommitThatOutlivesItsRepositoryAndWriterReleasesThemBeforeItReports) {
  for (int round = 0; round < 3; ++round) {
    const std::string name = "last-" + std::to_string(round);
    auto big = MakeRef("big", DType::kBF16, {8 << 20}, 30 + round);
    auto w = Begin(name);
    PutFlat(*w, big, 0, big.info.shape[0]);
    CommitHandle handle = w->Commit();
    w.reset();
    repo_.reset();
    ASSERT_OK(handle.Wait());
    handle = CommitHandle();
    Reopen();
    ExpectWhole(name, big);
  }
}

TEST_P(SaveAndLoad, TensorBlobAndTagNamesAreCheckedBeforeTheirBytesAreWritten) {
  auto expect_refused = [](const Status& st, const std::string& says) {
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
    EXPECT_NE(st.message().find(says), std::string::npos) << st.message();
    EXPECT_EQ(st.message().find('\x1b'), std::string::npos) << "a raw escape in a message";
  };
  auto w = Begin("names");
  const auto bytes = RandomBytes(16, 1);
  const TensorInfo ok{"x", DType::kU8, {16}};
  auto named = [&](std::string n) {
    TensorInfo t = ok;
    t.name = std::move(n);
    return t;
  };
  expect_refused(w->PutTensor(named(std::string(301, 'a')), bytes), "more than the 300 allowed");
  expect_refused(w->PutTensor(named("red\x1b[31m"), bytes), "red\\x1b[31m' holds a control character");
  expect_refused(w->PutTensor(named("bad\xff"), bytes), "is not valid UTF-8");
  expect_refused(w->PutBlob("blob\n", bytes), "blob name");
  // The longest names of every kind commit and read back.
  std::string longest;
  while (longest.size() + 2 <= kMaxMemberName) longest += "\xce\xb1";  // 2-byte characters
  ASSERT_OK(w->PutTensor(named(longest), bytes));
  ASSERT_OK(w->PutBlob(longest, bytes));
  ASSERT_OK(w->Commit().Wait());
  w.reset();
  const std::string long_name(200, 'c');
  auto lw = repo_->BeginCheckpoint(long_name, {0, 1, 1, {{longest, longest}}});
  ASSERT_OK(lw);
  ASSERT_OK((*lw)->PutTensor(named(longest), bytes));
  ASSERT_OK((*lw)->Commit().Wait());
  auto r = std::move(repo_->OpenCheckpoint(long_name)).value();
  std::vector<std::byte> got(bytes.size());
  ASSERT_OK(r->ReadBytes(*r->FindTensor(longest), 0, got));
  EXPECT_EQ(got, bytes);
  expect_refused(repo_->BeginCheckpoint("latest", {0, 1, 1, {}}).status(), "'latest' is reserved");
  expect_refused(repo_->BeginCheckpoint("t", {0, 1, 1, {{"k\x07", "v"}}}).status(), "tag 'k\\x07'");
  expect_refused(repo_->BeginCheckpoint("t", {0, 1, 1, {{"k", "\x1b]0;title\x07"}}}).status(), "value");
  expect_refused(repo_->BeginCheckpoint("bad\x1bname", {0, 1, 1, {}}).status(), "bad\\x1bname");
}

TEST_P(SaveAndLoad, OverlapWithDifferentBytesFailsAndStaysInvisible) {
  Ref a = MakeRef("x", DType::kI32, {8, 8}, 1);
  {
    auto w = Begin("bad", 0, 2);
    PutBox(*w, a, Box{{0, 0}, {5, 8}});
    ASSERT_OK(w->Commit().Wait());
  }
  auto w = Begin("bad", 1, 2);
  Ref other = a;
  other.bytes[4 * 8 * 4] ^= std::byte{1};  // row 4 differs in the overlap
  PutBox(*w, other, Box{{4, 0}, {4, 8}});
  auto res = w->Commit().Wait();
  ASSERT_FALSE(res.ok());
  EXPECT_EQ(res.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(res.status().message().find("tensor 'x'"), std::string::npos) << res.status().message();
  EXPECT_NE(res.status().message().find("different bytes"), std::string::npos);
  EXPECT_TRUE(repo_->OpenCheckpoint("bad").status().IsNotFound());
  // The failed rank may try again with the right bytes.
  auto retry = Begin("bad", 1, 2);
  PutBox(*retry, a, Box{{4, 0}, {4, 8}});
  ASSERT_OK(retry->Commit().Wait());
  ExpectWhole("bad", a);
}

TEST_P(SaveAndLoad, OverlapWithSameBytesIsAccepted) {
  Ref a = MakeRef("x", DType::kF32, {6, 4}, 1);
  auto w0 = Begin("ok", 0, 2);
  PutFlat(*w0, a, 0, 14);
  ASSERT_OK(w0->Commit().Wait());
  auto w1 = Begin("ok", 1, 2);
  PutFlat(*w1, a, 10, 24);
  ASSERT_OK(w1->Commit().Wait());
  ExpectWhole("ok", a);
}

TEST_P(SaveAndLoad, GapFailsNamingTheTensor) {
  Ref a = MakeRef("layer.weight", DType::kF32, {10, 4}, 1);
  auto w = Begin("gappy");
  PutBox(*w, a, Box{{0, 0}, {4, 4}});
  PutBox(*w, a, Box{{5, 0}, {5, 4}});
  auto res = w->Commit().Wait();
  ASSERT_FALSE(res.ok());
  EXPECT_NE(res.status().message().find("'layer.weight'"), std::string::npos);
  EXPECT_NE(res.status().message().find("not fully covered"), std::string::npos);
  EXPECT_TRUE(repo_->OpenCheckpoint("gappy").status().IsNotFound());
  // Same for box shards leaving a hole in the middle column.
  auto w2 = Begin("gappy2");
  PutBox(*w2, a, Box{{0, 0}, {10, 1}});
  PutBox(*w2, a, Box{{0, 2}, {10, 2}});
  EXPECT_FALSE(w2->Commit().Wait().ok());
}

TEST_P(SaveAndLoad, DTypeOrShapeDisagreementBetweenRanksFails) {
  Ref a = MakeRef("x", DType::kF32, {4, 4}, 1);
  auto w0 = Begin("mismatch", 0, 2);
  PutBox(*w0, a, Box{{0, 0}, {2, 4}});
  ASSERT_OK(w0->Commit().Wait());
  Ref b = MakeRef("x", DType::kI32, {4, 4}, 1);
  auto w1 = Begin("mismatch", 1, 2);
  PutBox(*w1, b, Box{{2, 0}, {2, 4}});
  auto res = w1->Commit().Wait();
  ASSERT_FALSE(res.ok());
  EXPECT_NE(res.status().message().find("tensor 'x'"), std::string::npos);
  EXPECT_NE(res.status().message().find("I32"), std::string::npos);
  EXPECT_TRUE(repo_->OpenCheckpoint("mismatch").status().IsNotFound());
}

// The catalog shows every rank in; on an object store a rank reads no other
// rank's record until the last one merges them
// (DTypeOrShapeDisagreementBetweenRanksFails holds for both).
TEST_F(LocalRepository, DisagreementIsReportedBeforeTheLastRank) {
  Ref a = MakeRef("x", DType::kF32, {6, 4}, 1);
  auto w0 = Begin("early", 0, 3);
  PutBox(*w0, a, Box{{0, 0}, {2, 4}});
  ASSERT_OK(w0->Commit().Wait());
  Ref b = MakeRef("x", DType::kI32, {6, 4}, 1);
  auto w1 = Begin("early", 1, 3);
  PutBox(*w1, b, Box{{2, 0}, {2, 4}});
  auto res = w1->Commit().Wait();  // rank 2 has not committed yet
  ASSERT_FALSE(res.ok());
  EXPECT_EQ(res.status().message(), "tensor 'x': rank 1 saved it as I32 [6, 4] but rank 0 as F32 [6, 4]");
}

TEST_P(SaveAndLoad, GlobalShapeDisagreementBetweenRanksFailsAtTheLastCommit) {
  Ref a = MakeRef("w", DType::kF32, {4, 6}, 1);
  auto w0 = Begin("shapes", 0, 2);
  PutFlat(*w0, a, 0, 12);
  ASSERT_OK(w0->Commit().Wait());
  Ref b = MakeRef("w", DType::kF32, {6, 4}, 1);  // same element count, other global shape
  auto w1 = Begin("shapes", 1, 2);
  PutFlat(*w1, b, 12, 24);
  auto res = w1->Commit().Wait();
  ASSERT_FALSE(res.ok());
  EXPECT_EQ(res.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(res.status().message().find("tensor 'w'"), std::string::npos);
  EXPECT_NE(res.status().message().find("[6, 4]"), std::string::npos) << res.status().message();
  EXPECT_TRUE(repo_->OpenCheckpoint("shapes").status().IsNotFound());
}

TEST_P(SaveAndLoad, BadPutsAreRejected) {
  Ref a = MakeRef("x", DType::kF32, {4, 4}, 1);
  auto w = Begin("puts");
  std::vector<std::byte> small(10);
  HostSource src(small);
  EXPECT_FALSE(w->PutShard(a.info, Region::OfBox(FullBox(a.info.shape)), src).ok());  // wrong size
  HostSource whole(a.bytes);
  EXPECT_FALSE(w->PutShard(a.info, Region::OfBox(Box{{2, 0}, {4, 4}}), whole).ok());  // out of bounds
  EXPECT_FALSE(w->PutShard(a.info, Region::OfFlat(0, 17), whole).ok());
  ASSERT_OK(w->PutTensor(a.info, a.bytes));
  TensorInfo other{"x", DType::kF32, {16}};
  EXPECT_FALSE(w->PutTensor(other, a.bytes).ok());  // another shape
  ASSERT_OK(w->PutTensor(a.info, a.bytes));  // same region, same bytes: merged
  ASSERT_OK(w->Commit().Wait());
  auto reader = std::move(repo_->OpenCheckpoint("puts")).value();
  EXPECT_EQ(reader->FindTensor("x")->shards.size(), 1u);
  // Same region with other bytes fails the commit.
  auto w2 = Begin("puts2");
  ASSERT_OK(w2->PutTensor(a.info, a.bytes));
  Ref b = MakeRef("x", DType::kF32, {4, 4}, 2);
  ASSERT_OK(w2->PutTensor(b.info, b.bytes));
  auto res = w2->Commit().Wait();
  ASSERT_FALSE(res.ok());
  EXPECT_NE(res.status().message().find("different bytes"), std::string::npos);
}

TEST_P(SaveAndLoad, WriterThatNeverCommitsLeavesNoRecord) {
  {
    auto w = Begin("ghost", 0, 2);
    Ref a = MakeRef("x", DType::kF32, {4, 4}, 1);
    ASSERT_OK(w->PutTensor(a.info, a.bytes));
  }
  EXPECT_TRUE(repo_->ListCheckpoints(true)->empty());
}

TEST_P(SaveAndLoad, NamesAndRanksAreChecked) {
  EXPECT_FALSE(repo_->BeginCheckpoint("", {}).ok());
  for (const char* bad : {"a//b", "/a", "a/", "a/.b", "run/100", "a~", "a b"}) {
    EXPECT_EQ(repo_->BeginCheckpoint(bad, {}).status().code(), StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_FALSE(repo_->BeginCheckpoint(".hidden", {}).ok());
  EXPECT_FALSE(repo_->BeginCheckpoint("x", {2, 2, {}, {}}).ok());
  auto w = Begin("dup");
  ASSERT_OK(w->Commit().Wait());
  EXPECT_EQ(repo_->BeginCheckpoint("dup", {}).status().code(), StatusCode::kAlreadyExists);
  auto p = Begin("pending", 0, 3);
  ASSERT_OK(p->Commit().Wait());
  EXPECT_FALSE(repo_->BeginCheckpoint("pending", {1, 2, {}, {}}).ok());              // world size differs
  EXPECT_EQ(repo_->BeginCheckpoint("pending", {0, 3, {}, {}}).status().code(),    // rank done
            StatusCode::kAlreadyExists);
  EXPECT_TRUE(repo_->OpenCheckpoint("nope").status().IsNotFound());
  auto list = repo_->ListCheckpoints(true);
  ASSERT_OK(list);
  ASSERT_EQ(list->size(), 2u);
  EXPECT_EQ((*list)[0].name, "dup");
  EXPECT_EQ((*list)[1].state, CheckpointState::kPending);
  EXPECT_EQ(repo_->ListCheckpoints(false)->size(), 1u);
}

// Names with '/' put checkpoints in groups (runs): they save, read, list,
// retire and sync like any other, on every kind of repository, and a name
// is a checkpoint or a group, never both.
TEST_P(SaveAndLoad, GroupedNamesSaveReadRetireAndSyncLikeAnyOther) {
  Ref a = MakeRef("w", DType::kF32, {16, 8}, 61);
  Ref b = MakeRef("w", DType::kF32, {16, 8}, 62);
  auto save = [&](const std::string& name, const Ref& r, uint32_t world = 1) {
    std::vector<std::unique_ptr<CheckpointWriter>> ws;
    for (uint32_t rank = 0; rank < world; ++rank) {
      ws.push_back(Begin(name, rank, world));
      ASSERT_NE(ws.back(), nullptr) << name;
      PutBox(*ws.back(), r, Box{{16 / world * rank, 0}, {16 / world, 8}});
    }
    for (auto& w : ws) ASSERT_OK(w->Commit().Wait());
  };
  save("run1/step-1", a, 2);  // two ranks: on a store, through pending/run1/step-1/rank-R
  save("run1/step-2", b);
  save("run2/eval/step-1", b);
  save("run1x", a);
  ExpectWhole("run1/step-1", a);
  ExpectWhole("run2/eval/step-1", b);
  EXPECT_EQ(repo_->BeginCheckpoint("run1", {}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(repo_->BeginCheckpoint("run1/step-1/x", {}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(repo_->BeginCheckpoint("run2/eval", {}).status().code(), StatusCode::kInvalidArgument);
  auto reader = repo_->OpenCheckpoint("run1/step-1");
  ASSERT_OK(reader);
  ASSERT_OK(repo_->RemoveCheckpoints({"run1/step-1"}));
  EXPECT_TRUE(repo_->OpenCheckpoint("run1/step-1").status().IsNotFound());
  auto listed = repo_->ListCheckpoints(true);
  ASSERT_OK(listed);
  std::vector<std::string> names;
  for (const auto& c : *listed) names.push_back(c.name);
  EXPECT_EQ(names, (std::vector<std::string>{"run1/step-2", "run2/eval/step-1", "run1x"}));
  // The removed one's reader keeps its bytes through gc, as for any name.
  auto gc = repo_->CollectGarbage(GcOptions{});
  ASSERT_OK(gc);
  EXPECT_EQ(gc->retired_kept, 1u);
  std::vector<std::byte> got(a.bytes.size());
  ASSERT_OK((*reader)->ReadBytes(*(*reader)->FindTensor("w"), 0, got));
  EXPECT_TRUE(got == a.bytes);
  reader->reset();
  if (GetParam() != RepoKind::kLocal) {
    LeasesLetGo();
    auto other = where_.Open(open_, "host2");
    ASSERT_OK(other);
    auto theirs = (*other)->ListCheckpoints(true);
    ASSERT_OK(theirs);
    ASSERT_EQ(theirs->size(), 3u);
    EXPECT_EQ((*theirs)[1].name, "run2/eval/step-1");
    auto r = (*other)->OpenCheckpoint("run2/eval/step-1");
    ASSERT_OK(r);
  }
  gc = repo_->CollectGarbage(GcOptions{});
  ASSERT_OK(gc);
  EXPECT_EQ(gc->retired_collected, 1u);
  // The group's name is free again once no checkpoint is in it... but run1
  // still holds step-2.
  EXPECT_EQ(repo_->BeginCheckpoint("run1", {}).status().code(), StatusCode::kInvalidArgument);
  save("run1/step-1", b);  // the removed name saved again
  ExpectWhole("run1/step-1", b);
  ExpectVerifies();
}

TEST_P(SaveAndLoad, AbortedWriterLeavesNothingVisible) {
  Ref a = MakeRef("x", DType::kF32, {256, 256}, 1);
  {
    auto w = Begin("aborted");
    ASSERT_OK(w->PutTensor(a.info, a.bytes));
    w->Abort();
  }
  EXPECT_TRUE(repo_->OpenCheckpoint("aborted").status().IsNotFound());
  ExpectVerifies();
}

TEST_F(LocalRepository, RanksInSeparateProcessesCommitOnce) {
  Ref a = MakeRef("x", DType::kBF16, {64, 1024}, 1);
  repo_.reset();  // children open their own environment
  const int world = 4;
  std::vector<pid_t> kids;
  for (int r = 0; r < world; ++r) {
    pid_t pid = fork();
    if (pid == 0) {
      auto repo = Repository::Open(dir_.path());
      if (!repo.ok()) _exit(10);
      auto w = (*repo)->BeginCheckpoint("mp", {static_cast<uint32_t>(r), world, 1, {}});
      if (!w.ok()) _exit(11);
      auto data = a.Box(Box{{16ull * r, 0}, {16, 1024}});
      HostSource src(data);
      if (!(*w)->PutShard(a.info, Region::OfBox(Box{{16ull * r, 0}, {16, 1024}}), src).ok()) _exit(12);
      _exit((*w)->Commit().Wait().ok() ? 0 : 13);
    }
    kids.push_back(pid);
  }
  for (pid_t pid : kids) {
    int status = 0;
    waitpid(pid, &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  }
  Reopen();
  ExpectWhole("mp", a);
}

TEST_F(LocalRepository, CorruptPackFailsReadsAndVerifyNeverReturnsWrongBytes) {
  Ref a = MakeRef("x", DType::kF32, {128, 1024}, 1);
  auto w = Begin("c");
  ASSERT_OK(w->PutTensor(a.info, a.bytes));
  ASSERT_OK(w->Commit().Wait());
  w.reset();
  repo_.reset();
  // Flip one byte in the middle of every pack's data area.
  for (const auto& e : std::filesystem::directory_iterator(dir_ / "objects/packs")) {
    std::fstream f(e.path(), std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(100);
    char c;
    f.read(&c, 1);
    c ^= 0x55;
    f.seekp(100);
    f.write(&c, 1);
  }
  Reopen();
  auto reader = std::move(repo_->OpenCheckpoint("c")).value();
  std::vector<std::byte> got(a.bytes.size());
  Status st = reader->ReadBytes(*reader->FindTensor("x"), 0, got);
  EXPECT_TRUE(st.IsCorruption()) << st.ToString();
  auto v = repo_->Verify(std::string("c"));
  ASSERT_OK(v);
  EXPECT_FALSE(v->ok());
  EXPECT_NE(v->problems[0].message.find("pack"), std::string::npos);
}

TEST_F(LocalRepository, ReindexRebuildsDeletedCatalog) {
  Ref a = MakeRef("x", DType::kBF16, {100, 100}, 1);
  auto w = Begin("r1");
  ASSERT_OK(w->PutTensor(a.info, a.bytes));
  ASSERT_OK(w->PutBlob("b", RandomBytes(10, 1)));
  ASSERT_OK(w->Commit().Wait());
  auto p = Begin("pending", 0, 2);
  ASSERT_OK(p->Commit().Wait());
  repo_.reset();
  std::filesystem::remove_all(dir_ / "catalog");
  EXPECT_EQ(Repository::Open(dir_.path()).status().code(), StatusCode::kCorruption);
  auto report = Repository::Reindex(dir_.path());
  ASSERT_OK(report);
  EXPECT_EQ(report->checkpoints, 1u);
  Reopen();
  ExpectWhole("r1", a);
  EXPECT_EQ(repo_->ListCheckpoints(true)->size(), 1u);  // pending dropped
  ExpectVerifies();
  // New commits continue the sequence.
  auto w2 = Begin("r2");
  ASSERT_OK(w2->Commit().Wait());
  auto list = *repo_->ListCheckpoints();
  EXPECT_LT(list[0].sequence, list[1].sequence);
}

TEST_F(LocalRepository, ASharedSyncOfALocalRepositoryIsEmptyAndChangesNothing) {
  auto shared = repo_->ShareSync();
  ASSERT_OK(shared);
  EXPECT_TRUE(shared->empty());
  EXPECT_OK(repo_->SyncFrom(""));
  EXPECT_EQ(repo_->SyncFrom("a listing").code(), StatusCode::kInvalidArgument);
}

TEST(RepositoryInit, MakesMissingParentsAndRefusesAFileInTheWay) {
  TempDir dir;
  ASSERT_OK(Repository::Init(dir / "runs/llama/repo", {}));
  EXPECT_OK(Repository::Open(dir / "runs/llama/repo").status());
  std::ofstream(dir / "file") << "x";
  Status under_file = Repository::Init(dir / "file/repo", {});
  EXPECT_FALSE(under_file.ok());
  EXPECT_NE(under_file.message().find("creating"), std::string::npos) << under_file.ToString();
  EXPECT_EQ(Repository::Init(dir / "file", {}).code(), StatusCode::kFailedPrecondition);
}

TEST(RepositoryOpen, MissingForeignAndNewerRepositoriesAreRefused) {
  TempDir dir;
  auto missing = Repository::Open(dir / "nothing");
  EXPECT_TRUE(missing.status().IsNotFound());
  EXPECT_NE(missing.status().message().find("ckpt init"), std::string::npos);
  EXPECT_EQ(Repository::Open(dir.path()).status().code(), StatusCode::kFailedPrecondition);
  std::ofstream(dir / "ckptfs.json") << "{\"format\": \"something-else\"}";
  EXPECT_EQ(Repository::Open(dir.path()).status().code(), StatusCode::kFailedPrecondition);
  std::filesystem::remove(dir / "ckptfs.json");
  ASSERT_OK(Repository::Init(dir / "repo", {}));
  EXPECT_EQ(Repository::Init(dir / "repo", {}).code(), StatusCode::kAlreadyExists);
  std::string config;
  {
    std::ifstream f(dir / "repo/ckptfs.json");
    config.assign(std::istreambuf_iterator<char>(f), {});
  }
  config.replace(config.find("\"format_version\": 1"), 19, "\"format_version\": 99");
  std::ofstream(dir / "repo/ckptfs.json") << config;
  auto newer = Repository::Open(dir / "repo");
  EXPECT_EQ(newer.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(newer.status().message().find("99"), std::string::npos);
  RepositoryConfig bad;
  bad.chunk_size = 1000;
  EXPECT_FALSE(Repository::Init(dir / "repo2", bad).ok());
}

// OpenShared: one Repository per repository per process, by any spelling
// of its path; let go, it opens again; another repository made at the same
// path is opened anew while the old one's holders keep theirs.
TEST(RepositoryOpen, OpenSharedGivesEveryCallerOfAProcessTheSameRepository) {
  TempDir dir;
  const std::string path = dir / "repo";
  ASSERT_OK(Repository::Init(path, {}));
  auto a = Repository::OpenShared(path);
  ASSERT_OK(a);
  auto b = Repository::OpenShared(dir.path() + "/./repo/");
  ASSERT_OK(b);
  EXPECT_EQ(a->get(), b->get());
  // A plain Open of the same path is refused: LMDB's rule the sharing keeps.
  auto second = Repository::Open(path);
  EXPECT_EQ(second.status().detail(), StatusDetail::kCatalogOpenInProcess);
  auto save = [](Repository& repo, const std::string& name) {
    auto w = repo.BeginCheckpoint(name, {});
    ASSERT_OK(w);
    std::vector<std::byte> bytes(100, std::byte{7});
    ASSERT_OK((*w)->PutTensor({"t", DType::kU8, {100}}, bytes));
    ASSERT_OK((*w)->Commit().Wait());
  };
  save(**a, "old");
  b->reset();
  // Another repository at the path (the first moved away while held).
  std::filesystem::rename(path, dir / "moved");
  ASSERT_OK(Repository::Init(path, {}));
  auto c = Repository::OpenShared(path);
  ASSERT_OK(c);
  EXPECT_NE(a->get(), c->get());
  auto listed = (*c)->ListCheckpoints();
  ASSERT_OK(listed);
  EXPECT_TRUE(listed->empty());
  auto old = (*a)->OpenCheckpoint("old");
  EXPECT_OK(old);
  // Every holder gone: the next open makes a new Repository that works.
  old = Status::NotFound("dropped");
  a->reset();
  c->reset();
  auto d = Repository::OpenShared(path);
  ASSERT_OK(d);
  save(**d, "new");
  EXPECT_FALSE(Repository::OpenShared(dir / "nothing").ok());
}

// The engine reads settings from the environment only through the lookup
// its caller hands it; S3 settings are read only when an S3 URL is opened.
TEST(RepositoryOpen, SettingsComeFromTheEnvironmentOnlyThroughTheLookupGiven) {
  std::map<std::string, std::string> vars = {{"HOME", "/home/u"}, {"CKPT_LOCK_STALE_SECONDS", "2.5"}};
  const Environment env = [&](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  };
  auto o = OpenOptionsFromEnvironment(env);
  ASSERT_OK(o.status());
  EXPECT_EQ(o->cache_dir, "");
  EXPECT_EQ(o->cache_root, "/home/u/.cache/ckptfs");
  EXPECT_EQ(o->lock_stale_after, std::chrono::milliseconds(2500));
  ASSERT_TRUE(o->s3_settings);
  auto s3 = o->s3_settings();
  EXPECT_EQ(s3.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s3.status().message().find("AWS_ENDPOINT_URL"), std::string::npos) << s3.status().message();
  // Read when asked for, not when the options were made.
  vars["AWS_ENDPOINT_URL"] = "http://127.0.0.1:1";
  vars["AWS_ACCESS_KEY_ID"] = "key";
  vars["AWS_SECRET_ACCESS_KEY"] = "secret";
  s3 = o->s3_settings();
  ASSERT_OK(s3.status());
  EXPECT_EQ(s3->endpoint, "http://127.0.0.1:1");
  EXPECT_EQ(s3->access_key, "key");

  vars["XDG_CACHE_HOME"] = "/xdg";
  vars["CKPT_CACHE_DIR"] = "/cache/repo";
  o = OpenOptionsFromEnvironment(env);
  ASSERT_OK(o.status());
  EXPECT_EQ(o->cache_dir, "/cache/repo");
  EXPECT_EQ(o->cache_root, "/xdg/ckptfs");
  for (const char* bad : {"soon", "0.01", "-3", "1e99"}) {
    vars["CKPT_LOCK_STALE_SECONDS"] = bad;
    auto refused = OpenOptionsFromEnvironment(env);
    EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(refused.status().message().find("CKPT_LOCK_STALE_SECONDS"), std::string::npos);
  }
  vars.erase("CKPT_LOCK_STALE_SECONDS");

  // A local repository opens without any S3 setting; an S3 URL with none
  // given is refused, naming what is missing, before any request.
  TempDir dir;
  ASSERT_OK(Repository::Init(dir / "repo", {}));
  vars.erase("AWS_ENDPOINT_URL");
  o = OpenOptionsFromEnvironment(env);
  ASSERT_OK(o.status());
  ASSERT_OK(Repository::Open(dir / "repo", *o).status());
  OpenOptions none;
  none.cache_dir = dir / "cache";
  auto s3_open = Repository::Open("s3://bucket/prefix", none);
  EXPECT_EQ(s3_open.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s3_open.status().message().find("no S3 settings"), std::string::npos) << s3_open.status().message();
  EXPECT_EQ(Repository::Open("s3://bucket/prefix", *o).status().code(), StatusCode::kInvalidArgument);
}

// Stores are opened by URL through a registry of schemes: an unknown scheme
// is named, and a scheme a program registers works like s3://.
TEST(RepositoryOpen, StoresOpenByUrlThroughTheRegistryOfSchemes) {
  EXPECT_EQ(StoreScheme("S3://bucket/p"), "s3");
  EXPECT_EQ(StoreScheme("/data/ckpt"), "");
  EXPECT_EQ(StoreScheme("./a://b"), "");
  EXPECT_FALSE(IsObjectStoreUrl("relative/dir"));
  EXPECT_EQ(ObjectStoreChild("s3://b/p/", "objects"), "s3://b/p/objects");
  EXPECT_EQ(ObjectStoreChild("s3://b", "objects"), "s3://b/objects");
  TempDir dir;
  OpenOptions o;
  o.s3 = ObjectStoreOptions{};
  o.cache_dir = dir / "cache-1";
  auto unknown = Repository::Open("gs://bucket/run", o);
  EXPECT_EQ(unknown.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(unknown.status().message().find("unknown scheme 'gs://'"), std::string::npos) << unknown.status().message();
  EXPECT_NE(unknown.status().message().find("s3://"), std::string::npos);

  // "memtest://NAME/PATH": the objects under PATH of an in-memory store NAME.
  auto stores = std::make_shared<std::map<std::string, std::shared_ptr<Backend>>>();
  auto mu = std::make_shared<std::mutex>();
  RegisterStoreScheme("memtest", [stores, mu](const std::string& url, const ObjectStoreOptions&,
                                              bool create) -> Result<std::unique_ptr<Backend>> {
    const std::string rest = url.substr(std::string("memtest://").size());
    const size_t slash = rest.find('/');
    if (slash == std::string::npos) return Status::InvalidArgument("memtest:// needs a path");
    std::lock_guard lock(*mu);
    auto& store = (*stores)[rest.substr(0, slash)];
    if (!store) {
      if (!create) return Status::NotFound("no store " + rest.substr(0, slash));
      store = NewMemoryBackend();
    }
    return NewPrefixedBackend(store, rest.substr(slash + 1));
  });
  EXPECT_EQ(Repository::Open("memtest://nothing/here", o).status().code(), StatusCode::kNotFound);
  ASSERT_OK(Repository::Init("memtest://a/repo", {}, o));
  const std::string bytes = "twelve bytes";
  {
    auto host1 = Repository::Open("memtest://a/repo", o);
    ASSERT_OK(host1.status());
    EXPECT_TRUE((*host1)->remote());
    auto w = (*host1)->BeginCheckpoint("c", {});
    ASSERT_OK(w.status());
    ASSERT_OK((*w)->PutTensor({"t", DType::kU8, {12}}, std::as_bytes(std::span(bytes))));
    ASSERT_OK((*w)->Commit().Wait().status());
  }
  o.cache_dir = dir / "cache-2";  // another host
  auto host2 = Repository::Open("memtest://a/repo", o);
  ASSERT_OK(host2.status());
  auto r = (*host2)->OpenCheckpoint("c");
  ASSERT_OK(r.status());
  std::string got(12, '\0');
  ASSERT_OK((*r)->ReadRegion(*(*r)->FindTensor("t"), Region::OfFlat(0, 12), std::as_writable_bytes(std::span(got))));
  EXPECT_EQ(got, bytes);
  EXPECT_EQ(Repository::Init("memtest://a/repo", {}, o).code(), StatusCode::kAlreadyExists);
}

// Counts the reads in flight at once, each held 20 ms so that parallel
// ones overlap.
class ConcurrencyProbe : public BackendWrapper {
 public:
  using BackendWrapper::BackendWrapper;
  std::atomic<bool> counting{false};
  std::atomic<int> now{0}, most{0};
  Result<std::string> ReadAll(std::string_view key, uint64_t max_bytes) override {
    Hold hold(*this);
    return BackendWrapper::ReadAll(key, max_bytes);
  }
  Status ReadRange(std::string_view key, uint64_t offset, std::span<std::byte> out) override {
    Hold hold(*this);
    return BackendWrapper::ReadRange(key, offset, out);
  }

 private:
  struct Hold {
    explicit Hold(ConcurrencyProbe& p) : p(p) {
      if (!p.counting) return;
      int n = ++p.now;
      for (int m = p.most; n > m && !p.most.compare_exchange_weak(m, n);) {
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    ~Hold() {
      if (p.counting) --p.now;
    }
    ConcurrencyProbe& p;
  };
};

TEST(RepositoryOpen, IoThreadsBoundTheRequestsAnOperationSendsAtOnce) {
  TempDir dir;
  auto probe = std::make_shared<ConcurrencyProbe>(NewMemoryBackend());
  ASSERT_OK(Repository::Init(*probe, {}));
  OpenOptions o;
  o.cache_dir = dir / "host-a";
  {
    auto host_a = Repository::Open(probe, o);
    ASSERT_OK(host_a.status());
    for (int i = 0; i < 24; ++i) {
      const std::string bytes = "checkpoint " + std::to_string(i);
      auto w = (*host_a)->BeginCheckpoint("c" + std::to_string(i), {});
      ASSERT_OK(w.status());
      ASSERT_OK((*w)->PutTensor({"t", DType::kU8, {bytes.size()}}, std::as_bytes(std::span(bytes))));
      ASSERT_OK((*w)->Commit().Wait().status());
    }
  }
  // Another host's first open reads the 24 manifests (and the packs'
  // indexes) in parallel: never more at once than io_threads.
  for (size_t io_threads : {1u, 3u, 8u}) {
    SCOPED_TRACE("io_threads " + std::to_string(io_threads));
    o.cache_dir = dir / ("host-b-" + std::to_string(io_threads));
    o.io_threads = io_threads;
    probe->most = 0;
    probe->counting = true;
    auto host_b = Repository::Open(probe, o);
    probe->counting = false;
    ASSERT_OK(host_b.status());
    auto listed = (*host_b)->ListCheckpoints(false);
    ASSERT_OK(listed.status());
    EXPECT_EQ(listed->size(), 24u);
    EXPECT_LE(probe->most.load(), static_cast<int>(io_threads));
    if (io_threads > 1) {
      EXPECT_GE(probe->most.load(), 2);
    }
  }
}

// A repository on an object store handed over as a Backend: hosts (each a
// Repository with its own catalog directory) share only the store.
TEST(RepositoryOnAStore, HostsSharingOneStoreSeeEachOthersCheckpoints) {
  TempDir dir;
  std::shared_ptr<Backend> store = NewMemoryBackend();
  auto host = [&](const std::string& name) {
    OpenOptions o;
    o.threads = 2;
    o.cache_dir = dir / name;
    return Repository::Open(store, o);
  };
  auto empty = host("a");
  EXPECT_TRUE(empty.status().IsNotFound()) << empty.status().ToString();
  EXPECT_NE(empty.status().message().find("ckpt init"), std::string::npos);
  EXPECT_EQ(Repository::Open(store, {}).status().code(), StatusCode::kInvalidArgument);  // no cache directory
  RepositoryConfig config;
  config.chunk_size = 64 << 10;
  ASSERT_OK(Repository::Init(*store, config));
  EXPECT_EQ(Repository::Init(*store, config).code(), StatusCode::kAlreadyExists);

  const uint64_t rows = 64, cols = 1000;
  const auto w = RandomBytes(rows * cols * 4, 3);
  const TensorInfo info{"w", DType::kF32, {rows, cols}};
  {
    auto a = host("a"), b = host("b");
    ASSERT_OK(a);
    ASSERT_OK(b);
    EXPECT_TRUE((*a)->remote());
    for (uint32_t r = 0; r < 2; ++r) {
      Repository& repo = r == 0 ? **a : **b;
      auto writer = repo.BeginCheckpoint("s", {.rank = r, .world_size = 2});
      ASSERT_OK(writer);
      const uint64_t r0 = r * rows / 2, n = rows / 2;
      HostSource src(std::span<const std::byte>(w).subspan(r0 * cols * 4, n * cols * 4));
      ASSERT_OK((*writer)->PutShard(info, Region::OfBox(Box{{r0, 0}, {n, cols}}), src));
      ASSERT_OK((*writer)->Commit().Wait());
    }
  }
  // A third host, which saved nothing, reads the checkpoint whole; the
  // packs are in the store, only catalogs on disk.
  auto c = host("c");
  ASSERT_OK(c);
  auto reader = (*c)->OpenCheckpoint("s");
  ASSERT_OK(reader);
  std::vector<std::byte> out(w.size());
  ASSERT_OK((*reader)->ReadRegion((*reader)->tensors()[0], Region::OfBox(FullBox(info.shape)), out));
  EXPECT_TRUE(out == w);
  EXPECT_FALSE(store->List("objects/packs/")->empty());
  EXPECT_FALSE(std::filesystem::exists(dir / "a/objects"));
}

// Counts the manifest objects read, and can make the store list every
// manifest under a new tag without new bytes (as a store may, copying or
// re-uploading an object).
class ManifestReads : public BackendWrapper {
 public:
  using BackendWrapper::BackendWrapper;
  std::atomic<int> reads{0}, epoch{0};
  Result<std::string> ReadAll(std::string_view key, uint64_t max_bytes) override {
    if (key.find("/manifests/") != std::string_view::npos) ++reads;
    return BackendWrapper::ReadAll(key, max_bytes);
  }
  Result<std::vector<ListedObject>> ListTagged(std::string_view prefix) override {
    CKPT_ASSIGN_OR_RETURN(auto listed, BackendWrapper::ListTagged(prefix));
    for (ListedObject& o : listed) o.tag += "/" + std::to_string(epoch.load());
    return listed;
  }
};

// A host of `store` with its catalog in `cache` (two I/O threads).
std::unique_ptr<Repository> OpenHost(std::shared_ptr<Backend> store, const std::string& cache) {
  OpenOptions o;
  o.threads = 2;
  o.cache_dir = cache;
  return std::move(Repository::Open(std::move(store), o)).value();
}

TEST(RepositoryOnAStore, AKnownManifestIsReadAgainOnlyWhenItsListedTagChanges) {
  TempDir dir;
  auto store = std::make_shared<ManifestReads>(NewMemoryBackend());
  ASSERT_OK(Repository::Init(*store, {}));
  auto host = [&](const std::string& name) { return OpenHost(store, dir / name); };
  auto save = [](Repository& repo, const std::string& name, const std::string& bytes) {
    auto w = std::move(repo.BeginCheckpoint(name, {})).value();
    ASSERT_OK(w->PutTensor({"t", DType::kU8, {bytes.size()}}, std::as_bytes(std::span(bytes))));
    ASSERT_OK(w->Commit().Wait());
  };
  auto read = [](Repository& repo, const std::string& name) {
    auto r = repo.OpenCheckpoint(name);
    if (!r.ok()) return r.status().ToString();
    std::string got((*r)->FindTensor("t")->shape[0], '\0');
    EXPECT_OK((*r)->ReadBytes(*(*r)->FindTensor("t"), 0, std::as_writable_bytes(std::span(got))));
    return got;
  };
  auto a = host("a");
  save(*a, "x", "x, first");
  save(*a, "y", "y, first");
  auto b = host("b");  // its first sync reads both manifests
  EXPECT_EQ(read(*b, "y"), "y, first");
  const auto sequences = [&] {
    std::vector<uint64_t> out;
    auto listed = b->ListCheckpoints();
    EXPECT_OK(listed);
    if (listed.ok()) {
      for (const auto& c : *listed) out.push_back(c.sequence);
    }
    return out;
  };
  const auto before = sequences();
  store->reads = 0;
  ASSERT_OK(b->Refresh());
  EXPECT_EQ(store->reads.load(), 0);  // nothing changed: nothing read
  // Listed under new tags, the same manifests are read once each and
  // change nothing; after that they cost nothing again.
  ++store->epoch;
  ASSERT_OK(b->Refresh());
  EXPECT_EQ(store->reads.load(), 2);
  EXPECT_EQ(sequences(), before);
  ASSERT_OK(b->Refresh());
  EXPECT_EQ(store->reads.load(), 2);
  // "y" removed and saved again by host a: host b reads that one manifest
  // and then the new bytes.
  ASSERT_OK(a->RemoveCheckpoints({"y"}));
  save(*a, "y", "y, second");
  store->reads = 0;
  ASSERT_OK(b->Refresh());
  EXPECT_EQ(store->reads.load(), 1);
  EXPECT_EQ(read(*b, "y"), "y, second");
  EXPECT_EQ(read(*b, "x"), "x, first");
}

// Fails every read of one object while `failing` is set.
class FailingReadsOf : public BackendWrapper {
 public:
  using BackendWrapper::BackendWrapper;
  std::mutex mu;
  std::string failing;
  bool Fails(std::string_view key) {
    std::lock_guard lock(mu);
    return !failing.empty() && key == failing;
  }
  Result<uint64_t> Size(std::string_view key) override {
    if (Fails(key)) return Status::IOError("connection lost before HEAD " + std::string(key) + " (test)");
    return BackendWrapper::Size(key);
  }
  Status ReadRange(std::string_view key, uint64_t offset, std::span<std::byte> out) override {
    if (Fails(key)) return Status::IOError("connection lost before GET " + std::string(key) + " (test)");
    return BackendWrapper::ReadRange(key, offset, out);
  }
};

// Two hosts stored the same chunk, each in its own pack; a third knows both
// packs and finds the chunk in the first. That pack goes (another host's gc
// moved the chunk), and the third host's sync, which then reads every index
// again, fails to read the other pack's: the chunk must come back once the
// store answers again, in this process and after a restart, though the pack
// is one the catalog knew.
TEST(RepositoryOnAStore, AChunkOfAGonePackComesBackFromAPackWhoseIndexFailedToReadOnce) {
  for (const bool restart : {false, true}) {
    SCOPED_TRACE(restart ? "reopened after the failed sync" : "the same process");
    TempDir dir;
    auto store = std::make_shared<FailingReadsOf>(NewMemoryBackend());
    ASSERT_OK(Repository::Init(*store, {}));
    auto host = [&](const std::string& name) { return OpenHost(store, dir / name); };
    const std::string bytes(100000, 'x');
    auto a = host("a");
    auto b = host("b");
    auto wa = std::move(a->BeginCheckpoint("a", {})).value();
    auto wb = std::move(b->BeginCheckpoint("b", {})).value();
    for (auto* w : {wa.get(), wb.get()}) {
      ASSERT_OK(w->PutTensor({"t", DType::kU8, {bytes.size()}}, std::as_bytes(std::span(bytes))));
    }
    ASSERT_OK(wa->Commit().Wait());
    ASSERT_OK(wb->Commit().Wait());
    std::vector<std::string> packs;
    const std::vector<std::string> keys = std::move(store->List("")).value();
    for (const auto& key : keys) {
      if (key.find(kPackKeyPrefix) != std::string::npos) packs.push_back(key);
    }
    ASSERT_EQ(packs.size(), 2u);  // the chunk, stored by each host
    std::sort(packs.begin(), packs.end());
    auto c = host("c");  // records the chunk in the first pack listed
    ASSERT_OK(c->Verify(std::nullopt, {}).status());
    ASSERT_OK(store->Delete(packs[0]));
    {
      std::lock_guard lock(store->mu);
      store->failing = packs[1];
    }
    EXPECT_OK(c->Refresh());  // the other pack's index is a problem of this sync
    {
      std::lock_guard lock(store->mu);
      store->failing.clear();
    }
    if (restart) {
      c.reset();
      c = host("c");
    }
    ASSERT_OK(c->Refresh());
    auto report = c->Verify(std::nullopt, {});
    ASSERT_OK(report);
    EXPECT_TRUE(report->problems.empty()) << report->problems.front().message;
    for (const char* name : {"a", "b"}) {
      auto r = c->OpenCheckpoint(name);
      ASSERT_OK(r);
      std::string got(bytes.size(), '\0');
      ASSERT_OK((*r)->ReadBytes(*(*r)->FindTensor("t"), 0, std::as_writable_bytes(std::span(got))));
      EXPECT_EQ(got, bytes);
    }
  }
}

// Fails one request, the first of kind `op` on a key containing `part`,
// before it takes effect or after (the client sees an error for a write
// that happened: its answer was lost).
class OneLostAnswer : public BackendWrapper {
 public:
  OneLostAnswer(std::shared_ptr<Backend> inner, std::string op, std::string part, bool after)
      : BackendWrapper(std::move(inner)), op_(std::move(op)), part_(std::move(part)), after_(after) {}
  std::atomic<bool> armed{false}, fired{false};
  Status PutIfAbsent(std::string_view key, std::span<const std::byte> data) override {
    if (!Hit("PUT", key)) return BackendWrapper::PutIfAbsent(key, data);
    if (!after_) return Lost(key);
    Status st = BackendWrapper::PutIfAbsent(key, data);
    return st.ok() ? Lost(key) : st;
  }
  Result<std::string> ReadAll(std::string_view key, uint64_t max_bytes) override {
    if (Hit("GET", key)) return Lost(key);
    return BackendWrapper::ReadAll(key, max_bytes);
  }
  Result<std::vector<std::string>> List(std::string_view prefix) override {
    if (Hit("LIST", prefix)) return Lost(prefix);
    return BackendWrapper::List(prefix);
  }

 private:
  bool Hit(std::string_view op, std::string_view key) {
    return armed && op == op_ && key.find(part_) != std::string_view::npos && !fired.exchange(true);
  }
  static Status Lost(std::string_view key) { return Status::IOError("connection lost on " + std::string(key) + " (test)"); }
  const std::string op_, part_;
  const bool after_;
};

// A commit that fails from one fault at any step after its part may be in
// the store takes its part and its claim back, so a new save of the name
// commits (a one-rank save no longer stays pending, "already committed",
// until rm).
TEST(RepositoryOnAStore, ACommitFailedByOneLostAnswerTakesItsPartBackAndTheNameSavesAgain) {
  struct Case {
    const char* op;
    const char* part;
    bool after;
  };
  for (const Case& c : {Case{"PUT", "pending/x/rank-0", true}, Case{"LIST", "pending/x/", false},
                        Case{"PUT", "pending/x/commit", true}, Case{"GET", "pending/x/rank-0", false},
                        Case{"PUT", "manifests/x.manifest", false}}) {
    SCOPED_TRACE(std::string(c.op) + " " + c.part + (c.after ? ", after it took effect" : ", before"));
    TempDir dir;
    auto store = std::make_shared<OneLostAnswer>(NewMemoryBackend(), c.op, c.part, c.after);
    ASSERT_OK(Repository::Init(*store, {}));
    auto repo = OpenHost(store, dir / "a");
    auto save = [&](const std::string& bytes) {
      auto w = repo->BeginCheckpoint("x", {});
      if (!w.ok()) return w.status();
      EXPECT_OK((*w)->PutTensor({"t", DType::kU8, {bytes.size()}}, std::as_bytes(std::span(bytes))));
      return (*w)->Commit().Wait().status();
    };
    store->armed = true;
    Status failed = save(std::string(5000, 'a'));
    store->armed = false;
    ASSERT_TRUE(store->fired.load());
    EXPECT_FALSE(failed.ok());
    auto left = store->List("objects/pending/x/");
    ASSERT_OK(left);
    for (const auto& key : *left) {
      EXPECT_TRUE(key.find("/rank-") == std::string::npos && key.find("/commit") == std::string::npos)
          << key << " left by the failed commit";
    }
    ASSERT_OK(save(std::string(5000, 'b')));
    auto r = repo->OpenCheckpoint("x");
    ASSERT_OK(r);
    std::string got(5000, '\0');
    ASSERT_OK((*r)->ReadBytes(*(*r)->FindTensor("t"), 0, std::as_writable_bytes(std::span(got))));
    EXPECT_EQ(got, std::string(5000, 'b'));
  }
}

TEST(RepositoryOnAStore, HostileIdsAndForeignStateDirectoriesAreRefused) {
  TempDir dir;
  std::shared_ptr<Backend> store = NewMemoryBackend();
  ASSERT_OK(Repository::Init(*store, RepositoryConfig{}));
  const std::string honest = *store->ReadAll("ckptfs.json");
  const size_t at = honest.find("\"repository_id\"");
  ASSERT_NE(at, std::string::npos);
  const size_t value = honest.find('"', honest.find(':', at)) + 1;
  const size_t end = honest.find('"', value);
  OpenOptions o;
  o.threads = 1;
  // The id names a directory of the cache: a path, a name too long, or
  // characters outside [A-Za-z0-9_-] are refused before anything is made.
  for (const std::string& evil : std::vector<std::string>{"../../escaped", "a/b", std::string(65, 'a'), "x y", ".."}) {
    std::string config = honest;
    config.replace(value, end - value, evil);
    ASSERT_OK(store->Put("ckptfs.json", std::as_bytes(std::span(config))));
    auto r = Repository::Open(store, {.cache_dir = dir / "never"});
    EXPECT_TRUE(r.status().IsCorruption()) << evil << ": " << r.status().ToString();
    EXPECT_NE(r.status().message().find("'repository_id' must be 1 to 64 of [A-Za-z0-9_-]"), std::string::npos);
    EXPECT_FALSE(std::filesystem::exists(dir / "never")) << evil;
  }
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/../escaped"));
  ASSERT_OK(store->Put("ckptfs.json", std::as_bytes(std::span(honest))));

  // A cache directory made here is the user's alone.
  o.cache_dir = dir / "mine/state";
  {
    auto mine = Repository::Open(store, o);
    ASSERT_OK(mine);
  }
  struct stat sb;
  ASSERT_EQ(::stat((dir / "mine").c_str(), &sb), 0);
  EXPECT_EQ(sb.st_mode & 0777, 0700u);
  ASSERT_EQ(::stat((dir / "mine/state").c_str(), &sb), 0);
  EXPECT_EQ(sb.st_mode & 0777, 0700u);
  if (::geteuid() != 0) GTEST_SKIP() << "the foreign-owner checks need root (chown)";
  // Another user's symbolic link on the way is not followed; another user's
  // directory is not used.
  std::filesystem::create_directory(dir / "elsewhere");
  std::filesystem::create_directory_symlink(dir / "elsewhere", dir / "link");
  ASSERT_EQ(::lchown((dir / "link").c_str(), 4321, 4321), 0);
  o.cache_dir = dir / "link/state";
  auto via_link = Repository::Open(store, o);
  EXPECT_EQ(via_link.status().code(), StatusCode::kFailedPrecondition) << via_link.status().ToString();
  EXPECT_NE(via_link.status().message().find("symbolic link owned by user 4321"), std::string::npos);
  EXPECT_FALSE(std::filesystem::exists(dir / "elsewhere/state"));
  std::filesystem::create_directory(dir / "theirs");
  ASSERT_EQ(::chown((dir / "theirs").c_str(), 4321, 4321), 0);
  o.cache_dir = dir / "theirs";
  auto foreign = Repository::Open(store, o);
  EXPECT_EQ(foreign.status().code(), StatusCode::kFailedPrecondition) << foreign.status().ToString();
  EXPECT_NE(foreign.status().message().find("belongs to user 4321"), std::string::npos);
}

}  // namespace
}  // namespace ckptfs

namespace ckptfs {
namespace {

TEST(PackInfo, RecordsDecodeOnlyFromTheirExactEncoding) {
  // Found by fuzz_catalog_records: trailing bytes were ignored.
  auto info = DecodePackInfo(EncodePackInfo({1 << 20, 12}));
  ASSERT_OK(info);
  EXPECT_EQ(info->size, 1u << 20);
  EXPECT_EQ(info->chunks, 12u);
  EXPECT_TRUE(DecodePackInfo(EncodePackInfo({1 << 20, 12}) + "x").status().IsCorruption());
  EXPECT_TRUE(DecodePackInfo("\x02\x01\x01").status().IsCorruption());
}

TEST(CatalogSchema, CountersAndKeysDecodeOnlyFromTheirExactEncoding) {
  auto seq = DecodeSequence(EncodeSequence(42));
  ASSERT_OK(seq);
  EXPECT_EQ(*seq, 42u);
  EXPECT_TRUE(DecodeSequence("1234567").status().IsCorruption());
  auto version = DecodeFormatVersion(EncodeFormatVersion(7));
  ASSERT_OK(version);
  EXPECT_EQ(*version, 7u);
  EXPECT_TRUE(DecodeFormatVersion(EncodeFormatVersion(7) + "x").status().IsCorruption());
  ChunkId id;
  for (size_t i = 0; i < 16; ++i) id.bytes[i] = static_cast<uint8_t>(i * 17);
  auto back = keys::ChunkIdOfKey(keys::Chunk(id));
  ASSERT_OK(back);
  EXPECT_EQ(*back, id);
  EXPECT_TRUE(keys::ChunkIdOfKey("short").status().IsCorruption());
  EXPECT_EQ(keys::CheckpointOfKey(keys::Rank("step-1", 3)), "step-1");
  EXPECT_EQ(keys::CheckpointOfKey(keys::Member("step-1", "w")), "step-1");
  EXPECT_LT(keys::Rank("a", 255), keys::Rank("a", 256));  // ranks scan in order
}

TEST_F(LocalRepository, AWriterToldToCompressEveryChunkCompressesTheLowYieldOnes) {
  // fp32 values of a normal distribution (Adam moments, master weights):
  // byte grouping saves about 16 %, under the adaptive codec's bar, so
  // while the disk keeps up it stores them raw. An import reading its
  // source from the same disk asks for every chunk to be compressed.
  ASSERT_TRUE(repo_->config().adaptive);
  std::mt19937 gen(11);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::vector<float> values(1 << 20);
  for (float& v : values) v = normal(gen);
  Ref r{{"optim.exp_avg", DType::kF32, {1024, 1024}}, {}};
  r.bytes.resize(values.size() * sizeof(float));
  std::memcpy(r.bytes.data(), values.data(), r.bytes.size());
  WriterOptions options{0, 1, 7, {}};
  options.compress_every_chunk = true;
  auto w = repo_->BeginCheckpoint("imported", options);
  ASSERT_OK(w);
  ASSERT_OK((*w)->PutTensor(r.info, r.bytes));
  auto res = (*w)->Commit().Wait();
  ASSERT_OK(res);
  EXPECT_EQ(res->logical_bytes, r.bytes.size());
  // Every chunk compressed: 0.836 of the bytes (the adaptive codec on a
  // disk that keeps up stores about 0.90).
  EXPECT_LT(res->stored_bytes, r.bytes.size() * 85 / 100) << res->stored_bytes;
  EXPECT_GT(res->stored_bytes, r.bytes.size() * 6 / 10);
  ExpectWhole("imported", r);
}

TEST_F(LocalRepository, SecondOpenOfOneRepositoryInAProcessIsRefused) {
  // Two LMDB environments of one catalog in one process corrupt each other's
  // lock table: the second open is refused, and a forked child, which does
  // not share the parent's environment, may open its own.
  auto second = Repository::Open(dir_.path());
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(second.status().detail(), StatusDetail::kCatalogOpenInProcess);
  EXPECT_NE(second.status().message().find("already open in this process"), std::string::npos);
  EXPECT_EQ(second.status().message().find("reindex"), std::string::npos) << second.status().ToString();
  // The child opens the catalog alone: it starts no thread (ThreadSanitizer
  // forbids that after a fork of a multi-threaded process).
  pid_t pid = fork();
  if (pid == 0) _exit(LmdbEnv::Open(dir_.path() + "/catalog", false, 0).ok() ? 0 : 1);
  int status = 0;
  waitpid(pid, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  repo_.reset();
  EXPECT_OK(Repository::Open(dir_.path()));  // once closed, it opens again
}

// Runs `child` in a forked process and returns its exit code; -1 when it
// had not exited after 60 s (it is then killed): a hang is a failure.
int RunForkedChild(const std::function<int()>& child) {
  pid_t pid = fork();
  if (pid == 0) _exit(child());
  for (int i = 0; i < 6000; ++i) {
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  return -1;
}

// What a test may do around fork() under the sanitizers. ThreadSanitizer
// forbids new threads in a child of a threaded process. gcc 12's
// AddressSanitizer does not lock its allocator across fork(): a child may
// find the lock held by a parent thread that does not exist in it and hang
// in its first allocation (glibc's malloc takes its locks across fork, so
// a normal build has no such hang); so under ASan the parent forks only
// once its threads are idle.
using testing::kAddressSanitizer;
using testing::kThreadSanitizer;
constexpr bool kChildMayStartThreads = !kThreadSanitizer && !kAddressSanitizer;

TEST_F(LocalRepository, AForkedChildRefusesInheritedHandlesAndOpensTheRepositoryAgain) {
  auto first = MakeRef("w", DType::kF32, {1 << 18}, 31);
  auto w = Begin("before-fork");
  PutFlat(*w, first, 0, first.info.shape[0]);
  ASSERT_OK(w->Commit().Wait());
  w.reset();
  auto reader = std::move(repo_->OpenCheckpoint("before-fork")).value();
  // A save in flight in the parent when it forks: its writer, its threads
  // and its commit belong to the parent.
  auto inflight = Begin("in-flight");
  PutFlat(*inflight, first, 0, first.info.shape[0]);
  CommitHandle handle = inflight->Commit();
  if (kAddressSanitizer) ASSERT_OK(handle.Wait());  // see kAddressSanitizer
  const std::string path = dir_.path();
  int code = RunForkedChild([&]() -> int {
    auto list = repo_->ListCheckpoints();
    if (list.ok() || list.status().code() != StatusCode::kFailedPrecondition) return 10;
    if (list.status().message().find("open the repository again") == std::string::npos) return 11;
    if (repo_->BeginCheckpoint("child", {0, 1, 1, {}}).ok()) return 12;
    std::vector<std::byte> got(first.bytes.size());
    if (reader->ReadBytes(*reader->FindTensor("w"), 0, got).ok()) return 13;
    if (handle.Wait().ok() || handle.Ready()) return 14;
    // Destroying what the parent made releases nothing and does not hang.
    handle = CommitHandle();
    inflight.reset();
    reader.reset();
    repo_.reset();
    // Where the sanitizer allows it, the child opens the repository and
    // uses it (the Python fork test does so too).
    if (!kChildMayStartThreads) return 0;
    auto mine = Repository::Open(path);
    if (!mine.ok()) return 20;
    auto cw = (*mine)->BeginCheckpoint("child", {0, 1, 2, {}});
    if (!cw.ok()) return 21;
    if (!(*cw)->PutTensor(first.info, first.bytes).ok() || !(*cw)->Commit().Wait().ok()) return 22;
    auto cr = (*mine)->OpenCheckpoint("before-fork");
    if (!cr.ok()) return 23;
    std::vector<std::byte> again(first.bytes.size());
    if (!(*cr)->ReadBytes(*(*cr)->FindTensor("w"), 0, again).ok() || again != first.bytes) return 24;
    return 0;
  });
  EXPECT_EQ(code, 0) << "the child failed at check " << code << " (-1: it hung)";
  // The parent's handles go on as if nothing happened.
  ASSERT_OK(handle.Wait());
  inflight.reset();
  std::vector<std::byte> got(first.bytes.size());
  ASSERT_OK(reader->ReadBytes(*reader->FindTensor("w"), 0, got));
  EXPECT_TRUE(got == first.bytes);
  ExpectWhole("in-flight", first);
  if (kChildMayStartThreads) ExpectWhole("child", first);
}

// Writes `t` over its record in the catalog, as a damaged disk or a bug could.
void OverwriteTensorRecord(const std::string& repo, const std::string& checkpoint, const TensorRecord& t) {
  auto env = LmdbEnv::Open(repo + "/catalog", false, 0);
  ASSERT_OK(env);
  ASSERT_OK((*env)->Update([&](WriteTxn& txn) {
    return txn.Put(Table::kTensors, keys::Member(checkpoint, t.name), EncodeTensor(t));
  }));
}

TEST_F(LocalRepository, DamagedRecordsAreRejectedWhenOpenedAndReportedByVerifyAndReindex) {
  Ref a = MakeRef("a", DType::kF32, {64, 1024}, 1);  // 256 KiB: 4 chunks
  Ref b = MakeRef("b", DType::kBF16, {100}, 2);
  for (const char* name : {"good", "bad"}) {
    auto w = Begin(name);
    ASSERT_OK(w->PutTensor(a.info, a.bytes));
    ASSERT_OK(w->PutTensor(b.info, b.bytes));
    ASSERT_OK(w->Commit().Wait());
  }
  TensorRecord damaged;
  {
    auto reader = repo_->OpenCheckpoint("bad");
    ASSERT_OK(reader);
    damaged = *(*reader)->FindTensor("a");
  }
  ASSERT_GE(damaged.shards[0].chunks.size(), 2u);
  damaged.shards[0].chunks.pop_back();  // the shard's chunks no longer cover its region
  damaged.shards[0].ComputeStarts();
  repo_.reset();
  OverwriteTensorRecord(dir_.path(), "bad", damaged);
  Reopen();

  auto reader = repo_->OpenCheckpoint("bad");
  ASSERT_FALSE(reader.ok());
  EXPECT_TRUE(reader.status().IsCorruption());
  EXPECT_NE(reader.status().message().find("tensor 'a'"), std::string::npos) << reader.status().message();
  EXPECT_NE(reader.status().message().find("ckpt reindex"), std::string::npos);
  ExpectWhole("good", a);
  auto report = repo_->Verify(std::nullopt);
  ASSERT_OK(report);
  ASSERT_EQ(report->problems.size(), 1u);
  EXPECT_EQ(report->problems[0].checkpoint, "bad");
  EXPECT_EQ(report->checkpoints, 1u);  // the intact one was verified

  // Reindex rebuilds the record from the intact manifest.
  repo_.reset();
  auto rebuilt = Repository::Reindex(dir_.path());
  ASSERT_OK(rebuilt);
  EXPECT_TRUE(rebuilt->problems.empty());
  Reopen();
  ExpectWhole("bad", a);
  ExpectWhole("bad", b);

  // A damaged manifest (valid checksum) is skipped by reindex and reported by verify.
  Manifest m;
  {
    auto r2 = repo_->OpenCheckpoint("bad");
    ASSERT_OK(r2);
    m.checkpoint = (*r2)->info();
    m.tensors = (*r2)->tensors();
  }
  m.checkpoint.name = "crafted";
  m.tensors[0] = damaged;
  const std::string bytes = EncodeManifest(m);
  {
    auto backend = OpenLocalBackend(dir_.path() + "/objects");
    ASSERT_OK(backend);
    ASSERT_OK((*backend)->Put(keys::ManifestObject("crafted"), std::as_bytes(std::span(bytes))));
  }
  repo_.reset();
  rebuilt = Repository::Reindex(dir_.path());
  ASSERT_OK(rebuilt);
  ASSERT_EQ(rebuilt->problems.size(), 1u);
  EXPECT_NE(rebuilt->problems[0].find("manifests/crafted.manifest"), std::string::npos);
  EXPECT_NE(rebuilt->problems[0].find("its region needs"), std::string::npos) << rebuilt->problems[0];
  EXPECT_EQ(rebuilt->checkpoints, 2u);
  Reopen();
  EXPECT_TRUE(repo_->OpenCheckpoint("crafted").status().IsNotFound());
  report = repo_->Verify(std::nullopt);
  ASSERT_OK(report);
  ASSERT_EQ(report->problems.size(), 1u);
  EXPECT_NE(report->problems[0].what.find("manifests/crafted.manifest"), std::string::npos);
}

}  // namespace
}  // namespace ckptfs
