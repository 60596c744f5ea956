#include "ckpt/repository.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "backend/s3_backend.h"
#include "ckpt/repository_impl.h"
#include "core/encoding.h"
#include "core/json.h"
#include "core/random.h"

namespace ckptfs {

// ---- keys ------------------------------------------------------------------

namespace keys {
std::string ManifestObject(const std::string& checkpoint) {
  return std::string(kManifestPrefix) + checkpoint + ".manifest";
}
bool ParseManifestObject(const std::string& key, std::string* checkpoint) {
  const std::string prefix = kManifestPrefix, suffix = ".manifest";
  if (key.size() <= prefix.size() + suffix.size() || key.compare(0, prefix.size(), prefix) != 0 ||
      key.compare(key.size() - suffix.size(), suffix.size(), suffix) != 0) {
    return false;
  }
  *checkpoint = key.substr(prefix.size(), key.size() - prefix.size() - suffix.size());
  return ValidateCheckpointName(*checkpoint).ok();
}
}  // namespace keys

uint64_t NowUnixMs() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                   std::chrono::system_clock::now().time_since_epoch())
                                   .count());
}

Status ValidateCheckpointName(const std::string& name) {
  if (name.empty() || name.size() > 200) {
    return Status::InvalidArgument("checkpoint name must have 1 to 200 characters");
  }
  if (name[0] == '.') return Status::InvalidArgument("checkpoint name '" + name + "' starts with '.'");
  for (char c : name) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
              c == '_' || c == '-';
    if (!ok) {
      return Status::InvalidArgument("checkpoint name '" + name +
                                     "' may hold only letters, digits, '.', '_' and '-'");
    }
  }
  return Status::OK();
}

// ---- config ----------------------------------------------------------------

namespace {
constexpr const char* kConfigFile = "ckptfs.json";
constexpr const char* kCatalogDir = "catalog";
constexpr const char* kObjectsDir = "objects";
// The LMDB map at creation; it doubles on demand (docs/FORMAT.md).
constexpr uint64_t kInitialMapSize = 64ull << 20;

bool PathExists(const std::string& p) {
  struct stat sb;
  return ::stat(p.c_str(), &sb) == 0;
}

Json ConfigToJson(const RepositoryConfig& c) {
  Json j = Json::MakeObject();
  j.Set("format", "ckptfs");
  j.Set("format_version", static_cast<uint64_t>(kFormatVersion));
  j.Set("repository_id", RandomHex(32));
  j.Set("chunk_size", c.chunk_size);
  j.Set("pack_size", c.pack_size);
  j.Set("compression", c.codec.compression == Compression::kZstd ? "zstd" : "none");
  j.Set("level", static_cast<int64_t>(c.codec.level));
  j.Set("adaptive", c.adaptive);
  return j;
}

Status ValidateConfig(const RepositoryConfig& c) {
  if (c.chunk_size % 8 != 0 || c.chunk_size < (64 << 10) || c.chunk_size > kMaxChunkSize) {
    return Status::InvalidArgument("chunk size must be a multiple of 8 between 64 KiB and 256 MiB");
  }
  if (c.pack_size < c.chunk_size) return Status::InvalidArgument("pack size must be at least the chunk size");
  if (c.codec.level < -100 || c.codec.level > 19) {
    return Status::InvalidArgument("compression level must be between -100 and 19");
  }
  return Status::OK();
}
}  // namespace

