// Chunk fetchers (chunk_fetcher.h).
#include "store/chunk_fetcher.h"

#include <cstring>

namespace ckptfs {

Status ChunkFetcher::FetchInto(const ChunkRef& chunk, std::span<std::byte> dst) {
  CKPT_ASSIGN_OR_RETURN(ChunkData data, Fetch(chunk));
  if (data->size() != dst.size()) return Status::Internal("chunk size does not match its destination");
  std::memcpy(dst.data(), data->data(), dst.size());
  return Status::OK();
}

template <class Read>
Result<ChunkLocation> DirectFetcher::WithRelocation(const ChunkId& id, ChunkLocation loc, const Read& read) {
  // Garbage collection may move a live chunk to a new pack and delete the
  // old one between our lookup and our read: look it up again and retry.
  bool refreshed = false;
  for (int attempt = 0;; ++attempt) {
    Status st = read(loc);
    if (st.ok()) {
      if (counters_) counters_->Add(loc.stored_len);
      return loc;
    }
    if (!st.IsNotFound() || attempt >= 3) return st;
    CKPT_ASSIGN_OR_RETURN(ChunkLocation again, lookup_(id));
    if (again.pack == loc.pack && again.offset == loc.offset && refresh_ && !refreshed) {
      refreshed = true;
      CKPT_RETURN_IF_ERROR(refresh_());
      CKPT_ASSIGN_OR_RETURN(again, lookup_(id));
    }
    if (again.pack == loc.pack && again.offset == loc.offset) return st;
    loc = again;
  }
}

Result<ChunkData> DirectFetcher::Fetch(const ChunkRef& chunk) {
  CKPT_ASSIGN_OR_RETURN(ChunkLocation loc, lookup_(chunk.id));
  if (loc.raw_len != chunk.raw_len) {
    return Status::Corruption("chunk " + chunk.id.ToHex() + " has length " + std::to_string(loc.raw_len) +
                              " in pack " + loc.pack + ", expected " + std::to_string(chunk.raw_len));
  }
  auto data = buffers_ ? std::make_shared<ChunkBuffer>(buffers_->Acquire(loc.raw_len), loc.raw_len)
                       : std::make_shared<ChunkBuffer>(loc.raw_len);
  CKPT_RETURN_IF_ERROR(WithRelocation(chunk.id, loc, [&](const ChunkLocation& at) {
                         return ReadChunk(backend_, chunk.id, at, data->span(), ChunkDestination::kOwnBuffer);
                       }).status());
  return ChunkData(std::move(data));
}

Result<ChunkLocation> DirectFetcher::FetchStored(const ChunkRef& chunk, BufferPool& buffers,
                                                 BufferPool::Lease* stored) {
  CKPT_ASSIGN_OR_RETURN(ChunkLocation loc, lookup_(chunk.id));
  return WithRelocation(chunk.id, loc, [&](const ChunkLocation& at) -> Status {
    if (at.raw_len != chunk.raw_len) {
      return Status::Corruption("chunk " + chunk.id.ToHex() + " has length " + std::to_string(at.raw_len) +
                                " in pack " + at.pack + ", expected " + std::to_string(chunk.raw_len));
    }
    if (stored->capacity() < at.stored_len) *stored = buffers.Acquire(at.stored_len);
    return ReadStoredChunk(backend_, chunk.id, at, stored->first(at.stored_len));
  });
}

Status DirectFetcher::FetchInto(const ChunkRef& chunk, std::span<std::byte> dst) {
  CKPT_ASSIGN_OR_RETURN(ChunkLocation loc, lookup_(chunk.id));
  if (loc.raw_len != chunk.raw_len || dst.size() != chunk.raw_len) {
    return Status::Corruption("chunk " + chunk.id.ToHex() + " has length " + std::to_string(loc.raw_len) +
                              " in pack " + loc.pack + ", expected " + std::to_string(chunk.raw_len));
  }
  return WithRelocation(chunk.id, loc, [&](const ChunkLocation& at) {
           return ReadChunk(backend_, chunk.id, at, dst, ChunkDestination::kCallerMemory);
         }).status();
}

Result<ChunkData> CachedFetcher::Fetch(const ChunkRef& chunk) {
  return cache_->Get(chunk.id, [&] { return direct_.Fetch(chunk); });
}

Status CachedFetcher::FetchInto(const ChunkRef& chunk, std::span<std::byte> dst) {
  if (auto hit = cache_->Peek(chunk.id)) {
    if ((*hit)->size() != dst.size()) return Status::Internal("cached chunk has the wrong size");
    std::memcpy(dst.data(), (*hit)->data(), dst.size());
    cache_->Consumed(chunk.id, dst.size());
    return Status::OK();
  }
  return direct_.FetchInto(chunk, dst);
}

void CachedFetcher::Consumed(const ChunkRef& chunk, uint64_t bytes) { cache_->Consumed(chunk.id, bytes); }

}  // namespace ckptfs
