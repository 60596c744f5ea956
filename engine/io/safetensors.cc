#include "io/safetensors.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <optional>

#include "core/json.h"

namespace ckptfs {

Result<SafetensorsHeader> ParseSafetensorsHeader(std::string_view json, uint64_t data_size) {
  // A real header spends far more than 4 bytes per value ("dtype":"F32"),
  // and no checkpoint has millions of tensors in one file: the bound keeps
  // a hostile header of tiny values from costing gigabytes.
  auto parsed = Json::Parse(json, std::min<size_t>(json.size() / 4 + 64, kMaxSafetensorsValues));
  if (!parsed.ok()) return Status::InvalidArgument("header is not valid JSON: " + parsed.status().message());
  if (!parsed->is_object()) return Status::InvalidArgument("header is not a JSON object");
  SafetensorsHeader h;
  for (const auto& [name, v] : parsed->as_object()) {
    if (name == "__metadata__") {
      if (!v.is_object()) return Status::InvalidArgument("__metadata__ is not an object");
      for (const auto& [k, mv] : v.as_object()) {
        if (!mv.is_string()) return Status::InvalidArgument("__metadata__ value of '" + k + "' is not a string");
        h.metadata.emplace_back(k, mv.as_string());
      }
      continue;
    }
    auto bad = [&](const std::string& what) { return Status::InvalidArgument("tensor '" + name + "': " + what); };
    if (!v.is_object()) return bad("entry is not an object");
    const Json* dtype = v.Find("dtype");
    const Json* shape = v.Find("shape");
    const Json* offsets = v.Find("data_offsets");
    if (!dtype || !dtype->is_string()) return bad("missing dtype");
    if (!shape || !shape->is_array()) return bad("missing shape");
    if (!offsets || !offsets->is_array() || offsets->as_array().size() != 2 ||
        !offsets->as_array()[0].is_uint() || !offsets->as_array()[1].is_uint()) {
      return bad("data_offsets must be two non-negative integers");
    }
    SafetensorsTensor t;
    t.name = name;
    auto dt = ParseDType(dtype->as_string());
    if (!dt) return bad("unknown dtype '" + dtype->as_string() + "'");
    t.dtype = *dt;
    for (const Json& d : shape->as_array()) {
      if (!d.is_uint()) return bad("shape must hold non-negative integers");
      t.shape.push_back(d.as_uint());
    }
    t.begin = offsets->as_array()[0].as_uint();
    t.end = offsets->as_array()[1].as_uint();
    if (t.begin > t.end) return bad("data_offsets are reversed");
    if (t.end > data_size) {
      return bad("data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) +
                 ") run past the end of the data (" + std::to_string(data_size) + " bytes; is the file truncated?)");
    }
    auto n = CheckedNumElements(t.shape);
    if (!n.ok()) return bad(n.status().message());
    if (*n > (uint64_t{1} << 62) / DTypeSize(t.dtype) || *n * DTypeSize(t.dtype) != t.end - t.begin) {
      return bad(std::string(DTypeName(t.dtype)) + " " + ShapeToString(t.shape) + " needs " +
                 std::to_string(*n * DTypeSize(t.dtype)) + " bytes but data_offsets span " +
                 std::to_string(t.end - t.begin));
    }
    h.tensors.push_back(std::move(t));
  }
  std::sort(h.tensors.begin(), h.tensors.end(), [](const auto& a, const auto& b) {
    return std::pair(a.begin, a.end) < std::pair(b.begin, b.end);
  });
  for (size_t i = 1; i < h.tensors.size(); ++i) {
    if (h.tensors[i].begin < h.tensors[i - 1].end) {
      return Status::InvalidArgument("tensors '" + h.tensors[i - 1].name + "' and '" + h.tensors[i].name +
                                     "' share bytes of the data section");
    }
  }
  return h;
}

namespace {

// Tensors by name, for O(log n) matching: a file may hold 10^5 entries.
std::vector<std::pair<std::string_view, size_t>> ByName(const SafetensorsHeader& header) {
  std::vector<std::pair<std::string_view, size_t>> by_name;
  by_name.reserve(header.tensors.size());
  for (size_t i = 0; i < header.tensors.size(); ++i) by_name.emplace_back(header.tensors[i].name, i);
  std::sort(by_name.begin(), by_name.end());
  return by_name;
}

// The index of tensor `name` in the header ByName listed, if it holds one.
std::optional<size_t> Lookup(const std::vector<std::pair<std::string_view, size_t>>& by_name, std::string_view name) {
  auto it = std::lower_bound(by_name.begin(), by_name.end(), std::pair<std::string_view, size_t>(name, 0));
  if (it == by_name.end() || it->first != name) return std::nullopt;
  return it->second;
}

// A JSON array of non-negative integers, appended to `v`; false otherwise.
bool Uints(const Json& array, std::vector<uint64_t>* v) {
  if (!array.is_array()) return false;
  for (const Json& d : array.as_array()) {
    if (!d.is_uint()) return false;
    v->push_back(d.as_uint());
  }
  return true;
}

// Why an entry of a shard map is refused.
using Refuse = std::function<Status(const std::string& what)>;

// Walks the shard map `text` (metadata key `key`): a JSON object of tensor
// names, each placed by place(spec, stored tensor, its shard, refuse).
Status PlaceShards(const SafetensorsHeader& header, const char* key, const std::string& text,
                   std::vector<SafetensorsShard>& out,
                   const std::function<Status(const Json&, const SafetensorsTensor&, SafetensorsShard&,
                                              const Refuse&)>& place) {
  auto bad = [key](const std::string& what) {
    return Status::InvalidArgument(std::string("__metadata__ \"") + key + "\": " + what);
  };
  auto j = Json::Parse(text, text.size() / 4 + 64);
  if (!j.ok()) return bad(j.status().message());
  if (!j->is_object()) return bad("is not a JSON object");
  const auto by_name = ByName(header);
  for (const auto& [name, spec] : j->as_object()) {
    const std::optional<size_t> index = Lookup(by_name, name);
    if (!index) return bad("names tensor '" + name + "', which the file does not hold");
    CKPT_RETURN_IF_ERROR(place(spec, header.tensors[*index], out[*index],
                               [&](const std::string& what) { return bad("tensor '" + name + "': " + what); }));
  }
  return Status::OK();
}

// ckptfs.shards: a box at offsets, or a flat range, of a stated global shape.
Status PlaceByShardMap(const Json& spec, const SafetensorsTensor& stored, SafetensorsShard& shard,
                       const Refuse& bad) {
  if (!spec.is_object()) return bad("entry is not an object");
  const Json* gs = spec.Find("global_shape");
  const Json* offsets = spec.Find("offsets");
  const Json* flat = spec.Find("flat_start");
  shard.global_shape.clear();
  if (!gs || !Uints(*gs, &shard.global_shape)) return bad("global_shape must be an array of non-negative integers");
  if ((offsets != nullptr) == (flat != nullptr)) return bad("needs exactly one of offsets and flat_start");
  if (offsets) {
    std::vector<uint64_t> o;
    if (!Uints(*offsets, &o)) return bad("offsets must be an array of non-negative integers");
    if (o.size() != shard.global_shape.size() || stored.shape.size() != shard.global_shape.size()) {
      return bad("offsets, global_shape and the stored shape " + ShapeToString(stored.shape) +
                 " must have the same rank");
    }
    shard.region = Region::OfBox(Box{std::move(o), stored.shape});
  } else {
    if (!flat->is_uint()) return bad("flat_start must be a non-negative integer");
    if (stored.shape.size() != 1) {
      return bad("is a flat shard but is stored with shape " + ShapeToString(stored.shape) + " (it must be 1-D)");
    }
    const uint64_t start = flat->as_uint();
    if (stored.shape[0] > UINT64_MAX - start) return bad("flat_start + length overflows");
    shard.region = Region::OfFlat(start, start + stored.shape[0]);
  }
  Status fits = ValidateRegion(shard.global_shape, shard.region);
  if (!fits.ok()) return bad(fits.message());
  return Status::OK();
}

// DCP_SHARDING_INFO: a box at its saved offsets, its global shape for now
// its own extent.
Status PlaceBySavedOffsets(const Json& spec, const SafetensorsTensor& stored, SafetensorsShard& shard,
                           const Refuse& bad) {
  const Json* offsets = spec.is_object() ? spec.Find("saved_offsets") : nullptr;
  std::vector<uint64_t> o;
  if (offsets == nullptr || !Uints(*offsets, &o)) return bad("needs saved_offsets, an array of non-negative integers");
  if (o.size() != stored.shape.size()) {
    return bad("saved_offsets " + ShapeToString(o) + " and the stored shape " + ShapeToString(stored.shape) +
               " differ in rank");
  }
  Shape extent(o.size());
  for (size_t d = 0; d < o.size(); ++d) {
    if (stored.shape[d] > UINT64_MAX - o[d]) return bad("saved_offsets + shape overflows");
    extent[d] = o[d] + stored.shape[d];
  }
  shard.global_shape = std::move(extent);
  shard.region = Region::OfBox(Box{std::move(o), stored.shape});
  shard.extent_only = true;
  return Status::OK();
}

}  // namespace

Status WidenToExtents(const std::vector<const SafetensorsHeader*>& headers,
                      std::vector<std::vector<SafetensorsShard>>& files) {
  struct Extent {
    Shape shape;
    bool by_offsets = false;
    bool plain = false;
  };
  std::map<std::string_view, Extent> extents;
  for (size_t f = 0; f < files.size(); ++f) {
    for (const SafetensorsShard& s : files[f]) {
      const std::string& name = headers[f]->tensors[s.tensor].name;
      Extent& e = extents[name];
      (s.extent_only ? e.by_offsets : e.plain) = true;
      if (!s.extent_only) continue;
      if (e.shape.empty()) e.shape.assign(s.global_shape.size(), 0);
      if (e.shape.size() != s.global_shape.size()) {
        return Status::InvalidArgument("tensor '" + name + "': its shards' saved_offsets differ in rank");
      }
      for (size_t d = 0; d < e.shape.size(); ++d) e.shape[d] = std::max(e.shape[d], s.global_shape[d]);
    }
  }
  for (const auto& [name, e] : extents) {
    if (e.by_offsets && e.plain) {
      return Status::InvalidArgument("tensor '" + std::string(name) + "': some files place it by " +
                                     kDcpShardingMetadataKey + " and others hold it whole");
    }
  }
  for (size_t f = 0; f < files.size(); ++f) {
    for (SafetensorsShard& s : files[f]) {
      if (s.extent_only) s.global_shape = extents[headers[f]->tensors[s.tensor].name].shape;
    }
  }
  return Status::OK();
}

Result<std::vector<SafetensorsShard>> ShardsOfSafetensors(const SafetensorsHeader& header) {
  std::vector<SafetensorsShard> out;
  out.reserve(header.tensors.size());
  for (size_t i = 0; i < header.tensors.size(); ++i) {
    const SafetensorsTensor& t = header.tensors[i];
    out.push_back({i, t.shape, Region::OfBox(FullBox(t.shape))});
  }
  const std::string* map_text = nullptr;
  const std::string* dcp_text = nullptr;
  for (const auto& [k, v] : header.metadata) {
    if (k == kShardsMetadataKey) map_text = &v;
    if (k == kDcpShardingMetadataKey) dcp_text = &v;
  }
  if (map_text != nullptr) {
    CKPT_RETURN_IF_ERROR(PlaceShards(header, kShardsMetadataKey, *map_text, out, PlaceByShardMap));
  } else if (dcp_text != nullptr) {
    CKPT_RETURN_IF_ERROR(PlaceShards(header, kDcpShardingMetadataKey, *dcp_text, out, PlaceBySavedOffsets));
  }
  return out;
}

Result<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  CKPT_ASSIGN_OR_RETURN(auto map, MappedFile::Open(path, /*sequential=*/true));
  const uint64_t size = map->size();
  if (size < 8) {
    return Status::InvalidArgument(path + ": too short to be a safetensors file (" + std::to_string(size) + " bytes)");
  }
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;
  f->map_ = std::move(map);
  const std::byte* data = f->map_->bytes().data();
  uint64_t n;
  std::memcpy(&n, data, 8);
  if (n > kMaxSafetensorsHeader || n > size - 8) {
    return Status::InvalidArgument(path + ": bad header length " + std::to_string(n) + " (file has " +
                                   std::to_string(size) + " bytes)");
  }
  auto header = ParseSafetensorsHeader(std::string_view(reinterpret_cast<const char*>(data) + 8, n), size - 8 - n);
  if (!header.ok()) return header.status().WithContext(path);
  f->header_ = std::move(header).value();
  f->header_.data_offset = 8 + n;
  return f;
}

