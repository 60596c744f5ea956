// The object-store protocol's sync (sync.cc): brings this host's catalog up
// to date with the store, which is the truth. Owned by the protocol
// (commit_store.cc); see CommitProtocol::Sync and IndexPacks.
#pragma once

#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ckpt/commit.h"
#include "core/status.h"

namespace ckptfs {

class RepositoryImpl;

// What a checkpoints sync read from the store: its three listings and the
// manifests it fetched. One process of a job makes it (Sync with
// `capture`) and the others apply it (Sync with `given`): the store is
// listed once for the job, not once per process.
struct StoreListing {
  std::vector<std::string> pending, manifests, packs;               // object keys
  std::vector<std::string> manifest_tags;                           // manifests[i]'s (ListedObject)
  std::vector<std::pair<std::string, std::string>> manifest_objects;  // checkpoint name, object bytes
  // Indexes of listed packs the sharer read (ShareSync with indexes): a
  // host applying the listing records these instead of reading them.
  std::vector<SealedPack> pack_indexes;
};
std::string EncodeStoreListing(const StoreListing& listing);
// Corruption when `data` is not what EncodeStoreListing wrote.
Result<StoreListing> DecodeStoreListing(std::string_view data);

class StoreSync {
 public:
  explicit StoreSync(RepositoryImpl& repo) : repo_(repo) {}
  // With `capture` (a checkpoints sync only), what was listed and fetched
  // is kept there. With `given`, its listings are used instead of LISTs,
  // and its manifest objects instead of GETs; a manifest the catalog lacks
  // that `given` does not hold is read from the store. The known state is
  // read when this runs, after `given` was listed: an object this host
  // recorded in between looks removed and leaves the catalog until the
  // next sync of this host lists it again (the store is not touched).
  Result<SyncReport> Sync(SyncScope scope, StoreListing* capture = nullptr, const StoreListing* given = nullptr);
  // With `captured`, the indexes read are also appended there.
  Status IndexPacks(std::vector<SealedPack>* captured = nullptr);

 private:
  RepositoryImpl& repo_;
  std::mutex mu_;  // one sync at a time
  // Packs listed by the last sync whose indexes are not in the catalog yet
  // (guarded by mu_).
  std::vector<std::string> unindexed_packs_;
};

}  // namespace ckptfs
