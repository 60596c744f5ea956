// ckpt: the command-line tool of ckptfs.
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <map>
#include <set>

#include "backend/durable_file.h"
#include "ckpt/files.h"
#include "ckpt/repository.h"
#include "ckpt/describe.h"
#include "cli.h"
#include "core/json.h"
#include "core/text.h"
#include "io/safetensors.h"
#ifdef CKPTFS_HAVE_FUSE
#include "mount.h"
#endif

namespace ckptfs::cli {
namespace {

const OptionSpec kRepoOpt{"repo", 'r', true, false, "PATH", "repository: a directory or s3://BUCKET/PREFIX (default: $CKPT_REPO)"};
const OptionSpec kJsonOpt{"json", 0, false, false, "", "print machine-readable JSON"};

Result<std::string> RepoPath(const Args& args) {
  if (auto r = args.Get("repo")) return *r;
  const char* env = std::getenv("CKPT_REPO");
  if (env && *env) return std::string(env);
  return Status::InvalidArgument("no repository given: pass -r PATH or set CKPT_REPO");
}

// A command line that cannot work: one line on stderr, exit status 2.
int UsageError(const Status& st) {
  std::fprintf(stderr, "ckpt: error: %s\n", EscapeForTerminal(st.message()).c_str());
  return kExitUsage;
}

// The operation failed: one line on stderr, exit status 1.
int Fail(const Status& st) {
  std::fprintf(stderr, "ckpt: error: %s\n", EscapeForTerminal(st.message()).c_str());
  return kExitError;
}

// SIGINT and SIGTERM during a long command: the handler only notes the
// signal; the command's loop sees it at its next chunk, undoes what it wrote
// and leaves with InterruptGuard::Exit (128 + the signal, as a shell
// reports a process the signal killed).
volatile std::sig_atomic_t g_interrupt_signal = 0;
extern "C" void OnInterrupt(int sig) { g_interrupt_signal = sig; }

class InterruptGuard {
 public:
  InterruptGuard() {
    struct sigaction sa {};
    sa.sa_handler = OnInterrupt;
    sigemptyset(&sa.sa_mask);
    ::sigaction(SIGINT, &sa, &old_int_);
    ::sigaction(SIGTERM, &sa, &old_term_);
  }
  ~InterruptGuard() {
    ::sigaction(SIGINT, &old_int_, nullptr);
    ::sigaction(SIGTERM, &old_term_, nullptr);
  }
  InterruptGuard(const InterruptGuard&) = delete;
  InterruptGuard& operator=(const InterruptGuard&) = delete;

  bool requested() const { return g_interrupt_signal != 0; }
  Status status() const {
    return Status::FailedPrecondition(std::string("interrupted by ") + (g_interrupt_signal == SIGINT ? "SIGINT" : "SIGTERM"));
  }
  // Says what stopped and what is left, and returns the exit status.
  int Exit(const std::string& what, const std::string& left) const {
    const int sig = g_interrupt_signal;
    std::fprintf(stderr, "ckpt: interrupted (%s): %s stopped; %s\n", sig == SIGINT ? "SIGINT" : "SIGTERM",
                 EscapeForTerminal(what).c_str(), left.c_str());
    return 128 + sig;
  }

 private:
  struct sigaction old_int_ {}, old_term_ {};
};

// Opens the repository that -r or CKPT_REPO names. On failure the error is
// printed and *exit_code set (2 when no repository was named).
std::unique_ptr<Repository> OpenRepoOr(const Args& args, int* exit_code) {
  auto path = RepoPath(args);
  if (!path.ok()) {
    *exit_code = UsageError(path.status());
    return nullptr;
  }
  auto repo = Repository::Open(*path);
  if (!repo.ok()) {
    *exit_code = Fail(repo.status());
    return nullptr;
  }
  return std::move(repo).value();
}

void PrintJson(const Json& j) { std::printf("%s\n", j.Dump(2).c_str()); }

// ---- init --------------------------------------------------------------------

const CommandSpec kInit{
    "init", "", "Create an empty repository.",
    "The repository directory is created if missing; it must not hold a repository already.\n"
    "For s3://BUCKET/PREFIX the bucket is created if missing.",
    {kRepoOpt,
     {"chunk-size", 0, true, false, "SIZE", "chunk size (default 4M; 64K..256M, multiple of 8)"},
     {"pack-size", 0, true, false, "SIZE", "target pack file size (default 256M)"},
     {"compression", 0, true, false, "zstd|none", "codec (default zstd)"},
     {"level", 0, true, false, "N", "zstd level, -100..19 (default 1)"},
     {"no-adaptive", 0, false, false, "", "always compress, even when the disk waits for the codec"}},
    0, 0};

int CmdInit(const Args& args) {
  auto path = RepoPath(args);
  if (!path.ok()) return UsageError(path.status());
  RepositoryConfig config;
  auto chunk_size = args.Size("chunk-size");
  auto pack_size = args.Size("pack-size");
  auto level = args.Int("level");
  for (const Status* st : {&chunk_size.status(), &pack_size.status(), &level.status()}) {
    if (!st->ok()) return UsageError(*st);
  }
  if (*chunk_size) config.chunk_size = **chunk_size;
  if (*pack_size) config.pack_size = **pack_size;
  if (*level) config.codec.level = static_cast<int>(**level);
  if (auto v = args.Get("compression")) {
    if (*v == "zstd") config.codec.compression = Compression::kZstd;
    else if (*v == "none") config.codec.compression = Compression::kNone;
    else return UsageError(Status::InvalidArgument("compression must be 'zstd' or 'none', not '" + *v + "'"));
  }
  if (args.Has("no-adaptive")) config.adaptive = false;
  Status st = Repository::Init(*path, config);
  // Init rejects option values (chunk size, level) as InvalidArgument.
  if (!st.ok()) return st.code() == StatusCode::kInvalidArgument ? UsageError(st) : Fail(st);
  std::printf("initialized ckptfs repository in %s (chunk size %s, %s level %d)\n", path->c_str(),
              HumanBytes(config.chunk_size).c_str(),
              config.codec.compression == Compression::kZstd ? "zstd" : "no compression", config.codec.level);
  return kExitOk;
}

// ---- import --------------------------------------------------------------------

// The inputs of `ckpt import`: safetensors files, and the other files of a
// model directory, which become blobs.
struct ImportInputs {
  std::vector<std::string> safetensors;
  std::vector<std::pair<std::string, std::string>> blob_files;  // blob name, path
  std::vector<std::string> indexes;                            // *.safetensors.index.json
};

bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

// A directory (a Hugging Face model directory written by save_pretrained)
// gives its *.safetensors files as tensors, its *.safetensors.index.json as a
// check, and every other regular file as a blob of the same name.
// Subdirectories and hidden files are left out, and said so.
Status AddImportPath(const std::string& path, ImportInputs* in) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return Status::FromErrno(errno, "reading " + path);
  if (!S_ISDIR(st.st_mode)) {
    in->safetensors.push_back(path);
    return Status::OK();
  }
  DIR* d = ::opendir(path.c_str());
  if (!d) return Status::FromErrno(errno, "listing " + path);
  std::vector<std::string> names;
  while (const dirent* e = ::readdir(d)) names.emplace_back(e->d_name);
  ::closedir(d);
  std::sort(names.begin(), names.end());
  const size_t before = in->safetensors.size() + in->blob_files.size();
  for (const auto& n : names) {
    if (n == "." || n == "..") continue;
    const std::string full = path + "/" + n;
    if (::stat(full.c_str(), &st) != 0) return Status::FromErrno(errno, "reading " + full);
    if (n[0] == '.' || !S_ISREG(st.st_mode)) {
      std::fprintf(stderr, "ckpt import: leaving out %s (%s)\n", full.c_str(),
                   n[0] == '.' ? "a hidden file" : S_ISDIR(st.st_mode) ? "a directory" : "not a regular file");
      continue;
    }
    if (EndsWith(n, ".safetensors")) {
      in->safetensors.push_back(full);
    } else if (EndsWith(n, ".safetensors.index.json")) {
      in->indexes.push_back(full);
    } else {
      in->blob_files.emplace_back(n, full);
    }
  }
  if (in->safetensors.size() + in->blob_files.size() == before) {
    return Status::InvalidArgument(path + " holds no files to import");
  }
  return Status::OK();
}

// Blobs are held in memory whole while a checkpoint is imported.
constexpr uint64_t kMaxBlobBytes = uint64_t{1} << 30;

// A regular file (after symbolic links) of at most `limit` bytes, whole.
// Opened without blocking, so a FIFO is refused instead of waited on.
Result<std::string> ReadRegularFile(const std::string& path, uint64_t limit) {
  int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return Status::FromErrno(errno, "opening " + path);
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return Status::InvalidArgument(path + " is not a regular file");
  }
  if (static_cast<uint64_t>(st.st_size) > limit) {
    ::close(fd);
    return Status::InvalidArgument(path + " has " + std::to_string(st.st_size) + " bytes, more than the " +
                                   std::to_string(limit) + " such a file may have");
  }
  std::string data(static_cast<size_t>(st.st_size), '\0');
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = ::read(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      Status err = n < 0 ? Status::FromErrno(errno, "reading " + path)
                         : Status::IOError(path + " became shorter while it was read");
      ::close(fd);
      return err;
    }
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  return data;
}

