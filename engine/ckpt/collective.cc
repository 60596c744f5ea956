// Collective saves and restores (collective.h): each step is an all-gather
// of every rank's plan or outcome, so that every rank takes the same
// decisions and fails together.
#include "ckpt/collective.h"

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <utility>

#include "ckpt/collective_plan.h"
#include "ckpt/layout.h"
#include "core/chunk_id.h"
#include "core/encoding.h"

namespace ckptfs {
namespace {

// A rank's message: its entries (and, for a save whose replicas are
// compared, the hash of each), or why it has none.
std::string EncodePlan(const Status& local, const std::vector<PlanEntry>& entries, std::string_view digests) {
  Encoder e;
  e.U8(local.ok() ? 1 : 0);
  e.String(local.ok() ? "" : local.ToString());
  e.Varint(entries.size());
  for (const PlanEntry& p : entries) {
    e.String(p.name);
    e.Varint(p.shape.size());
    for (uint64_t d : p.shape) e.Varint(d);
    e.U8(static_cast<uint8_t>(p.region.kind));
    if (p.region.kind == Region::Kind::kBox) {
      e.Varint(p.region.box.offsets.size());
      for (size_t i = 0; i < p.region.box.offsets.size(); ++i) {
        e.Varint(p.region.box.offsets[i]);
        e.Varint(p.region.box.lengths[i]);
      }
    } else {
      e.Varint(p.region.flat.start);
      e.Varint(p.region.flat.end);
    }
    e.Varint(p.bytes);
  }
  e.String(digests);
  return e.Take();
}

Status DecodePlan(std::string_view data, std::string* error, std::vector<PlanEntry>* entries, std::string* digests) {
  Decoder d(data);
  uint8_t ok = 0;
  CKPT_RETURN_IF_ERROR(d.U8(&ok));
  CKPT_RETURN_IF_ERROR(d.String(error));
  if (ok) error->clear();
  auto count = [&](uint64_t* n) -> Status {
    CKPT_RETURN_IF_ERROR(d.Varint(n));
    if (*n > d.remaining()) return Status::Corruption("a plan's count exceeds its bytes");
    return Status::OK();
  };
  uint64_t n;
  CKPT_RETURN_IF_ERROR(count(&n));
  entries->resize(n);
  for (PlanEntry& p : *entries) {
    CKPT_RETURN_IF_ERROR(d.String(&p.name));
    uint64_t rank;
    CKPT_RETURN_IF_ERROR(count(&rank));
    p.shape.resize(rank);
    for (uint64_t& dim : p.shape) CKPT_RETURN_IF_ERROR(d.Varint(&dim));
    uint8_t kind = 0;
    CKPT_RETURN_IF_ERROR(d.U8(&kind));
    if (kind == static_cast<uint8_t>(Region::Kind::kBox)) {
      CKPT_RETURN_IF_ERROR(count(&rank));
      Box box;
      box.offsets.resize(rank);
      box.lengths.resize(rank);
      for (uint64_t i = 0; i < rank; ++i) {
        CKPT_RETURN_IF_ERROR(d.Varint(&box.offsets[i]));
        CKPT_RETURN_IF_ERROR(d.Varint(&box.lengths[i]));
      }
      p.region = Region::OfBox(std::move(box));
    } else if (kind == static_cast<uint8_t>(Region::Kind::kFlat)) {
      uint64_t start, end;
      CKPT_RETURN_IF_ERROR(d.Varint(&start));
      CKPT_RETURN_IF_ERROR(d.Varint(&end));
      p.region = Region::OfFlat(start, end);
    } else {
      return Status::Corruption("a plan names region kind " + std::to_string(kind));
    }
    CKPT_RETURN_IF_ERROR(d.Varint(&p.bytes));
  }
  CKPT_RETURN_IF_ERROR(d.String(digests));
  if (!d.done()) return Status::Corruption("a plan has trailing bytes");
  return Status::OK();
}

void EncodeChunk(Encoder& e, const ChunkRef& c) {
  e.Bytes(c.id.bytes.data(), c.id.bytes.size());
  e.Varint(c.raw_len);
}

}  // namespace

std::string EncodeLoadPlan(const RankLoadPlan& p) {
  Encoder e;
  e.Varint(p.unique_bytes);
  e.Varint(p.needed_bytes);
  e.Varint(p.fetch_bytes);
  e.Varint(p.routes.size());
  for (const RankRoute& r : p.routes) {
    e.Varint(r.route);
    e.Varint(static_cast<uint64_t>(r.reader));
    e.Varint(r.bytes);
    e.Varint(r.entries.size());
    for (size_t i : r.entries) e.Varint(i);
    e.Varint(r.peers.size());
    for (int peer : r.peers) e.Varint(static_cast<uint64_t>(peer));
  }
  e.Varint(p.windows.size());
  for (const HandoffWindow& w : p.windows) {
    e.Varint(w.routes_end);
    e.U8(w.exchange ? 1 : 0);
    e.Varint(w.hold.size());
    for (const ChunkRef& c : w.hold) EncodeChunk(e, c);
    e.Varint(w.handoffs.size());
    for (const ChunkHandoff& h : w.handoffs) {
      EncodeChunk(e, h.chunk);
      e.Varint(static_cast<uint64_t>(h.from));
      e.Varint(static_cast<uint64_t>(h.to));
      e.Varint(h.owner_route);
      e.Varint(h.route);
      e.Varint(h.index);
    }
    e.Varint(w.release.size());
    for (const ChunkRef& c : w.release) EncodeChunk(e, c);
  }
  return e.Take();
}

Status DecodeLoadPlan(std::string_view data, size_t entries, int ranks, RankLoadPlan* p) {
  Decoder d(data);
  auto count = [&](uint64_t* n) -> Status {
    CKPT_RETURN_IF_ERROR(d.Varint(n));
    if (*n > d.remaining()) return Status::Corruption("a load plan's count exceeds its bytes");
    return Status::OK();
  };
  auto rank = [&](int* r) -> Status {
    uint64_t v;
    CKPT_RETURN_IF_ERROR(d.Varint(&v));
    if (v >= static_cast<uint64_t>(ranks)) return Status::Corruption("a load plan names rank " + std::to_string(v));
    *r = static_cast<int>(v);
    return Status::OK();
  };
  auto chunk = [&](ChunkRef* c) -> Status {
    CKPT_RETURN_IF_ERROR(d.Bytes(c->id.bytes.data(), c->id.bytes.size()));
    uint64_t len;
    CKPT_RETURN_IF_ERROR(d.Varint(&len));
    if (len > UINT32_MAX) return Status::Corruption("a load plan's chunk is too long");
    c->raw_len = static_cast<uint32_t>(len);
    return Status::OK();
  };
  auto chunks = [&](std::vector<ChunkRef>* out) -> Status {
    uint64_t n;
    CKPT_RETURN_IF_ERROR(count(&n));
    out->resize(n);
    for (ChunkRef& c : *out) CKPT_RETURN_IF_ERROR(chunk(&c));
    return Status::OK();
  };
  CKPT_RETURN_IF_ERROR(d.Varint(&p->unique_bytes));
  CKPT_RETURN_IF_ERROR(d.Varint(&p->needed_bytes));
  CKPT_RETURN_IF_ERROR(d.Varint(&p->fetch_bytes));
  uint64_t n;
  CKPT_RETURN_IF_ERROR(count(&n));
  p->routes.resize(n);
  for (RankRoute& r : p->routes) {
    uint64_t v;
    CKPT_RETURN_IF_ERROR(d.Varint(&v));
    r.route = v;
    CKPT_RETURN_IF_ERROR(rank(&r.reader));
    CKPT_RETURN_IF_ERROR(d.Varint(&r.bytes));
    CKPT_RETURN_IF_ERROR(count(&n));
    if (n == 0) return Status::Corruption("a load plan's route names none of this rank's entries");
    r.entries.resize(n);
    for (size_t& i : r.entries) {
      CKPT_RETURN_IF_ERROR(d.Varint(&v));
      if (v >= entries) return Status::Corruption("a load plan names entry " + std::to_string(v));
      i = v;
    }
    CKPT_RETURN_IF_ERROR(count(&n));
    r.peers.resize(n);
    for (int& peer : r.peers) CKPT_RETURN_IF_ERROR(rank(&peer));
  }
  CKPT_RETURN_IF_ERROR(count(&n));
  p->windows.resize(n);
  size_t end = 0;
  for (HandoffWindow& w : p->windows) {
    uint64_t v;
    CKPT_RETURN_IF_ERROR(d.Varint(&v));
    if (v < end || v > p->routes.size()) return Status::Corruption("a load plan's windows are out of order");
    w.routes_end = end = v;
    uint8_t exchange = 0;
    CKPT_RETURN_IF_ERROR(d.U8(&exchange));
    w.exchange = exchange != 0;
    CKPT_RETURN_IF_ERROR(chunks(&w.hold));
    CKPT_RETURN_IF_ERROR(count(&n));
    w.handoffs.resize(n);
    for (ChunkHandoff& h : w.handoffs) {
      CKPT_RETURN_IF_ERROR(chunk(&h.chunk));
      CKPT_RETURN_IF_ERROR(rank(&h.from));
      CKPT_RETURN_IF_ERROR(rank(&h.to));
      CKPT_RETURN_IF_ERROR(d.Varint(&v));
      h.owner_route = v;
      CKPT_RETURN_IF_ERROR(d.Varint(&v));
      h.route = v;
      CKPT_RETURN_IF_ERROR(d.Varint(&v));
      h.index = v;
    }
    CKPT_RETURN_IF_ERROR(chunks(&w.release));
  }
  if (!p->windows.empty() && end != p->routes.size()) return Status::Corruption("a load plan's windows miss routes");
  if (!d.done()) return Status::Corruption("a load plan has trailing bytes");
  return Status::OK();
}

namespace {

Status Collective(StatusCode code, std::string message) {
  return Status(code, std::move(message)).WithDetail(StatusDetail::kCollective);
}

// The group's transport failed in `step` on this rank.
Status StepFailed(const Communicator& comm, const std::string& step, const Status& st) {
  return Collective(st.code(), "the step '" + step + "' failed on rank " + std::to_string(comm.rank()) + " of " +
                                   std::to_string(comm.size()) + ": " + st.message());
}

// What rank 0 computes from every rank's entries (and what each sent
// beside them): each rank's part of the plan, or why it cannot.
using PlanParts =
    std::function<Result<std::vector<std::string>>(const std::vector<std::vector<PlanEntry>>& plans,
                                                    const std::vector<std::string>& extras)>;

// A part of the plan as sent: a status code, then the part or the error.
std::string PartMessage(const Status& st, std::string_view part) {
  std::string m(1, static_cast<char>(st.code()));
  m.append(st.ok() ? part : std::string_view(st.message()));
  return m;
}

// The plan is made once, at rank 0: every rank's entries are gathered
// there, rank 0 computes every rank's part (`compute`) and sends each its
// own. Returns this rank's part and how many bytes of plan it received, or
// the agreed error: naming the first failing rank (or rank 0's plan, when
// computing it failed).
Result<std::string> PlanAtRankZero(Communicator& comm, const std::string& step, const Status& local,
                                   const std::vector<PlanEntry>& mine, std::string_view extra,
                                   const PlanParts& compute, uint64_t* received) {
  auto said = comm.Gather(EncodePlan(local, local.ok() ? mine : std::vector<PlanEntry>{}, extra), 0);
  if (!said.ok()) {
    if (!local.ok()) return Collective(local.code(), "rank " + std::to_string(comm.rank()) + " failed in '" + step +
                                                         "': " + local.ToString());
    return StepFailed(comm, step, said.status());
  }
  std::vector<std::string> parts;
  if (comm.rank() == 0) {
    Status failed;
    std::vector<std::vector<PlanEntry>> plans(said->size());
    std::vector<std::string> extras(said->size());
    if (said->size() != static_cast<size_t>(comm.size())) {
      failed = Status::Internal("the communicator gathered " + std::to_string(said->size()) + " plans from " +
                                std::to_string(comm.size()) + " ranks");
    }
    for (size_t r = 0; failed.ok() && r < said->size(); ++r) {
      std::string error;
      Status st = DecodePlan((*said)[r], &error, &plans[r], &extras[r]);
      if (!st.ok()) {
        failed = st.WithContext("the plan of rank " + std::to_string(r));
      } else if (!error.empty()) {
        failed = Status::IOError("rank " + std::to_string(r) + " failed in '" + step + "': " + error);
      }
    }
    Result<std::vector<std::string>> computed = failed;
    if (failed.ok()) computed = compute(plans, extras);
    if (computed.ok() && computed->size() != static_cast<size_t>(comm.size())) {
      computed = Status::Internal("the plan has " + std::to_string(computed->size()) + " parts for " +
                                  std::to_string(comm.size()) + " ranks");
    }
    parts.resize(static_cast<size_t>(comm.size()));
    for (size_t r = 0; r < parts.size(); ++r) {
      if (computed.ok()) {
        parts[r] = PartMessage(Status::OK(), (*computed)[r]);
      } else if (!failed.ok()) {
        parts[r] = PartMessage(failed, "");
      } else {
        parts[r] = PartMessage(computed.status().WithContext("in '" + step + "'"), "");
      }
    }
  }
  auto part = comm.Scatter(parts, 0);
  if (!part.ok()) return StepFailed(comm, step, part.status());
  if (part->empty()) return Collective(StatusCode::kInternal, "rank 0 sent no plan in the step '" + step + "'");
  *received = part->size();
  if (comm.rank() == 0) {
    for (const std::string& m : *said) *received += m.size();
  }
  const auto code = static_cast<StatusCode>(static_cast<unsigned char>((*part)[0]));
  if (code != StatusCode::kOk) return Collective(code, part->substr(1));
  return part->substr(1);
}

std::string KeyOf(const TensorInfo& t) { return t.name + '\0' + std::string(DTypeName(t.dtype)); }

Status CheckRegion(const TensorInfo& t, const Region& region, size_t bytes) {
  CKPT_RETURN_IF_ERROR(ValidateRegion(t.shape, region).WithContext("tensor '" + t.name + "'"));
  const uint64_t want = region.NumElements() * DTypeSize(t.dtype);
  if (bytes != want) {
    return Status::InvalidArgument("tensor '" + t.name + "': region " + region.ToString() + " of " +
                                   std::string(DTypeName(t.dtype)) + " is " + std::to_string(want) +
                                   " bytes, the memory given is " + std::to_string(bytes));
  }
  return Status::OK();
}

// Every rank's regions checked against their tensors' shapes at rank 0 (a
// tensor's entry is named "tensor NUL dtype"; a blob's has no NUL).
Status CheckEveryRegion(const std::vector<std::vector<PlanEntry>>& plans) {
  for (size_t r = 0; r < plans.size(); ++r) {
    for (const PlanEntry& p : plans[r]) {
      const size_t cut = p.name.find('\0');
      if (cut == std::string::npos) continue;
      CKPT_RETURN_IF_ERROR(ValidateRegion(p.shape, p.region)
                               .WithContext("rank " + std::to_string(r) + ", '" + p.name.substr(0, cut) + "' (" +
                                            p.name.substr(cut + 1) + ")"));
    }
  }
  return Status::OK();
}

class HostMemory final : public CollectiveMemory {
 public:
  std::unique_ptr<ShardSource> Source(std::span<const std::byte> data) override {
    return std::make_unique<HostSource>(data);
  }
  Result<ChunkId> Digest(std::span<const std::byte> data) override { return ChunkId::Of(data); }
  Status Read(const CheckpointReader& reader, const TensorRecord& tensor, const Region& region,
              std::span<std::byte> target) override {
    return reader.ReadRegion(tensor, region, target);
  }
  Status Copy(std::span<std::byte> dst, std::span<const std::byte> src) override {
    if (!src.empty() && dst.data() != src.data()) std::memcpy(dst.data(), src.data(), src.size());
    return Status::OK();
  }
};

}  // namespace

CollectiveMemory& HostCollectiveMemory() {
  static HostMemory memory;
  return memory;
}

Status AgreeCollective(Communicator& comm, const std::string& step, std::string_view error, StatusCode code) {
  const std::string me = std::to_string(comm.rank());
  auto own = [&] { return Collective(code, "rank " + me + " failed in '" + step + "': " + std::string(error)); };
  // One all-reduce of a flag when all went well; the errors are gathered
  // only when some rank failed.
  uint64_t all_ok = error.empty() ? 1 : 0;
  Status reduced = comm.AllReduceMin(std::span<uint64_t>(&all_ok, 1));
  if (!reduced.ok()) return error.empty() ? StepFailed(comm, step, reduced) : own();
  if (all_ok == 1) return Status::OK();
  auto said = comm.AllGather(error);
  if (!said.ok()) return error.empty() ? StepFailed(comm, step, said.status()) : own();
  for (size_t r = 0; r < said->size(); ++r) {
    if ((*said)[r].empty()) continue;
    if (r == static_cast<size_t>(comm.rank())) return own();
    return Collective(StatusCode::kIOError, "rank " + std::to_string(r) + " failed in '" + step + "': " + (*said)[r]);
  }
  return Collective(StatusCode::kInternal, "the step '" + step + "': a rank failed and none said why");
}

Status AgreeCollective(Communicator& comm, const std::string& step, const Status& local) {
  return AgreeCollective(comm, step, local.ok() ? std::string() : local.ToString(), local.code());
}

Result<std::string> ShareFromRankZero(Communicator& comm, const std::string& step, const Status& rank0,
                                      std::string_view data) {
  std::string mine;
  if (comm.rank() == 0) {
    mine.push_back(static_cast<char>(rank0.code()));
    mine.append(rank0.ok() ? data : std::string_view(rank0.message()));
  }
  auto said = comm.BroadcastMessage(std::move(mine), 0);
  if (!said.ok()) return StepFailed(comm, step, said.status());
  if (comm.rank() == 0 && !rank0.ok()) return rank0;
  if (said->empty()) return Collective(StatusCode::kInternal, "rank 0 sent nothing in the step '" + step + "'");
  std::string_view first = *said;
  const auto code = static_cast<StatusCode>(static_cast<unsigned char>(first[0]));
  first.remove_prefix(1);
  if (code != StatusCode::kOk) {
    return Status(code, std::string(first) + " (rank 0 of " + std::to_string(comm.size()) + ", in '" + step + "')");
  }
  return std::string(first);
}

Status ShareOpeningSync(Repository* repo, std::string_view open_error, Communicator& comm) {
  CKPT_RETURN_IF_ERROR(AgreeCollective(comm, "open the repository", open_error));
  if (repo == nullptr) return Collective(StatusCode::kInternal, "a repository opened without an error is missing");
  Result<std::string> listing = comm.rank() == 0 ? repo->ShareSync() : Result<std::string>(std::string());
  CKPT_ASSIGN_OR_RETURN(std::string shared,
                        ShareFromRankZero(comm, "share the store listing", listing.status(),
                                          listing.ok() ? std::string_view(*listing) : std::string_view()));
  Status local = comm.rank() != 0 ? repo->SyncFrom(shared) : Status::OK();
  return AgreeCollective(comm, "apply the store listing", local);
}

Result<std::unique_ptr<Repository>> OpenCollective(const std::string& url, OpenOptions options, Communicator& comm) {
  options.opening_sync = false;
  auto repo = Repository::Open(url, options);
  CKPT_RETURN_IF_ERROR(ShareOpeningSync(repo.ok() ? repo->get() : nullptr,
                                        repo.ok() ? std::string() : repo.status().ToString(), comm));
  return std::move(repo).value();
}

bool DeliverOnDevice(std::span<const std::string> tokens) {
  std::vector<std::string_view> seen;
  for (const std::string& t : tokens) {
    if (t.empty()) return false;
    seen.push_back(t);
  }
  std::sort(seen.begin(), seen.end());
  return std::adjacent_find(seen.begin(), seen.end()) == seen.end();
}

Result<CollectiveSavePlan> PlanCollectiveSave(Communicator& comm, const std::string& name,
                                              const std::vector<PlanEntry>& mine, const Status& local,
                                              std::span<const ChunkId> digests, bool verify_replicas) {
  // What rank 0 gathers beside the entries: the checkpoint's name (ranks
  // naming different checkpoints would each leave a part of a checkpoint
  // that never completes), a NUL, and the replicas' hashes.
  std::string extra = name + '\0';
  Status described = local;
  if (described.ok() && verify_replicas && digests.size() != mine.size()) {
    described = Status::InvalidArgument("the replicas' check needs a hash of each value: " +
                                        std::to_string(digests.size()) + " for " + std::to_string(mine.size()));
  }
  for (size_t i = 0; verify_replicas && described.ok() && i < digests.size(); ++i) {
    extra.append(reinterpret_cast<const char*>(digests[i].bytes.data()), digests[i].bytes.size());
  }
  auto plan = [&](const std::vector<std::vector<PlanEntry>>& plans,
                  const std::vector<std::string>& said) -> Result<std::vector<std::string>> {
    CKPT_RETURN_IF_ERROR(CheckEveryRegion(plans));
    std::vector<std::string_view> every(said.size());
    std::string_view first_name;
    for (size_t r = 0; r < said.size(); ++r) {
      const size_t cut = said[r].find('\0');
      if (cut == std::string::npos) return Status::Internal("rank " + std::to_string(r) + " sent no checkpoint name");
      const std::string_view named = std::string_view(said[r]).substr(0, cut);
      if (r == 0) first_name = named;
      if (named != first_name) {
        return Status::InvalidArgument("rank 0 saves checkpoint '" + std::string(first_name) + "' and rank " +
                                       std::to_string(r) + " saves '" + std::string(named) +
                                       "': every rank of a collective save names the same checkpoint");
      }
      every[r] = std::string_view(said[r]).substr(cut + 1);
    }
    const LoadRoutes routes = AssignLoadReaders(plans);
    if (verify_replicas) {
      // The load planner's grouping of equal regions says which entries
      // are replicas of each other.
      const size_t w = ChunkId{}.bytes.size();
      for (size_t r = 0; r < plans.size(); ++r) {
        if (every[r].size() != plans[r].size() * w) {
          return Status::Internal("rank " + std::to_string(r) + " sent " + std::to_string(every[r].size()) +
                                  " bytes of hashes for " + std::to_string(plans[r].size()) + " values");
        }
      }
      for (const LoadRoute& route : routes.routes) {
        const auto [r0, i0] = route.needers.front();
        const std::string_view first = every[r0].substr(i0 * w, w);
        for (const auto& [r, i] : route.needers) {
          if (every[r].substr(i * w, w) != first) {
            const std::string& key = plans[r][i].name;
            return Status::InvalidArgument("the replicas of '" + key.substr(0, key.find('\0')) + "' differ: rank " +
                                           std::to_string(r0) + " and rank " + std::to_string(r) +
                                           " hold different bytes for the same region");
          }
        }
      }
    }
    const SaveOwners owners = OwnersOfRoutes(routes, plans);
    std::vector<std::string> parts;
    parts.reserve(plans.size());
    for (const std::vector<uint8_t>& put : owners.put) {
      Encoder e;
      e.Varint(owners.unique_bytes);
      e.Varint(owners.held_bytes);
      e.String(std::string_view(reinterpret_cast<const char*>(put.data()), put.size()));
      e.Varint(owners.bytes_per_rank.size());
      for (uint64_t b : owners.bytes_per_rank) e.Varint(b);
      parts.push_back(e.Take());
    }
    return parts;
  };
  CollectiveSavePlan out;
  CKPT_ASSIGN_OR_RETURN(std::string part, PlanAtRankZero(comm, kStepDescribeValues, described, mine, extra, plan,
                                                         &out.plan_bytes_received));
  Decoder d(part);
  std::string put;
  uint64_t ranks = 0;
  Status st = d.Varint(&out.unique_bytes);
  if (st.ok()) st = d.Varint(&out.held_bytes);
  if (st.ok()) st = d.String(&put);
  if (st.ok()) st = d.Varint(&ranks);
  if (st.ok() && ranks != static_cast<uint64_t>(comm.size())) st = Status::Corruption("a save plan for other ranks");
  out.bytes_per_rank.resize(st.ok() ? ranks : 0);
  for (size_t r = 0; st.ok() && r < out.bytes_per_rank.size(); ++r) st = d.Varint(&out.bytes_per_rank[r]);
  if (st.ok() && (!d.done() || put.size() != mine.size())) st = Status::Corruption("a malformed save plan");
  CKPT_RETURN_IF_ERROR(st.WithContext("the save plan from rank 0"));
  out.put.assign(put.begin(), put.end());
  return out;
}

Result<std::unique_ptr<CheckpointWriter>> BeginCollectiveSave(Repository& repo, const std::string& name,
                                                              Communicator& comm, WriterOptions options,
                                                              Status* own) {
  *own = Status::OK();
  options.rank = static_cast<uint32_t>(comm.rank());
  options.world_size = static_cast<uint32_t>(comm.size());
  // One store sync for the group: rank 0 begins, listing the store under
  // its shared store lock, and sends what it listed; the others apply
  // that. And one lock and one completion: the others take no store lock
  // and their commits only put their parts; rank 0's commit waits for
  // every part, then completes the checkpoint, so its lock covers every
  // rank from before any began (WriterOptions::await_ranks).
  if (options.await_ranks.count() <= 0) options.await_ranks = kDefaultAwaitRanks;
  Result<std::unique_ptr<CheckpointWriter>> writer = Status::Internal("no writer begun");
  std::string listing;
  // Rank 0 also gives the save its attempt (WriterOptions::attempt), unless
  // the caller did: a job restarted after a crash takes over the name.
  if (comm.rank() == 0) {
    if (options.attempt.empty()) options.attempt = NewSaveAttempt();
    WriterOptions first = options;
    first.share_sync = &listing;
    writer = repo.BeginCheckpoint(name, first);
  }
  CKPT_ASSIGN_OR_RETURN(std::string shared,
                        ShareFromRankZero(comm, kStepBegin, writer.status(), options.attempt + '\n' + listing));
  if (comm.rank() == 0) return writer;
  const size_t end = shared.find('\n');
  if (end == std::string::npos) {
    *own = Status::Internal("rank 0's store listing came without the save attempt");
    return std::unique_ptr<CheckpointWriter>();
  }
  WriterOptions rest = options;
  rest.attempt = shared.substr(0, end);
  shared.erase(0, end + 1);
  rest.shared_sync = &shared;
  writer = repo.BeginCheckpoint(name, rest);
  if (!writer.ok()) {
    *own = writer.status();
    return std::unique_ptr<CheckpointWriter>();
  }
  return writer;
}

Result<CollectiveSaveResult> SaveCollective(Repository& repo, const std::string& name,
                                            std::span<const CollectiveShard> shards,
                                            std::span<const CollectiveBlob> blobs, Communicator& comm,
                                            WriterOptions options, bool verify_replicas) {
  return SaveCollective(repo, name, shards, blobs, comm, HostCollectiveMemory(), std::move(options), verify_replicas);
}

Result<CollectiveSaveResult> SaveCollective(Repository& repo, const std::string& name,
                                            std::span<const CollectiveShard> shards,
                                            std::span<const CollectiveBlob> blobs, Communicator& comm,
                                            CollectiveMemory& memory, WriterOptions options, bool verify_replicas) {
  // 1. What this rank holds (and, to compare replicas, a hash of each),
  // gathered at rank 0, which assigns the owners and sends each rank
  // which of its values it puts.
  std::vector<PlanEntry> mine;
  Status local = ValidateMemberName("checkpoint name", name);
  for (const CollectiveShard& s : shards) {
    if (!local.ok()) break;
    local = CheckRegion(s.tensor, s.region, s.data.size());
    mine.push_back({KeyOf(s.tensor), s.tensor.shape, s.region, s.data.size()});
  }
  for (const CollectiveBlob& b : blobs) mine.push_back({b.name, {}, Region::OfFlat(0, 0), b.data.size()});
  std::vector<ChunkId> digests;
  for (size_t i = 0; verify_replicas && local.ok() && i < shards.size(); ++i) {
    auto id = memory.Digest(shards[i].data);
    if (id.ok()) digests.push_back(*id);
    else local = id.status().WithContext("hashing '" + shards[i].tensor.name + "'");
  }
  for (size_t i = 0; verify_replicas && local.ok() && i < blobs.size(); ++i) digests.push_back(ChunkId::Of(blobs[i].data));
  CKPT_ASSIGN_OR_RETURN(CollectiveSavePlan plan, PlanCollectiveSave(comm, name, mine, local, digests, verify_replicas));
  CollectiveSaveResult result;
  result.unique_bytes = plan.unique_bytes;
  result.held_bytes = plan.held_bytes;
  result.bytes_per_rank = plan.bytes_per_rank;
  result.plan_bytes_received = plan.plan_bytes_received;
  // 2. Each rank begins its writer; 3. puts what it owns.
  Status own;
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointWriter> writer,
                        BeginCollectiveSave(repo, name, comm, std::move(options), &own));
  local = own;
  for (size_t i = 0; local.ok() && i < shards.size(); ++i) {
    if (!plan.put[i]) continue;
    const std::unique_ptr<ShardSource> source = memory.Source(shards[i].data);
    local = writer->PutShard(shards[i].tensor, shards[i].region, *source);
    result.put_bytes += shards[i].data.size();
  }
  for (size_t i = 0; local.ok() && i < blobs.size(); ++i) {
    if (!plan.put[shards.size() + i]) continue;
    local = writer->PutBlob(blobs[i].name, blobs[i].data);
    result.put_bytes += blobs[i].data.size();
  }
  Status agreed = AgreeCollective(comm, kStepPut, local);
  if (!agreed.ok()) {
    if (writer) writer->Abort();
    return agreed;
  }
  // 4. Commit: rank 0's, once every rank's part is in, makes the
  // checkpoint visible.
  auto committed = writer->Commit().Wait();
  CKPT_RETURN_IF_ERROR(AgreeCollective(comm, kStepCommit, committed.status()));
  result.commit = *committed;
  return result;
}

