// Thin retention (RetentionPolicy::thin_older_than): an old checkpoint
// keeps its model and drops its optimizer state.
//
// A thinning is a replacing save of the checkpoint's own ranks that puts
// the kept tensors and blobs again by reference: every chunk is in the
// repository already, so nothing is read or written but records. The save
// runs under "NAME~" as any replacing save does, and its last commit
// renames it over NAME in one step: a crash anywhere leaves the whole
// checkpoint (and perhaps a replacement that the next thinning or gc
// drops), never a mix. The rename checks that NAME still holds the version
// that was read (another host may have saved it again, or removed it), and
// the thinned version keeps that version's place in the commit order, so
// that "newest" and keep-last mean what they meant before.
#include <fnmatch.h>

#include <algorithm>
#include <array>
#include <ctime>

#include "ckpt/copy.h"
#include "ckpt/repository.h"
#include "ckpt/repository_impl.h"

namespace ckptfs {
namespace {

// Parts of a name that say it is optimizer, scheduler or RNG state.
constexpr std::array<std::string_view, 12> kNotModel = {
    "optim",         "optimizer",    "optimizers", "optim_state", "optimizer_state", "optimizer_states",
    "lr_scheduler", "lr_schedulers", "scheduler",  "rng",         "rng_states",      "rng_tracker"};

bool IsTrainingState(std::string_view name) {
  size_t begin = 0;
  while (begin <= name.size()) {
    size_t end = name.find_first_of("./", begin);
    if (end == std::string_view::npos) end = name.size();
    const std::string_view part = name.substr(begin, end - begin);
    if (part.starts_with("rng_state") ||
        std::find(kNotModel.begin(), kNotModel.end(), part) != kNotModel.end()) {
      return true;
    }
    begin = end + 1;
  }
  return false;
}

std::string UtcNow() {
  const time_t t = std::time(nullptr);
  struct tm tm;
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

}  // namespace

bool ThinKeeps(std::string_view name, DType dtype, bool blob, const std::vector<std::string>& patterns) {
  if (!patterns.empty()) {
    const std::string n(name);
    return std::any_of(patterns.begin(), patterns.end(),
                       [&](const std::string& p) { return fnmatch(p.c_str(), n.c_str(), 0) == 0; });
  }
  if (IsTrainingState(name)) return false;
  const std::string_view kind = StateKindOf(name, dtype, blob);
  return kind != "adam_exp_avg" && kind != "adam_exp_avg_sq";
}

ThinPlan PlanThin(const std::vector<TensorRecord>& tensors, const std::vector<BlobRecord>& blobs,
                  const std::vector<std::string>& patterns) {
  ThinPlan plan;
  for (const TensorRecord& t : tensors) {
    if (ThinKeeps(t.name, t.dtype, false, patterns)) {
      plan.tensors.push_back(t);
    } else {
      ++plan.dropped_tensors;
      plan.dropped_bytes += t.ByteSize();
    }
  }
  for (const BlobRecord& b : blobs) {
    if (ThinKeeps(b.name, DType::kU8, true, patterns)) {
      plan.blobs.push_back(b);
    } else {
      ++plan.dropped_blobs;
      plan.dropped_bytes += b.size;
    }
  }
  return plan;
}

std::string DescribeDropped(const ThinPlan& plan) {
  const auto count = [](uint64_t n, const char* what) {
    return std::to_string(n) + " " + what + (n == 1 ? "" : "s");
  };
  if (!plan.dropped_blobs) return count(plan.dropped_tensors, "tensor");
  if (!plan.dropped_tensors) return count(plan.dropped_blobs, "blob");
  return count(plan.dropped_tensors, "tensor") + " and " + count(plan.dropped_blobs, "blob");
}

std::string DescribeThinRule(const std::vector<std::string>& patterns) {
  if (patterns.empty()) return "optimizer, scheduler and RNG state";
  std::string out = "what matches none of";
  for (size_t i = 0; i < patterns.size(); ++i) out += (i ? ", '" : " '") + patterns[i] + "'";
  return out;
}

Result<bool> ThinCheckpoint(Repository& repo, const std::string& name, const std::vector<std::string>& patterns) {
  RepositoryImpl& impl = *repo.impl_;
  ReadOptions manifest_only;
  manifest_only.lease = false;  // the records only: no chunk is read
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader, repo.OpenCheckpoint(name, manifest_only));
  CKPT_RETURN_IF_ERROR(CheckShardRanks(*reader));
  const CheckpointRecord info = reader->info();
  const ThinPlan plan = PlanThin(reader->tensors(), reader->blobs(), patterns);
  if (!plan.thins()) return false;

  WriterOptions wo;
  wo.world_size = info.world_size;
  wo.step = info.step;
  for (const auto& tag : info.tags) {
    if (tag.first != kThinnedTag) wo.tags.push_back(tag);
  }
  wo.tags.emplace_back(kThinnedTag, UtcNow() + ": dropped " + DescribeDropped(plan) + " (" +
                                        std::to_string(plan.dropped_bytes) + " bytes) of " +
                                        DescribeThinRule(patterns));
  wo.engine_tags = true;
  wo.overwrite = true;
  wo.attempt = NewSaveAttempt();
  wo.thins = info.sequence;
  wo.thins_committed_unix_ms = info.committed_unix_ms;
  // Nothing is fetched: every chunk the kept records name is here.
  DirectFetcher unused(
      impl.backend.get(), [r = &impl](const ChunkId& id) { return r->LookupChunk(id); }, impl.buffers.get(),
      impl.protocol->RelocationRefresh());
  CopyCounters counters;
  for (uint32_t rank = 0; rank < info.world_size; ++rank) {
    wo.rank = rank;
    CKPT_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointWriter> writer, repo.BeginCheckpoint(name, wo));
    // Under the writer's lock no gc deletes a chunk. The version read must
    // still be the name's: its chunks are then live, and stay so until
    // this rank's commit records its references.
    CKPT_ASSIGN_OR_RETURN(std::optional<CheckpointRecord> now, CommittedRecord(impl, name));
    if (!now || now->sequence != info.sequence || now->committed_unix_ms != info.committed_unix_ms) return false;
    const RankRecord part = PartOfRank(plan.tensors, plan.blobs, rank);
    CKPT_RETURN_IF_ERROR(PutStoredRank(*writer, part, {}, unused, impl.IoPool(), 1, counters)
                             .WithContext("thinning checkpoint '" + name + "' rank " + std::to_string(rank)));
    auto committed = writer->Commit().Wait();
    if (!committed.ok()) {
      // The rename refuses a version that changed meanwhile.
      CKPT_ASSIGN_OR_RETURN(now, CommittedRecord(impl, name));
      if (!now || now->sequence != info.sequence) return false;
      return committed.status().WithContext("thinning checkpoint '" + name + "'");
    }
  }
  return true;
}

}  // namespace ckptfs
