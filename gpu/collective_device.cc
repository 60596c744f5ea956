#include "collective_device.h"

#include <algorithm>
#include <deque>

#include "core/chunk_id.h"

namespace ckptfs::gpu {

DeviceCollectiveMemory::~DeviceCollectiveMemory() {
  if (staging_) engine_.FreeDevice(staging_);
}

std::unique_ptr<ShardSource> DeviceCollectiveMemory::Source(std::span<const std::byte> data) {
  return std::make_unique<DeviceSource>(engine_, pool_, data.data(), data.size());
}

Result<ChunkId> DeviceCollectiveMemory::Digest(std::span<const std::byte> data) {
  // Pieces copied off the device into every free pinned buffer ahead of
  // the hashing, in order.
  struct Piece {
    PinnedPool::Lease lease;
    uint64_t ticket;
    size_t bytes;
  };
  std::deque<Piece> inflight;
  ChunkHasher hasher;
  const size_t step = pool_.buffer_bytes();
  size_t submitted = 0;
  Status st;
  while (st.ok() && (submitted < data.size() || !inflight.empty())) {
    while (submitted < data.size() && inflight.size() < pool_.count()) {
      PinnedPool::Lease lease = inflight.empty() ? pool_.Acquire() : pool_.TryAcquire();
      if (!lease.valid()) break;
      const size_t n = std::min(step, data.size() - submitted);
      auto t = engine_.DeviceToHost(lease.buffer().data(), data.data() + submitted, n);
      if (!t.ok()) {
        st = t.status();
        break;
      }
      inflight.push_back({std::move(lease), *t, n});
      submitted += n;
    }
    if (!st.ok() || inflight.empty()) break;
    st = engine_.Wait(inflight.front().ticket);
    if (st.ok()) hasher.Update(inflight.front().lease.buffer().first(inflight.front().bytes));
    inflight.pop_front();
  }
  // No copy may still be writing into a buffer returned to the pool (its
  // error is the one already in `st`).
  if (!inflight.empty()) (void)engine_.Wait(inflight.back().ticket);
  if (!st.ok()) return st;
  return hasher.Finish();
}

Status DeviceCollectiveMemory::Read(const CheckpointReader& reader, const TensorRecord& tensor, const Region& region,
                                    std::span<std::byte> target) {
  return LoadToDevice(reader, tensor, region, target.data(), engine_, pool_);
}

Status DeviceCollectiveMemory::Copy(std::span<std::byte> dst, std::span<const std::byte> src) {
  if (src.empty()) return Status::OK();
  CKPT_ASSIGN_OR_RETURN(uint64_t ticket, engine_.DeviceToDevice(dst.data(), src.data(), src.size()));
  return engine_.Wait(ticket);
}

Status DeviceCollectiveMemory::PrepareHandoffs(size_t largest) {
  if (largest <= staging_bytes_) return Status::OK();
  if (staging_) engine_.FreeDevice(staging_);
  staging_ = nullptr;
  staging_bytes_ = 0;
  CKPT_ASSIGN_OR_RETURN(staging_, engine_.AllocateDevice(largest));
  staging_bytes_ = largest;
  return Status::OK();
}

Status DeviceCollectiveMemory::Stage(std::span<const std::byte> host) {
  const size_t step = pool_.buffer_bytes();
  for (size_t off = 0; off < host.size(); off += step) {
    const size_t n = std::min(step, host.size() - off);
    PinnedPool::Lease lease = pool_.Acquire();
    std::copy_n(host.data() + off, n, lease.buffer().data());
    CKPT_ASSIGN_OR_RETURN(uint64_t ticket, engine_.HostToDevice(staging_ + off, lease.buffer().data(), n));
    CKPT_RETURN_IF_ERROR(engine_.Wait(ticket));
  }
  return Status::OK();
}

Status DeviceCollectiveMemory::Unstage(std::span<std::byte> host) {
  const size_t step = pool_.buffer_bytes();
  for (size_t off = 0; off < host.size(); off += step) {
    const size_t n = std::min(step, host.size() - off);
    PinnedPool::Lease lease = pool_.Acquire();
    CKPT_ASSIGN_OR_RETURN(uint64_t ticket, engine_.DeviceToHost(lease.buffer().data(), staging_ + off, n));
    CKPT_RETURN_IF_ERROR(engine_.Wait(ticket));
    std::copy_n(lease.buffer().data(), n, host.data() + off);
  }
  return Status::OK();
}

Status DeviceCollectiveMemory::SendHost(Communicator& comm, std::span<const std::byte> host, int peer) {
  if (host.size() > staging_bytes_) return Status::Internal("a hand-off larger than the one prepared for");
  const Status staged = Stage(host);  // on failure the buffer's bytes go anyway: the peer's check refuses them
  CKPT_RETURN_IF_ERROR(comm.Send(std::span<const std::byte>(staging_, host.size()), peer));
  return staged.WithContext("staging a hand-off on the device");
}

Status DeviceCollectiveMemory::RecvHost(Communicator& comm, std::span<std::byte> host, int peer) {
  if (host.size() > staging_bytes_) return Status::Internal("a hand-off larger than the one prepared for");
  CKPT_RETURN_IF_ERROR(comm.Recv(std::span<std::byte>(staging_, host.size()), peer));
  return Unstage(host).WithContext("copying a hand-off off the device");
}

Result<CollectiveSaveResult> SaveCollectiveFromDevice(Repository& repo, const std::string& name,
                                                      std::span<const CollectiveShard> shards,
                                                      std::span<const CollectiveBlob> blobs, Communicator& comm,
                                                      CopyEngine& engine, PinnedPool& pool, WriterOptions options,
                                                      bool verify_replicas) {
  DeviceCollectiveMemory memory(engine, pool);
  return SaveCollective(repo, name, shards, blobs, comm, memory, std::move(options), verify_replicas);
}

Result<CollectiveLoadResult> LoadCollectiveToDevice(Repository& repo, const std::string& name,
                                                    std::span<const CollectiveTarget> targets, Communicator& comm,
                                                    CopyEngine& engine, PinnedPool& pool) {
  DeviceCollectiveMemory memory(engine, pool);
  return LoadCollective(repo, name, targets, comm, memory);
}

}  // namespace ckptfs::gpu
