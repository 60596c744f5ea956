// Content-defined chunking of files in sequence, as Hugging Face's Xet
// storage chunks them: a gear rolling hash over the bytes cuts a chunk where
// its top bits are zero, aiming at 64 KiB chunks of 8 to 128 KiB. Files are
// taken in the order given (the checkpoints of a run, oldest first); each
// chunk is named by its XXH3-128, and a chunk seen in an earlier file (or
// earlier in the same one) counts as deduplicated. Prints, per file, its
// bytes and the bytes of the chunks it adds, and one JSON line per file with
// --json, so that a benchmark can compare ckptfs's dedup with Xet-style
// chunking on the same checkpoints (tools/bench/step_dedup_bench.py).
//
//     cdc_bench [--target-kib 64] [--json] FILE...
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <unordered_set>
#include <vector>

#include "core/chunk_id.h"
#include "io/mapped_file.h"

using namespace ckptfs;

namespace {

// The gear table: 256 fixed pseudo-random 64-bit values (splitmix64 from a
// fixed seed), as every gear chunker has one.
struct Gear {
  uint64_t value[256];
  Gear() {
    uint64_t x = 0x6a09e667f3bcc908ull;
    for (auto& v : value) {
      x += 0x9e3779b97f4a7c15ull;
      uint64_t z = x;
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
      v = z ^ (z >> 31);
    }
  }
};

// Chunk boundaries of `data`: a cut after byte i when the hash's top
// log2(target) bits are zero, no chunk under min or over max bytes.
void Cut(const uint8_t* data, size_t n, size_t target, std::vector<size_t>& ends) {
  static const Gear gear;
  const size_t min = target / 8, max = target * 2;
  int bits = 0;
  while ((size_t{1} << bits) < target) ++bits;
  const uint64_t mask = bits ? ~uint64_t{0} << (64 - bits) : 0;
  ends.clear();
  size_t start = 0;
  while (start < n) {
    const size_t limit = std::min(n, start + max);
    size_t i = std::min(n, start + min);
    uint64_t h = 0;
    size_t end = limit;
    for (; i < limit; ++i) {
      h = (h << 1) + gear.value[data[i]];
      if ((h & mask) == 0) {
        end = i + 1;
        break;
      }
    }
    ends.push_back(end);
    start = end;
  }
}

}  // namespace

int main(int argc, char** argv) {
  size_t target = 64 << 10;
  bool json = false;
  std::vector<std::string> files;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--target-kib" && i + 1 < argc) {
      target = static_cast<size_t>(std::atol(argv[++i])) << 10;
    } else if (a == "--json") {
      json = true;
    } else if (a == "--help" || a == "-h" || a.starts_with("--")) {
      std::printf("usage: cdc_bench [--target-kib 64] [--json] FILE...\n"
                  "Chunks the files in order with a gear hash (Xet-style content-defined chunks\n"
                  "of 1/8 to 2x the target) and prints each file's bytes and the bytes of the\n"
                  "chunks no earlier file or chunk had.\n");
      return a == "--help" || a == "-h" ? 0 : 2;
    } else {
      files.push_back(a);
    }
  }
  if (files.empty() || target < 1024) {
    std::fprintf(stderr, "cdc_bench: give files, and a target of at least 1 KiB\n");
    return 2;
  }
  std::unordered_set<ChunkId, ChunkIdHash> seen;
  std::vector<size_t> ends;
  for (const std::string& path : files) {
    auto file = MappedFile::Open(path, /*sequential=*/true);
    if (!file.ok()) {
      std::fprintf(stderr, "cdc_bench: %s: %s\n", path.c_str(), file.status().ToString().c_str());
      return 1;
    }
    const auto bytes = (*file)->bytes();
    const auto* data = reinterpret_cast<const uint8_t*>(bytes.data());
    Cut(data, bytes.size(), target, ends);
    uint64_t added = 0, chunks_added = 0;
    size_t start = 0;
    for (size_t end : ends) {
      if (seen.insert(ChunkId::Of(bytes.subspan(start, end - start))).second) {
        added += end - start;
        ++chunks_added;
      }
      start = end;
    }
    if (json) {
      std::printf("{\"file\": \"%s\", \"bytes\": %zu, \"chunks\": %zu, \"new_bytes\": %llu, \"new_chunks\": %llu}\n",
                  path.c_str(), bytes.size(), ends.size(), static_cast<unsigned long long>(added),
                  static_cast<unsigned long long>(chunks_added));
    } else {
      std::printf("%s: %zu bytes in %zu chunks, %llu new bytes (%.3f) in %llu new chunks\n", path.c_str(),
                  bytes.size(), ends.size(), static_cast<unsigned long long>(added),
                  bytes.empty() ? 0.0 : double(added) / double(bytes.size()), static_cast<unsigned long long>(chunks_added));
    }
  }
  return 0;
}
