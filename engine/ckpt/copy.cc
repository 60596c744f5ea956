// Copying checkpoints between repositories (repository.h CopyCheckpoints).
//
// A checkpoint is copied as the ranks that saved it: rank r of the copy puts
// every shard whose record names rank r (so the merge at the destination
// gives each shard the same ranks, in the same order, as at the source) and
// rank 0 the blobs. Each rank is a writer of the destination's own, whose
// commit is durable on its own. A copy that fails or is cancelled removes
// the pending checkpoint it was making (chunks of the ranks it committed
// stay until gc, so the next copy sends only what is missing); a killed one
// leaves it pending with the ranks it finished, and the next copy commits
// the rest.
#include <algorithm>
#include <map>
#include <set>
#include <unordered_map>

#include "ckpt/commit.h"
#include "ckpt/copy.h"
#include "ckpt/repository.h"
#include "ckpt/repository_impl.h"

namespace ckptfs {
namespace {

// Whether the destination's checkpoint holds what the source's does: the
// same tensors, shards, chunks and blobs, step, world size (`world`, the
// source's as copied: WorldNeeded) and tags (not when it was made).
bool SameContent(const CheckpointReader& a, uint32_t world, const CheckpointReader& b) {
  const CheckpointRecord& x = a.info();
  const CheckpointRecord& y = b.info();
  if (x.step != y.step || world != y.world_size || x.tags != y.tags) return false;
  if (a.tensors().size() != b.tensors().size() || a.blobs().size() != b.blobs().size()) return false;
  for (size_t i = 0; i < a.tensors().size(); ++i) {
    if (EncodeTensor(a.tensors()[i]) != EncodeTensor(b.tensors()[i])) return false;
  }
  for (size_t i = 0; i < a.blobs().size(); ++i) {
    if (EncodeBlob(a.blobs()[i]) != EncodeBlob(b.blobs()[i])) return false;
  }
  return true;
}

// The world size a copy of the checkpoint gets: the source's, but no more
// than its shards name (the highest rank any shard names, plus one; rank 0
// holds the blobs). A source that claims 20,000 ranks for shards of four
// costs four ranks' commits, not 20,000.
uint32_t WorldNeeded(const CheckpointReader& reader) {
  uint32_t highest = 0;
  for (const TensorRecord& t : reader.tensors()) {
    for (const ShardRecord& s : t.shards) {
      if (!s.ranks.empty()) highest = std::max(highest, *std::max_element(s.ranks.begin(), s.ranks.end()));
    }
  }
  return std::min(reader.info().world_size, highest + 1);
}

}  // namespace

RankRecord PartOfRank(const std::vector<TensorRecord>& tensors, const std::vector<BlobRecord>& blobs, uint32_t rank) {
  RankRecord part;
  part.rank = rank;
  for (const TensorRecord& t : tensors) {
    TensorRecord mine{t.name, t.dtype, t.shape, {}};
    for (const ShardRecord& s : t.shards) {
      if (std::find(s.ranks.begin(), s.ranks.end(), rank) != s.ranks.end()) mine.shards.push_back(s);
    }
    if (!mine.shards.empty()) part.tensors.push_back(std::move(mine));
  }
  if (rank == 0) part.blobs = blobs;
  return part;
}

// Every shard must name ranks of the checkpoint, or no rank would put it.
Status CheckShardRanks(const CheckpointReader& reader) {
  const uint32_t world = reader.info().world_size;
  for (const TensorRecord& t : reader.tensors()) {
    for (const ShardRecord& s : t.shards) {
      if (s.ranks.empty() || *std::max_element(s.ranks.begin(), s.ranks.end()) >= world) {
        return Status::Corruption("checkpoint '" + reader.info().name + "': a shard of tensor '" + t.name +
                                  "' names no rank of its world size " + std::to_string(world));
      }
    }
  }
  return Status::OK();
}

Status PutRanks(RepositoryImpl& src, DirectFetcher& fetcher, Repository& destination, RepositoryImpl& dst,
                const std::string& name,
                const WriterOptions& header, std::span<const RankRecord> parts, size_t ranks_at_once,
                HandledChunks& handled, CopyCounters& counters, uint32_t* ranks_committed, uint64_t* stored_sent,
                const std::function<void()>& after_wave) {
  // Ranks are put `ranks_at_once` at a time (their packs written side by
  // side) and committed in the order given. Each chunk the destination
  // lacks is sent by the first rank of the wave that names it; the others
  // only reference it, and commit after that rank did. A rank whose put
  // failed stops the commits there: the ranks before it are kept
  // (resumption).
  const size_t at_once = std::max<size_t>(1, ranks_at_once);
  for (size_t first = 0; first < parts.size(); first += at_once) {
    if (counters.cancelled && counters.cancelled()) return Status::FailedPrecondition("cancelled");
    const size_t n = std::min(at_once, parts.size() - first);
    std::vector<std::unique_ptr<CheckpointWriter>> writers(n);
    std::vector<std::vector<ChunkRef>> sends(n);
    for (size_t i = 0; i < n; ++i) {
      WriterOptions wo = header;
      wo.rank = parts[first + i].rank;
      CKPT_ASSIGN_OR_RETURN(writers[i], destination.BeginCheckpoint(name, wo));
    }
    // On an object store, packs an interrupted copy finished are listed
    // by the writers' sync; their indexes make their chunks present.
    CKPT_RETURN_IF_ERROR(dst.protocol->IndexPacks());
    for (size_t i = 0; i < n; ++i) {
      // A reference names a chunk by id and length; the length must be
      // the chunk's wherever it is named, or the copy would commit a
      // checkpoint that cannot be read.
      auto consider = [&](const ChunkRef& c, const std::string& member) -> Status {
        auto [first_ref, fresh] = handled.emplace(c.id, c.raw_len);
        if (!fresh) {  // sent or counted for an earlier reference
          if (first_ref->second == c.raw_len) return Status::OK();
          return Status::Corruption("checkpoint '" + name + "' " + member + " references chunk " + c.id.ToHex() +
                                    " with length " + std::to_string(c.raw_len) + ", elsewhere with length " +
                                    std::to_string(first_ref->second));
        }
        auto known = dst.LookupChunk(c.id);
        if (known.ok() && known->raw_len != c.raw_len) {
          return Status::Corruption("checkpoint '" + name + "' " + member + " references chunk " + c.id.ToHex() +
                                    " with length " + std::to_string(c.raw_len) +
                                    ", but the destination's chunk of that id has length " +
                                    std::to_string(known->raw_len) + "; nothing of it was committed");
        }
        if (known.ok()) {
          counters.chunks_present.fetch_add(1);
          counters.raw_bytes_present.fetch_add(c.raw_len);
          return Status::OK();
        }
        if (!known.status().IsNotFound()) return known.status();
        sends[i].push_back(c);
        return Status::OK();
      };
      const RankRecord& part = parts[first + i];
      for (const TensorRecord& t : part.tensors) {
        for (const ShardRecord& s : t.shards) {
          for (const ChunkRef& c : s.chunks) CKPT_RETURN_IF_ERROR(consider(c, "tensor '" + t.name + "'"));
        }
      }
      for (const BlobRecord& b : part.blobs) {
        for (const ChunkRef& c : b.chunks) CKPT_RETURN_IF_ERROR(consider(c, "blob '" + b.name + "'"));
      }
    }
    std::vector<Status> put(n);
    const size_t threads = std::max<size_t>(1, src.io_threads / n);
    ParallelFor(src.IoPool(), n, n, [&](size_t i) {
      put[i] = PutStoredRank(*writers[i], parts[first + i], sends[i], fetcher, src.IoPool(), threads, counters)
                   .WithContext("copying checkpoint '" + name + "' rank " + std::to_string(parts[first + i].rank));
    });
    for (size_t i = 0; i < n; ++i) {
      CKPT_RETURN_IF_ERROR(put[i]);
      auto committed_rank = writers[i]->Commit().Wait();
      if (!committed_rank.ok()) {
        return committed_rank.status().WithContext("committing checkpoint '" + name + "' rank " +
                                                   std::to_string(parts[first + i].rank) + " at the destination");
      }
      *stored_sent += committed_rank->stored_bytes;
      ++*ranks_committed;
    }
    if (after_wave) after_wave();
  }
  return Status::OK();
}

Result<CopyReport> CopyCheckpoints(Repository& source, Repository& destination, const CopyOptions& options,
                                   const ProgressFn& progress) {
  RepositoryImpl& src = *source.impl_;
  RepositoryImpl& dst = *destination.impl_;
  CKPT_RETURN_IF_ERROR(src.CheckProcess());
  CKPT_RETURN_IF_ERROR(dst.CheckProcess());
  if (&src == &dst || (!src.path.empty() && src.path == dst.path)) {
    return Status::InvalidArgument("source and destination are the same repository (" + src.path + ")");
  }
  auto phase = [&](const std::string& what) {
    if (options.on_phase) options.on_phase(what);
  };

  // What to copy, in commit order.
  CKPT_ASSIGN_OR_RETURN(std::vector<CheckpointRecord> committed, source.ListCheckpoints());
  std::vector<CheckpointRecord> selected;
  if (!options.names.empty()) {
    std::set<std::string> wanted(options.names.begin(), options.names.end());
    for (const CheckpointRecord& c : committed) {
      if (wanted.erase(c.name)) selected.push_back(c);
    }
    if (!wanted.empty()) {
      return Status::NotFound("the source has no committed checkpoint '" + *wanted.begin() + "'");
    }
  } else if (options.last) {
    const size_t n = std::min<size_t>(*options.last, committed.size());
    selected.assign(committed.end() - n, committed.end());
  } else if (options.all) {
    selected = committed;
  } else {
    return Status::InvalidArgument("name the checkpoints to copy, or ask for all or the last N");
  }
  uint64_t total = 0;
  for (const CheckpointRecord& c : selected) total += c.logical_bytes;
  uint64_t done_before = 0;
  if (progress) progress(0, total);

  CKPT_ASSIGN_OR_RETURN(std::vector<CheckpointRecord> at_destination, destination.ListCheckpoints(true));
  std::map<std::string, CheckpointRecord> there;
  for (CheckpointRecord& c : at_destination) there.emplace(c.name, std::move(c));

  CKPT_RETURN_IF_ERROR(src.protocol->IndexPacks());
  DirectFetcher fetcher(
      src.backend.get(), [r = &src](const ChunkId& id) { return r->LookupChunk(id); }, src.buffers.get(),
      src.protocol->RelocationRefresh());

  CopyReport report;
  // One checkpoint; on an error or a cancel after it began at the
  // destination, its pending copy is removed there (below).
  auto copy_one = [&](const CheckpointRecord& rec, bool* began) -> Status {
    CopiedCheckpoint out;
    out.name = rec.name;
    // The source's bytes stay while we read them (a read lease).
    CKPT_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader, source.OpenCheckpoint(rec.name));
    CKPT_RETURN_IF_ERROR(CheckShardRanks(*reader));
    const CheckpointRecord& info = reader->info();
    const uint32_t world = WorldNeeded(*reader);
    std::set<uint32_t> done_ranks;
    if (auto it = there.find(rec.name); it != there.end()) {
      const CheckpointRecord& theirs = it->second;
      if (theirs.state == CheckpointState::kCommitted) {
        ReadOptions no_lease;
        no_lease.lease = false;
        CKPT_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> other, destination.OpenCheckpoint(rec.name, no_lease));
        if (!SameContent(*reader, world, *other)) {
          return Status::AlreadyExists("the destination has a different checkpoint named '" + rec.name + "'");
        }
        out.outcome = CopiedCheckpoint::Outcome::kPresent;
        phase(rec.name + ": present at the destination, skipped");
        report.checkpoints.push_back(out);
        done_before += rec.logical_bytes;
        if (progress) progress(done_before, total);
        return Status::OK();
      }
      if (theirs.world_size != world || theirs.step != info.step) {
        return Status::AlreadyExists("the destination has a pending checkpoint named '" + rec.name +
                                     "' of another world size or step; remove it first (ckpt rm)");
      }
      if (theirs.committed_ranks.size() == theirs.world_size) {
        // Every rank is in but the checkpoint is not visible: the last
        // commit was interrupted between its rank's record and the
        // manifest (an object store's protocol, commit_store.cc). No rank
        // can commit again; the pending checkpoint is removed and copied
        // anew, which finds its chunks present and sends none of them.
        phase(rec.name + ": every rank is in at the destination, but its commit was interrupted; committing it again");
        CKPT_RETURN_IF_ERROR(destination.RemoveCheckpoints({rec.name}));
      } else {
        done_ranks.insert(theirs.committed_ranks.begin(), theirs.committed_ranks.end());
      }
    }
    phase("copying " + rec.name + " (" + std::to_string(world) + (world == 1 ? " rank" : " ranks") +
          (world < info.world_size ? " of the " + std::to_string(info.world_size) + " it claims: no shard names the others"
                                   : "") +
          (done_ranks.empty() ? "" : ", " + std::to_string(done_ranks.size()) + " committed before") + ")");
    CopyCounters counters;
    counters.cancelled = options.cancelled;
    HandledChunks handled;
    std::vector<RankRecord> parts;
    for (uint32_t rank = 0; rank < world; ++rank) {
      if (!done_ranks.count(rank)) parts.push_back(PartOfRank(reader->tensors(), reader->blobs(), rank));
    }
    WriterOptions header;
    header.world_size = world;
    header.step = info.step;
    header.tags = info.tags;
    header.engine_tags = true;  // a thinned checkpoint stays marked
    *began = !parts.empty();
    uint64_t stored_sent = 0;
    CKPT_RETURN_IF_ERROR(PutRanks(src, fetcher, destination, dst, rec.name, header, parts, options.ranks_at_once, handled,
                                  counters, &out.ranks_copied, &stored_sent, [&] {
                                    if (!progress) return;
                                    const uint64_t handled_bytes =
                                        counters.raw_bytes_sent.load() + counters.raw_bytes_present.load();
                                    progress(done_before + std::min(handled_bytes, rec.logical_bytes), total);
                                  }));
    out.chunks_sent = counters.chunks_sent.load();
    out.raw_bytes_sent = counters.raw_bytes_sent.load();
    out.stored_bytes_sent = stored_sent;
    out.chunks_present = counters.chunks_present.load();
    out.raw_bytes_present = counters.raw_bytes_present.load();
    report.chunks_sent += out.chunks_sent;
    report.raw_bytes_sent += out.raw_bytes_sent;
    report.stored_bytes_sent += out.stored_bytes_sent;
    report.chunks_present += out.chunks_present;
    report.raw_bytes_present += out.raw_bytes_present;
    report.checkpoints.push_back(out);
    done_before += rec.logical_bytes;
    if (progress) progress(done_before, total);
    return Status::OK();
  };
  for (const CheckpointRecord& rec : selected) {
    bool began = false;
    Status st = copy_one(rec, &began);
    if (st.ok()) continue;
    // Nothing is left pending: the ranks committed are removed with the
    // checkpoint's record, while their chunks stay in the destination's
    // packs until a gc, so that running the copy again sends only what is
    // missing.
    if (began) {
      auto listed = destination.ListCheckpoints(/*include_pending=*/true);
      bool pending = false;
      for (const CheckpointRecord& c : listed.ok() ? *listed : std::vector<CheckpointRecord>{}) {
        pending = pending || (c.name == rec.name && c.state != CheckpointState::kCommitted);
      }
      if (pending) {
        Status removed = destination.RemoveCheckpoints({rec.name});
        st = st.WithContext(removed.ok() ? "copy of '" + rec.name + "' stopped; its pending copy at the destination "
                                                  "was removed (chunks of the ranks committed stay until gc: running the copy again "
                                                  "sends only what is missing)"
                                         : "copy of '" + rec.name + "' stopped, and removing its pending copy at the "
                                                  "destination failed (" + removed.message() + "; ckpt rm it)");
      }
    }
    return st;
  }
  return report;
}

}  // namespace ckptfs
