// Collective saves and restores of tensors in device memory
// (gpu/collective_device.h): with the host copy engine and the host group
// (whose "device" memory is host memory) always, and on a GPU when one is
// usable: real device memory over NCCL with one rank, and several ranks of
// the host group on CUDA copy engines with managed memory, which the host
// group can move as the CPU does and CUDA as device memory.
#include "collective_device.h"

#include <gtest/gtest.h>

#include <functional>
#include <thread>

#include "ckpt/read_plan.h"
#include "replicated.h"
#include "staging_util.h"
#include "test_util.h"

#ifdef CKPTFS_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace ckptfs::gpu {
namespace {

using testing::DeviceMemory;
using testing::HostMemory;
using testing::RandomBytes;

// "big" [96, 1000] f32 (row shards cut the 64 KiB chunks at other world
// sizes), "norm" [1000] f32 on every rank, and a blob.
struct State {
  static constexpr uint64_t kRows = 96, kCols = 1000;
  std::vector<std::byte> big = RandomBytes(kRows * kCols * 4, 31), norm = RandomBytes(kCols * 4, 32);
  std::vector<std::byte> cfg = RandomBytes(300, 33);
  TensorInfo big_info{"big", DType::kF32, {kRows, kCols}}, norm_info{"norm", DType::kF32, {kCols}};
  Region Rows(int shard, int shards) const {
    const uint64_t n = kRows / shards;
    return Region::OfBox(Box{{shard * n, 0}, {n, kCols}});
  }
  std::vector<std::byte> RowBytes(int shard, int shards) const {
    const uint64_t n = kRows / shards;
    const auto first = big.begin() + static_cast<std::ptrdiff_t>(shard * n * kCols * 4);
    return {first, first + static_cast<std::ptrdiff_t>(n * kCols * 4)};
  }
};

// One rank's copy engine and device memory, and the pool over them (small
// buffers, so every region and hand-off takes several pieces).
struct RankDevice {
  std::unique_ptr<CopyEngine> engine;
  std::unique_ptr<DeviceMemory> memory;
  std::unique_ptr<PinnedPool> pool;
};
using MakeDevice = std::function<RankDevice(int rank)>;

RankDevice HostDevice(int) {
  RankDevice d;
  d.engine = std::make_unique<HostCopyEngine>();
  d.memory = std::make_unique<HostMemory>();
  d.pool = std::move(PinnedPool::Create(*d.engine, 3, 24 << 10)).value();
  return d;
}

template <typename Fn>
void OnGroup(std::vector<std::unique_ptr<Communicator>>& comms, Fn fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < static_cast<int>(comms.size()); ++r) threads.emplace_back([&, r] { fn(r, *comms[r]); });
  for (auto& t : threads) t.join();
}

class CollectiveDevice : public ::testing::Test {
 protected:
  void SetUp() override {
    RepositoryConfig config;
    config.chunk_size = 64 << 10;
    ASSERT_OK(Repository::Init(dir_.path(), config));
    repo_ = std::move(Repository::Open(dir_.path())).value();
  }

  // HSDP on `comms`: rank r holds row shard r % 2 of "big", and "norm" and
  // "cfg" whole; each rank's shards uploaded to its device first.
  std::vector<Result<CollectiveSaveResult>> Save(std::vector<std::unique_ptr<Communicator>>& comms,
                                                 const MakeDevice& make, const std::string& name, bool verify,
                                                 int differing_rank = -1) {
    std::vector<Result<CollectiveSaveResult>> out(comms.size(), Status::Internal("not run"));
    OnGroup(comms, [&](int r, Communicator& comm) {
      RankDevice d = make(r);
      const auto rows = s_.RowBytes(r % 2, 2);
      auto norm = r == differing_rank ? RandomBytes(s_.norm.size(), 99) : s_.norm;
      std::byte* big = d.memory->Alloc(rows.size());
      std::byte* nrm = d.memory->Alloc(norm.size());
      d.memory->Upload(big, rows);
      d.memory->Upload(nrm, norm);
      std::vector<CollectiveShard> shards = {{s_.big_info, s_.Rows(r % 2, 2), {big, rows.size()}},
                                             {s_.norm_info, Region::OfFlat(0, State::kCols), {nrm, norm.size()}}};
      std::vector<CollectiveBlob> blobs = {{"cfg", s_.cfg}};
      out[r] = SaveCollectiveFromDevice(*repo_, name, shards, blobs, comm, *d.engine, *d.pool, {.step = 3}, verify);
    });
    return out;
  }

