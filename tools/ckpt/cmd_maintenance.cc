// ckpt verify, reindex, rm and gc: checking and maintaining a repository.
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
#include "ckpt/tiers.h"
#include "commands.h"
#include "core/json.h"
#include "core/text.h"
#include "io/safetensors.h"

namespace ckptfs::cli {
namespace {

const CommandSpec kVerify{"verify", "[NAME]", "Re-read and re-hash every chunk; check every tensor is tiled exactly.",
                          "Without NAME the whole repository is checked, including chunks no checkpoint\n"
                          "references and every pack index. Every reference to a chunk is checked against\n"
                          "the stored chunk's length, and a chunk whose bytes fail their id is reported\n"
                          "against every checkpoint that uses it. Exits 1 when a problem is found.\n"
                          "\n"
                          "--repair stores each such chunk again from a good copy: another pack of the\n"
                          "repository that holds it, or a repository named by --from (another tier, a\n"
                          "copy made with ckpt copy). Every copy is checked against the chunk's id first.\n"
                          "The packs holding a bad chunk are rewritten as gc rewrites packs, under gc's\n"
                          "lock, and the run also collects what gc without a retention policy would.\n"
                          "It exits 1 while any chunk stays unrepaired.",
                          {{"repair", 0, false, false, "", "store bad chunks again from a good copy"},
                           {"from", 0, true, true, "URL", "a repository to take good copies from (repeatable)"},
                           kJsonOpt},
                          0, 1};

int CmdVerify(const GlobalOptions& global, const Args& args) {
  int rc = kExitOk;
  const bool repair = args.Has("repair");
  const std::vector<std::string> from = args.All("from");
  if (!from.empty() && !repair) return UsageError(Status::InvalidArgument("--from is for --repair"));
  auto repo = OpenRepoOr(global, &rc);
  if (!repo) return rc;
  std::vector<std::unique_ptr<Repository>> sources;
  for (const auto& url : from) {
    auto src = Repository::Open(url, global.open);
    if (!src.ok()) return Fail(src.status().WithContext("--from " + url));
    sources.push_back(std::move(src).value());
  }
  std::optional<std::string> name;
  if (!args.positional.empty()) name = args.positional[0];
  Progress progress("verifying");
  auto report = repo->Verify(name, [&](uint64_t d, uint64_t t) { progress.Update(d, t); });
  progress.Finish();
  if (!report.ok()) return Fail(report.status());
  std::optional<RepairReport> repaired;
  if (repair && !report->bad_chunks.empty()) {
    std::vector<Repository*> from_repos;
    for (auto& s : sources) from_repos.push_back(s.get());
    auto r = repo->Repair(*report, from_repos, [](const std::string& what) { Phase("repair", what); });
    if (!r.ok()) return Fail(r.status().WithContext("repairing"));
    repaired = std::move(r).value();
  }
  // With --repair, the problems a repair mended no longer count.
  size_t left = report->problems.size();
  if (repaired) {
    for (const auto& p : report->problems) {
      const bool mended = p.bad_chunk && std::any_of(repaired->repaired.begin(), repaired->repaired.end(),
                                                     [&](const auto& r) { return r.id == *p.bad_chunk; });
      if (mended) --left;
    }
  }
  if (args.Has("json")) {
    Json j = DescribeVerifyReport(*report);
    if (repaired) {
      j.Set("repair", DescribeRepairReport(*repaired));
      j.Set("problems_left", static_cast<uint64_t>(left));
    }
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
    if (repaired) {
      for (const auto& c : repaired->repaired) {
        std::printf("repaired chunk %s from %s\n", c.id.ToHex().c_str(), EscapeForTerminal(c.from).c_str());
      }
      for (const auto& c : repaired->unrepaired) {
        std::string users;
        for (const auto& n : c.checkpoints) users += (users.empty() ? "" : ", ") + n;
        std::fprintf(stderr, "unrepaired: chunk %s has no good copy (used by %s)\n", c.id.ToHex().c_str(),
                     EscapeForTerminal(users).c_str());
      }
      std::printf("repair: %zu chunks stored again, %zu without a good copy, %llu packs rewritten\n",
                  repaired->repaired.size(), repaired->unrepaired.size(),
                  static_cast<unsigned long long>(repaired->packs_rewritten));
    } else if (repair) {
      std::printf("repair: no chunk fails its id\n");
    }
  }
  if (left > 0) {
    std::fprintf(stderr, "ckpt: error: verify found %zu problems%s\n", left, repaired ? " that repair did not mend" : "");
    return kExitError;
  }
  return kExitOk;
}

const CommandSpec kReindex{"reindex", "", "Rebuild the catalog from pack files and manifests alone.",
                           "Use when the catalog is lost or damaged. No other process may use the\n"
                           "repository meanwhile. Uncommitted checkpoints are dropped.",
                           {kJsonOpt}, 0, 0};

int CmdReindex(const GlobalOptions& global, const Args& args) {
  auto path = global.RepoPath();
  if (!path.ok()) return UsageError(path.status());
  Progress progress("reindexing");
  auto report = Repository::Reindex(*path, [&](uint64_t d, uint64_t t) { progress.Update(d, t); }, global.open);
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

const CommandSpec kRm{"rm", "NAME...", "Remove checkpoints (all or none); 'ckpt gc' reclaims their space.",
                      "Committed and pending checkpoints can be removed. If any NAME is unknown,\n"
                      "nothing is removed. The names go at once; like unlink(2), files open through\n"
                      "a mount (and mmaps of them) and open readers keep reading, on every host, and\n"
                      "the first gc after the last of them closed reclaims the space.",
                      {}, 1, SIZE_MAX};

int CmdRm(const GlobalOptions& global, const Args& args) {
  int rc = kExitOk;
  auto repo = OpenRepoOr(global, &rc);
  if (!repo) return rc;
  Status st = repo->RemoveCheckpoints(args.positional);
  if (!st.ok()) return Fail(st);
  for (const auto& n : args.positional) std::printf("removed %s\n", n.c_str());
  return kExitOk;
}

const CommandSpec kGc{
    "gc", "", "Apply a retention policy, then reclaim the space no checkpoint uses.",
    "The --keep-* options together say what stays; without any, nothing is removed\n"
    "and only unreferenced data is reclaimed. --keep-last counts the newest by step\n"
    "(by commit order when some checkpoint has no step). --keep-every keeps the steps\n"
    "that are multiples of K, and of the checkpoints without a step every K-th in\n"
    "commit order, counted among themselves. --dry-run says, for each checkpoint,\n"
    "which rule keeps it or why none does. A policy that would remove the newest\n"
    "committed checkpoint (or all of them, as --keep-last 0 would) is refused unless\n"
    "--allow-removing-newest is given; pending checkpoints are never removed. Packs\n"
    "left mostly dead (less than half live) are rewritten. gc waits for saves in\n"
    "progress, and new saves wait for it. A removed checkpoint that a reader still\n"
    "has open (through a mount, on any host, or in a process) keeps its data until\n"
    "the first gc after it is closed. With --group, the policy applies to the\n"
    "checkpoints of that group only (a run: run1/step-100, run1/eval/step-3), and\n"
    "\"newest\" means the group's newest; the other checkpoints stay.\n"
    "\n"
    "--thin-older-than N thins the checkpoints kept, but the newest N (in\n"
    "--keep-last's order): each keeps its model and drops its optimizer, scheduler\n"
    "and RNG state (a name with a part optim, optimizer, optimizer_states,\n"
    "lr_scheduler, scheduler, rng, rng_state*, ..., or an Adam moment exp_avg,\n"
    "exp_avg_sq), or, with --thin-keep, every tensor and blob whose name matches\n"
    "none of the patterns. The thinned checkpoint replaces the whole one atomically\n"
    "(readers of the whole one keep it until they close it), stays loadable and\n"
    "mountable, keeps its step and place in the order, and says it was thinned\n"
    "(ckpt show). One whose thinning would keep no tensor stays whole.\n"
    "\n"
    "On a fast tier (a repository that names a shared tier: ckpt drain), no rule\n"
    "removes a checkpoint with a rank not yet drained to the shared tier.",
    {{"keep-last", 0, true, false, "N", "keep the newest N checkpoints"},
     {"keep-every", 0, true, false, "K", "keep checkpoints whose step is a multiple of K"},
     {"keep-within", 0, true, false, "DURATION",
      "keep checkpoints committed within DURATION of the newest (s, m, h, d, w: 36h, 1w2d)"},
     {"keep", 0, true, true, "NAME", "keep this checkpoint (repeatable)"},
     {"group", 0, true, false, "GROUP", "apply the policy to the checkpoints of GROUP only"},
     {"thin-older-than", 0, true, false, "N",
      "keep only the model of checkpoints older than the newest N (drop optimizer and RNG state)"},
     {"thin-keep", 0, true, true, "PATTERN",
      "with --thin-older-than: keep the tensors and blobs matching PATTERN (shell pattern; repeatable)"},
     {"allow-removing-newest", 0, false, false, "",
      "let the policy remove the newest committed checkpoint (or every checkpoint)"},
     {"dry-run", 'n', false, false, "", "show what would be removed and reclaimed; change nothing"},
     kJsonOpt},
    0, 0};

int CmdGc(const GlobalOptions& global, const Args& args) {
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
  if (auto group = args.Get("group")) o.retention.group = *group;
  o.retention.allow_removing_newest = args.Has("allow-removing-newest");
  auto thin = args.Int("thin-older-than", 1);
  if (!thin.ok()) return UsageError(thin.status());
  if (*thin) o.retention.thin_older_than = static_cast<uint64_t>(**thin);
  o.retention.thin_keep = args.All("thin-keep");
  if (!o.retention.thin_keep.empty() && !o.retention.thin_older_than) {
    return UsageError(Status::InvalidArgument("--thin-keep says what thinning keeps: give --thin-older-than N too"));
  }
  o.dry_run = args.Has("dry-run");
  int rc = kExitOk;
  auto repo = OpenRepoOr(global, &rc);
  if (!repo) return rc;
  // A fast tier drops no checkpoint its shared tier lacks.
  auto shared = OpenSharedTier(global, *repo);
  if (!shared.ok()) return Fail(shared.status());
  if (*shared) {
    Status held = HoldNotDurable(*repo, **shared, &o.retention);
    if (!held.ok()) return Fail(held);
  }
  auto plan = repo->ExplainRetention(o.retention);
  if (!plan.ok()) return Fail(plan.status());
  if (!args.Has("json")) {
    // A dry run shows every checkpoint's fate; a run, what it removes.
    for (const auto& d : *plan) {
      if (d.thin) {
        std::printf("%s %s (%s; %s)\n", o.dry_run ? "would thin" : "thinning", d.name.c_str(), d.why.c_str(),
                    (d.thin_why + ", " + HumanBytes(d.thin_bytes)).c_str());
        continue;
      }
      if (d.keep && !o.dry_run) continue;
      const char* verb = d.keep ? "would keep" : o.dry_run ? "would remove" : "removing";
      std::printf("%s %s (%s%s)\n", verb, d.name.c_str(), d.why.c_str(),
                  d.keep && !d.thin_why.empty() ? ("; " + d.thin_why).c_str() : "");
    }
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
  // What was reclaimed, by where it came from.
  std::string sources;
  auto source = [&](uint64_t bytes, const std::string& what) {
    if (bytes) sources += (sources.empty() ? ": " : ", ") + HumanBytes(bytes) + " " + what;
  };
  auto packs = [](uint64_t n) { return std::to_string(n) + (n == 1 ? " pack" : " packs"); };
  const uint64_t dropped = r->packs_deleted - r->packs_rewritten - r->orphan_packs;
  source(r->dead_pack_bytes, "in " + packs(dropped) + " with no live chunk");
  if (r->packs_rewritten) {
    const uint64_t freed =
        r->rewritten_pack_bytes > r->rewritten_live_bytes ? r->rewritten_pack_bytes - r->rewritten_live_bytes : 0;
    sources += (sources.empty() ? ": " : ", ") + HumanBytes(freed) + " from " + packs(r->packs_rewritten) + " rewritten, mostly dead (" + HumanBytes(r->rewritten_live_bytes) + " live copied out)";
  }
  source(r->orphan_pack_bytes, "in " + packs(r->orphan_packs) + " of killed saves");
  source(r->temporary_bytes, "in temporary files of interrupted writes");
  std::printf("%s %s%s; %llu dead chunks; %s in packs %s, %s live\n", o.dry_run ? "would reclaim" : "reclaimed",
              HumanBytes(r->bytes_reclaimed()).c_str(), sources.c_str(),
              static_cast<unsigned long long>(r->dead_chunks), HumanBytes(r->bytes_after).c_str(),
              o.dry_run ? "after it" : "now", HumanBytes(r->live_bytes).c_str());
  if (r->retired_kept) {
    std::printf("%llu removed checkpoints are still open for reading (a mount or a process): their space is\n"
                "reclaimed by the first gc after they are closed\n",
                static_cast<unsigned long long>(r->retired_kept));
  }
  return kExitOk;
}

}  // namespace

const Command kVerifyCommand{&kVerify, CmdVerify};
const Command kReindexCommand{&kReindex, CmdReindex};
const Command kRmCommand{&kRm, CmdRm};
const Command kGcCommand{&kGc, CmdGc};

}  // namespace ckptfs::cli
