// The names a repository accepts: checkpoints, groups of them, and the
// tensors, blobs and tags inside one.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "core/status.h"

namespace ckptfs {

// Checkpoint names: 1-200 characters of [A-Za-z0-9._-], not starting with '.'.
Status ValidateCheckpointName(const std::string& name);
// Whether checkpoint `name` is in group `group` ('/'-separated prefix of its
// name: "run1/eval/step-3" is in "run1" and "run1/eval"); every name is in
// the empty group. A group given with a trailing '/' ("run1/") is the same.
bool InGroup(std::string_view name, std::string_view group);

// Tensor, blob and tag names (tag values too, which may be empty): at most
// kMaxMemberName bytes of valid UTF-8 without control characters. With the
// longest checkpoint name, a catalog key stays under LMDB's 511 bytes.
// InvalidArgument naming `kind` ("tensor name", "blob name", "tag"), the
// name (escaped) and what is wrong. PutShard, PutBlob and BeginCheckpoint
// check before any byte is written; callers importing many may check first.
inline constexpr size_t kMaxMemberName = 300;
Status ValidateMemberName(std::string_view kind, std::string_view name, bool allow_empty = false);

}  // namespace ckptfs
