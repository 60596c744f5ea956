// Copying checkpoints between repositories (CopyCheckpoints): between every
// pair of kinds that matters (a local directory, an in-memory store, S3),
// only the chunks the destination lacks are sent, the copy is identical to
// its source, and an interrupted copy resumes.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>

#include "backend/backend.h"
#include "ckpt/repository.h"
#include "test_repositories.h"
#include "test_util.h"

namespace ckptfs {
namespace {

using testing::RandomBytes;
using testing::RepoKind;
using testing::RepoKindName;
using testing::TestRepository;

struct KindPair {
  RepoKind from, to;
};
void PrintTo(const KindPair& p, std::ostream* os) { *os << RepoKindName(p.from) << "_to_" << RepoKindName(p.to); }

RepositoryConfig SmallConfig() {
  RepositoryConfig config;
  config.chunk_size = 64 << 10;
  config.pack_size = 1 << 20;
  return config;
}

// A checkpoint of two ranks: a row-sharded f32 matrix, a bf16 vector both
// ranks hold (replicas), a u8 tensor in flat ranges, and a blob per rank.
// `changed_rows` of the matrix's 256 rows differ from seed to seed; the
// rest stay the same.
void SaveTwoRanks(Repository& repo, const std::string& name, int64_t step, uint32_t seed, int changed_rows = 256) {
  const Shape w_shape = {256, 256};
  std::vector<std::byte> w = RandomBytes(256 * 256 * 4, 1);
  if (changed_rows > 0) {
    std::vector<std::byte> fresh = RandomBytes(changed_rows * 256 * 4, seed);
    std::memcpy(w.data(), fresh.data(), fresh.size());
  }
  const std::vector<std::byte> norm = RandomBytes(4096 * 2, seed + 1);
  const std::vector<std::byte> flat = RandomBytes(100000, seed + 2);
  for (uint32_t rank = 0; rank < 2; ++rank) {
    WriterOptions wo;
    wo.rank = rank;
    wo.world_size = 2;
    wo.step = step;
    wo.tags = {{"run", "copy-test"}};
    auto writer = repo.BeginCheckpoint(name, wo);
    ASSERT_TRUE(writer.ok()) << writer.status().ToString();
    Box rows{{rank * 128ull, 0}, {128, 256}};
    HostSource part(std::span<const std::byte>(w).subspan(rank * 128 * 256 * 4, 128 * 256 * 4));
    ASSERT_TRUE((*writer)->PutShard({"w", DType::kF32, w_shape}, Region::OfBox(rows), part).ok());
    ASSERT_TRUE((*writer)->PutTensor({"norm", DType::kBF16, {4096}}, norm).ok());
    const uint64_t cut = 60000;
    FlatRange range = rank == 0 ? FlatRange{0, cut} : FlatRange{cut, 100000};
    HostSource fpart(std::span<const std::byte>(flat).subspan(range.start, range.end - range.start));
    ASSERT_TRUE((*writer)->PutShard({"flat", DType::kU8, {100000}}, Region::OfFlat(range.start, range.end), fpart).ok());
    const std::string blob = "state of rank " + std::to_string(rank) + " " + std::to_string(seed);
    ASSERT_TRUE((*writer)->PutBlob("rank" + std::to_string(rank), testing::AsBytes(blob)).ok());
    auto done = (*writer)->Commit().Wait();
    ASSERT_TRUE(done.ok()) << done.status().ToString();
  }
}

// The records of `name` in both, identical but for when they were made.
void ExpectSameCheckpoint(Repository& a, Repository& b, const std::string& name) {
  auto ra = a.OpenCheckpoint(name);
  auto rb = b.OpenCheckpoint(name);
  ASSERT_TRUE(ra.ok()) << ra.status().ToString();
  ASSERT_TRUE(rb.ok()) << rb.status().ToString();
  const CheckpointRecord& x = (*ra)->info();
  const CheckpointRecord& y = (*rb)->info();
  EXPECT_EQ(x.step, y.step);
  EXPECT_EQ(x.world_size, y.world_size);
  EXPECT_EQ(x.tags, y.tags);
  EXPECT_EQ(x.committed_ranks, y.committed_ranks);
  EXPECT_EQ(x.logical_bytes, y.logical_bytes);
  ASSERT_EQ((*ra)->tensors().size(), (*rb)->tensors().size());
  for (size_t i = 0; i < (*ra)->tensors().size(); ++i) {
    const TensorRecord& t = (*ra)->tensors()[i];
    EXPECT_EQ(EncodeTensor(t), EncodeTensor((*rb)->tensors()[i])) << t.name;
    std::vector<std::byte> ba(t.ByteSize()), bb(t.ByteSize());
    ASSERT_TRUE((*ra)->ReadBytes(t, 0, ba).ok());
    Status st = (*rb)->ReadBytes((*rb)->tensors()[i], 0, bb);
    ASSERT_TRUE(st.ok()) << st.ToString();
    EXPECT_TRUE(ba == bb) << t.name;
  }
  ASSERT_EQ((*ra)->blobs().size(), (*rb)->blobs().size());
  for (size_t i = 0; i < (*ra)->blobs().size(); ++i) {
    EXPECT_EQ(EncodeBlob((*ra)->blobs()[i]), EncodeBlob((*rb)->blobs()[i]));
  }
}

class CopyBetween : public ::testing::TestWithParam<KindPair> {
 protected:
  void SetUp() override {
    std::string why;
    CKPTFS_SKIP_UNLESS(from_.Create(GetParam().from, SmallConfig(), &why), why);
    CKPTFS_SKIP_UNLESS(to_.Create(GetParam().to, SmallConfig(), &why), why);
    src_ = Open(from_);
    dst_ = Open(to_);
  }
  static std::unique_ptr<Repository> Open(const TestRepository& where) {
    auto r = where.Open();
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? std::move(r).value() : nullptr;
  }
  Result<CopyReport> Copy(std::vector<std::string> names) {
    CopyOptions o;
    o.names = std::move(names);
    return CopyCheckpoints(*src_, *dst_, o);
  }

