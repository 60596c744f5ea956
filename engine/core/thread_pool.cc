#include "core/thread_pool.h"

#include <algorithm>
#include <atomic>

namespace ckptfs {
namespace {
thread_local bool on_pool_thread = false;
}

ThreadPool::ThreadPool(size_t threads) {
  if (threads == 0) threads = 1;
  for (size_t i = 0; i < threads; ++i) threads_.emplace_back([this] { Run(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

bool ThreadPool::OnPoolThread() { return on_pool_thread; }

void ThreadPool::Submit(std::function<void()> task) {
  {
    std::lock_guard lock(mu_);
    queue_.push_back(std::move(task));
  }
  cv_.notify_one();
}

void ThreadPool::Run() {
  on_pool_thread = true;
  while (true) {
    std::function<void()> task;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();
  }
}

void ParallelFor(size_t n, size_t threads, const std::function<void(size_t)>& fn) {
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i; (i = next.fetch_add(1)) < n;) fn(i);
  };
  std::vector<std::thread> helpers;
  for (size_t k = 1; k < std::min(n, threads); ++k) helpers.emplace_back(work);
  work();
  for (auto& t : helpers) t.join();
}

}  // namespace ckptfs
