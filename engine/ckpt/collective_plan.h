// Planning a collective save or restore: which rank of a group hashes,
// encodes and writes each region that several ranks hold, and which rank
// fetches each region that several ranks need.
//
// Every rank gathers every rank's list (all-gather, driven by the layer
// that owns the process group: Python for torch.distributed) and calls the
// same function on the same input, so all ranks reach the same answer
// without another exchange. The functions are pure and deterministic.
//
// Regions are the same when they name the same tensor (and global shape)
// and cover the same elements: a box that is contiguous in row-major order
// and the flat range of the same elements are one region. Regions that
// overlap without being equal are not merged here; the commit's tiling
// check and the merge deal with them as before.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/region.h"

namespace ckptfs {

// One region a rank holds (save) or needs (load). A blob is an entry with
// an empty shape and an empty flat region; blobs are the same when their
// names are.
struct PlanEntry {
  std::string name;
  Shape shape;
  Region region;
  uint64_t bytes = 0;
};

struct SaveOwners {
  // put[r][i]: rank r hashes, encodes and writes its entry i.
  std::vector<std::vector<uint8_t>> put;
  std::vector<uint64_t> bytes_per_rank;  // what each rank writes
  uint64_t unique_bytes = 0;             // each distinct region once
  uint64_t held_bytes = 0;               // every entry of every rank
};

// Each distinct region goes to one of the ranks holding it: largest region
// first, to the holder with the fewest bytes so far, the lowest rank on
// ties (ByteCheckpoint's and DCP's rule). O(N log N) in the number of
// entries N over all ranks.
SaveOwners AssignSaveOwners(const std::vector<std::vector<PlanEntry>>& ranks);

struct LoadRoute {
  int reader = 0;  // fetches it from the store, verifies and decodes it
  uint64_t bytes = 0;
  // Every rank needing the region, with the index of the entry in that
  // rank's list, in rank order; the reader is one of them.
  std::vector<std::pair<int, size_t>> needers;
};

struct LoadRoutes {
  std::vector<LoadRoute> routes;          // distinct regions, largest first
  std::vector<uint64_t> bytes_per_rank;   // what each rank fetches
  uint64_t unique_bytes = 0;
  uint64_t needed_bytes = 0;
};

// The union of the ranks' load plans, each distinct region once, fetched
// by one of the ranks needing it (balanced by bytes as above) and then
// delivered to the others. O(N log N).
LoadRoutes AssignLoadReaders(const std::vector<std::vector<PlanEntry>>& ranks);

}  // namespace ckptfs
