// ckpt drain: a fast tier's checkpoints to its shared tier (ckpt/tiers.h).
#include <chrono>
#include <cstdio>
#include <thread>

#include "ckpt/describe.h"
#include "ckpt/tiers.h"
#include "commands.h"
#include "core/json.h"
#include "core/text.h"

namespace ckptfs::cli {
namespace {

const CommandSpec kDrain{
    "drain",
    "[NAME...]",
    "Send a fast tier's checkpoints to its shared tier; show or wait for their state.",
    "-r/--repo names the fast tier: a local repository on this host in front of a\n"
    "shared one (S3, or any repository), which --to names the first time (the fast\n"
    "tier records it in its shared-tier file). Each rank part the fast tier holds\n"
    "of the NAMEd checkpoints (default: every one not durable yet) is committed in\n"
    "the shared tier as that rank, sending only the chunks it lacks, each checked\n"
    "against its hash. A checkpoint becomes visible there (durable) with the last\n"
    "rank any host drains. A drain stopped at any point (Ctrl-C, a kill, a failed\n"
    "network) leaves the ranks it finished and nothing visible; the same command\n"
    "finishes it.\n"
    "States: local (ranks of this host not all in the shared tier yet), replicated\n"
    "(the same, with copies of every rank's part in peers' fast tiers), drained\n"
    "(this host's ranks are in the shared tier; other hosts' are still missing),\n"
    "durable. A checkpoint that replaces an older version of its name in the shared\n"
    "tier takes its place there with its last rank.\n"
    "--wait drains until every checkpoint is durable, draining new saves as they\n"
    "come; --timeout bounds it. Afterwards the fast tier keeps its newest --keep-last\n"
    "checkpoints (default 2) and drops older ones that are durable, never one that\n"
    "is not (--no-trim keeps all).",
    {{"to", 0, true, false, "URL", "the shared tier (recorded in the fast tier on first use)"},
     {"status", 0, false, false, "", "only show each checkpoint's state; send nothing"},
     {"wait", 0, false, false, "", "drain until every checkpoint is durable (other hosts' ranks too)"},
     {"timeout", 0, true, false, "SECONDS", "with --wait: give up after this long (default: no limit)"},
     {"keep-last", 0, true, false, "K", "then keep the newest K checkpoints in the fast tier (default 2)"},
     {"no-trim", 0, false, false, "", "drop nothing from the fast tier"},
     kJsonOpt},
    0,
    SIZE_MAX};

const char* Plural(uint64_t n, const char* one, const char* many) { return n == 1 ? one : many; }

void PrintStatus(const std::vector<TierEntry>& entries) {
  if (entries.empty()) {
    std::printf("no checkpoints in the fast tier\n");
    return;
  }
  std::printf("%-28s %-10s %-10s %12s  %s\n", "NAME", "STEP", "TIER", "SIZE", "RANKS HERE / IN SHARED TIER");
  for (const TierEntry& e : entries) {
    std::printf("%-28s %-10s %-10s %12s  %s / %s\n", EscapeForTerminal(e.name).c_str(),
                e.step ? std::to_string(*e.step).c_str() : "-", e.state().c_str(), HumanBytes(e.logical_bytes).c_str(),
                RanksToString(e.ranks_here).c_str(), RanksToString(e.ranks_shared).c_str());
  }
}

int CmdDrain(const GlobalOptions& global, const Args& args) {
  auto timeout = args.Int("timeout", 1);
  if (!timeout.ok()) return UsageError(timeout.status());
  auto keep_last = args.Int("keep-last", 1);
  if (!keep_last.ok()) return UsageError(keep_last.status());
  if (*timeout && !args.Has("wait")) return UsageError(Status::InvalidArgument("--timeout bounds --wait: give both"));
  if (*keep_last && args.Has("no-trim")) {
    return UsageError(Status::InvalidArgument("--keep-last and --no-trim disagree: give one"));
  }
  if (args.Has("status") && (args.Has("wait") || *keep_last || args.Has("no-trim"))) {
    return UsageError(Status::InvalidArgument("--status only shows: it takes no --wait, --keep-last or --no-trim"));
  }
  int rc = kExitOk;
  auto fast = OpenRepoOr(global, &rc);
  if (!fast) return rc;
  if (fast->remote()) {
    return UsageError(Status::InvalidArgument("-r names the fast tier, which must be a local directory, not " +
                                              fast->path()));
  }
  if (auto to = args.Get("to")) {
    Status named = WriteSharedTier(fast->path(), *to);
    if (!named.ok()) return Fail(named);
  }
  auto shared = OpenSharedTier(global, *fast);
  if (!shared.ok()) return Fail(shared.status());
  if (!*shared) {
    return UsageError(Status::InvalidArgument(fast->path() + " names no shared tier: give --to URL once"));
  }
  Repository& to = **shared;
  auto status = [&]() { return TierStatus(*fast, to); };
  if (args.Has("status")) {
    auto entries = status();
    if (!entries.ok()) return Fail(entries.status());
    if (args.Has("json")) {
      Json j = Json::MakeArray();
      for (const TierEntry& e : *entries) j.Push(DescribeTierEntry(e));
      PrintJson(j);
    } else {
      PrintStatus(*entries);
    }
    return kExitOk;
  }

  DrainOptions options;
  options.names.assign(args.positional.begin(), args.positional.end());
  options.on_phase = [](const std::string& what) { Phase("drain", what); };
  InterruptGuard interrupt;
  options.cancelled = [&] { return interrupt.requested(); };
  DrainReport total;
  const auto start = std::chrono::steady_clock::now();
  std::vector<TierEntry> entries;
  for (;;) {
    Progress progress("draining");
    auto report = Drain(*fast, to, options, [&](uint64_t d, uint64_t t) { progress.Update(d, t); });
    progress.Finish();
    if (!report.ok()) {
      if (interrupt.requested()) {
        return interrupt.Exit("drain", "the ranks it committed stay in the shared tier and nothing half-done is "
                                       "visible there; the same command sends the rest");
      }
      return Fail(report.status());
    }
    for (DrainedCheckpoint& c : report->checkpoints) {
      if (c.sent.outcome == CopiedCheckpoint::Outcome::kCopied) total.checkpoints.push_back(c);
    }
    total.chunks_sent += report->chunks_sent;
    total.raw_bytes_sent += report->raw_bytes_sent;
    total.stored_bytes_sent += report->stored_bytes_sent;
    total.chunks_present += report->chunks_present;
    total.raw_bytes_present += report->raw_bytes_present;
    auto now = status();
    if (!now.ok()) return Fail(now.status());
    entries = std::move(now).value();
    if (!args.Has("wait")) break;
    bool waiting = false;
    for (const TierEntry& e : entries) {
      const bool asked = options.names.empty() ||
                         std::find(options.names.begin(), options.names.end(), e.name) != options.names.end();
      waiting = waiting || (asked && !e.durable);
    }
    if (!waiting) break;
    const auto waited = std::chrono::steady_clock::now() - start;
    if (*timeout && waited >= std::chrono::seconds(**timeout)) {
      if (!args.Has("json")) PrintStatus(entries);
      return Fail(Status::FailedPrecondition(
          "not every checkpoint is durable after " + std::to_string(**timeout) +
          " s: a 'drained' one waits for other hosts' ranks (run ckpt drain on those hosts)"));
    }
    if (interrupt.requested()) return interrupt.Exit("drain", "the same command goes on waiting");
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }

  std::vector<std::string> trimmed;
  if (!args.Has("no-trim")) {
    const uint64_t keep = *keep_last ? static_cast<uint64_t>(**keep_last) : 2;
    auto plan = PlanFastTierTrim(*fast, to, keep);
    if (!plan.ok()) return Fail(plan.status());
    if (!plan->empty()) {
      Status removed = fast->RemoveCheckpoints(*plan, /*missing_ok=*/true);
      if (!removed.ok()) return Fail(removed.WithContext("trimming the fast tier"));
      GcOptions gc;
      gc.on_phase = [](const std::string& what) { Phase("drain", "fast tier: " + what); };
      auto collected = fast->CollectGarbage(gc);
      if (!collected.ok()) return Fail(collected.status().WithContext("reclaiming the fast tier's space"));
      trimmed = *plan;
      std::erase_if(entries, [&](const TierEntry& e) {
        return std::find(trimmed.begin(), trimmed.end(), e.name) != trimmed.end();
      });
    }
  }

  if (args.Has("json")) {
    Json j = DescribeDrainReport(total);
    Json states = Json::MakeArray();
    for (const TierEntry& e : entries) states.Push(DescribeTierEntry(e));
    j.Set("fast_tier", std::move(states));
    Json gone = Json::MakeArray();
    for (const std::string& n : trimmed) gone.Push(n);
    j.Set("trimmed", std::move(gone));
    PrintJson(j);
    return kExitOk;
  }
  for (const DrainedCheckpoint& c : total.checkpoints) {
    std::printf("drained  %s: %u %s, sent %s in %llu chunks, %s already there; %s\n",
                EscapeForTerminal(c.sent.name).c_str(), c.sent.ranks_copied, Plural(c.sent.ranks_copied, "rank", "ranks"),
                HumanBytes(c.sent.stored_bytes_sent).c_str(), static_cast<unsigned long long>(c.sent.chunks_sent),
                HumanBytes(c.sent.raw_bytes_present).c_str(),
                c.durable ? "durable" : "waiting for other hosts' ranks");
  }
  for (const std::string& n : trimmed) {
    std::printf("trimmed  %s from the fast tier (its ranks here are in the shared tier)\n", EscapeForTerminal(n).c_str());
  }
  PrintStatus(entries);
  return kExitOk;
}

}  // namespace

const Command kDrainCommand{&kDrain, CmdDrain};

}  // namespace ckptfs::cli
