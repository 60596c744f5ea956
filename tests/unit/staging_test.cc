// GPU staging through the host copy engine (always), and through CUDA when
// a GPU is present (skipped, with the reason, otherwise).
#include "staging.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>

#include "staging_util.h"
#include "test_util.h"

#ifdef CKPTFS_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace ckptfs::gpu {
namespace {

using testing::DeviceMemory;
using testing::Extract;
using testing::HostMemory;
using testing::RandomBytes;
using testing::TempDir;
#ifdef CKPTFS_HAVE_CUDA
using testing::CudaMemory;
#endif

class Staging {
 public:
  explicit Staging(std::unique_ptr<CopyEngine> engine, std::unique_ptr<DeviceMemory> mem)
      : engine(std::move(engine)), mem(std::move(mem)) {
    RepositoryConfig config;
    config.chunk_size = 64 << 10;
    EXPECT_OK(Repository::Init(dir.path(), config));
    repo = std::move(Repository::Open(dir.path(), {2, 1 << 20})).value();
    // 96 KiB buffers: not a multiple of the chunk size, so chunks straddle them.
    pool = std::move(PinnedPool::Create(*this->engine, 2, 96 << 10)).value();
  }

  // A copy of `data` in device memory.
  std::byte* OnDevice(const std::vector<std::byte>& data) {
    std::byte* dev = mem->Alloc(data.size());
    mem->Upload(dev, data);
    return dev;
  }

  // Replaces the pack directory by a file: creating a pack fails.
  void BreakPacks() {
    std::filesystem::remove_all(dir / "objects/packs");
    std::ofstream(dir / "objects/packs") << "not a directory";
  }

  // The whole of tensor `tensor` of committed checkpoint `name`.
  std::vector<std::byte> Saved(const std::string& name, const std::string& tensor) {
    auto reader = std::move(repo->OpenCheckpoint(name)).value();
    const TensorRecord* rec = reader->FindTensor(tensor);
    std::vector<std::byte> out(NumElements(rec->shape) * DTypeSize(rec->dtype));
    EXPECT_OK(reader->ReadBytes(*rec, 0, out));
    return out;
  }

  // Saves every dtype with box and flat shards from 2 ranks, loads at 3.
  void RoundTripEveryDTypeAndShardKind() {
    const Shape shape = {37, 129};
    std::map<std::string, std::pair<DType, std::vector<std::byte>>> tensors;
    for (int code = 0; code < kDTypeCount; ++code) {
      DType dt = *DTypeFromCode(code);
      tensors["t" + std::to_string(code)] = {dt, RandomBytes(NumElements(shape) * DTypeSize(dt), code)};
    }
    const uint64_t n = NumElements(shape);
    for (uint32_t rank = 0; rank < 2; ++rank) {
      std::vector<DeviceShard> shards;
      for (const auto& [name, t] : tensors) {
        const bool as_box = (t.first == DType::kBF16 || DTypeSize(t.first) != 2);
        Region r = as_box ? Region::OfBox(Box{{0, rank ? 64u : 0u}, {37, rank ? 65u : 64u}})
                          : Region::OfFlat(rank ? 1000 : 0, rank ? n : 1000);
        shards.push_back({{name, t.first, shape}, r, OnDevice(Extract(t.second, shape, t.first, r))});
      }
      auto saved = SaveStreaming(*repo, "c", {rank, 2, 1, {}}, shards, *engine, *pool);
      ASSERT_OK(saved);
      EXPECT_EQ(saved->checkpoint_visible, rank == 1);  // durable and visible with the last rank's save
    }
    auto reader = std::move(repo->OpenCheckpoint("c")).value();
    for (const auto& [name, t] : tensors) {
      const TensorRecord* rec = reader->FindTensor(name);
      ASSERT_NE(rec, nullptr);
      for (const Region& r : {Region::OfBox(Box{{0, 0}, {13, 129}}), Region::OfBox(Box{{13, 0}, {24, 129}}),
                              Region::OfBox(Box{{5, 17}, {30, 100}}), Region::OfFlat(7, n - 3)}) {
        auto want = Extract(t.second, shape, t.first, r);
        std::byte* dev = mem->Alloc(want.size());
        ASSERT_OK(LoadToDevice(*reader, *rec, r, dev, *engine, *pool));
        ASSERT_EQ(mem->Download(dev, want.size()), want) << name << " " << r.ToString();
      }
    }
  }