  TestRepository from_, to_;
  std::unique_ptr<Repository> src_, dst_;
};

TEST_P(CopyBetween, CopyIsIdenticalAndASecondCopySendsNothing) {
  ASSERT_NO_FATAL_FAILURE(SaveTwoRanks(*src_, "step-1", 1, 7));
  auto first = Copy({"step-1"});
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  ASSERT_EQ(first->checkpoints.size(), 1u);
  EXPECT_EQ(first->checkpoints[0].outcome, CopiedCheckpoint::Outcome::kCopied);
  EXPECT_EQ(first->checkpoints[0].ranks_copied, 2u);
  EXPECT_EQ(first->chunks_present, 0u);
  EXPECT_GT(first->chunks_sent, 0u);
  EXPECT_GT(first->stored_bytes_sent, 0u);
  ExpectSameCheckpoint(*src_, *dst_, "step-1");

  // Again, and from a fresh open of the destination (as a new process):
  // present, nothing sent.
  dst_.reset();
  dst_ = Open(to_);
  auto again = Copy({"step-1"});
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(again->checkpoints[0].outcome, CopiedCheckpoint::Outcome::kPresent);
  EXPECT_EQ(again->chunks_sent, 0u);
  EXPECT_EQ(again->stored_bytes_sent, 0u);

  // The destination's own checks agree.
  auto verify = dst_->Verify(std::string("step-1"));
  ASSERT_TRUE(verify.ok()) << verify.status().ToString();
  EXPECT_TRUE(verify->ok());
}

TEST_P(CopyBetween, OnlyTheChunksTheDestinationLacksAreSent) {
  ASSERT_NO_FATAL_FAILURE(SaveTwoRanks(*src_, "step-1", 1, 7, 0));
  ASSERT_TRUE(Copy({"step-1"}).ok());
  // 16 of 256 rows of the matrix change, and the small tensors.
  ASSERT_NO_FATAL_FAILURE(SaveTwoRanks(*src_, "step-2", 2, 8, 16));
  auto second = Copy({"step-2"});
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  const CopiedCheckpoint& c = second->checkpoints[0];
  // The matrix's 256 KiB of unchanged rows are 4 whole chunks the
  // destination has; the changed rows, the bf16 vector, the flat tensor
  // and the blobs are new.
  EXPECT_GE(c.chunks_present, 3u);
  EXPECT_EQ(c.raw_bytes_present + c.raw_bytes_sent, uint64_t(256 * 256 * 4 + 4096 * 2 + 100000) +
                                                        std::string("state of rank 0 8").size() * 2);
  EXPECT_LT(c.raw_bytes_sent, c.raw_bytes_present);
  ExpectSameCheckpoint(*src_, *dst_, "step-2");
}

TEST_P(CopyBetween, ChoosesAllOrTheLastAndRefusesConflicts) {
  ASSERT_NO_FATAL_FAILURE(SaveTwoRanks(*src_, "a", 1, 1));
  ASSERT_NO_FATAL_FAILURE(SaveTwoRanks(*src_, "b", 2, 2));
  ASSERT_NO_FATAL_FAILURE(SaveTwoRanks(*src_, "c", 3, 3));
  CopyOptions last;
  last.last = 2;
  auto r = CopyCheckpoints(*src_, *dst_, last);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->checkpoints.size(), 2u);
  EXPECT_EQ(r->checkpoints[0].name, "b");
  EXPECT_EQ(r->checkpoints[1].name, "c");
  CopyOptions all;
  all.all = true;
  r = CopyCheckpoints(*src_, *dst_, all);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->checkpoints.size(), 3u);
  EXPECT_EQ(r->checkpoints[0].outcome, CopiedCheckpoint::Outcome::kCopied);
  EXPECT_EQ(r->checkpoints[1].outcome, CopiedCheckpoint::Outcome::kPresent);
  EXPECT_EQ(r->checkpoints[2].outcome, CopiedCheckpoint::Outcome::kPresent);
  auto listed = dst_->ListCheckpoints();
  ASSERT_TRUE(listed.ok());
  EXPECT_EQ(listed->size(), 3u);

