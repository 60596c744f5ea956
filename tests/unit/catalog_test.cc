#include <gtest/gtest.h>

#include "meta/lmdb_env.h"
#include "meta/records.h"
#include "test_util.h"

namespace ckptfs {
namespace {

using testing::TempDir;

TEST(Lmdb, PutGetScanDelete) {
  TempDir dir;
  auto env = LmdbEnv::Open(dir / "cat", true, 1 << 20);
  ASSERT_OK(env);
  ASSERT_OK((*env)->Update([](WriteTxn& t) -> Status {
    RETURN_IF_ERROR(t.Put(Table::kTensors, std::string("a\0x", 3), "1"));
    RETURN_IF_ERROR(t.Put(Table::kTensors, std::string("a\0y", 3), "2"));
    return t.Put(Table::kTensors, std::string("b\0x", 3), "3");
  }));
  std::vector<std::string> seen;
  ASSERT_OK((*env)->Read([&](const ReadTxn& t) -> Status {
    auto v = t.Get(Table::kTensors, std::string("a\0y", 3));
    EXPECT_TRUE(v.ok() && v->has_value() && **v == "2");
    EXPECT_FALSE(t.Get(Table::kChunks, "zz")->has_value());
    return t.Scan(Table::kTensors, std::string("a\0", 2), [&](std::string_view, std::string_view v) {
      seen.emplace_back(v);
      return true;
    });
  }));
  EXPECT_EQ(seen, (std::vector<std::string>{"1", "2"}));
  ASSERT_OK((*env)->Update([](WriteTxn& t) { return t.Delete(Table::kTensors, std::string("a\0x", 3)); }));
  ASSERT_OK((*env)->Read([](const ReadTxn& t) -> Status {
    EXPECT_EQ(t.Count(Table::kTensors), 2u);
    return Status::OK();
  }));
}

TEST(Lmdb, FailedUpdateRollsBack) {
  TempDir dir;
  auto env = std::move(LmdbEnv::Open(dir / "cat", true, 1 << 20)).value();
  Status st = env->Update([](WriteTxn& t) -> Status {
    RETURN_IF_ERROR(t.Put(Table::kMeta, "k", "v"));
    return Status::InvalidArgument("no");
  });
  EXPECT_FALSE(st.ok());
  ASSERT_OK(env->Read([](const ReadTxn& t) -> Status {
    EXPECT_FALSE(t.Get(Table::kMeta, "k")->has_value());
    return Status::OK();
  }));
}

TEST(Lmdb, MapGrowsWhenFull) {
  TempDir dir;
  auto env = std::move(LmdbEnv::Open(dir / "cat", true, 256 << 10)).value();
  const uint64_t before = env->map_size();
  std::string value(4000, 'v');
  for (int batch = 0; batch < 20; ++batch) {
    ASSERT_OK(env->Update([&](WriteTxn& t) -> Status {
      for (int i = 0; i < 100; ++i) RETURN_IF_ERROR(t.Put(Table::kChunks, std::to_string(batch * 100 + i), value));
      return Status::OK();
    }));
  }
  EXPECT_GT(env->map_size(), before);
  ASSERT_OK(env->Read([](const ReadTxn& t) -> Status {
    EXPECT_EQ(t.Count(Table::kChunks), 2000u);
    return Status::OK();
  }));
  // Reopening adopts the grown size.
  env.reset();
  auto again = LmdbEnv::Open(dir / "cat", false, 256 << 10);
  ASSERT_OK(again);
  EXPECT_GT((*again)->map_size(), before);
}

TEST(Lmdb, OpenMissingWithoutCreateIsNotFound) {
  TempDir dir;
  EXPECT_TRUE(LmdbEnv::Open(dir / "none", false, 1 << 20).status().IsNotFound());
}

TensorRecord SampleTensor() {
  TensorRecord t{"layers.0/weight", DType::kBF16, {4, 6}, {}};
  ShardRecord a{Region::OfBox({{0, 0}, {4, 3}}), {0, 2}, {{ChunkId::Of({}), 24}}, {}};
  ShardRecord b{Region::OfFlat(3, 9), {1}, {{ChunkId::Of(std::as_bytes(std::span("x", 1))), 12}}, {}};
  a.ComputeStarts();
  b.ComputeStarts();
  t.shards = {a, b};
  return t;
}

TEST(Records, RoundTripAndRejectTruncation) {
  TensorRecord t = SampleTensor();
  auto back = DecodeTensor(EncodeTensor(t));
  ASSERT_OK(back);
  EXPECT_EQ(back->name, t.name);
  EXPECT_EQ(back->shape, t.shape);
  ASSERT_EQ(back->shards.size(), 2u);
  EXPECT_EQ(back->shards[0].region, t.shards[0].region);
  EXPECT_EQ(back->shards[0].ranks, t.shards[0].ranks);
  EXPECT_EQ(back->shards[1].chunks, t.shards[1].chunks);
  EXPECT_EQ(back->shards[1].ByteSize(), 12u);

  CheckpointRecord c;
  c.name = "step-1";
  c.step = -5;
  c.world_size = 3;
  c.committed_ranks = {0, 2};
  c.tags = {{"run", "a"}};
  auto cb = DecodeCheckpoint(EncodeCheckpoint(c));
  ASSERT_OK(cb);
  EXPECT_EQ(cb->step, std::optional<int64_t>(-5));
  EXPECT_EQ(cb->committed_ranks, c.committed_ranks);
  EXPECT_EQ(cb->tags, c.tags);

  std::string enc = EncodeTensor(t);
  for (size_t cut = 0; cut < enc.size(); ++cut) {
    EXPECT_FALSE(DecodeTensor(enc.substr(0, cut)).ok()) << cut;
  }
  EXPECT_FALSE(DecodeTensor(enc + "x").ok());
}

TEST(Records, ManifestChecksumCatchesDamage) {
  Manifest m;
  m.checkpoint.name = "c";
  m.tensors = {SampleTensor()};
  m.blobs = {BlobRecord{"rng", 5, {{ChunkId::Of({}), 5}}}};
  std::string enc = EncodeManifest(m);
  auto back = DecodeManifest(enc);
  ASSERT_OK(back);
  EXPECT_EQ(back->tensors[0].name, "layers.0/weight");
  EXPECT_EQ(back->blobs[0].name, "rng");
  for (size_t i = 0; i < enc.size(); i += 7) {
    std::string bad = enc;
    bad[i] ^= 0x10;
    EXPECT_TRUE(DecodeManifest(bad).status().IsCorruption()) << i;
  }
}

}  // namespace
}  // namespace ckptfs
