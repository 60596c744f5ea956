// Internals shared by the repository, writer, reader and maintenance code.
// Not part of the public API.
#pragma once

#include <atomic>
#include <memory>
#include <string>

#include "backend/backend.h"
#include "ckpt/merge.h"
#include "ckpt/repository.h"
#include "core/buffer_pool.h"
#include "core/thread_pool.h"
#include "meta/catalog_schema.h"
#include "meta/lmdb_env.h"
#include "store/chunk_cache.h"

namespace ckptfs {

// Catalog keys (docs/FORMAT.md). One module builds them all.
// Object names in the backend (the catalog's keys are meta/catalog_schema.h's).
namespace keys {
std::string ManifestObject(const std::string& checkpoint);
bool ParseManifestObject(const std::string& key, std::string* checkpoint);
inline constexpr const char* kManifestPrefix = "manifests/";
inline constexpr const char* kPackPrefix = "packs/";
}  // namespace keys

class RepositoryImpl {
 public:
  // Finishes the worker pool's queued tasks (prefetches use the fetcher,
  // the cache and the catalog) before any member they use is destroyed.
  ~RepositoryImpl();

  std::string path;
  RepositoryConfig config;
  std::unique_ptr<Backend> backend;
  std::unique_ptr<LmdbEnv> catalog;
  // Chunk-sized buffers for decoded chunks (the cache holds them), encoded
  // chunks and staged source bytes. Declared before the cache, so it is
  // destroyed after it.
  std::unique_ptr<BufferPool> buffers;
  std::unique_ptr<ChunkCache> cache;
  std::unique_ptr<ThreadPool> pool;

  // Location of a committed chunk; NotFound when the catalog lacks it.
  Result<ChunkLocation> LookupChunk(const ChunkId& id) const;
  // Fetches through the shared cache.
  ChunkFetcher* fetcher() { return fetcher_.get(); }
  void InitFetcher();

  // Encoded chunks waiting for any pack writer of this process: the
  // adaptive codec's view of whether the disk keeps up.
  std::atomic<int64_t> queued_chunks{0};

 private:
  std::unique_ptr<ChunkFetcher> fetcher_;
};

// Reads a chunk by location lookup, without caching.
class DirectFetcher : public ChunkFetcher {
 public:
  using Lookup = std::function<Result<ChunkLocation>(const ChunkId&)>;
  // Decoded chunks are leased from `buffers` (allocated per chunk when null).
  DirectFetcher(Backend* backend, Lookup lookup, BufferPool* buffers = nullptr)
      : backend_(backend), lookup_(std::move(lookup)), buffers_(buffers) {}
  Result<ChunkData> Fetch(const ChunkRef& chunk) override;
  Status FetchInto(const ChunkRef& chunk, std::span<std::byte> dst) override;

 private:
  Status ReadWithRelocation(const ChunkId& id, ChunkLocation loc, std::span<std::byte> dst);
  Backend* backend_;
  Lookup lookup_;
  BufferPool* buffers_;
};

Result<RepositoryConfig> ReadRepositoryConfig(const std::string& path);
// Unsupported for an s3:// URL: the repository layer is local-only so far.
Status RejectObjectStoreUrl(const std::string& path);
uint64_t NowUnixMs();

}  // namespace ckptfs
