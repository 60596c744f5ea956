// Collective saves and restores of tensors in device memory: the engine's
// collective protocol (ckpt/collective.h) with each region staged through a
// pinned pool, as in a save or load of one rank (staging.h), and moved
// between ranks by a communicator that moves device memory (NCCL, or the
// host group with the host copy engine, whose "device" memory is host
// memory).
//
// A region several ranks hold is copied off the device, hashed, encoded and
// written by one of them; a region several ranks need is fetched, decoded
// and copied to the device by one of them, then sent device to device to
// the others. Chunks that regions of different readers share are handed
// over decoded through a device buffer the memory keeps (one chunk),
// allocated before the exchange.
#pragma once

#include <span>
#include <string>

#include "ckpt/collective.h"
#include "staging.h"

namespace ckptfs::gpu {

// CollectiveMemory over `engine`'s device. Each rank has its own, used by
// that rank's thread; the engine and pool must outlive it.
class DeviceCollectiveMemory final : public CollectiveMemory {
 public:
  DeviceCollectiveMemory(CopyEngine& engine, PinnedPool& pool) : engine_(engine), pool_(pool) {}
  ~DeviceCollectiveMemory() override;
  DeviceCollectiveMemory(const DeviceCollectiveMemory&) = delete;
  DeviceCollectiveMemory& operator=(const DeviceCollectiveMemory&) = delete;

  std::unique_ptr<ShardSource> Source(std::span<const std::byte> data) override;
  Result<ChunkId> Digest(std::span<const std::byte> data) override;
  Status Read(const CheckpointReader& reader, const TensorRecord& tensor, const Region& region,
              std::span<std::byte> target) override;
  Status Copy(std::span<std::byte> dst, std::span<const std::byte> src) override;
  Status PrepareHandoffs(size_t largest) override;
  Status SendHost(Communicator& comm, std::span<const std::byte> host, int peer) override;
  Status RecvHost(Communicator& comm, std::span<std::byte> host, int peer) override;

  // The device buffer the hand-offs go through (0 until one is needed).
  size_t staging_bytes() const { return staging_bytes_; }

 private:
  // Host to or from the hand-off buffer, through the pinned pool.
  Status Stage(std::span<const std::byte> host);
  Status Unstage(std::span<std::byte> host);

  CopyEngine& engine_;
  PinnedPool& pool_;
  std::byte* staging_ = nullptr;
  size_t staging_bytes_ = 0;
};

// SaveCollective with every shard's `data` in device memory (blobs stay in
// host memory). `comm` need only move host messages for the save.
Result<CollectiveSaveResult> SaveCollectiveFromDevice(Repository& repo, const std::string& name,
                                                      std::span<const CollectiveShard> shards,
                                                      std::span<const CollectiveBlob> blobs, Communicator& comm,
                                                      CopyEngine& engine, PinnedPool& pool,
                                                      WriterOptions options = {}, bool verify_replicas = false);

// LoadCollective with every target's `data` in device memory; `comm` moves
// device memory (Send, Recv).
Result<CollectiveLoadResult> LoadCollectiveToDevice(Repository& repo, const std::string& name,
                                                    std::span<const CollectiveTarget> targets, Communicator& comm,
                                                    CopyEngine& engine, PinnedPool& pool);

}  // namespace ckptfs::gpu
