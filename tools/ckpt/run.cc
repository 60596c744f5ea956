// ckpt's entry point: the global options, the command table, help.
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstring>

#include "commands.h"
#include "core/text.h"
#include "core/version.h"

namespace ckptfs::cli {
namespace {

const Command* const kCommands[] = {
    &kInitCommand, &kImportCommand, &kLsCommand,      &kShowCommand, &kCatCommand,
    &kExportCommand, &kVerifyCommand, &kReindexCommand, &kRmCommand,   &kMountCommand,
    &kDuCommand,   &kDiffCommand,   &kGcCommand,    &kCopyCommand,  &kDrainCommand,
};

void MainHelp(FILE* out) {
  std::fprintf(out,
               "usage: ckpt [global options] COMMAND [options] [args]\n\n"
               "ckptfs: a deduplicating, compressed store for sharded training checkpoints.\n\n"
               "commands:\n");
  for (const Command* c : kCommands) std::fprintf(out, "  %-10s %s\n", c->spec->name.c_str(), c->spec->summary.c_str());
  std::fprintf(out, "\nglobal options (before or after the command):\n");
  for (const auto& o : kGlobalOptions) {
    std::string flags = (o.short_name ? std::string("-") + o.short_name + ", " : std::string("    ")) + "--" + o.name +
                        (o.takes_value ? " " + o.value_name : "") + (o.inline_value_allowed ? "[=json]" : "");
    std::fprintf(out, "  %-24s %s\n", flags.c_str(), o.help.c_str());
  }
  std::fprintf(out,
               "\nThe repository comes from -r/--repo PATH or $CKPT_REPO: a directory, or\n"
               "s3://BUCKET/PREFIX on an S3 store (AWS_ENDPOINT_URL, AWS_REGION, AWS_ACCESS_KEY_ID,\n"
               "AWS_SECRET_ACCESS_KEY). For S3, each host keeps its catalog in --cache-dir DIR or\n"
               "$CKPT_CACHE_DIR (default: ~/.cache/ckptfs/REPOSITORY-ID).\n"
               "Run 'ckpt COMMAND --help' for a command's options.\n");
}

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

int Main(int argc, char** argv) {
  std::signal(SIGBUS, OnBusError);
  // Global options may come before the command, as in `ckpt -r REPO ls`
  // (restic's and git's order), or after it among the command's own.
  Args args;
  auto at = ParseLeadingGlobals(argc, argv, 1, &args);
  if (!at.ok()) return UsageError(at.status());
  const int cmd = *at;
  if (cmd >= argc || std::strcmp(argv[cmd], "-h") == 0 || std::strcmp(argv[cmd], "--help") == 0 ||
      std::strcmp(argv[cmd], "help") == 0) {
    MainHelp(cmd >= argc ? stderr : stdout);
    return cmd >= argc ? kExitUsage : kExitOk;
  }
  if (std::strcmp(argv[cmd], "--version") == 0) {
    std::printf("ckpt (ckptfs) %s, repository format %u\n", CKPTFS_VERSION, kFormatVersion);
    return kExitOk;
  }
  for (const Command* c : kCommands) {
    if (c->spec->name != argv[cmd]) continue;
    bool help = false;
    if (Status st = Parse(*c->spec, argc, argv, cmd + 1, &args, &help); !st.ok()) {
      std::fprintf(stderr, "ckpt %s: error: %s\n", argv[cmd], EscapeForTerminal(st.message()).c_str());
      return kExitUsage;
    }
    if (help) return kExitOk;
    auto global = GlobalOptions::From(args);
    if (!global.ok()) return UsageError(global.status());
    SetProgressMode(global->progress);
    return c->run(*global, args);
  }
  std::fprintf(stderr, "ckpt: error: unknown command '%s' (see 'ckpt --help')\n",
               EscapeForTerminal(argv[cmd]).c_str());
  return kExitUsage;
}

}  // namespace ckptfs::cli
