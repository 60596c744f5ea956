#include "ckpt/communicator.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <utility>

namespace ckptfs {

Status Communicator::Exchange(std::span<const Transfer> transfers) {
  for (const Transfer& t : transfers) {
    CKPT_RETURN_IF_ERROR(t.send ? Send(t.data, t.peer) : Recv(t.data, t.peer));
  }
  return Status::OK();
}

Result<std::string> Communicator::BroadcastMessage(std::string mine, int root) {
  if (root < 0 || root >= size()) return Status::InvalidArgument("broadcast root out of range");
  CKPT_ASSIGN_OR_RETURN(std::vector<std::string> all, AllGather(rank() == root ? mine : std::string()));
  if (all.size() != static_cast<size_t>(size())) return Status::Internal("an all-gather returned another group's size");
  return std::move(all[static_cast<size_t>(root)]);
}

namespace {

struct HostGroupState {
  explicit HostGroupState(int n) : size(n), gathered(static_cast<size_t>(n)) {}
  const int size;
  std::mutex mu;
  std::condition_variable cv;
  uint64_t generation = 0;
  int arrived = 0;
  const std::byte* root_buffer = nullptr;
  std::vector<uint64_t> reduced;
  std::vector<std::string> gathered;
  // Messages in flight, per (from, to), in the order sent.
  std::map<std::pair<int, int>, std::deque<std::vector<std::byte>>> mail;

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

  Status Broadcast(std::byte* data, size_t bytes, int root) override {
    if (root < 0 || root >= group_->size) return Status::InvalidArgument("broadcast root out of range");
    std::unique_lock lock(group_->mu);
    if (rank_ == root) group_->root_buffer = data;
    group_->Barrier(lock);
    if (rank_ != root && bytes > 0) {
      // Copies run in parallel, outside the lock; the root's buffer stays
      // untouched until the second barrier.
      const std::byte* src = group_->root_buffer;
      lock.unlock();
      std::memcpy(data, src, bytes);
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

  Result<std::vector<std::string>> AllGather(std::string_view mine) override {
    std::unique_lock lock(group_->mu);
    group_->gathered[static_cast<size_t>(rank_)] = std::string(mine);
    group_->Barrier(lock);
    std::vector<std::string> out = group_->gathered;
    group_->Barrier(lock);  // every rank has its copy before the next gather writes
    return out;
  }

  Result<std::vector<std::string>> Gather(std::string_view mine, int root) override {
    if (root < 0 || root >= group_->size) return Status::InvalidArgument("gather root out of range");
    std::unique_lock lock(group_->mu);
    group_->gathered[static_cast<size_t>(rank_)] = std::string(mine);
    group_->Barrier(lock);
    std::vector<std::string> out;
    if (rank_ == root) out = group_->gathered;
    group_->Barrier(lock);
    return out;
  }

  Result<std::string> Scatter(const std::vector<std::string>& parts, int root) override {
    if (root < 0 || root >= group_->size) return Status::InvalidArgument("scatter root out of range");
    const bool fits = parts.size() == static_cast<size_t>(group_->size);
    std::unique_lock lock(group_->mu);
    if (rank_ == root) {
      for (size_t r = 0; r < group_->gathered.size(); ++r) group_->gathered[r] = fits ? parts[r] : std::string();
    }
    group_->Barrier(lock);
    std::string out = std::move(group_->gathered[static_cast<size_t>(rank_)]);
    group_->Barrier(lock);
    if (rank_ == root && !fits) return Status::InvalidArgument("scatter given " + std::to_string(parts.size()) +
                                                               " parts for " + std::to_string(group_->size) + " ranks");
    return out;
  }

  Status Send(std::span<const std::byte> data, int peer) override {
    if (peer < 0 || peer >= group_->size || peer == rank_) return Status::InvalidArgument("send to a bad peer");
    std::vector<std::byte> copy(data.begin(), data.end());
    std::lock_guard lock(group_->mu);
    group_->mail[{rank_, peer}].push_back(std::move(copy));
    group_->cv.notify_all();
    return Status::OK();
  }

  Status Recv(std::span<std::byte> data, int peer) override {
    if (peer < 0 || peer >= group_->size || peer == rank_) return Status::InvalidArgument("receive from a bad peer");
    std::unique_lock lock(group_->mu);
    auto& box = group_->mail[{peer, rank_}];
    group_->cv.wait(lock, [&] { return !box.empty(); });
    std::vector<std::byte> got = std::move(box.front());
    box.pop_front();
    lock.unlock();
    if (got.size() != data.size()) {
      return Status::Internal("rank " + std::to_string(peer) + " sent " + std::to_string(got.size()) +
                              " bytes where " + std::to_string(data.size()) + " were expected");
    }
    std::memcpy(data.data(), got.data(), got.size());
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

}  // namespace ckptfs
