// The safetensors format: an 8-byte little-endian header length N, N bytes
// of JSON ({name: {dtype, shape, data_offsets: [begin, end]}, and an optional
// "__metadata__" object of string values}), then the data. Offsets are
// relative to the start of the data.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "core/region.h"
#include "core/status.h"
#include "io/mapped_file.h"

namespace ckptfs {

// Headers larger than this are rejected as malformed (the reference
// implementation's limit).
inline constexpr uint64_t kMaxSafetensorsHeader = 100ull << 20;
// At most this many JSON values in a header, and one per 4 bytes of it.
inline constexpr size_t kMaxSafetensorsValues = 4u << 20;

struct SafetensorsTensor {
  std::string name;
  DType dtype = DType::kU8;
  Shape shape;
  uint64_t begin = 0;  // relative to the data section
  uint64_t end = 0;
};

struct SafetensorsHeader {
  std::vector<SafetensorsTensor> tensors;  // in data order
  std::vector<std::pair<std::string, std::string>> metadata;
  uint64_t data_offset = 0;  // 8 + N
};

// Parses and validates a header against a data section of `data_size` bytes:
// known dtypes, offsets inside the data, sizes that match dtype and shape,
// no two tensors sharing bytes. InvalidArgument names what is wrong.
Result<SafetensorsHeader> ParseSafetensorsHeader(std::string_view json, uint64_t data_size);

// The sharded-safetensors convention (docs/FORMAT.md): the __metadata__ key
// "ckptfs.shards" holds a JSON object mapping tensor names to
//   {"global_shape": [..], "offsets": [..]}  a box of the global tensor, whose
//                                             lengths are the stored shape, or
//   {"global_shape": [..], "flat_start": N}  elements [N, N + len) of the
//                                             row-major global tensor, stored
//                                             as a 1-D tensor of len elements.
inline constexpr const char* kShardsMetadataKey = "ckptfs.shards";

// The files torch's HuggingFaceStorageWriter writes per rank
// (save_distributed=True: shard-0000R-model-0000K-of-0000N.safetensors)
// say where each stored tensor lies in its global tensor under this key:
//   {"NAME": {"saved_offsets": [..]}, ...}
// but not the global shape, which is the extent of all the ranks' shards.
inline constexpr const char* kDcpShardingMetadataKey = "DCP_SHARDING_INFO";

// What one stored tensor of a file contributes to a checkpoint.
struct SafetensorsShard {
  size_t tensor = 0;  // index into SafetensorsHeader::tensors
  Shape global_shape;
  Region region;      // inside global_shape (validated)
  // From DCP_SHARDING_INFO: global_shape is this shard's own extent
  // (offsets + stored shape), to be widened to the extent of every shard of
  // the tensor (WidenToExtents) once all files are read.
  bool extent_only = false;
};

// One entry per tensor of `header`, in its order: the whole tensor when the
// shard map (ckptfs.shards, else DCP_SHARDING_INFO) does not name it.
// InvalidArgument (naming the tensor) when the map is malformed, names a
// tensor the header lacks, or describes a region that does not fit its
// global shape or the stored shape.
Result<std::vector<SafetensorsShard>> ShardsOfSafetensors(const SafetensorsHeader& header);

// Sets the global shape of every extent_only shard to the extent of all
// shards of its tensor, over `files` (each file's header and its shards):
// the element-wise maximum of offset + length. InvalidArgument when shards
// of one tensor differ in rank, or one named by offsets meets one without.
Status WidenToExtents(const std::vector<const SafetensorsHeader*>& headers,
                      std::vector<std::vector<SafetensorsShard>>& files);

// A safetensors file mapped read-only into memory.
class SafetensorsFile {
 public:
  static Result<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  ~SafetensorsFile();
  const SafetensorsHeader& header() const { return header_; }
  std::span<const std::byte> Data(const SafetensorsTensor& t) const;
  const std::string& path() const { return path_; }
  // The mapping Data() points into, for sources that lend its bytes.
  const std::shared_ptr<const MappedFile>& mapping() const { return map_; }

 private:
  SafetensorsFile() = default;
  std::string path_;
  SafetensorsHeader header_;
  std::shared_ptr<const MappedFile> map_;
};

// The layout of a safetensors file for the given tensors, in order: the
// header bytes (length prefix + JSON padded with spaces to a multiple of 8)
// and each tensor's absolute offset. Used by export and by the mount, which
// serves the file without materialising it.
struct SafetensorsLayout {
  std::string header;               // bytes [0, header.size())
  std::vector<uint64_t> offsets;    // absolute, per tensor
  std::vector<uint64_t> sizes;
  uint64_t total_size = 0;
};
struct TensorMeta {
  std::string name;
  DType dtype;
  Shape shape;
};
SafetensorsLayout LayoutSafetensors(const std::vector<TensorMeta>& tensors,
                                    const std::vector<std::pair<std::string, std::string>>& metadata);
// A tensor as the header writer needs it, without copies.
struct TensorMetaRef {
  std::string_view name;
  DType dtype;
  std::span<const uint64_t> shape;
};
// The whole header of a safetensors file holding `count` tensors in file
// order (`tensor(i)` gives each): the 8-byte length, the JSON and its
// padding, exactly as LayoutSafetensors makes it, written in pieces to `out`
// (null: only counted). Returns its size. A checkpoint of millions of
// tensors can so know its header's size without holding the header.
uint64_t WriteSafetensorsHeader(size_t count, const std::function<TensorMetaRef(size_t)>& tensor,
                                const std::vector<std::pair<std::string, std::string>>& metadata,
                                const std::function<void(std::string_view)>& out);

// The header of a .npy file (format 1.0, or 2.0 for huge headers) for a
// C-order array; its length is a multiple of 64. BF16 and F8 types are
// written as unsigned integers of their width (docs/FORMAT.md).
std::string NpyHeader(DType dtype, const Shape& shape);

}  // namespace ckptfs
