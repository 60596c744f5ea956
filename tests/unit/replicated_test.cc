// Replicated tensors read once and broadcast: a host group of threads (one
// per rank, each with its own reader, engine and pool, like one
// process per GPU) always, and NCCL over the GPUs present when there are any.
#include "replicated.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <thread>

#include "staging_util.h"
#include "test_util.h"

namespace ckptfs::gpu {
namespace {

using testing::HostMemory;
using testing::RandomBytes;
using testing::TempDir;

struct Saved {
  std::string name;
  DType dtype;
  Shape shape;
  std::vector<std::byte> data;
};

// A repository with one checkpoint "c" of tensors of varied sizes.
class ReplicatedLoad : public ::testing::Test {
 protected:
  void SetUp() override {
    RepositoryConfig config;
    config.chunk_size = 64 << 10;
    ASSERT_OK(Repository::Init(dir_.path(), config));
    tensors_ = {{"embed", DType::kBF16, {300, 257}, {}},  {"norm", DType::kF32, {4096}, {}},
                {"head", DType::kF16, {129, 511}, {}},    {"scale", DType::kF64, {}, {}},
                {"bias", DType::kI32, {1000}, {}},        {"empty", DType::kF32, {0, 3}, {}}};
    for (size_t i = 0; i < tensors_.size(); ++i) {
      auto& t = tensors_[i];
      t.data = RandomBytes(NumElements(t.shape) * DTypeSize(t.dtype), 100 + i);
    }
    auto repo = std::move(Repository::Open(dir_.path())).value();
    auto w = std::move(repo->BeginCheckpoint("c", {0, 1, 1, {}})).value();
    for (const auto& t : tensors_) ASSERT_OK(w->PutTensor({t.name, t.dtype, t.shape}, t.data));
    ASSERT_OK(w->Commit().Wait());
  }

  // A copy of the repository whose packs are garbage: any read from its
  // store fails, while its catalog still describes every tensor.
  std::string BrokenCopy(const std::string& name) {
    const std::string copy = copies_ / name;
    std::filesystem::copy(dir_.path(), copy, std::filesystem::copy_options::recursive);
    for (const auto& e : std::filesystem::directory_iterator(copy + "/objects/packs")) {
      const auto size = std::filesystem::file_size(e.path());
      std::ofstream(e.path(), std::ios::binary | std::ios::trunc) << std::string(size, '\x5a');
    }
    return copy;
  }

  struct RankResult {
    Result<ReplicatedLoadStats> stats = Status::Internal("not run");
    std::vector<std::vector<std::byte>> got;
  };

  // Runs LoadReplicated on `ranks` threads of a host group. Rank r reads
  // repos[r] (the healthy repository when empty) and loads `regions(r)`.
  // Ranks that read one path share its Repository handle, as threads of one
  // process must (LMDB allows one environment per database and process);
  // each opens its own reader.
  std::vector<RankResult> Run(int ranks, const std::vector<std::string>& repos,
                              const std::function<std::vector<Region>(int)>& regions) {
    auto group = NewHostGroup(ranks);
    std::vector<RankResult> results(ranks);
    std::map<std::string, std::unique_ptr<Repository>> handles;
    std::vector<Repository*> repo_of(ranks);
    for (int r = 0; r < ranks; ++r) {
      const std::string path = r < static_cast<int>(repos.size()) && !repos[r].empty() ? repos[r] : dir_.path();
      auto& handle = handles[path];
      if (!handle) {
        auto opened = Repository::Open(path);
        EXPECT_OK(opened);
        if (!opened.ok()) return results;
        handle = std::move(opened).value();
      }
      repo_of[r] = handle.get();
    }
    std::vector<std::thread> threads;
    for (int r = 0; r < ranks; ++r) {
      threads.emplace_back([&, r] {
        auto opened = repo_of[r]->OpenCheckpoint("c");
        if (!opened.ok()) {
          results[r].stats = opened.status();
          return;
        }
        auto reader = std::move(opened).value();
        HostCopyEngine engine;
        auto pool = std::move(PinnedPool::Create(engine, 2, 80 << 10)).value();
        HostMemory mem;
        const std::vector<Region> want = regions(r);
        std::vector<ReplicatedTensor> list;
        for (size_t i = 0; i < tensors_.size(); ++i) {
          const TensorRecord* rec = reader->FindTensor(tensors_[i].name);
          list.push_back({rec, want[i], mem.Alloc(want[i].NumElements() * DTypeSize(rec->dtype))});
        }
        results[r].stats = LoadReplicated(*reader, list, engine, *pool, *group[r]);
        for (const auto& t : list) {
          results[r].got.push_back(mem.Download(t.device, t.region.NumElements() * DTypeSize(t.tensor->dtype)));
        }
      });
    }
    for (auto& t : threads) t.join();
    return results;
  }