  struct Loaded {
    Result<CollectiveLoadResult> result = Status::Internal("not run");
    std::vector<std::byte> rows, norm, norm_again;
  };
  // Rank r of `comms` loads row shard r of "big" at the group's size, and
  // "norm" into two targets.
  std::vector<Loaded> Load(std::vector<std::unique_ptr<Communicator>>& comms, const MakeDevice& make,
                           const std::string& name, const std::function<void(int, CopyEngine&)>& arm = nullptr) {
    const int world = static_cast<int>(comms.size());
    std::vector<Loaded> out(comms.size());
    OnGroup(comms, [&](int r, Communicator& comm) {
      RankDevice d = make(r);
      if (arm) arm(r, *d.engine);
      const size_t row_bytes = s_.big.size() / world;
      std::byte* rows = d.memory->Alloc(row_bytes);
      std::byte* norm = d.memory->Alloc(s_.norm.size());
      std::byte* again = d.memory->Alloc(s_.norm.size());
      std::vector<CollectiveTarget> targets = {
          {s_.big_info, s_.Rows(r, world), {rows, row_bytes}},
          {s_.norm_info, Region::OfFlat(0, State::kCols), {norm, s_.norm.size()}},
          {s_.norm_info, Region::OfBox(FullBox({State::kCols})), {again, s_.norm.size()}}};
      out[r].result = LoadCollectiveToDevice(*repo_, name, targets, comm, *d.engine, *d.pool);
      out[r].rows = d.memory->Download(rows, row_bytes);
      out[r].norm = d.memory->Download(norm, s_.norm.size());
      out[r].norm_again = d.memory->Download(again, s_.norm.size());
    });
    return out;
  }

  // Saves on 4 ranks and restores on 4 and 3, where some row cuts fall
  // inside chunks (those are handed over between readers): each region put
  // once, each stored chunk fetched once, bit-exact.
  void SaveAndRestore(const std::function<std::vector<std::unique_ptr<Communicator>>(int)>& group,
                      const MakeDevice& make) {
    auto comms = group(4);
    uint64_t put = 0;
    for (auto& s : Save(comms, make, "c", /*verify=*/true)) {
      ASSERT_OK(s);
      put += s->put_bytes;
    }
    EXPECT_EQ(put, s_.big.size() + s_.norm.size() + s_.cfg.size()) << "each region put once";
    auto reader = std::move(repo_->OpenCheckpoint("c")).value();
    std::vector<std::byte> big(s_.big.size()), cfg(s_.cfg.size());
    ASSERT_OK(reader->ReadBytes(*reader->FindTensor("big"), 0, big));
    ASSERT_OK(reader->ReadBlob(*reader->GetBlob("cfg").value(), 0, cfg));
    EXPECT_EQ(big, s_.big);
    EXPECT_EQ(cfg, s_.cfg);
    auto chunks = ChunksForRegion(*reader->FindTensor("big"), Region::OfFlat(0, State::kRows * State::kCols));
    ASSERT_OK(chunks);

    for (int world : {4, 3}) {
      auto load_comms = group(world);
      const uint64_t before = repo_->fetch_counts().chunks;
      auto loaded = Load(load_comms, make, "c");
      uint64_t fetched = 0, handed = 0, handed_in = 0, sent = 0, received = 0;
      for (int r = 0; r < world; ++r) {
        ASSERT_OK(loaded[r].result);
        EXPECT_EQ(loaded[r].rows, s_.RowBytes(r, world)) << world << " " << r;
        EXPECT_EQ(loaded[r].norm, s_.norm) << world << " " << r;
        EXPECT_EQ(loaded[r].norm_again, s_.norm) << world << " " << r;
        fetched += loaded[r].result->fetched_bytes;
        handed += loaded[r].result->handoff_sent_bytes;
        handed_in += loaded[r].result->handoff_received_bytes;
        sent += loaded[r].result->sent_bytes;
        received += loaded[r].result->received_bytes;
      }
      EXPECT_EQ(fetched, s_.big.size() + s_.norm.size()) << world;
      EXPECT_EQ(sent, (world - 1) * s_.norm.size()) << world;
      EXPECT_EQ(received, sent) << world;
      // At 4 ranks rows 24 and 72 cut chunks, at 3 ranks rows 32 and 64.
      EXPECT_EQ(handed, 2u * (64u << 10)) << world;
      EXPECT_EQ(handed_in, handed) << world;
      // "norm" is stored as one chunk, fetched by one rank.
      EXPECT_EQ(repo_->fetch_counts().chunks - before, chunks->size() + 1) << world << ": each stored chunk once";
    }
  }

