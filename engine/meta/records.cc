#include "meta/records.h"

#include <algorithm>
#include <cstring>

#include "core/encoding.h"
#include "meta/lmdb_env.h"

namespace ckptfs {

void ShardRecord::ComputeStarts() {
  starts.resize(chunks.size() + 1);
  uint64_t n = 0;
  for (size_t i = 0; i < chunks.size(); ++i) {
    starts[i] = n;
    n += chunks[i].raw_len;
  }
  starts[chunks.size()] = n;
}

Status ValidateTensorRecord(const TensorRecord& t) {
  auto bad = [&](const std::string& what) { return Status::Corruption("tensor '" + t.name + "': " + what); };
  auto elements = CheckedNumElements(t.shape);
  if (!elements.ok()) return bad(elements.status().message());
  const uint64_t width = DTypeSize(t.dtype);
  if (*elements > (uint64_t{1} << 63) / width) return bad("shape " + ShapeToString(t.shape) + " is too large");
  for (const ShardRecord& s : t.shards) {
    Status region = ValidateRegion(t.shape, s.region);
    if (!region.ok()) return bad("shard " + s.region.ToString() + ": " + region.message());
    if (s.starts.size() != s.chunks.size() + 1) return bad("shard " + s.region.ToString() + " has no chunk offsets");
    for (const ChunkRef& c : s.chunks) {
      if (c.raw_len == 0 || c.raw_len > kMaxChunkSize) return bad("chunk of " + std::to_string(c.raw_len) + " bytes");
    }
    const uint64_t want = s.region.NumElements() * width;
    if (s.ByteSize() != want) {
      return bad("shard " + s.region.ToString() + " has chunks of " + std::to_string(s.ByteSize()) +
                 " bytes, its region needs " + std::to_string(want));
    }
  }
  return Status::OK();
}

Status ValidateBlobRecord(const BlobRecord& b) {
  uint64_t sum = 0;
  for (const ChunkRef& c : b.chunks) {
    if (c.raw_len == 0 || c.raw_len > kMaxChunkSize) {
      return Status::Corruption("blob '" + b.name + "': chunk of " + std::to_string(c.raw_len) + " bytes");
    }
    sum += c.raw_len;  // at most 2^32 chunks of < 2^32 bytes: no overflow
  }
  if (sum != b.size) {
    return Status::Corruption("blob '" + b.name + "' of " + std::to_string(b.size) + " bytes has chunks of " +
                              std::to_string(sum) + " bytes");
  }
  return Status::OK();
}

bool IsValidSaveAttempt(std::string_view attempt) {
  return attempt.size() <= kMaxAttemptSize &&
         std::all_of(attempt.begin(), attempt.end(), [](char c) { return c >= 0x21 && c <= 0x7e; });
}

Status ValidateCheckpointRecord(const CheckpointRecord& c) {
  auto bad = [&](const std::string& what) { return Status::Corruption("checkpoint '" + c.name + "': " + what); };
  if (c.world_size == 0) return bad("world size 0");
  for (size_t i = 0; i < c.committed_ranks.size(); ++i) {
    if (c.committed_ranks[i] >= c.world_size) {
      return bad("rank " + std::to_string(c.committed_ranks[i]) + " is outside world size " + std::to_string(c.world_size));
    }
    if (i > 0 && c.committed_ranks[i] <= c.committed_ranks[i - 1]) return bad("committed ranks are not in order");
  }
  if (c.state == CheckpointState::kCommitted && c.committed_ranks.size() != c.world_size) {
    return bad("committed with " + std::to_string(c.committed_ranks.size()) + " of " + std::to_string(c.world_size) +
               " ranks");
  }
  if (c.state == CheckpointState::kCommitted && !c.attempt.empty()) return bad("committed with a save attempt");
  if (!IsValidSaveAttempt(c.attempt)) return bad("malformed save attempt");
  return Status::OK();
}

namespace {

// Version 2 adds a checkpoint's save attempt; a record is written at
// version 1 whenever it has none, so what older builds wrote and read stays
// as it was.
constexpr uint8_t kRecordVersion = 1;
constexpr uint8_t kAttemptVersion = 2;
constexpr char kManifestMagic[8] = {'C', 'K', 'P', 'T', 'M', 'A', 'N', 'I'};

void PutChunks(Encoder& e, const std::vector<ChunkRef>& chunks) {
  e.Varint(chunks.size());
  for (const auto& c : chunks) {
    e.Bytes(c.id.bytes.data(), 16);
    e.Varint(c.raw_len);
  }
}

Status GetChunks(Decoder& d, std::vector<ChunkRef>* chunks) {
  uint64_t n;
  CKPT_RETURN_IF_ERROR(d.Varint(&n));
  if (n > d.remaining() / 17) return Status::Corruption("chunk count exceeds record size");
  chunks->resize(n);
  for (auto& c : *chunks) {
    uint64_t len;
    CKPT_RETURN_IF_ERROR(d.Bytes(c.id.bytes.data(), 16));
    CKPT_RETURN_IF_ERROR(d.Varint(&len));
    if (len == 0 || len > kMaxChunkSize) return Status::Corruption("chunk of " + std::to_string(len) + " bytes");
    c.raw_len = static_cast<uint32_t>(len);
  }
  return Status::OK();
}

// A varint that must fit in 32 bits (ranks, world sizes).
Status GetU32(Decoder& d, uint32_t* out, const char* what) {
  uint64_t v;
  CKPT_RETURN_IF_ERROR(d.Varint(&v));
  if (v > UINT32_MAX) return Status::Corruption(std::string(what) + " " + std::to_string(v) + " does not fit 32 bits");
  *out = static_cast<uint32_t>(v);
  return Status::OK();
}

void PutU64s(Encoder& e, const std::vector<uint64_t>& v) {
  e.Varint(v.size());
  for (uint64_t x : v) e.Varint(x);
}

Status GetU64s(Decoder& d, std::vector<uint64_t>* v) {
  uint64_t n;
  CKPT_RETURN_IF_ERROR(d.Varint(&n));
  if (n > d.remaining()) return Status::Corruption("list length exceeds record size");
  v->resize(n);
  for (auto& x : *v) CKPT_RETURN_IF_ERROR(d.Varint(&x));
  return Status::OK();
}

void PutTensor(Encoder& e, const TensorRecord& t) {
  e.String(t.name);
  e.U8(static_cast<uint8_t>(t.dtype));
  PutU64s(e, t.shape);
  e.Varint(t.shards.size());
  for (const auto& s : t.shards) {
    e.U8(static_cast<uint8_t>(s.region.kind));
    if (s.region.kind == Region::Kind::kFlat) {
      e.Varint(s.region.flat.start);
      e.Varint(s.region.flat.end);
    } else {
      PutU64s(e, s.region.box.offsets);
      PutU64s(e, s.region.box.lengths);
    }
    e.Varint(s.ranks.size());
    for (uint32_t r : s.ranks) e.Varint(r);
    PutChunks(e, s.chunks);
  }
}

Status GetTensor(Decoder& d, TensorRecord* t) {
  uint8_t dtype;
  CKPT_RETURN_IF_ERROR(d.String(&t->name));
  CKPT_RETURN_IF_ERROR(d.U8(&dtype));
  auto dt = DTypeFromCode(dtype);
  if (!dt) return Status::Corruption("unknown dtype code " + std::to_string(dtype));
  t->dtype = *dt;
  CKPT_RETURN_IF_ERROR(GetU64s(d, &t->shape));
  uint64_t nshards;
  CKPT_RETURN_IF_ERROR(d.Varint(&nshards));
  if (nshards > d.remaining()) return Status::Corruption("shard count exceeds record size");
  t->shards.resize(nshards);
  for (auto& s : t->shards) {
    uint8_t kind;
    CKPT_RETURN_IF_ERROR(d.U8(&kind));
    if (kind == static_cast<uint8_t>(Region::Kind::kFlat)) {
      s.region.kind = Region::Kind::kFlat;
      CKPT_RETURN_IF_ERROR(d.Varint(&s.region.flat.start));
      CKPT_RETURN_IF_ERROR(d.Varint(&s.region.flat.end));
    } else if (kind == static_cast<uint8_t>(Region::Kind::kBox)) {
      s.region.kind = Region::Kind::kBox;
      CKPT_RETURN_IF_ERROR(GetU64s(d, &s.region.box.offsets));
      CKPT_RETURN_IF_ERROR(GetU64s(d, &s.region.box.lengths));
    } else {
      return Status::Corruption("unknown region kind");
    }
    uint64_t nranks;
    CKPT_RETURN_IF_ERROR(d.Varint(&nranks));
    if (nranks > d.remaining()) return Status::Corruption("rank count exceeds record size");
    s.ranks.resize(nranks);
    for (auto& r : s.ranks) CKPT_RETURN_IF_ERROR(GetU32(d, &r, "rank"));
    CKPT_RETURN_IF_ERROR(GetChunks(d, &s.chunks));
    s.ComputeStarts();
  }
  return ValidateTensorRecord(*t);
}

void PutBlob(Encoder& e, const BlobRecord& b) {
  e.String(b.name);
  e.Varint(b.size);
  PutChunks(e, b.chunks);
}

Status GetBlob(Decoder& d, BlobRecord* b) {
  CKPT_RETURN_IF_ERROR(d.String(&b->name));
  CKPT_RETURN_IF_ERROR(d.Varint(&b->size));
  CKPT_RETURN_IF_ERROR(GetChunks(d, &b->chunks));
  return ValidateBlobRecord(*b);
}

uint8_t VersionOf(const CheckpointRecord& c) { return c.attempt.empty() ? kRecordVersion : kAttemptVersion; }

void PutCheckpoint(Encoder& e, const CheckpointRecord& c) {
  e.String(c.name);
  e.U8(c.step.has_value());
  e.U64(static_cast<uint64_t>(c.step.value_or(0)));
  e.Varint(c.world_size);
  e.U8(static_cast<uint8_t>(c.state));
  e.Varint(c.committed_ranks.size());
  for (uint32_t r : c.committed_ranks) e.Varint(r);
  e.Varint(c.created_unix_ms);
  e.Varint(c.committed_unix_ms);
  e.Varint(c.sequence);
  e.Varint(c.tags.size());
  for (const auto& [k, v] : c.tags) {
    e.String(k);
    e.String(v);
  }
  e.Varint(c.tensor_count);
  e.Varint(c.logical_bytes);
  if (!c.attempt.empty()) e.String(c.attempt);
}

Status GetCheckpoint(Decoder& d, CheckpointRecord* c, uint8_t version) {
  uint8_t has_step, state;
  uint64_t step;
  CKPT_RETURN_IF_ERROR(d.String(&c->name));
  CKPT_RETURN_IF_ERROR(d.U8(&has_step));
  CKPT_RETURN_IF_ERROR(d.U64(&step));
  if (has_step > 1 || (!has_step && step != 0)) return Status::Corruption("malformed step");
  if (has_step) c->step = static_cast<int64_t>(step);
  CKPT_RETURN_IF_ERROR(GetU32(d, &c->world_size, "world size"));
  CKPT_RETURN_IF_ERROR(d.U8(&state));
  if (state > 1) return Status::Corruption("unknown checkpoint state");
  c->state = static_cast<CheckpointState>(state);
  uint64_t n;
  CKPT_RETURN_IF_ERROR(d.Varint(&n));
  if (n > d.remaining()) return Status::Corruption("rank count exceeds record size");
  c->committed_ranks.resize(n);
  for (auto& r : c->committed_ranks) CKPT_RETURN_IF_ERROR(GetU32(d, &r, "rank"));
  CKPT_RETURN_IF_ERROR(d.Varint(&c->created_unix_ms));
  CKPT_RETURN_IF_ERROR(d.Varint(&c->committed_unix_ms));
  CKPT_RETURN_IF_ERROR(d.Varint(&c->sequence));
  CKPT_RETURN_IF_ERROR(d.Varint(&n));
  if (n > d.remaining()) return Status::Corruption("tag count exceeds record size");
  c->tags.resize(n);
  for (auto& [k, val] : c->tags) {
    CKPT_RETURN_IF_ERROR(d.String(&k));
    CKPT_RETURN_IF_ERROR(d.String(&val));
  }
  CKPT_RETURN_IF_ERROR(d.Varint(&c->tensor_count));
  CKPT_RETURN_IF_ERROR(d.Varint(&c->logical_bytes));
  if (version == kAttemptVersion) {
    CKPT_RETURN_IF_ERROR(d.String(&c->attempt));
    if (c->attempt.empty()) return Status::Corruption("empty save attempt");
  }
  return ValidateCheckpointRecord(*c);
}

template <typename T, typename Fn>
Result<T> DecodeWith(std::string_view data, Fn fn, const char* what) {
  Decoder d(data);
  uint8_t version = 0;
  CKPT_RETURN_IF_ERROR(d.U8(&version));
  // These records live in the catalog only (manifests decode on their own).
  if (version != kRecordVersion) {
    return Status::Corruption(std::string(what) + " record has unknown version " + std::to_string(version) + kReindexHint);
  }
  T out;
  Status st = fn(d, &out);
  if (!st.ok()) return Status::Corruption(std::string(what) + " record: " + st.message() + kReindexHint);
  if (!d.done()) return Status::Corruption(std::string(what) + " record has trailing bytes" + kReindexHint);
  return out;
}

template <typename T, typename Fn>
std::string EncodeWith(const T& r, Fn fn) {
  Encoder e;
  e.U8(kRecordVersion);
  fn(e, r);
  return e.Take();
}

void PutRank(Encoder& e, const RankRecord& r) {
  e.Varint(r.rank);
  e.Varint(r.tensors.size());
  for (const auto& t : r.tensors) PutTensor(e, t);
  e.Varint(r.blobs.size());
  for (const auto& b : r.blobs) PutBlob(e, b);
}

Status GetRank(Decoder& d, RankRecord* r) {
  uint64_t n;
  CKPT_RETURN_IF_ERROR(GetU32(d, &r->rank, "rank"));
  CKPT_RETURN_IF_ERROR(d.Varint(&n));
  if (n > d.remaining()) return Status::Corruption("tensor count exceeds record size");
  r->tensors.resize(n);
  for (auto& t : r->tensors) CKPT_RETURN_IF_ERROR(GetTensor(d, &t));
  CKPT_RETURN_IF_ERROR(d.Varint(&n));
  if (n > d.remaining()) return Status::Corruption("blob count exceeds record size");
  r->blobs.resize(n);
  for (auto& b : r->blobs) CKPT_RETURN_IF_ERROR(GetBlob(d, &b));
  return Status::OK();
}

void PutLocation(Encoder& e, const ChunkLocation& l) {
  e.String(l.pack);
  e.Varint(l.offset);
  e.Varint(l.stored_len);
  e.Varint(l.raw_len);
  e.U8(static_cast<uint8_t>(l.codec));
}

Status GetLocation(Decoder& d, ChunkLocation* l) {
  uint8_t codec;
  CKPT_RETURN_IF_ERROR(d.String(&l->pack));
  CKPT_RETURN_IF_ERROR(d.Varint(&l->offset));
  CKPT_RETURN_IF_ERROR(GetU32(d, &l->stored_len, "stored length"));
  CKPT_RETURN_IF_ERROR(GetU32(d, &l->raw_len, "raw length"));
  CKPT_RETURN_IF_ERROR(d.U8(&codec));
  if (codec > static_cast<uint8_t>(Codec::kByteGroupZstd)) return Status::Corruption("unknown codec");
  l->codec = static_cast<Codec>(codec);
  if (l->raw_len == 0 || l->raw_len > kMaxChunkSize) {
    return Status::Corruption("chunk of " + std::to_string(l->raw_len) + " bytes");
  }
  if (l->offset > UINT64_MAX - l->stored_len) return Status::Corruption("chunk offset overflows");
  return Status::OK();
}

}  // namespace

std::string CheckpointIdentity(const CheckpointRecord& c) {
  return std::to_string(c.created_unix_ms) + ':' + std::to_string(c.committed_unix_ms) + ':' +
         std::to_string(c.world_size);
}

std::string EncodeCheckpoint(const CheckpointRecord& r) {
  Encoder e;
  e.U8(VersionOf(r));
  PutCheckpoint(e, r);
  return e.Take();
}
Result<CheckpointRecord> DecodeCheckpoint(std::string_view data) {
  if (!data.empty() && static_cast<uint8_t>(data[0]) == kAttemptVersion) {
    Decoder d(data.substr(1));
    CheckpointRecord out;
    Status st = GetCheckpoint(d, &out, kAttemptVersion);
    if (!st.ok()) return Status::Corruption("checkpoint record: " + st.message() + kReindexHint);
    if (!d.done()) return Status::Corruption(std::string("checkpoint record has trailing bytes") + kReindexHint);
    return out;
  }
  return DecodeWith<CheckpointRecord>(
      data, [](Decoder& d, CheckpointRecord* c) { return GetCheckpoint(d, c, kRecordVersion); }, "checkpoint");
}
std::string EncodeTensor(const TensorRecord& r) { return EncodeWith(r, PutTensor); }
Result<TensorRecord> DecodeTensor(std::string_view data) {
  return DecodeWith<TensorRecord>(data, GetTensor, "tensor");
}
std::string EncodeBlob(const BlobRecord& r) { return EncodeWith(r, PutBlob); }
Result<BlobRecord> DecodeBlob(std::string_view data) { return DecodeWith<BlobRecord>(data, GetBlob, "blob"); }
std::string EncodeRank(const RankRecord& r) { return EncodeWith(r, PutRank); }
Result<RankRecord> DecodeRank(std::string_view data) { return DecodeWith<RankRecord>(data, GetRank, "rank"); }
std::string EncodeChunkLocation(const ChunkLocation& loc) { return EncodeWith(loc, PutLocation); }
Result<ChunkLocation> DecodeChunkLocation(std::string_view data) {
  return DecodeWith<ChunkLocation>(data, GetLocation, "chunk location");
}

std::string EncodeManifest(const Manifest& m) {
  Encoder e;
  e.Bytes(kManifestMagic, 8);
  e.U8(VersionOf(m.checkpoint));
  PutCheckpoint(e, m.checkpoint);
  e.Varint(m.tensors.size());
  for (const auto& t : m.tensors) PutTensor(e, t);
  e.Varint(m.blobs.size());
  for (const auto& b : m.blobs) PutBlob(e, b);
  uint64_t sum = Checksum64(std::as_bytes(std::span(e.data())));
  e.U64(sum);
  return e.Take();
}

Result<Manifest> DecodeManifest(std::string_view data) {
  if (data.size() < 17 || std::memcmp(data.data(), kManifestMagic, 8) != 0) {
    return Status::Corruption("not a ckptfs manifest (bad magic)");
  }
  uint64_t sum;
  std::memcpy(&sum, data.data() + data.size() - 8, 8);
  std::string_view body = data.substr(0, data.size() - 8);
  if (Checksum64(std::as_bytes(std::span(body.data(), body.size()))) != sum) {
    return Status::Corruption("manifest checksum mismatch");
  }
  Decoder d(body.substr(8));
  uint8_t version = 0;
  CKPT_RETURN_IF_ERROR(d.U8(&version));
  if (version != kRecordVersion && version != kAttemptVersion) return Status::Corruption("manifest has unknown version");
  Manifest m;
  CKPT_RETURN_IF_ERROR(GetCheckpoint(d, &m.checkpoint, version));
  uint64_t n;
  CKPT_RETURN_IF_ERROR(d.Varint(&n));
  if (n > d.remaining()) return Status::Corruption("manifest tensor count exceeds size");
  m.tensors.resize(n);
  for (auto& t : m.tensors) CKPT_RETURN_IF_ERROR(GetTensor(d, &t));
  CKPT_RETURN_IF_ERROR(d.Varint(&n));
  if (n > d.remaining()) return Status::Corruption("manifest blob count exceeds size");
  m.blobs.resize(n);
  for (auto& b : m.blobs) CKPT_RETURN_IF_ERROR(GetBlob(d, &b));
  if (!d.done()) return Status::Corruption("manifest has trailing bytes");
  return m;
}

}  // namespace ckptfs
