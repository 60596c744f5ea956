#include "core/thread_pool.h"

#include <algorithm>
#include <atomic>

namespace ckptfs {
namespace {
thread_local bool on_pool_thread = false;
}

ThreadPool::ThreadPool(size_t threads) {
  if (threads == 0) threads = 1;
  for (size_t i = 0; i < threads; ++i) threads_.emplace_back([state = state_] { Run(state); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard lock(state_->mu);
    state_->stop = true;
  }
  state_->cv.notify_all();
  for (auto& t : threads_) {
    if (t.get_id() == std::this_thread::get_id()) {
      t.detach();  // a task of this pool is destroying it: this worker ends after it
    } else {
      t.join();
    }
  }
}

bool ThreadPool::OnPoolThread() { return on_pool_thread; }

void ThreadPool::Submit(std::function<void()> task) {
  {
    std::lock_guard lock(state_->mu);
    state_->queue.push_back(std::move(task));
  }
  state_->cv.notify_one();
}

void ThreadPool::Run(std::shared_ptr<State> state) {
  on_pool_thread = true;
  while (true) {
    std::function<void()> task;
    {
      std::unique_lock lock(state->mu);
      state->cv.wait(lock, [&] { return state->stop || !state->queue.empty(); });
      if (state->queue.empty()) return;
      task = std::move(state->queue.front());
      state->queue.pop_front();
    }
    task();
  }
}

void ParallelFor(ThreadPool& pool, size_t n, size_t threads, const std::function<void(size_t)>& fn) {
  // Shared with the helpers, which may start after the call has returned.
  struct State {
    std::atomic<size_t> next{0};
    std::mutex mu;
    std::condition_variable idle;
    size_t running = 0;  // helpers that may still call fn; guarded by mu
  };
  auto state = std::make_shared<State>();
  const std::function<void(size_t)>* body = &fn;
  auto work = [n, body](State& s) {
    for (size_t i; (i = s.next.fetch_add(1)) < n;) (*body)(i);
  };
  const size_t helpers = std::min(n, std::min(threads, pool.size() + 1));
  for (size_t k = 1; k < helpers; ++k) {
    pool.Submit([state, work, n] {
      {
        std::lock_guard lock(state->mu);
        if (state->next.load() >= n) return;  // all taken: fn may be gone
        ++state->running;
      }
      work(*state);
      std::lock_guard lock(state->mu);
      if (--state->running == 0) state->idle.notify_all();
    });
  }
  work(*state);
  std::unique_lock lock(state->mu);
  state->idle.wait(lock, [&] { return state->running == 0; });
}

}  // namespace ckptfs
