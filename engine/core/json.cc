#include "core/json.h"

#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <unordered_set>

#include "core/text.h"

namespace ckptfs {

Json::Json(int64_t v) : type_(Type::kNumber), double_(static_cast<double>(v)) {
  if (v >= 0) {
    is_uint_ = true;
    uint_ = static_cast<uint64_t>(v);
  } else {
    is_int_ = true;
    int_ = v;
  }
}
Json::Json(uint64_t v) : type_(Type::kNumber), is_uint_(true), uint_(v), double_(static_cast<double>(v)) {}
Json::Json(double v) : type_(Type::kNumber), double_(v) {}

bool Json::operator==(const Json& o) const {
  if (type_ != o.type_) return false;
  switch (type_) {
    case Type::kNull: return true;
    case Type::kBool: return bool_ == o.bool_;
    case Type::kNumber:
      if (is_uint_ != o.is_uint_ || is_int_ != o.is_int_) return false;
      if (is_uint_) return uint_ == o.uint_;
      if (is_int_) return int_ == o.int_;
      return std::memcmp(&double_, &o.double_, sizeof double_) == 0;  // tells -0.0 from 0.0
    case Type::kString: return string_ == o.string_;
    case Type::kArray: return array_ == o.array_;
    case Type::kObject: return object_ == o.object_;
  }
  return false;
}

const Json* Json::Find(std::string_view key) const {
  if (type_ != Type::kObject) return nullptr;
  for (const auto& [k, v] : object_) {
    if (k == key) return &v;
  }
  return nullptr;
}

Json& Json::Set(std::string key, Json value) {
  for (auto& [k, v] : object_) {
    if (k == key) {
      v = std::move(value);
      return v;
    }
  }
  object_.emplace_back(std::move(key), std::move(value));
  return object_.back().second;
}

Json& Json::Push(Json value) {
  array_.push_back(std::move(value));
  return array_.back();
}

void AppendJsonString(std::string& out, std::string_view s) {
  // JSON text is UTF-8: a name that is not (an old repository's) is written
  // with U+FFFD in place of its bad bytes rather than as invalid JSON.
  std::string fixed;
  if (!IsValidUtf8(s)) {
    fixed = ToValidUtf8(s);
    s = fixed;
  }
  out.push_back('"');
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out.push_back(static_cast<char>(c));
        }
    }
  }
  out.push_back('"');
}

std::string Json::Dump(int indent) const {
  std::string out;
  DumpTo(out, indent, 0);
  return out;
}

void Json::DumpTo(std::string& out, int indent, int level) const {
  auto newline = [&](int lvl) {
    if (indent < 0) return;
    out.push_back('\n');
    out.append(static_cast<size_t>(indent * lvl), ' ');
  };
  switch (type_) {
    case Type::kNull: out += "null"; break;
    case Type::kBool: out += bool_ ? "true" : "false"; break;
    case Type::kNumber:
      if (is_uint_) {
        out += std::to_string(uint_);
      } else if (is_int_) {
        out += std::to_string(int_);
      } else if (!std::isfinite(double_)) {
        out += "null";
      } else {
        // Shortest form that reads back as the same double, whatever the
        // locale; always with a '.' or an exponent, so it parses back as a
        // double and not as an integer ("-0.0", "3.0").
        char buf[64];
        auto [end, ec] = std::to_chars(buf, buf + sizeof buf, double_);
        std::string_view text(buf, ec == std::errc() ? static_cast<size_t>(end - buf) : 0);
        out += text;
        if (text.find_first_of(".e") == std::string_view::npos) out += ".0";
      }
      break;
    case Type::kString: AppendJsonString(out, string_); break;
    case Type::kArray:
      out.push_back('[');
      for (size_t i = 0; i < array_.size(); ++i) {
        if (i) out.push_back(',');
        newline(level + 1);
        array_[i].DumpTo(out, indent, level + 1);
      }
      if (!array_.empty()) newline(level);
      out.push_back(']');
      break;
    case Type::kObject:
      out.push_back('{');
      for (size_t i = 0; i < object_.size(); ++i) {
        if (i) out.push_back(',');
        newline(level + 1);
        AppendJsonString(out, object_[i].first);
        out += indent < 0 ? ":" : ": ";
        object_[i].second.DumpTo(out, indent, level + 1);
      }
      if (!object_.empty()) newline(level);
      out.push_back('}');
      break;
  }
}

namespace {

class Parser {
 public:
  Parser(std::string_view s, size_t max_values) : s_(s), values_left_(max_values) {}

  Result<Json> ParseDocument() {
    Json v;
    CKPT_RETURN_IF_ERROR(ParseValue(v, 0));
    SkipSpace();
    if (pos_ != s_.size()) return Error("unexpected trailing characters");
    return v;
  }

 private:
  static constexpr int kMaxDepth = 64;

