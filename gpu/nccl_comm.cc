// The NCCL communicator. Only this file includes NCCL; without NCCL (or
// without CUDA) in the build the same functions say so.
#include "replicated.h"

#ifdef CKPTFS_HAVE_NCCL
#include <cuda_runtime_api.h>
#include <nccl.h>

#include "cuda_util.h"

#include <algorithm>
#include <cstring>
#include <vector>
#endif

namespace ckptfs::gpu {

#ifdef CKPTFS_HAVE_NCCL
namespace {

Status NcclError(ncclResult_t r, const char* what, ncclComm_t comm = nullptr) {
  std::string msg = std::string(what) + ": " + ncclGetErrorString(r);
  if (comm) {
    const char* last = ncclGetLastError(comm);
    if (last && *last) msg += std::string(" (") + last + ")";
  }
  return Status::IOError(msg);
}

std::string NcclVersion() {
  int v = 0;
  ncclGetVersion(&v);
  // NCCL >= 2.9 encodes major * 10000 + minor * 100 + patch.
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(int device, int size, int rank) : device_(device), size_(size), rank_(rank) {}
  ~NcclCommunicator() override {
    DeviceGuard guard(device_);
    if (stream_) cudaStreamSynchronize(stream_);
    if (comm_) ncclCommDestroy(comm_);
    if (scratch_) cudaFree(scratch_);
    if (gather_) cudaFree(gather_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  Status Init(const NcclId& id) {
    DeviceGuard guard(device_);
    cudaError_t e = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
    if (e != cudaSuccess) return CudaError(e, "cudaStreamCreateWithFlags");
    e = cudaMalloc(reinterpret_cast<void**>(&scratch_), kMaxReduceValues * sizeof(uint64_t));
    if (e != cudaSuccess) return CudaError(e, "cudaMalloc");
    ncclUniqueId uid;
    static_assert(sizeof(uid.internal) == sizeof(id.bytes));
    std::memcpy(uid.internal, id.bytes.data(), sizeof(uid.internal));
    ncclResult_t r = ncclCommInitRank(&comm_, size_, uid, rank_);
    if (r != ncclSuccess) {
      comm_ = nullptr;
      return NcclError(r, "ncclCommInitRank");
    }
    return Status::OK();
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string Describe() const override {
    return "NCCL " + NcclVersion() + " rank " + std::to_string(rank_) + " of " + std::to_string(size_) +
           " on CUDA device " + std::to_string(device_);
  }

  Status Broadcast(std::byte* device, size_t bytes, int root) override {
    if (root < 0 || root >= size_) return Status::InvalidArgument("broadcast root out of range");
    DeviceGuard guard(device_);
    ncclResult_t r = ncclBroadcast(device, device, bytes, ncclUint8, root, comm_, stream_);
    if (r != ncclSuccess) return NcclError(r, "ncclBroadcast", comm_);
    return Sync("ncclBroadcast");
  }

  Status AllReduceMin(std::span<uint64_t> values) override {
    if (values.size() > kMaxReduceValues) return Status::InvalidArgument("too many values to reduce");
    if (values.empty()) return Status::OK();
    DeviceGuard guard(device_);
    const size_t n = values.size() * sizeof(uint64_t);
    cudaError_t e = cudaMemcpyAsync(scratch_, values.data(), n, cudaMemcpyHostToDevice, stream_);
    if (e != cudaSuccess) return CudaError(e, "cudaMemcpyAsync");
    ncclResult_t r = ncclAllReduce(scratch_, scratch_, values.size(), ncclUint64, ncclMin, comm_, stream_);
    if (r != ncclSuccess) return NcclError(r, "ncclAllReduce", comm_);
    e = cudaMemcpyAsync(values.data(), scratch_, n, cudaMemcpyDeviceToHost, stream_);
    if (e != cudaSuccess) return CudaError(e, "cudaMemcpyAsync");
    return Sync("ncclAllReduce");
  }

  // Host messages through device memory: the lengths first (one u64 a
  // rank), then every rank's bytes padded to the longest.
  Result<std::vector<std::string>> AllGather(std::string_view mine) override {
    DeviceGuard guard(device_);
    const size_t n = static_cast<size_t>(size_);
    CKPT_ASSIGN_OR_RETURN(std::vector<uint64_t> lens, GatherLengths(mine.size()));
    const uint64_t longest = *std::max_element(lens.begin(), lens.end());
    std::vector<std::string> out(n);
    if (longest == 0) return out;
    CKPT_RETURN_IF_ERROR(Reserve(n * longest));
    cudaError_t e =
        cudaMemcpyAsync(gather_ + rank_ * longest, mine.data(), mine.size(), cudaMemcpyHostToDevice, stream_);
    if (e != cudaSuccess) return CudaError(e, "cudaMemcpyAsync");
    ncclResult_t r = ncclAllGather(gather_ + rank_ * longest, gather_, longest, ncclUint8, comm_, stream_);
    if (r != ncclSuccess) return NcclError(r, "ncclAllGather", comm_);
    std::vector<char> all(n * longest);
    e = cudaMemcpyAsync(all.data(), gather_, all.size(), cudaMemcpyDeviceToHost, stream_);
    if (e != cudaSuccess) return CudaError(e, "cudaMemcpyAsync");
    CKPT_RETURN_IF_ERROR(Sync("ncclAllGather"));
    for (size_t i = 0; i < n; ++i) out[i].assign(all.data() + i * longest, lens[i]);
    return out;
  }

  // The lengths go to every rank (one u64 a rank); the bytes only to the
  // root, each rank's sent on its own.
  Result<std::vector<std::string>> Gather(std::string_view mine, int root) override {
    if (root < 0 || root >= size_) return Status::InvalidArgument("gather root out of range");
    DeviceGuard guard(device_);
    CKPT_ASSIGN_OR_RETURN(std::vector<uint64_t> lens, GatherLengths(mine.size()));
    std::vector<std::string> out;
    if (rank_ != root) {
      if (!mine.empty()) {
        CKPT_RETURN_IF_ERROR(Reserve(mine.size()));
        cudaError_t e = cudaMemcpyAsync(gather_, mine.data(), mine.size(), cudaMemcpyHostToDevice, stream_);
        if (e != cudaSuccess) return CudaError(e, "cudaMemcpyAsync");
        ncclResult_t r = ncclSend(gather_, mine.size(), ncclUint8, root, comm_, stream_);
        if (r != ncclSuccess) return NcclError(r, "ncclSend", comm_);
        CKPT_RETURN_IF_ERROR(Sync("a gather's send"));
      }
      return out;
    }
    std::vector<size_t> at(lens.size() + 1, 0);
    for (size_t i = 0; i < lens.size(); ++i) at[i + 1] = at[i] + (static_cast<int>(i) == rank_ ? 0 : lens[i]);
    CKPT_RETURN_IF_ERROR(Reserve(at.back()));
    ncclGroupStart();
    for (int i = 0; i < size_; ++i) {
      if (i == rank_ || lens[i] == 0) continue;
      ncclResult_t r = ncclRecv(gather_ + at[i], lens[i], ncclUint8, i, comm_, stream_);
      if (r != ncclSuccess) {
        ncclGroupEnd();
        return NcclError(r, "ncclRecv", comm_);
      }
    }
    ncclResult_t r = ncclGroupEnd();
    if (r != ncclSuccess) return NcclError(r, "ncclGroupEnd", comm_);
    std::vector<char> all(at.back());
    cudaError_t e = cudaMemcpyAsync(all.data(), gather_, all.size(), cudaMemcpyDeviceToHost, stream_);
    if (e != cudaSuccess) return CudaError(e, "cudaMemcpyAsync");
    CKPT_RETURN_IF_ERROR(Sync("a gather's receives"));
    out.resize(lens.size());
    for (size_t i = 0; i < lens.size(); ++i) {
      if (static_cast<int>(i) == rank_) out[i] = std::string(mine);
      else out[i].assign(all.data() + at[i], lens[i]);
    }
    return out;
  }

  // The root broadcasts the lengths, then sends each rank its part.
  Result<std::string> Scatter(const std::vector<std::string>& parts, int root) override {
    if (root < 0 || root >= size_) return Status::InvalidArgument("scatter root out of range");
    DeviceGuard guard(device_);
    const size_t n = static_cast<size_t>(size_);
    const bool fits = parts.size() == n;
    std::vector<uint64_t> lens(n, 0);
    if (rank_ == root && fits) {
      for (size_t i = 0; i < n; ++i) lens[i] = static_cast<int>(i) == root ? 0 : parts[i].size();
    }
    CKPT_RETURN_IF_ERROR(Reserve(n * sizeof(uint64_t)));
    cudaError_t e = cudaMemcpyAsync(gather_, lens.data(), n * sizeof(uint64_t), cudaMemcpyHostToDevice, stream_);
    if (e != cudaSuccess) return CudaError(e, "cudaMemcpyAsync");
    ncclResult_t r = ncclBroadcast(gather_, gather_, n * sizeof(uint64_t), ncclUint8, root, comm_, stream_);
    if (r != ncclSuccess) return NcclError(r, "ncclBroadcast", comm_);
    e = cudaMemcpyAsync(lens.data(), gather_, n * sizeof(uint64_t), cudaMemcpyDeviceToHost, stream_);
    if (e != cudaSuccess) return CudaError(e, "cudaMemcpyAsync");
    CKPT_RETURN_IF_ERROR(Sync("a scatter's lengths"));
    if (rank_ != root) {
      std::string out(lens[rank_], '\0');
      if (out.empty()) return out;
      CKPT_RETURN_IF_ERROR(Reserve(out.size()));
      r = ncclRecv(gather_, out.size(), ncclUint8, root, comm_, stream_);
      if (r != ncclSuccess) return NcclError(r, "ncclRecv", comm_);
      e = cudaMemcpyAsync(out.data(), gather_, out.size(), cudaMemcpyDeviceToHost, stream_);
      if (e != cudaSuccess) return CudaError(e, "cudaMemcpyAsync");
      CKPT_RETURN_IF_ERROR(Sync("a scatter's receive"));
      return out;
    }
    std::vector<size_t> at(n + 1, 0);
    for (size_t i = 0; i < n; ++i) at[i + 1] = at[i] + lens[i];
    CKPT_RETURN_IF_ERROR(Reserve(std::max<size_t>(at.back(), 1)));
    for (size_t i = 0; i < n; ++i) {
      if (lens[i] == 0) continue;
      e = cudaMemcpyAsync(gather_ + at[i], parts[i].data(), lens[i], cudaMemcpyHostToDevice, stream_);
      if (e != cudaSuccess) return CudaError(e, "cudaMemcpyAsync");
    }
    ncclGroupStart();
    for (int i = 0; i < size_; ++i) {
      if (lens[i] == 0) continue;
      r = ncclSend(gather_ + at[i], lens[i], ncclUint8, i, comm_, stream_);
      if (r != ncclSuccess) {
        ncclGroupEnd();
        return NcclError(r, "ncclSend", comm_);
      }
    }
    r = ncclGroupEnd();
    if (r != ncclSuccess) return NcclError(r, "ncclGroupEnd", comm_);
    CKPT_RETURN_IF_ERROR(Sync("a scatter's sends"));
    if (!fits) {
      return Status::InvalidArgument("scatter given " + std::to_string(parts.size()) + " parts for " +
                                     std::to_string(size_) + " ranks");
    }
    return parts[root];
  }

  Status Send(std::span<const std::byte> data, int peer) override {
    if (peer < 0 || peer >= size_ || peer == rank_) return Status::InvalidArgument("send to a bad peer");
    DeviceGuard guard(device_);
    ncclResult_t r = ncclSend(data.data(), data.size(), ncclUint8, peer, comm_, stream_);
    if (r != ncclSuccess) return NcclError(r, "ncclSend", comm_);
    return Sync("ncclSend");
  }

  Status Recv(std::span<std::byte> data, int peer) override {
    if (peer < 0 || peer >= size_ || peer == rank_) return Status::InvalidArgument("receive from a bad peer");
    DeviceGuard guard(device_);
    ncclResult_t r = ncclRecv(data.data(), data.size(), ncclUint8, peer, comm_, stream_);
    if (r != ncclSuccess) return NcclError(r, "ncclRecv", comm_);
    return Sync("ncclRecv");
  }

 private:
  // The gather buffer holds at least `bytes`.
  Status Reserve(size_t bytes) {
    if (bytes <= gather_bytes_) return Status::OK();
    if (gather_) cudaFree(gather_);
    gather_ = nullptr;
    gather_bytes_ = 0;
    cudaError_t e = cudaMalloc(reinterpret_cast<void**>(&gather_), bytes);
    if (e != cudaSuccess) return CudaError(e, "cudaMalloc");
    gather_bytes_ = bytes;
    return Status::OK();
  }

  // Every rank's `len`, through the gather buffer.
  Result<std::vector<uint64_t>> GatherLengths(uint64_t len) {
    const size_t n = static_cast<size_t>(size_);
    CKPT_RETURN_IF_ERROR(Reserve(n * sizeof(uint64_t)));
    cudaError_t e = cudaMemcpyAsync(gather_ + rank_ * sizeof(uint64_t), &len, sizeof(len), cudaMemcpyHostToDevice,
                                    stream_);
    if (e != cudaSuccess) return CudaError(e, "cudaMemcpyAsync");
    ncclResult_t r = ncclAllGather(gather_ + rank_ * sizeof(uint64_t), gather_, sizeof(uint64_t), ncclUint8, comm_,
                                   stream_);
    if (r != ncclSuccess) return NcclError(r, "ncclAllGather", comm_);
    std::vector<uint64_t> lens(n);
    e = cudaMemcpyAsync(lens.data(), gather_, n * sizeof(uint64_t), cudaMemcpyDeviceToHost, stream_);
    if (e != cudaSuccess) return CudaError(e, "cudaMemcpyAsync");
    CKPT_RETURN_IF_ERROR(Sync("ncclAllGather"));
    return lens;
  }

  // Waits for the stream; a peer's failure shows up as NCCL's asynchronous error.
  Status Sync(const char* what) {
    cudaError_t e = cudaStreamSynchronize(stream_);
    if (e != cudaSuccess) return CudaError(e, what);
    ncclResult_t async = ncclSuccess;
    ncclCommGetAsyncError(comm_, &async);
    if (async != ncclSuccess) return NcclError(async, what, comm_);
    return Status::OK();
  }

  const int device_, size_, rank_;
  cudaStream_t stream_ = nullptr;
  uint64_t* scratch_ = nullptr;
  char* gather_ = nullptr;
  size_t gather_bytes_ = 0;
  ncclComm_t comm_ = nullptr;
};

}  // namespace

bool NcclAvailable(std::string* why) {
  std::string cuda_why;
  if (!CudaAvailable(&cuda_why)) {
    if (why) *why = "NCCL " + NcclVersion() + " is built in, but " + cuda_why;
    return false;
  }
  if (why) *why = "NCCL " + NcclVersion();
  return true;
}

Result<NcclId> NewNcclId() {
  std::string why;
  if (!NcclAvailable(&why)) return Status::Unsupported(why);
  ncclUniqueId uid;
  ncclResult_t r = ncclGetUniqueId(&uid);
  if (r != ncclSuccess) return NcclError(r, "ncclGetUniqueId");
  NcclId id;
  std::memcpy(id.bytes.data(), uid.internal, sizeof(uid.internal));
  return id;
}

Result<std::unique_ptr<Communicator>> NewNcclCommunicator(int device, int size, int rank, const NcclId& id) {
  std::string why;
  if (!NcclAvailable(&why)) return Status::Unsupported(why);
  if (size < 1 || rank < 0 || rank >= size) {
    return Status::InvalidArgument("NCCL rank " + std::to_string(rank) + " of " + std::to_string(size));
  }
  auto comm = std::make_unique<NcclCommunicator>(device, size, rank);
  CKPT_RETURN_IF_ERROR(comm->Init(id));
  return std::unique_ptr<Communicator>(std::move(comm));
}

#else

namespace {
const char* kNoNccl =
    "this build has no NCCL (it is looked for beside the CUDA installation at build time); replicated tensors "
    "cannot be broadcast, each rank reads them from the store";
}  // namespace

bool NcclAvailable(std::string* why) {
  if (why) *why = kNoNccl;
  return false;
}

Result<NcclId> NewNcclId() { return Status::Unsupported(kNoNccl); }

Result<std::unique_ptr<Communicator>> NewNcclCommunicator(int, int, int, const NcclId&) {
  return Status::Unsupported(kNoNccl);
}

#endif

}  // namespace ckptfs::gpu