  testing::TempDir dir_;
  std::unique_ptr<Repository> repo_;
  State s_;
};

TEST_F(CollectiveDevice, SavesFromAndRestoresIntoDeviceMemoryFetchingEachChunkOnce) {
  SaveAndRestore([](int n) { return NewHostGroup(n); }, HostDevice);
}

TEST_F(CollectiveDevice, ReplicasThatDifferOnTheDeviceFailEveryRank) {
  auto comms = NewHostGroup(4);
  auto saved = Save(comms, HostDevice, "differ", /*verify=*/true, /*differing_rank=*/2);
  for (int r = 0; r < 4; ++r) {
    ASSERT_FALSE(saved[r].ok()) << r;
    EXPECT_NE(saved[r].status().message().find("replicas of 'norm' differ"), std::string::npos)
        << saved[r].status().ToString();
  }
  EXPECT_TRUE(repo_->ListCheckpoints(/*include_pending=*/true)->empty());
}

TEST_F(CollectiveDevice, ADeviceCopyFailingOnOneRankFailsEveryRankWithoutAHang) {
  auto comms = NewHostGroup(4);
  for (auto& s : Save(comms, HostDevice, "c", false)) ASSERT_OK(s);
  // At 3 ranks, rank 1's device copies fail from the first, the second,
  // ... on (while handing over, reading or delivering), until it makes
  // too few copies for that to happen: every rank fails every time.
  int failing_points = 0;
  for (uint64_t after = 0;; ++after) {
    auto load_comms = NewHostGroup(3);
    auto loaded = Load(load_comms, HostDevice, "c", [&](int r, CopyEngine& engine) {
      if (r == 1) static_cast<HostCopyEngine&>(engine).FailAfter(after);
    });
    if (loaded[1].result.ok()) {
      for (int r = 0; r < 3; ++r) ASSERT_OK(loaded[r].result);
      break;
    }
    ++failing_points;
    EXPECT_NE(loaded[1].result.status().message().find("device copy failed"), std::string::npos)
        << after << ": " << loaded[1].result.status().ToString();
    for (int r = 0; r < 3; ++r) {
      ASSERT_FALSE(loaded[r].result.ok()) << after << " " << r;
      // Another rank names rank 1, or fails itself on the bytes it handed over.
      const std::string said = loaded[r].result.status().ToString();
      EXPECT_TRUE(said.find("rank 1") != std::string::npos || said.find("does not match its id") != std::string::npos)
          << after << " " << r << ": " << said;
    }
  }
  EXPECT_GE(failing_points, 8);
  // The save: rank 0 puts the first shard (the largest region goes to the
  // lowest rank) and fails copying it off its device; with the replicas
  // compared, rank 3 fails hashing its copy. Every rank fails, and nothing
  // becomes visible.
  for (const auto& [failing, verify] : {std::pair(0, false), std::pair(3, true)}) {
    auto save_comms = NewHostGroup(4);
    OnGroup(save_comms, [&](int r, Communicator& comm) {
      RankDevice d = HostDevice(r);
      if (r == failing) static_cast<HostCopyEngine&>(*d.engine).FailAfter(2);
      std::byte* big = d.memory->Alloc(s_.big.size() / 2);
      d.memory->Upload(big, s_.RowBytes(r % 2, 2));
      std::vector<CollectiveShard> shards = {{s_.big_info, s_.Rows(r % 2, 2), {big, s_.big.size() / 2}}};
      auto saved = SaveCollectiveFromDevice(*repo_, "bad", shards, {}, comm, *d.engine, *d.pool, {}, verify);
      ASSERT_FALSE(saved.ok()) << failing << " " << r;
      EXPECT_NE(saved.status().ToString().find(r == failing ? "device copy failed" : "rank " + std::to_string(failing)),
                std::string::npos)
          << failing << " " << r << ": " << saved.status().ToString();
    });
    auto all = repo_->ListCheckpoints(/*include_pending=*/true);
    ASSERT_OK(all);
    ASSERT_EQ(all->size(), 1u) << failing;
    EXPECT_EQ((*all)[0].name, "c");
  }
}

