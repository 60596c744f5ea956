#include <gtest/gtest.h>

#include "core/encoding.h"
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
    CKPT_RETURN_IF_ERROR(t.Put(Table::kTensors, std::string("a\0x", 3), "1"));
    CKPT_RETURN_IF_ERROR(t.Put(Table::kTensors, std::string("a\0y", 3), "2"));
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
    CKPT_RETURN_IF_ERROR(t.Put(Table::kMeta, "k", "v"));
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
      for (int i = 0; i < 100; ++i) CKPT_RETURN_IF_ERROR(t.Put(Table::kChunks, std::to_string(batch * 100 + i), value));
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

// A record whose checksum (for manifests) or encoding is fine but whose
// content contradicts itself is Corruption at decode, naming what is wrong;
// no reader ever sees it.
void ExpectRejected(const TensorRecord& t, const std::string& why) {
  auto back = DecodeTensor(EncodeTensor(t));
  ASSERT_FALSE(back.ok()) << why;
  EXPECT_TRUE(back.status().IsCorruption());
  EXPECT_NE(back.status().message().find(why), std::string::npos) << back.status().message();
  EXPECT_NE(back.status().message().find("ckpt reindex"), std::string::npos);
  Manifest m;
  m.checkpoint.name = "c";
  m.checkpoint.state = CheckpointState::kCommitted;
  m.checkpoint.committed_ranks = {0};
  m.tensors = {t};
  auto manifest = DecodeManifest(EncodeManifest(m));  // checksum valid
  ASSERT_FALSE(manifest.ok()) << why;
  EXPECT_NE(manifest.status().message().find(why), std::string::npos) << manifest.status().message();
  RankRecord rank{0, {t}, {}};
  EXPECT_TRUE(DecodeRank(EncodeRank(rank)).status().IsCorruption());
}

TEST(Records, ShardWhoseChunksHoldFewerBytesThanItsRegionIsCorrupt) {
  TensorRecord t = SampleTensor();
  t.shards[1].chunks.pop_back();  // none of its 12 bytes
  t.shards[1].ComputeStarts();
  ExpectRejected(t, "has chunks of 0 bytes, its region needs 12");
  t = SampleTensor();
  t.shards[0].chunks[0].raw_len += 1;  // more bytes than the region
  t.shards[0].ComputeStarts();
  ExpectRejected(t, "its region needs");
}

TEST(Records, BoxWhoseRankDiffersFromTheTensorIsCorrupt) {
  TensorRecord t = SampleTensor();
  t.shards[0].region = Region::OfBox(Box{{0, 0, 0}, {1, 2, 1}});  // rank 3, tensor rank 2
  ExpectRejected(t, "does not match a tensor of shape");
  t.shards[0].region = Region::OfBox(Box{{0, 0}, {1}});  // offsets and lengths differ
  ExpectRejected(t, "does not match a tensor of shape");
  t.shards[0].region = Region::OfBox(Box{{4, 0}, {1, 2}});  // outside the tensor
  ExpectRejected(t, "exceeds shape");
  t.shards[0].region = Region::OfFlat(4, 3);
  ExpectRejected(t, "does not fit");
}

TEST(Records, ChunkLengthsAreBoundedAndShapesCannotOverflow) {
  TensorRecord t = SampleTensor();
  t.shards[0].chunks[0].raw_len = 0;
  t.shards[0].ComputeStarts();
  EXPECT_TRUE(DecodeTensor(EncodeTensor(t)).status().IsCorruption());
  t.shards[0].chunks[0].raw_len = kMaxChunkSize + 1;
  t.shards[0].ComputeStarts();
  ExpectRejected(t, "chunk of 268435457 bytes");
  t = SampleTensor();
  t.shape = {uint64_t{1} << 40, uint64_t{1} << 30};
  ExpectRejected(t, "too many elements");
  t.shape = {uint64_t{1} << 62};
  t.dtype = DType::kF64;
  t.shards.clear();
  ExpectRejected(t, "too large");

  ChunkLocation loc{"p", UINT64_MAX - 2, 100, 100, Codec::kRaw};
  EXPECT_TRUE(DecodeChunkLocation(EncodeChunkLocation(loc)).status().IsCorruption());
  loc.offset = 16;
  EXPECT_OK(DecodeChunkLocation(EncodeChunkLocation(loc)));
  loc.raw_len = kMaxChunkSize + 1;
  EXPECT_TRUE(DecodeChunkLocation(EncodeChunkLocation(loc)).status().IsCorruption());

  BlobRecord b{"rng", 6, {{ChunkId::Of({}), 5}}};
  auto blob = DecodeBlob(EncodeBlob(b));
  ASSERT_FALSE(blob.ok());
  EXPECT_NE(blob.status().message().find("blob 'rng' of 6 bytes has chunks of 5 bytes"), std::string::npos);
}