  TempDir dir;
  std::unique_ptr<CopyEngine> engine;
  std::unique_ptr<DeviceMemory> mem;
  std::unique_ptr<Repository> repo;
  std::unique_ptr<PinnedPool> pool;
};

Staging HostStaging() { return Staging(std::make_unique<HostCopyEngine>(), std::make_unique<HostMemory>()); }

// A whole 1-d u8 tensor in device memory.
DeviceShard Bytes(const std::string& name, std::byte* dev, uint64_t n) {
  return {{name, DType::kU8, {n}}, Region::OfFlat(0, n), dev};
}

TEST(StagingHost, EveryDTypeAndShardKindRoundTripsBitExact) { HostStaging().RoundTripEveryDTypeAndShardKind(); }

TEST(StagingHost, BuffersAreAllocatedOnceAndReused) {
  Staging s = HostStaging();
  auto* host = static_cast<HostCopyEngine*>(s.engine.get());
  s.RoundTripEveryDTypeAndShardKind();
  const uint64_t after_first = host->pinned_allocations();
  EXPECT_EQ(after_first, 2u);  // the pool's two buffers, nothing per save or load
  EXPECT_EQ(s.pool->pinned_bytes(), 2u * (96 << 10));
  auto data = RandomBytes(1 << 20, 9);
  std::byte* dev = s.OnDevice(data);
  for (int i = 0; i < 3; ++i) {
    ASSERT_OK(SaveStreaming(*s.repo, "again" + std::to_string(i), {0, 1, i, {}}, {Bytes("x", dev, data.size())},
                            *s.engine, *s.pool));
  }
  EXPECT_EQ(host->pinned_allocations(), after_first);
}

TEST(StagingHost, ChunksAreHashedInPlaceFromPinnedBuffers) {
  Staging s = HostStaging();
  auto data = RandomBytes(1 << 20, 10);
  std::byte* dev = s.OnDevice(data);
  auto w = std::move(s.repo->BeginCheckpoint("lent", {0, 1, 1, {}})).value();
  {
    DeviceSource source(*s.engine, *s.pool, dev, data.size());
    ASSERT_OK(w->PutShard({"x", DType::kU8, {data.size()}}, Region::OfFlat(0, data.size()), source));
    // 64 KiB chunks, 96 KiB buffers: copies are cut at chunk boundaries, so
    // every chunk was lent in place and none copied out.
    EXPECT_EQ(source.lent_bytes(), data.size());
  }
  // Once PutShard returned, every buffer is back in the pool.
  auto a = s.pool->TryAcquire(), b = s.pool->TryAcquire();
  EXPECT_TRUE(a.valid() && b.valid());
  a = {};
  b = {};
  ASSERT_OK(w->Commit().Wait());
  EXPECT_EQ(s.Saved("lent", "x"), data);
}

TEST(StagingHost, ChunksBiggerThanABufferAreCopiedOut) {
  Staging s = HostStaging();
  s.pool = std::move(PinnedPool::Create(*s.engine, 3, 40 << 10)).value();  // smaller than a 64 KiB chunk
  auto data = RandomBytes((1 << 20) + 12345, 11);
  std::byte* dev = s.OnDevice(data);
  auto w = std::move(s.repo->BeginCheckpoint("copied", {0, 1, 1, {}})).value();
  {
    DeviceSource source(*s.engine, *s.pool, dev, data.size());
    ASSERT_OK(w->PutShard({"x", DType::kU8, {data.size()}}, Region::OfFlat(0, data.size()), source));
    EXPECT_EQ(source.lent_bytes(), 12345u);  // only the short last chunk fits in a buffer
  }
  ASSERT_OK(w->Commit().Wait());
  EXPECT_EQ(s.Saved("copied", "x"), data);
  auto reader = std::move(s.repo->OpenCheckpoint("copied")).value();
  std::byte* back = s.mem->Alloc(data.size());
  ASSERT_OK(LoadToDevice(*reader, *reader->FindTensor("x"), Region::OfFlat(0, data.size()), back, *s.engine, *s.pool));
  EXPECT_EQ(s.mem->Download(back, data.size()), data);
}

TEST(StagingHost, DeviceErrorMidStreamCommitsNothing) {
  Staging s = HostStaging();
  auto* host = static_cast<HostCopyEngine*>(s.engine.get());
  auto data = RandomBytes(1 << 20, 3);
  std::byte* dev = s.OnDevice(data);
  host->FailAfter(4);  // the fifth 96 KiB copy fails
  auto r = SaveStreaming(*s.repo, "broken", {0, 1, 1, {}}, {Bytes("x", dev, data.size())}, *s.engine, *s.pool);
  EXPECT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("device"), std::string::npos) << r.status().ToString();
  EXPECT_TRUE(s.repo->ListCheckpoints(true)->empty());
}

