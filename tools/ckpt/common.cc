#include "common.h"

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <cstdlib>

#include "ckpt/tiers.h"
#include "core/text.h"

namespace ckptfs::cli {

Result<GlobalOptions> GlobalOptions::From(const Args& args) {
  GlobalOptions g;
  if (auto r = args.Get("repo")) {
    g.repo = *r;
  } else if (const char* env = std::getenv("CKPT_REPO"); env && *env) {
    g.repo = std::string(env);
  }
  if (args.Has("progress") && args.Has("quiet")) {
    return Status::InvalidArgument("--progress and --quiet contradict each other");
  }
  if (auto p = args.Get("progress")) {
    if (!p->empty() && *p != "json") return Status::InvalidArgument("--progress takes no value or =json, not '" + *p + "'");
    g.progress = p->empty() ? ProgressMode::kOn : ProgressMode::kJson;
  } else if (args.Has("progress")) {
    g.progress = ProgressMode::kOn;
  }
  if (args.Has("quiet")) g.progress = ProgressMode::kOff;
  // The one place where ckpt reads the engine's settings from its
  // environment.
  CKPT_ASSIGN_OR_RETURN(g.open, OpenOptionsFromEnvironment(std::getenv));
  if (args.Has("cache-dir")) {
    const std::string dir = *args.Get("cache-dir");
    if (dir.empty()) return Status::InvalidArgument("option --cache-dir needs a value");
    g.open.cache_dir = dir;
  }
  return g;
}

Result<std::string> GlobalOptions::RepoPath() const {
  if (repo) return *repo;
  return Status::InvalidArgument("no repository given: pass -r PATH or set CKPT_REPO");
}

int UsageError(const Status& st) {
  std::fprintf(stderr, "ckpt: error: %s\n", EscapeForTerminal(st.message()).c_str());
  return kExitUsage;
}

int Fail(const Status& st) {
  std::fprintf(stderr, "ckpt: error: %s\n", EscapeForTerminal(st.message()).c_str());
  return kExitError;
}

std::unique_ptr<Repository> OpenRepoOr(const GlobalOptions& global, int* exit_code) {
  auto path = global.RepoPath();
  if (!path.ok()) {
    *exit_code = UsageError(path.status());
    return nullptr;
  }
  auto repo = Repository::Open(*path, global.open);
  if (!repo.ok()) {
    *exit_code = Fail(repo.status());
    return nullptr;
  }
  return std::move(repo).value();
}

Result<std::unique_ptr<Repository>> OpenSharedTier(const GlobalOptions& global, const Repository& fast) {
  if (fast.remote()) return std::unique_ptr<Repository>();
  CKPT_ASSIGN_OR_RETURN(std::optional<std::string> url, ReadSharedTier(fast.path()));
  if (!url) return std::unique_ptr<Repository>();
  auto shared = Repository::Open(*url, global.open);
  if (!shared.ok()) return shared.status().WithContext("the shared tier " + *url + " of fast tier " + fast.path());
  return std::move(shared).value();
}

void PrintJson(const Json& j) { std::printf("%s\n", j.Dump(2).c_str()); }

namespace {
// Python runs isolated (-I): neither the working directory nor the user's
// site nor PYTHON* variables reach sys.path, so a torch.py or argparse.py
// lying in the directory the command runs in is never imported. Only the
// absolute directories of PYTHONPATH are put back, in their order: a
// relative or empty entry would mean the working directory again.
constexpr const char* kIsolatedPath =
    "import os, sys\n"
    "sys.path[0:0] = [d for d in os.environ.get('PYTHONPATH', '').split(os.pathsep) if os.path.isabs(d)]\n";

// Runs argv, its output discarded; whether it exited 0.
bool RunQuietly(const std::vector<std::string>& args) {
  const pid_t pid = ::fork();
  if (pid < 0) return false;
  if (pid == 0) {
    const int null = ::open("/dev/null", O_RDWR | O_CLOEXEC);
    if (null >= 0) {
      ::dup2(null, 1);
      ::dup2(null, 2);
    }
    std::vector<char*> cargv;
    for (const auto& a : args) cargv.push_back(const_cast<char*>(a.c_str()));
    cargv.push_back(nullptr);
    ::execvp(cargv[0], cargv.data());
    ::_exit(127);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) return false;
  }
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}
}  // namespace