// A safetensors index must name exactly the tensors the files hold, each in
// the file that holds it.
Status CheckSafetensorsIndex(const std::string& index_path,
                             const std::vector<std::unique_ptr<SafetensorsFile>>& files) {
  auto text = ReadRegularFile(index_path, 64 << 20);
  if (!text.ok()) return text.status();
  auto index = Json::Parse(*text, text->size() / 4 + 64);
  if (!index.ok()) return index.status().WithContext(index_path);
  const Json* map = index->Find("weight_map");
  if (!map || !map->is_object()) return Status::InvalidArgument(index_path + ": no \"weight_map\" object");
  std::map<std::string, std::string> where;  // tensor -> file name
  for (const auto& f : files) {
    const std::string base = f->path().substr(f->path().find_last_of('/') + 1);
    for (const auto& t : f->header().tensors) where[t.name] = base;
  }
  for (const auto& [tensor, file] : map->as_object()) {
    auto it = where.find(tensor);
    if (!file.is_string()) return Status::InvalidArgument(index_path + ": the file of '" + tensor + "' is not a string");
    if (it == where.end()) {
      return Status::InvalidArgument(index_path + " names tensor '" + tensor + "' (in " + file.as_string() +
                                     "), which no imported file holds");
    }
    if (it->second != file.as_string()) {
      return Status::InvalidArgument(index_path + " places tensor '" + tensor + "' in " + file.as_string() +
                                     ", but it is in " + it->second);
    }
  }
  if (map->as_object().size() != where.size()) {
    for (const auto& [tensor, file] : where) {
      if (!map->Find(tensor)) {
        return Status::InvalidArgument(index_path + " does not name tensor '" + tensor + "' of " + file);
      }
    }
  }
  return Status::OK();
}

const CommandSpec kImport{
    "import", "NAME PATH...", "Import safetensors files, or model directories, as checkpoint NAME.",
    "All PATHs together form one checkpoint. A PATH that is a directory (a Hugging\n"
    "Face model directory, as save_pretrained writes it) gives its *.safetensors\n"
    "files as tensors, checks them against its *.safetensors.index.json, and stores\n"
    "every other file (config.json, generation_config.json, tokenizer files) as a\n"
    "blob of the same name; subdirectories and hidden files are left out, and said\n"
    "so. Every input is read and checked before anything is written.\n"
    "A file may hold one rank's part of a\n"
    "sharded checkpoint: its __metadata__ key \"ckptfs.shards\" maps tensor names to\n"
    "{\"global_shape\": [..], \"offsets\": [..]} (a box shard) or\n"
    "{\"global_shape\": [..], \"flat_start\": N} (a flat shard of a 1-D stored tensor).\n"
    "With --rank R --world-size N only rank R's part is contributed; the checkpoint\n"
    "becomes visible when all N ranks have committed.",
    {kRepoOpt,
     {"step", 0, true, false, "N", "training step of the checkpoint"},
     {"rank", 0, true, false, "R", "contribute as rank R (with --world-size)"},
     {"world-size", 0, true, false, "N", "number of ranks writing the checkpoint"},
     {"tag", 0, true, true, "KEY=VALUE", "attach a tag (repeatable)"},
     {"blob", 0, true, true, "NAME=FILE", "store FILE's bytes as blob NAME (repeatable)"},
     kJsonOpt},
    2, SIZE_MAX};

