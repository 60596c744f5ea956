// The LMDB catalog's schema: the key of every record in every table, the
// values that are not records.h records (pack info, the sequence counter,
// the format version), and a typed scan. The tables are lmdb_env.h's
// `Table`; docs/FORMAT.md describes the layout.
//
//   kCheckpoints  name                      -> CheckpointRecord
//   kRanks        name \0 rank (u32 BE)     -> RankRecord (pending ranks)
//   kTensors      name \0 tensor            -> TensorRecord (committed)
//   kBlobs        name \0 blob              -> BlobRecord (committed)
//   kChunks       chunk id (16 bytes)       -> ChunkLocation
//   kPacks        pack id                   -> PackInfo
//   kMeta         "format_version"          -> u32
//                 "next_sequence"           -> u64 (commit order)
//                 "manifest_tag/" name      -> the listed tag of the store's
//                                              manifest object the record
//                                              was read from (object stores)
//                 "reindex_pack/" pack id   -> "" : a known pack whose index
//                                              must be read again (a sync
//                                              dropped chunks that may live
//                                              in it, and reading it failed)
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "core/chunk_id.h"
#include "core/status.h"
#include "meta/lmdb_env.h"

namespace ckptfs {

namespace keys {
std::string Checkpoint(const std::string& name);
std::string Rank(const std::string& checkpoint, uint32_t rank);
std::string MemberPrefix(const std::string& checkpoint);                       // tensors, blobs, ranks of one checkpoint
std::string Member(const std::string& checkpoint, const std::string& member);  // tensor or blob
std::string Chunk(const ChunkId& id);
// The checkpoint a kRanks/kTensors/kBlobs key belongs to.
std::string CheckpointOfKey(std::string_view key);
// The id a kChunks key names; Corruption unless it is 16 bytes.
Result<ChunkId> ChunkIdOfKey(std::string_view key);
inline constexpr const char* kFormatVersionKey = "format_version";
inline constexpr const char* kNextSequenceKey = "next_sequence";
inline constexpr const char* kManifestTagPrefix = "manifest_tag/";
inline std::string ManifestTag(const std::string& checkpoint) { return kManifestTagPrefix + checkpoint; }
inline constexpr const char* kReindexPackPrefix = "reindex_pack/";
inline std::string ReindexPack(const std::string& pack) { return kReindexPackPrefix + pack; }
}  // namespace keys

// A pack's catalog entry.
struct PackInfo {
  uint64_t size = 0;    // bytes of the pack object
  uint64_t chunks = 0;  // entries in its index
};
std::string EncodePackInfo(const PackInfo& info);
Result<PackInfo> DecodePackInfo(std::string_view data);

// The next commit sequence number (kMeta "next_sequence").
std::string EncodeSequence(uint64_t next);
Result<uint64_t> DecodeSequence(std::string_view data);

// The catalog format version (kMeta "format_version").
std::string EncodeFormatVersion(uint32_t version);
Result<uint32_t> DecodeFormatVersion(std::string_view data);

// Calls fn(key, record) for every entry of `table` under `prefix`, decoded
// with `decode`, until fn returns false. The first value that does not
// decode stops the scan and is the result (Corruption naming the key's
// table).
template <typename T>
Status ScanDecoded(const ReadTxn& txn, Table table, std::string_view prefix,
                   Result<T> (*decode)(std::string_view),
                   const std::function<bool(std::string_view key, T&& value)>& fn) {
  Status inner;
  CKPT_RETURN_IF_ERROR(txn.Scan(table, prefix, [&](std::string_view k, std::string_view v) {
    Result<T> r = decode(v);
    if (!r.ok()) {
      inner = r.status();
      return false;
    }
    return fn(k, std::move(r).value());
  }));
  return inner;
}

}  // namespace ckptfs
