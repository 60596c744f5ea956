// Helpers shared by the benchmarks.
#pragma once

#include <sys/resource.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "backend/backend.h"
#include "backend/store_options.h"
#include "backend/store_url.h"
#include "core/status.h"

namespace ckptfs::bench {

// The value of option argv[i] (advancing i past it); exits with status 2,
// naming the option, when it has none.
inline std::string NextArg(int argc, char** argv, int& i) {
  if (i + 1 >= argc) {
    std::fprintf(stderr, "%s needs a value\n", argv[i]);
    std::exit(2);
  }
  return argv[++i];
}

inline void Check(const Status& st, const char* what) {
  if (!st.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, st.ToString().c_str());
    std::exit(1);
  }
}

// Seconds from `since` to `until` (now by default).
inline double Seconds(std::chrono::steady_clock::time_point since,
                      std::chrono::steady_clock::time_point until = std::chrono::steady_clock::now()) {
  return std::chrono::duration<double>(until - since).count();
}

// Drops the page cache (needs root); false when it could not.
inline bool DropCaches() {
  ::sync();
  int fd = ::open("/proc/sys/vm/drop_caches", O_WRONLY);
  if (fd < 0) return false;
  bool ok = ::write(fd, "3", 1) == 1;
  ::close(fd);
  return ok;
}

// Writes `parts` one after the other to a new file at `path` in 4 MiB
// write()s, then fsyncs it; the seconds it took. Exits on a write error.
inline double TimedWrite(const std::string& path, const std::vector<std::span<const std::byte>>& parts) {
  const auto t0 = std::chrono::steady_clock::now();
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) {
    std::perror(path.c_str());
    std::exit(1);
  }
  for (const auto& part : parts) {
    for (size_t off = 0; off < part.size(); off += 4 << 20) {
      const size_t n = std::min<size_t>(4 << 20, part.size() - off);
      if (::write(fd, part.data() + off, n) != static_cast<ssize_t>(n)) {
        std::perror(path.c_str());
        std::exit(1);
      }
    }
  }
  ::fsync(fd);
  ::close(fd);
  return Seconds(t0);
}

// read()s `path` to its end, each read into the span next(bytes so far)
// gives and reported to got(span of the bytes read); returns the number of
// bytes read. Exits when the file cannot be opened or a read fails.
template <typename Next, typename Got>
uint64_t ReadToEnd(const std::string& path, Next next, Got got) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) {
    std::perror(path.c_str());
    std::exit(1);
  }
  uint64_t total = 0;
  ssize_t n;
  for (std::span<std::byte> to = next(total); (n = ::read(fd, to.data(), to.size())) > 0; to = next(total)) {
    got(to.first(static_cast<size_t>(n)));
    total += static_cast<uint64_t>(n);
  }
  ::close(fd);
  if (n < 0) {
    std::fprintf(stderr, "read of %s failed after %llu bytes\n", path.c_str(), static_cast<unsigned long long>(total));
    std::exit(1);
  }
  return total;
}

// Reads `path` sequentially in `piece`-byte read()s and returns the seconds
// it took; exits unless exactly `expect` bytes came back. With `digest`, the
// XXH3-64 of the bytes is computed on the way (timed too).
inline double TimedRead(const std::string& path, uint64_t expect, size_t piece, uint64_t* digest = nullptr) {
  std::vector<std::byte> buf(piece);
  XXH3_state_t* h = XXH3_createState();
  XXH3_64bits_reset(h);
  const auto t0 = std::chrono::steady_clock::now();
  const uint64_t total = ReadToEnd(
      path, [&](uint64_t) { return std::span(buf); },
      [&](std::span<std::byte> got) {
        if (digest) XXH3_64bits_update(h, got.data(), got.size());
      });
  const double seconds = Seconds(t0);
  if (total != expect) {
    std::fprintf(stderr, "%s has %llu bytes, expected %llu\n", path.c_str(), static_cast<unsigned long long>(total),
                 static_cast<unsigned long long>(expect));
    std::exit(1);
  }
  if (digest) *digest = XXH3_64bits_digest(h);
  XXH3_freeState(h);
  return seconds;
}

