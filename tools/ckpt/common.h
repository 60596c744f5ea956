// What the commands of ckpt share: the global options, read once; messages
// and exit statuses; interruption; opening the repository.
#pragma once

#include <csignal>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/repository.h"
#include "cli.h"
#include "core/json.h"

namespace ckptfs::cli {

inline const OptionSpec kJsonOpt{"json", 0, false, false, "", "print machine-readable JSON"};

// The global options (kGlobalOptions) and the environment, read in one
// place (GlobalOptions::From) and handed to every command.
struct GlobalOptions {
  std::optional<std::string> repo;  // -r/--repo, else $CKPT_REPO
  ProgressMode progress = ProgressMode::kAuto;
  // How the engine opens the repository: $CKPT_CACHE_DIR or --cache-dir,
  // the default cache root under $XDG_CACHE_HOME or $HOME,
  // $CKPT_LOCK_STALE_SECONDS, and the S3 settings of AWS_* (read when the
  // repository is on S3). See docs/CLI.md, "Environment".
  OpenOptions open;

  static Result<GlobalOptions> From(const Args& args);
  // The repository's path or URL; InvalidArgument when none was named.
  Result<std::string> RepoPath() const;
};

// A command line that cannot work: one line on stderr, exit status 2.
int UsageError(const Status& st);
// The operation failed: one line on stderr, exit status 1.
int Fail(const Status& st);

// Opens the repository that -r or CKPT_REPO names. On failure the error is
// printed and *exit_code set (2 when no repository was named).
std::unique_ptr<Repository> OpenRepoOr(const GlobalOptions& global, int* exit_code);

// The shared tier that the fast tier `fast` names (a local repository
// with a shared-tier file: ckpt/tiers.h), opened with the global options;
// null when `fast` names none.
Result<std::unique_ptr<Repository>> OpenSharedTier(const GlobalOptions& global, const Repository& fast);

void PrintJson(const Json& j);

// Runs `python -m ckptfs.formats ARGS...` in place of this process: the
// formats read or written with torch (DCP, torch.save). The Python is
// $CKPT_PYTHON, else the python3 beside this ckpt (a virtual environment's
// bin/), else python3 on PATH; one that cannot import ckptfs gets one line
// naming `what` and what to install (exit 1). The command's
// progress mode is passed on as --progress=auto|on|json|off after ARGS[0].
int ExecPythonFormats(const std::string& what, const std::vector<std::string>& args);

// SIGINT and SIGTERM during a long command: the handler only notes the
// signal; the command's loop sees it at its next chunk, undoes what it wrote
// and leaves with InterruptGuard::Exit (128 + the signal, as a shell
// reports a process the signal killed).
class InterruptGuard {
 public:
  InterruptGuard();
  ~InterruptGuard();
  InterruptGuard(const InterruptGuard&) = delete;
  InterruptGuard& operator=(const InterruptGuard&) = delete;

  bool requested() const;
  Status status() const;
  // Says what stopped and what is left, and returns the exit status.
  int Exit(const std::string& what, const std::string& left) const;

 private:
  struct sigaction old_int_ {}, old_term_ {};
};

inline const OptionSpec kWideOpt{"wide", 'w', false, false, "", "show long names whole instead of cut in the middle"};

// The name column of a table: as wide as the longest name, at least
// `min_width` and, unless `wide`, at most `max_width`; a longer name is cut
// in the middle ("model.layers.1...q_proj.weight"), its ends kept, so that
// the other columns stay aligned. Names are escaped for the terminal.
class NameColumn {
 public:
  NameColumn(const std::vector<std::string>& names, size_t min_width, size_t max_width, bool wide);
  size_t width() const { return width_; }
  // The name escaped, fitted and padded to the column's width.
  std::string Cell(const std::string& name) const;
  // A heading padded to the column's width.
  std::string Heading(const std::string& title) const;

 private:
  size_t width_ = 0;
  bool wide_ = false;
};

// One entry of ckpt's command table (main.cc); each command group's file
// defines its entries.
struct Command {
  const CommandSpec* spec;
  int (*run)(const GlobalOptions& global, const Args& args);
};

}  // namespace ckptfs::cli