  Status Error(const std::string& what) const {
    return Status::InvalidArgument("invalid JSON at byte " + std::to_string(pos_) + ": " + what);
  }
  void SkipSpace() {
    while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\n' || s_[pos_] == '\r' || s_[pos_] == '\t')) ++pos_;
  }
  bool Consume(std::string_view lit) {
    if (s_.substr(pos_, lit.size()) == lit) {
      pos_ += lit.size();
      return true;
    }
    return false;
  }

  Status ParseValue(Json& out, int depth) {
    if (depth > kMaxDepth) return Error("nesting too deep");
    // Each value costs a node of about a hundred bytes whatever its text:
    // "[0,0,0,...]" would cost fifty times its size.
    if (values_left_ == 0) return Error("more values than such a document may hold");
    --values_left_;
    SkipSpace();
    if (pos_ >= s_.size()) return Error("unexpected end");
    char c = s_[pos_];
    if (c == '{') return ParseObject(out, depth);
    if (c == '[') return ParseArray(out, depth);
    if (c == '"') {
      std::string str;
      CKPT_RETURN_IF_ERROR(ParseString(str));
      out = Json(std::move(str));
      return Status::OK();
    }
    if (Consume("true")) { out = Json(true); return Status::OK(); }
    if (Consume("false")) { out = Json(false); return Status::OK(); }
    if (Consume("null")) { out = Json(); return Status::OK(); }
    if (c == '-' || (c >= '0' && c <= '9')) return ParseNumber(out);
    return Error(std::string("unexpected character '") + c + "'");
  }

  // The power of ten of a well-formed number's first non-zero digit
  // ("123" -> 2, "0.05" -> -2, "1e400" -> 400), saturating; a zero gives a
  // large negative value.
  static int64_t DecimalExponent(const char* first, const char* last) {
    constexpr int64_t kLimit = int64_t{1} << 40;
    std::string_view text(first, static_cast<size_t>(last - first));
    if (!text.empty() && text[0] == '-') text.remove_prefix(1);
    const size_t e = std::min(text.find_first_of("eE"), text.size());
    const std::string_view mantissa = text.substr(0, e);
    const size_t point = std::min(mantissa.find('.'), mantissa.size());
    const std::string_view int_part = mantissa.substr(0, point);
    const std::string_view frac_part = point < mantissa.size() ? mantissa.substr(point + 1) : std::string_view();
    int64_t position;
    if (size_t i = int_part.find_first_not_of('0'); i != std::string_view::npos) {
      position = static_cast<int64_t>(int_part.size() - 1 - i);
    } else if (size_t j = frac_part.find_first_not_of('0'); j != std::string_view::npos) {
      position = -static_cast<int64_t>(j + 1);
    } else {
      return -kLimit;
    }
    int64_t exponent = 0;
    if (e < text.size()) {
      std::string_view digits = text.substr(e + 1);
      const bool negative = !digits.empty() && digits[0] == '-';
      if (!digits.empty() && (digits[0] == '+' || digits[0] == '-')) digits.remove_prefix(1);
      for (char c : digits) exponent = std::min(kLimit, exponent * 10 + (c - '0'));
      if (negative) exponent = -exponent;
    }
    return position + exponent;
  }

  // RFC 8259 numbers: -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?, converted
  // with std::from_chars (independent of the locale). Integers that fit are
  // kept exact; "-0" is the double -0.0; a number beyond the range of a
  // double is an error, so every parsed number is finite.
  Status ParseNumber(Json& out) {
    const size_t start = pos_;
    auto digits = [&] {
      size_t from = pos_;
      while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_;
      return pos_ - from;
    };
    bool neg = false, is_integer = true;
    if (s_[pos_] == '-') { neg = true; ++pos_; }
    const size_t int_start = pos_;
    const size_t int_digits = digits();
    if (int_digits == 0) return Error("malformed number");
    if (int_digits > 1 && s_[int_start] == '0') return Error("number with a leading zero");
    if (pos_ < s_.size() && s_[pos_] == '.') {
      is_integer = false;
      ++pos_;
      if (digits() == 0) return Error("malformed number");
    }
    if (pos_ < s_.size() && (s_[pos_] == 'e' || s_[pos_] == 'E')) {
      is_integer = false;
      ++pos_;
      if (pos_ < s_.size() && (s_[pos_] == '+' || s_[pos_] == '-')) ++pos_;
      if (digits() == 0) return Error("malformed number");
    }
    const char* first = s_.data() + start;
    const char* last = s_.data() + pos_;
    if (is_integer && !(neg && int_digits == 1 && s_[int_start] == '0')) {
      if (neg) {
        int64_t v = 0;
        auto [p, ec] = std::from_chars(first, last, v);
        if (ec == std::errc() && p == last) { out = Json(v); return Status::OK(); }
      } else {
        uint64_t v = 0;
        auto [p, ec] = std::from_chars(first, last, v);
        if (ec == std::errc() && p == last) { out = Json(v); return Status::OK(); }
      }
    }
    double d = 0;
    auto [p, ec] = std::from_chars(first, last, d);
    if (ec == std::errc::result_out_of_range) {
      // Too large is an error (no finite value); too small is a zero.
      if (DecimalExponent(first, last) > 0) return Error("number out of range");
      d = neg ? -0.0 : 0.0;
    } else if (ec != std::errc() || p != last) {
      return Error("malformed number");
    }
    out = Json(d);
    return Status::OK();
  }

