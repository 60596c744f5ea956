// A checkpoint as files, without FUSE: names, exact sizes, any byte range,
// and prefetch that never changes bytes. Every test runs twice: over a
// repository in a local directory and over one on an in-memory object
// store (packs in memory, the catalog in a temporary directory).
#include "ckpt/files.h"
#include "ckpt/describe.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <thread>

#include "core/json.h"
#include "io/file_names.h"
#include "test_util.h"

namespace ckptfs {
namespace {

using testing::RandomBytes;
using testing::TempDir;

struct Saved {
  TensorInfo info;
  std::vector<std::byte> bytes;
};

// Opens the test's repository (again) with these options.
using RepositoryOpener = std::function<std::unique_ptr<Repository>(OpenOptions)>;

class CheckpointAsFiles : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    RepositoryConfig config;
    config.chunk_size = 64 << 10;
    if (GetParam() == "memory") {
      store_ = NewMemoryBackend();
      ASSERT_OK(Repository::Init(*store_, config));
    } else {
      ASSERT_OK(Repository::Init(dir_.path(), config));
    }
    OpenOptions options;
    options.threads = 2;
    options.cache_bytes = 8 * (64 << 10);
    repo_ = Open()(options);
    ASSERT_TRUE(repo_);
    // Every dtype, odd shapes, 0-d and zero-size; saved as box and flat shards
    // by two ranks.
    uint32_t seed = 1;
    for (int code = 0; code < kDTypeCount; ++code) {
      const DType dt = *DTypeFromCode(code);
      const Shape shape = code % 3 == 0 ? Shape{37, 129} : code % 3 == 1 ? Shape{3000} : Shape{5, 7, 11};
      saved_.push_back({{"layer/" + std::string(DTypeName(dt)), dt, shape}, {}});
    }
    saved_.push_back({{"scalar", DType::kF64, {}}, {}});
    saved_.push_back({{"empty", DType::kF32, {0, 4}}, {}});
    saved_.push_back({{"big%name", DType::kBF16, {300, 1000}}, {}});  // several chunks
    for (auto& s : saved_) s.bytes = RandomBytes(NumElements(s.info.shape) * DTypeSize(s.info.dtype), seed++);
    for (uint32_t rank = 0; rank < 2; ++rank) {
      auto w = std::move(repo_->BeginCheckpoint("c", {rank, 2, 42, {}})).value();
      for (const auto& s : saved_) {
        const uint64_t n = NumElements(s.info.shape), width = DTypeSize(s.info.dtype);
        if (s.info.shape.size() == 2 && s.info.shape[0] > 1) {
          // Box shards: rows split between the ranks.
          const uint64_t r0 = rank == 0 ? 0 : s.info.shape[0] / 2, r1 = rank == 0 ? s.info.shape[0] / 2 : s.info.shape[0];
          const uint64_t row = s.info.shape[1] * width;
          HostSource src(std::span(s.bytes).subspan(r0 * row, (r1 - r0) * row));
          ASSERT_OK(w->PutShard(s.info, Region::OfBox(Box{{r0, 0}, {r1 - r0, s.info.shape[1]}}), src));
        } else {
          // Flat shards cut at an odd element.
          const uint64_t cut = n / 3;
          const uint64_t e0 = rank == 0 ? 0 : cut, e1 = rank == 0 ? cut : n;
          HostSource src(std::span(s.bytes).subspan(e0 * width, (e1 - e0) * width));
          ASSERT_OK(w->PutShard(s.info, Region::OfFlat(e0, e1), src));
        }
      }
      if (rank == 0) ASSERT_OK(w->PutBlob("rng/state", RandomBytes(1000, 99)));
      ASSERT_OK(w->Commit().Wait());
    }
    if (store_) {
      ASSERT_FALSE(store_->List("objects/packs/")->empty()) << "the packs are not in the memory store";
    }
    blob_ = RandomBytes(1000, 99);
    auto reader = repo_->OpenCheckpoint("c");
    ASSERT_OK(reader);
    auto files = CheckpointFiles::Build(std::move(reader).value());
    ASSERT_OK(files);
    files_ = std::move(files).value();
  }

  const Saved& SavedFor(const std::string& name) {
    for (const auto& s : saved_) {
      if (s.info.name == name) return s;
    }
    ADD_FAILURE() << name;
    return saved_[0];
  }