int CmdImport(const Args& args) {
  const std::string name = args.positional[0];
  WriterOptions wopts;
  auto step = args.Int("step");
  if (!step.ok()) return UsageError(step.status());
  wopts.step = *step;
  if (args.Has("rank") != args.Has("world-size")) {
    return UsageError(Status::InvalidArgument("--rank and --world-size go together"));
  }
  auto rank = args.Int("rank");
  auto world = args.Int("world-size");
  if (!rank.ok()) return UsageError(rank.status());
  if (!world.ok()) return UsageError(world.status());
  if (*rank) {
    if (**world < 1 || **world > UINT32_MAX || **rank < 0 || **rank >= **world) {
      return UsageError(Status::InvalidArgument("--rank must be in [0, --world-size) and --world-size at least 1"));
    }
    wopts.rank = static_cast<uint32_t>(**rank);
    wopts.world_size = static_cast<uint32_t>(**world);
  }
  for (const auto& t : args.All("tag")) {
    size_t eq = t.find('=');
    if (eq == std::string::npos || eq == 0) return UsageError(Status::InvalidArgument("--tag must be KEY=VALUE, not '" + t + "'"));
    wopts.tags.emplace_back(t.substr(0, eq), t.substr(eq + 1));
    if (Status st = ValidateMemberName("tag", wopts.tags.back().first); !st.ok()) return Fail(st);
    if (Status st = ValidateMemberName("tag value", wopts.tags.back().second, true); !st.ok()) return Fail(st);
  }
  if (Status st = ValidateCheckpointName(name); !st.ok()) return Fail(st);
  if (name == "latest") {
    return Fail(Status::InvalidArgument("'latest' is reserved: the mount shows it as a link to the newest checkpoint"));
  }
  // Read and check every input before anything is written.
  ImportInputs inputs;
  for (size_t i = 1; i < args.positional.size(); ++i) {
    Status st = AddImportPath(args.positional[i], &inputs);
    if (!st.ok()) return Fail(st);
  }
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  std::vector<std::vector<SafetensorsShard>> shard_lists;
  uint64_t total = 0;
  for (const auto& path : inputs.safetensors) {
    auto f = SafetensorsFile::Open(path);
    if (!f.ok()) return Fail(f.status());
    auto shards = ShardsOfSafetensors((*f)->header());
    if (!shards.ok()) return Fail(shards.status().WithContext(path));
    for (const auto& t : (*f)->header().tensors) {
      Status name_ok = ValidateMemberName("tensor name", t.name);
      if (!name_ok.ok()) return Fail(name_ok.WithContext(path));
      total += t.end - t.begin;
    }
    files.push_back(std::move(f).value());
    shard_lists.push_back(std::move(shards).value());
  }
  // Without --rank the files must hold every element of each tensor. Too
  // few is a rank's part of a sharded checkpoint given alone: refused now,
  // rather than at the commit after every byte was written. (Gaps between
  // parts that do add up are still found at the commit.)
  if (!args.Has("rank")) {
    std::map<std::string_view, std::pair<uint64_t, uint64_t>> held;  // name -> (elements held, elements)
    for (size_t fi = 0; fi < files.size(); ++fi) {
      for (const SafetensorsShard& shard : shard_lists[fi]) {
        auto& h = held[files[fi]->header().tensors[shard.tensor].name];
        h.first += shard.region.NumElements();
        h.second = NumElements(shard.global_shape);
      }
    }
    for (const auto& [tensor, h] : held) {
      if (h.first < h.second) {
        return Fail(Status::InvalidArgument(
            "tensor '" + std::string(tensor) + "': the files hold " + std::to_string(h.first) + " of its " +
            std::to_string(h.second) + " elements; nothing was written. To import one rank's part of a sharded "
            "checkpoint, give --rank R --world-size N (the other ranks' imports complete it)"));
      }
    }
  }
  for (const auto& index : inputs.indexes) {
    Status st = CheckSafetensorsIndex(index, files);
    if (!st.ok()) return Fail(st);
  }
  struct BlobInput {
    std::string name;
    std::string data;
  };
  std::vector<BlobInput> blobs;
  for (const auto& [blob_name, path] : inputs.blob_files) {
    auto data = ReadRegularFile(path, kMaxBlobBytes);
    if (!data.ok()) return Fail(data.status());
    total += data->size();
    blobs.push_back({blob_name, std::move(data).value()});
  }
  for (const auto& b : args.All("blob")) {
    size_t eq = b.find('=');
    if (eq == std::string::npos || eq == 0) return UsageError(Status::InvalidArgument("--blob must be NAME=FILE, not '" + b + "'"));
    // A regular file after symbolic links (not a FIFO, a device such as
    // /dev/zero, or a directory), read whole with every error checked.
    auto data = ReadRegularFile(b.substr(eq + 1), kMaxBlobBytes);
    if (!data.ok()) return Fail(data.status().WithContext("--blob " + b.substr(0, eq)));
    blobs.push_back({b.substr(0, eq), std::move(data).value()});
    if (Status st = ValidateMemberName("blob name", blobs.back().name); !st.ok()) return Fail(st);
    total += blobs.back().data.size();
  }
  int rc = kExitOk;
  auto repo = OpenRepoOr(args, &rc);
  if (!repo) return rc;
  auto writer = repo->BeginCheckpoint(name, wopts);
  if (!writer.ok()) return Fail(writer.status());
  Progress progress("importing " + name);
  uint64_t done = 0;
  // Ctrl-C or SIGTERM stops the import at the next tensor; the writer is
  // given up, which in a local repository deletes the packs it wrote.
  InterruptGuard interrupt;
  auto interrupted = [&] {
    (*writer)->Abort();
    progress.Finish();
    return interrupt.Exit("import of " + name,
                          repo->remote() ? "nothing became visible; the packs it wrote stay in the store until 'ckpt gc'"
                                         : "nothing of it was kept");
  };
  for (size_t fi = 0; fi < files.size(); ++fi) {
    const auto& f = *files[fi];
    for (const SafetensorsShard& shard : shard_lists[fi]) {
      if (interrupt.requested()) return interrupted();
      const SafetensorsTensor& t = f.header().tensors[shard.tensor];
      TensorInfo info{t.name, t.dtype, shard.global_shape};
      HostSource source(f.Data(t));
      Status st = (*writer)->PutShard(info, shard.region, source);
      if (!st.ok()) return Fail(st.WithContext(f.path()));
      done += t.end - t.begin;
      progress.Update(done, total);
    }
  }
  for (const auto& b : blobs) {
    if (interrupt.requested()) return interrupted();
    Status st = (*writer)->PutBlob(b.name, std::as_bytes(std::span(b.data)));
    if (!st.ok()) return Fail(st);
    done += b.data.size();
    progress.Update(done, total);
  }
  if (interrupt.requested()) return interrupted();
  auto result = (*writer)->Commit().Wait();
  progress.Finish();
  if (!result.ok()) return Fail(result.status().WithContext("commit of '" + name + "' failed"));
  if (args.Has("json")) {
    Json j = Json::MakeObject();
    j.Set("checkpoint", name);
    j.Set("rank", static_cast<uint64_t>(wopts.rank));
    j.Set("world_size", static_cast<uint64_t>(wopts.world_size));
    j.Set("checkpoint_visible", result->checkpoint_visible);  // the name Python uses
    j.Set("visible", result->checkpoint_visible);             // the older name, kept
    j.Set("logical_bytes", result->logical_bytes);
    j.Set("stored_bytes", result->stored_bytes);
    j.Set("chunks_written", result->chunks_written);
    j.Set("chunks_deduplicated", result->chunks_deduplicated);
    PrintJson(j);
  } else {
    std::printf("%s rank %u/%u: %s imported, %s stored (%llu new chunks, %llu deduplicated)%s\n", name.c_str(), wopts.rank,
                wopts.world_size, HumanBytes(result->logical_bytes).c_str(), HumanBytes(result->stored_bytes).c_str(),
                static_cast<unsigned long long>(result->chunks_written),
                static_cast<unsigned long long>(result->chunks_deduplicated),
                result->checkpoint_visible ? "; checkpoint committed" : "; waiting for the other ranks");
  }
  return kExitOk;
}

// ---- ls / show ------------------------------------------------------------------

const CommandSpec kLs{"ls", "", "List checkpoints in commit order.", "",
                      {kRepoOpt, {"all", 'a', false, false, "", "include pending (uncommitted) checkpoints"}, kJsonOpt},
                      0, 0};

int CmdLs(const Args& args) {
  int rc = kExitOk;
  auto repo = OpenRepoOr(args, &rc);
  if (!repo) return rc;
  auto list = repo->ListCheckpoints(args.Has("all"));
  if (!list.ok()) return Fail(list.status());
  if (args.Has("json")) {
    Json j = Json::MakeArray();
    for (const auto& c : *list) j.Push(DescribeRecord(c));
    PrintJson(j);
    return kExitOk;
  }
  if (list->empty()) {
    std::printf("no checkpoints\n");
    return kExitOk;
  }
  std::printf("%-28s %-10s %8s %8s %12s  %s\n", "NAME", "STEP", "RANKS", "TENSORS", "SIZE", "COMMITTED");
  for (const auto& c : *list) {
    const bool committed = c.state == CheckpointState::kCommitted;
    std::string ranks = std::to_string(c.committed_ranks.size()) + "/" + std::to_string(c.world_size);
    const std::string when = committed ? FormatUnixMs(c.committed_unix_ms)
                                       : "(pending since " + FormatUnixMs(c.created_unix_ms) + "; missing ranks " +
                                             RanksToString(MissingRanks(c)) + ")";
    std::printf("%-28s %-10s %8s %8llu %12s  %s\n", c.name.c_str(), c.step ? std::to_string(*c.step).c_str() : "-",
                committed ? std::to_string(c.world_size).c_str() : ranks.c_str(),
                static_cast<unsigned long long>(c.tensor_count), HumanBytes(c.logical_bytes).c_str(), when.c_str());
  }
  return kExitOk;
}

const CommandSpec kShow{"show", "NAME [TENSOR...]", "Show a checkpoint: tensors, dtypes, shapes, shard layout, sizes.",
                        "With --stats, each tensor's statistics instead (the TENSORs, or every tensor):\n"
                        "NaN, infinite and zero counts, and over the finite elements min, max, mean,\n"
                        "standard deviation and L2 norm, read in one streaming pass.",
                        {kRepoOpt, kJsonOpt, {"stats", 0, false, false, "", "read the tensors and show their statistics"}},
                        1, SIZE_MAX};

int ShowStats(Repository& repo, const Args& args) {
  std::vector<std::string> tensors(args.positional.begin() + 1, args.positional.end());
  Progress progress("reading " + args.positional[0]);
  auto stats = repo.Stats(args.positional[0], tensors, [&](uint64_t d, uint64_t t) { progress.Update(d, t); });
  progress.Finish();
  if (!stats.ok()) return Fail(stats.status());
  if (args.Has("json")) {
    Json j = Json::MakeArray();
    for (const auto& s : *stats) j.Push(DescribeTensorStats(s));
    PrintJson(j);
    return kExitOk;
  }
  auto num = [](const std::optional<double>& v) {
    char buf[32] = "-";
    if (v) std::snprintf(buf, sizeof buf, "%.6g", *v);
    return std::string(buf);
  };
  std::printf("%-40s %-8s %10s %10s %10s %12s %12s %12s %12s %12s\n", "TENSOR", "DTYPE", "NAN", "INF", "ZERO", "MIN",
              "MAX", "MEAN", "STD", "L2");
  for (const auto& s : *stats) {
    std::printf("%-40s %-8s %10llu %10llu %10llu %12s %12s %12s %12s %12s\n", EscapeForTerminal(s.name).c_str(),
                std::string(DTypeName(s.dtype)).c_str(), static_cast<unsigned long long>(s.nan_count),
                static_cast<unsigned long long>(s.inf_count), static_cast<unsigned long long>(s.zero_count),
                num(s.min).c_str(), num(s.max).c_str(), num(s.mean).c_str(), num(s.std).c_str(),
                num(s.l2_norm).c_str());
  }
  return kExitOk;
}

