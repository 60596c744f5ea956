// Object stores named by URL: SCHEME://REST, with a registry of schemes
// (as restic's backend locations and TensorStore's URL schemes). "s3" is
// built in; a program may register more. Anything without "SCHEME://" is a
// local path, which the repository opens itself (it keeps its catalog
// beside the objects). Code above backend/ opens stores only through this
// header, so it never names a protocol.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "backend/backend.h"
#include "backend/store_options.h"
#include "core/status.h"

namespace ckptfs {

// Opens the store a URL of its scheme names; with `create`, first creates
// what holds it when missing (an S3 bucket). InvalidArgument for a URL it
// cannot parse.
using StoreOpener = std::function<Result<std::unique_ptr<Backend>>(const std::string& url,
                                                                     const ObjectStoreOptions& options, bool create)>;

// Registers (or replaces) the opener of `scheme` ("s3", lower case).
// Thread-safe.
void RegisterStoreScheme(const std::string& scheme, StoreOpener opener);

// The scheme of "SCHEME://...", lower-cased; empty for a local path.
std::string StoreScheme(std::string_view url);

// True when `url` is SCHEME://... (registered or not): not a local path.
bool IsObjectStoreUrl(std::string_view url);

// Opens the store `url` names. InvalidArgument naming the scheme when no
// store is registered for it.
Result<std::unique_ptr<Backend>> OpenObjectStore(const std::string& url, const ObjectStoreOptions& options,
                                                 bool create = false);

// The URL of `name` under `url`'s location: ("s3://b/p", "objects") ->
// "s3://b/p/objects".
std::string ObjectStoreChild(std::string_view url, std::string_view name);

// The registered schemes, sorted (for messages).
std::vector<std::string> StoreSchemes();

}  // namespace ckptfs
