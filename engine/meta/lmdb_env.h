// RAII wrapper of an LMDB environment and its transactions.
//
// Honours lmdb.h: one environment per process and path (the Repository owns
// it); values are valid only inside their transaction (the wrapper hands out
// string_views that callers copy before the callback returns); a write
// transaction runs on the calling thread. Read transactions use MDB_NOTLS, so
// any thread may hold several. The map grows (doubling) when a write hits
// MDB_MAP_FULL, and adopts a size another process set (MDB_MAP_RESIZED).
//
// Thread safety: Read and Update may be called concurrently from any thread.
// Do not call Update from inside a Read or Update callback on the same thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <sys/types.h>

#include <optional>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <tuple>


#include "core/status.h"

typedef struct MDB_env MDB_env;
typedef struct MDB_txn MDB_txn;
typedef unsigned int MDB_dbi;

namespace ckptfs {

// The named databases of the catalog (docs/FORMAT.md).
enum class Table : int {
  kMeta = 0,
  kCheckpoints,
  kRanks,
  kTensors,
  kBlobs,
  kChunks,
  kPacks,
  kCount,
};

class LmdbEnv;

class ReadTxn {
 public:
  // nullopt when absent. The view is valid until the callback returns.
  Result<std::optional<std::string_view>> Get(Table t, std::string_view key) const;
  // Calls fn(key, value) for keys starting with `prefix`, in key order,
  // until fn returns false.
  Status Scan(Table t, std::string_view prefix,
              const std::function<bool(std::string_view, std::string_view)>& fn) const;
  uint64_t Count(Table t) const;

 protected:
  ReadTxn(const LmdbEnv* env, MDB_txn* txn) : env_(env), txn_(txn) {}
  friend class LmdbEnv;
  const LmdbEnv* env_;
  MDB_txn* txn_;
};

class WriteTxn : public ReadTxn {
 public:
  Status Put(Table t, std::string_view key, std::string_view value);
  // OK when the key was absent too.
  Status Delete(Table t, std::string_view key);

 private:
  using ReadTxn::ReadTxn;
  friend class LmdbEnv;
};

class LmdbEnv {
 public:
  // Opens (creating when `create`) the environment in directory `dir`. The
  // map size applies at creation; an existing environment keeps its own.
  // FailedPrecondition when this process already has `dir` open (LMDB
  // forbids two environments of one database in one process).
  static Result<std::unique_ptr<LmdbEnv>> Open(const std::string& dir, bool create,
                                               uint64_t initial_map_size);
  ~LmdbEnv();

  // Runs fn in a short read transaction.
  Status Read(const std::function<Status(const ReadTxn&)>& fn) const;
  // Runs fn in a write transaction and commits when it returns OK; aborts
  // otherwise. fn may run more than once (after the map grew), so it must
  // not have effects outside the transaction that a retry would repeat.
  Status Update(const std::function<Status(WriteTxn&)>& fn);

  uint64_t map_size() const;
  const std::string& dir() const { return dir_; }

 private:
  friend class ReadTxn;
  friend class WriteTxn;
  LmdbEnv() = default;
  Status Grow();
  Status AdoptSize();

  std::string dir_;
  MDB_env* env_ = nullptr;
  std::optional<std::tuple<pid_t, dev_t, ino_t>> open_key_;  // in the open-environments registry
  MDB_dbi dbi_[static_cast<int>(Table::kCount)] = {};
  // Held shared by every transaction of this process, exclusively while
  // the map is resized (LMDB forbids resizing with transactions open).
  mutable std::shared_mutex resize_mu_;
};

Status LmdbError(int rc, std::string_view context);
// What every catalog corruption error ends with: how to recover.
inline constexpr const char* kReindexHint =
    " (the catalog is damaged; rebuild it from the packs and manifests with 'ckpt reindex')";

}  // namespace ckptfs
