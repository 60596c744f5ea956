// Where everything of a repository lies: one module names every file of a
// repository directory or a host's state directory and every object of a
// store (docs/FORMAT.md). The catalog's own keys are meta/catalog_schema.h's.
//
// A repository directory (local) or a store prefix (S3: s3://BUCKET/PREFIX):
//   ckptfs.json          config: format version, chunk size, codec settings
//   catalog/             LMDB catalog (local; on S3 each host's is in its
//                        state directory)
//   objects/packs/       pack files
//   objects/manifests/   one manifest object per committed checkpoint
//   objects/retired/     removed checkpoints kept for their readers
//   objects/pending/     (stores) ranks of checkpoints not yet visible
//   objects/locks/       (stores) lock objects
//   objects/leases/      (stores) read leases, one per host and checkpoint
// A state directory (the repository directory, or a host's cache directory
// for a store): catalog/, leases/ (flock files), gc.lock, gc-run.lock, and
// for a store `repository` (its id and URL) and host-id.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "store/pack.h"

namespace ckptfs {
namespace keys {

// ---- files of a repository directory and of a state directory ----
inline constexpr const char* kConfigFile = "ckptfs.json";
inline constexpr const char* kCatalogDir = "catalog";
inline constexpr const char* kObjectsDir = "objects";
inline constexpr const char* kLeaseFilesDir = "leases";
inline constexpr const char* kGcLockFile = "gc.lock";
inline constexpr const char* kGcRunLockFile = "gc-run.lock";
inline constexpr const char* kDrainLockFile = "drain.lock";
inline constexpr const char* kRepositoryMarkerFile = "repository";
inline constexpr const char* kHostIdFile = "host-id";

// ---- objects, relative to objects/ ----
inline constexpr const char* kLockPrefix = "locks/";
std::string ManifestObject(const std::string& checkpoint);
bool ParseManifestObject(const std::string& key, std::string* checkpoint);
inline constexpr const char* kManifestPrefix = "manifests/";
inline constexpr const char* kPackPrefix = kPackKeyPrefix;  // PackKey() (store/pack.h) names each pack
// Object-store repositories: a rank's part of a checkpoint not yet visible.
inline constexpr const char* kPendingPrefix = "pending/";
std::string PendingPrefix(const std::string& checkpoint);  // "pending/NAME/"
// Whether `key` is one of checkpoint NAME's own pending objects: a listing
// of PendingPrefix(NAME) also holds those of checkpoints in group NAME
// ("pending/NAME/step-1/rank-0").
bool IsPendingObjectOf(std::string_view key, const std::string& checkpoint);
std::string PendingRankObject(const std::string& checkpoint, uint32_t rank);
// Written (if absent) by the one rank that commits a checkpoint on an object store.
std::string CommitClaimObject(const std::string& checkpoint);  // "pending/NAME/commit"
bool ParsePendingRankObject(const std::string& key, std::string* checkpoint, uint32_t* rank);
// Written by each rank of an object-store repository when it begins a save
// ("pending/NAME/started-R": JSON host, pid, started_unix_ms), so a
// pending checkpoint can say where its ranks run; deleted with the rank
// objects, or by the rank when it gives its save up.
std::string StartedRankObject(const std::string& checkpoint, uint32_t rank);
bool ParseStartedRankObject(const std::string& key, const std::string& checkpoint, uint32_t* rank);

// Removed checkpoints kept for their readers, and read leases (lease.h).
inline constexpr const char* kRetiredPrefix = "retired/";
inline constexpr const char* kLeasePrefix = "leases/";
// The catalog name of a retired checkpoint: "NAME/TOKEN" (a live name's last
// part is never digits only when it has groups, so it never collides with
// a live one; the last '/' separates the token).
std::string RetiredCheckpoint(const std::string& name, uint64_t token);
bool IsRetiredCheckpoint(std::string_view catalog_name);
// NAME of "NAME/TOKEN" (the name itself when not retired).
std::string BaseName(std::string_view catalog_name);
// "retired/NAME/TOKEN.manifest" for a catalog name "NAME/TOKEN".
std::string RetiredObject(const std::string& catalog_name);
// The catalog name a retired/ object key holds, or false for foreign keys.
bool ParseRetiredObject(const std::string& key, std::string* catalog_name);
// A save that replaces checkpoint NAME (WriterOptions::overwrite) is saved
// under the catalog and object name "NAME~" ('~' is not allowed in
// checkpoint names) and renamed to NAME once committed; listings hide it.
std::string ReplacementCheckpoint(const std::string& name);
bool IsReplacementCheckpoint(std::string_view catalog_name);
// NAME of "NAME~" (the name itself otherwise).
std::string ReplacedName(std::string_view catalog_name);
// A name objects may carry: a checkpoint name, or a replacement's.
bool IsStoredCheckpointName(const std::string& name);
std::string LeaseObject(const std::string& name, const std::string& host);
bool ParseLeaseObject(const std::string& key, std::string* name, std::string* host);

}  // namespace keys
}  // namespace ckptfs
