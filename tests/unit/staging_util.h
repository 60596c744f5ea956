// Helpers shared by the GPU staging tests: "device" memory for the host
// copy engine (host memory) and for CUDA.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <list>
#include <vector>

#include "staging.h"

#ifdef CKPTFS_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace ckptfs::testing {

// Row-major bytes of `region` of a whole tensor image.
inline std::vector<std::byte> Extract(const std::vector<std::byte>& whole, const Shape& shape, DType dtype, const Region& r) {
  const uint64_t w = DTypeSize(dtype);
  std::vector<std::byte> out(r.NumElements() * w);
  if (r.kind == Region::Kind::kFlat) {
    std::memcpy(out.data(), whole.data() + r.flat.start * w, out.size());
  } else {
    ForEachRun(r.box, SpaceOfBox(FullBox(shape)), SpaceOfBox(r.box), [&](uint64_t s, uint64_t d, uint64_t n) {
      std::memcpy(out.data() + d * w, whole.data() + s * w, n * w);
    });
  }
  return out;
}

// "Device" memory: host memory for the host engine, cudaMalloc for CUDA
// (on the calling thread's current device).
class DeviceMemory {
 public:
  virtual ~DeviceMemory() = default;
  virtual std::byte* Alloc(size_t n) = 0;
  virtual void Upload(std::byte* dev, const std::vector<std::byte>& host) = 0;
  virtual std::vector<std::byte> Download(const std::byte* dev, size_t n) = 0;
};

class HostMemory : public DeviceMemory {
 public:
  std::byte* Alloc(size_t n) override {
    blocks_.emplace_back(std::max<size_t>(n, 1));
    return blocks_.back().data();
  }
  void Upload(std::byte* dev, const std::vector<std::byte>& host) override {
    if (!host.empty()) std::memcpy(dev, host.data(), host.size());
  }
  std::vector<std::byte> Download(const std::byte* dev, size_t n) override { return {dev, dev + n}; }

 private:
  std::list<std::vector<std::byte>> blocks_;
};

#ifdef CKPTFS_HAVE_CUDA
// `managed`: managed memory (cudaMallocManaged), which the CPU reaches too.
class CudaMemory : public DeviceMemory {
 public:
  explicit CudaMemory(bool managed = false) : managed_(managed) {}
  ~CudaMemory() override {
    for (void* p : blocks_) cudaFree(p);
  }
  std::byte* Alloc(size_t n) override {
    void* p = nullptr;
    const size_t bytes = std::max<size_t>(n, 1);
    EXPECT_EQ(managed_ ? cudaMallocManaged(&p, bytes) : cudaMalloc(&p, bytes), cudaSuccess);
    blocks_.push_back(p);
    return static_cast<std::byte*>(p);
  }
  void Upload(std::byte* dev, const std::vector<std::byte>& host) override {
    EXPECT_EQ(cudaMemcpy(dev, host.data(), host.size(), cudaMemcpyHostToDevice), cudaSuccess);
  }
  std::vector<std::byte> Download(const std::byte* dev, size_t n) override {
    std::vector<std::byte> out(n);
    EXPECT_EQ(cudaMemcpy(out.data(), dev, n, cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }

 private:
  bool managed_;
  std::vector<void*> blocks_;
};
#endif

}  // namespace ckptfs::testing