Result<CollectiveLoadResult> LoadCollective(Repository& repo, const std::string& name,
                                            std::span<const CollectiveTarget> targets, Communicator& comm) {
  return LoadCollective(repo, name, targets, comm, HostCollectiveMemory());
}

Result<CollectiveLoadResult> LoadCollective(Repository& repo, const std::string& name,
                                            std::span<const CollectiveTarget> targets, Communicator& comm,
                                            CollectiveMemory& memory, std::span<Repository* const> nearer) {
  // 1. What each rank needs, gathered at rank 0. One read lease for the
  // job: rank 0's, taken (and the checkpoint checked against the store)
  // before it makes the plan and held until every rank agrees its fetches
  // are done; no rank fetches before it has its part of the plan. The
  // others open without one and send what they opened (its identity), for
  // rank 0 to check that it is the checkpoint it leased, and the device
  // their targets are on.
  const auto called = std::chrono::steady_clock::now();
  double make_seconds = 0;
  Status local = memory.Ready();
  Result<std::unique_ptr<CheckpointReader>> reader = Status::Internal("no reader opened");
  if (local.ok()) {
    ReadOptions read;
    read.lease = comm.rank() == 0;
    read.nearer.assign(nearer.begin(), nearer.end());
    reader = repo.OpenCheckpoint(name, read);
    local = reader.status();
  }
  // The saving ranks whose parts this rank's nearer tiers hold (its host's
  // fast tier): rank 0 has a region read by a rank whose host holds it.
  std::string held;
  for (Repository* tier : nearer) {
    auto listed = tier->ListCheckpoints(/*include_pending=*/true);
    if (!listed.ok()) continue;  // that tier is skipped by the reads too
    for (const CheckpointRecord& c : *listed) {
      if (keys::ReplacedName(c.name) != name) continue;
      if (c.state == CheckpointState::kCommitted) {
        for (uint32_t r = 0; r < c.world_size; ++r) held += std::to_string(r) + ",";
      } else {
        for (uint32_t r : c.committed_ranks) held += std::to_string(r) + ",";
      }
    }
  }
  const std::string extra = (reader.ok() ? CheckpointIdentity((*reader)->info()) : std::string()) + '\0' +
                            memory.DeliveryDevice() + '\0' + held;
  std::vector<const TensorRecord*> records(targets.size(), nullptr);
  std::vector<PlanEntry> mine;
  for (size_t i = 0; local.ok() && i < targets.size(); ++i) {
    const CollectiveTarget& t = targets[i];
    local = CheckRegion(t.tensor, t.region, t.data.size());
    if (!local.ok()) break;
    auto found = (*reader)->FindTarget(t.tensor.name, t.tensor.dtype, t.tensor.shape);
    local = found.status();
    if (found.ok()) records[i] = *found;
    mine.push_back({KeyOf(t.tensor), t.tensor.shape, t.region, t.data.size()});
  }
  // 2. Rank 0 makes the plan once, its reader listing the chunks of
  // every rank's regions, and sends each rank its part, with whether the
  // regions travel over the device.
  auto plan = [&](const std::vector<std::vector<PlanEntry>>& plans,
                  const std::vector<std::string>& extras) -> Result<std::vector<std::string>> {
    const auto making = std::chrono::steady_clock::now();
    const CheckpointReader& r = **reader;  // rank 0's, open: its failure stops the plan before this
    std::vector<std::string> identities, devices;
    std::vector<std::vector<uint32_t>> near(extras.size());
    for (size_t k = 0; k < extras.size(); ++k) {
      const std::string& x = extras[k];
      const size_t cut = x.find('\0'), cut2 = cut == std::string::npos ? cut : x.find('\0', cut + 1);
      if (cut2 == std::string::npos) return Status::Internal("a rank sent no delivery device or nearer ranks");
      identities.push_back(x.substr(0, cut));
      devices.push_back(x.substr(cut + 1, cut2 - cut - 1));
      std::string_view list = std::string_view(x).substr(cut2 + 1);
      for (size_t at = 0; at < list.size();) {
        const size_t comma = list.find(',', at);
        if (comma == std::string_view::npos) break;
        uint32_t r = 0;
        auto [end, ec] = std::from_chars(list.data() + at, list.data() + comma, r);
        if (ec != std::errc() || end != list.data() + comma) return Status::Internal("a rank sent malformed nearer ranks");
        near[k].push_back(r);
        at = comma + 1;
      }
    }
    for (size_t k = 1; k < identities.size(); ++k) {
      if (identities[k] != identities[0]) {
        return Status::FailedPrecondition("rank " + std::to_string(k) + "'s host knows another checkpoint named '" +
                                          name + "' than rank 0's: its catalog is behind the store (open the "
                                          "repository collectively to bring every host's catalog up to date)");
      }
    }
    const char on_device = DeliverOnDevice(devices) ? 1 : 0;
    std::vector<std::string> parts;
    for (const RankLoadPlan& p : PlanLoadForRanks(
             plans, [&](std::string_view tensor) { return r.FindTensor(tensor); }, kHandoffWindowBytes, near)) {
      parts.push_back(std::string(1, on_device) + EncodeLoadPlan(p));
    }
    make_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - making).count();
    return parts;
  };
  uint64_t plan_bytes = 0;
  CKPT_ASSIGN_OR_RETURN(std::string part,
                        PlanAtRankZero(comm, kStepDescribeTargets, local, mine, extra, plan, &plan_bytes));
  const double plan_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - called).count();
  RankLoadPlan routes;
  const bool on_device = !part.empty() && part[0] != 0;
  CKPT_RETURN_IF_ERROR(DecodeLoadPlan(std::string_view(part).substr(part.empty() ? 0 : 1), mine.size(), comm.size(),
                                      &routes)
                           .WithContext("the load plan from rank 0"));
  const int me = comm.rank();
  CollectiveLoadResult result;
  result.unique_bytes = routes.unique_bytes;
  result.plan_bytes_received = plan_bytes;
  result.plan_seconds = plan_seconds;
  result.plan_make_seconds = make_seconds;
  const std::vector<HandoffWindow>& windows = routes.windows;
  // 3. Chunks that regions with different readers share are fetched by one
  // of them and handed over decoded before those regions are read, in
  // windows that bound what the ranks hold. 4. Each region is read by its
  // reader. A rank whose read or check fails keeps exchanging, so no peer
  // waits for it, and says so at the end. Either every rank takes part in
  // a window's exchange or none does; so with the preparing of the
  // hand-off buffer.
  size_t largest = 0;
  bool any_handoff = false;
  for (const HandoffWindow& w : windows) {
    any_handoff = any_handoff || w.exchange;
    for (const ChunkHandoff& h : w.handoffs) largest = std::max<size_t>(largest, h.chunk.raw_len);
  }
  if (any_handoff) {
    CKPT_RETURN_IF_ERROR(AgreeCollective(comm, "prepare the hand-offs", memory.PrepareHandoffs(largest)));
  }
  Status failed;
  std::vector<std::byte> buffer;
  size_t begin = 0;
  for (const HandoffWindow& w : windows) {
    if (w.exchange) {
      Status held;
      for (const ChunkRef& c : w.hold) {
        held = (*reader)->HoldChunk(c);
        if (!held.ok()) break;
      }
      CKPT_RETURN_IF_ERROR(AgreeCollective(comm, "fetch the shared chunks", held));
      // This rank's, in the plan's order, as its peers make them.
      for (const ChunkHandoff& h : w.handoffs) {
        buffer.resize(h.chunk.raw_len);
        if (h.from == me) {
          Status copied = (*reader)->CopyHeldChunk(h.chunk, buffer);
          if (!copied.ok() && failed.ok()) failed = copied;  // sent anyway: the receiver's check fails, none waits
          Status sent = memory.SendHost(comm, buffer, h.to);
          if (!sent.ok() && failed.ok()) failed = StepFailed(comm, "hand over the shared chunks", sent);
          result.handoff_sent_bytes += buffer.size();
        } else {
          Status got = memory.RecvHost(comm, buffer, h.from);
          if (!got.ok() && failed.ok()) failed = StepFailed(comm, "hand over the shared chunks", got);
          result.handoff_received_bytes += buffer.size();
          if (failed.ok()) failed = (*reader)->LendChunk(h.chunk, buffer);
        }
      }
    }
    for (size_t k = begin; failed.ok() && k < w.routes_end; ++k) {
      const RankRoute& route = routes.routes[k];
      if (route.reader != me) continue;
      const size_t i = route.entries.front();
      failed = memory.Read(**reader, *records[i], targets[i].region, targets[i].data);
      result.fetched_bytes += targets[i].data.size();
    }
    (*reader)->ReleaseChunks(w.release);
    begin = w.routes_end;
  }
  CKPT_RETURN_IF_ERROR(AgreeCollective(comm, kStepFetch, failed));
  // 5. Then sent to the other ranks needing it, in one round, and copied
  // to this rank's other entries of the same region.
  std::vector<Communicator::Transfer> transfers;
  for (const RankRoute& route : routes.routes) {
    std::span<std::byte> first = targets[route.entries.front()].data;
    if (me == route.reader) {
      for (int peer : route.peers) {
        transfers.push_back({.send = true, .peer = peer, .data = first, .tag = route.route});
        result.sent_bytes += first.size();
      }
    } else {
      transfers.push_back({.send = false, .peer = route.reader, .data = first, .tag = route.route});
      result.received_bytes += first.size();
    }
  }
  Status delivered = memory.Deliver(comm, transfers, on_device);
  if (!delivered.ok()) delivered = StepFailed(comm, kStepDeliver, delivered);
  for (const RankRoute& route : routes.routes) {
    const std::vector<size_t>& own = route.entries;
    for (size_t k = 1; delivered.ok() && k < own.size(); ++k) {
      delivered = memory.Copy(targets[own[k]].data, targets[own.front()].data);
    }
  }
  CKPT_RETURN_IF_ERROR(AgreeCollective(comm, kStepDeliver, delivered));
  return result;
}

}  // namespace ckptfs
