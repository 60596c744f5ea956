#include "replicated.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <mutex>

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

// ---- host group ------------------------------------------------------------------

namespace {

struct HostGroupState {
  explicit HostGroupState(int n) : size(n) {}
  const int size;
  std::mutex mu;
  std::condition_variable cv;
  uint64_t generation = 0;
  int arrived = 0;
  const std::byte* root_buffer = nullptr;
  std::vector<uint64_t> reduced;

  // Everyone waits until all ranks arrived; `lock` holds mu.
  void Barrier(std::unique_lock<std::mutex>& lock) {
    const uint64_t gen = generation;
    if (++arrived == size) {
      arrived = 0;
      ++generation;
      cv.notify_all();
    } else {
      cv.wait(lock, [&] { return generation != gen; });
    }
  }
};

class HostCommunicator final : public Communicator {
 public:
  HostCommunicator(std::shared_ptr<HostGroupState> group, int rank) : group_(std::move(group)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return group_->size; }
  std::string Describe() const override {
    return "host group rank " + std::to_string(rank_) + " of " + std::to_string(group_->size);
  }

  Status Broadcast(std::byte* device, size_t bytes, int root) override {
    if (root < 0 || root >= group_->size) return Status::InvalidArgument("broadcast root out of range");
    std::unique_lock lock(group_->mu);
    if (rank_ == root) group_->root_buffer = device;
    group_->Barrier(lock);
    if (rank_ != root && bytes > 0) {
      // Copies run in parallel, outside the lock; the root's buffer stays
      // untouched until the second barrier.
      const std::byte* src = group_->root_buffer;
      lock.unlock();
      std::memcpy(device, src, bytes);
      lock.lock();
    }
    group_->Barrier(lock);
    return Status::OK();
  }

  Status AllReduceMin(std::span<uint64_t> values) override {
    if (values.size() > kMaxReduceValues) return Status::InvalidArgument("too many values to reduce");
    std::unique_lock lock(group_->mu);
    auto& r = group_->reduced;
    if (group_->arrived == 0) {
      r.assign(values.begin(), values.end());
    } else {
      for (size_t i = 0; i < values.size() && i < r.size(); ++i) r[i] = std::min(r[i], values[i]);
    }
    group_->Barrier(lock);
    std::copy_n(r.begin(), std::min(r.size(), values.size()), values.begin());
    group_->Barrier(lock);  // nobody starts the next reduction before all have read this one
    return Status::OK();
  }

 private:
  std::shared_ptr<HostGroupState> group_;
  const int rank_;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> NewHostGroup(int size) {
  auto state = std::make_shared<HostGroupState>(size);
  std::vector<std::unique_ptr<Communicator>> out;
  for (int r = 0; r < size; ++r) out.push_back(std::make_unique<HostCommunicator>(state, r));
  return out;
}

}  // namespace ckptfs::gpu