Result<RepositoryConfig> ReadRepositoryConfig(const std::string& path) {
  if (!PathExists(path)) {
    return Status::NotFound("no repository at '" + path + "': the directory does not exist (create one with 'ckpt init')");
  }
  std::string file = path + "/" + kConfigFile;
  std::ifstream f(file, std::ios::binary);
  if (!f) {
    return Status::FailedPrecondition("'" + path + "' is not a ckptfs repository (it has no " + kConfigFile + ")");
  }
  std::stringstream ss;
  ss << f.rdbuf();
  auto parsed = Json::Parse(ss.str());
  const Json* fmt = parsed.ok() ? parsed->Find("format") : nullptr;
  if (!fmt || !fmt->is_string() || fmt->as_string() != "ckptfs") {
    return Status::FailedPrecondition("'" + path + "' is not a ckptfs repository (" + kConfigFile +
                                      " is not a ckptfs config)");
  }
  const Json& j = *parsed;
  const Json* version = j.Find("format_version");
  if (!version || !version->is_uint()) return Status::Corruption(file + " lacks format_version");
  if (version->as_uint() > kFormatVersion) {
    return Status::Unsupported("repository '" + path + "' has format version " +
                               std::to_string(version->as_uint()) + "; this ckptfs reads versions up to " +
                               std::to_string(kFormatVersion) + " (upgrade ckptfs)");
  }
  RepositoryConfig c;
  auto get_uint = [&](const char* key, uint64_t* out) -> Status {
    const Json* v = j.Find(key);
    if (!v || !v->is_uint()) return Status::Corruption(file + ": '" + key + "' is missing or not a number");
    *out = v->as_uint();
    return Status::OK();
  };
  CKPT_RETURN_IF_ERROR(get_uint("chunk_size", &c.chunk_size));
  CKPT_RETURN_IF_ERROR(get_uint("pack_size", &c.pack_size));
  const Json* comp = j.Find("compression");
  if (!comp || !comp->is_string() || (comp->as_string() != "zstd" && comp->as_string() != "none")) {
    return Status::Corruption(file + ": 'compression' must be \"zstd\" or \"none\"");
  }
  c.codec.compression = comp->as_string() == "zstd" ? Compression::kZstd : Compression::kNone;
  const Json* level = j.Find("level");
  if (!level || !level->is_int()) return Status::Corruption(file + ": 'level' is missing");
  c.codec.level = static_cast<int>(level->as_int());
  const Json* adaptive = j.Find("adaptive");
  c.adaptive = adaptive && adaptive->is_bool() ? adaptive->as_bool() : true;
  CKPT_RETURN_IF_ERROR(ValidateConfig(c).WithContext(file));
  return c;
}

// ---- RepositoryImpl ----------------------------------------------------------

RepositoryImpl::~RepositoryImpl() { pool.reset(); }

Result<ChunkLocation> RepositoryImpl::LookupChunk(const ChunkId& id) const {
  ChunkLocation loc;
  Status st = catalog->Read([&](const ReadTxn& txn) -> Status {
    CKPT_ASSIGN_OR_RETURN(auto v, txn.Get(Table::kChunks, keys::Chunk(id)));
    if (!v) return Status::NotFound("chunk " + id.ToHex() + " is not in the catalog");
    CKPT_ASSIGN_OR_RETURN(loc, DecodeChunkLocation(*v));
    return Status::OK();
  });
  CKPT_RETURN_IF_ERROR(st);
  return loc;
}

Result<ChunkData> DirectFetcher::Fetch(const ChunkRef& chunk) {
  CKPT_ASSIGN_OR_RETURN(ChunkLocation loc, lookup_(chunk.id));
  if (loc.raw_len != chunk.raw_len) {
    return Status::Corruption("chunk " + chunk.id.ToHex() + " has length " + std::to_string(loc.raw_len) +
                              " in pack " + loc.pack + ", expected " + std::to_string(chunk.raw_len));
  }
  auto data = buffers_ ? std::make_shared<ChunkBuffer>(buffers_->Acquire(loc.raw_len), loc.raw_len)
                       : std::make_shared<ChunkBuffer>(loc.raw_len);
  CKPT_RETURN_IF_ERROR(ReadWithRelocation(chunk.id, loc, data->span()));
  return ChunkData(std::move(data));
}

