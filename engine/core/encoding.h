// Little-endian binary encoding of catalog records and pack indexes.
//
// Encoder appends; Decoder reads and reports truncation or bad varints as
// Corruption. Layouts built with these are specified in docs/FORMAT.md.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "ckptfs's on-disk formats are little-endian and are encoded with plain copies");

namespace ckptfs {

class Encoder {
 public:
  void U8(uint8_t v) { buf_.push_back(static_cast<char>(v)); }
  void U32(uint32_t v) { Fixed(&v, 4); }
  void U64(uint64_t v) { Fixed(&v, 8); }
  void Varint(uint64_t v) {
    while (v >= 0x80) {
      buf_.push_back(static_cast<char>(v | 0x80));
      v >>= 7;
    }
    buf_.push_back(static_cast<char>(v));
  }
  void Bytes(const void* p, size_t n) { buf_.append(static_cast<const char*>(p), n); }
  // Varint length + bytes.
  void String(std::string_view s) {
    Varint(s.size());
    buf_.append(s);
  }
  const std::string& data() const { return buf_; }
  std::string Take() { return std::move(buf_); }

 private:
  void Fixed(const void* p, size_t n) { buf_.append(static_cast<const char*>(p), n); }  // x86/arm LE
  std::string buf_;
};

class Decoder {
 public:
  explicit Decoder(std::string_view data) : p_(data.data()), end_(data.data() + data.size()) {}
  Decoder(const void* p, size_t n) : Decoder(std::string_view(static_cast<const char*>(p), n)) {}

  Status U8(uint8_t* v) { return Fixed(v, 1); }
  Status U32(uint32_t* v) { return Fixed(v, 4); }
  Status U64(uint64_t* v) { return Fixed(v, 8); }
  // Only the encoder's own (shortest) form is accepted: a value has one
  // encoding, so a record that decodes re-encodes to the same bytes.
  Status Varint(uint64_t* v) {
    uint64_t r = 0;
    for (int shift = 0; shift <= 63; shift += 7) {
      if (p_ == end_) return Truncated();
      uint8_t b = static_cast<uint8_t>(*p_++);
      if (shift == 63 && b > 1) return Status::Corruption("varint overflows 64 bits");
      r |= uint64_t{b & 0x7fu} << shift;
      if (!(b & 0x80)) {
        if (b == 0 && shift > 0) return Status::Corruption("varint is not in its shortest form");
        *v = r;
        return Status::OK();
      }
    }
    return Status::Corruption("malformed varint");
  }
  Status Bytes(void* out, size_t n) { return Fixed(out, n); }
  Status String(std::string* s) {
    uint64_t n;
    CKPT_RETURN_IF_ERROR(Varint(&n));
    if (n > static_cast<uint64_t>(end_ - p_)) return Truncated();
    s->assign(p_, n);
    p_ += n;
    return Status::OK();
  }
  bool done() const { return p_ == end_; }
  size_t remaining() const { return static_cast<size_t>(end_ - p_); }

 private:
  Status Fixed(void* out, size_t n) {
    if (static_cast<size_t>(end_ - p_) < n) return Truncated();
    std::memcpy(out, p_, n);
    p_ += n;
    return Status::OK();
  }
  static Status Truncated() { return Status::Corruption("record is truncated"); }
  const char* p_;
  const char* end_;
};

}  // namespace ckptfs
