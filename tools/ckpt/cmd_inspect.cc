// ckpt ls, show, du and diff: what a repository holds.
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

const CommandSpec kLs{"ls", "[GROUP]", "List checkpoints in commit order.",
                      "A checkpoint name may hold '/'-separated groups (run1/step-100): with GROUP,\n"
                      "only the checkpoints in it (run1: run1/step-100, run1/eval/step-3) are listed.\n"
                      "A pending save that replaces NAME (an overwriting save) is listed as NAME~.\n"
                      "A fast tier (a repository that names a shared tier: ckpt drain) lists its\n"
                      "pending checkpoints too, with each one's TIER state: local, replicated, drained\n"
                      "or durable.",
                      {{"all", 'a', false, false, "", "include pending (uncommitted) checkpoints"}, kJsonOpt},
                      0, 1};

int CmdLs(const GlobalOptions& global, const Args& args) {
  int rc = kExitOk;
  auto repo = OpenRepoOr(global, &rc);
  if (!repo) return rc;
  // A fast tier: each checkpoint's state in its shared tier. On a job of
  // several hosts its checkpoints stay pending here, so they are listed.
  std::map<std::string, std::string> tier_state;
  auto shared = OpenSharedTier(global, *repo);
  if (!shared.ok()) return Fail(shared.status());
  if (*shared) {
    auto entries = TierStatus(*repo, **shared);
    if (!entries.ok()) return Fail(entries.status());
    for (const TierEntry& e : *entries) tier_state[e.name] = e.state();
  }
  const bool tiered = *shared != nullptr;
  auto list = repo->ListCheckpoints(args.Has("all") || tiered);
  if (!list.ok()) return Fail(list.status());
  if (!args.positional.empty()) {
    std::erase_if(*list, [&](const CheckpointRecord& c) { return !InGroup(c.name, args.positional[0]); });
  }
  auto state_of = [&](const CheckpointRecord& c) {
    auto it = tier_state.find(c.name);
    return it == tier_state.end() ? std::string("-") : it->second;
  };
  if (args.Has("json")) {
    Json j = Json::MakeArray();
    for (const auto& c : *list) {
      Json one = DescribeRecord(c);
      if (tiered) one.Set("tier_state", state_of(c));
      j.Push(std::move(one));
    }
    PrintJson(j);
    return kExitOk;
  }
  if (list->empty()) {
    std::printf("no checkpoints\n");
    return kExitOk;
  }
  const char* tier_head = tiered ? "TIER       " : "";
  std::printf("%-28s %-10s %8s %8s %12s  %s%s\n", "NAME", "STEP", "RANKS", "TENSORS", "SIZE", tier_head, "COMMITTED");
  for (const auto& c : *list) {
    const bool committed = c.state == CheckpointState::kCommitted;
    std::string ranks = std::to_string(c.committed_ranks.size()) + "/" + std::to_string(c.world_size);
    const std::string when = committed ? FormatUnixMs(c.committed_unix_ms)
                                       : "(pending since " + FormatUnixMs(c.created_unix_ms) + "; missing ranks " +
                                             RanksToString(MissingRanks(c)) + ")";
    char tier[16] = "";
    if (tiered) std::snprintf(tier, sizeof tier, "%-10s ", state_of(c).c_str());
    std::printf("%-28s %-10s %8s %8llu %12s  %s%s\n", c.name.c_str(), c.step ? std::to_string(*c.step).c_str() : "-",
                committed ? std::to_string(c.world_size).c_str() : ranks.c_str(),
                static_cast<unsigned long long>(c.tensor_count), HumanBytes(c.logical_bytes).c_str(), tier, when.c_str());
  }
  return kExitOk;
}

const CommandSpec kShow{"show", "NAME [TENSOR...]", "Show a checkpoint: tensors, dtypes, shapes, shard layout, sizes.",
                        "Each tensor's PLACEMENT says how its shards lie (whole, 4 row blocks, 4 column\n"
                        "blocks, 8 flat ranges, replicated x2...); --shards lists every shard too.\n"
                        "Names longer than the column are cut in the middle; --wide shows them whole.\n"
                        "With --stats, each tensor's statistics instead (the TENSORs, or every tensor):\n"
                        "NaN, infinite and zero counts, and over the finite elements min, max, mean,\n"
                        "standard deviation and L2 norm, read in one streaming pass.",
                        {kJsonOpt, kWideOpt, {"stats", 0, false, false, "", "read the tensors and show their statistics"},
                         {"shards", 's', false, false, "", "list every shard: its region and the ranks that wrote it"}},
                        1, SIZE_MAX};

