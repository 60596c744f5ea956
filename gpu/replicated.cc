#include "replicated.h"

#include <algorithm>

#include "core/chunk_id.h"

namespace ckptfs::gpu {

std::vector<int> AssignReaders(const std::vector<uint64_t>& bytes, int ranks) {
  std::vector<uint64_t> load(std::max(ranks, 1), 0);
  std::vector<int> owner;
  owner.reserve(bytes.size());
  for (uint64_t b : bytes) {
    const int r = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    load[r] += b;
    owner.push_back(r);
  }
  return owner;
}

namespace {

// What every rank must agree on: names, dtypes, shapes and regions, in order.
uint64_t Fingerprint(const std::vector<ReplicatedTensor>& tensors) {
  std::string s;
  for (const auto& t : tensors) {
    if (!t.tensor) {
      s += "<null>;";
      continue;
    }
    s += t.tensor->name + '\0' + std::string(DTypeName(t.tensor->dtype)) + ShapeToString(t.tensor->shape) +
         t.region.ToString() + ';';
  }
  return Checksum64(std::as_bytes(std::span(s)));
}

Status CheckLocal(const std::vector<ReplicatedTensor>& tensors) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    if (!t.tensor) return Status::InvalidArgument("replicated tensor #" + std::to_string(i) + " is null");
    CKPT_RETURN_IF_ERROR(ValidateRegion(t.tensor->shape, t.region).WithContext("tensor '" + t.tensor->name + "'"));
    if (!t.device && Normalize(t.tensor->shape, t.region).NumElements() > 0) {
      return Status::InvalidArgument("tensor '" + t.tensor->name + "' has no device buffer");
    }
  }
  return Status::OK();
}

}  // namespace

Result<ReplicatedLoadStats> LoadReplicated(const CheckpointReader& reader,
                                           const std::vector<ReplicatedTensor>& tensors, CopyEngine& engine,
                                           PinnedPool& pool, Communicator& comm) {
  // First collective: the lists are sound everywhere and the same everywhere.
  // Comparing minima of the fingerprint and of its complement tells every
  // rank, the lowest and the highest alike, whether any rank differs.
  const Status local = CheckLocal(tensors);
  const uint64_t fp = Fingerprint(tensors);
  uint64_t agree[3] = {local.ok() ? 1u : 0u, fp, ~fp};
  CKPT_RETURN_IF_ERROR(comm.AllReduceMin(agree).WithContext("agreeing on replicated tensors"));
  if (!local.ok()) return local;
  if (agree[0] == 0) return Status::InvalidArgument("another rank's replicated tensors are invalid");
  if (agree[1] != fp || agree[2] != ~fp) {
    return Status::InvalidArgument("ranks disagree on the replicated tensors to load (names, shapes or regions differ)");
  }

  std::vector<uint64_t> bytes;
  for (const auto& t : tensors) {
    bytes.push_back(Normalize(t.tensor->shape, t.region).NumElements() * DTypeSize(t.tensor->dtype));
  }
  const std::vector<int> owner = AssignReaders(bytes, comm.size());
  ReplicatedLoadStats stats;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    if (bytes[i] == 0) continue;
    Status st;
    if (owner[i] == comm.rank()) {
      st = LoadToDevice(reader, *t.tensor, t.region, t.device, engine, pool);
      ++stats.tensors_read;
      stats.bytes_read += bytes[i];
    }
    // The reader's outcome, everywhere, before anyone waits on a broadcast.
    uint64_t ok[1] = {st.ok() ? 1u : 0u};
    CKPT_RETURN_IF_ERROR(comm.AllReduceMin(ok).WithContext("loading '" + t.tensor->name + "'"));
    if (!st.ok()) return st;
    if (ok[0] == 0) {
      return Status::IOError("'" + t.tensor->name + "' was not loaded: rank " + std::to_string(owner[i]) +
                             ", which reads it from the store, failed");
    }
    CKPT_RETURN_IF_ERROR(
        comm.Broadcast(t.device, bytes[i], owner[i]).WithContext("broadcasting '" + t.tensor->name + "'"));
    if (owner[i] != comm.rank()) stats.bytes_received += bytes[i];
  }
  return stats;
}

}  // namespace ckptfs::gpu