int ExecPythonFormats(const std::string& what, const std::vector<std::string>& args) {
  const char* env_python = std::getenv("CKPT_PYTHON");
  std::string python = env_python && *env_python ? env_python : "python3";
  if (!env_python || !*env_python) {
    char self[4096];
    const ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
    if (n > 0) {
      std::string dir(self, static_cast<size_t>(n));
      dir = dir.substr(0, dir.rfind('/'));
      if (::access((dir + "/python3").c_str(), X_OK) == 0) python = dir + "/python3";
    }
  }
  // Whether that Python has the package, asked first so that a missing one
  // gets one clear line (without importing torch, which takes seconds: the
  // package itself says when torch is missing).
  if (!RunQuietly({python, "-I", "-c", std::string(kIsolatedPath) + "import ckptfs.formats\n"})) {
    return Fail(Status::Unsupported(what + ": that is done with torch through the Python package, and '" + python +
                                    "' cannot import ckptfs (this format needs pip install 'ckptfs[torch]' there, or the torch build your "
                                    "training uses beside ckptfs; or set CKPT_PYTHON to a Python that has both; Python runs "
                                    "isolated, so only the absolute directories of PYTHONPATH count)"));
  }
  std::vector<std::string> argv = {
      python, "-I", "-c",
      std::string(kIsolatedPath) +
          "import runpy\nrunpy.run_module('ckptfs.formats', run_name='__main__', alter_sys=True)\n"};
  const size_t first_arg = argv.size();
  argv.insert(argv.end(), args.begin(), args.end());
  // The package draws progress as this command does (--progress, --quiet).
  const char* mode = "auto";
  switch (GetProgressMode()) {
    case ProgressMode::kOn: mode = "on"; break;
    case ProgressMode::kJson: mode = "json"; break;
    case ProgressMode::kOff: mode = "off"; break;
    case ProgressMode::kAuto: break;
  }
  if (argv.size() > first_arg) argv.insert(argv.begin() + first_arg + 1, std::string("--progress=") + mode);
  std::vector<char*> cargv;
  for (auto& a : argv) cargv.push_back(a.data());
  cargv.push_back(nullptr);
  std::fflush(nullptr);
  ::execvp(cargv[0], cargv.data());
  return Fail(Status::IOError("cannot run '" + python + "': " + std::strerror(errno)));
}

namespace {
volatile std::sig_atomic_t g_interrupt_signal = 0;
extern "C" void OnInterrupt(int sig) { g_interrupt_signal = sig; }
}  // namespace

InterruptGuard::InterruptGuard() {
  struct sigaction sa {};
  sa.sa_handler = OnInterrupt;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGINT, &sa, &old_int_);
  ::sigaction(SIGTERM, &sa, &old_term_);
}

InterruptGuard::~InterruptGuard() {
  ::sigaction(SIGINT, &old_int_, nullptr);
  ::sigaction(SIGTERM, &old_term_, nullptr);
}

bool InterruptGuard::requested() const { return g_interrupt_signal != 0; }

Status InterruptGuard::status() const {
  return Status::FailedPrecondition(std::string("interrupted by ") + (g_interrupt_signal == SIGINT ? "SIGINT" : "SIGTERM"));
}

int InterruptGuard::Exit(const std::string& what, const std::string& left) const {
  const int sig = g_interrupt_signal;
  std::fprintf(stderr, "ckpt: interrupted (%s): %s stopped; %s\n", sig == SIGINT ? "SIGINT" : "SIGTERM",
               EscapeForTerminal(what).c_str(), left.c_str());
  return 128 + sig;
}

namespace {
// Display columns of UTF-8 text: one per character (wide scripts are rare in
// tensor names, and escaping made control bytes ASCII).
size_t Columns(std::string_view s) {
  size_t n = 0;
  for (char c : s) n += (static_cast<uint8_t>(c) & 0xC0) != 0x80;
  return n;
}
// The byte offset after the first `columns` characters.
size_t PrefixBytes(std::string_view s, size_t columns) {
  size_t i = 0;
  for (size_t seen = 0; i < s.size(); ++i) {
    if ((static_cast<uint8_t>(s[i]) & 0xC0) != 0x80 && seen++ == columns) break;
  }
  return i;
}
}  // namespace

NameColumn::NameColumn(const std::vector<std::string>& names, size_t min_width, size_t max_width, bool wide)
    : width_(min_width), wide_(wide) {
  for (const auto& n : names) width_ = std::max(width_, Columns(EscapeForTerminal(n)));
  if (!wide) width_ = std::min(width_, std::max(min_width, max_width));
}

std::string NameColumn::Cell(const std::string& name) const {
  std::string text = EscapeForTerminal(name);
  size_t columns = Columns(text);
  if (!wide_ && columns > width_) {
    const std::string cut = "...";
    const size_t keep = width_ > cut.size() ? width_ - cut.size() : 0;
    const size_t head = keep - keep / 2, tail = keep / 2;
    const std::string_view t(text);
    text = std::string(t.substr(0, PrefixBytes(t, head))) + cut + std::string(t.substr(PrefixBytes(t, columns - tail)));
    columns = width_;
  }
  return text + std::string(width_ > columns ? width_ - columns : 0, ' ');
}

std::string NameColumn::Heading(const std::string& title) const {
  return title + std::string(width_ > title.size() ? width_ - title.size() : 0, ' ');
}

}  // namespace ckptfs::cli
