// A small JSON value, parser and writer.
//
// Used for safetensors headers (untrusted input: the parser bounds depth and
// reports the byte offset of the first error) and for `--json` output.
// Objects keep insertion order, so output is stable.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>  // std::as_const
#include <vector>

#include "core/status.h"

namespace ckptfs {

class Json {
 public:
  enum class Type { kNull, kBool, kNumber, kString, kArray, kObject };
  using Array = std::vector<Json>;
  using Object = std::vector<std::pair<std::string, Json>>;

  Json() = default;
  Json(std::nullptr_t) {}
  Json(bool b) : type_(Type::kBool), bool_(b) {}
  Json(int v) : Json(static_cast<int64_t>(v)) {}
  Json(int64_t v);
  Json(uint64_t v);
  Json(double v);
  Json(const char* s) : type_(Type::kString), string_(s) {}
  Json(std::string s) : type_(Type::kString), string_(std::move(s)) {}
  Json(std::string_view s) : type_(Type::kString), string_(s) {}
  static Json MakeArray() { Json j; j.type_ = Type::kArray; return j; }
  static Json MakeObject() { Json j; j.type_ = Type::kObject; return j; }

  Type type() const { return type_; }
  bool is_null() const { return type_ == Type::kNull; }
  bool is_bool() const { return type_ == Type::kBool; }
  bool is_number() const { return type_ == Type::kNumber; }
  bool is_string() const { return type_ == Type::kString; }
  bool is_array() const { return type_ == Type::kArray; }
  bool is_object() const { return type_ == Type::kObject; }
  // True when the number is an integer that fits in uint64.
  bool is_uint() const { return type_ == Type::kNumber && is_uint_; }
  bool is_int() const { return type_ == Type::kNumber && (is_uint_ || is_int_); }

  bool as_bool() const { return bool_; }
  uint64_t as_uint() const { return uint_; }
  int64_t as_int() const { return is_uint_ ? static_cast<int64_t>(uint_) : int_; }
  double as_double() const { return double_; }
  const std::string& as_string() const { return string_; }
  const Array& as_array() const { return array_; }
  Array& as_array() { return array_; }
  const Object& as_object() const { return object_; }

  // Same type and value; numbers compare as the kind they were parsed or
  // built as (an integer 1 differs from the double 1.0), doubles bitwise.
  bool operator==(const Json& o) const;

  // Object access: nullptr when absent (or not an object).
  const Json* Find(std::string_view key) const;
  Json* Find(std::string_view key) { return const_cast<Json*>(std::as_const(*this).Find(key)); }
  // Sets (replacing) a key of an object.
  Json& Set(std::string key, Json value);
  // Appends a key without checking for duplicates (the caller has).
  Json& Append(std::string key, Json value) {
    object_.emplace_back(std::move(key), std::move(value));
    return object_.back().second;
  }
  // Appends to an array.
  Json& Push(Json value);

  // Compact (indent < 0) or pretty-printed.
  std::string Dump(int indent = -1) const;
  // InvalidArgument for text that is not one JSON value, nests deeper than
  // 64, or holds more than `max_values` values (each costs a node whatever
  // its text's length: bound it for untrusted input).
  static Result<Json> Parse(std::string_view text, size_t max_values = SIZE_MAX);

 private:
  void DumpTo(std::string& out, int indent, int level) const;
  Type type_ = Type::kNull;
  bool bool_ = false;
  bool is_uint_ = false;
  bool is_int_ = false;
  uint64_t uint_ = 0;
  int64_t int_ = 0;
  double double_ = 0;
  std::string string_;
  Array array_;
  Object object_;
};

// Appends `s` as a quoted JSON string.
void AppendJsonString(std::string& out, std::string_view s);

}  // namespace ckptfs
