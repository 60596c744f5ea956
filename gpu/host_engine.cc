// The host copy engine: CUDA-stream semantics on a worker thread.
#include <algorithm>
#include <cstring>
#include <deque>
#include <thread>

#include "staging.h"

namespace ckptfs::gpu {

struct HostCopyEngine::Impl {
  struct Copy {
    uint64_t ticket;
    std::byte* dst;
    const std::byte* src;
    size_t n;
  };
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Copy> queue;
  uint64_t next_ticket = 1;
  uint64_t done_through = 0;
  Status error;  // sticky, like a CUDA stream error
  uint64_t fail_after = UINT64_MAX;
  uint64_t allocations = 0;
  bool stop = false;
  std::thread worker;

  void Run() {
    while (true) {
      Copy c;
      {
        std::unique_lock lock(mu);
        cv.wait(lock, [&] { return stop || !queue.empty(); });
        if (queue.empty()) return;
        c = queue.front();
        queue.pop_front();
      }
      bool fail = false;
      {
        std::lock_guard lock(mu);
        if (fail_after == 0) fail = true;
        else if (fail_after != UINT64_MAX) --fail_after;
      }
      if (!fail && c.n) std::memcpy(c.dst, c.src, c.n);
      {
        std::lock_guard lock(mu);
        if (fail && error.ok()) error = Status::IOError("device copy failed (injected)");
        done_through = c.ticket;
      }
      cv.notify_all();
    }
  }

  Result<uint64_t> Submit(std::byte* dst, const std::byte* src, size_t n) {
    std::lock_guard lock(mu);
    CKPT_RETURN_IF_ERROR(error);
    uint64_t t = next_ticket++;
    queue.push_back({t, dst, src, n});
    cv.notify_all();
    return t;
  }
};

HostCopyEngine::HostCopyEngine() : impl_(new Impl) {
  impl_->worker = std::thread([this] { impl_->Run(); });
}

HostCopyEngine::~HostCopyEngine() {
  {
    std::lock_guard lock(impl_->mu);
    impl_->stop = true;
  }
  impl_->cv.notify_all();
  impl_->worker.join();
}

Result<std::byte*> HostCopyEngine::AllocatePinned(size_t bytes) {
  std::lock_guard lock(impl_->mu);
  ++impl_->allocations;
  // Zeroed, so that like pinned memory its pages are resident from the start
  // and no copy pays for first-touch faults.
  return new std::byte[bytes]();
}

void HostCopyEngine::FreePinned(std::byte* p) { delete[] p; }

Result<uint64_t> HostCopyEngine::DeviceToHost(std::byte* host, const std::byte* device, size_t n) {
  return impl_->Submit(host, device, n);
}

Result<uint64_t> HostCopyEngine::HostToDevice(std::byte* device, const std::byte* host, size_t n) {
  return impl_->Submit(device, host, n);
}

Result<uint64_t> HostCopyEngine::DeviceToDevice(std::byte* dst, const std::byte* src, size_t n) {
  return impl_->Submit(dst, src, n);
}

Result<std::byte*> HostCopyEngine::AllocateDevice(size_t bytes) { return new std::byte[std::max<size_t>(bytes, 1)]; }

void HostCopyEngine::FreeDevice(std::byte* p) { delete[] p; }

Status HostCopyEngine::Wait(uint64_t ticket) {
  std::unique_lock lock(impl_->mu);
  impl_->cv.wait(lock, [&] { return impl_->done_through >= ticket; });
  return impl_->error;
}

void HostCopyEngine::FailAfter(uint64_t n) {
  std::lock_guard lock(impl_->mu);
  impl_->fail_after = n;
}

uint64_t HostCopyEngine::pinned_allocations() const {
  std::lock_guard lock(impl_->mu);
  return impl_->allocations;
}

}  // namespace ckptfs::gpu