#ifdef CKPTFS_HAVE_CUDA
// The CUDA engine, whose "device" allocations are managed memory, which
// the host group's copies can reach.
class ManagedEngine final : public CopyEngine {
 public:
  explicit ManagedEngine(std::unique_ptr<CopyEngine> cuda) : cuda_(std::move(cuda)) {}
  std::string Describe() const override { return cuda_->Describe() + ", managed memory"; }
  Result<std::byte*> AllocatePinned(size_t n) override { return cuda_->AllocatePinned(n); }
  void FreePinned(std::byte* p) override { cuda_->FreePinned(p); }
  Result<uint64_t> DeviceToHost(std::byte* h, const std::byte* d, size_t n) override {
    return cuda_->DeviceToHost(h, d, n);
  }
  Result<uint64_t> HostToDevice(std::byte* d, const std::byte* h, size_t n) override {
    return cuda_->HostToDevice(d, h, n);
  }
  Result<uint64_t> DeviceToDevice(std::byte* d, const std::byte* s, size_t n) override {
    return cuda_->DeviceToDevice(d, s, n);
  }
  Result<std::byte*> AllocateDevice(size_t n) override {
    void* p = nullptr;
    if (cudaMallocManaged(&p, std::max<size_t>(n, 1)) != cudaSuccess) return Status::IOError("cudaMallocManaged");
    return static_cast<std::byte*>(p);
  }
  void FreeDevice(std::byte* p) override { cudaFree(p); }
  Status Wait(uint64_t t) override { return cuda_->Wait(t); }

 private:
  std::unique_ptr<CopyEngine> cuda_;
};

class CollectiveDeviceGpu : public CollectiveDevice {};

TEST_F(CollectiveDeviceGpu, HostGroupOfCudaEnginesOverManagedMemory) {
  std::string why;
  if (!CudaAvailable(&why)) GTEST_SKIP() << "GPU test skipped: " << why;
  SaveAndRestore([](int n) { return NewHostGroup(n); },
                 [](int) {
                   RankDevice d;
                   d.engine = std::make_unique<ManagedEngine>(std::move(NewCudaCopyEngine(0)).value());
                   d.memory = std::make_unique<testing::CudaMemory>(/*managed=*/true);
                   d.pool = std::move(PinnedPool::Create(*d.engine, 3, 24 << 10)).value();
                   return d;
                 });
}

TEST_F(CollectiveDeviceGpu, OneRankOverNcclIntoDeviceMemory) {
  std::string why;
  if (!NcclAvailable(&why)) GTEST_SKIP() << "GPU test skipped: " << why;
  auto id = NewNcclId();
  ASSERT_OK(id);
  auto comm = NewNcclCommunicator(0, 1, 0, *id);
  ASSERT_OK(comm);
  std::vector<std::unique_ptr<Communicator>> comms;
  comms.push_back(std::move(comm).value());
  auto cuda = [](int) {
    RankDevice d;
    d.engine = std::move(NewCudaCopyEngine(0)).value();
    d.memory = std::make_unique<testing::CudaMemory>();
    d.pool = std::move(PinnedPool::Create(*d.engine, 3, 24 << 10)).value();
    return d;
  };
  // One rank holds everything: the save puts it all, the load reads it
  // all and copies "norm" device to device into its second target.
  OnGroup(comms, [&](int, Communicator& c) {
    RankDevice d = cuda(0);
    std::byte* big = d.memory->Alloc(s_.big.size());
    d.memory->Upload(big, s_.big);
    std::vector<CollectiveShard> shards = {{s_.big_info, s_.Rows(0, 1), {big, s_.big.size()}}};
    auto saved = SaveCollectiveFromDevice(*repo_, "one", shards, {}, c, *d.engine, *d.pool, {}, /*verify=*/true);
    ASSERT_OK(saved);
    EXPECT_EQ(saved->put_bytes, s_.big.size());
  });
  auto w = std::move(std::move(repo_->BeginCheckpoint("norm", {})).value());
  ASSERT_OK(w->PutTensor(s_.big_info, s_.big));
  ASSERT_OK(w->PutTensor(s_.norm_info, s_.norm));
  ASSERT_OK(w->Commit().Wait());
  auto loaded = Load(comms, cuda, "norm");
  ASSERT_OK(loaded[0].result);
  EXPECT_EQ(loaded[0].rows, s_.big);
  EXPECT_EQ(loaded[0].norm, s_.norm);
  EXPECT_EQ(loaded[0].norm_again, s_.norm);
  auto reader = std::move(repo_->OpenCheckpoint("one")).value();
  std::vector<std::byte> big(s_.big.size());
  ASSERT_OK(reader->ReadBytes(*reader->FindTensor("big"), 0, big));
  EXPECT_EQ(big, s_.big);
}
#endif

}  // namespace
}  // namespace ckptfs::gpu
