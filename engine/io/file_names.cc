#include "io/file_names.h"

#include <cstdio>

#include "core/chunk_id.h"

namespace ckptfs {

std::string FileNameFor(std::string_view name, std::string_view suffix) {
  std::string out;
  for (size_t i = 0; i < name.size(); ++i) {
    unsigned char c = static_cast<unsigned char>(name[i]);
    bool dot_name = i == 0 && c == '.' && (name == "." || name == "..");
    // '~' is escaped so that only shortened names hold one.
    if (c == '%' || c == '/' || c == '~' || c < 0x20 || c == 0x7f || dot_name) {
      char buf[4];
      std::snprintf(buf, sizeof buf, "%%%02X", c);
      out += buf;
    } else {
      out.push_back(static_cast<char>(c));
    }
  }
  if (out.size() + suffix.size() > 255) {
    char hash[20];
    std::snprintf(hash, sizeof hash, "~%016llx",
                  static_cast<unsigned long long>(Checksum64(std::as_bytes(std::span(name.data(), name.size())))));
    out.resize(200);
    out += hash;
  }
  return out + std::string(suffix);
}

std::optional<std::string> UnescapeName(std::string_view escaped) {
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  std::string out;
  for (size_t i = 0; i < escaped.size(); ++i) {
    if (escaped[i] != '%') {
      out.push_back(escaped[i]);
      continue;
    }
    if (i + 2 >= escaped.size()) return std::nullopt;
    int hi = hex(escaped[i + 1]), lo = hex(escaped[i + 2]);
    if (hi < 0 || lo < 0) return std::nullopt;
    out.push_back(static_cast<char>(hi * 16 + lo));
    i += 2;
  }
  return out;
}

}  // namespace ckptfs
