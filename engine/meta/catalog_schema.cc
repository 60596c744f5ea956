#include "meta/catalog_schema.h"

#include <cstring>

#include "core/encoding.h"

namespace ckptfs {

namespace keys {
std::string Checkpoint(const std::string& name) { return name; }
std::string MemberPrefix(const std::string& checkpoint) {
  std::string k = checkpoint;
  k.push_back('\0');
  return k;
}
std::string Rank(const std::string& checkpoint, uint32_t rank) {
  std::string k = MemberPrefix(checkpoint);
  for (int shift = 24; shift >= 0; shift -= 8) k.push_back(static_cast<char>((rank >> shift) & 0xff));
  return k;
}
std::string Member(const std::string& checkpoint, const std::string& member) {
  return MemberPrefix(checkpoint) + member;
}
std::string Chunk(const ChunkId& id) { return std::string(reinterpret_cast<const char*>(id.bytes.data()), 16); }
std::string CheckpointOfKey(std::string_view key) { return std::string(key.substr(0, key.find('\0'))); }
Result<ChunkId> ChunkIdOfKey(std::string_view key) {
  if (key.size() != 16) return Status::Corruption("chunk key of " + std::to_string(key.size()) + " bytes in the catalog");
  ChunkId id;
  for (size_t i = 0; i < 16; ++i) id.bytes[i] = static_cast<uint8_t>(key[i]);
  return id;
}
}  // namespace keys

std::string EncodePackInfo(const PackInfo& info) {
  Encoder e;
  e.U8(1);
  e.Varint(info.size);
  e.Varint(info.chunks);
  return e.Take();
}

Result<PackInfo> DecodePackInfo(std::string_view data) {
  Decoder d(data);
  uint8_t v = 0;
  CKPT_RETURN_IF_ERROR(d.U8(&v));
  if (v != 1) return Status::Corruption("pack record has unknown version");
  PackInfo info;
  CKPT_RETURN_IF_ERROR(d.Varint(&info.size));
  CKPT_RETURN_IF_ERROR(d.Varint(&info.chunks));
  if (!d.done()) return Status::Corruption("pack record has trailing bytes");
  return info;
}

namespace {

// A fixed-width little-endian integer filling the whole value.
template <typename T>
std::string EncodeFixed(T v) {
  std::string out(sizeof v, '\0');
  std::memcpy(out.data(), &v, sizeof v);
  return out;
}

template <typename T>
Result<T> DecodeFixed(std::string_view data, const char* malformed) {
  if (data.size() != sizeof(T)) return Status::Corruption(malformed);
  T v;
  std::memcpy(&v, data.data(), sizeof v);
  return v;
}

}  // namespace

std::string EncodeSequence(uint64_t next) { return EncodeFixed(next); }

Result<uint64_t> DecodeSequence(std::string_view data) {
  return DecodeFixed<uint64_t>(data, "catalog sequence counter is malformed");
}

std::string EncodeFormatVersion(uint32_t version) { return EncodeFixed(version); }

Result<uint32_t> DecodeFormatVersion(std::string_view data) {
  return DecodeFixed<uint32_t>(data, "catalog format version is malformed; run 'ckpt reindex'");
}

}  // namespace ckptfs
