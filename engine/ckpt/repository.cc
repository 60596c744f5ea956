#include "ckpt/repository.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <iterator>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "backend/store_url.h"
#include "ckpt/repository_impl.h"
#include "ckpt/state_dir.h"
#include "core/encoding.h"
#include "core/json.h"
#include "core/random.h"
#include "core/text.h"

namespace ckptfs {



Status ValidateCheckpointName(const std::string& name) {
  if (name.empty() || name.size() > 200) {
    return Status::InvalidArgument("checkpoint name must have 1 to 200 characters");
  }
  // '/'-separated groups, each part a name of its own.
  size_t start = 0;
  bool digits_only = false;
  for (size_t end = 0; end <= name.size(); ++end) {
    if (end < name.size() && name[end] != '/') {
      const char c = name[end];
      bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
                c == '_' || c == '-';
      if (!ok) {
        return Status::InvalidArgument("checkpoint name '" + EscapeForTerminal(name) +
                                       "' may hold only letters, digits, '.', '_', '-' and '/' between groups");
      }
      continue;
    }
    const std::string_view part = std::string_view(name).substr(start, end - start);
    if (part.empty()) {
      return Status::InvalidArgument("checkpoint name '" + EscapeForTerminal(name) + "' has an empty part");
    }
    if (part[0] == '.') {
      return Status::InvalidArgument("checkpoint name '" + EscapeForTerminal(name) + "' has a part that starts with '.'");
    }
    digits_only = part.find_first_not_of("0123456789") == std::string_view::npos;
    start = end + 1;
  }
  // "GROUP/DIGITS" is how the catalog names a removed checkpoint (keys::RetiredCheckpoint).
  if (digits_only && name.find('/') != std::string::npos) {
    return Status::InvalidArgument("checkpoint name '" + EscapeForTerminal(name) +
                                   "': the last part of a grouped name must not be digits only (name it "
                                   "'step-N', say)");
  }
  return Status::OK();
}

bool InGroup(std::string_view name, std::string_view group) {
  while (group.ends_with('/')) group.remove_suffix(1);  // "run1/", as a shell completes it
  if (group.empty()) return true;
  return name.size() > group.size() && name.starts_with(group) && name[group.size()] == '/';
}

Status ValidateMemberName(std::string_view kind, std::string_view name, bool allow_empty) {
  const std::string what(kind);
  if (name.empty() && !allow_empty) return Status::InvalidArgument(what + " is empty");
  if (name.size() > kMaxMemberName) {
    return Status::InvalidArgument(what + " '" + EscapeForTerminal(name.substr(0, 40)) + "...' has " +
                                   std::to_string(name.size()) + " bytes, more than the " +
                                   std::to_string(kMaxMemberName) + " allowed");
  }
  if (!IsValidUtf8(name)) {
    return Status::InvalidArgument(what + " '" + EscapeForTerminal(name) + "' is not valid UTF-8");
  }
  if (HasControlCharacter(name)) {
    return Status::InvalidArgument(what + " '" + EscapeForTerminal(name) + "' holds a control character");
  }
  return Status::OK();
}

// ---- helpers -----------------------------------------------------------------

namespace {
using keys::kCatalogDir;
using keys::kConfigFile;
using keys::kObjectsDir;
// The LMDB map at creation; it doubles on demand (docs/FORMAT.md).
constexpr uint64_t kInitialMapSize = 64ull << 20;

bool PathExists(const std::string& p) {
  struct stat sb;
  return ::stat(p.c_str(), &sb) == 0;
}

}  // namespace

Result<uint64_t> RecordPack(WriteTxn& txn, const SealedPack& pack) {
  uint64_t added = 0;
  for (const auto& e : pack.entries) {
    CKPT_ASSIGN_OR_RETURN(auto existing, txn.Get(Table::kChunks, keys::Chunk(e.id)));
    if (existing) continue;
    CKPT_RETURN_IF_ERROR(txn.Put(Table::kChunks, keys::Chunk(e.id), EncodeChunkLocation(e.location)));
    ++added;
  }
  CKPT_RETURN_IF_ERROR(txn.Put(Table::kPacks, pack.id, EncodePackInfo({pack.size, pack.entries.size()})));
  return added;
}

Status RecordManifest(WriteTxn& txn, const Manifest& m) { return RecordManifestAs(txn, m, m.checkpoint.name); }

Status RecordManifestAs(WriteTxn& txn, const Manifest& m, const std::string& name) {
  CKPT_RETURN_IF_ERROR(txn.Put(Table::kCheckpoints, keys::Checkpoint(name), EncodeCheckpoint(m.checkpoint)));
  for (const auto& t : m.tensors) CKPT_RETURN_IF_ERROR(txn.Put(Table::kTensors, keys::Member(name, t.name), EncodeTensor(t)));
  for (const auto& b : m.blobs) CKPT_RETURN_IF_ERROR(txn.Put(Table::kBlobs, keys::Member(name, b.name), EncodeBlob(b)));
  return Status::OK();
}

// ---- RepositoryImpl ----------------------------------------------------------

RepositoryImpl::~RepositoryImpl() {
  if (Forked()) {
    // The parent's threads are not in this process, its catalog environment
    // must not be closed from here, and its store may hold connections and
    // files the parent still uses: leave them all (core/fork.h).
    (void)pool.release();
    (void)catalog.release();
    (void)cache.release();
    (void)buffers.release();
    (void)backend.release();
    (void)fetcher_.release();
    (void)leases.release();
    (void)io_pool_.release();
    return;
  }
  pool.reset();
  io_pool_.reset();
  leases.reset();
}

ThreadPool& RepositoryImpl::IoPool() {
  std::call_once(io_pool_once_, [this] { io_pool_ = std::make_unique<ThreadPool>(std::max<size_t>(1, io_threads - 1)); });
  return *io_pool_;
}

Status RepositoryImpl::CheckProcess() const {
  if (!Forked()) return Status::OK();
  return Status::FailedPrecondition("repository " + path +
                                    " was opened before this process was forked: its threads and catalog belong to "
                                    "the parent; open the repository again in this process");
}

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

void RepositoryImpl::InitFetcher() {
  fetcher_ = std::make_unique<CachedFetcher>(
      cache.get(), DirectFetcher(backend.get(), [this](const ChunkId& id) { return LookupChunk(id); }, buffers.get(),
                                 protocol->RelocationRefresh(), &fetched));
}

// ---- Repository ----------------------------------------------------------------

Repository::Repository(std::unique_ptr<RepositoryImpl> impl) : impl_(std::move(impl)) {}
Repository::~Repository() = default;
const RepositoryConfig& Repository::config() const { return impl_->config; }
const std::string& Repository::path() const { return impl_->path; }
BufferPoolStats Repository::buffer_stats() const { return impl_->buffers->stats(); }
RequestCounts Repository::store_requests() const { return impl_->backend->Requests(); }
FetchCounts Repository::fetch_counts() const {
  return {impl_->fetched.chunks.load(std::memory_order_relaxed),
          impl_->fetched.stored_bytes.load(std::memory_order_relaxed)};
}

bool Repository::remote() const { return impl_->remote; }

Status Repository::Refresh() {
  CKPT_RETURN_IF_ERROR(impl_->CheckProcess());
  return impl_->protocol->Sync(SyncScope::kCheckpoints).status();
}

Result<std::string> Repository::ShareSync() {
  CKPT_RETURN_IF_ERROR(impl_->CheckProcess());
  return impl_->protocol->ShareSync(/*with_pack_indexes=*/true);
}

Status Repository::SyncFrom(std::string_view shared) {
  CKPT_RETURN_IF_ERROR(impl_->CheckProcess());
  return impl_->protocol->SyncFrom(shared).status();
}

namespace {

// A repository on an object store: ckptfs.json at the URL's location, the
// objects under URL/objects.
struct RemoteStore {
  std::string url;
  ObjectStoreOptions options;
  std::unique_ptr<Backend> root;
};

Result<RemoteStore> ConnectRemote(const std::string& url, const OpenOptions& options,
                                  bool create_bucket = false) {
  RemoteStore r;
  r.url = url;
  if (const auto known = StoreSchemes(); std::find(known.begin(), known.end(), StoreScheme(url)) == known.end()) {
    return OpenObjectStore(url, {}).status();  // names the unknown scheme
  }
  if (options.s3) {
    r.options = *options.s3;
  } else if (options.s3_settings) {
    CKPT_ASSIGN_OR_RETURN(r.options, options.s3_settings());
  } else {
    return Status::InvalidArgument("no S3 settings given for " + url +
                                   " (endpoint and credentials: OpenOptions::s3, or AWS_ENDPOINT_URL, "
                                   "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the environment of ckpt)");
  }
  CKPT_ASSIGN_OR_RETURN(r.root, OpenObjectStore(url, r.options, create_bucket));
  return r;
}

Result<std::unique_ptr<Backend>> OpenRemoteObjects(const RemoteStore& r) {
  return OpenObjectStore(ObjectStoreChild(r.url, kObjectsDir), r.options);
}

// Writes the config object of a new repository at the top of `store`
// (`where` names it in messages).
Status InitStore(Backend& store, const std::string& where, const RepositoryConfig& config) {
  auto existing = store.Size(kConfigFile);
  if (existing.ok()) return Status::AlreadyExists("'" + where + "' already holds a ckptfs repository");
  if (!existing.status().IsNotFound()) return existing.status();
  const std::string json = ConfigToJson(config).Dump(2) + "\n";
  return store.Put(kConfigFile, std::as_bytes(std::span(json)));
}

Status InitRemote(const std::string& url, const RepositoryConfig& config, const OpenOptions& options) {
  CKPT_ASSIGN_OR_RETURN(RemoteStore r, ConnectRemote(url, options, /*create_bucket=*/true));
  return InitStore(*r.root, url, config);
}

Result<std::unique_ptr<LmdbEnv>> OpenCatalog(const std::string& dir, bool create) {
  auto env = LmdbEnv::Open(dir, create, kInitialMapSize);
  if (!env.ok()) {
    // A corrupt catalog's message already says to reindex; one open in
    // this process is not damaged.
    if (env.status().IsCorruption() || env.status().detail() == StatusDetail::kCatalogOpenInProcess) {
      return env.status();
    }
    return Status(env.status().code(),
                  env.status().message() + " (if the catalog is damaged, rebuild it with 'ckpt reindex')")
        .WithDetail(env.status().detail());
  }
  return env;
}

// A fresh catalog gets its format version and sequence counter.
Status InitCatalogMeta(LmdbEnv& env) {
  return env.Update([&](WriteTxn& txn) -> Status {
    CKPT_ASSIGN_OR_RETURN(auto v, txn.Get(Table::kMeta, keys::kFormatVersionKey));
    if (v) return Status::OK();
    CKPT_RETURN_IF_ERROR(txn.Put(Table::kMeta, keys::kFormatVersionKey, EncodeFormatVersion(kFormatVersion)));
    return txn.Put(Table::kMeta, keys::kNextSequenceKey, EncodeSequence(1));
  });
}

// A repository on an object store located: its config, and the directory
// where this host keeps its state (claimed for it).
struct LocatedStore {
  RepositoryConfig config;
  std::string state_dir;
};

// Reads the config at the top of `store` (`where` names it in messages)
// and claims this host's state directory for the repository.
Result<LocatedStore> LocateStore(Backend& store, const std::string& where, const OpenOptions& options) {
  auto text = store.ReadAll(kConfigFile, kMaxSmallObject);
  if (!text.ok()) {
    if (text.status().IsNotFound() && text.status().detail() != StatusDetail::kBucketMissing) {
      return Status::NotFound("no ckptfs repository at '" + where + "' (it has no " + kConfigFile +
                              "; create one with 'ckpt init')");
    }
    return text.status();
  }
  LocatedStore r;
  std::string id;
  CKPT_ASSIGN_OR_RETURN(r.config, ParseRepositoryConfig(*text, where, where + "/" + kConfigFile, &id));
  CKPT_ASSIGN_OR_RETURN(r.state_dir, CacheDirFor(options, id));
  CKPT_RETURN_IF_ERROR(ClaimCacheDir(r.state_dir, where, id));
  return r;
}

// An S3 repository located: its store, its config and state directory.
struct RemoteRepository {
  RemoteStore store;
  LocatedStore located;
};

Result<RemoteRepository> LocateRemote(const std::string& url, const OpenOptions& options) {
  RemoteRepository r;
  CKPT_ASSIGN_OR_RETURN(r.store, ConnectRemote(url, options));
  CKPT_ASSIGN_OR_RETURN(r.located, LocateStore(*r.store.root, url, options));
  return r;
}

// The rest of opening a repository on an object store, once located and
// its objects' backend set: this host's catalog and the lock settings.
Status OpenStoreCatalog(const LocatedStore& located, const OpenOptions& options, RepositoryImpl& impl) {
  impl.remote = true;
  impl.config = located.config;
  impl.state_dir = located.state_dir;
  CKPT_ASSIGN_OR_RETURN(impl.catalog, OpenCatalog(impl.state_dir + "/" + kCatalogDir, true));
  impl.lock_options.wait = options.lock_wait;
  if (options.lock_stale_after < std::chrono::milliseconds(100)) {
    return Status::InvalidArgument("the stale time of locks must be at least 0.1 s");
  }
  impl.lock_options.stale_after = options.lock_stale_after;
  impl.lock_options.now_unix_ms = options.wall_clock;
  impl.lock_options.refresh_interval =
      std::min<std::chrono::milliseconds>(std::chrono::minutes(1), impl.lock_options.stale_after / 10);
  return InitCatalogMeta(*impl.catalog);
}

Status OpenRemote(const std::string& url, const OpenOptions& options, RepositoryImpl& impl) {
  CKPT_ASSIGN_OR_RETURN(RemoteRepository r, LocateRemote(url, options));
  CKPT_ASSIGN_OR_RETURN(impl.backend, OpenRemoteObjects(r.store));
  return OpenStoreCatalog(r.located, options, impl);
}

}  // namespace

Result<OpenOptions> OpenOptionsFromEnvironment(const Environment& env) {
  OpenOptions options;
  auto get = [&](const char* name) -> std::string {
    const char* v = env ? env(name) : nullptr;
    return v ? std::string(v) : std::string();
  };
  options.cache_dir = get("CKPT_CACHE_DIR");
  if (std::string xdg = get("XDG_CACHE_HOME"); !xdg.empty()) {
    options.cache_root = xdg + "/ckptfs";
  } else if (std::string home = get("HOME"); !home.empty()) {
    options.cache_root = home + "/.cache/ckptfs";
  }
  if (std::string stale = get("CKPT_LOCK_STALE_SECONDS"); !stale.empty()) {
    char* end = nullptr;
    const double seconds = std::strtod(stale.c_str(), &end);
    if (*end != '\0' || !(seconds >= 0.1) || seconds > 1e9) {
      return Status::InvalidArgument("CKPT_LOCK_STALE_SECONDS must be a number of seconds, at least 0.1 (not '" +
                                     stale + "')");
    }
    options.lock_stale_after = std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
  }
  options.s3_settings = [env] { return ObjectStoreOptions::FromEnvironment(env); };
  return options;
}

Result<ReindexReport> ReindexRemote(const std::string& url, const OpenOptions& options) {
  {
    CKPT_ASSIGN_OR_RETURN(RemoteRepository located, LocateRemote(url, options));
    const std::string catalog = located.located.state_dir + "/" + kCatalogDir;
    std::error_code ec;
    std::filesystem::remove_all(catalog, ec);
    if (ec) return Status::IOError("removing " + catalog + ": " + ec.message());
  }
  CKPT_ASSIGN_OR_RETURN(auto repo, Repository::Open(url, options));
  ReindexReport report;
  CKPT_ASSIGN_OR_RETURN(auto committed, repo->ListCheckpoints(false));
  report.checkpoints = committed.size();
  report.problems = repo->impl_->opening_sync.problems;
  // Open's sync left the pack indexes for later: read them all now.
  CKPT_ASSIGN_OR_RETURN(SyncReport packs, repo->impl_->protocol->Sync(SyncScope::kPacks));
  report.packs = packs.packs_added;
  report.chunks = packs.chunks_added;
  report.problems.insert(report.problems.end(), packs.problems.begin(), packs.problems.end());
  return report;
}

Status Repository::Init(const std::string& path, const RepositoryConfig& config, const OpenOptions& options) {
  CKPT_RETURN_IF_ERROR(ValidateConfig(config));
  if (IsObjectStoreUrl(path)) return InitRemote(path, config, options);
  if (PathExists(path + "/" + kConfigFile)) {
    return Status::AlreadyExists("'" + path + "' already holds a ckptfs repository");
  }
  if (PathExists(path)) {
    struct stat sb;
    ::stat(path.c_str(), &sb);
    if (!S_ISDIR(sb.st_mode)) return Status::FailedPrecondition("'" + path + "' exists and is not a directory");
  } else {
    // Missing parents are made too, as `mkdir -p` (and `git init`) would.
    std::error_code ec;
    std::filesystem::create_directories(path, ec);
    if (ec) return Status::FromErrno(ec.value(), "creating " + path);
  }
  CKPT_ASSIGN_OR_RETURN(auto backend, OpenLocalBackend(path + "/" + kObjectsDir));
  CKPT_ASSIGN_OR_RETURN(auto env, LmdbEnv::Open(path + "/" + kCatalogDir, true, kInitialMapSize));
  CKPT_RETURN_IF_ERROR(InitCatalogMeta(*env));
  // The config file goes last: a directory holding it is a complete
  // repository. Written like any object: atomically and durably.
  CKPT_ASSIGN_OR_RETURN(auto root, OpenLocalBackend(path));
  const std::string json = ConfigToJson(config).Dump(2) + "\n";
  return root->Put(kConfigFile, std::as_bytes(std::span(json)));
}

Result<std::unique_ptr<Repository>> Repository::Open(const std::string& path, const OpenOptions& options) {
  auto impl = std::make_unique<RepositoryImpl>();
  impl->path = path;
  if (IsObjectStoreUrl(path)) {
    CKPT_RETURN_IF_ERROR(OpenRemote(path, options, *impl));
  } else {
    CKPT_ASSIGN_OR_RETURN(impl->config, ReadRepositoryConfig(path));
    impl->state_dir = path;
    CKPT_ASSIGN_OR_RETURN(impl->backend, OpenLocalBackend(path + "/" + kObjectsDir));
    if (!PathExists(path + "/" + kCatalogDir + "/data.mdb")) {
      return Status::Corruption("repository '" + path + "' has no catalog; rebuild it with 'ckpt reindex'");
    }
    CKPT_ASSIGN_OR_RETURN(impl->catalog, OpenCatalog(path + "/" + kCatalogDir, false));
  }
  return FinishOpen(std::move(impl), options);
}

Status Repository::Init(Backend& store, const RepositoryConfig& config) {
  CKPT_RETURN_IF_ERROR(ValidateConfig(config));
  return InitStore(store, store.Describe(), config);
}

Result<std::unique_ptr<Repository>> Repository::Open(std::shared_ptr<Backend> store, const OpenOptions& options) {
  if (!store) return Status::InvalidArgument("no object store given");
  if (options.cache_dir.empty()) {
    return Status::InvalidArgument("a repository on a given object store needs a cache directory for its catalog");
  }
  auto impl = std::make_unique<RepositoryImpl>();
  impl->path = store->Describe();
  CKPT_ASSIGN_OR_RETURN(LocatedStore located, LocateStore(*store, impl->path, options));
  impl->backend = NewPrefixedBackend(std::move(store), kObjectsDir);
  CKPT_RETURN_IF_ERROR(OpenStoreCatalog(located, options, *impl));
  return FinishOpen(std::move(impl), options);
}

Result<std::unique_ptr<Repository>> Repository::FinishOpen(std::unique_ptr<RepositoryImpl> impl,
                                                           const OpenOptions& options) {
  const RepositoryConfig& config = impl->config;
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
  impl->io_threads = options.io_threads ? options.io_threads : kStoreRequestsInFlight;
  // Idle buffers kept: enough for every worker's chunks in flight (the
  // writer bounds those to about 4 per worker).
  impl->buffers = std::make_unique<BufferPool>(config.chunk_size, 4 * threads + 8);
  impl->cache = std::make_unique<ChunkCache>(options.cache_bytes);
  impl->protocol = impl->remote ? MakeStoreCommit(*impl) : MakeCatalogCommit(*impl);
  impl->InitFetcher();
  impl->leases = std::make_unique<LeaseRegistry>(impl->state_dir, impl->remote ? impl->backend.get() : nullptr,
                                                 impl->lock_options);
  if (options.opening_sync) {
    CKPT_ASSIGN_OR_RETURN(impl->opening_sync, impl->protocol->Sync());
  }
  return std::unique_ptr<Repository>(new Repository(std::move(impl)));
}

Result<std::vector<CheckpointRecord>> Repository::ListCheckpoints(bool include_pending) {
  CKPT_RETURN_IF_ERROR(impl_->CheckProcess());
  std::vector<CheckpointRecord> committed, pending;
  Status inner;
  CKPT_RETURN_IF_ERROR(impl_->catalog->Read([&](const ReadTxn& txn) {
    return txn.Scan(Table::kCheckpoints, "", [&](std::string_view k, std::string_view v) {
      if (keys::IsRetiredCheckpoint(k)) return true;  // removed, kept for its readers (lease.h)
      auto rec = DecodeCheckpoint(v);
      if (!rec.ok()) {
        inner = rec.status();
        return false;
      }
      if (rec->state == CheckpointState::kCommitted) {
        // A replacement committed but not yet renamed over its name: the
        // name's own record is the checkpoint (a crash in between leaves
        // it for the next save of the name, or gc, to drop).
        if (keys::IsReplacementCheckpoint(k)) return true;
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