  // The whole file, read in one piece.
  std::vector<std::byte> Whole(const CheckpointFile& f) {
    std::vector<std::byte> out(f.size);
    EXPECT_OK(files_->Read(f, 0, out));
    return out;
  }

  RepositoryOpener Open() {
    return [this](OpenOptions options) {
      options.cache_dir = dir_.path() + "/host";  // the memory store's catalog
      auto r = store_ ? Repository::Open(store_, options) : Repository::Open(dir_.path(), options);
      EXPECT_OK(r);
      return r.ok() ? std::move(r).value() : nullptr;
    };
  }

  TempDir dir_;
  std::shared_ptr<Backend> store_;  // the in-memory object store, or null
  std::unique_ptr<Repository> repo_;
  std::vector<Saved> saved_;
  std::vector<std::byte> blob_;
  std::unique_ptr<CheckpointFiles> files_;
};

TEST_P(CheckpointAsFiles, BlobsWithPlainNamesAlsoStandBesideTheTensorsUnlessTheNameIsTaken) {
  auto w = std::move(repo_->BeginCheckpoint("d", {})).value();
  const auto x = RandomBytes(16, 5);
  HostSource src{std::span(x)};
  ASSERT_OK(w->PutShard({"x", DType::kF32, {4}}, Region::OfFlat(0, 4), src));
  const std::vector<std::string> blob_names = {"config.json", "x.npy", "metadata.json", "blobs", "a/b", "tokenizer.json"};
  for (size_t i = 0; i < blob_names.size(); ++i) ASSERT_OK(w->PutBlob(blob_names[i], RandomBytes(10 + i, 7 + i)));
  ASSERT_OK(w->Commit().Wait());
  auto files = CheckpointFiles::Build(std::move(repo_->OpenCheckpoint("d")).value());
  ASSERT_OK(files);
  std::vector<std::string> top, under_blobs;
  for (const auto& f : (*files)->files()) (f.name.starts_with("blobs/") ? under_blobs : top).push_back(f.name);
  std::sort(top.begin(), top.end());
  std::sort(under_blobs.begin(), under_blobs.end());
  EXPECT_EQ(top, (std::vector<std::string>{"config.json", "metadata.json", "model.safetensors", "tokenizer.json", "x.npy"}));
  EXPECT_EQ(under_blobs, (std::vector<std::string>{"blobs/a%2Fb", "blobs/blobs", "blobs/config.json", "blobs/metadata.json",
                                                   "blobs/tokenizer.json", "blobs/x.npy"}));
  // The copy beside the tensors has the blob's bytes; x.npy stays the tensor.
  const CheckpointFile* config = (*files)->Find("config.json");
  ASSERT_NE(config, nullptr);
  EXPECT_EQ(config->kind, FileKind::kBlob);
  std::vector<std::byte> got(config->size);
  ASSERT_OK((*files)->Read(*config, 0, got));
  EXPECT_TRUE(got == RandomBytes(10, 7));
  EXPECT_EQ((*files)->Find("x.npy")->kind, FileKind::kTensor);
}