// Reads `path` sequentially in `piece`-byte read()s straight into `dst`
// (memory of the file's size that exists already, like a tensor being
// loaded) and returns the seconds it took; exits unless the whole file
// fills `dst` exactly.
inline double TimedReadInto(const std::string& path, std::span<std::byte> dst, size_t piece) {
  std::byte past_end[1];  // where a read after dst is full goes: it must find the end
  const auto t0 = std::chrono::steady_clock::now();
  const uint64_t total = ReadToEnd(
      path,
      [&](uint64_t at) {
        return at < dst.size() ? dst.subspan(at, std::min<uint64_t>(piece, dst.size() - at)) : std::span(past_end);
      },
      [](std::span<std::byte>) {});
  const double seconds = Seconds(t0);
  if (total != dst.size()) {
    std::fprintf(stderr, "%s has %llu bytes, expected %zu\n", path.c_str(), static_cast<unsigned long long>(total),
                 dst.size());
    std::exit(1);
  }
  return seconds;
}

// "1,8,32" as {1, 8, 32} (an option's list of counts).
inline std::vector<int> ParseIntList(const std::string& s) {
  std::vector<int> out;
  size_t pos = 0;
  while (pos <= s.size()) {
    size_t comma = s.find(',', pos);
    if (comma == std::string::npos) comma = s.size();
    if (comma > pos) out.push_back(std::atoi(s.substr(pos, comma - pos).c_str()));
    pos = comma + 1;
  }
  return out;
}

