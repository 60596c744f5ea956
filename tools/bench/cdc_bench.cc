// Content-defined chunking of files in sequence, as Hugging Face's Xet
// storage chunks them (ContentCuts, core/content_cuts.h, which ckptfs uses
// for blobs), aiming at 64 KiB chunks of 8 to 128 KiB. Files are
// taken in the order given (the checkpoints of a run, oldest first); each
// chunk is named by its XXH3-128, and a chunk seen in an earlier file (or
// earlier in the same one) counts as deduplicated. Prints, per file, its
// bytes and the bytes of the chunks it adds, and one JSON line per file with
// --json, so that a benchmark can compare ckptfs's dedup with Xet-style
// chunking on the same checkpoints (tools/bench/step_dedup_bench.py).
// Also prints the speed of the cuts beside XXH3-128 of the same chunks
// (the chunk id every save computes), on pages already touched.
//
//     cdc_bench [--target-kib 64] [--json] FILE...
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <unordered_set>
#include <vector>

#include "core/chunk_id.h"
#include "core/content_cuts.h"
#include "io/mapped_file.h"

using namespace ckptfs;


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
  std::vector<uint64_t> ends;
  double cut_seconds = 0, hash_seconds = 0;
  uint64_t total = 0;
  const auto now = [] { return std::chrono::steady_clock::now(); };
  for (const std::string& path : files) {
    auto file = MappedFile::Open(path, /*sequential=*/true);
    if (!file.ok()) {
      std::fprintf(stderr, "cdc_bench: %s: %s\n", path.c_str(), file.status().ToString().c_str());
      return 1;
    }
    const auto bytes = (*file)->bytes();
    (void)ChunkId::Of(bytes);  // pages in, untimed
    const auto t0 = now();
    ContentCuts(bytes, target, ends);
    const auto t1 = now();
    std::vector<ChunkId> ids;
    ids.reserve(ends.size());
    size_t start = 0;
    for (uint64_t end : ends) {
      ids.push_back(ChunkId::Of(bytes.subspan(start, end - start)));
      start = end;
    }
    const auto t2 = now();
    cut_seconds += std::chrono::duration<double>(t1 - t0).count();
    hash_seconds += std::chrono::duration<double>(t2 - t1).count();
    total += bytes.size();
    uint64_t added = 0, chunks_added = 0;
    start = 0;
    for (size_t i = 0; i < ends.size(); ++i) {
      if (seen.insert(ids[i]).second) {
        added += ends[i] - start;
        ++chunks_added;
      }
      start = ends[i];
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
  if (!json && total > 0) {
    std::printf("cuts: %.2f GB/s; XXH3-128 of the same chunks: %.2f GB/s; cut time / hash time %.2f\n",
                total / cut_seconds / 1e9, total / hash_seconds / 1e9, cut_seconds / hash_seconds);
  }
  return 0;
}