Status DirectFetcher::ReadWithRelocation(const ChunkId& id, ChunkLocation loc, std::span<std::byte> dst) {
  // Garbage collection may move a live chunk to a new pack and delete the
  // old one between our lookup and our read: look it up again and retry.
  for (int attempt = 0;; ++attempt) {
    Status st = ReadChunk(backend_, id, loc, dst);
    if (st.ok() || !st.IsNotFound() || attempt >= 3) return st;
    CKPT_ASSIGN_OR_RETURN(ChunkLocation again, lookup_(id));
    if (again.pack == loc.pack && again.offset == loc.offset) return st;
    loc = again;
  }
}

Status DirectFetcher::FetchInto(const ChunkRef& chunk, std::span<std::byte> dst) {
  CKPT_ASSIGN_OR_RETURN(ChunkLocation loc, lookup_(chunk.id));
  if (loc.raw_len != chunk.raw_len || dst.size() != chunk.raw_len) {
    return Status::Corruption("chunk " + chunk.id.ToHex() + " has length " + std::to_string(loc.raw_len) +
                              " in pack " + loc.pack + ", expected " + std::to_string(chunk.raw_len));
  }
  return ReadWithRelocation(chunk.id, loc, dst);
}

namespace {
class CachedFetcher : public ChunkFetcher {
 public:
  explicit CachedFetcher(RepositoryImpl* repo)
      : repo_(repo),
        direct_(repo->backend.get(), [repo](const ChunkId& id) { return repo->LookupChunk(id); },
                repo->buffers.get()) {}
  Result<ChunkData> Fetch(const ChunkRef& chunk) override {
    return repo_->cache->Get(chunk.id, [&] { return direct_.Fetch(chunk); });
  }
  Status FetchInto(const ChunkRef& chunk, std::span<std::byte> dst) override {
    if (auto hit = repo_->cache->Peek(chunk.id)) {
      if ((*hit)->size() != dst.size()) return Status::Internal("cached chunk has the wrong size");
      std::memcpy(dst.data(), (*hit)->data(), dst.size());
      return Status::OK();
    }
    return direct_.FetchInto(chunk, dst);
  }

 private:
  RepositoryImpl* repo_;
  DirectFetcher direct_;
};
}  // namespace

void RepositoryImpl::InitFetcher() { fetcher_ = std::make_unique<CachedFetcher>(this); }

// ---- Repository ----------------------------------------------------------------

Repository::Repository(std::unique_ptr<RepositoryImpl> impl) : impl_(std::move(impl)) {}
Repository::~Repository() = default;
const RepositoryConfig& Repository::config() const { return impl_->config; }
const std::string& Repository::path() const { return impl_->path; }
BufferPoolStats Repository::buffer_stats() const { return impl_->buffers->stats(); }

Status RejectObjectStoreUrl(const std::string& path) {
  if (IsS3Url(path)) {
    return Status::Unsupported("'" + path + "': repositories on S3 are not supported yet (the S3 object backend " +
                               "exists, the repository on it does not); use a local path");
  }
  return Status::OK();
}

Status Repository::Init(const std::string& path, const RepositoryConfig& config) {
  CKPT_RETURN_IF_ERROR(RejectObjectStoreUrl(path));
  CKPT_RETURN_IF_ERROR(ValidateConfig(config));
  if (PathExists(path + "/" + kConfigFile)) {
    return Status::AlreadyExists("'" + path + "' already holds a ckptfs repository");
  }
  if (PathExists(path)) {
    struct stat sb;
    ::stat(path.c_str(), &sb);
    if (!S_ISDIR(sb.st_mode)) return Status::FailedPrecondition("'" + path + "' exists and is not a directory");
  } else if (::mkdir(path.c_str(), 0755) != 0) {
    return Status::FromErrno(errno, "creating " + path);
  }
  CKPT_ASSIGN_OR_RETURN(auto backend, OpenLocalBackend(path + "/" + kObjectsDir));
  CKPT_ASSIGN_OR_RETURN(auto env, LmdbEnv::Open(path + "/" + kCatalogDir, true, kInitialMapSize));
  CKPT_RETURN_IF_ERROR(env->Update([&](WriteTxn& txn) -> Status {
    CKPT_RETURN_IF_ERROR(txn.Put(Table::kMeta, keys::kFormatVersionKey, EncodeFormatVersion(kFormatVersion)));
    return txn.Put(Table::kMeta, keys::kNextSequenceKey, EncodeSequence(1));
  }));
  // The config file goes last: a directory holding it is a complete
  // repository. Written like any object: atomically and durably.
  CKPT_ASSIGN_OR_RETURN(auto root, OpenLocalBackend(path));
  const std::string json = ConfigToJson(config).Dump(2) + "\n";
  return root->Put(kConfigFile, std::as_bytes(std::span(json)));
}