// CPU seconds this process has used (user + system, every thread).
inline double CpuSeconds() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec + (u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

inline double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

// A benchmark's figures, one value per run under each name, reported as
// medians.
class RunFigures {
 public:
  void Add(const std::string& name, double value) { values_[name].push_back(value); }
  double Median(const std::string& name) const {
    auto it = values_.find(name);
    return it == values_.end() ? 0 : bench::Median(it->second);
  }

 private:
  std::map<std::string, std::vector<double>> values_;
};

// A fast deterministic generator (splitmix64) with Box-Muller normals:
// billions of values in seconds.
struct Rng {
  uint64_t state;
  uint64_t Next() {
    state += 0x9e3779b97f4a7c15ull;
    uint64_t z = state;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  void Normals(float* out, size_t n, float sigma) {
    for (size_t i = 0; i + 1 < n; i += 2) {
      uint64_t r = Next();
      float u1 = ((r >> 40) + 1) * (1.0f / 16777217.0f);
      float u2 = (r & 0xffffff) * (1.0f / 16777216.0f);
      float m = std::sqrt(-2.0f * std::log(u1)) * sigma;
      out[i] = m * std::cos(6.2831853f * u2);
      out[i + 1] = m * std::sin(6.2831853f * u2);
    }
    if (n % 2) out[n - 1] = 0;
  }
};

// float -> bf16, rounding to nearest even.
inline uint16_t ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

// n bf16 values drawn from N(0, sigma).
inline void FillNormalBf16(uint16_t* out, size_t n, float sigma, uint64_t seed) {
  Rng rng{seed};
  std::vector<float> tmp(std::min<size_t>(n, 1 << 20));
  for (size_t done = 0; done < n; done += tmp.size()) {
    size_t k = std::min(tmp.size(), n - done);
    rng.Normals(tmp.data(), k, sigma);
    for (size_t i = 0; i < k; ++i) out[done + i] = ToBf16(tmp[i]);
  }
}

// Minor page faults of process `pid` so far (/proc/PID/stat, field 10);
// -1 when it cannot be read.
inline long long MinorFaults(pid_t pid) {
  const std::string path = "/proc/" + std::to_string(pid) + "/stat";
  FILE* f = std::fopen(path.c_str(), "r");
  if (!f) return -1;
  char buf[1024];
  const size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[n] = 0;
  // Fields after the command name, which is in parentheses and may hold spaces.
  const char* p = std::strrchr(buf, ')');
  if (!p) return -1;
  long long minflt = -1;
  // state ppid pgrp session tty_nr tpgid flags minflt
  if (std::sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %lld", &minflt) != 1) return -1;
  return minflt;
}

// The largest page-cache folio, in 4 KiB pages, among the first `max_bytes`
// of `path` (which should be cached): the file is mapped, its pages are
// looked up in /proc/self/pagemap and their flags in /proc/kpageflags
// (compound head and tail). 0 when that cannot be read (not root).
inline size_t LargestCachedFolioPages(const std::string& path, size_t max_bytes) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return 0;
  struct stat st;
  size_t pages = ::fstat(fd, &st) == 0 ? std::min<size_t>(st.st_size, max_bytes) / 4096 : 0;
  void* map = pages ? ::mmap(nullptr, pages * 4096, PROT_READ, MAP_SHARED, fd, 0) : MAP_FAILED;
  ::close(fd);
  if (map == MAP_FAILED) return 0;
  const volatile char* p = static_cast<const volatile char*>(map);
  int pagemap = ::open("/proc/self/pagemap", O_RDONLY), flags = ::open("/proc/kpageflags", O_RDONLY);
  size_t largest = 0, run = 0;
  for (size_t i = 0; i < pages && pagemap >= 0 && flags >= 0; ++i) {
    (void)p[i * 4096];
    uint64_t entry = 0, f = 0;
    const uint64_t vpn = reinterpret_cast<uintptr_t>(map) / 4096 + i;
    if (::pread(pagemap, &entry, 8, static_cast<off_t>(vpn * 8)) != 8 || !(entry >> 63)) continue;
    const uint64_t pfn = entry & ((1ull << 55) - 1);
    if (pfn == 0 || ::pread(flags, &f, 8, static_cast<off_t>(pfn * 8)) != 8) break;  // PFNs hidden: not root
    run = (f >> 16 & 1) ? run + 1 : 1;  // KPF_COMPOUND_TAIL continues the head's folio
    largest = std::max(largest, run);
  }
  if (pagemap >= 0) ::close(pagemap);
  if (flags >= 0) ::close(flags);
  ::munmap(map, pages * 4096);
  return largest;
}

// What a first touch of a page costs on this machine: microseconds per 4 KiB
// page, touching 256 MiB of fresh anonymous memory (huge pages off).
inline double PageFaultMicros() {
  const size_t len = 256 << 20;
  void* p = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return -1;
  ::madvise(p, len, MADV_NOHUGEPAGE);
  const auto t0 = std::chrono::steady_clock::now();
  for (size_t off = 0; off < len; off += 4096) static_cast<volatile char*>(p)[off] = 1;
  const double s = Seconds(t0);
  ::munmap(p, len);
  return s * 1e6 / (len / 4096);
}

// The s3cmd command line (Debian's s3cmd) for the server and credentials
// in `s3`; append "put FILE s3://..." or "get ...".
inline std::string S3cmd(const ObjectStoreOptions& s3) {
  const std::string host = s3.endpoint.substr(s3.endpoint.find("://") + 3);
  return "s3cmd --no-ssl --host=" + host + " --host-bucket=" + host + " --access_key=" + s3.access_key +
         " --secret_key=" + s3.secret_key + " --region=" + s3.region + " --no-check-md5 -q";
}

// Reads object `key` into `out` with 4 MiB ranged reads, from `threads`
// threads taking every threads-th piece (1: one thread, in order).
inline void ReadInPieces(Backend& backend, const std::string& key, std::span<std::byte> out, int threads) {
  constexpr uint64_t kPiece = 4 << 20;
  auto run = [&](int t) {
    for (uint64_t off = uint64_t(t) * kPiece; off < out.size(); off += uint64_t(threads) * kPiece) {
      const uint64_t n = std::min<uint64_t>(kPiece, out.size() - off);
      Check(backend.ReadRange(key, off, out.subspan(off, n)), "ranged read");
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(run, t);
  run(0);
  for (auto& th : pool) th.join();
}

// Writes `data` as objects KEY-0, KEY-1, ... of 16 MiB from `threads`
// threads, each a whole PUT (or multipart upload) of its own.
inline void WriteInPieces(Backend& backend, const std::string& key, std::span<const std::byte> data, int threads) {
  constexpr uint64_t kPiece = 16 << 20;
  auto run = [&](int t) {
    for (uint64_t off = uint64_t(t) * kPiece; off < data.size(); off += uint64_t(threads) * kPiece) {
      const uint64_t n = std::min<uint64_t>(kPiece, data.size() - off);
      Check(backend.Put(key + "-" + std::to_string(off / kPiece), data.subspan(off, n)), "put");
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(run, t);
  run(0);
  for (auto& th : pool) th.join();
}

// Removes every object under s3://BUCKET/PREFIX (the test server keeps its
// data in memory); errors are ignored.
inline void RemovePrefix(const ObjectStoreOptions& s3, const std::string& bucket, const std::string& prefix) {
  auto backend = OpenObjectStore("s3://" + bucket + "/" + prefix, s3);
  if (!backend.ok()) return;
  auto keys = (*backend)->List("");
  if (!keys.ok()) return;
  for (const auto& k : *keys) (void)(*backend)->Delete(k);
}

}  // namespace ckptfs::bench
