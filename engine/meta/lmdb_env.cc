#include "meta/lmdb_env.h"

#include <unistd.h>

#include <mutex>
#include <set>
#include <tuple>

#include "core/crash_point.h"

#include <lmdb.h>
#include <sys/stat.h>

#include <cerrno>
#include <mutex>

namespace ckptfs {
namespace {
const char* kTableNames[] = {"meta", "checkpoints", "ranks", "tensors", "blobs", "chunks", "packs"};

MDB_val Val(std::string_view s) { return MDB_val{s.size(), const_cast<char*>(s.data())}; }
std::string_view View(const MDB_val& v) { return {static_cast<const char*>(v.mv_data), v.mv_size}; }
}  // namespace

Status LmdbError(int rc, std::string_view context) {
  std::string msg = std::string(context) + ": " + mdb_strerror(rc);
  switch (rc) {
    case MDB_MAP_FULL: return Status::ResourceExhausted(msg).WithDetail(StatusDetail::kCatalogMapFull);
    case ENOSPC: return Status::ResourceExhausted(msg);
    case MDB_CORRUPTED:
    case MDB_PAGE_NOTFOUND:
    case MDB_INVALID:
      return Status::Corruption(msg + kReindexHint);
    case MDB_VERSION_MISMATCH: return Status::Unsupported(msg);
    case ENOENT: return Status::NotFound(msg);
    default: return Status::IOError(msg);
  }
}

Result<std::optional<std::string_view>> ReadTxn::Get(Table t, std::string_view key) const {
  MDB_val k = Val(key), v;
  int rc = mdb_get(txn_, env_->dbi_[static_cast<int>(t)], &k, &v);
  if (rc == MDB_NOTFOUND) return std::optional<std::string_view>();
  if (rc != 0) return LmdbError(rc, "catalog read");
  return std::optional<std::string_view>(View(v));
}

Status ReadTxn::Scan(Table t, std::string_view prefix,
                     const std::function<bool(std::string_view, std::string_view)>& fn) const {
  MDB_cursor* cur;
  int rc = mdb_cursor_open(txn_, env_->dbi_[static_cast<int>(t)], &cur);
  if (rc != 0) return LmdbError(rc, "catalog cursor");
  MDB_val k = Val(prefix), v;
  rc = mdb_cursor_get(cur, &k, &v, prefix.empty() ? MDB_FIRST : MDB_SET_RANGE);
  while (rc == 0) {
    std::string_view key = View(k);
    if (key.substr(0, prefix.size()) != prefix) break;
    if (!fn(key, View(v))) break;
    rc = mdb_cursor_get(cur, &k, &v, MDB_NEXT);
  }
  mdb_cursor_close(cur);
  if (rc != 0 && rc != MDB_NOTFOUND) return LmdbError(rc, "catalog scan");
  return Status::OK();
}

uint64_t ReadTxn::Count(Table t) const {
  MDB_stat st;
  if (mdb_stat(txn_, env_->dbi_[static_cast<int>(t)], &st) != 0) return 0;
  return st.ms_entries;
}

Status WriteTxn::Put(Table t, std::string_view key, std::string_view value) {
  MDB_val k = Val(key), v = Val(value);
  int rc = mdb_put(txn_, env_->dbi_[static_cast<int>(t)], &k, &v, 0);
  if (rc != 0) return LmdbError(rc, "catalog write");
  return Status::OK();
}

Status WriteTxn::Delete(Table t, std::string_view key) {
  MDB_val k = Val(key);
  int rc = mdb_del(txn_, env_->dbi_[static_cast<int>(t)], &k, nullptr);
  if (rc != 0 && rc != MDB_NOTFOUND) return LmdbError(rc, "catalog delete");
  return Status::OK();
}

namespace {
// The environments this process has open, by (pid, device, inode) of their
// directory. LMDB must not open one environment twice in a process: the
// second open re-initialises the shared lock table under the first (both
// hold the same process's file locks), and closing either one drops the
// other's reader slots, so readers of the first fail or read garbage at
// random. The pid makes entries inherited across fork() not count.
std::mutex open_envs_mu;
std::set<std::tuple<pid_t, dev_t, ino_t>> open_envs;
}  // namespace

Result<std::unique_ptr<LmdbEnv>> LmdbEnv::Open(const std::string& dir, bool create,
                                              uint64_t initial_map_size) {
  struct stat sb;
  if (::stat(dir.c_str(), &sb) != 0) {
    if (!create) return Status::NotFound("catalog directory " + dir + " is missing");
    // Another process of this host may create it at the same moment.
    if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) return Status::FromErrno(errno, "creating " + dir);
    if (::stat(dir.c_str(), &sb) != 0) return Status::FromErrno(errno, "stat of " + dir);
  }
  std::unique_ptr<LmdbEnv> env(new LmdbEnv());
  env->dir_ = dir;
  {
    std::lock_guard lock(open_envs_mu);
    auto key = std::make_tuple(::getpid(), sb.st_dev, sb.st_ino);
    if (!open_envs.insert(key).second) {
      return Status::FailedPrecondition("catalog " + dir +
                                        " is already open in this process; share its Repository handle")
          .WithDetail(StatusDetail::kCatalogOpenInProcess);
    }
    env->open_key_ = key;
  }
  int rc = mdb_env_create(&env->env_);
  if (rc != 0) return LmdbError(rc, "creating LMDB environment");
  mdb_env_set_maxdbs(env->env_, static_cast<MDB_dbi>(Table::kCount));
  mdb_env_set_maxreaders(env->env_, 1024);
  if (create) mdb_env_set_mapsize(env->env_, initial_map_size);
  rc = mdb_env_open(env->env_, dir.c_str(), MDB_NOTLS, 0644);
  if (rc != 0) {
    mdb_env_close(env->env_);
    env->env_ = nullptr;
    return LmdbError(rc, "opening catalog " + dir);
  }
  if (!create) {
    // Adopt the size recorded in the file (0 = use the current size).
    mdb_env_set_mapsize(env->env_, 0);
  }
  MDB_txn* txn;
  rc = mdb_txn_begin(env->env_, nullptr, 0, &txn);
  if (rc != 0) return LmdbError(rc, "opening catalog tables");
  for (int i = 0; i < static_cast<int>(Table::kCount); ++i) {
    rc = mdb_dbi_open(txn, kTableNames[i], create ? MDB_CREATE : 0, &env->dbi_[i]);
    if (rc != 0) {
      mdb_txn_abort(txn);
      if (rc == MDB_NOTFOUND) return Status::Corruption("catalog " + dir + " lacks table " + kTableNames[i] + kReindexHint);
      return LmdbError(rc, std::string("opening catalog table ") + kTableNames[i]);
    }
  }
  rc = mdb_txn_commit(txn);
  if (rc != 0) return LmdbError(rc, "opening catalog tables");
  return env;
}