  std::vector<Region> Whole() const {
    std::vector<Region> out;
    for (const auto& t : tensors_) out.push_back(Region::OfBox(FullBox(t.shape)));
    return out;
  }

  TempDir dir_;
  TempDir copies_;
  std::vector<Saved> tensors_;
};

TEST_F(ReplicatedLoad, EveryRankGetsEveryTensorAndEachIsReadOnce) {
  const int ranks = 4;
  auto results = Run(ranks, {}, [&](int) { return Whole(); });
  uint64_t total = 0, read = 0, tensors_read = 0;
  for (const auto& t : tensors_) total += t.data.size();
  for (int r = 0; r < ranks; ++r) {
    ASSERT_OK(results[r].stats);
    for (size_t i = 0; i < tensors_.size(); ++i) EXPECT_EQ(results[r].got[i], tensors_[i].data) << r << " " << i;
    // What a rank did not read, it received.
    EXPECT_EQ(results[r].stats->bytes_read + results[r].stats->bytes_received, total);
    read += results[r].stats->bytes_read;
    tensors_read += results[r].stats->tensors_read;
    EXPECT_GT(results[r].stats->bytes_read, 0u) << "rank " << r << " read nothing: the reading is not shared";
  }
  EXPECT_EQ(read, total);              // every byte read from the store once, by one rank
  EXPECT_EQ(tensors_read, tensors_.size() - 1);  // the empty tensor needs no read
}

TEST_F(ReplicatedLoad, RanksThatDoNotReadATensorNeverTouchTheStore) {
  // Only "embed" is loaded (the rest as empty regions), so rank 0 reads it;
  // ranks 1-3 have a store that fails every read, and still get its bytes.
  std::vector<std::string> repos = {"", BrokenCopy("b1"), BrokenCopy("b2"), BrokenCopy("b3")};
  auto only_embed = [&](int) {
    std::vector<Region> r;
    for (const auto& t : tensors_) {
      r.push_back(t.name == "embed" ? Region::OfBox(FullBox(t.shape)) : Region::OfFlat(0, 0));
    }
    return r;
  };
  {
    // The broken copies really cannot be read.
    auto repo = std::move(Repository::Open(repos[1])).value();
    auto reader = std::move(repo->OpenCheckpoint("c")).value();
    std::vector<std::byte> buf(1024);
    EXPECT_FALSE(reader->ReadBytes(*reader->FindTensor("embed"), 0, buf).ok());
  }
  auto results = Run(4, repos, only_embed);
  for (int r = 0; r < 4; ++r) {
    ASSERT_OK(results[r].stats);
    EXPECT_EQ(results[r].got[0], tensors_[0].data) << "rank " << r;
    EXPECT_EQ(results[r].stats->bytes_read, r == 0 ? tensors_[0].data.size() : 0u);
  }
}

TEST_F(ReplicatedLoad, AFailedReadIsReportedOnEveryRankAndNobodyHangs) {
  // Rank 0's store is broken and it reads the first tensor.
  auto results = Run(3, {BrokenCopy("b0")}, [&](int) { return Whole(); });
  EXPECT_FALSE(results[0].stats.ok());
  for (int r = 1; r < 3; ++r) {
    ASSERT_FALSE(results[r].stats.ok());
    const std::string msg = results[r].stats.status().ToString();
    EXPECT_NE(msg.find("'embed'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("rank 0"), std::string::npos) << msg;
  }
}

TEST_F(ReplicatedLoad, RanksThatDisagreeAreToldBeforeAnythingIsRead) {
  std::vector<std::string> repos = {BrokenCopy("b0"), BrokenCopy("b1"), BrokenCopy("b2")};
  auto results = Run(3, repos, [&](int r) {
    auto regions = Whole();
    if (r == 2) regions[1] = Region::OfFlat(0, 10);  // rank 2 asks for part of "norm"
    return regions;
  });
  for (int r = 0; r < 3; ++r) {
    ASSERT_FALSE(results[r].stats.ok());
    // Not a read error from the broken stores: nothing was read.
    EXPECT_NE(results[r].stats.status().ToString().find("disagree"), std::string::npos)
        << results[r].stats.status().ToString();
  }
}

TEST(Replicated, ReadersAreSpreadByBytes) {
  EXPECT_EQ(AssignReaders({100, 10, 10, 10, 90}, 2), (std::vector<int>{0, 1, 1, 1, 1}));
  EXPECT_EQ(AssignReaders({5, 5, 5, 5}, 4), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(AssignReaders({7, 7}, 1), (std::vector<int>{0, 0}));
}

TEST(Replicated, NcclSaysWhyItIsUnavailable) {
  std::string why;
  if (NcclAvailable(&why)) GTEST_SKIP() << "NCCL is usable here: " << why;
  EXPECT_NE(why.find("NCCL"), std::string::npos) << why;
  EXPECT_FALSE(NewNcclId().ok());
}

#ifdef CKPTFS_HAVE_CUDA
class ReplicatedGpu : public ReplicatedLoad {};

TEST_F(ReplicatedGpu, BroadcastOverNccl) {
  std::string why;
  if (!NcclAvailable(&why)) GTEST_SKIP() << "GPU test skipped: " << why;
  int gpus = 0;
  ASSERT_EQ(cudaGetDeviceCount(&gpus), cudaSuccess);
  const int ranks = std::min(gpus, 4);  // one rank per GPU; a single GPU still runs the protocol
  auto id = NewNcclId();
  ASSERT_OK(id);
  std::vector<Result<ReplicatedLoadStats>> stats(ranks, Status::Internal("not run"));
  std::vector<std::vector<std::vector<std::byte>>> got(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      ASSERT_EQ(cudaSetDevice(r), cudaSuccess);
      auto comm = NewNcclCommunicator(r, ranks, r, *id);
      if (!comm.ok()) {
        stats[r] = comm.status();
        return;
      }
      auto repo = std::move(Repository::Open(dir_.path())).value();
      auto reader = std::move(repo->OpenCheckpoint("c")).value();
      auto engine = std::move(NewCudaCopyEngine(r)).value();
      auto pool = std::move(PinnedPool::Create(*engine, 2, 1 << 20)).value();
      testing::CudaMemory mem;
      std::vector<ReplicatedTensor> list;
      for (const auto& t : tensors_) {
        const TensorRecord* rec = reader->FindTensor(t.name);
        list.push_back({rec, Region::OfBox(FullBox(t.shape)), mem.Alloc(t.data.size())});
      }
      stats[r] = LoadReplicated(*reader, list, *engine, *pool, **comm);
      for (size_t i = 0; i < list.size(); ++i) got[r].push_back(mem.Download(list[i].device, tensors_[i].data.size()));
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < ranks; ++r) {
    ASSERT_OK(stats[r]);
    for (size_t i = 0; i < tensors_.size(); ++i) EXPECT_EQ(got[r][i], tensors_[i].data) << r << " " << i;
  }
}
#endif

}  // namespace
}  // namespace ckptfs::gpu
