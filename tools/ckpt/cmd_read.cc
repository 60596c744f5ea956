// ckpt cat and export: a checkpoint's bytes out of the repository.
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
                       {{"format", 'f', true, false, "raw|npy", "output format (default raw)"},
                        {"blob", 0, false, false, "", "TENSOR names a blob"}},
                       2, 2};

int CmdCat(const GlobalOptions& global, const Args& args) {
  std::string format = args.Get("format").value_or("raw");
  if (format != "raw" && format != "npy") return UsageError(Status::InvalidArgument("--format must be raw or npy"));
  int rc = kExitOk;
  auto repo = OpenRepoOr(global, &rc);
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

const CommandSpec kExport{
    "export", "NAME OUT", "Write a checkpoint as standard files: safetensors, Hugging Face, DCP or torch.save.",
    "--format safetensors (the default): OUT is one safetensors file of merged tensors;\n"
    "blobs are not part of it (read them with 'ckpt cat --blob').\n"
    "--format hf: OUT is a model directory: model-0000K-of-0000N.safetensors split at\n"
    "--max-shard-size as Hugging Face splits, model.safetensors.index.json, and the\n"
    "blobs named like files (config.json, tokenizer files); --prefix model. writes\n"
    "only the tensors named under model. (a training state's model), without it.\n"
    "--format dcp: OUT is a directory that dcp.load with FileSystemReader loads at any\n"
    "world size. --format torch: OUT is a directory holding model.pt, one torch.save\n"
    "file of the state dict. These three are written by the Python package with torch\n"
    "($CKPT_PYTHON, else the python3 beside ckpt, with the torch your training uses)\n"
    "into OUT.ckpt-export-partial, each file durable, and renamed to OUT when complete;\n"
    "run the same command again to resume an interrupted one, or add --clean to start\n"
    "over.",
    {{"force", 'f', false, false, "", "overwrite OUT if it exists (safetensors only)"},
     {"format", 0, true, false, "FORMAT", "safetensors (default), hf, dcp or torch"},
     {"max-shard-size", 0, true, false, "SIZE", "hf: largest shard file, as Hugging Face counts (default 5GB)"},
     {"dtype", 0, true, false, "DTYPE", "hf, dcp, torch: cast floating tensors (bfloat16, float16, float32)"},
     {"prefix", 0, true, false, "PREFIX", "hf: only the tensors whose names start with PREFIX, written without it"},
     {"clean", 0, false, false, "", "remove an interrupted export's OUT.ckpt-export-partial first"},
     kJsonOpt},
    2,
    2};

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

int CmdExport(const GlobalOptions& global, const Args& args) {
  const std::string format = args.Get("format").value_or("safetensors");
  if (format != "safetensors") {
    if (format != "hf" && format != "dcp" && format != "torch") {
      return UsageError(Status::InvalidArgument("--format must be safetensors, hf, dcp or torch, not '" + format + "'"));
    }
    if (args.Has("force")) return UsageError(Status::InvalidArgument("--force is for --format safetensors only"));
    if (args.Has("prefix") && format != "hf") {
      return UsageError(Status::InvalidArgument("--prefix is for --format hf"));
    }
    auto path = global.RepoPath();
    if (!path.ok()) return UsageError(path.status());
    std::vector<std::string> argv = {"export", "--repo", *path, "--format", format};
    if (auto dir = args.Get("cache-dir")) argv.insert(argv.end(), {"--cache-dir", *dir});
    if (auto size = args.Get("max-shard-size")) argv.insert(argv.end(), {"--max-shard-size", *size});
    if (auto dtype = args.Get("dtype")) argv.insert(argv.end(), {"--dtype", *dtype});
    if (auto prefix = args.Get("prefix")) argv.insert(argv.end(), {"--prefix", *prefix});
    if (args.Has("clean")) argv.push_back("--clean");
    if (args.Has("json")) argv.push_back("--json");
    argv.insert(argv.end(), {"--", args.positional[0], args.positional[1]});
    return ExecPythonFormats("--format " + format, argv);
  }
  if (args.Has("prefix")) return UsageError(Status::InvalidArgument("--prefix is for --format hf"));
  for (const char* option : {"max-shard-size", "dtype", "clean", "json"}) {
    if (args.Has(option)) {
      return UsageError(Status::InvalidArgument(std::string("--") + option + " is for --format hf, dcp or torch"));
    }
  }
  int rc = kExitOk;
  auto repo = OpenRepoOr(global, &rc);
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
  // Caught from before the temporary exists: a signal in between would
  // leave it behind.
  InterruptGuard interrupt;
  auto durable = DurableFile::Create(out, ExportTemporary(out, ::getpid()));
  if (!durable.ok()) return Fail(durable.status());
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

}  // namespace

const Command kCatCommand{&kCat, CmdCat};
const Command kExportCommand{&kExport, CmdExport};

}  // namespace ckptfs::cli
