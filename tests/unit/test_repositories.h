// Every kind of repository, for the suites that must hold for each (the
// repository conformance suite: save/load and gc): a local directory, an
// object store handed over as a Backend (the in-memory store), and S3 on the
// server the AWS_* variables name. The two stores run the object-store
// protocol, the directory the catalog's (ckpt/commit.h).
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <ostream>
#include <string>
#include <thread>

#include "backend/backend.h"
#include "backend/store_url.h"
#include "ckpt/lease.h"
#include "ckpt/repository.h"
#include "core/random.h"
#include "test_backends.h"
#include "test_util.h"

namespace ckptfs::testing {

enum class RepoKind { kLocal, kMemoryStore, kS3 };

inline const char* RepoKindName(RepoKind k) {
  switch (k) {
    case RepoKind::kLocal: return "local";
    case RepoKind::kMemoryStore: return "memory";
    case RepoKind::kS3: return "s3";
  }
  return "?";
}
inline void PrintTo(RepoKind k, std::ostream* os) { *os << RepoKindName(k); }

inline auto AllRepositoryKinds() { return ::testing::Values(RepoKind::kLocal, RepoKind::kMemoryStore, RepoKind::kS3); }
// For INSTANTIATE_TEST_SUITE_P: names the instances local, memory, s3.
struct RepoKindNamer {
  std::string operator()(const ::testing::TestParamInfo<RepoKind>& info) const { return RepoKindName(info.param); }
};

// One repository of a kind, in a temporary place: created once, opened as
// often as a test likes (each open a fresh Repository, as a new process's).
class TestRepository {
 public:
  TestRepository() = default;
  TestRepository(const TestRepository&) = delete;
  TestRepository& operator=(const TestRepository&) = delete;
  // An S3 repository's objects are deleted (best effort): the test server
  // keeps its data in memory, and the suites run three times per test
  // command (release, ASan, TSan).
  ~TestRepository() {
    if (kind_ != RepoKind::kS3 || path_.empty()) return;
    auto root = OpenObjectStore(path_, s3_);
    if (!root.ok()) return;
    auto keys = (*root)->List("");
    if (!keys.ok()) return;
    for (const auto& key : *keys) (void)(*root)->Delete(key);
  }

  // False, with `why`, when this kind cannot be tested here (no S3 server).
  bool Create(RepoKind kind, const RepositoryConfig& config, std::string* why) {
    kind_ = kind;
    switch (kind) {
      case RepoKind::kLocal:
        path_ = dir_.path();  // a store's hosts keep their caches here too
        return Check(Repository::Init(path_, config), why);
      case RepoKind::kMemoryStore:
        store_ = NewMemoryBackend();
        path_ = "memory store";
        return Check(Repository::Init(*store_, config), why);
      case RepoKind::kS3: {
        auto o = S3TestOptions(why);
        if (!o) return false;
        s3_ = *o;
        path_ = "s3://ckptfs-test/repo-" + RandomHex(10);
        OpenOptions init;
        init.s3 = s3_;
        return Check(Repository::Init(path_, config, init), why);
      }
    }
    return false;
  }

  // Opens it with `options`, plus what its kind needs (the host's cache
  // directory `host` for a store, the S3 settings).
  Result<std::unique_ptr<Repository>> Open(OpenOptions options = {}, const std::string& host = "host") const {
    if (kind_ != RepoKind::kLocal) options.cache_dir = dir_.path() + "/cache-" + host;
    switch (kind_) {
      case RepoKind::kLocal: return Repository::Open(path_, options);
      case RepoKind::kMemoryStore: return Repository::Open(store_, options);
      case RepoKind::kS3:
        options.s3 = s3_;
        return Repository::Open(path_, options);
    }
    return Status::Internal("unknown kind");
  }

