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
#include "ckpt/import.h"
#include "ckpt/repository.h"
#include "commands.h"
#include "core/json.h"
#include "core/text.h"
#include "io/safetensors.h"

namespace ckptfs::cli {
namespace {

const CommandSpec kImport{
    "import", "NAME PATH...",
    "Import a checkpoint (safetensors, a model directory, DCP or torch.save) as NAME.",
    "All PATHs together form one checkpoint. A PATH that is a directory (a Hugging\n"
    "Face model directory, as save_pretrained writes it) gives its *.safetensors\n"
    "files as tensors, checks them against its *.safetensors.index.json, and stores\n"
    "every other file (config.json, generation_config.json, tokenizer files) as a\n"
    "blob of the same name; subdirectories, hidden files and pytorch_model*.bin\n"
    "beside safetensors weights are left out, and said so. A symbolic link in the\n"
    "directory is followed only if it stays inside it (--dry-run lists those);\n"
    "one to elsewhere is refused unless --follow-symlinks is given. Files of\n"
    "kernel filesystems (/proc, /sys) are refused. Every input is read and\n"
    "checked before anything is written.\n"
    "A file may hold one rank's part of a\n"
    "sharded checkpoint: its __metadata__ key \"ckptfs.shards\" maps tensor names to\n"
    "{\"global_shape\": [..], \"offsets\": [..]} (a box shard) or\n"
    "{\"global_shape\": [..], \"flat_start\": N} (a flat shard of a 1-D stored tensor).\n"
    "With --rank R --world-size N only rank R's part is contributed; the checkpoint\n"
    "becomes visible when all N ranks have committed.\n"
    "A PATH that is a DCP checkpoint directory (a .metadata file beside __R_K.distcp\n"
    "files, as dcp.save with FileSystemWriter and Megatron-Core's torch_dist write),\n"
    "a torch.save file, or a model directory whose weights are torch.save files\n"
    "(pytorch_model.bin, or shards named by pytorch_model.bin.index.json, as older\n"
    "transformers wrote them) is read with torch's own readers through the Python\n"
    "package ckptfs ($CKPT_PYTHON, else the python3 beside ckpt, else python3 on\n"
    "PATH; it needs torch, the build your training uses, installed there): each\n"
    "saved DCP chunk becomes a box shard, non-tensor items\n"
    "blobs. Python runs isolated (-I): nothing is imported from the working\n"
    "directory or the user's site; only PYTHONPATH's absolute directories are kept.\n"
    "DCP's .metadata is a pickle: it is read admitting only DCP's metadata classes\n"
    "and plain values, so a file from elsewhere runs no code (with --dry-run too);\n"
    "one that names anything else is refused, naming it. --trust-pickle reads it as\n"
    "dcp.load does, for files you wrote yourself. torch.save files are read with\n"
    "torch.load(weights_only=True).",
    {{"step", 0, true, false, "N", "training step of the checkpoint"},
     {"rank", 0, true, false, "R", "contribute as rank R (with --world-size)"},
     {"world-size", 0, true, false, "N", "number of ranks writing the checkpoint"},
     {"tag", 0, true, true, "KEY=VALUE", "attach a tag (repeatable)"},
     {"blob", 0, true, true, "NAME=FILE", "store FILE's bytes as blob NAME (repeatable)"},
     {"dry-run", 'n', false, false, "", "read and check the inputs, list what would be imported, write nothing"},
     {"follow-symlinks", 0, false, false, "",
      "follow symbolic links in an imported directory wherever they point (by default only links that stay "
      "inside it are followed, and others are refused)"},
     {"trust-pickle", 0, false, false, "",
      "read a DCP .metadata pickle as torch does, whatever it names (only for files you wrote yourself)"},
     {"overwrite", 0, false, false, "",
      "replace the checkpoint NAME holds, if any, when the import commits (readers of the old version keep "
      "it until they close it); without it, an existing NAME is refused"},
     kJsonOpt},
    2, SIZE_MAX};

// Formats the engine reads itself, and those read with torch through the
// Python package (ckptfs/formats/).
enum class InputKind { kNative, kDcp, kTorch, kTorchModelDir };

InputKind KindOf(const std::string& path) {
  struct stat sb;
  if (::stat(path.c_str(), &sb) != 0) return InputKind::kNative;  // the native reader names what is wrong
  if (S_ISDIR(sb.st_mode)) {
    if (::access((path + "/.metadata").c_str(), F_OK) == 0) return InputKind::kDcp;
    return HoldsTorchWeightsOnly(path) ? InputKind::kTorchModelDir : InputKind::kNative;
  }
  if (!S_ISREG(sb.st_mode) || path.ends_with(".safetensors")) return InputKind::kNative;
  unsigned char head[4] = {};
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return InputKind::kNative;
  const ssize_t n = ::read(fd, head, sizeof head);
  ::close(fd);
  // A zip archive (torch.save since 1.6) or a pickle (older torch.save).
  if ((n == 4 && std::memcmp(head, "PK\x03\x04", 4) == 0) || (n >= 1 && head[0] == 0x80)) return InputKind::kTorch;
  return InputKind::kNative;
}

// Runs `python -m ckptfs.formats import ...` in place of this process.
int DelegateToPython(const GlobalOptions& global, const Args& args, InputKind kind) {
  const std::string& path = args.positional[1];
  const std::string what =
      "'" + path + "' is " +
      (kind == InputKind::kDcp      ? "a DCP checkpoint directory"
       : kind == InputKind::kTorch ? "a torch.save file"
                                   : "a model directory whose weights are torch.save files (pytorch_model*.bin)");
  if (args.positional.size() != 2 || args.Has("rank") || args.Has("blob")) {
    return UsageError(Status::InvalidArgument(what + ": it is imported alone, without --rank or --blob"));
  }
  auto repo = global.RepoPath();
  if (!repo.ok()) return UsageError(repo.status());
  std::vector<std::string> argv = {"import", "--repo", *repo};
  if (auto dir = args.Get("cache-dir")) argv.insert(argv.end(), {"--cache-dir", *dir});
  if (auto step = args.Get("step")) argv.insert(argv.end(), {"--step", *step});
  for (const auto& t : args.All("tag")) argv.insert(argv.end(), {"--tag", t});
  if (args.Has("dry-run")) argv.push_back("--dry-run");
  if (args.Has("trust-pickle")) argv.push_back("--trust-pickle");
  if (args.Has("follow-symlinks")) argv.push_back("--follow-symlinks");
  if (args.Has("overwrite")) argv.push_back("--overwrite");
  if (args.Has("json")) argv.push_back("--json");
  argv.insert(argv.end(), {"--", args.positional[0], path});
  return ExecPythonFormats(what, argv);
}

int CmdImport(const GlobalOptions& global, const Args& args) {
  const std::string name = args.positional[0];
  for (size_t i = 1; i < args.positional.size(); ++i) {
    if (InputKind kind = KindOf(args.positional[i]); kind != InputKind::kNative) {
      if (auto step = args.Int("step"); !step.ok()) return UsageError(step.status());
      return DelegateToPython(global, args, kind);
    }
  }
  WriterOptions wopts;
  auto step = args.Int("step");
  if (!step.ok()) return UsageError(step.status());
  wopts.step = *step;
  wopts.overwrite = args.Has("overwrite");
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
  inputs.paths.assign(args.positional.begin() + 1, args.positional.end());
  inputs.partial = args.Has("rank");
  inputs.follow_symlinks = args.Has("follow-symlinks");
  inputs.left_out = [](const std::string& what) {
    std::fprintf(stderr, "ckpt import: leaving out %s\n", EscapeForTerminal(what).c_str());
  };
  for (const auto& b : args.All("blob")) {
    size_t eq = b.find('=');
    if (eq == std::string::npos || eq == 0) return UsageError(Status::InvalidArgument("--blob must be NAME=FILE, not '" + b + "'"));
    inputs.blob_files.emplace_back(b.substr(0, eq), b.substr(eq + 1));
  }
  auto prepared = PreparedImport::Prepare(inputs);
  if (!prepared.ok()) return Fail(prepared.status());
  if (args.Has("dry-run")) {
    Json what = prepared->Describe();
    if (args.Has("json")) {
      what.Set("format", "safetensors");
      what.Set("name", name);
      what.Set("committed", false);
      PrintJson(what);
      return kExitOk;
    }
    std::printf("%s: would import\n", EscapeForTerminal(name).c_str());
    const Json::Array& tensors = what.Find("tensors")->as_array();
    const Json::Array& blobs = what.Find("blobs")->as_array();
    for (const Json& t : tensors) {
      std::printf("  %s  %s %s  %s\n", EscapeForTerminal(t.Find("name")->as_string()).c_str(),
                  t.Find("dtype")->as_string().c_str(), t.Find("shape")->Dump().c_str(),
                  HumanBytes(t.Find("bytes")->as_uint()).c_str());
    }
    for (const Json& b : blobs) {
      std::printf("  %s  (blob, %s)\n", EscapeForTerminal(b.Find("name")->as_string()).c_str(),
                  HumanBytes(b.Find("bytes")->as_uint()).c_str());
    }
    for (const Json& l : what.Find("links")->as_array()) {
      std::printf("  (symbolic link %s -> %s, followed)\n", EscapeForTerminal(l.Find("path")->as_string()).c_str(),
                  EscapeForTerminal(l.Find("target")->as_string()).c_str());
    }
    std::printf("%zu tensors, %s; %zu blobs\n", tensors.size(), HumanBytes(what.Find("tensor_bytes")->as_uint()).c_str(),
                blobs.size());
    return kExitOk;
  }
  int rc = kExitOk;
  auto repo = OpenRepoOr(global, &rc);
  if (!repo) return rc;
  auto writer = repo->BeginCheckpoint(name, wopts);
  if (!writer.ok()) return Fail(writer.status());
  Progress progress("importing " + name);
  // Ctrl-C or SIGTERM stops the import at the next tensor; the writer is
  // given up, which in a local repository deletes the packs it wrote.
  InterruptGuard interrupt;
  Status put = prepared->PutInto(**writer, [&](uint64_t d, uint64_t t) { progress.Update(d, t); },
                                 [&] { return interrupt.requested(); });
  if (interrupt.requested()) {
    (*writer)->Abort();
    progress.Finish();
    return interrupt.Exit("import of " + name,
                          repo->remote() ? "nothing became visible; the packs it wrote stay in the store until 'ckpt gc'"
                                         : "nothing of it was kept");
  }
  if (!put.ok()) return Fail(put);
  auto result = (*writer)->Commit().Wait();
  progress.Finish();
  if (!result.ok()) return Fail(result.status().WithContext("commit of '" + name + "' failed"));
  if (args.Has("json")) {
    Json j = DescribeCommitResult(*result);
    j.Set("checkpoint", name);
    j.Set("rank", static_cast<uint64_t>(wopts.rank));
    j.Set("world_size", static_cast<uint64_t>(wopts.world_size));
    j.Set("visible", result->checkpoint_visible);  // the older name of checkpoint_visible, kept
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