// A training state ({"model": ..., "optim": ..., "step": ...}, as the
// Python package stores its nesting) has a model view; a model whose own
// names begin "model." does not, nor a state whose nesting is unreadable.
TEST_P(CheckpointAsFiles, ATrainingStateHasAModelViewOfTheModelsTensorsAndTheFilesBesideIt) {
  const std::string structure =
      R"({"dict": [["model", {"dict": [["model", {"dict": [["w", {"tensor": "model.model.w"}]]}],)"
      R"( ["lm_head", {"dict": [["weight", {"tensor": "model.lm_head.weight"}]]}]]}],)"
      R"( ["optim", {"dict": [["exp_avg", {"tensor": "optim.exp_avg"}], ["lr", {"value": "optim.lr"}]]}],)"
      R"( ["step", {"value": "step"}]]})";
  auto save = [&](const std::string& name, const std::string& nesting) {
    auto w = std::move(repo_->BeginCheckpoint(name, {})).value();
    for (const char* t : {"model.model.w", "model.lm_head.weight", "optim.exp_avg"}) {
      ASSERT_OK(w->PutTensor({t, DType::kU8, {8}}, RandomBytes(8, static_cast<uint32_t>(std::strlen(t)))));
    }
    for (const char* b : {"optim.lr", "step", "config.json"}) ASSERT_OK(w->PutBlob(b, RandomBytes(4, 3)));
    if (!nesting.empty()) ASSERT_OK(w->PutBlob("ckptfs.torch.structure", std::as_bytes(std::span(nesting))));
    ASSERT_OK(w->Commit().Wait());
  };
  save("train", structure);
  save("flat", "");
  save("broken", "{\"dict\": [[\"model\"");
  auto files = CheckpointFiles::Build(std::move(repo_->OpenCheckpoint("train")).value());
  ASSERT_OK(files);
  ASSERT_TRUE(HasModelView(**files));
  auto view = CheckpointFiles::Build(ModelViewOf(**files));
  ASSERT_OK(view);
  const CheckpointReader& part = (*view)->reader();
  std::vector<std::string> tensors, blobs;
  for (const auto& t : part.tensors()) tensors.push_back(t.name);
  for (const auto& b : part.blobs()) blobs.push_back(b.name);
  EXPECT_EQ(tensors, (std::vector<std::string>{"lm_head.weight", "model.w"}));
  EXPECT_EQ(blobs, (std::vector<std::string>{"config.json"}));
  EXPECT_EQ(part.info().name, "train");  // leases and identity are the checkpoint's
  EXPECT_EQ(part.info().tensor_count, 2u);
  EXPECT_EQ(part.info().logical_bytes, 16u + 4u);
  // Its bytes are the checkpoint's.
  std::vector<std::byte> got(8);
  ASSERT_OK(part.ReadBytes(*part.FindTensor("model.w"), 0, got));
  EXPECT_TRUE(got == RandomBytes(8, static_cast<uint32_t>(std::strlen("model.model.w"))));
  ASSERT_NE((*view)->Find("model.safetensors"), nullptr);
  ASSERT_NE((*view)->Find("config.json"), nullptr);
  EXPECT_FALSE(HasModelView(**view));
  for (const char* other : {"flat", "broken"}) {
    auto f = CheckpointFiles::Build(std::move(repo_->OpenCheckpoint(other)).value());
    ASSERT_OK(f);
    EXPECT_FALSE(HasModelView(**f)) << other;
    EXPECT_EQ(ModelViewOf(**f), nullptr) << other;
  }
}

TEST_P(CheckpointAsFiles, NamesAndExactSizesAreKnownBeforeAnyRead) {
  const BufferPoolStats before = repo_->buffer_stats();
  const auto& files = files_->files();
  ASSERT_EQ(files.size(), saved_.size() + 3);  // tensors, model.safetensors, metadata.json, one blob
  uint64_t tensor_bytes = 0;
  for (size_t i = 0; i < saved_.size(); ++i) {
    const CheckpointFile& f = files_->tensor_file(i);
    const TensorRecord& t = files_->reader().tensors()[i];
    EXPECT_EQ(f.kind, FileKind::kTensor);
    EXPECT_EQ(f.name, FileNameFor(t.name, ".npy"));
    EXPECT_EQ(f.size, NpyHeader(t.dtype, t.shape).size() + t.ByteSize());
    tensor_bytes += t.ByteSize();
  }
  EXPECT_EQ(files_->safetensors_file().name, "model.safetensors");
  EXPECT_EQ(files_->safetensors_file().size, files_->HeaderSize(files_->safetensors_file()) + tensor_bytes);
  EXPECT_EQ(files_->blob_file(0).name, "blobs/rng%2Fstate");
  EXPECT_EQ(files_->blob_file(0).size, 1000u);
  EXPECT_NE(files_->Find("metadata.json"), nullptr);
  EXPECT_EQ(files_->Find("big%25name.npy"), &files_->tensor_file(0));
  EXPECT_EQ(files_->Find("nope"), nullptr);
  // Building the files read no tensor data.
  EXPECT_EQ(repo_->buffer_stats().allocations, before.allocations);
  EXPECT_EQ(repo_->buffer_stats().reuses, before.reuses);
}