  // The repository's objects (packs/, manifests/, ...) as the store holds
  // them, for a test to look at what is really stored.
  std::unique_ptr<Backend> Objects() const {
    switch (kind_) {
      case RepoKind::kLocal: return std::move(OpenLocalBackend(path_ + "/objects")).value();
      case RepoKind::kMemoryStore: return NewPrefixedBackend(store_, "objects");
      case RepoKind::kS3: return std::move(OpenObjectStore(ObjectStoreChild(path_, "objects"), s3_)).value();
    }
    return nullptr;
  }

  // Bytes of every object under `prefix` of Objects().
  uint64_t StoredBytes(const std::string& prefix) const {
    auto objects = Objects();
    uint64_t n = 0;
    const std::vector<std::string> keys = std::move(objects->List(prefix)).value();
    for (const auto& key : keys) {
      auto size = objects->Size(key);
      if (size.ok()) n += *size;
    }
    return n;
  }

  RepoKind kind() const { return kind_; }
  const std::string& path() const { return path_; }
  const TempDir& dir() const { return dir_; }

 private:
  static bool Check(const Status& st, std::string* why) {
    if (!st.ok()) *why = "cannot create the repository: " + st.ToString();
    return st.ok();
  }

  TempDir dir_;
  RepoKind kind_ = RepoKind::kLocal;
  std::string path_;
  std::shared_ptr<Backend> store_;
  ObjectStoreOptions s3_;
};

// A fixture base: a repository of one kind, opened as repo_ (64 KiB chunks,
// 1 MiB packs: many chunks per tensor, several packs per save).
class RepositoryTest : public ::testing::Test {
 protected:
  // Skips (or, where the test command promised S3, fails) when the kind
  // cannot be tested here.
  void Create(RepoKind kind, OpenOptions open) {
    open_ = std::move(open);
    RepositoryConfig config;
    config.chunk_size = 64 << 10;
    config.pack_size = 1 << 20;
    std::string why;
    const bool made = where_.Create(kind, config, &why);
    CKPTFS_SKIP_UNLESS(made, why);
    Reopen();
  }
  // A fresh Repository of the same repository, as a new process would open.
  void Reopen() {
    repo_.reset();
    auto r = where_.Open(open_);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    repo_ = std::move(r).value();
  }

  // After the last reader of a checkpoint let go: on an object store its
  // lease lingers (LeaseRegistry::kLinger) until the repository closes.
  // With no reader left the repository reopens, so the gc that should find
  // the checkpoint free runs as a new process would; with a reader kept
  // (it keeps the repository's internals, and its lease registry, alive),
  // the linger is waited out.
  void LeasesLetGo(bool reader_kept = false) {
    if (where_.kind() == RepoKind::kLocal) return;
    if (!reader_kept) return Reopen();
    std::this_thread::sleep_for(LeaseRegistry::kLinger + std::chrono::milliseconds(700));
  }
  // Verify of the whole repository finds nothing wrong.
  void ExpectVerifies() {
    auto v = repo_->Verify(std::nullopt);
    ASSERT_OK(v);
    EXPECT_TRUE(v->ok()) << (v->problems.empty() ? "" : v->problems[0].message);
  }

  TestRepository where_;
  const TempDir& dir_ = where_.dir();  // the local kind's repository
  OpenOptions open_;
  std::unique_ptr<Repository> repo_;
};

// A suite's two fixtures from one fixture `Base` (a RepositoryTest with a
// Create(RepoKind)): EachKind<Base> runs its tests on every kind
// (INSTANTIATE_TEST_SUITE_P with AllRepositoryKinds), LocalKind<Base> on a
// local directory only.
template <class Base>
class EachKind : public Base, public ::testing::WithParamInterface<RepoKind> {
 protected:
  void SetUp() override { this->Create(this->GetParam()); }
};
template <class Base>
class LocalKind : public Base {
 protected:
  void SetUp() override { this->Create(RepoKind::kLocal); }
};

}  // namespace ckptfs::testing