LmdbEnv::~LmdbEnv() {
  if (env_) mdb_env_close(env_);
  if (open_key_) {
    std::lock_guard lock(open_envs_mu);
    open_envs.erase(*open_key_);
  }
}

uint64_t LmdbEnv::map_size() const {
  MDB_envinfo info;
  mdb_env_info(env_, &info);
  return info.me_mapsize;
}

Status LmdbEnv::Grow() {
  std::unique_lock lock(resize_mu_);
  MDB_envinfo info;
  mdb_env_info(env_, &info);
  int rc = mdb_env_set_mapsize(env_, info.me_mapsize * 2);
  if (rc != 0) return LmdbError(rc, "growing the catalog map");
  return Status::OK();
}

Status LmdbEnv::AdoptSize() {
  std::unique_lock lock(resize_mu_);
  int rc = mdb_env_set_mapsize(env_, 0);
  if (rc != 0) return LmdbError(rc, "adopting the catalog map size");
  return Status::OK();
}

Status LmdbEnv::Read(const std::function<Status(const ReadTxn&)>& fn) const {
  for (int attempt = 0;; ++attempt) {
    std::shared_lock lock(resize_mu_);
    MDB_txn* txn;
    int rc = mdb_txn_begin(env_, nullptr, MDB_RDONLY, &txn);
    if (rc == MDB_MAP_RESIZED && attempt < 8) {
      lock.unlock();
      CKPT_RETURN_IF_ERROR(const_cast<LmdbEnv*>(this)->AdoptSize());
      continue;
    }
    if (rc != 0) return LmdbError(rc, "beginning a catalog read");
    ReadTxn t(this, txn);
    Status st = fn(t);
    mdb_txn_abort(txn);
    return st;
  }
}

Status LmdbEnv::Update(const std::function<Status(WriteTxn&)>& fn) {
  for (int attempt = 0;; ++attempt) {
    std::shared_lock lock(resize_mu_);
    MDB_txn* txn;
    int rc = mdb_txn_begin(env_, nullptr, 0, &txn);
    if (rc == MDB_MAP_RESIZED && attempt < 8) {
      lock.unlock();
      CKPT_RETURN_IF_ERROR(AdoptSize());
      continue;
    }
    if (rc != 0) return LmdbError(rc, "beginning a catalog update");
    WriteTxn t(this, txn);
    Status st = fn(t);
    if (st.ok()) {
      CrashPoint();
      rc = mdb_txn_commit(txn);
      if (rc == 0) {
        CrashPoint();
        return Status::OK();
      }
      st = LmdbError(rc, "committing a catalog update");
    } else {
      mdb_txn_abort(txn);
    }
    // A full map shows up as ResourceExhausted from Put or from the commit.
    const bool map_full = st.detail() == StatusDetail::kCatalogMapFull;
    if (!map_full || attempt >= 40) return st;
    lock.unlock();
    CKPT_RETURN_IF_ERROR(Grow());
  }
}

}  // namespace ckptfs