TEST_P(CheckpointAsFiles, FilesHoldTheSavedBytes) {
  for (size_t i = 0; i < saved_.size(); ++i) {
    const CheckpointFile& f = files_->tensor_file(i);
    const auto& s = SavedFor(files_->reader().tensors()[i].name);
    auto got = Whole(f);
    const uint64_t h = files_->HeaderSize(f);
    ASSERT_EQ(got.size(), h + s.bytes.size());
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(got.data()), h), NpyHeader(s.info.dtype, s.info.shape));
    EXPECT_TRUE(std::equal(s.bytes.begin(), s.bytes.end(), got.begin() + h)) << f.name;
  }
  // model.safetensors parses to the same tensors, at the offsets it names.
  auto st = Whole(files_->safetensors_file());
  uint64_t n;
  std::memcpy(&n, st.data(), 8);
  auto header = ParseSafetensorsHeader(std::string_view(reinterpret_cast<const char*>(st.data()) + 8, n), st.size() - 8 - n);
  ASSERT_OK(header);
  ASSERT_EQ(header->tensors.size(), saved_.size());
  for (const auto& t : header->tensors) {
    const auto& s = SavedFor(t.name);
    EXPECT_TRUE(std::equal(s.bytes.begin(), s.bytes.end(), st.begin() + 8 + n + t.begin)) << t.name;
  }
  EXPECT_EQ(header->metadata, (std::vector<std::pair<std::string, std::string>>{{"format", "pt"}, {"ckptfs.checkpoint", "c"}, {"ckptfs.step", "42"}}));
  EXPECT_TRUE(Whole(files_->blob_file(0)) == blob_);
  auto meta = Whole(*files_->Find("metadata.json"));
  auto json = Json::Parse(std::string_view(reinterpret_cast<const char*>(meta.data()), meta.size()));
  ASSERT_OK(json);
  EXPECT_EQ(json->Find("tensors")->as_array()[0].Find("file")->as_string(), "big%25name.npy");
  // Written a tensor at a time, the text is what the whole tree would dump.
  auto described = DescribeCheckpoint(files_->reader());
  ASSERT_OK(described);
  auto& tensors = described->Find("tensors")->as_array();
  for (size_t i = 0; i < tensors.size(); ++i) tensors[i].Set("file", files_->tensor_file(i).name);
  auto& blobs = described->Find("blobs")->as_array();
  for (size_t i = 0; i < blobs.size(); ++i) blobs[i].Set("file", files_->blob_file(i).name);
  const std::string expected = described->Dump(2) + "\n";
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(meta.data()), meta.size()), expected);
}

TEST_P(CheckpointAsFiles, EveryByteRangeOfEveryFileMatchesTheWholeFile) {
  std::mt19937_64 rng(7);
  for (const auto& f : files_->files()) {
    const auto whole = Whole(f);
    for (int i = 0; i < 40; ++i) {
      const uint64_t off = f.size ? rng() % (f.size + 1) : 0;
      const uint64_t len = (f.size - off) ? rng() % (f.size - off + 1) : 0;
      std::vector<std::byte> got(len);
      ASSERT_OK(files_->Read(f, off, got));
      EXPECT_TRUE(std::equal(got.begin(), got.end(), whole.begin() + off)) << f.name << " " << off << "+" << len;
    }
    std::vector<std::byte> past(2);
    EXPECT_EQ(files_->Read(f, f.size - std::min<uint64_t>(f.size, 1), past).code(), StatusCode::kInvalidArgument);
  }
}

TEST_P(CheckpointAsFiles, ReadsInPlaceGiveTheBytesOfReadsAndReleaseTheirChunks) {
  std::mt19937_64 rng(11);
  size_t in_place = 0, copied = 0;
  for (const auto& f : files_->files()) {
    const auto whole = Whole(f);
    for (int i = 0; i < 40; ++i) {
      uint64_t off = f.size ? rng() % (f.size + 1) : 0;
      uint64_t len = (f.size - off) ? rng() % (f.size - off + 1) : 0;
      if (i % 2 == 0) {  // page-aligned, as the kernel asks
        off &= ~uint64_t{4095};
        len = std::min<uint64_t>(f.size - off, (len + 4095) & ~uint64_t{4095});
      }
      FilePieces pieces;
      auto r = files_->ReadInPlace(f, off, len, 64, pieces);
      ASSERT_OK(r);
      if (!*r) {
        EXPECT_TRUE(pieces.pieces().empty());
        ++copied;
        continue;
      }
      ++in_place;
      std::vector<std::byte> got;
      for (const auto& p : pieces.pieces()) {
        EXPECT_FALSE(p.empty());
        got.insert(got.end(), p.begin(), p.end());
      }
      EXPECT_LE(pieces.pieces().size(), 64u);
      ASSERT_EQ(got.size(), len) << f.name << " " << off << "+" << len;
      EXPECT_TRUE(std::equal(got.begin(), got.end(), whole.begin() + off)) << f.name << " " << off << "+" << len;
    }
    FilePieces past;
    EXPECT_EQ(files_->ReadInPlace(f, f.size, 1, 64, past).status().code(), StatusCode::kInvalidArgument);
  }
  EXPECT_GT(in_place, 200u);
  EXPECT_GT(copied, 0u);  // blobs, unaligned ranges and ranges of many rows of a box shard
  // Blobs are always copied.
  FilePieces pieces;
  EXPECT_FALSE(*files_->ReadInPlace(files_->blob_file(0), 0, 10, 64, pieces));
  // The whole of a tensor saved as two row boxes: a piece per chunk part.
  const CheckpointFile& big = files_->tensor_file(0);
  ASSERT_TRUE(*files_->ReadInPlace(big, 0, big.size, 64, pieces));
  EXPECT_LT(pieces.pieces().size(), 64u);
  // Used up, its chunks left the cache: a read in place holds the only
  // reference until it is cleared, and clearing gives the buffers back.
  // (The tensor is larger than the cache, so the whole read has evicted
  // every other chunk.)
  pieces.Clear();
  const BufferPoolStats after = repo_->buffer_stats();
  EXPECT_EQ(after.bytes_held, after.idle_buffers * (64 << 10));
}

