// ckpt import: safetensors files and model directories into a checkpoint.
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
#include "ckpt/describe.h"
#include "ckpt/files.h"
#include "ckpt/repository.h"
#include "commands.h"
#include "core/json.h"
#include "core/text.h"
#include "io/safetensors.h"

namespace ckptfs::cli {
namespace {

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
    {{"step", 0, true, false, "N", "training step of the checkpoint"},
     {"rank", 0, true, false, "R", "contribute as rank R (with --world-size)"},
     {"world-size", 0, true, false, "N", "number of ranks writing the checkpoint"},
     {"tag", 0, true, true, "KEY=VALUE", "attach a tag (repeatable)"},
     {"blob", 0, true, true, "NAME=FILE", "store FILE's bytes as blob NAME (repeatable)"},
     kJsonOpt},
    2, SIZE_MAX};

int CmdImport(const GlobalOptions& global, const Args& args) {
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
  auto repo = OpenRepoOr(global, &rc);
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

}  // namespace

const Command kImportCommand{&kImport, CmdImport};

}  // namespace ckptfs::cli
