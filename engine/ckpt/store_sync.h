// The object-store protocol's sync (sync.cc): brings this host's catalog up
// to date with the store, which is the truth. Owned by the protocol
// (commit_store.cc); see CommitProtocol::Sync and IndexPacks.
#pragma once

#include <mutex>
#include <string>
#include <vector>

#include "ckpt/commit.h"
#include "core/status.h"

namespace ckptfs {

class RepositoryImpl;

class StoreSync {
 public:
  explicit StoreSync(RepositoryImpl& repo) : repo_(repo) {}
  Result<SyncReport> Sync(SyncScope scope);
  Status IndexPacks();

 private:
  RepositoryImpl& repo_;
  std::mutex mu_;  // one sync at a time
  // Packs listed by the last sync whose indexes are not in the catalog yet
  // (guarded by mu_).
  std::vector<std::string> unindexed_packs_;
};

}  // namespace ckptfs