TEST_P(CheckpointAsFiles, PrefetchNeverChangesBytesAndCrossesTensorBoundaries) {
  const CheckpointFile& st = files_->safetensors_file();
  const auto expect = Whole(st);
  // Read front to back in 64 KiB requests with readahead; compare.
  const uint64_t window = 4 * (64 << 10);
  FileReadahead ahead(*files_, st, window);
  ahead.OnOpen();
  // The first tensor's data ends here; the window runs on past it.
  const uint64_t end_of_first = files_->HeaderSize(st) + files_->reader().tensors()[0].ByteSize();
  std::vector<std::byte> got(st.size);
  for (uint64_t off = 0; off < st.size; off += 64 << 10) {
    const uint64_t n = std::min<uint64_t>(64 << 10, st.size - off);
    ahead.BeforeRead(off, n);
    if (off < end_of_first && off + n + window > end_of_first + (64 << 10)) {
      EXPECT_GT(ahead.prefetched_until(), end_of_first) << "the window stopped at a tensor boundary";
    }
    ASSERT_OK(files_->Read(st, off, std::span(got).subspan(off, n)));
  }
  EXPECT_TRUE(got == expect);
  // Random jumps (not sequential) and reads after them still give the bytes.
  std::mt19937_64 rng(3);
  for (int i = 0; i < 50; ++i) {
    const uint64_t off = rng() % st.size, n = std::min<uint64_t>(1 + rng() % 100000, st.size - off);
    ahead.BeforeRead(off, n);
    std::vector<std::byte> piece(n);
    ASSERT_OK(files_->Read(st, off, piece));
    EXPECT_TRUE(std::equal(piece.begin(), piece.end(), expect.begin() + off));
  }
}

// The .npy files in name order, each read front to back through its own
// FileReadahead with a window of one chunk, on a repository whose prefetches
// run on one thread in order (so a prefetch asked for later proves the
// earlier ones have run).
class NpyFilesInOrder {
 public:
  explicit NpyFilesInOrder(const RepositoryOpener& open) {
    OpenOptions options;
    options.threads = 1;
    options.cache_bytes = 64 * (64 << 10);
    repo_ = open(options);
    files_ = std::move(CheckpointFiles::Build(std::move(repo_->OpenCheckpoint("c")).value())).value();
    // NextTensorFile from the first file in name order.
    std::vector<const CheckpointFile*> tensors;
    for (const auto& f : files_->files()) {
      if (f.kind == FileKind::kTensor) tensors.push_back(&f);
    }
    const CheckpointFile* first = *std::min_element(tensors.begin(), tensors.end(),
                                                    [](auto* a, auto* b) { return a->name < b->name; });
    for (const CheckpointFile* f = first; f; f = files_->NextTensorFile(*f)) order_.push_back(f);
  }
  const CheckpointFiles& files() const { return *files_; }
  const std::vector<const CheckpointFile*>& order() const { return order_; }
  const CheckpointFile& at(size_t k) const { return *order_[k]; }