int CmdShow(const Args& args) {
  int rc = kExitOk;
  auto repo = OpenRepoOr(args, &rc);
  if (!repo) return rc;
  if (args.Has("stats")) return ShowStats(*repo, args);
  if (args.positional.size() > 1) {
    return UsageError(Status::InvalidArgument("TENSOR names go with --stats (see 'ckpt show --help')"));
  }
  auto reader = repo->OpenCheckpoint(args.positional[0]);
  if (!reader.ok()) {
    // A pending checkpoint: what it waits for.
    auto all = repo->ListCheckpoints(true);
    if (all.ok()) {
      for (const auto& c : *all) {
        if (c.name != args.positional[0] || c.state == CheckpointState::kCommitted) continue;
        // On an object store: where each rank that began runs (hosts of
        // missing ranks that began tell a hung rank from one never started).
        auto ranks = repo->PendingRanks(c.name);
        if (!ranks.ok()) return Fail(ranks.status());
        if (args.Has("json")) {
          Json j = DescribeRecord(c);
          if (repo->remote()) j.Set("ranks_started", DescribePendingRanks(*ranks));
          PrintJson(j);
          return kExitOk;
        }
        std::printf("checkpoint %s (pending: not visible until every rank has committed)\n", c.name.c_str());
        std::printf("  step:      %s\n", c.step ? std::to_string(*c.step).c_str() : "-");
        std::printf("  ranks:     %zu of %u committed (%s); missing %s\n", c.committed_ranks.size(), c.world_size,
                    RanksToString(c.committed_ranks).c_str(), RanksToString(MissingRanks(c)).c_str());
        std::printf("  since:     %s (the first rank's commit)\n", FormatUnixMs(c.created_unix_ms).c_str());
        if (repo->remote()) {
          std::set<uint32_t> began;
          for (const auto& r : *ranks) {
            began.insert(r.rank);
            std::printf("  rank %-5u %s on %s (pid %llu), began %s\n", r.rank, r.committed ? "committed" : "saving   ",
                        r.host.empty() ? "?" : EscapeForTerminal(r.host).c_str(),
                        static_cast<unsigned long long>(r.pid), FormatUnixMs(r.started_unix_ms).c_str());
          }
          std::vector<uint32_t> never;
          for (uint32_t r : MissingRanks(c)) {
            if (!began.count(r)) never.push_back(r);
          }
          if (!never.empty()) std::printf("  not begun: %s (no save in progress)\n", RanksToString(never).c_str());
        }
        std::printf("  remove it: ckpt rm %s (its ranks' data then goes with the next gc)\n", c.name.c_str());
        return kExitOk;
      }
    }
    return Fail(reader.status());
  }
  auto stored = (*reader)->StoredBytes();
  if (!stored.ok()) return Fail(stored.status());
  const auto& info = (*reader)->info();
  if (args.Has("json")) {
    auto j = DescribeCheckpoint(**reader);
    if (!j.ok()) return Fail(j.status());
    PrintJson(*j);
    return kExitOk;
  }
  std::printf("checkpoint %s\n", info.name.c_str());
  std::printf("  step:      %s\n", info.step ? std::to_string(*info.step).c_str() : "-");
  std::printf("  ranks:     %u\n", info.world_size);
  std::printf("  committed: %s\n", FormatUnixMs(info.committed_unix_ms).c_str());
  for (const auto& [k, v] : info.tags) {
    std::printf("  tag:       %s=%s\n", EscapeForTerminal(k).c_str(), EscapeForTerminal(v).c_str());
  }
  std::printf("  size:      %s logical, %s stored\n", HumanBytes(info.logical_bytes).c_str(), HumanBytes(stored->total).c_str());
  std::printf("\n%-40s %-8s %-18s %10s %10s  %s\n", "TENSOR", "DTYPE", "SHAPE", "SIZE", "STORED", "SHARDS");
  for (size_t i = 0; i < (*reader)->tensors().size(); ++i) {
    const TensorRecord& t = (*reader)->tensors()[i];
    std::printf("%-40s %-8s %-18s %10s %10s  %zu\n", EscapeForTerminal(t.name).c_str(), std::string(DTypeName(t.dtype)).c_str(),
                ShapeToString(t.shape).c_str(), HumanBytes(t.ByteSize()).c_str(), HumanBytes(stored->tensors[i]).c_str(),
                t.shards.size());
    for (const auto& s : t.shards) {
      std::string ranks;
      for (uint32_t r : s.ranks) ranks += (ranks.empty() ? "" : ",") + std::to_string(r);
      std::printf("    %-36s ranks %s\n", s.region.ToString().c_str(), ranks.c_str());
    }
  }
  if (!(*reader)->blobs().empty()) {
    std::printf("\n%-40s %10s\n", "BLOB", "SIZE");
    for (const auto& b : (*reader)->blobs()) std::printf("%-40s %10s\n", EscapeForTerminal(b.name).c_str(), HumanBytes(b.size).c_str());
  }
  return kExitOk;
}

// ---- cat / export ----------------------------------------------------------------

Status WriteFd(int fd, const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t w = ::write(fd, c, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return Status::FromErrno(errno, "writing output");
    }
    c += w;
    n -= static_cast<size_t>(w);
  }
  return Status::OK();
}

constexpr uint64_t kCopyPiece = 64ull << 20;

// Passes bytes [from, file.size) of `file` to `sink` in large pieces.
Status StreamFile(const CheckpointFiles& files, const CheckpointFile& file, uint64_t from,
                  const std::function<Status(std::span<const std::byte>)>& sink, Progress* progress) {
  std::vector<std::byte> buf(std::min<uint64_t>(kCopyPiece, std::max<uint64_t>(file.size - from, 1)));
  for (uint64_t off = from; off < file.size; off += buf.size()) {
    const uint64_t n = std::min<uint64_t>(buf.size(), file.size - off);
    CKPT_RETURN_IF_ERROR(files.Read(file, off, std::span(buf.data(), n)));
    CKPT_RETURN_IF_ERROR(sink(std::span(buf.data(), n)));
    if (progress) progress->Update(off + n - from, file.size - from);
  }
  return Status::OK();
}

// The files of committed checkpoint `name` (ckpt/files.h).
Result<std::unique_ptr<CheckpointFiles>> FilesOf(Repository& repo, const std::string& name) {
  CKPT_ASSIGN_OR_RETURN(auto reader, repo.OpenCheckpoint(name));
  return CheckpointFiles::Build(std::move(reader));
}

const CommandSpec kCat{"cat", "NAME TENSOR", "Write a whole merged tensor (or a blob) to stdout.",
                       "With --format npy the output is a .npy file; BF16 and F8 tensors are written\n"
                       "as unsigned integers of the same width (the bits are exact).",
                       {kRepoOpt,
                        {"format", 'f', true, false, "raw|npy", "output format (default raw)"},
                        {"blob", 0, false, false, "", "TENSOR names a blob"}},
                       2, 2};

int CmdCat(const Args& args) {
  std::string format = args.Get("format").value_or("raw");
  if (format != "raw" && format != "npy") return UsageError(Status::InvalidArgument("--format must be raw or npy"));
  int rc = kExitOk;
  auto repo = OpenRepoOr(args, &rc);
  if (!repo) return rc;
  auto files = FilesOf(*repo, args.positional[0]);
  if (!files.ok()) return Fail(files.status());
  if (::isatty(STDOUT_FILENO)) {
    return Fail(Status::InvalidArgument("refusing to write binary data to a terminal; redirect stdout"));
  }
  const std::string& name = args.positional[1];
  const CheckpointReader& reader = (*files)->reader();
  const CheckpointFile* file = nullptr;
  uint64_t from = 0;
  if (args.Has("blob")) {
    auto b = reader.GetBlob(name);
    if (!b.ok()) return Fail(b.status());
    file = &(*files)->blob_file(static_cast<size_t>(*b - reader.blobs().data()));
  } else {
    auto t = reader.GetTensor(name);
    if (!t.ok()) return Fail(t.status());
    // The .npy file of the mount; raw output is the same without its header.
    file = &(*files)->tensor_file(static_cast<size_t>(*t - reader.tensors().data()));
    if (format == "raw") from = (*files)->HeaderSize(*file);
  }
  Progress progress("reading " + name);
  Status st = StreamFile(**files, *file, from, [](std::span<const std::byte> piece) {
    return WriteFd(STDOUT_FILENO, piece.data(), piece.size());
  }, &progress);
  progress.Finish();
  return st.ok() ? kExitOk : Fail(st);
}