// Tensor names in a table: at least 40 columns, names up to 60 whole.
NameColumn TensorColumn(const std::vector<std::string>& names, const Args& args) {
  return NameColumn(names, 40, 60, args.Has("wide"));
}

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
  std::vector<std::string> names;
  for (const auto& s : *stats) names.push_back(s.name);
  const NameColumn column = TensorColumn(names, args);
  std::printf("%s %-8s %10s %10s %10s %12s %12s %12s %12s %12s\n", column.Heading("TENSOR").c_str(), "DTYPE", "NAN",
              "INF", "ZERO", "MIN", "MAX", "MEAN", "STD", "L2");
  for (const auto& s : *stats) {
    std::printf("%s %-8s %10llu %10llu %10llu %12s %12s %12s %12s %12s\n", column.Cell(s.name).c_str(),
                std::string(DTypeName(s.dtype)).c_str(), static_cast<unsigned long long>(s.nan_count),
                static_cast<unsigned long long>(s.inf_count), static_cast<unsigned long long>(s.zero_count),
                num(s.min).c_str(), num(s.max).c_str(), num(s.mean).c_str(), num(s.std).c_str(),
                num(s.l2_norm).c_str());
  }
  return kExitOk;
}

int CmdShow(const GlobalOptions& global, const Args& args) {
  int rc = kExitOk;
  auto repo = OpenRepoOr(global, &rc);
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
    if (k == kThinnedTag) {
      std::printf("  thinned:   %s\n", EscapeForTerminal(v).c_str());
    } else {
      std::printf("  tag:       %s=%s\n", EscapeForTerminal(k).c_str(), EscapeForTerminal(v).c_str());
    }
  }
  std::printf("  size:      %s logical, %s stored\n", HumanBytes(info.logical_bytes).c_str(), HumanBytes(stored->total).c_str());
  std::vector<std::string> names;
  for (const auto& t : (*reader)->tensors()) names.push_back(t.name);
  const NameColumn column = TensorColumn(names, args);
  std::printf("\n%s %-8s %-18s %10s %10s  %s\n", column.Heading("TENSOR").c_str(), "DTYPE", "SHAPE", "SIZE", "STORED",
              "PLACEMENT");
  for (size_t i = 0; i < (*reader)->tensors().size(); ++i) {
    const TensorRecord& t = (*reader)->tensors()[i];
    std::printf("%s %-8s %-18s %10s %10s  %s\n", column.Cell(t.name).c_str(), std::string(DTypeName(t.dtype)).c_str(),
                ShapeToString(t.shape).c_str(), HumanBytes(t.ByteSize()).c_str(), HumanBytes(stored->tensors[i]).c_str(),
                DescribePlacement(t).c_str());
    if (!args.Has("shards")) continue;
    for (const auto& s : t.shards) {
      std::string ranks;
      for (uint32_t r : s.ranks) ranks += (ranks.empty() ? "" : ",") + std::to_string(r);
      std::printf("    %-36s ranks %s\n", s.region.ToString().c_str(), ranks.c_str());
    }
  }
  if (!(*reader)->blobs().empty()) {
    std::vector<std::string> blob_names;
    for (const auto& b : (*reader)->blobs()) blob_names.push_back(b.name);
    const NameColumn blobs = TensorColumn(blob_names, args);
    std::printf("\n%s %10s\n", blobs.Heading("BLOB").c_str(), "SIZE");
    for (const auto& b : (*reader)->blobs()) {
      std::printf("%s %10s\n", blobs.Cell(b.name).c_str(), HumanBytes(b.size).c_str());
    }
  }
  return kExitOk;
}


const CommandSpec kDu{"du", "[NAME...]", "Show the space checkpoints use, and what deduplication and compression save.",
                      "Per checkpoint: logical bytes, the stored bytes of the chunks it references, and\n"
                      "the stored bytes only it references (what removing it alone would reclaim).\n"
                      "The total says what gc without a retention policy would reclaim now, as\n"
                      "'ckpt gc --dry-run' does. With --by-kind, the same per kind of state, each\n"
                      "tensor sorted by its name and dtype: 16-bit weights, fp32 weights (or master\n"
                      "copies), Adam's first and second moments, other; a kind's chunks counted\n"
                      "once, stored against decoded (its compression).",
                      {kJsonOpt, {"by-kind", 0, false, false, "", "also report space and compression per kind of state"}},
                      0, SIZE_MAX};

