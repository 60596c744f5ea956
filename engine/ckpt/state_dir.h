// A host's state directory for a repository on an object store: where its
// catalog (a cache of the store) and its lease and lock files live. Chosen
// from the open options, created owner-only, and claimed for one
// repository (docs/DESIGN.md "Repositories on S3").
#pragma once

#include <string>

#include "ckpt/repository.h"
#include "core/status.h"

namespace ckptfs {

// The directory where this host keeps the state of repository `id`:
// options.cache_dir, else options.cache_root/ID. FailedPrecondition when
// neither is given (a predictable shared directory such as /tmp/NAME could
// be prepared by another local user).
Result<std::string> CacheDirFor(const OpenOptions& options, const std::string& id);

// Creates `dir` and its missing parents with owner-only permissions.
// Refuses to follow a symbolic link owned by another user (root's are
// trusted) and a final directory that belongs to another user: either could
// hand this user's catalog to someone else.
Status MakePrivateDirectory(const std::string& dir);

// Makes `dir` the state directory of repository `id` at `url`: a directory
// whose `repository` file names them. A directory holding another
// repository's state is refused; one holding the state of an earlier
// repository at the same URL (recreated since) is emptied, since it is
// only a cache.
Status ClaimCacheDir(const std::string& dir, const std::string& url, const std::string& id);

}  // namespace ckptfs
