// Catalog records: what a checkpoint is made of. Their binary encodings are
// stored in LMDB and in manifest objects; docs/FORMAT.md specifies them.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/chunk_id.h"
#include "core/dtype.h"
#include "core/region.h"
#include "core/status.h"
#include "store/chunk_ref.h"
#include "store/pack.h"

namespace ckptfs {

// One stored shard: a region of the tensor (normalised: contiguous boxes are
// flat ranges) and the chunks of its row-major byte stream.
struct ShardRecord {
  Region region;
  std::vector<uint32_t> ranks;  // every rank that wrote these bytes (replicas)
  std::vector<ChunkRef> chunks;
  // Byte offset of each chunk in the shard's stream, plus the total at the
  // end; derived, not stored. Filled by ComputeStarts() (decoders call it).
  std::vector<uint64_t> starts;
  void ComputeStarts();
  uint64_t ByteSize() const { return starts.empty() ? 0 : starts.back(); }
};

struct TensorRecord {
  std::string name;
  DType dtype = DType::kU8;
  Shape shape;
  std::vector<ShardRecord> shards;
  uint64_t ByteSize() const { return NumElements(shape) * DTypeSize(dtype); }
};

struct BlobRecord {
  std::string name;
  uint64_t size = 0;
  std::vector<ChunkRef> chunks;
};

enum class CheckpointState : uint8_t { kPending = 0, kCommitted = 1 };

inline constexpr size_t kMaxAttemptSize = 64;
// A save attempt as records keep it: at most kMaxAttemptSize bytes, each
// printable ASCII other than the space (empty: none).
bool IsValidSaveAttempt(std::string_view attempt);

struct CheckpointRecord {
  std::string name;
  std::optional<int64_t> step;
  uint32_t world_size = 1;
  CheckpointState state = CheckpointState::kPending;
  std::vector<uint32_t> committed_ranks;  // sorted
  uint64_t created_unix_ms = 0;
  uint64_t committed_unix_ms = 0;
  uint64_t sequence = 0;  // commit order within the repository, from 1
  std::vector<std::pair<std::string, std::string>> tags;
  uint64_t tensor_count = 0;
  uint64_t logical_bytes = 0;  // tensors + blobs, as written by the ranks (unique shards)
  // A pending checkpoint's save attempt (WriterOptions::attempt): every rank
  // of one save gives the same, and a newer one abandons an older one's
  // ranks. Empty for a save that gave none, and once committed.
  std::string attempt;
};

// What one rank contributed, kept until the last rank commits.
struct RankRecord {
  uint32_t rank = 0;
  std::vector<TensorRecord> tensors;
  std::vector<BlobRecord> blobs;
};

// A committed checkpoint, whole: the content of its manifest object.
struct Manifest {
  CheckpointRecord checkpoint;
  std::vector<TensorRecord> tensors;
  std::vector<BlobRecord> blobs;
};

// Internal consistency of records, checked by every decoder below before a
// record is returned, so no reader ever plans a copy from a record that
// cannot hold what it claims. Corruption names what is wrong:
//   tensor: its element count and byte size fit in 2^63; every shard's
//     region lies inside the tensor (box ranks agree with the shape); every
//     chunk has 1 to kMaxChunkSize bytes; a shard's chunks hold exactly its
//     region's bytes;
//   blob: its chunks hold exactly `size` bytes, each 1 to kMaxChunkSize;
//   checkpoint: world size >= 1; committed ranks strictly increasing and
//     below the world size; a committed checkpoint has every rank and no
//     attempt; an attempt has at most kMaxAttemptSize printable bytes.
// Tiling (shards covering the tensor, overlaps agreeing) needs the chunks'
// bytes and is checked at commit and by verify, not here.
Status ValidateTensorRecord(const TensorRecord& t);
Status ValidateBlobRecord(const BlobRecord& b);
Status ValidateCheckpointRecord(const CheckpointRecord& c);

// What tells a committed checkpoint from another of the same name (one
// removed and saved again): when it was created and committed, by how many
// ranks. Equal for the same checkpoint read from any host's catalog.
std::string CheckpointIdentity(const CheckpointRecord& c);

std::string EncodeCheckpoint(const CheckpointRecord& r);
Result<CheckpointRecord> DecodeCheckpoint(std::string_view data);
std::string EncodeTensor(const TensorRecord& r);
Result<TensorRecord> DecodeTensor(std::string_view data);
std::string EncodeBlob(const BlobRecord& r);
Result<BlobRecord> DecodeBlob(std::string_view data);
std::string EncodeRank(const RankRecord& r);
Result<RankRecord> DecodeRank(std::string_view data);
std::string EncodeChunkLocation(const ChunkLocation& loc);
Result<ChunkLocation> DecodeChunkLocation(std::string_view data);
// Manifest objects carry a magic, a version and a checksum around the records.
std::string EncodeManifest(const Manifest& m);
Result<Manifest> DecodeManifest(std::string_view data);

}  // namespace ckptfs