TEST(Records, CheckpointRanksMustFitTheWorld) {
  CheckpointRecord c;
  c.name = "c";
  c.world_size = 2;
  c.committed_ranks = {0, 1};
  c.state = CheckpointState::kCommitted;
  EXPECT_OK(DecodeCheckpoint(EncodeCheckpoint(c)));
  c.committed_ranks = {1, 0};
  EXPECT_TRUE(DecodeCheckpoint(EncodeCheckpoint(c)).status().IsCorruption());
  c.committed_ranks = {0, 2};
  EXPECT_TRUE(DecodeCheckpoint(EncodeCheckpoint(c)).status().IsCorruption());
  c.committed_ranks = {0};  // committed without every rank
  EXPECT_TRUE(DecodeCheckpoint(EncodeCheckpoint(c)).status().IsCorruption());
  c.state = CheckpointState::kPending;
  EXPECT_OK(DecodeCheckpoint(EncodeCheckpoint(c)));
  c.world_size = 0;
  c.committed_ranks = {};
  EXPECT_TRUE(DecodeCheckpoint(EncodeCheckpoint(c)).status().IsCorruption());
}

TEST(Records, ASaveAttemptRaisesTheVersionOnlyOfRecordsThatHaveOne) {
  CheckpointRecord c;
  c.name = "c";
  c.world_size = 2;
  c.committed_ranks = {1};
  const std::string plain = EncodeCheckpoint(c);
  EXPECT_EQ(plain[0], 1);  // what earlier builds wrote and read
  c.attempt = "0001764300000000-0123456789abcdef";
  const std::string with = EncodeCheckpoint(c);
  EXPECT_EQ(with[0], 2);
  auto back = DecodeCheckpoint(with);
  ASSERT_OK(back);
  EXPECT_EQ(back->attempt, c.attempt);
  Manifest pending;
  pending.checkpoint = c;
  auto m = DecodeManifest(EncodeManifest(pending));
  ASSERT_OK(m);
  EXPECT_EQ(m->checkpoint.attempt, c.attempt);
  for (size_t cut = 0; cut < with.size(); ++cut) EXPECT_FALSE(DecodeCheckpoint(with.substr(0, cut)).ok()) << cut;
  std::string empty = plain;
  empty[0] = 2;
  empty.push_back('\0');  // version 2 with an empty attempt: not what any encoder writes
  EXPECT_TRUE(DecodeCheckpoint(empty).status().IsCorruption());
  c.attempt = "has space";
  EXPECT_TRUE(DecodeCheckpoint(EncodeCheckpoint(c)).status().IsCorruption());
  c.attempt = std::string(kMaxAttemptSize + 1, 'a');
  EXPECT_TRUE(DecodeCheckpoint(EncodeCheckpoint(c)).status().IsCorruption());
  c.attempt = "a";
  c.committed_ranks = {0, 1};
  c.state = CheckpointState::kCommitted;  // a committed record keeps none
  EXPECT_TRUE(DecodeCheckpoint(EncodeCheckpoint(c)).status().IsCorruption());
}

TEST(Records, EveryValueHasOneEncoding) {
  // Decoders accept only what the encoders write, so a decoded record
  // encodes back to the same bytes (the fuzz targets rely on it).
  std::string enc = EncodeBlob(BlobRecord{"b", 0, {}});
  ASSERT_OK(DecodeBlob(enc));
  std::string overlong = enc;
  overlong.replace(overlong.size() - 2, 1, std::string("\x80\x00", 2));  // size 0 as two bytes
  EXPECT_TRUE(DecodeBlob(overlong).status().IsCorruption());
  const std::string too_big("\xff\xff\xff\xff\xff\xff\xff\xff\xff\x02", 10);  // 2^64 and more
  Decoder d(too_big);
  uint64_t v;
  EXPECT_TRUE(d.Varint(&v).IsCorruption());
  CheckpointRecord c;
  c.name = "c";
  std::string cp = EncodeCheckpoint(c);
  cp[1 + 1 + 1] = 2;  // version, name length, name, then the has-step flag
  EXPECT_TRUE(DecodeCheckpoint(cp).status().IsCorruption());
}

}  // namespace
}  // namespace ckptfs
