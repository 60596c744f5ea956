// Helpers for the files that call the CUDA runtime (built with CUDA only).
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "core/status.h"

namespace ckptfs::gpu {

inline Status CudaError(cudaError_t e, const char* what) {
  return Status::IOError(std::string(what) + ": " + cudaGetErrorString(e));
}

// Makes `device` current for the calling thread and restores the previous
// one, so using the staging layer never changes the caller's current device.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&previous_) == cudaSuccess && previous_ == device) return;
    changed_ = cudaSetDevice(device) == cudaSuccess && previous_ >= 0;
  }
  ~DeviceGuard() {
    if (changed_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
  bool changed_ = false;
};

}  // namespace ckptfs::gpu