TEST(StagingHost, FailingPackWriteIsReportedAndNothingCommitted) {
  // A save whose packs cannot be written: the repository's pack directory is
  // replaced by a file, so creating a pack fails.
  Staging s = HostStaging();
  s.BreakPacks();
  auto data = RandomBytes(300 << 10, 4);
  auto r = SaveStreaming(*s.repo, "nopacks", {0, 1, 1, {}}, {Bytes("x", s.OnDevice(data), data.size())}, *s.engine,
                         *s.pool);
  EXPECT_FALSE(r.ok());
  EXPECT_TRUE(s.repo->ListCheckpoints(true)->empty());
}

TEST(StagingHost, SnapshotWhosePacksCannotBeWrittenFailsThroughItsHandle) {
  Staging s = HostStaging();
  s.BreakPacks();
  auto data = RandomBytes(2 << 20, 12);
  SnapshotBuffer buffer(*s.engine);
  auto h = SaveSnapshot(*s.repo, "nopacks", {0, 1, 1, {}}, {Bytes("x", s.OnDevice(data), data.size())}, *s.engine,
                        buffer);
  ASSERT_OK(h);  // the copies succeeded: training goes on
  auto r = h->Wait();
  EXPECT_FALSE(r.ok());
  EXPECT_FALSE(h->durable());
  EXPECT_TRUE(s.repo->ListCheckpoints(true)->empty());
}

