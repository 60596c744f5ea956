// Names and messages as text: UTF-8 checks, escapes for terminals, and
// secrets kept out of messages.
#pragma once

#include <string>
#include <string_view>

namespace ckptfs {

// True when `s` is well-formed UTF-8 (no overlong forms, surrogates or
// code points past U+10FFFF).
bool IsValidUtf8(std::string_view s);

// True when `s` holds a control character: C0 (below U+0020), DEL, or C1
// (U+0080 to U+009F). Assumes valid UTF-8.
bool HasControlCharacter(std::string_view s);

// `s` with control characters and bytes that are not valid UTF-8 written
// as \xNN, so that no name from a file or a store can move a terminal's
// cursor or change its colours. Text without them is unchanged, so escaping
// twice changes nothing more.
std::string EscapeForTerminal(std::string_view s);

// `s` with every byte sequence that is not valid UTF-8 replaced by U+FFFD,
// so that JSON output stays valid whatever names an old repository holds.
std::string ToValidUtf8(std::string_view s);

// A URL with the password of its user information replaced:
// "https://user:secret@host/" -> "https://user:***@host/".
std::string RedactUrl(std::string_view url);

}  // namespace ckptfs
