// Content addressing's promise, tried as careless users and damaged stores
// would: a chunk id names exactly its stored bytes (a source that changes
// during a save never stores one that fails its id), a reference's length
// is checked against the chunk wherever it is copied or verified, a chunk
// that fails its id is found, named against every checkpoint that uses it,
// and stored again from a good copy.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <random>
#include <thread>

#include "ckpt/repository.h"
#include "meta/records.h"
#include "store/pack.h"
#include "test_repositories.h"
#include "test_util.h"

namespace ckptfs {
namespace {

using testing::RandomBytes;
using testing::RepoKind;

class IntegrityFixture : public testing::RepositoryTest {
 protected:
  void Create(RepoKind kind) { RepositoryTest::Create(kind, {2, 1 << 20}); }

  // Saves `bytes` as the f32 tensor "w" (and "fixed", never changed) of
  // checkpoint `name`, whole, from host memory.
  Status SaveBytes(Repository& repo, const std::string& name, std::span<const std::byte> bytes,
                   std::span<const std::byte> fixed) {
    auto w = repo.BeginCheckpoint(name, {0, 1, std::nullopt, {}});
    CKPT_RETURN_IF_ERROR(w.status());
    CKPT_RETURN_IF_ERROR((*w)->PutTensor({"w", DType::kF32, {bytes.size() / 4}}, bytes));
    CKPT_RETURN_IF_ERROR((*w)->PutTensor({"fixed", DType::kU8, {fixed.size()}}, fixed));
    return (*w)->Commit().Wait().status();
  }
  std::vector<std::byte> ReadTensor(Repository& repo, const std::string& name, const std::string& tensor) {
    auto r = repo.OpenCheckpoint(name);
    EXPECT_OK(r);
    if (!r.ok()) return {};
    const TensorRecord* t = (*r)->FindTensor(tensor);
    EXPECT_NE(t, nullptr);
    if (!t) return {};
    std::vector<std::byte> out(t->shape[0] * DTypeSize(t->dtype));
    EXPECT_OK((*r)->ReadBytes(*t, 0, out));
    return out;
  }
};

class Integrity : public testing::EachKind<IntegrityFixture> {};
INSTANTIATE_TEST_SUITE_P(Repositories, Integrity, testing::AllRepositoryKinds(), testing::RepoKindNamer());
class LocalIntegrity : public testing::LocalKind<IntegrityFixture> {};

// Training code that runs its next optimizer step while an asynchronous
// save still reads the tensors: another thread rewrites the source all
// through 100 saves. Each checkpoint may hold a mix of old and new values;
// the store holds no chunk that fails its id, and a later save of the
// original bytes (deduplicating against whatever those saves stored)
// reads back bit-exact.
TEST_P(Integrity, ASourceRewrittenDuringSavesNeverPoisonsTheStore) {
  if (testing::kThreadSanitizer) GTEST_SKIP() << "the test races another thread's writes with the save on purpose";
  const int saves = GetParam() == RepoKind::kS3 ? 10 : 100;
  const std::vector<std::byte> original = RandomBytes(1 << 20, 11);  // 16 chunks of 64 KiB
  const std::vector<std::byte> fixed = RandomBytes(100 << 10, 12);
  std::vector<std::byte> live = original;
  std::atomic<bool> stop{false};
  std::thread mutator([&] {
    std::mt19937_64 rng(99);
    while (!stop.load(std::memory_order_relaxed)) {
      // Whole floats, as an optimizer step writes them; the bytes are
      // changed with volatile stores so none is optimised away.
      const uint64_t draw = rng();
      const size_t at = (draw % (live.size() / 4)) * 4;
      volatile std::byte* p = live.data() + at;
      for (int i = 0; i < 4; ++i) p[i] = std::byte(draw >> (8 * (4 + i)));
    }
  });
  for (int i = 0; i < saves; ++i) {
    ASSERT_OK(SaveBytes(*repo_, "racy-" + std::to_string(i), live, fixed));
  }
  stop = true;
  mutator.join();
  auto verified = repo_->Verify(std::nullopt);
  ASSERT_OK(verified);
  EXPECT_TRUE(verified->ok()) << verified->problems.front().message;
  EXPECT_TRUE(verified->bad_chunks.empty());
  ASSERT_OK(SaveBytes(*repo_, "clean", original, fixed));
  EXPECT_EQ(ReadTensor(*repo_, "clean", "w"), original);
  EXPECT_EQ(ReadTensor(*repo_, "clean", "fixed"), fixed);
}

// The store of `where` as an object store test reaches it; the pack holding
// chunk `id` gets one byte of that chunk flipped. Returns the pack's id.
std::string DamageChunk(Backend& objects, Repository& repo, const std::string& checkpoint, const std::string& tensor) {
  auto r = repo.OpenCheckpoint(checkpoint);
  EXPECT_OK(r);
  const ChunkId id = (*r)->FindTensor(tensor)->shards.at(0).chunks.at(0).id;
  auto packs = objects.List("packs/");
  EXPECT_OK(packs);
  for (const std::string& key : *packs) {
    std::string pack_id;
    if (!ParsePackKey(key, &pack_id)) continue;
    auto index = ReadPackIndex(&objects, pack_id);
    if (!index.ok()) continue;
    for (const PackIndexEntry& e : index->entries) {
      if (e.id != id) continue;
      std::string bytes = std::move(objects.ReadAll(key)).value();
      bytes[e.location.offset + e.location.stored_len / 2] ^= 0x5a;
      EXPECT_OK(objects.Put(key, testing::AsBytes(bytes)));
      return pack_id;
    }
  }
  ADD_FAILURE() << "no pack holds chunk " << id.ToHex();
  return "";
}

// A chunk whose stored bytes fail its id (a damaged disk, or a store
// poisoned before saves copied their sources) is named against every
// checkpoint that uses it; with no good copy it stays unrepaired, and a
// repair from a repository that has it (another tier, a copy) stores it
// again: verify is clean and every checkpoint reads back.
TEST_P(Integrity, AChunkThatFailsItsIdIsNamedForEveryUserAndRepairedFromAGoodCopy) {
  const std::vector<std::byte> shared = RandomBytes(256 << 10, 21), a = RandomBytes(64 << 10, 22),
                               b = RandomBytes(64 << 10, 23);
  ASSERT_OK(SaveBytes(*repo_, "a", a, shared));
  ASSERT_OK(SaveBytes(*repo_, "b", b, shared));
  testing::TempDir tier_dir;
  ASSERT_OK(Repository::Init(tier_dir.path(), RepositoryConfig{}));
  auto tier = Repository::Open(tier_dir.path());
  ASSERT_OK(tier);
  CopyOptions all;
  all.all = true;
  ASSERT_OK(CopyCheckpoints(*repo_, **tier, all));

  auto objects = where_.Objects();
  DamageChunk(*objects, *repo_, "a", "fixed");
  Reopen();  // no decoded chunk left in a cache
  auto verified = repo_->Verify(std::nullopt);
  ASSERT_OK(verified);
  ASSERT_FALSE(verified->ok());
  ASSERT_EQ(verified->bad_chunks.size(), 1u);
  EXPECT_EQ(verified->bad_chunks[0].checkpoints, (std::vector<std::string>{"a", "b"}));
  int named = 0;
  for (const VerifyProblem& p : verified->problems) {
    if (p.bad_chunk && *p.bad_chunk == verified->bad_chunks[0].id) ++named;
  }
  EXPECT_EQ(named, 2);  // once per checkpoint that uses it

  auto alone = repo_->Repair(*verified);
  ASSERT_OK(alone);
  EXPECT_TRUE(alone->repaired.empty());
  ASSERT_EQ(alone->unrepaired.size(), 1u);
  EXPECT_EQ(alone->unrepaired[0].checkpoints, (std::vector<std::string>{"a", "b"}));

  Repository* sources[] = {tier->get()};
  auto repaired = repo_->Repair(*verified, sources);
  ASSERT_OK(repaired);
  ASSERT_EQ(repaired->repaired.size(), 1u);
  EXPECT_EQ(repaired->repaired[0].from, tier_dir.path());
  EXPECT_TRUE(repaired->unrepaired.empty());
  EXPECT_GE(repaired->packs_rewritten, 1u);
  Reopen();
  auto again = repo_->Verify(std::nullopt);
  ASSERT_OK(again);
  EXPECT_TRUE(again->ok()) << again->problems.front().message;
  EXPECT_EQ(ReadTensor(*repo_, "a", "fixed"), shared);
  EXPECT_EQ(ReadTensor(*repo_, "b", "fixed"), shared);
  EXPECT_EQ(ReadTensor(*repo_, "a", "w"), a);
  // Another host of a store learns the new packs by its sync.
  if (where_.kind() == RepoKind::kLocal) return;
  auto other = where_.Open(open_, "other");
  ASSERT_OK(other);
  EXPECT_EQ(ReadTensor(**other, "b", "fixed"), shared);
}

// Where two saves each stored a chunk (two hosts of a store, or racing
// saves), the other pack's copy is a good copy: a repair needs no other
// repository.
TEST_F(LocalIntegrity, ARepairTakesAGoodCopyFromAnotherPackOfTheRepository) {
  const std::vector<std::byte> shared = RandomBytes(128 << 10, 31), a = RandomBytes(64 << 10, 32);
  ASSERT_OK(SaveBytes(*repo_, "a", a, shared));
  // A second pack holding the same chunk, as a racing save leaves one: the
  // pack written by a save into another repository, moved in beside.
  testing::TempDir other_dir;
  RepositoryConfig config;
  config.chunk_size = 64 << 10;
  config.pack_size = 1 << 20;
  ASSERT_OK(Repository::Init(other_dir.path(), config));
  {
    auto other = Repository::Open(other_dir.path());
    ASSERT_OK(other);
    ASSERT_OK(SaveBytes(**other, "a", a, shared));
  }
  auto objects = where_.Objects();
  auto other_objects = std::move(OpenLocalBackend(other_dir.path() + "/objects")).value();
  const std::vector<std::string> other_packs = std::move(other_objects->List("packs/")).value();
  for (const std::string& key : other_packs) {
    const std::string bytes = std::move(other_objects->ReadAll(key)).value();
    ASSERT_OK(objects->Put(key, testing::AsBytes(bytes)));
  }
  auto reindexed = Repository::Reindex(where_.path());
  ASSERT_OK(reindexed);
  Reopen();
  // Damage the copy the catalog points at.
  const std::string damaged = DamageChunk(*objects, *repo_, "a", "fixed");
  auto verified = repo_->Verify(std::nullopt);
  ASSERT_OK(verified);
  (void)damaged;
  if (verified->bad_chunks.empty()) GTEST_SKIP() << "the catalog points at the undamaged copy";
  auto repaired = repo_->Repair(*verified);
  ASSERT_OK(repaired);
  ASSERT_EQ(repaired->repaired.size(), 1u);
  EXPECT_EQ(repaired->repaired[0].from.rfind("pack ", 0), 0u);
  Reopen();
  auto again = repo_->Verify(std::nullopt);
  ASSERT_OK(again);
  EXPECT_TRUE(again->ok());
  EXPECT_EQ(ReadTensor(*repo_, "a", "fixed"), shared);
}

// A source whose manifest references a chunk with a length other than the
// chunk's (damaged, or hostile): the copy refuses it when the destination
// already has the chunk and nothing of it is committed, and verify names
// the reference.
TEST(CopyIntegrity, AReferenceWhoseLengthDisagreesWithTheDestinationsChunkIsRefused) {
  testing::TempDir dir;
  std::shared_ptr<Backend> memory = NewMemoryBackend();
  RepositoryConfig config;
  config.chunk_size = 64 << 10;
  ASSERT_OK(Repository::Init(*memory, config));
  OpenOptions host;
  host.cache_dir = dir.path() + "/cache";
  // Two chunks of different lengths: 64 KiB and 1000 bytes.
  const auto bytes = RandomBytes((64 << 10) + 1000, 41);
  {
    auto src = Repository::Open(memory, host);
    ASSERT_OK(src);
    for (const char* name : {"a", "b"}) {
      auto w = std::move((*src)->BeginCheckpoint(name, {0, 1, std::nullopt, {}})).value();
      ASSERT_OK(w->PutTensor({"t", DType::kU8, {bytes.size()}}, bytes));
      ASSERT_OK(w->Commit().Wait());
    }
  }
  ASSERT_OK(Repository::Init(dir.path() + "/dst", config));
  auto dst = Repository::Open(dir.path() + "/dst");
  ASSERT_OK(dst);
  {
    auto src = Repository::Open(memory, host);
    ASSERT_OK(src);
    CopyOptions o;
    o.names = {"a"};
    ASSERT_OK(CopyCheckpoints(**src, **dst, o));
  }
  // b's manifest with its two chunks' lengths swapped: the shard's total
  // is unchanged, so the manifest decodes.
  auto body = memory->ReadAll("objects/manifests/b.manifest");
  ASSERT_OK(body);
  auto manifest = DecodeManifest(*body);
  ASSERT_OK(manifest);
  auto& chunks = manifest->tensors.at(0).shards.at(0).chunks;
  ASSERT_EQ(chunks.size(), 2u);
  std::swap(chunks[0].raw_len, chunks[1].raw_len);
  const std::string tampered = EncodeManifest(*manifest);
  ASSERT_OK(memory->Put("objects/manifests/b.manifest", testing::AsBytes(tampered)));
  host.cache_dir = dir.path() + "/cache-fresh";
  auto src = Repository::Open(memory, host);
  ASSERT_OK(src);
  CopyOptions o;
  o.names = {"b"};
  auto copied = CopyCheckpoints(**src, **dst, o);
  ASSERT_FALSE(copied.ok());
  EXPECT_TRUE(copied.status().IsCorruption()) << copied.status().ToString();
  EXPECT_NE(copied.status().message().find("length"), std::string::npos) << copied.status().ToString();
  EXPECT_TRUE((*dst)->GetCheckpoint("b").status().IsNotFound());
  auto listed = (*dst)->ListCheckpoints(/*include_pending=*/true);
  ASSERT_OK(listed);
  EXPECT_EQ(listed->size(), 1u);  // nothing of b, not even pending
  auto verified = (*src)->Verify("b");
  ASSERT_OK(verified);
  EXPECT_FALSE(verified->ok());
  int length_problems = 0;
  for (const VerifyProblem& p : verified->problems) {
    if (p.checkpoint == "b" && p.message.find("with length") != std::string::npos) ++length_problems;
  }
  EXPECT_EQ(length_problems, 2);
}

}  // namespace
}  // namespace ckptfs
