// A fixed pool of worker threads for hashing, compression, pack I/O and
// parallel reads.
//
// Thread safety: Submit may be called from any thread. Tasks must not block
// waiting on other tasks of the same pool; code that may run on a pool
// thread checks OnPoolThread() and runs inline instead. A task may destroy
// the pool it runs on (its last owner let go inside it): the destructor
// then lets that worker finish on its own instead of joining it.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace ckptfs {

class ThreadPool {
 public:
  explicit ThreadPool(size_t threads);
  ~ThreadPool();  // runs the queued tasks, then joins (see above)
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  void Submit(std::function<void()> task);
  size_t size() const { return threads_.size(); }
  static bool OnPoolThread();

 private:
  // Shared with the workers, so that one outliving the pool (above) still
  // has its queue to drain.
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<std::function<void()>> queue;  // guarded by mu
    bool stop = false;                        // guarded by mu
  };
  static void Run(std::shared_ptr<State> state);
  std::shared_ptr<State> state_ = std::make_shared<State>();
  std::vector<std::thread> threads_;
};

// Counts outstanding work; Wait blocks until it reaches zero.
class WaitGroup {
 public:
  void Add(size_t n = 1) {
    std::lock_guard lock(mu_);
    count_ += n;
  }
  void Done() {
    std::lock_guard lock(mu_);
    if (--count_ == 0) cv_.notify_all();
  }
  void Wait() {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return count_ == 0; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  size_t count_ = 0;
};

// fn(i) for every i in [0, n), on the calling thread and up to `threads - 1`
// workers of `pool` (for blocking work such as requests to an object
// store: a pool of its own, so that it never occupies the compute
// workers). No thread is created. The caller takes indices too, so the
// loop finishes even when every worker is busy, and a ParallelFor inside
// another on the same pool cannot deadlock. Returns when all calls have
// returned; a worker that starts after that touches nothing of the call's.
void ParallelFor(ThreadPool& pool, size_t n, size_t threads, const std::function<void(size_t)>& fn);

}  // namespace ckptfs
