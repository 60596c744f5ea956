// The CUDA copy engine. CUDA headers are included only here, in
// nccl_comm.cc and in cuda_util.h; without CUDA in the build the same
// functions say so.
#include <cstdlib>

#include "staging.h"

#ifdef CKPTFS_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "cuda_util.h"

#include <algorithm>
#include <deque>
#include <memory>
#include <mutex>
#endif

namespace ckptfs::gpu {

#ifdef CKPTFS_HAVE_CUDA
namespace {

// An event destroyed when the last holder lets go: a thread may still be
// synchronizing on it while another retires it.
struct Event {
  ~Event() {
    if (ev) cudaEventDestroy(ev);
  }
  cudaEvent_t ev = nullptr;
};

class CudaCopyEngine final : public CopyEngine {
 public:
  explicit CudaCopyEngine(int device) : device_(device) {}
  ~CudaCopyEngine() override {
    if (stream_) {
      DeviceGuard guard(device_);
      cudaStreamSynchronize(stream_);
      events_.clear();
      cudaStreamDestroy(stream_);
    }
  }
  Status Init() {
    DeviceGuard guard(device_);
    cudaError_t e = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
    if (e != cudaSuccess) return CudaError(e, "cudaStreamCreateWithFlags");
    return Status::OK();
  }
  std::string Describe() const override {
    cudaDeviceProp prop{};
    cudaGetDeviceProperties(&prop, device_);
    return std::string("CUDA device ") + std::to_string(device_) + " (" + prop.name + ")";
  }
  Result<std::byte*> AllocatePinned(size_t bytes) override {
    DeviceGuard guard(device_);
    void* p = nullptr;
    cudaError_t e = cudaHostAlloc(&p, bytes, cudaHostAllocPortable);
    if (e != cudaSuccess) return CudaError(e, "cudaHostAlloc");
    return static_cast<std::byte*>(p);
  }
  void FreePinned(std::byte* p) override { cudaFreeHost(p); }
  Result<uint64_t> DeviceToHost(std::byte* host, const std::byte* device, size_t n) override {
    return Submit(host, device, n, cudaMemcpyDeviceToHost);
  }
  Result<uint64_t> HostToDevice(std::byte* device, const std::byte* host, size_t n) override {
    return Submit(device, host, n, cudaMemcpyHostToDevice);
  }
  Result<uint64_t> DeviceToDevice(std::byte* dst, const std::byte* src, size_t n) override {
    return Submit(dst, src, n, cudaMemcpyDeviceToDevice);
  }
  Result<std::byte*> AllocateDevice(size_t bytes) override {
    DeviceGuard guard(device_);
    void* p = nullptr;
    cudaError_t e = cudaMalloc(&p, std::max<size_t>(bytes, 1));
    if (e != cudaSuccess) return CudaError(e, "cudaMalloc");
    return static_cast<std::byte*>(p);
  }
  void FreeDevice(std::byte* p) override {
    DeviceGuard guard(device_);
    cudaFree(p);
  }
  Status Wait(uint64_t ticket) override {
    std::shared_ptr<Event> ev;
    {
      std::lock_guard lock(mu_);
      // Tickets before the first retained one are done already (the stream
      // runs in order); otherwise wait for this ticket's own event.
      for (const auto& [t, e] : events_) {
        if (t == ticket) ev = e;
        if (t >= ticket) break;
      }
    }
    if (!ev) return Status::OK();
    cudaError_t e = cudaEventSynchronize(ev->ev);
    if (e != cudaSuccess) return CudaError(e, "cudaEventSynchronize");
    std::lock_guard lock(mu_);
    while (!events_.empty() && events_.front().first <= ticket) events_.pop_front();
    return Status::OK();
  }

 private:
  Result<uint64_t> Submit(std::byte* dst, const std::byte* src, size_t n, cudaMemcpyKind kind) {
    std::lock_guard lock(mu_);
    DeviceGuard guard(device_);
    cudaError_t e = cudaMemcpyAsync(dst, src, n, kind, stream_);
    if (e != cudaSuccess) return CudaError(e, "cudaMemcpyAsync");
    auto ev = std::make_shared<Event>();
    e = cudaEventCreateWithFlags(&ev->ev, cudaEventDisableTiming);
    if (e != cudaSuccess) return CudaError(e, "cudaEventCreate");
    e = cudaEventRecord(ev->ev, stream_);
    if (e != cudaSuccess) return CudaError(e, "cudaEventRecord");
    uint64_t t = next_ticket_++;
    events_.emplace_back(t, std::move(ev));
    return t;
  }

  int device_;
  cudaStream_t stream_ = nullptr;
  std::mutex mu_;
  uint64_t next_ticket_ = 1;
  std::deque<std::pair<uint64_t, std::shared_ptr<Event>>> events_;
};

}  // namespace

bool CudaAvailable(std::string* why) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    if (why) *why = std::string("no usable GPU: ") + cudaGetErrorString(e);
    return false;
  }
  if (n == 0) {
    if (why) *why = "no GPU found";
    return false;
  }
  return true;
}

Result<std::unique_ptr<CopyEngine>> NewCudaCopyEngine(int device) {
  std::string why;
  if (!CudaAvailable(&why)) return Status::Unsupported(why);
  auto engine = std::make_unique<CudaCopyEngine>(device);
  CKPT_RETURN_IF_ERROR(engine->Init());
  return std::unique_ptr<CopyEngine>(std::move(engine));
}

#else

bool CudaAvailable(std::string* why) {
  if (why) *why = "this build has no CUDA support (the toolkit was not found at build time)";
  return false;
}

Result<std::unique_ptr<CopyEngine>> NewCudaCopyEngine(int) {
  return Status::Unsupported("this build has no CUDA support (the toolkit was not found at build time)");
}

#endif

}  // namespace ckptfs::gpu