  static void AppendUtf8(std::string& out, uint32_t cp) {
    if (cp < 0x80) {
      out.push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
      out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
      out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else if (cp < 0x10000) {
      out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
      out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else {
      out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
      out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
  }

  Status ParseHex4(uint32_t* v) {
    if (pos_ + 4 > s_.size()) return Error("truncated \\u escape");
    uint32_t r = 0;
    for (int i = 0; i < 4; ++i) {
      char c = s_[pos_++];
      r <<= 4;
      if (c >= '0' && c <= '9') r |= c - '0';
      else if (c >= 'a' && c <= 'f') r |= c - 'a' + 10;
      else if (c >= 'A' && c <= 'F') r |= c - 'A' + 10;
      else return Error("bad \\u escape");
    }
    *v = r;
    return Status::OK();
  }

  Status ParseString(std::string& out) {
    ++pos_;  // opening quote
    while (true) {
      if (pos_ >= s_.size()) return Error("unterminated string");
      char c = s_[pos_++];
      if (c == '"') {
        // Dump writes only valid UTF-8: what it could not write back is refused.
        if (!IsValidUtf8(out)) return Error("string is not valid UTF-8");
        return Status::OK();
      }
      if (static_cast<unsigned char>(c) < 0x20) return Error("control character in string");
      if (c != '\\') {
        out.push_back(c);
        continue;
      }
      if (pos_ >= s_.size()) return Error("unterminated escape");
      char e = s_[pos_++];
      switch (e) {
        case '"': out.push_back('"'); break;
        case '\\': out.push_back('\\'); break;
        case '/': out.push_back('/'); break;
        case 'b': out.push_back('\b'); break;
        case 'f': out.push_back('\f'); break;
        case 'n': out.push_back('\n'); break;
        case 'r': out.push_back('\r'); break;
        case 't': out.push_back('\t'); break;
        case 'u': {
          uint32_t cp = 0;
          CKPT_RETURN_IF_ERROR(ParseHex4(&cp));
          if (cp >= 0xD800 && cp < 0xDC00) {
            uint32_t lo = 0;
            if (!Consume("\\u")) return Error("unpaired surrogate");
            CKPT_RETURN_IF_ERROR(ParseHex4(&lo));
            if (lo < 0xDC00 || lo >= 0xE000) return Error("unpaired surrogate");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          } else if (cp >= 0xDC00 && cp < 0xE000) {
            return Error("unpaired surrogate");
          }
          AppendUtf8(out, cp);
          break;
        }
        default: return Error("bad escape");
      }
    }
  }

  Status ParseArray(Json& out, int depth) {
    ++pos_;
    out = Json::MakeArray();
    SkipSpace();
    if (pos_ < s_.size() && s_[pos_] == ']') { ++pos_; return Status::OK(); }
    while (true) {
      Json v;
      CKPT_RETURN_IF_ERROR(ParseValue(v, depth + 1));
      out.Push(std::move(v));
      SkipSpace();
      if (pos_ >= s_.size()) return Error("unterminated array");
      if (s_[pos_] == ',') { ++pos_; continue; }
      if (s_[pos_] == ']') { ++pos_; return Status::OK(); }
      return Error("expected ',' or ']'");
    }
  }

  Status ParseObject(Json& out, int depth) {
    ++pos_;
    out = Json::MakeObject();
    SkipSpace();
    if (pos_ < s_.size() && s_[pos_] == '}') { ++pos_; return Status::OK(); }
    std::unordered_set<std::string> seen;
    while (true) {
      SkipSpace();
      if (pos_ >= s_.size() || s_[pos_] != '"') return Error("expected a string key");
      std::string key;
      CKPT_RETURN_IF_ERROR(ParseString(key));
      SkipSpace();
      if (pos_ >= s_.size() || s_[pos_] != ':') return Error("expected ':'");
      ++pos_;
      Json v;
      CKPT_RETURN_IF_ERROR(ParseValue(v, depth + 1));
      if (!seen.insert(key).second) return Error("duplicate key \"" + key + "\"");
      out.Append(std::move(key), std::move(v));
      SkipSpace();
      if (pos_ >= s_.size()) return Error("unterminated object");
      if (s_[pos_] == ',') { ++pos_; continue; }
      if (s_[pos_] == '}') { ++pos_; return Status::OK(); }
      return Error("expected ',' or '}'");
    }
  }

  std::string_view s_;
  size_t pos_ = 0;
  size_t values_left_;
};

}  // namespace

Result<Json> Json::Parse(std::string_view text, size_t max_values) {
  return Parser(text, max_values).ParseDocument();
}

}  // namespace ckptfs
