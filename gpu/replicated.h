// Loading replicated tensors on a multi-GPU node: a tensor that every rank
// needs whole (layer norms, embeddings under tensor parallelism, everything
// under plain data parallelism) is read from the store by one rank and
// broadcast to the others over NCCL, instead of being read, verified and
// decoded once per GPU.
//
// A Communicator is one rank's end of a group of GPUs. Its calls are
// collective: every rank makes the same calls in the same order, with the
// same sizes and root. Two implementations: NCCL (one process per GPU, the
// usual launch) and a host group of threads in one process whose "device"
// memory is host memory, matching the host copy engine, for the CPU tests.
#pragma once

#include <array>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "ckpt/communicator.h"
#include "staging.h"

namespace ckptfs::gpu {

// The engine's communicator (ckpt/communicator.h); here its memory is
// device memory: a CUDA device's for NCCL, host memory for the host group,
// matching the host copy engine.
using ckptfs::Communicator;
using ckptfs::NewHostGroup;

// NCCL: one rank makes an id, the launcher shares it with the others (for
// example with torch.distributed), then every rank makes its communicator on
// its GPU. Unsupported when the build has no NCCL or no GPU is usable.
struct NcclId {
  std::array<char, 128> bytes{};
};
Result<NcclId> NewNcclId();
Result<std::unique_ptr<Communicator>> NewNcclCommunicator(int device, int size, int rank, const NcclId& id);
// True when NCCL is built in and a GPU is usable; otherwise `why` says which
// is missing.
bool NcclAvailable(std::string* why);

struct ReplicatedTensor {
  const TensorRecord* tensor = nullptr;
  Region region;                // usually the whole tensor
  std::byte* device = nullptr;  // this rank's buffer, region.NumElements() * dtype size bytes
};

struct ReplicatedLoadStats {
  uint64_t tensors_read = 0;    // by this rank, from the store
  uint64_t bytes_read = 0;
  uint64_t bytes_received = 0;  // broadcast to this rank by others
};

// Collective. Every rank passes the same tensors and regions in the same
// order, each with its own device buffer. Each tensor is read from the store
// (LoadToDevice) by one rank, the reading spread over the ranks by bytes,
// then broadcast to all. Either every rank returns OK with every buffer
// filled, or every rank returns an error (the failing rank's own error, or
// one naming the tensor and the rank that failed to read it); a rank whose
// list differs from the others' is reported on every rank before anything
// is read.
Result<ReplicatedLoadStats> LoadReplicated(const CheckpointReader& reader,
                                           const std::vector<ReplicatedTensor>& tensors, CopyEngine& engine,
                                           PinnedPool& pool, Communicator& comm);

// Which rank reads each tensor (the same on every rank): each in turn goes
// to the rank with the fewest bytes so far, the lowest on ties.
std::vector<int> AssignReaders(const std::vector<uint64_t>& bytes, int ranks);

}  // namespace ckptfs::gpu
