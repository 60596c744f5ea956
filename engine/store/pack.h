// Pack files: compressed chunks appended back to back, followed by the
// pack's own index and a fixed footer (layout in docs/FORMAT.md), so the chunk
// index of a repository can be rebuilt from its packs alone.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "codec/codec.h"
#include "core/chunk_id.h"
#include "core/status.h"

namespace ckptfs {

inline constexpr char kPackMagic[8] = {'C', 'K', 'P', 'T', 'P', 'A', 'C', 'K'};
inline constexpr char kPackEndMagic[8] = {'C', 'K', 'P', 'T', 'P', 'E', 'N', 'D'};
inline constexpr uint32_t kPackVersion = 1;
inline constexpr size_t kPackHeaderSize = 16;
inline constexpr size_t kPackFooterSize = 32;
inline constexpr size_t kPackIndexEntrySize = 40;
// The largest raw chunk a repository may hold (the upper bound of its chunk
// size). Records and pack indexes that claim a longer chunk are corrupt,
// which bounds the memory a read of damaged metadata can ask for.
inline constexpr uint32_t kMaxChunkSize = 256u << 20;

// Where a chunk is stored.
struct ChunkLocation {
  std::string pack;      // pack id (the object key is PackKey(pack))
  uint64_t offset = 0;   // of the stored bytes inside the pack
  uint32_t stored_len = 0;
  uint32_t raw_len = 0;
  Codec codec = Codec::kRaw;
};

struct PackIndexEntry {
  ChunkId id;
  ChunkLocation location;
};

struct SealedPack {
  std::string id;
  uint64_t size = 0;  // whole object, bytes
  std::vector<PackIndexEntry> entries;
};

// Object keys, built and parsed in one place.
// Packs are the objects "packs/ID.pack" (ckpt/layout.h lists the rest).
inline constexpr const char* kPackKeyPrefix = "packs/";
std::string PackKey(const std::string& pack_id);
bool ParsePackKey(const std::string& key, std::string* pack_id);
std::string NewPackId();

// Appends encoded chunks to packs of about `target_size` bytes. Each pack is
// durable (fsync'd) and visible when it is sealed; a writer that is destroyed
// without Finish() leaves no visible pack.
// Thread safety: Add and Finish may be called from any thread; appends are
// serialised by an internal mutex.
class PackWriter {
 public:
  PackWriter(Backend* backend, uint64_t target_size);
  ~PackWriter();

  // Appends one encoded chunk; returns where it was stored. The pack holding
  // it is durable only after it is sealed (by size or by Finish).
  Result<ChunkLocation> Add(const ChunkId& id, Codec codec, uint32_t raw_len,
                            std::span<const std::byte> stored);
  // Seals the open pack, if any, and returns every pack sealed so far,
  // clearing that list.
  Result<std::vector<SealedPack>> Finish();
  // Gives up: aborts the open pack and deletes the packs sealed so far, for
  // a save that will never commit them (only safe where no other writer can
  // have found their chunks: a local repository, whose dedup sees committed
  // chunks only). Deletion errors are ignored: gc removes what is left.
  void Discard();

 private:
  Status SealLocked();

  Backend* backend_;
  uint64_t target_size_;
  std::mutex mu_;
  std::unique_ptr<ObjectWriter> current_;
  SealedPack open_;
  uint64_t offset_ = 0;
  std::vector<SealedPack> sealed_;
  Status error_;  // sticky: after a failed append nothing more is written
};

// Reads and checks a pack's index (footer, magic, checksum, bounds). The
// footer and index are read from the pack's tail in one request when they
// fit in the tail read: with `chunk_size` (the repository's; 0: unknown),
// a tail sized for twice the chunks a pack of full chunks holds (at least
// 4 KiB, at most 64 KiB), so that a restore's download stays near the
// bytes it needs; a pack of many smaller chunks takes a second read.
Result<SealedPack> ReadPackIndex(Backend* backend, const std::string& pack_id, uint64_t chunk_size = 0);
// Checks one index entry of a pack whose data area ends at `data_end` (where
// its index begins): a known codec, stored bytes inside the data area, a raw
// length in (0, kMaxChunkSize], stored and raw lengths equal for a raw
// chunk. The message names entry `i`; the caller adds the pack.
Status CheckIndexEntry(const PackIndexEntry& entry, uint8_t codec, uint64_t data_end, uint64_t i);

// What ReadChunk's destination is.
enum class ChunkDestination {
  // The engine's own recycled memory (a pool buffer): read straight in.
  kOwnBuffer,
  // Memory the caller owns, such as a tensor being loaded. A raw chunk from
  // a backend that reads with a kernel copy is staged: read 256 KiB at a
  // time into this thread's scratch buffer, hashed and copied out while the
  // piece is in cache. The kernel never writes into the caller's pages: on
  // virtual machines its first write into a page of a process is several
  // times slower than the copy itself (DESIGN.md "Read path").
  kCallerMemory,
};

// Reads one chunk, decodes it and verifies its XXH3-128 against `id`.
// Corruption names the chunk and the pack.
Status ReadChunk(Backend* backend, const ChunkId& id, const ChunkLocation& loc, std::span<std::byte> raw,
                 ChunkDestination destination = ChunkDestination::kOwnBuffer);

// Reads one chunk's stored (encoded) bytes into `stored` (loc.stored_len
// bytes) and checks them as ReadChunk does: decoded into this thread's
// scratch memory and hashed against `id`. What a copy to another
// repository sends as it is, without encoding it again.
Status ReadStoredChunk(Backend* backend, const ChunkId& id, const ChunkLocation& loc, std::span<std::byte> stored);

}  // namespace ckptfs
