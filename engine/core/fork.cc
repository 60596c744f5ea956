#include "core/fork.h"

#include <pthread.h>

#include <atomic>

namespace ckptfs {
namespace {
std::atomic<uint64_t> generation{0};
void InChild() { generation.fetch_add(1, std::memory_order_relaxed); }
}  // namespace

uint64_t ForkGeneration() {
  static const bool registered = [] { return pthread_atfork(nullptr, nullptr, InChild) == 0; }();
  (void)registered;
  return generation.load(std::memory_order_relaxed);
}

}  // namespace ckptfs