SafetensorsFile::~SafetensorsFile() = default;

std::span<const std::byte> SafetensorsFile::Data(const SafetensorsTensor& t) const {
  return map_->bytes().subspan(header_.data_offset + t.begin, t.end - t.begin);
}

namespace {
// The header's JSON (compact, as Json::Dump writes it) in pieces; returns
// its length.
uint64_t WriteHeaderJson(size_t count, const std::function<TensorMetaRef(size_t)>& tensor,
                         const std::vector<std::pair<std::string, std::string>>& metadata,
                         const std::function<void(std::string_view)>& out) {
  uint64_t length = 0;
  std::string piece;
  auto emit = [&] {
    length += piece.size();
    if (out) out(piece);
    piece.clear();
  };
  piece = "{";
  if (!metadata.empty()) {
    Json m = Json::MakeObject();
    for (const auto& [k, v] : metadata) m.Set(k, v);
    piece += "\"__metadata__\":" + m.Dump();
  }
  uint64_t pos = 0;
  for (size_t i = 0; i < count; ++i) {
    const TensorMetaRef t = tensor(i);
    if (i > 0 || !metadata.empty()) piece += ',';
    piece += Json(t.name).Dump();
    piece += ":{\"dtype\":";
    piece += Json(DTypeName(t.dtype)).Dump();
    piece += ",\"shape\":[";
    uint64_t elements = 1;
    for (size_t d = 0; d < t.shape.size(); ++d) {
      if (d) piece += ',';
      piece += std::to_string(t.shape[d]);
      elements *= t.shape[d];
    }
    const uint64_t size = elements * DTypeSize(t.dtype);
    piece += "],\"data_offsets\":[" + std::to_string(pos) + "," + std::to_string(pos + size) + "]}";
    pos += size;
    emit();
  }
  piece += '}';
  emit();
  return length;
}
}  // namespace