TEST(StagingHost, CorruptChunkOnLoadIsReported) {
  Staging s = HostStaging();
  auto data = RandomBytes(512 << 10, 5);
  ASSERT_OK(
      SaveStreaming(*s.repo, "c", {0, 1, 1, {}}, {Bytes("x", s.OnDevice(data), data.size())}, *s.engine, *s.pool));
  s.repo.reset();
  for (const auto& e : std::filesystem::directory_iterator(s.dir / "objects/packs")) {
    std::fstream f(e.path(), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(300000);
    f.put('\x5a');
  }
  s.repo = std::move(Repository::Open(s.dir.path())).value();
  auto reader = std::move(s.repo->OpenCheckpoint("c")).value();
  std::byte* out = s.mem->Alloc(data.size());
  Status st = LoadToDevice(*reader, *reader->FindTensor("x"), Region::OfFlat(0, data.size()), out, *s.engine, *s.pool);
  EXPECT_TRUE(st.IsCorruption()) << st.ToString();
}

TEST(StagingHost, SnapshotReturnsBeforeDurableAndIsIsolatedFromLaterWrites) {
  Staging s = HostStaging();
  auto data = RandomBytes(16 << 20, 6);
  std::byte* dev = s.OnDevice(data);
  SnapshotBuffer buffer(*s.engine);
  auto handle = SaveSnapshot(*s.repo, "snap", {0, 1, 1, {}}, {Bytes("w", dev, data.size())}, *s.engine, buffer);
  ASSERT_OK(handle);
  // Training may now modify its tensors: the snapshot must not see it.
  std::memset(dev, 0, data.size());
  auto r = handle->Wait();
  ASSERT_OK(r);
  EXPECT_TRUE(handle->durable());
  EXPECT_GT(handle->total_time(), handle->blocking_time());
  EXPECT_EQ(s.Saved("snap", "w"), data);
}

TEST(StagingHost, SnapshotJoinsAWriterThatAlreadyHoldsHostTensorsAndBlobs) {
  Staging s = HostStaging();
  auto host = RandomBytes(1 << 20, 30);
  auto device = RandomBytes(3 << 20, 31);
  std::byte* dev = s.OnDevice(device);
  auto writer = std::move(s.repo->BeginCheckpoint("mixed", {0, 1, 5, {}})).value();
  ASSERT_OK(writer->PutTensor({"host", DType::kU8, {host.size()}}, host));
  ASSERT_OK(writer->PutBlob("rng", host));
  SnapshotBuffer buffer(*s.engine);
  auto handle = SnapshotAndCommit(std::move(writer), {Bytes("dev", dev, device.size())}, *s.engine, buffer);
  ASSERT_OK(handle);
  std::memset(dev, 0, device.size());  // training goes on
  auto r = handle->Wait();
  ASSERT_OK(r);
  EXPECT_TRUE(r->checkpoint_visible);
  EXPECT_EQ(s.Saved("mixed", "host"), host);
  EXPECT_EQ(s.Saved("mixed", "dev"), device);
  // A device shard that does not fit its tensor fails before anything is
  // copied, and the writer (with its host puts) is aborted.
  auto bad = std::move(s.repo->BeginCheckpoint("bad", {0, 1, 6, {}})).value();
  ASSERT_OK(bad->PutTensor({"host", DType::kU8, {host.size()}}, host));
  auto failed = SnapshotAndCommit(std::move(bad), {{{"d", DType::kU8, {4}}, Region::OfFlat(2, 9), dev}}, *s.engine,
                                  buffer);
  EXPECT_EQ(failed.status().code(), StatusCode::kInvalidArgument);
  auto all = s.repo->ListCheckpoints(true);
  ASSERT_OK(all);
  ASSERT_EQ(all->size(), 1u);
  EXPECT_EQ((*all)[0].name, "mixed");
}

TEST(StagingHost, SnapshotBufferIsReusedAndOneSnapshotUsesItAtATime) {
  Staging s = HostStaging();
  auto* host = static_cast<HostCopyEngine*>(s.engine.get());
  SnapshotBuffer buffer(*s.engine);
  const uint64_t before = host->pinned_allocations();
  std::vector<std::vector<std::byte>> states;
  for (int i = 0; i < 3; ++i) states.push_back(RandomBytes(16 << 20, 20 + i));
  std::vector<SnapshotHandle> handles;
  std::byte* dev = s.mem->Alloc(16 << 20);
  const Shape shape = {8 << 20};
  for (int i = 0; i < 3; ++i) {
    // Each step trains the tensor; the next snapshot starts while the
    // previous one is still persisting and must not overwrite its bytes.
    s.mem->Upload(dev, states[i]);
    auto h = SaveSnapshot(*s.repo, "step" + std::to_string(i), {0, 1, i, {}},
                          {{{"w", DType::kBF16, shape}, Region::OfBox(FullBox(shape)), dev}}, *s.engine, buffer);
    ASSERT_OK(h);
    // It could start copying only once the previous snapshot was durable.
    if (i > 0) {
      EXPECT_TRUE(handles.back().durable()) << "snapshot " << i << " overlapped the previous one";
    }
    handles.push_back(std::move(h).value());
  }
  for (auto& h : handles) ASSERT_OK(h.Wait());
  EXPECT_EQ(host->pinned_allocations(), before + 1);  // one allocation, reused by every snapshot
  EXPECT_EQ(buffer.capacity(), 16u << 20);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(s.Saved("step" + std::to_string(i), "w"), states[i]) << "snapshot " << i;
  // A larger snapshot grows the buffer once.
  std::byte* big = s.mem->Alloc(20 << 20);
  auto h = SaveSnapshot(*s.repo, "big", {0, 1, 3, {}}, {Bytes("b", big, 20 << 20)}, *s.engine, buffer);
  ASSERT_OK(h);
  ASSERT_OK(h->Wait());
  EXPECT_EQ(host->pinned_allocations(), before + 2);
  EXPECT_EQ(buffer.capacity(), 20u << 20);
}

TEST(StagingHost, SnapshotDeviceErrorReturnsAndCommitsNothing) {
  Staging s = HostStaging();
  auto* host = static_cast<HostCopyEngine*>(s.engine.get());
  SnapshotBuffer buffer(*s.engine);
  std::byte* a = s.mem->Alloc(1 << 20);
  std::byte* b = s.mem->Alloc(1 << 20);
  host->FailAfter(1);  // the second shard's copy fails
  auto h = SaveSnapshot(*s.repo, "broken", {0, 1, 1, {}}, {Bytes("a", a, 1 << 20), Bytes("b", b, 1 << 20)},
                        *s.engine, buffer);
  ASSERT_FALSE(h.ok());
  EXPECT_NE(h.status().message().find("snapshot copy"), std::string::npos) << h.status().ToString();
  EXPECT_TRUE(s.repo->ListCheckpoints(true)->empty());
  EXPECT_OK(buffer.Reserve(1));  // the buffer was given back
}

TEST(StagingHost, PoolNeedsTwoBuffers) {
  HostCopyEngine engine;
  EXPECT_FALSE(PinnedPool::Create(engine, 1, 1024).ok());
  std::string why;
  if (!CudaAvailable(&why)) {
    EXPECT_FALSE(why.empty());
  }
}

#ifdef CKPTFS_HAVE_CUDA
TEST(StagingGpu, SaveFromDeviceAndLoadAtAnotherSharding) {
  std::string why;
  if (!CudaAvailable(&why)) GTEST_SKIP() << "GPU test skipped: " << why;
  auto engine = NewCudaCopyEngine(0);
  ASSERT_OK(engine);
  Staging(std::move(engine).value(), std::make_unique<CudaMemory>()).RoundTripEveryDTypeAndShardKind();
}

TEST(StagingGpu, SnapshotIsReleasedBeforeDurable) {
  std::string why;
  if (!CudaAvailable(&why)) GTEST_SKIP() << "GPU test skipped: " << why;
  Staging s(std::move(NewCudaCopyEngine(0)).value(), std::make_unique<CudaMemory>());
  auto data = RandomBytes(64 << 20, 8);
  std::byte* dev = s.OnDevice(data);
  SnapshotBuffer buffer(*s.engine);
  auto handle = SaveSnapshot(*s.repo, "snap", {0, 1, 1, {}}, {Bytes("w", dev, data.size())}, *s.engine, buffer);
  ASSERT_OK(handle);
  EXPECT_FALSE(handle->durable());  // 64 MiB cannot be hashed and written in the copy's time
  ASSERT_EQ(cudaMemset(dev, 0, data.size()), cudaSuccess);
  ASSERT_OK(handle->Wait());
  EXPECT_GT(handle->total_time(), handle->blocking_time());
  EXPECT_EQ(s.Saved("snap", "w"), data);
}
TEST(StagingGpu, StagingThroughputIsReported) {
  // Reported, not asserted (tools/bench/gpu_bench measures it properly).
  std::string why;
  if (!CudaAvailable(&why)) GTEST_SKIP() << "GPU test skipped: " << why;
  auto engine = std::move(NewCudaCopyEngine(0)).value();
  const size_t bytes = 1ull << 30, chunk = 4 << 20;
  CudaMemory mem;
  std::byte* dev = mem.Alloc(bytes);
  ASSERT_EQ(cudaMemset(dev, 0x5a, bytes), cudaSuccess);
  auto plain_dst = engine->AllocatePinned(bytes);
  ASSERT_OK(plain_dst);
  auto t0 = std::chrono::steady_clock::now();
  ASSERT_EQ(cudaMemcpy(*plain_dst, dev, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  const double plain = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  engine->FreePinned(*plain_dst);
  auto pool = std::move(PinnedPool::Create(*engine, 2, 64 << 20)).value();
  std::vector<uint64_t> bounds;
  for (uint64_t off = 0; off < bytes; off += chunk) bounds.push_back(off);
  bounds.push_back(bytes);
  t0 = std::chrono::steady_clock::now();
  {
    DeviceSource source(*engine, *pool, dev, bytes);
    source.PlanChunks(bounds);
    for (size_t i = 0; i + 1 < bounds.size(); ++i) {
      auto lent = source.Borrow(bounds[i], chunk);
      ASSERT_OK(lent);
      ASSERT_TRUE(lent->keep);
      ASSERT_EQ(lent->bytes[chunk - 1], std::byte{0x5a});
    }
  }
  const double staged = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("plain pinned D2H %.2f GB/s, staged %.2f GB/s (%.2fx)\n", bytes / plain / 1e9, bytes / staged / 1e9,
              plain / staged);
  ::testing::Test::RecordProperty("staging_vs_plain", std::to_string(plain / staged));
}
#endif

}  // namespace
}  // namespace ckptfs::gpu
