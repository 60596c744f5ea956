// A repository's config, ckptfs.json (docs/FORMAT.md): made for a new
// repository, parsed and checked when one is opened (on a shared store it
// is untrusted input).
#pragma once

#include <string>

#include "ckpt/repository.h"
#include "core/json.h"
#include "core/status.h"

namespace ckptfs {

// The config of a new repository, with a fresh repository_id.
Json ConfigToJson(const RepositoryConfig& config);
// InvalidArgument naming the setting out of range.
Status ValidateConfig(const RepositoryConfig& config);
// Parses and checks a repository's config (`ckptfs.json`, untrusted on a
// shared store): `origin` names the repository and `file` the config in
// messages; `id`, when given, receives the repository_id, which must be a
// safe file name (it names this host's state directory).
Result<RepositoryConfig> ParseRepositoryConfig(const std::string& text, const std::string& origin,
                                               const std::string& file, std::string* id);
// The config of the local repository at `path`: NotFound or
// FailedPrecondition saying what `path` is instead.
Result<RepositoryConfig> ReadRepositoryConfig(const std::string& path);

}  // namespace ckptfs