uint64_t WriteSafetensorsHeader(size_t count, const std::function<TensorMetaRef(size_t)>& tensor,
                                const std::vector<std::pair<std::string, std::string>>& metadata,
                                const std::function<void(std::string_view)>& out) {
  const uint64_t json = WriteHeaderJson(count, tensor, metadata, nullptr);
  const uint64_t padded = (json + 7) / 8 * 8;
  if (out) {
    out(std::string_view(reinterpret_cast<const char*>(&padded), 8));
    WriteHeaderJson(count, tensor, metadata, out);
    out(std::string_view("        ", padded - json));
  }
  return 8 + padded;
}

SafetensorsLayout LayoutSafetensors(const std::vector<TensorMeta>& tensors,
                                    const std::vector<std::pair<std::string, std::string>>& metadata) {
  SafetensorsLayout layout;
  auto ref = [&](size_t i) { return TensorMetaRef{tensors[i].name, tensors[i].dtype, tensors[i].shape}; };
  WriteSafetensorsHeader(tensors.size(), ref, metadata, [&](std::string_view p) { layout.header.append(p); });
  uint64_t pos = layout.header.size();
  for (const auto& t : tensors) {
    const uint64_t size = NumElements(t.shape) * DTypeSize(t.dtype);
    layout.sizes.push_back(size);
    layout.offsets.push_back(pos);
    pos += size;
  }
  layout.total_size = pos;
  return layout;
}