const CommandSpec kExport{"export", "NAME OUT.safetensors", "Write a checkpoint as one safetensors file of merged tensors.",
                          "Blobs are not part of safetensors; read them with 'ckpt cat --blob'.",
                          {kRepoOpt, {"force", 'f', false, false, "", "overwrite OUT if it exists"}}, 2, 2};

// The temporary an export by process `pid` writes beside `out`.
std::string ExportTemporary(const std::string& out, pid_t pid) { return out + ".ckpt-tmp-" + std::to_string(pid); }

// Whether `out` may be written: absent, or (with --force) a regular file.
// A symbolic link, FIFO, device or directory is never replaced.
Status CheckExportTarget(const std::string& out, bool force) {
  struct stat sb;
  if (::lstat(out.c_str(), &sb) != 0) {
    if (errno == ENOENT) return Status::OK();
    return Status::FromErrno(errno, "checking " + out);
  }
  if (!force) return Status::AlreadyExists(out + " exists (use --force to overwrite)");
  if (S_ISREG(sb.st_mode)) return Status::OK();
  const char* kind = S_ISLNK(sb.st_mode) ? "a symbolic link" : S_ISDIR(sb.st_mode) ? "a directory"
                     : S_ISFIFO(sb.st_mode) ? "a FIFO" : S_ISCHR(sb.st_mode) || S_ISBLK(sb.st_mode) ? "a device"
                     : "not a regular file";
  return Status::FailedPrecondition(out + " is " + kind + "; --force replaces only regular files");
}

// Removes the temporaries beside `out` that exports killed before they
// finished left behind (their process is gone), saying so.
void RemoveStaleExportTemporaries(const std::string& out) {
  const size_t slash = out.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : out.substr(0, slash);
  const std::string prefix = (slash == std::string::npos ? out : out.substr(slash + 1)) + ".ckpt-tmp-";
  DIR* d = ::opendir(dir.c_str());
  if (!d) return;
  std::vector<std::string> stale;
  while (const dirent* e = ::readdir(d)) {
    const std::string n = e->d_name;
    if (n.rfind(prefix, 0) != 0) continue;
    const std::string digits = n.substr(prefix.size());
    if (digits.empty() || digits.size() > 9 || digits.find_first_not_of("0123456789") != std::string::npos) continue;
    const pid_t pid = static_cast<pid_t>(std::stol(digits));
    if (::kill(pid, 0) != 0 && errno == ESRCH) stale.push_back(dir + "/" + n);
  }
  ::closedir(d);
  for (const auto& path : stale) {
    if (::unlink(path.c_str()) == 0) {
      std::fprintf(stderr, "ckpt export: removed %s, left by an export that did not finish\n",
                   EscapeForTerminal(path).c_str());
    }
  }
}

int CmdExport(const Args& args) {
  int rc = kExitOk;
  auto repo = OpenRepoOr(args, &rc);
  if (!repo) return rc;
  auto files = FilesOf(*repo, args.positional[0]);
  if (!files.ok()) return Fail(files.status());
  const std::string out = args.positional[1];
  const bool force = args.Has("force");
  if (Status st = CheckExportTarget(out, force); !st.ok()) return Fail(st);
  RemoveStaleExportTemporaries(out);
  // The mount's model.safetensors, written atomically and durably.
  const CheckpointFile& file = (*files)->safetensors_file();
  Progress progress("exporting " + args.positional[0]);
  auto durable = DurableFile::Create(out, ExportTemporary(out, ::getpid()));
  if (!durable.ok()) return Fail(durable.status());
  InterruptGuard interrupt;
  Status st = StreamFile(**files, file, 0, [&](std::span<const std::byte> piece) {
    if (interrupt.requested()) return interrupt.status();
    return (*durable)->Append(piece);
  }, &progress);
  // What is at OUT now is checked again: it may have appeared, or changed
  // kind, while the export ran. Without --force the file is linked into
  // place, which fails if anything took the name meanwhile.
  if (st.ok() && force) st = CheckExportTarget(out, force);
  if (st.ok()) st = (*durable)->Commit(/*replace=*/force);
  if (st.IsAlreadyExists()) st = Status::AlreadyExists(out + " appeared while the export ran; it was kept (use --force to replace it)");
  progress.Finish();
  if (!st.ok()) {
    (*durable)->Abort();
    if (interrupt.requested()) return interrupt.Exit("export of " + args.positional[0], "nothing was written to " + out);
    return Fail(st);
  }
  std::printf("exported %s: %zu tensors, %s to %s\n", args.positional[0].c_str(), (*files)->reader().tensors().size(),
              HumanBytes(file.size).c_str(), out.c_str());
  return kExitOk;
}

// ---- verify / reindex --------------------------------------------------------------

const CommandSpec kVerify{"verify", "[NAME]", "Re-read and re-hash every chunk; check every tensor is tiled exactly.",
                          "Without NAME the whole repository is checked, including chunks no checkpoint\n"
                          "references and every pack index. Exits 1 when a problem is found.",
                          {kRepoOpt, kJsonOpt}, 0, 1};

int CmdVerify(const Args& args) {
  int rc = kExitOk;
  auto repo = OpenRepoOr(args, &rc);
  if (!repo) return rc;
  std::optional<std::string> name;
  if (!args.positional.empty()) name = args.positional[0];
  Progress progress("verifying");
  auto report = repo->Verify(name, [&](uint64_t d, uint64_t t) { progress.Update(d, t); });
  progress.Finish();
  if (!report.ok()) return Fail(report.status());
  if (args.Has("json")) {
    Json j = Json::MakeObject();
    j.Set("ok", report->ok());
    j.Set("checkpoints", report->checkpoints);
    j.Set("tensors", report->tensors);
    j.Set("chunks", report->chunks);
    j.Set("bytes", report->bytes);
    Json problems = Json::MakeArray();
    for (const auto& p : report->problems) {
      Json pj = Json::MakeObject();
      pj.Set("checkpoint", p.checkpoint);
      pj.Set("what", p.what);
      pj.Set("message", p.message);
      problems.Push(std::move(pj));
    }
    j.Set("problems", std::move(problems));
    PrintJson(j);
  } else {
    for (const auto& p : report->problems) {
      std::fprintf(stderr, "problem: %s%s%s: %s\n", p.checkpoint.c_str(), p.checkpoint.empty() ? "" : " ",
                   EscapeForTerminal(p.what).c_str(), EscapeForTerminal(p.message).c_str());
    }
    std::printf("verified %llu checkpoints, %llu tensors, %llu chunks (%s): %s\n",
                static_cast<unsigned long long>(report->checkpoints), static_cast<unsigned long long>(report->tensors),
                static_cast<unsigned long long>(report->chunks), HumanBytes(report->bytes).c_str(),
                report->ok() ? "ok" : (std::to_string(report->problems.size()) + " problems").c_str());
  }
  if (!report->ok()) {
    std::fprintf(stderr, "ckpt: error: verify found %zu problems\n", report->problems.size());
    return kExitError;
  }
  return kExitOk;
}

const CommandSpec kReindex{"reindex", "", "Rebuild the catalog from pack files and manifests alone.",
                           "Use when the catalog is lost or damaged. No other process may use the\n"
                           "repository meanwhile. Uncommitted checkpoints are dropped.",
                           {kRepoOpt, kJsonOpt}, 0, 0};

