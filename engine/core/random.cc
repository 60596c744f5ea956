#include "core/random.h"

#include <unistd.h>

#include <random>

namespace ckptfs {

namespace {

// The calling thread's generator, seeded from the OS once per thread and
// again in a child after fork.
std::mt19937_64& Generator() {
  struct Seeded {
    pid_t pid = 0;
    std::mt19937_64 rng;
  };
  thread_local Seeded g;
  if (g.pid != ::getpid()) {
    g.pid = ::getpid();
    std::random_device rd;
    g.rng.seed((uint64_t{rd()} << 32) ^ rd() ^ static_cast<uint64_t>(g.pid));
  }
  return g.rng;
}

}  // namespace

uint64_t RandomU64() { return Generator()(); }

std::string RandomHex(size_t digits) {
  std::mt19937_64& rng = Generator();
  static const char* kDigits = "0123456789abcdef";
  std::string s(digits, '0');
  uint64_t v = 0;
  for (size_t i = 0; i < digits; ++i) {
    if (i % 16 == 0) v = rng();
    s[i] = kDigits[v & 15];
    v >>= 4;
  }
  return s;
}

}  // namespace ckptfs
