// Collective saves and restores: the ranks of a Communicator
// (ckpt/communicator.h) plan together (ckpt/collective_plan.h) so that a
// region several ranks hold is hashed, encoded and written by one of them,
// and a region several ranks need is fetched, verified and decoded by one
// of them and sent to the others. This is the one driver of the protocol:
// C++ callers use SaveCollective and LoadCollective; the Python package
// runs the same over torch.distributed (its binding's communicator and
// memory, ckptfs/collective.py), putting its own values between the save's
// steps (PlanCollectiveSave, BeginCollectiveSave, AgreeCollective).
//
// The tensors' memory is host memory, moved by a communicator that moves
// host memory (the host group, or a caller's own over MPI, gloo and the
// like), unless the caller passes a CollectiveMemory saying otherwise:
// gpu/collective_device.h gives one for device memory and a communicator
// that moves device memory (NCCL). Errors are agreed: when a step fails on
// one rank, every rank returns an error naming that rank and the step
// (StatusDetail::kCollective), and nothing becomes visible.
#pragma once

#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ckpt/collective_plan.h"
#include "ckpt/communicator.h"
#include "ckpt/repository.h"

namespace ckptfs {

// Where a collective's tensor bytes live, and how they are read, written,
// copied and handed over. Blobs are host memory whatever it is. The
// engine's own calls on one rank come from that rank's thread, in order.
class CollectiveMemory {
 public:
  virtual ~CollectiveMemory() = default;
  // What a writer reads to put `data`.
  virtual std::unique_ptr<ShardSource> Source(std::span<const std::byte> data) = 0;
  // ChunkId::Of the bytes at `data` (replica checks).
  virtual Result<ChunkId> Digest(std::span<const std::byte> data) = 0;
  // `region` of `tensor` from the checkpoint into `target`.
  virtual Status Read(const CheckpointReader& reader, const TensorRecord& tensor, const Region& region,
                      std::span<std::byte> target) = 0;
  // Between two targets of one rank.
  virtual Status Copy(std::span<std::byte> dst, std::span<const std::byte> src) = 0;
  // Called on every rank before chunks are handed over, with the largest
  // this rank sends or receives; what SendHost and RecvHost need is got
  // here.
  virtual Status PrepareHandoffs(size_t largest) {
    (void)largest;
    return Status::OK();
  }
  // Host bytes (decoded chunks) over a communicator that moves this memory.
  // SendHost sends host.size() bytes even when staging them failed (then
  // returning that error), so that the peer never waits for them. The
  // default is for a communicator that moves host memory.
  virtual Status SendHost(Communicator& comm, std::span<const std::byte> host, int peer) {
    return comm.Send(host, peer);
  }
  virtual Status RecvHost(Communicator& comm, std::span<std::byte> host, int peer) { return comm.Recv(host, peer); }
  // Whether the memory could take the targets it was given: a caller that
  // failed to describe its targets says so here, and a load fails on every
  // rank at its first step, naming this rank.
  virtual Status Ready() const { return Status::OK(); }
  // A token naming the one device whose memory holds every target of this
  // rank, where the regions can travel device to device (a GPU's UUID);
  // empty otherwise. A load delivers over the device when every rank gives
  // one and no two the same (DeliverOnDevice).
  virtual std::string DeliveryDevice() const { return {}; }
  // Delivers the fetched regions: one round of transfers of the targets'
  // bytes (Communicator::Exchange), `on_device` as the ranks agreed.
  virtual Status Deliver(Communicator& comm, std::span<const Communicator::Transfer> transfers, bool on_device) {
    (void)on_device;
    return comm.Exchange(transfers);
  }
};
// Host memory, moved as it is.
CollectiveMemory& HostCollectiveMemory();

// Opens the repository at `url` on every rank of `comm` with one listing of
// its store: every rank opens it without the opening sync, rank 0 syncs and
// shares what it listed and fetched (Repository::ShareSync), and the other
// ranks apply that (SyncFrom). An error on any rank is an error on all.
Result<std::unique_ptr<Repository>> OpenCollective(const std::string& url, OpenOptions options, Communicator& comm);

// A region of a tensor this rank holds: region.NumElements() elements of
// tensor.dtype, row-major, at `data`.
struct CollectiveShard {
  TensorInfo tensor;
  Region region;
  std::span<const std::byte> data;
};
struct CollectiveBlob {
  std::string name;
  std::span<const std::byte> data;
};
struct CollectiveSaveResult {
  CommitResult commit;         // this rank's
  uint64_t put_bytes = 0;      // what this rank hashed, encoded and wrote
  uint64_t unique_bytes = 0;   // each distinct region once, over the group
  uint64_t held_bytes = 0;     // every region of every rank
  std::vector<uint64_t> bytes_per_rank;  // what each rank puts
  // What this rank received of the plan: its own part (rank 0: also every
  // rank's entries, which it gathers to make the plan).
  uint64_t plan_bytes_received = 0;
};
// How long rank 0's commit of a collective save waits for the other
// ranks' parts unless WriterOptions::await_ranks says otherwise.
inline constexpr std::chrono::milliseconds kDefaultAwaitRanks = std::chrono::minutes(5);

// Every rank of `comm` calls it with its part; the rank and world size are
// the communicator's (those in `options` are ignored). On an object store
// the save costs one rank's listings and lock: rank 0's writer alone lists
// the store when it begins, the others apply its listing, take no store
// lock, and commit their parts without listing; rank 0's commit waits for
// every part and completes the checkpoint (WriterOptions::share_sync,
// shared_sync, await_ranks). The checkpoint is the
// one the ranks would save each alone: the owners' parts tile every tensor.
// With `verify_replicas` (tests, debugging: it hashes every replica), the
// holders of each region several ranks hold first compare hashes of their
// bytes, and every rank fails, naming the tensor and two ranks, where they
// differ; nothing is written then.
Result<CollectiveSaveResult> SaveCollective(Repository& repo, const std::string& name,
                                            std::span<const CollectiveShard> shards,
                                            std::span<const CollectiveBlob> blobs, Communicator& comm,
                                            WriterOptions options = {}, bool verify_replicas = false);
// The same with the shards' bytes in `memory` (Source, Digest).
Result<CollectiveSaveResult> SaveCollective(Repository& repo, const std::string& name,
                                            std::span<const CollectiveShard> shards,
                                            std::span<const CollectiveBlob> blobs, Communicator& comm,
                                            CollectiveMemory& memory, WriterOptions options = {},
                                            bool verify_replicas = false);

// A region of a saved tensor this rank needs, to be written at `data`.
struct CollectiveTarget {
  TensorInfo tensor;  // the dtype and global shape the caller expects
  Region region;
  std::span<std::byte> data;
};
struct CollectiveLoadResult {
  uint64_t fetched_bytes = 0;   // read from the store by this rank (logical)
  uint64_t received_bytes = 0;  // sent to this rank by others
  uint64_t sent_bytes = 0;
  uint64_t unique_bytes = 0;    // each distinct region once, over the group
  // Decoded chunks that regions read by different ranks share, handed over
  // by the rank that fetched them (PlanLoadForRanks).
  uint64_t handoff_sent_bytes = 0;
  uint64_t handoff_received_bytes = 0;
  uint64_t plan_bytes_received = 0;  // as CollectiveSaveResult's
  // Seconds from this rank's call until it held its part of the plan
  // (its reader open, the targets gathered at rank 0, the plan made and
  // sent); at rank 0, plan_make_seconds of them went into making it.
  double plan_seconds = 0;
  double plan_make_seconds = 0;
};
// Every rank calls it with the regions it needs (at any world size and
// replication). Each distinct region is read by one of the ranks needing
// it, balanced by bytes, and sent to the others point to point. Each
// stored chunk is fetched from the store once over the group: a chunk that
// regions of different readers cut (a restore at another world size) is
// fetched by one of them and handed to the others decoded.
Result<CollectiveLoadResult> LoadCollective(Repository& repo, const std::string& name,
                                            std::span<const CollectiveTarget> targets, Communicator& comm);
// The same with the targets in `memory` (Read, Copy, and the hand-offs
// through SendHost and RecvHost). `nearer`: repositories of this rank's
// host whose chunks its fetches take first (ReadOptions::nearer: a fast
// tier in front of `repo`; tiers.h). Rank 0 gives a region several ranks
// need to one whose nearer tiers hold a saving rank's part of every chunk
// of it (PlanLoadForRanks's `near`), when one does.
Result<CollectiveLoadResult> LoadCollective(Repository& repo, const std::string& name,
                                            std::span<const CollectiveTarget> targets, Communicator& comm,
                                            CollectiveMemory& memory, std::span<Repository* const> nearer = {});

// ---- The steps, for callers that put their own values ----------------------

// The steps' names, as errors name them.
inline constexpr char kStepDescribeValues[] = "describe the values";
inline constexpr char kStepBegin[] = "begin and share the store listing";
inline constexpr char kStepPut[] = "put the values";
inline constexpr char kStepCommit[] = "commit";
inline constexpr char kStepDescribeTargets[] = "describe the targets";
inline constexpr char kStepFetch[] = "fetch from the store";
inline constexpr char kStepDeliver[] = "deliver the fetched regions";

// Every rank says how its part of `step` went (`error`: empty when it went
// well). All return OK, or all an error with StatusDetail::kCollective:
// "rank R failed in 'STEP': ERROR" for the first rank R that failed (on R
// itself with its own code, given as `code`), or, when the exchange itself
// failed, "the step 'STEP' failed on rank r of n: ...". A rank whose own
// part failed reports its own error even when the exchange fails too.
Status AgreeCollective(Communicator& comm, const std::string& step, std::string_view error,
                       StatusCode code = StatusCode::kIOError);
Status AgreeCollective(Communicator& comm, const std::string& step, const Status& local);

// Rank 0's `data` on every rank, or rank 0's error (`rank0`, its outcome;
// the other ranks' is not asked): on rank 0 itself unchanged, on the
// others with its code and "MESSAGE (rank 0 of N, in 'STEP')".
Result<std::string> ShareFromRankZero(Communicator& comm, const std::string& step, const Status& rank0,
                                      std::string_view data);

// OpenCollective after its opens: every rank says how its open went
// (`repo`: null where it failed, and `open_error` says why), rank 0 syncs
// with the store and shares what it listed, the others apply that.
Status ShareOpeningSync(Repository* repo, std::string_view open_error, Communicator& comm);

// The plan of a collective save: which of this rank's entries it puts.
struct CollectiveSavePlan {
  std::vector<uint8_t> put;  // one per entry of `mine`
  uint64_t unique_bytes = 0;
  uint64_t held_bytes = 0;
  std::vector<uint64_t> bytes_per_rank;
  uint64_t plan_bytes_received = 0;
};
// Step 1 of a save: every rank's entries (tensor name NUL dtype, global
// shape, region, bytes; a blob: its name, no shape, an empty flat region)
// gathered at rank 0, which checks every region against its tensor,
// refuses ranks naming different checkpoints, with `verify_replicas`
// compares the holders' `digests` (one per entry: ChunkId::Of its bytes)
// of each region several ranks hold, assigns each region one owner and
// sends every rank its part. `local`: this rank's failure to describe its
// values, agreed on here.
Result<CollectiveSavePlan> PlanCollectiveSave(Communicator& comm, const std::string& name,
                                              const std::vector<PlanEntry>& mine, const Status& local,
                                              std::span<const ChunkId> digests, bool verify_replicas);
// Step 2: this rank's writer. Rank 0 begins, listing the store, and shares
// the listing and the save's attempt (`options.attempt`, a new one unless
// given); the others begin with them (WriterOptions::shared_sync). Rank
// 0's failure is every rank's error; this rank's own failure to begin is
// returned in `own` (with a null writer) for the puts' agreement.
// options.rank and world_size are the communicator's; await_ranks is
// kDefaultAwaitRanks unless given.
Result<std::unique_ptr<CheckpointWriter>> BeginCollectiveSave(Repository& repo, const std::string& name,
                                                              Communicator& comm, WriterOptions options,
                                                              Status* own);
// Then each rank puts the entries its plan gives it, agrees on kStepPut
// (aborting its writer on a failure), commits, and agrees on kStepCommit.

// Whether a load delivers over the device: every rank's DeliveryDevice
// token given and no two the same.
bool DeliverOnDevice(std::span<const std::string> tokens);

// One rank's part of a load plan as rank 0 sends it (C++ and the Python
// package alike), and read back on that rank: checked against the rank's
// count of `entries` and the group's `ranks`, so that a malformed part is
// Corruption rather than a read out of range.
std::string EncodeLoadPlan(const RankLoadPlan& part);
Status DecodeLoadPlan(std::string_view data, size_t entries, int ranks, RankLoadPlan* part);

// Hand-offs of decoded chunks are exchanged in windows of about this many
// bytes over the group, so what the ranks hold for each other stays bounded.
inline constexpr uint64_t kHandoffWindowBytes = 256ull << 20;

}  // namespace ckptfs