int CmdReindex(const Args& args) {
  auto path = RepoPath(args);
  if (!path.ok()) return UsageError(path.status());
  Progress progress("reindexing");
  auto report = Repository::Reindex(*path, [&](uint64_t d, uint64_t t) { progress.Update(d, t); });
  progress.Finish();
  if (!report.ok()) return Fail(report.status());
  for (const auto& p : report->problems) std::fprintf(stderr, "warning: %s\n", EscapeForTerminal(p).c_str());
  if (args.Has("json")) {
    Json j = Json::MakeObject();
    j.Set("packs", report->packs);
    j.Set("chunks", report->chunks);
    j.Set("checkpoints", report->checkpoints);
    Json problems = Json::MakeArray();
    for (const auto& p : report->problems) problems.Push(p);
    j.Set("problems", std::move(problems));
    PrintJson(j);
  } else {
    std::printf("rebuilt catalog: %llu checkpoints, %llu packs, %llu chunks\n",
                static_cast<unsigned long long>(report->checkpoints), static_cast<unsigned long long>(report->packs),
                static_cast<unsigned long long>(report->chunks));
  }
  if (!report->problems.empty()) {
    // The catalog is rebuilt from everything else; what was skipped is lost
    // to it, which a script must be able to tell.
    std::fprintf(stderr, "ckpt: error: reindex skipped %zu damaged objects (warnings above)\n",
                 report->problems.size());
    return kExitError;
  }
  return kExitOk;
}

// ---- rm / mount -----------------------------------------------------------------

const CommandSpec kRm{"rm", "NAME...", "Remove checkpoints (all or none); 'ckpt gc' reclaims their space.",
                      "Committed and pending checkpoints can be removed. If any NAME is unknown,\n"
                      "nothing is removed. The names go at once; like unlink(2), files open through\n"
                      "a mount (and mmaps of them) and open readers keep reading, on every host, and\n"
                      "the first gc after the last of them closed reclaims the space.",
                      {kRepoOpt}, 1, SIZE_MAX};

int CmdRm(const Args& args) {
  int rc = kExitOk;
  auto repo = OpenRepoOr(args, &rc);
  if (!repo) return rc;
  Status st = repo->RemoveCheckpoints(args.positional);
  if (!st.ok()) return Fail(st);
  for (const auto& n : args.positional) std::printf("removed %s\n", n.c_str());
  return kExitOk;
}

const CommandSpec kMount{
    "mount", "MOUNTPOINT", "Show the repository as a read-only filesystem of whole tensors.",
    "MOUNTPOINT/latest is a link to the newest checkpoint; MOUNTPOINT/NAME/ holds\n"
    "<tensor>.npy files, model.safetensors, metadata.json and blobs/. Tensor names\n"
    "are escaped ('/' -> %2F, '%' -> %25). Unmount with 'fusermount3 -u MOUNTPOINT'\n"
    "(or Ctrl-C / SIGTERM with --foreground).",
    {kRepoOpt,
     {"foreground", 'f', false, false, "", "stay in the foreground (default: daemonize once mounted)"},
     {"allow-other", 0, false, false, "", "let other users read the mount (needs user_allow_other)"},
     {"cache-size", 0, true, false, "SIZE", "decoded-chunk cache bound (default 1G)"},
     {"prefetch", 0, true, false, "N", "chunks decoded ahead of sequential readers (default 8)"},
     {"readahead", 0, true, false, "SIZE", "kernel readahead of the mount, needs root (default 16M; 0: kernel default)"},
     {"poll", 0, true, false, "SECONDS", "how often new and removed checkpoints show (default 1; 5 on S3)"},
     {"debug", 'd', false, false, "", "log every FUSE request (implies --foreground)"}},
    1, 1};

int CmdMount(const Args& args) {
#ifdef CKPTFS_HAVE_FUSE
  auto path = RepoPath(args);
  if (!path.ok()) return UsageError(path.status());
  mount::MountOptions o;
  o.repository = *path;
  o.mountpoint = args.positional[0];
  o.foreground = args.Has("foreground") || args.Has("debug");
  o.debug = args.Has("debug");
  o.allow_other = args.Has("allow-other");
  auto cache = args.Size("cache-size");
  auto prefetch = args.Int("prefetch", 0);
  auto readahead = args.Size("readahead");
  for (const Status* st : {&cache.status(), &prefetch.status(), &readahead.status()}) {
    if (!st->ok()) return UsageError(*st);
  }
  if (*cache) o.cache_bytes = **cache;
  if (*prefetch) o.prefetch_chunks = static_cast<size_t>(**prefetch);
  if (*readahead) o.readahead_bytes = **readahead;
  if (auto poll = args.Get("poll")) {
    char* end = nullptr;
    const double seconds = std::strtod(poll->c_str(), &end);
    if (poll->empty() || *end != '\0' || !(seconds >= 0.1 && seconds <= 3600)) {
      return UsageError(Status::InvalidArgument("--poll takes seconds between 0.1 and 3600, not '" + *poll + "'"));
    }
    o.poll_seconds = seconds;
  }
  Status st = mount::RunMount(o);
  return st.ok() ? kExitOk : Fail(st);
#else
  (void)args;
  return Fail(Status::Unsupported("this ckpt was built without libfuse3; install libfuse3-dev and rebuild"));
#endif
}

// ---- du / diff / gc ------------------------------------------------------------------

const CommandSpec kDu{"du", "[NAME...]", "Show the space checkpoints use, and what deduplication and compression save.",
                      "Per checkpoint: logical bytes, the stored bytes of the chunks it references, and\n"
                      "the stored bytes only it references (what removing it alone would reclaim).",
                      {kRepoOpt, kJsonOpt}, 0, SIZE_MAX};

// What gc would reclaim inside recorded packs: referenced neither by a
// committed checkpoint, nor by a pending rank, nor by a removed checkpoint
// (which gc reclaims only once nobody reads it).
uint64_t Reclaimable(const UsageReport& r) {
  const uint64_t kept = r.referenced_bytes + r.pending_bytes + r.retired_bytes;
  return r.pack_bytes > kept ? r.pack_bytes - kept : 0;
}

int CmdDu(const Args& args) {
  int rc = kExitOk;
  auto repo = OpenRepoOr(args, &rc);
  if (!repo) return rc;
  auto r = repo->DiskUsage(args.positional);
  if (!r.ok()) return Fail(r.status());
  if (args.Has("json")) {
    Json j = Json::MakeObject();
    Json list = Json::MakeArray();
    for (const auto& e : r->checkpoints) {
      Json ej = Json::MakeObject();
      ej.Set("name", e.name);
      ej.Set("logical_bytes", e.logical_bytes);
      ej.Set("referenced_bytes", e.referenced_bytes);
      ej.Set("exclusive_bytes", e.exclusive_bytes);
      list.Push(std::move(ej));
    }
    j.Set("checkpoints", std::move(list));
    Json t = Json::MakeObject();
    t.Set("logical_bytes", r->logical_bytes);
    t.Set("unique_raw_bytes", r->unique_raw_bytes);
    t.Set("referenced_bytes", r->referenced_bytes);
    t.Set("pack_bytes", r->pack_bytes);
    t.Set("pending_bytes", r->pending_bytes);
    t.Set("unreferenced_bytes", r->unreferenced_bytes);
    t.Set("removed_bytes", r->retired_bytes);
    t.Set("removed_checkpoints", r->retired_checkpoints);
    t.Set("garbage_bytes", Reclaimable(*r));
    if (!repo->remote()) {
      t.Set("unrecorded_packs", r->unrecorded_packs);
      t.Set("unrecorded_pack_bytes", r->unrecorded_pack_bytes);
    }
    t.Set("dedup_ratio", r->dedup_ratio());
    t.Set("compression_ratio", r->compression_ratio());
    j.Set("total", std::move(t));
    PrintJson(j);
    return kExitOk;
  }
  std::printf("%-28s %12s %12s %12s\n", "NAME", "LOGICAL", "REFERENCED", "EXCLUSIVE");
  for (const auto& e : r->checkpoints) {
    std::printf("%-28s %12s %12s %12s\n", e.name.c_str(), HumanBytes(e.logical_bytes).c_str(),
                HumanBytes(e.referenced_bytes).c_str(), HumanBytes(e.exclusive_bytes).c_str());
  }
  std::printf("\ntotal: %s logical, %s after dedup, %s stored (%s in packs: %s pending, %s reclaimable by gc)\n",
              HumanBytes(r->logical_bytes).c_str(), HumanBytes(r->unique_raw_bytes).c_str(),
              HumanBytes(r->referenced_bytes).c_str(), HumanBytes(r->pack_bytes).c_str(),
              HumanBytes(r->pending_bytes).c_str(), HumanBytes(Reclaimable(*r)).c_str());
  if (r->retired_checkpoints) {
    std::printf("%llu removed checkpoints: %s only they use (gc reclaims it once no reader has them open)\n",
                static_cast<unsigned long long>(r->retired_checkpoints), HumanBytes(r->retired_bytes).c_str());
  }
  if (r->unrecorded_packs) {
    std::printf("%llu packs of interrupted saves: %s (gc deletes them)\n",
                static_cast<unsigned long long>(r->unrecorded_packs), HumanBytes(r->unrecorded_pack_bytes).c_str());
  }
  std::printf("dedup ratio %.2fx, compression ratio %.2fx, overall %.2fx\n", r->dedup_ratio(), r->compression_ratio(),
              r->referenced_bytes ? double(r->logical_bytes) / r->referenced_bytes : 1.0);
  return kExitOk;
}

