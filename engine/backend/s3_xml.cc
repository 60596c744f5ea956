#include "backend/s3_xml.h"

#include <utility>

namespace ckptfs {

std::string XmlUnescape(std::string_view s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '&') {
      out += s[i];
      continue;
    }
    static const std::pair<std::string_view, char> kEntities[] = {
        {"&amp;", '&'}, {"&lt;", '<'}, {"&gt;", '>'}, {"&quot;", '"'}, {"&apos;", '\''}};
    bool done = false;
    for (const auto& [e, c] : kEntities) {
      if (s.substr(i, e.size()) == e) {
        out += c;
        i += e.size() - 1;
        done = true;
        break;
      }
    }
    if (!done) out += '&';
  }
  return out;
}

std::vector<std::string_view> XmlAllRaw(std::string_view xml, std::string_view tag) {
  std::vector<std::string_view> out;
  const std::string open = "<" + std::string(tag) + ">", close = "</" + std::string(tag) + ">";
  size_t pos = 0;
  while ((pos = xml.find(open, pos)) != std::string_view::npos) {
    const size_t start = pos + open.size();
    const size_t end = xml.find(close, start);
    if (end == std::string_view::npos) break;
    out.push_back(xml.substr(start, end - start));
    pos = end + close.size();
  }
  return out;
}

std::vector<std::string> XmlAll(std::string_view xml, std::string_view tag) {
  std::vector<std::string> out;
  for (std::string_view raw : XmlAllRaw(xml, tag)) out.push_back(XmlUnescape(raw));
  return out;
}

std::string XmlFirst(std::string_view xml, std::string_view tag) {
  auto all = XmlAll(xml, tag);
  return all.empty() ? std::string() : all.front();
}

}  // namespace ckptfs
