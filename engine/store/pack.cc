#include "store/pack.h"

#include <algorithm>
#include <cstring>

#include "core/buffer_pool.h"
#include "core/encoding.h"
#include "core/random.h"

namespace ckptfs {

std::string PackKey(const std::string& pack_id) { return kPackKeyPrefix + pack_id + ".pack"; }

bool ParsePackKey(const std::string& key, std::string* pack_id) {
  const std::string prefix = kPackKeyPrefix, suffix = ".pack";
  if (key.size() <= prefix.size() + suffix.size() || key.compare(0, prefix.size(), prefix) != 0 ||
      key.compare(key.size() - suffix.size(), suffix.size(), suffix) != 0) {
    return false;
  }
  *pack_id = key.substr(prefix.size(), key.size() - prefix.size() - suffix.size());
  return pack_id->find('/') == std::string::npos;
}

std::string NewPackId() { return RandomHex(24); }

PackWriter::PackWriter(Backend* backend, uint64_t target_size)
    : backend_(backend), target_size_(target_size) {}

PackWriter::~PackWriter() {
  if (current_) current_->Abort();
}

Result<ChunkLocation> PackWriter::Add(const ChunkId& id, Codec codec, uint32_t raw_len,
                                      std::span<const std::byte> stored) {
  std::lock_guard lock(mu_);
  CKPT_RETURN_IF_ERROR(error_);
  auto fail = [&](Status st) {
    error_ = st;
    if (current_) current_->Abort();
    current_.reset();
    return st;
  };
  if (!current_) {
    open_ = SealedPack{NewPackId(), 0, {}};
    auto w = backend_->Create(PackKey(open_.id));
    if (!w.ok()) return fail(w.status());
    current_ = std::move(w).value();
    char header[kPackHeaderSize] = {};
    std::memcpy(header, kPackMagic, 8);
    std::memcpy(header + 8, &kPackVersion, 4);
    Status st = current_->Append(std::as_bytes(std::span(header)));
    if (!st.ok()) return fail(st);
    offset_ = kPackHeaderSize;
  }
  Status st = current_->Append(stored);
  if (!st.ok()) return fail(st.WithContext("appending to pack " + open_.id));
  ChunkLocation loc{open_.id, offset_, static_cast<uint32_t>(stored.size()), raw_len, codec};
  open_.entries.push_back({id, loc});
  offset_ += stored.size();
  if (offset_ >= target_size_) {
    Status seal = SealLocked();
    if (!seal.ok()) return fail(seal);
  }
  return loc;
}

Status PackWriter::SealLocked() {
  if (!current_) return Status::OK();
  Encoder index;
  for (const auto& e : open_.entries) {
    index.Bytes(e.id.bytes.data(), 16);
    index.U64(e.location.offset);
    index.U32(e.location.stored_len);
    index.U32(e.location.raw_len);
    index.U8(static_cast<uint8_t>(e.location.codec));
    for (int i = 0; i < 7; ++i) index.U8(0);
  }
  Encoder footer;
  footer.U64(offset_);
  footer.U64(open_.entries.size());
  footer.U64(Checksum64(std::as_bytes(std::span(index.data()))));
  footer.Bytes(kPackEndMagic, 8);
  CKPT_RETURN_IF_ERROR(current_->Append(std::as_bytes(std::span(index.data()))));
  CKPT_RETURN_IF_ERROR(current_->Append(std::as_bytes(std::span(footer.data()))));
  open_.size = offset_ + index.data().size() + footer.data().size();
  Status st = current_->Commit();
  current_.reset();
  CKPT_RETURN_IF_ERROR(st.WithContext("sealing pack " + open_.id));
  sealed_.push_back(std::move(open_));
  open_ = SealedPack{};
  return Status::OK();
}

void PackWriter::Discard() {
  std::lock_guard lock(mu_);
  if (current_) current_->Abort();
  current_.reset();
  for (const SealedPack& p : sealed_) (void)backend_->Delete(PackKey(p.id));
  sealed_.clear();
  error_ = Status::FailedPrecondition("pack writer was discarded");
}

Result<std::vector<SealedPack>> PackWriter::Finish() {
  std::lock_guard lock(mu_);
  CKPT_RETURN_IF_ERROR(error_);
  Status st = SealLocked();
  if (!st.ok()) {
    error_ = st;
    if (current_) current_->Abort();
    current_.reset();
    return st;
  }
  return std::move(sealed_);
}

namespace {
// Bytes read from a pack's end to find its index: at most the footer and
// an index of about 1,600 chunks, at least 4 KiB (about 100).
constexpr uint64_t kPackTailProbe = 64 << 10;
constexpr uint64_t kPackTailProbeMin = 4 << 10;
}  // namespace

Status CheckIndexEntry(const PackIndexEntry& e, uint8_t codec, uint64_t data_end, uint64_t i) {
  if (codec > static_cast<uint8_t>(Codec::kByteGroupZstd)) return Status::Corruption("unknown codec in index");
  // Compared without adding, so an offset near 2^64 cannot wrap around.
  if (e.location.offset < kPackHeaderSize || e.location.offset > data_end ||
      e.location.stored_len > data_end - e.location.offset) {
    return Status::Corruption("index entry " + std::to_string(i) + " points outside the data area");
  }
  if (e.location.raw_len == 0 || e.location.raw_len > kMaxChunkSize) {
    return Status::Corruption("index entry " + std::to_string(i) + " has raw length " +
                              std::to_string(e.location.raw_len));
  }
  if (codec == static_cast<uint8_t>(Codec::kRaw) && e.location.stored_len != e.location.raw_len) {
    return Status::Corruption("index entry " + std::to_string(i) + " is a raw chunk whose stored and raw lengths differ");
  }
  return Status::OK();
}

Result<SealedPack> ReadPackIndex(Backend* backend, const std::string& pack_id, uint64_t chunk_size) {
  const std::string key = PackKey(pack_id);
  auto corrupt = [&](const std::string& what) {
    return Status::Corruption("pack " + pack_id + ": " + what);
  };
  CKPT_ASSIGN_OR_RETURN(uint64_t size, backend->Size(key));
  if (size < kPackHeaderSize + kPackFooterSize) return corrupt("too short to be a pack");
  char header[kPackHeaderSize];
  CKPT_RETURN_IF_ERROR(backend->ReadRange(key, 0, std::as_writable_bytes(std::span(header))));
  if (std::memcmp(header, kPackMagic, 8) != 0) return corrupt("bad magic");
  uint32_t version;
  std::memcpy(&version, header + 8, 4);
  if (version != kPackVersion) return corrupt("unknown pack version " + std::to_string(version));
  // The footer and, for all but huge packs, the whole index in one read of
  // the pack's tail: on an object store each read is a request.
  uint64_t probe = kPackTailProbe;
  if (chunk_size > 0) {
    const uint64_t full_chunks = size / chunk_size + 1;
    probe = std::clamp<uint64_t>(2 * full_chunks * kPackIndexEntrySize + kPackFooterSize, kPackTailProbeMin,
                                 kPackTailProbe);
  }
  std::string tail(std::min<uint64_t>(size - kPackHeaderSize, probe), '\0');
  const uint64_t tail_start = size - tail.size();
  CKPT_RETURN_IF_ERROR(
      backend->ReadRange(key, tail_start, std::as_writable_bytes(std::span(tail.data(), tail.size()))));
  Decoder fd(tail.data() + tail.size() - kPackFooterSize, kPackFooterSize);
  uint64_t index_offset = 0, count = 0, checksum = 0;
  char end_magic[8];
  CKPT_RETURN_IF_ERROR(fd.U64(&index_offset));
  CKPT_RETURN_IF_ERROR(fd.U64(&count));
  CKPT_RETURN_IF_ERROR(fd.U64(&checksum));
  CKPT_RETURN_IF_ERROR(fd.Bytes(end_magic, 8));
  if (std::memcmp(end_magic, kPackEndMagic, 8) != 0) return corrupt("bad footer magic (truncated pack?)");
  if (index_offset < kPackHeaderSize || index_offset > size - kPackFooterSize ||
      count != (size - kPackFooterSize - index_offset) / kPackIndexEntrySize ||
      index_offset + count * kPackIndexEntrySize + kPackFooterSize != size) {
    return corrupt("index bounds do not match the pack size");
  }
  std::string index;
  if (index_offset >= tail_start) {
    index = tail.substr(index_offset - tail_start, count * kPackIndexEntrySize);
  } else {  // the index begins before the tail read: fetch the rest
    index.resize(tail_start - index_offset);
    CKPT_RETURN_IF_ERROR(
        backend->ReadRange(key, index_offset, std::as_writable_bytes(std::span(index.data(), index.size()))));
    index.append(tail, 0, tail.size() - kPackFooterSize);
  }
  if (Checksum64(std::as_bytes(std::span(index))) != checksum) return corrupt("index checksum mismatch");
  SealedPack pack{pack_id, size, {}};
  pack.entries.reserve(count);
  Decoder d(index);
  for (uint64_t i = 0; i < count; ++i) {
    PackIndexEntry e;
    uint8_t codec, pad[7];
    CKPT_RETURN_IF_ERROR(d.Bytes(e.id.bytes.data(), 16));
    CKPT_RETURN_IF_ERROR(d.U64(&e.location.offset));
    CKPT_RETURN_IF_ERROR(d.U32(&e.location.stored_len));
    CKPT_RETURN_IF_ERROR(d.U32(&e.location.raw_len));
    CKPT_RETURN_IF_ERROR(d.U8(&codec));
    CKPT_RETURN_IF_ERROR(d.Bytes(pad, 7));
    if (Status bad = CheckIndexEntry(e, codec, index_offset, i); !bad.ok()) return corrupt(bad.message());
    e.location.codec = static_cast<Codec>(codec);
    e.location.pack = pack_id;
    pack.entries.push_back(std::move(e));
  }
  return pack;
}

namespace {

// Names a chunk in messages: its id, pack and offset.
std::string ChunkWhere(const ChunkId& id, const ChunkLocation& loc) {
  return "chunk " + id.ToHex() + " in pack " + loc.pack + " at offset " + std::to_string(loc.offset);
}

// Decodes `stored` into `raw` and checks the result hashes to `id`.
Status DecodeChecked(const ChunkId& id, const ChunkLocation& loc, std::span<const std::byte> stored,
                     std::span<std::byte> raw) {
  Status st = DecodeChunk(loc.codec, stored, raw);
  if (!st.ok()) return Status::Corruption(ChunkWhere(id, loc) + ": " + st.message());
  if (ChunkId::Of(raw) != id) return Status::Corruption(ChunkWhere(id, loc) + ": content hash mismatch");
  return Status::OK();
}

}  // namespace

Status ReadChunk(Backend* backend, const ChunkId& id, const ChunkLocation& loc, std::span<std::byte> raw,
                 ChunkDestination destination) {
  auto where = [&]() { return ChunkWhere(id, loc); };
  if (raw.size() != loc.raw_len) return Status::Internal("buffer size does not match " + where());
  // Reused by every chunk this thread reads: no allocation, no zero-fill.
  thread_local ScratchBuffer stored_buffer;
  if (loc.codec == Codec::kRaw) {
    if (loc.stored_len != loc.raw_len) return Status::Corruption(where() + ": raw chunk with wrong length");
    if (destination == ChunkDestination::kCallerMemory && backend->ReadsWithKernelCopy()) {
      // In pieces small enough to stay in this core's cache while they are
      // hashed and copied out.
      constexpr size_t kPiece = 256 << 10;
      std::byte* staged = stored_buffer.Reserve(kPiece);
      const std::string key = PackKey(loc.pack);
      ChunkHasher hasher;
      for (size_t done = 0; done < raw.size(); done += kPiece) {
        std::span<std::byte> piece(staged, std::min(kPiece, raw.size() - done));
        CKPT_RETURN_IF_ERROR(backend->ReadRange(key, loc.offset + done, piece).WithContext(where()));
        hasher.Update(piece);
        std::memcpy(raw.data() + done, piece.data(), piece.size());
      }
      if (hasher.Finish() != id) return Status::Corruption(where() + ": content hash mismatch");
      return Status::OK();
    }
    CKPT_RETURN_IF_ERROR(backend->ReadRange(PackKey(loc.pack), loc.offset, raw).WithContext(where()));
  } else {
    std::span<std::byte> stored(stored_buffer.Reserve(loc.stored_len), loc.stored_len);
    CKPT_RETURN_IF_ERROR(backend->ReadRange(PackKey(loc.pack), loc.offset, stored).WithContext(where()));
    return DecodeChecked(id, loc, stored, raw);
  }
  if (ChunkId::Of(raw) != id) return Status::Corruption(where() + ": content hash mismatch");
  return Status::OK();
}

Status ReadStoredChunk(Backend* backend, const ChunkId& id, const ChunkLocation& loc, std::span<std::byte> stored) {
  auto where = [&]() { return ChunkWhere(id, loc); };
  if (stored.size() != loc.stored_len) return Status::Internal("buffer size does not match " + where());
  CKPT_RETURN_IF_ERROR(backend->ReadRange(PackKey(loc.pack), loc.offset, stored).WithContext(where()));
  if (loc.codec == Codec::kRaw) {
    if (loc.stored_len != loc.raw_len) return Status::Corruption(where() + ": raw chunk with wrong length");
    if (ChunkId::Of(stored) != id) return Status::Corruption(where() + ": content hash mismatch");
    return Status::OK();
  }
  thread_local ScratchBuffer raw_buffer;
  return DecodeChecked(id, loc, stored, std::span<std::byte>(raw_buffer.Reserve(loc.raw_len), loc.raw_len));
}

}  // namespace ckptfs