Result<std::unique_ptr<Repository>> Repository::Open(const std::string& path, const OpenOptions& options) {
  CKPT_RETURN_IF_ERROR(RejectObjectStoreUrl(path));
  CKPT_ASSIGN_OR_RETURN(RepositoryConfig config, ReadRepositoryConfig(path));
  auto impl = std::make_unique<RepositoryImpl>();
  impl->path = path;
  impl->config = config;
  CKPT_ASSIGN_OR_RETURN(impl->backend, OpenLocalBackend(path + "/" + kObjectsDir));
  if (!PathExists(path + "/" + kCatalogDir + "/data.mdb")) {
    return Status::Corruption("repository '" + path + "' has no catalog; rebuild it with 'ckpt reindex'");
  }
  auto env = LmdbEnv::Open(path + "/" + kCatalogDir, false, kInitialMapSize);
  if (!env.ok()) {
    if (env.status().IsCorruption()) return env.status();  // already says to reindex
    return Status(env.status().code(), env.status().message() + " (if the catalog is damaged, rebuild it with 'ckpt reindex')");
  }
  impl->catalog = std::move(env).value();
  Status st = impl->catalog->Read([&](const ReadTxn& txn) -> Status {
    CKPT_ASSIGN_OR_RETURN(auto v, txn.Get(Table::kMeta, keys::kFormatVersionKey));
    if (!v) return Status::Corruption("catalog lacks its format version; run 'ckpt reindex'");
    CKPT_ASSIGN_OR_RETURN(uint32_t version, DecodeFormatVersion(*v));
    if (version > kFormatVersion) {
      return Status::Unsupported("catalog format version " + std::to_string(version) + " is newer than this ckptfs supports");
    }
    return Status::OK();
  });
  CKPT_RETURN_IF_ERROR(st);
  size_t threads = options.threads ? options.threads : std::max(1u, std::thread::hardware_concurrency());
  impl->pool = std::make_unique<ThreadPool>(threads);
  // Idle buffers kept: enough for every worker's chunks in flight (the
  // writer bounds those to about 4 per worker).
  impl->buffers = std::make_unique<BufferPool>(config.chunk_size, 4 * threads + 8);
  impl->cache = std::make_unique<ChunkCache>(options.cache_bytes);
  impl->InitFetcher();
  return std::unique_ptr<Repository>(new Repository(std::move(impl)));
}

Result<std::vector<CheckpointRecord>> Repository::ListCheckpoints(bool include_pending) {
  std::vector<CheckpointRecord> committed, pending;
  Status inner;
  CKPT_RETURN_IF_ERROR(impl_->catalog->Read([&](const ReadTxn& txn) {
    return txn.Scan(Table::kCheckpoints, "", [&](std::string_view, std::string_view v) {
      auto rec = DecodeCheckpoint(v);
      if (!rec.ok()) {
        inner = rec.status();
        return false;
      }
      if (rec->state == CheckpointState::kCommitted) {
        committed.push_back(std::move(rec).value());
      } else if (include_pending) {
        pending.push_back(std::move(rec).value());
      }
      return true;
    });
  }));
  CKPT_RETURN_IF_ERROR(inner);
  std::sort(committed.begin(), committed.end(),
            [](const CheckpointRecord& a, const CheckpointRecord& b) { return a.sequence < b.sequence; });
  for (auto& p : pending) committed.push_back(std::move(p));
  return committed;
}

}  // namespace ckptfs
