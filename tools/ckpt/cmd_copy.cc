// ckpt copy: checkpoints from one repository to another.
#include <cstdio>

#include "ckpt/describe.h"
#include "commands.h"
#include "core/json.h"
#include "core/text.h"

namespace ckptfs::cli {
namespace {

const CommandSpec kCopy{
    "copy",
    "SRC DST [NAME...]",
    "Copy checkpoints between repositories, sending only the chunks DST lacks.",
    "SRC and DST are repositories: directories or s3://BUCKET/PREFIX. Checkpoints are\n"
    "named, or chosen with --all or --last N, and copied in commit order. Each chunk\n"
    "is read as stored, checked against its hash and written to DST without being\n"
    "encoded again; a checkpoint becomes visible in DST when its last rank is in.\n"
    "A checkpoint DST already has, with the same content, is skipped. A copy that\n"
    "fails or is interrupted (Ctrl-C, SIGTERM) removes the checkpoint it was making\n"
    "from DST, so nothing is left pending; chunks of the ranks it committed stay\n"
    "until gc, and running the same command again sends only what is missing. A killed copy\n"
    "leaves its checkpoint pending in DST; the same command finishes it (or 'ckpt\n"
    "rm' it in DST). A source checkpoint is copied with the world size its shards\n"
    "need (the highest rank any shard names, plus one), never more than it claims.\n"
    "-r/--repo is not used.",
    {{"all", 0, false, false, "", "copy every committed checkpoint"},
     {"last", 0, true, false, "N", "copy the newest N committed checkpoints"},
     kJsonOpt},
    2,
    SIZE_MAX};

bool IsObjectStore(const std::string& path) { return path.find("://") != std::string::npos; }

int CmdCopy(const GlobalOptions& global, const Args& args) {
  const std::string& from = args.positional[0];
  const std::string& to = args.positional[1];
  CopyOptions options;
  options.names.assign(args.positional.begin() + 2, args.positional.end());
  options.all = args.Has("all");
  auto last = args.Int("last", 1);
  if (!last.ok()) return UsageError(last.status());
  if (*last) options.last = static_cast<uint64_t>(**last);
  const int ways = (options.names.empty() ? 0 : 1) + (options.all ? 1 : 0) + (options.last ? 1 : 0);
  if (ways != 1) {
    return UsageError(Status::InvalidArgument("name the checkpoints to copy, or give --all or --last N (one of them)"));
  }
  if (!global.open.cache_dir.empty() && IsObjectStore(from) && IsObjectStore(to)) {
    return UsageError(Status::InvalidArgument(
        "--cache-dir (or CKPT_CACHE_DIR) names one catalog, and both repositories are on object stores: "
        "leave it unset, so each keeps its own under the cache root"));
  }
  auto src = Repository::Open(from, global.open);
  if (!src.ok()) return Fail(src.status().WithContext("source " + from));
  auto dst = Repository::Open(to, global.open);
  if (!dst.ok()) return Fail(dst.status().WithContext("destination " + to));
  options.on_phase = [](const std::string& what) { Phase("copy", what); };
  Progress progress("copying");
  InterruptGuard interrupt;
  options.cancelled = [&] { return interrupt.requested(); };
  auto report = CopyCheckpoints(**src, **dst, options, [&](uint64_t d, uint64_t t) { progress.Update(d, t); });
  progress.Finish();
  if (interrupt.requested() && !report.ok()) {
    const std::string said = report.ok() ? "" : report.status().message();
    return interrupt.Exit("copy", said.find("removing its pending copy") != std::string::npos
                                      ? EscapeForTerminal(said)
                                      : "nothing is left pending in " + EscapeForTerminal(to) +
                                            "; chunks of the ranks it committed stay until gc, so running the same "
                                            "command again sends only what is missing");
  }
  if (!report.ok()) {
    std::fprintf(stderr, "ckpt: error: %s\n", EscapeForTerminal(report.status().message()).c_str());
    const StatusCode code = report.status().code();
    if (code != StatusCode::kNotFound && code != StatusCode::kAlreadyExists && code != StatusCode::kInvalidArgument) {
      std::fprintf(stderr,
                   "ckpt: a checkpoint not copied whole is not visible in %s; run the same command again: it sends only "
                   "what is missing\n",
                   EscapeForTerminal(to).c_str());
    }
    return kExitError;
  }
  if (args.Has("json")) {
    PrintJson(DescribeCopyReport(*report));
    return kExitOk;
  }
  size_t copied = 0, present = 0;
  for (const CopiedCheckpoint& c : report->checkpoints) {
    const bool was_copied = c.outcome == CopiedCheckpoint::Outcome::kCopied;
    (was_copied ? copied : present)++;
    std::printf("%-8s %s  sent %s in %llu chunks, %s already there\n", was_copied ? "copied" : "present",
                EscapeForTerminal(c.name).c_str(), HumanBytes(c.stored_bytes_sent).c_str(),
                static_cast<unsigned long long>(c.chunks_sent), HumanBytes(c.raw_bytes_present).c_str());
  }
  std::printf("%zu copied, %zu already present: sent %s (%s decoded) in %llu chunks; %s in %llu chunks already there\n",
              copied, present, HumanBytes(report->stored_bytes_sent).c_str(), HumanBytes(report->raw_bytes_sent).c_str(),
              static_cast<unsigned long long>(report->chunks_sent), HumanBytes(report->raw_bytes_present).c_str(),
              static_cast<unsigned long long>(report->chunks_present));
  return kExitOk;
}

}  // namespace

const Command kCopyCommand{&kCopy, CmdCopy};

}  // namespace ckptfs::cli
