// The few pieces of S3's XML answers ckptfs reads (keys, tokens, markers,
// upload ids, error codes). S3's answers are flat enough that no real XML
// parser is needed; what the server sends is untrusted, so these never read
// past their input and their output is at most as long as it (a fuzz
// target checks both).
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace ckptfs {

// `s` with the five predefined XML entities replaced; any other '&' stays.
std::string XmlUnescape(std::string_view s);
// The unescaped text of every <tag>...</tag> in `xml`, in order.
std::vector<std::string> XmlAll(std::string_view xml, std::string_view tag);
// The same, as it stands in `xml` (not unescaped): the elements of an
// element, read with XmlFirst, are unescaped once.
std::vector<std::string_view> XmlAllRaw(std::string_view xml, std::string_view tag);
// The first of them, or "" when there is none.
std::string XmlFirst(std::string_view xml, std::string_view tag);

}  // namespace ckptfs
