#include "core/random.h"

#include <unistd.h>

#include <random>

namespace ckptfs {

std::string RandomHex(size_t digits) {
  struct Generator {
    pid_t pid = 0;
    std::mt19937_64 rng;
  };
  thread_local Generator g;
  if (g.pid != ::getpid()) {
    g.pid = ::getpid();
    std::random_device rd;
    g.rng.seed((uint64_t{rd()} << 32) ^ rd() ^ static_cast<uint64_t>(g.pid));
  }
  static const char* kDigits = "0123456789abcdef";
  std::string s(digits, '0');
  uint64_t v = 0;
  for (size_t i = 0; i < digits; ++i) {
    if (i % 16 == 0) v = g.rng();
    s[i] = kDigits[v & 15];
    v >>= 4;
  }
  return s;
}

}  // namespace ckptfs
