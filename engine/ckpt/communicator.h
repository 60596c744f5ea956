// One rank's end of a group of processes (or threads) that save or load a
// checkpoint together. Its calls are collective: every rank makes the same
// calls in the same order, with the same sizes and roots; Send and Recv
// pair up in the order both sides make them.
//
// The engine links no transport. Implementations: the host group below
// (threads of one process, for tests and single-process tools), NCCL for
// C++ jobs on GPUs (gpu/replicated.h), and, for the Python package, one
// over torch.distributed (the binding's, whose calls go to
// ckptfs/collective.py on the rank's own thread).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace ckptfs {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string Describe() const = 0;
  // `bytes` at `data` (this rank's buffer): root's bytes on every rank when
  // it returns. Host memory, unless the implementation says otherwise (NCCL:
  // device memory).
  virtual Status Broadcast(std::byte* data, size_t bytes, int root) = 0;
  // Element-wise minimum over the ranks of small host values (at most
  // kMaxReduceValues), in place.
  static constexpr size_t kMaxReduceValues = 16;
  virtual Status AllReduceMin(std::span<uint64_t> values) = 0;
  // Every rank's `mine`, in rank order: small host messages (plans,
  // statuses), of any length each.
  virtual Result<std::vector<std::string>> AllGather(std::string_view mine) = 0;
  // Every rank's `mine` at `root`, in rank order; the other ranks get an
  // empty list. Small host messages.
  virtual Result<std::vector<std::string>> Gather(std::string_view mine, int root) = 0;
  // `root`'s message (`mine` there; ignored elsewhere) on every rank: a
  // host message of any size (a store listing). The default all-gathers;
  // a transport with a broadcast of raw bytes overrides it.
  virtual Result<std::string> BroadcastMessage(std::string mine, int root);
  // parts[r], given at `root` (one per rank; ignored elsewhere), on rank r.
  // A root given the wrong number of parts sends every rank an empty
  // message and returns InvalidArgument. Small host messages.
  virtual Result<std::string> Scatter(const std::vector<std::string>& parts, int root) = 0;
  // Point to point, in the memory Broadcast uses: `data` goes to `peer`,
  // whose matching Recv (same size) receives it. A Send may return before
  // the peer receives.
  virtual Status Send(std::span<const std::byte> data, int peer) = 0;
  virtual Status Recv(std::span<std::byte> data, int peer) = 0;

  // One round of point-to-point transfers in the memory Send uses: `data`
  // goes to `peer` (send) or comes from it. Each rank's list holds the
  // transfers of every pair in the order the peer's list holds them;
  // `tag` tells apart the transfers of one pair (a transport may match
  // on it). Returns when all are done. The default makes them in order
  // with Send and Recv; a transport that posts them together (torch's
  // batch_isend_irecv, NCCL's group calls) overrides it.
  struct Transfer {
    bool send = false;
    int peer = 0;
    std::span<std::byte> data;
    uint64_t tag = 0;
  };
  virtual Status Exchange(std::span<const Transfer> transfers);
};

// `size` communicators forming one group in this process, each to be used
// by its own thread; "device" memory is host memory.
std::vector<std::unique_ptr<Communicator>> NewHostGroup(int size);

}  // namespace ckptfs