  void Open(size_t k) { Ahead(k).OnOpen(); }
  void ReadToEnd(size_t k) {
    for (uint64_t off = 0; off < at(k).size; off += 4096) Ahead(k).BeforeRead(off, std::min<uint64_t>(4096, at(k).size - off));
  }
  // Whether the first chunk of file k's tensor is in the cache, once every
  // prefetch asked for so far has run.
  bool FirstChunkCached(size_t k) {
    // A chunk not asked for before, from the end of the name order.
    const CheckpointReader& r = files_->reader();
    const TensorRecord& marker = r.tensors()[order_[order_.size() - 1 - markers_++]->index];
    EXPECT_EQ(r.ChunksCached(marker, 0, 1), 0u);
    r.Prefetch(marker, 0, 1);
    for (int i = 0; i < 10000 && r.ChunksCached(marker, 0, 1) == 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    EXPECT_EQ(r.ChunksCached(marker, 0, 1), 1u) << "the marker prefetch never ran";
    return r.ChunksCached(r.tensors()[at(k).index], 0, 1) == 1;
  }

 private:
  FileReadahead& Ahead(size_t k) {
    auto& a = ahead_[k];
    if (!a) a = std::make_unique<FileReadahead>(*files_, at(k), 64 << 10);
    return *a;
  }
  std::unique_ptr<Repository> repo_;
  std::unique_ptr<CheckpointFiles> files_;
  std::vector<const CheckpointFile*> order_;
  std::map<size_t, std::unique_ptr<FileReadahead>> ahead_;
  size_t markers_ = 0;
};

TEST_P(CheckpointAsFiles, ReadingNpyFilesInNameOrderPrefetchesTheNextFile) {
  files_.reset();
  repo_.reset();  // the catalog is opened once per process
  {
    NpyFilesInOrder npy(Open());
    // Every .npy file once, in byte order of names; none after the last,
    // and no next file for the others.
    ASSERT_EQ(npy.order().size(), saved_.size());
    for (size_t k = 1; k < npy.order().size(); ++k) EXPECT_LT(npy.at(k - 1).name, npy.at(k).name);
    EXPECT_EQ(npy.files().NextTensorFile(*npy.order().back()), nullptr);
    for (const auto& f : npy.files().files()) {
      if (f.kind != FileKind::kTensor) {
        EXPECT_EQ(npy.files().NextTensorFile(f), nullptr) << f.name;
      }
    }
    EXPECT_EQ(npy.order().front()->name, "big%25name.npy");
    ASSERT_EQ(npy.at(1).name, "empty.npy");  // no bytes: the window runs on past it
    // The files of the test from the third on (all under 64 KiB, so a
    // window of one chunk past a file's end reaches into the next file).
    npy.Open(2);
    EXPECT_FALSE(npy.FirstChunkCached(3));
    npy.ReadToEnd(2);
    EXPECT_TRUE(npy.FirstChunkCached(3)) << "the end of " << npy.at(2).name << " did not prefetch " << npy.at(3).name;
  }
  {
    // Opened out of name order: no prefetch across files, until a file is
    // opened right after its predecessor again.
    NpyFilesInOrder npy(Open());
    npy.Open(8);
    npy.Open(2);
    npy.ReadToEnd(2);
    EXPECT_FALSE(npy.FirstChunkCached(3)) << "prefetched across files opened out of order";
    npy.Open(3);
    npy.ReadToEnd(3);
    EXPECT_TRUE(npy.FirstChunkCached(4)) << "files opened in order again, and no prefetch across them";
  }
}

TEST_P(CheckpointAsFiles, ARepositoryClosedWithPrefetchesInFlightFinishesThemFirst) {
  // Prefetch tasks use the repository's fetcher, cache and catalog; closing
  // the repository right after asking for every chunk must let them finish
  // before those go (ASan and TSan catch the use after free otherwise).
  for (int round = 0; round < 5; ++round) {
    auto reader = repo_->OpenCheckpoint("c");
    ASSERT_OK(reader);
    for (const auto& t : (*reader)->tensors()) (*reader)->Prefetch(t, 0, t.ByteSize());
    files_.reset();
    reader->reset();
    repo_.reset();
    OpenOptions options;
    options.threads = 2;
    repo_ = Open()(options);
    ASSERT_TRUE(repo_);
  }
}

INSTANTIATE_TEST_SUITE_P(Repositories, CheckpointAsFiles, ::testing::Values("local", "memory"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace ckptfs
