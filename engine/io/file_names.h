// File names of a checkpoint's files (the mount, export): tensor and blob
// names escaped reversibly.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace ckptfs {

// '%' -> "%25", '/' -> "%2F", '~' -> "%7E", bytes below 0x20 and 0x7F ->
// "%XX"; a name
// that is "." or ".." has its first '.' written "%2E". Names whose escaped
// form (plus `suffix`) would exceed 255 bytes keep their first 200 bytes,
// then '~' and 16 hex digits of a hash: unique but not reversible; the
// true name is in the file's user.ckptfs.name attribute.
std::string FileNameFor(std::string_view name, std::string_view suffix);
// Inverse of the escaping (not of the shortening); nullopt if malformed.
std::optional<std::string> UnescapeName(std::string_view escaped);

}  // namespace ckptfs