const CommandSpec kDiff{"diff", "A B", "Compare two checkpoints tensor by tensor, and their blobs.",
                        "For each tensor and blob: whether it changed, the fraction of A's bytes in\n"
                        "chunks B shares and how many of A's chunks B lacks; for floating-point\n"
                        "tensors the largest and the mean |a - b| and the relative L2 change\n"
                        "||b - a|| / ||a||. Without --all, unchanged ones are counted, not listed\n"
                        "(in --json too).",
                        {kRepoOpt, kJsonOpt, {"all", 'a', false, false, "", "list unchanged tensors and blobs too"}}, 2, 2};

const char* DiffKindName(TensorDiff::Kind k) {
  switch (k) {
    case TensorDiff::Kind::kUnchanged: return "unchanged";
    case TensorDiff::Kind::kChanged: return "changed";
    case TensorDiff::Kind::kOnlyInA: return "removed";
    case TensorDiff::Kind::kOnlyInB: return "added";
    case TensorDiff::Kind::kTypeChanged: return "dtype/shape changed";
  }
  return "?";
}

int CmdDiff(const Args& args) {
  int rc = kExitOk;
  auto repo = OpenRepoOr(args, &rc);
  if (!repo) return rc;
  auto diffs = repo->Diff(args.positional[0], args.positional[1]);
  if (!diffs.ok()) return Fail(diffs.status());
  const bool all = args.Has("all");
  // JSON numbers cannot be infinite: an infinite difference is the string "inf".
  auto number = [](const std::optional<double>& v) {
    if (!v) return Json();
    return std::isinf(*v) ? Json("inf") : Json(*v);
  };
  if (args.Has("json")) {
    Json j = Json::MakeArray();
    for (const auto& d : *diffs) {
      if (d.kind == TensorDiff::Kind::kUnchanged && !all) continue;
      Json dj = Json::MakeObject();
      dj.Set("name", d.name);
      dj.Set("kind", d.blob ? "blob" : "tensor");
      dj.Set("status", DiffKindName(d.kind));
      dj.Set("changed", d.kind != TensorDiff::Kind::kUnchanged);
      dj.Set("shared_fraction", d.shared_fraction);
      dj.Set("chunks", d.chunks);
      dj.Set("changed_chunks", d.changed_chunks);
      dj.Set("max_abs_diff", number(d.max_abs_diff));
      dj.Set("mean_abs_diff", number(d.mean_abs_diff));
      dj.Set("relative_l2", number(d.relative_l2));
      j.Push(std::move(dj));
    }
    PrintJson(j);
    return kExitOk;
  }
  size_t changed = 0, tensors = 0, blobs = 0, changed_blobs = 0;
  std::printf("%-48s %-20s %8s %9s %12s %12s %12s\n", "TENSOR / BLOB", "STATUS", "SHARED", "CHUNKS", "MAX |A-B|",
              "MEAN |A-B|", "REL L2");
  for (const auto& d : *diffs) {
    const bool differs = d.kind != TensorDiff::Kind::kUnchanged;
    (d.blob ? blobs : tensors) += 1;
    if (differs) (d.blob ? changed_blobs : changed) += 1;
    if (!differs && !all) continue;
    char shared[16] = "-", chunks[48] = "-", max_diff[32] = "-", mean[32] = "-", l2[32] = "-";
    if (d.kind == TensorDiff::Kind::kChanged || d.kind == TensorDiff::Kind::kUnchanged) {
      std::snprintf(shared, sizeof shared, "%.1f%%", 100 * d.shared_fraction);
      std::snprintf(chunks, sizeof chunks, "%llu/%llu", static_cast<unsigned long long>(d.changed_chunks),
                    static_cast<unsigned long long>(d.chunks));
    }
    if (d.max_abs_diff) std::snprintf(max_diff, sizeof max_diff, "%.6g", *d.max_abs_diff);
    if (d.mean_abs_diff) std::snprintf(mean, sizeof mean, "%.6g", *d.mean_abs_diff);
    if (d.relative_l2) std::snprintf(l2, sizeof l2, "%.3g", *d.relative_l2);
    const std::string name = (d.blob ? "blob " : "") + EscapeForTerminal(d.name);
    std::printf("%-48s %-20s %8s %9s %12s %12s %12s\n", name.c_str(), DiffKindName(d.kind), shared, chunks, max_diff,
                mean, l2);
  }
  std::printf("%zu of %zu tensors differ, %zu of %zu blobs\n", changed, tensors, changed_blobs, blobs);
  return kExitOk;
}

const CommandSpec kGc{
    "gc", "", "Apply a retention policy, then reclaim the space no checkpoint uses.",
    "Checkpoints are ordered by step (by commit order when some have no step). The\n"
    "--keep-* options together say what stays; without any, nothing is removed and\n"
    "only unreferenced data is reclaimed. A policy that would remove the newest\n"
    "committed checkpoint (or all of them, as --keep-last 0 would) is refused unless\n"
    "--allow-removing-newest is given; pending checkpoints are never removed. Packs\n"
    "left mostly dead (less than half live) are rewritten. gc waits for saves in\n"
    "progress, and new saves wait for it. A removed checkpoint that a reader still\n"
    "has open (through a mount, on any host, or in a process) keeps its data until\n"
    "the first gc after it is closed.",
    {kRepoOpt,
     {"keep-last", 0, true, false, "N", "keep the newest N checkpoints"},
     {"keep-every", 0, true, false, "K", "keep checkpoints whose step is a multiple of K"},
     {"keep-within", 0, true, false, "DURATION",
      "keep checkpoints committed within DURATION of the newest (s, m, h, d, w: 36h, 1w2d)"},
     {"keep", 0, true, true, "NAME", "keep this checkpoint (repeatable)"},
     {"allow-removing-newest", 0, false, false, "",
      "let the policy remove the newest committed checkpoint (or every checkpoint)"},
     {"dry-run", 'n', false, false, "", "show what would be removed and reclaimed; change nothing"},
     kJsonOpt},
    0, 0};

