// Planning a collective save or restore: which rank of a group hashes,
// encodes and writes each region that several ranks hold, and which rank
// fetches each region that several ranks need.
//
// Rank 0 gathers every rank's list (driven by the layer that owns the
// process group: Python for torch.distributed), computes the plan once for
// the group, and sends each rank its own part (PlanLoadForRanks), so what
// moves over the group and what each rank holds grows with the entries,
// not with their square. The functions are pure and deterministic.
//
// Regions are the same when they name the same tensor (and global shape)
// and cover the same elements: a box that is contiguous in row-major order
// and the flat range of the same elements are one region. Regions that
// overlap without being equal are not merged here; the commit's tiling
// check and the merge deal with them as before.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/region.h"
#include "meta/records.h"
#include "store/chunk_ref.h"

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

// AssignSaveOwners from the routes AssignLoadReaders gave for `ranks`, for
// a caller that also needs the routes (a replica check groups by them).
SaveOwners OwnersOfRoutes(const LoadRoutes& routes, const std::vector<std::vector<PlanEntry>>& ranks);

// A chunk that the readers of two routes both need: distinct regions that
// cut one stored chunk (a restore at another world size), or equal bytes
// stored once. `from`, the reader of the first route needing it (`owner_route`),
// fetches, verifies and decodes it and hands the decoded bytes to `to`, the
// reader of route `route`, which then reads its regions without fetching it.
struct ChunkHandoff {
  ChunkRef chunk;
  int from = 0;
  int to = 0;
  size_t owner_route = 0;
  size_t route = 0;  // the first route of `to` that needs the chunk
  size_t index = 0;  // its place among the plan's hand-offs (a transport's tag)
};

// The chunks each route's region needs, in routes order (route_chunks
// below): `find` gives the stored tensor that an entry's name (tensor name,
// NUL, dtype) names, or nullptr, and such a route, or a blob's, lists none
// (its reader's read fails and names it). Each tensor's shards are indexed
// once (ShardIndex), so listing every rank's regions of a tensor saved in
// N shards costs O(N log N), not N regions times N shards.
std::vector<std::vector<ChunkRef>> ChunksOfRoutes(
    const LoadRoutes& routes, const std::vector<std::vector<PlanEntry>>& plans,
    const std::function<const TensorRecord*(std::string_view)>& find);

// route_chunks[k] lists the chunks route k's region needs (in routes
// order). Each chunk is fetched by one rank, the reader of the first route
// needing it; every other reader needing it gets one hand-off. In route
// then chunk order, the same on every rank. O(C) in the chunks listed.
std::vector<ChunkHandoff> AssignChunkHandoffs(const LoadRoutes& routes,
                                              const std::vector<std::vector<ChunkRef>>& route_chunks);

// What one rank does in one window of a collective load. Routes are read in
// windows so that the decoded chunks ranks hold for each other stay
// bounded: before reading routes [previous routes_end, routes_end), the
// rank fetches and holds `hold`, every rank takes part in an exchange of
// hand-offs when any rank has one in the window (`exchange`), in which
// this rank sends and receives `handoffs` (its own, in the plan's order),
// and after the reads the rank lets `release` go.
struct HandoffWindow {
  size_t routes_end = 0;
  bool exchange = false;
  std::vector<ChunkRef> hold;
  std::vector<ChunkHandoff> handoffs;
  std::vector<ChunkRef> release;
};

// Cuts the routes into windows of about `window_bytes` of hand-offs each
// (one window when there are none) and gives each of `ranks` ranks its
// part of each, in one pass: out[rank][window], routes_end counting all
// routes. O(R + C + N·W) in routes, chunks listed, ranks and windows.
std::vector<std::vector<HandoffWindow>> ScheduleHandoffs(const LoadRoutes& routes,
                                                         const std::vector<std::vector<ChunkRef>>& route_chunks,
                                                         const std::vector<ChunkHandoff>& handoffs, int ranks,
                                                         uint64_t window_bytes);

// A route as one rank takes part in it.
struct RankRoute {
  size_t route = 0;             // its index among the plan's routes (a transport's tag)
  int reader = 0;
  uint64_t bytes = 0;           // of the region
  std::vector<size_t> entries;  // this rank's entries on it, in order
  std::vector<int> peers;       // for its reader: the other ranks needing it, ascending
  bool operator==(const RankRoute&) const = default;
};

// One rank's part of a collective load's plan.
struct RankLoadPlan {
  std::vector<RankRoute> routes;       // those this rank needs, in the plan's order
  std::vector<HandoffWindow> windows;  // routes_end counts `routes` above
  uint64_t unique_bytes = 0;           // over the group
  uint64_t needed_bytes = 0;
  uint64_t fetch_bytes = 0;            // what this rank fetches
};

// The group's load plan, computed once (AssignLoadReaders, ChunksOfRoutes,
// AssignChunkHandoffs, ScheduleHandoffs) and cut into every rank's part.
// Without `find` (no reader of the checkpoint) there are no hand-offs.
// O(N log N) in the entries over all ranks plus the chunks listed; each
// rank's part is the size of its own entries and hand-offs.
//
// `near` (one list per rank, or empty) names the saving ranks whose parts
// each rank's host keeps in a nearer tier (its fast tier: ReadOptions::
// nearer). A region is then read by one of the ranks needing it whose
// nearer tier holds every chunk of it (a saving rank of each chunk's shard
// is in its list), the least loaded of those, and by the least loaded of
// all only when none does: a replicated tensor, or a restore at another
// world size, reads the fast tier of a host that has it, not the shared
// tier. O(C) more in the chunks of the routes.
std::vector<RankLoadPlan> PlanLoadForRanks(const std::vector<std::vector<PlanEntry>>& plans,
                                           const std::function<const TensorRecord*(std::string_view)>& find,
                                           uint64_t window_bytes,
                                           const std::vector<std::vector<uint32_t>>& near = {});

}  // namespace ckptfs