std::string NpyHeader(DType dtype, const Shape& shape) {
  std::string dict = "{'descr': '" + std::string(NumpyDescr(dtype)) + "', 'fortran_order': False, 'shape': (";
  for (size_t i = 0; i < shape.size(); ++i) {
    dict += std::to_string(shape[i]);
    if (shape.size() == 1 || i + 1 < shape.size()) dict += ",";
    if (i + 1 < shape.size()) dict += " ";
  }
  dict += "), }";
  // magic(6) + version(2) + length(2 or 4) + dict + padding + '\n', total % 64 == 0
  size_t prefix = 10;
  bool v2 = false;
  size_t total = (prefix + dict.size() + 1 + 63) / 64 * 64;
  if (total - prefix > 65535) {
    v2 = true;
    prefix = 12;
    total = (prefix + dict.size() + 1 + 63) / 64 * 64;
  }
  dict.append(total - prefix - dict.size() - 1, ' ');
  dict.push_back('\n');
  std::string out = "\x93NUMPY";
  out.push_back(v2 ? 2 : 1);
  out.push_back(0);
  uint32_t len = static_cast<uint32_t>(dict.size());
  out.push_back(static_cast<char>(len & 0xff));
  out.push_back(static_cast<char>((len >> 8) & 0xff));
  if (v2) {
    out.push_back(static_cast<char>((len >> 16) & 0xff));
    out.push_back(static_cast<char>((len >> 24) & 0xff));
  }
  return out + dict;
}

}  // namespace ckptfs