int CmdGc(const Args& args) {
  GcOptions o;
  auto keep_last = args.Int("keep-last", 0);
  auto keep_every = args.Int("keep-every", 1);
  if (!keep_last.ok()) return UsageError(keep_last.status());
  if (!keep_every.ok()) return UsageError(keep_every.status());
  if (*keep_last) o.retention.keep_last = static_cast<uint64_t>(**keep_last);
  if (*keep_every) o.retention.keep_every = static_cast<uint64_t>(**keep_every);
  if (auto within = args.Get("keep-within")) {
    auto seconds = ParseDuration(*within);
    if (!seconds.ok()) return UsageError(Status::InvalidArgument("--keep-within: " + seconds.status().message()));
    o.retention.keep_within_s = *seconds;
  }
  o.retention.keep = args.All("keep");
  o.retention.allow_removing_newest = args.Has("allow-removing-newest");
  o.dry_run = args.Has("dry-run");
  int rc = kExitOk;
  auto repo = OpenRepoOr(args, &rc);
  if (!repo) return rc;
  auto plan = repo->PlanRetention(o.retention);
  if (!plan.ok()) return Fail(plan.status());
  if (!args.Has("json")) {
    for (const auto& n : *plan) std::printf("%s %s\n", o.dry_run ? "would remove" : "removing", n.c_str());
  }
  Progress progress("rewriting packs");
  o.on_phase = [&](const std::string& what) {
    progress.Finish();  // a phase line never lands inside a progress line
    Phase("gc", what);
  };
  auto r = repo->CollectGarbage(o, [&](uint64_t d, uint64_t t) { progress.Update(d, t); });
  progress.Finish();
  if (!r.ok()) return Fail(r.status());
  if (args.Has("json")) {
    Json j = DescribeGcReport(*r, o.dry_run);
    PrintJson(j);
    return kExitOk;
  }
  std::printf("%s %s (%llu dead chunks, %llu packs deleted, %llu rewritten, %llu orphaned); %s in packs %s, %s live\n",
              o.dry_run ? "would reclaim" : "reclaimed", HumanBytes(r->bytes_reclaimed()).c_str(),
              static_cast<unsigned long long>(r->dead_chunks), static_cast<unsigned long long>(r->packs_deleted),
              static_cast<unsigned long long>(r->packs_rewritten), static_cast<unsigned long long>(r->orphan_packs),
              HumanBytes(r->bytes_after).c_str(), o.dry_run ? "after it" : "now", HumanBytes(r->live_bytes).c_str());
  if (r->retired_kept) {
    std::printf("%llu removed checkpoints are still open for reading (a mount or a process): their space is\n"
                "reclaimed by the first gc after they are closed\n",
                static_cast<unsigned long long>(r->retired_kept));
  }
  return kExitOk;
}

struct Command {
  const CommandSpec* spec;
  int (*run)(const Args&);
};

const Command kCommands[] = {
    {&kInit, CmdInit}, {&kImport, CmdImport}, {&kLs, CmdLs},         {&kShow, CmdShow},
    {&kCat, CmdCat},   {&kExport, CmdExport}, {&kVerify, CmdVerify}, {&kReindex, CmdReindex},
    {&kRm, CmdRm},     {&kMount, CmdMount},   {&kDu, CmdDu},         {&kDiff, CmdDiff},
    {&kGc, CmdGc},
};

void MainHelp(FILE* out) {
  std::fprintf(out,
               "usage: ckpt COMMAND [options] [args]\n\n"
               "ckptfs: a deduplicating, compressed store for sharded training checkpoints.\n\n"
               "commands:\n");
  for (const auto& c : kCommands) std::fprintf(out, "  %-10s %s\n", c.spec->name.c_str(), c.spec->summary.c_str());
  std::fprintf(out,
               "\nThe repository comes from -r/--repo PATH (before or after the command) or $CKPT_REPO:\n"
               "a directory, or s3://BUCKET/PREFIX on an S3 store (AWS_ENDPOINT_URL, AWS_REGION,\n"
               "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY). For S3, each host keeps its catalog in\n"
               "--cache-dir DIR or $CKPT_CACHE_DIR (default: ~/.cache/ckptfs/REPOSITORY-ID).\n"
               "Run 'ckpt COMMAND --help' for a command's options.\n");
}

}  // namespace
}  // namespace ckptfs::cli

namespace {

// SIGBUS in ckpt comes from a memory-mapped file that is damaged or was
// truncated while mapped: the LMDB catalog (LMDB trusts its pages and can
// follow a damaged one past the end of the file) or a safetensors input.
// Say so in one line instead of dying with "Bus error".
void OnBusError(int) {
  static const char kMessage[] =
      "ckpt: error: a memory-mapped file is damaged or was truncated while in use: the repository's catalog "
      "(rebuild it with 'ckpt reindex'; packs and manifests are not affected) or an input file\n";
  ssize_t ignored = ::write(STDERR_FILENO, kMessage, sizeof kMessage - 1);
  (void)ignored;
  ::_exit(1);
}

}  // namespace

// Global options may come before the command, as in `ckpt -r REPO ls`
// (restic's and git's order): they are moved behind the command name, where
// every command parses them. Returns the reordered arguments, or nullopt
// when a global option lacks its value.
std::optional<std::vector<char*>> MoveGlobalOptionsBehindCommand(int argc, char** argv) {
  std::vector<char*> globals, rest;
  int i = 1;
  for (; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-r" || a == "--repo") {
      if (i + 1 >= argc) return std::nullopt;
      globals.push_back(argv[i]);
      globals.push_back(argv[++i]);
    } else if ((a.size() > 2 && a.compare(0, 2, "-r") == 0) || a.rfind("--repo=", 0) == 0) {
      globals.push_back(argv[i]);
    } else {
      break;
    }
  }
  std::vector<char*> out = {argv[0]};
  if (i < argc) out.push_back(argv[i++]);  // the command
  out.insert(out.end(), globals.begin(), globals.end());
  for (; i < argc; ++i) out.push_back(argv[i]);
  return out;
}

// --cache-dir DIR, accepted anywhere before "--" by every command, sets
// CKPT_CACHE_DIR (where a repository on S3 keeps this host's catalog) and
// is removed from the arguments; so are --progress, --progress=json and
// --quiet, which set how long operations report progress. False when
// --cache-dir lacks its value.
bool TakeCacheDirOption(int* argc, char** argv) {
  int out = 1;
  bool ok = true;
  for (int i = 1; i < *argc; ++i) {
    const std::string a = argv[i];
    if (a == "--") {
      while (i < *argc) argv[out++] = argv[i++];
      break;
    }
    if (a == "--progress") {
      ckptfs::cli::SetProgressMode(ckptfs::cli::ProgressMode::kOn);
    } else if (a == "--progress=json") {
      ckptfs::cli::SetProgressMode(ckptfs::cli::ProgressMode::kJson);
    } else if (a == "--quiet") {
      ckptfs::cli::SetProgressMode(ckptfs::cli::ProgressMode::kOff);
    } else if (a == "--cache-dir") {
      if (i + 1 >= *argc || argv[i + 1][0] == '\0') {
        ok = false;
        continue;
      }
      ::setenv("CKPT_CACHE_DIR", argv[++i], 1);
    } else if (a.rfind("--cache-dir=", 0) == 0) {
      ::setenv("CKPT_CACHE_DIR", a.c_str() + 12, 1);
    } else {
      argv[out++] = argv[i];
    }
  }
  *argc = out;
  return ok;
}

int main(int raw_argc, char** raw_argv) {
  using namespace ckptfs::cli;
  std::signal(SIGBUS, OnBusError);
  if (!TakeCacheDirOption(&raw_argc, raw_argv)) {
    std::fprintf(stderr, "ckpt: error: option --cache-dir needs a value\n");
    return kExitUsage;
  }
  auto reordered = MoveGlobalOptionsBehindCommand(raw_argc, raw_argv);
  if (!reordered) {
    std::fprintf(stderr, "ckpt: error: option -r/--repo needs a value\n");
    return kExitUsage;
  }
  const int argc = static_cast<int>(reordered->size());
  char** argv = reordered->data();
  if (argc < 2 || std::strcmp(argv[1], "-h") == 0 || std::strcmp(argv[1], "--help") == 0 ||
      std::strcmp(argv[1], "help") == 0) {
    MainHelp(argc < 2 ? stderr : stdout);
    return argc < 2 ? kExitUsage : kExitOk;
  }
  if (std::strcmp(argv[1], "--version") == 0) {
    std::printf("ckpt (ckptfs) %s, repository format %u\n", CKPTFS_VERSION, ckptfs::kFormatVersion);
    return kExitOk;
  }
  for (const auto& c : kCommands) {
    if (c.spec->name != argv[1]) continue;
    bool help = false;
    auto args = Parse(*c.spec, argc, argv, 2, &help);
    if (!args.ok()) {
      std::fprintf(stderr, "ckpt %s: error: %s\n", argv[1], args.status().message().c_str());
      return kExitUsage;
    }
    if (help) return kExitOk;
    return c.run(*args);
  }
  std::fprintf(stderr, "ckpt: error: unknown command '%s' (see 'ckpt --help')\n", argv[1]);
  return kExitUsage;
}