// What gc would reclaim inside recorded packs: referenced neither by a
// committed checkpoint, nor by a pending rank, nor by a removed checkpoint
// (which gc reclaims only once nobody reads it).
int CmdDu(const GlobalOptions& global, const Args& args) {
  int rc = kExitOk;
  auto repo = OpenRepoOr(global, &rc);
  if (!repo) return rc;
  auto figures = MeasureUsage(*repo, args.positional, args.Has("by-kind"));
  if (!figures.ok()) return Fail(figures.status());
  if (args.Has("json")) {
    PrintJson(DescribeUsage(*figures, repo->remote()));
    return kExitOk;
  }
  const UsageReport* r = &figures->usage;
  const GcReport* gc = &figures->dry_gc;
  const uint64_t reclaimable = gc->bytes_reclaimed();
  std::printf("%-28s %12s %12s %12s\n", "NAME", "LOGICAL", "REFERENCED", "EXCLUSIVE");
  for (const auto& e : r->checkpoints) {
    std::printf("%-28s %12s %12s %12s\n", e.name.c_str(), HumanBytes(e.logical_bytes).c_str(),
                HumanBytes(e.referenced_bytes).c_str(), HumanBytes(e.exclusive_bytes).c_str());
  }
  std::printf("\ntotal: %s logical, %s after dedup, %s stored (%s in packs: %s pending, %s dead)\n",
              HumanBytes(r->logical_bytes).c_str(), HumanBytes(r->unique_raw_bytes).c_str(),
              HumanBytes(r->referenced_bytes).c_str(), HumanBytes(r->pack_bytes).c_str(),
              HumanBytes(r->pending_bytes).c_str(), HumanBytes(GarbageBytes(*r)).c_str());
  std::printf("gc would reclaim %s now%s\n", HumanBytes(reclaimable).c_str(),
              GarbageBytes(*r) > gc->dead_pack_bytes + gc->rewritten_pack_bytes - gc->rewritten_live_bytes
                  ? " (dead chunks in packs at least half live stay until their pack falls below half)"
                  : "");
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
  if (!figures->kinds.empty()) {
    std::printf("\n%-16s %8s %12s %12s %12s %8s\n", "KIND", "TENSORS", "LOGICAL", "UNIQUE", "STORED", "STORED/");
    for (const KindUsage& k : figures->kinds) {
      if (k.tensors == 0) continue;
      std::printf("%-16s %8llu %12s %12s %12s %8.3f\n", k.kind.c_str(), static_cast<unsigned long long>(k.tensors),
                  HumanBytes(k.logical_bytes).c_str(), HumanBytes(k.unique_raw_bytes).c_str(),
                  HumanBytes(k.stored_bytes).c_str(), k.stored_fraction());
    }
    std::printf("(STORED/: stored over unique, the kind's compression; a chunk two kinds share counts in both)\n");
  }
  return kExitOk;
}

const CommandSpec kDiff{"diff", "A B", "Compare two checkpoints tensor by tensor, and their blobs.",
                        "For each tensor and blob: whether it changed, the fraction of A's bytes in\n"
                        "chunks B shares and how many of A's chunks B lacks; for floating-point\n"
                        "tensors the largest and the mean |a - b| and the relative L2 change\n"
                        "||b - a|| / ||a||. Without --all, unchanged ones are counted, not listed\n"
                        "(in --json too).",
                        {kJsonOpt, kWideOpt, {"all", 'a', false, false, "", "list unchanged tensors and blobs too"}},
                        2, 2};

int CmdDiff(const GlobalOptions& global, const Args& args) {
  int rc = kExitOk;
  auto repo = OpenRepoOr(global, &rc);
  if (!repo) return rc;
  auto diffs = repo->Diff(args.positional[0], args.positional[1]);
  if (!diffs.ok()) return Fail(diffs.status());
  const bool all = args.Has("all");
  if (args.Has("json")) {
    Json j = Json::MakeArray();
    for (const auto& d : *diffs) {
      if (d.kind == TensorDiff::Kind::kUnchanged && !all) continue;
      j.Push(DescribeTensorDiff(d));
    }
    PrintJson(j);
    return kExitOk;
  }
  size_t changed = 0, tensors = 0, blobs = 0, changed_blobs = 0;
  std::vector<std::string> names;
  for (const auto& d : *diffs) {
    if (d.kind != TensorDiff::Kind::kUnchanged || all) names.push_back((d.blob ? "blob " : "") + d.name);
  }
  const NameColumn column(names, 48, 64, args.Has("wide"));
  std::printf("%s %-20s %8s %9s %12s %12s %12s\n", column.Heading("TENSOR / BLOB").c_str(), "STATUS", "SHARED",
              "CHUNKS", "MAX |A-B|", "MEAN |A-B|", "REL L2");
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
    std::printf("%s %-20s %8s %9s %12s %12s %12s\n", column.Cell((d.blob ? "blob " : "") + d.name).c_str(),
                DiffKindName(d.kind), shared, chunks, max_diff, mean, l2);
  }
  std::printf("%zu of %zu tensors differ, %zu of %zu blobs\n", changed, tensors, changed_blobs, blobs);
  return kExitOk;
}

}  // namespace

const Command kLsCommand{&kLs, CmdLs};
const Command kShowCommand{&kShow, CmdShow};
const Command kDuCommand{&kDu, CmdDu};
const Command kDiffCommand{&kDiff, CmdDiff};

}  // namespace ckptfs::cli