  // A name the source lacks: nothing copied.
  auto missing = Copy({"a", "nope"});
  EXPECT_TRUE(missing.status().IsNotFound()) << missing.status().ToString();
  // Another checkpoint of the same name at the destination.
  ASSERT_NO_FATAL_FAILURE(SaveTwoRanks(*src_, "d", 4, 4));
  ASSERT_NO_FATAL_FAILURE(SaveTwoRanks(*dst_, "d", 4, 5));
  auto conflict = Copy({"d"});
  EXPECT_TRUE(conflict.status().IsAlreadyExists()) << conflict.status().ToString();
  EXPECT_NE(conflict.status().message().find("different checkpoint named 'd'"), std::string::npos);
  // Nothing to choose: an error, not a copy of nothing.
  EXPECT_TRUE(CopyCheckpoints(*src_, *dst_, CopyOptions{}).status().code() == StatusCode::kInvalidArgument);
  EXPECT_TRUE(CopyCheckpoints(*src_, *src_, all).status().code() == StatusCode::kInvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(Repositories, CopyBetween,
                         ::testing::Values(KindPair{RepoKind::kLocal, RepoKind::kLocal},
                                           KindPair{RepoKind::kLocal, RepoKind::kMemoryStore},
                                           KindPair{RepoKind::kMemoryStore, RepoKind::kLocal},
                                           KindPair{RepoKind::kLocal, RepoKind::kS3},
                                           KindPair{RepoKind::kS3, RepoKind::kLocal},
                                           KindPair{RepoKind::kS3, RepoKind::kS3}),
                         [](const ::testing::TestParamInfo<KindPair>& info) {
                           return std::string(RepoKindName(info.param.from)) + "_to_" + RepoKindName(info.param.to);
                         });

// A store whose pack reads fail after `limit` of them: a copy that loses
// its source midway.
class FailingReads : public BackendWrapper {
 public:
  FailingReads(std::shared_ptr<Backend> inner, int limit) : BackendWrapper(std::move(inner)), left_(limit) {}
  Status ReadRange(std::string_view key, uint64_t offset, std::span<std::byte> out) override {
    if (key.find("packs/") != std::string_view::npos && left_.fetch_sub(1) <= 0) {
      return Status::IOError("the source went away");
    }
    return BackendWrapper::ReadRange(key, offset, out);
  }

 private:
  std::atomic<int> left_;
};

// A memory store holding "step-1" saved by two ranks, opened with its
// cache under `dir`, and an empty local repository at DIR/dst.
struct MemorySourceAndLocalDestination {
  std::shared_ptr<Backend> memory = NewMemoryBackend();
  OpenOptions host;
};
void SetUpCopy(const testing::TempDir& dir, MemorySourceAndLocalDestination* out) {
  ASSERT_TRUE(Repository::Init(*out->memory, SmallConfig()).ok());
  out->host.cache_dir = dir.path() + "/cache";
  auto src = Repository::Open(out->memory, out->host);
  ASSERT_TRUE(src.ok()) << src.status().ToString();
  ASSERT_NO_FATAL_FAILURE(SaveTwoRanks(**src, "step-1", 1, 7));
  ASSERT_TRUE(Repository::Init(dir.path() + "/dst", SmallConfig()).ok());
}

// Copies rank by rank (`at_once` ranks side by side) from a source that
// fails after 0, 2, 4, ... chunk reads, then from a healthy one.
void InterruptedCopy(size_t at_once) {
  testing::TempDir dir;
  MemorySourceAndLocalDestination setup;
  ASSERT_NO_FATAL_FAILURE(SetUpCopy(dir, &setup));
  std::shared_ptr<Backend>& memory = setup.memory;
  const OpenOptions& host = setup.host;

  // The source fails after 0, 2, 4, ... chunk reads: each run stops
  // somewhere in rank 0 or rank 1 and leaves nothing visible, and nothing
  // pending either (the ranks it committed are removed with the record).
  bool finished_by_broken_run = false;
  for (int limit = 0; limit < 22; limit += 2) {
    auto failing = Repository::Open(std::make_shared<FailingReads>(memory, limit), host);
    ASSERT_TRUE(failing.ok()) << failing.status().ToString();
    auto dst = Repository::Open(dir.path() + "/dst");
    ASSERT_TRUE(dst.ok());
    CopyOptions o;
    o.names = {"step-1"};
    o.ranks_at_once = at_once;
    auto r = CopyCheckpoints(**failing, **dst, o);
    if (r.ok()) {
      finished_by_broken_run = true;
      break;  // nothing was left to read
    }
    EXPECT_NE(r.status().message().find("the source went away"), std::string::npos) << r.status().ToString();
    EXPECT_TRUE((*dst)->GetCheckpoint("step-1").status().IsNotFound());
    auto pending = (*dst)->ListCheckpoints(true);
    ASSERT_TRUE(pending.ok());
    EXPECT_TRUE(pending->empty()) << pending->front().name;
  }
  auto healthy = Repository::Open(memory, host);
  ASSERT_TRUE(healthy.ok());
  auto dst = Repository::Open(dir.path() + "/dst");
  ASSERT_TRUE(dst.ok());
  CopyOptions o;
  o.names = {"step-1"};
  o.ranks_at_once = at_once;
  auto r = CopyCheckpoints(**healthy, **dst, o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  if (!finished_by_broken_run && at_once == 1) {
    // Rank 0 was committed by a broken run before rank 1 failed: its
    // chunks stayed, and are not sent again.
    EXPECT_GT(r->checkpoints[0].chunks_present, 0u);
  }
  ExpectSameCheckpoint(**healthy, **dst, "step-1");
  auto verify = (*dst)->Verify(std::nullopt);
  ASSERT_TRUE(verify.ok());
  EXPECT_TRUE(verify->ok());
}

// A copy that is cancelled leaves nothing pending; run again, it sends
// only what is missing.
TEST(CopyCheckpoints, ACancelledCopyLeavesNothingPending) {
  testing::TempDir dir;
  MemorySourceAndLocalDestination setup;
  ASSERT_NO_FATAL_FAILURE(SetUpCopy(dir, &setup));
  auto src = Repository::Open(setup.memory, setup.host);
  ASSERT_TRUE(src.ok());
  auto dst = Repository::Open(dir.path() + "/dst");
  ASSERT_TRUE(dst.ok());
  CopyOptions o;
  o.names = {"step-1"};
  o.ranks_at_once = 1;
  std::atomic<bool> stop{false};
  o.cancelled = [&] { return stop.load(); };
  // Progress comes after each group of ranks: cancelled once rank 0 is in.
  auto r = CopyCheckpoints(**src, **dst, o, [&](uint64_t done, uint64_t) {
    if (done > 0) stop.store(true);
  });
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("cancelled"), std::string::npos) << r.status().ToString();
  EXPECT_NE(r.status().message().find("its pending copy at the destination was removed"), std::string::npos)
      << r.status().ToString();
  auto pending = (*dst)->ListCheckpoints(true);
  ASSERT_TRUE(pending.ok());
  EXPECT_TRUE(pending->empty());
  o.cancelled = {};
  auto again = CopyCheckpoints(**src, **dst, o);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_GT(again->checkpoints[0].chunks_present, 0u);
  ExpectSameCheckpoint(**src, **dst, "step-1");
}

// A source that claims more ranks than its shards name is copied with the
// ranks they need: a claim of 20,000 ranks would cost 20,000 commits.
TEST(CopyCheckpoints, RanksNoShardNamesAreNotCopied) {
  testing::TempDir dir;
  ASSERT_TRUE(Repository::Init(dir.path() + "/src", SmallConfig()).ok());
  ASSERT_TRUE(Repository::Init(dir.path() + "/dst", SmallConfig()).ok());
  auto src = Repository::Open(dir.path() + "/src");
  ASSERT_TRUE(src.ok());
  const std::vector<std::byte> bytes = RandomBytes(4096, 3);
  for (uint32_t rank = 0; rank < 3; ++rank) {  // rank 2 holds nothing
    WriterOptions wo;
    wo.rank = rank;
    wo.world_size = 3;
    auto writer = (*src)->BeginCheckpoint("c", wo);
    ASSERT_TRUE(writer.ok()) << writer.status().ToString();
    if (rank < 2) {
      HostSource part(std::span<const std::byte>(bytes).subspan(rank * 2048, 2048));
      ASSERT_TRUE((*writer)->PutShard({"w", DType::kU8, {4096}}, Region::OfFlat(rank * 2048, rank * 2048 + 2048), part)
                      .ok());
    }
    ASSERT_TRUE((*writer)->Commit().Wait().ok());
  }
  auto dst = Repository::Open(dir.path() + "/dst");
  ASSERT_TRUE(dst.ok());
  CopyOptions o;
  o.names = {"c"};
  std::vector<std::string> phases;
  o.on_phase = [&](const std::string& p) { phases.push_back(p); };
  auto r = CopyCheckpoints(**src, **dst, o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->checkpoints[0].ranks_copied, 2u);
  auto copied = (*dst)->GetCheckpoint("c");
  ASSERT_TRUE(copied.ok());
  EXPECT_EQ(copied->world_size, 2u);
  ASSERT_FALSE(phases.empty());
  EXPECT_NE(phases.front().find("2 ranks of the 3 it claims"), std::string::npos) << phases.front();
  auto again = CopyCheckpoints(**src, **dst, o);  // the same content: present
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(again->checkpoints[0].outcome, CopiedCheckpoint::Outcome::kPresent);
}

TEST(CopyCheckpoints, AnInterruptedCopyResumesAndEndsIdentical) { InterruptedCopy(1); }
TEST(CopyCheckpoints, AnInterruptedCopyOfRanksSideBySideResumesAndEndsIdentical) { InterruptedCopy(2); }

TEST(CopyCheckpoints, ACorruptSourceChunkIsRefusedAndNothingShows) {
  testing::TempDir dir;
  MemorySourceAndLocalDestination setup;
  ASSERT_NO_FATAL_FAILURE(SetUpCopy(dir, &setup));
  std::shared_ptr<Backend>& memory = setup.memory;
  const OpenOptions& host = setup.host;
  // Flip a byte in the middle of every pack.
  auto keys = memory->List("objects/packs/");
  ASSERT_TRUE(keys.ok());
  ASSERT_FALSE(keys->empty());
  for (const auto& key : *keys) {
    auto all = memory->ReadAll(key);
    ASSERT_TRUE(all.ok());
    std::string bytes = *all;
    bytes[bytes.size() / 3] ^= 0x5a;
    ASSERT_TRUE(memory->Put(key, testing::AsBytes(bytes)).ok());
  }
  auto src = Repository::Open(memory, host);
  ASSERT_TRUE(src.ok());
  auto dst = Repository::Open(dir.path() + "/dst");
  ASSERT_TRUE(dst.ok());
  CopyOptions o;
  o.all = true;
  auto r = CopyCheckpoints(**src, **dst, o);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(r.status().IsCorruption()) << r.status().ToString();
  EXPECT_TRUE((*dst)->GetCheckpoint("step-1").status().IsNotFound());
}

}  // namespace
}  // namespace ckptfs
