#include "ckpt/collective_plan.h"

#include "ckpt/read_plan.h"

#include <algorithm>
#include <unordered_map>
#include <unordered_set>

namespace ckptfs {

namespace {

struct Ref {
  uint32_t rank;
  uint32_t index;
};

void AppendNumbers(std::string& out, const std::vector<uint64_t>& v) {
  for (uint64_t x : v) {
    out += std::to_string(x);
    out += ',';
  }
  out += ';';
}

// Equal for entries that name the same tensor and global shape and cover
// the same elements (a contiguous box and its flat range alike).
std::string KeyOf(const PlanEntry& e) {
  std::string key = e.name;
  key += '\0';
  AppendNumbers(key, e.shape);
  const Region r = e.shape.empty() ? e.region : Normalize(e.shape, e.region);
  if (r.kind == Region::Kind::kFlat) {
    key += 'F';
    AppendNumbers(key, {r.flat.start, r.flat.end});
  } else {
    key += 'B';
    AppendNumbers(key, r.box.offsets);
    AppendNumbers(key, r.box.lengths);
  }
  return key;
}

struct Group {
  size_t first = 0;  // into the sorted refs
  size_t count = 0;
  uint64_t bytes = 0;
};

// The entries of all ranks sorted so that equal regions are adjacent (each
// run in rank order), and the runs, largest first (then by key: the same
// order on every rank).
void GroupEntries(const std::vector<std::vector<PlanEntry>>& ranks, std::vector<std::pair<std::string, Ref>>* refs,
                  std::vector<Group>* groups) {
  size_t n = 0;
  for (const auto& r : ranks) n += r.size();
  refs->clear();
  refs->reserve(n);
  for (size_t r = 0; r < ranks.size(); ++r) {
    for (size_t i = 0; i < ranks[r].size(); ++i) {
      refs->emplace_back(KeyOf(ranks[r][i]), Ref{static_cast<uint32_t>(r), static_cast<uint32_t>(i)});
    }
  }
  std::sort(refs->begin(), refs->end(), [](const auto& a, const auto& b) {
    if (a.first != b.first) return a.first < b.first;
    if (a.second.rank != b.second.rank) return a.second.rank < b.second.rank;
    return a.second.index < b.second.index;
  });
  groups->clear();
  for (size_t i = 0; i < refs->size();) {
    size_t j = i + 1;
    while (j < refs->size() && (*refs)[j].first == (*refs)[i].first) ++j;
    const Ref& head = (*refs)[i].second;
    groups->push_back({i, j - i, ranks[head.rank][head.index].bytes});
    i = j;
  }
  // Largest first; equal sizes keep key order (the sort above), so the
  // order is the same wherever it is computed.
  std::stable_sort(groups->begin(), groups->end(), [](const Group& a, const Group& b) { return a.bytes > b.bytes; });
}

// The holder of a group with the fewest bytes so far, the lowest rank on
// ties (holders come in rank order).
uint32_t LeastLoaded(const std::vector<std::pair<std::string, Ref>>& refs, const Group& g,
                     const std::vector<uint64_t>& load) {
  uint32_t best = refs[g.first].second.rank;
  for (size_t k = g.first + 1; k < g.first + g.count; ++k) {
    const uint32_t r = refs[k].second.rank;
    if (load[r] < load[best]) best = r;
  }
  return best;
}

}  // namespace

LoadRoutes AssignLoadReaders(const std::vector<std::vector<PlanEntry>>& ranks) {
  LoadRoutes out;
  out.bytes_per_rank.assign(ranks.size(), 0);
  std::vector<std::pair<std::string, Ref>> refs;
  std::vector<Group> groups;
  GroupEntries(ranks, &refs, &groups);
  out.routes.reserve(groups.size());
  for (const Group& g : groups) {
    LoadRoute route;
    route.reader = static_cast<int>(LeastLoaded(refs, g, out.bytes_per_rank));
    route.bytes = g.bytes;
    route.needers.reserve(g.count);
    for (size_t k = g.first; k < g.first + g.count; ++k) {
      const Ref& ref = refs[k].second;
      route.needers.emplace_back(static_cast<int>(ref.rank), ref.index);
      out.needed_bytes += ranks[ref.rank][ref.index].bytes;
    }
    out.bytes_per_rank[route.reader] += g.bytes;
    out.unique_bytes += g.bytes;
    out.routes.push_back(std::move(route));
  }
  return out;
}

SaveOwners AssignSaveOwners(const std::vector<std::vector<PlanEntry>>& ranks) {
  return OwnersOfRoutes(AssignLoadReaders(ranks), ranks);
}

// The same assignment as a load's: each distinct region's reader is its
// owner, and puts it once (a rank holding it twice puts the first).
SaveOwners OwnersOfRoutes(const LoadRoutes& routes, const std::vector<std::vector<PlanEntry>>& ranks) {
  SaveOwners out;
  out.put.resize(ranks.size());
  for (size_t r = 0; r < ranks.size(); ++r) out.put[r].assign(ranks[r].size(), 0);
  for (const LoadRoute& route : routes.routes) {
    for (const auto& [rank, index] : route.needers) {
      if (rank == route.reader) {
        out.put[rank][index] = 1;
        break;
      }
    }
  }
  out.bytes_per_rank = routes.bytes_per_rank;
  out.unique_bytes = routes.unique_bytes;
  out.held_bytes = routes.needed_bytes;
  return out;
}

std::vector<std::vector<ChunkRef>> ChunksOfRoutes(
    const LoadRoutes& routes, const std::vector<std::vector<PlanEntry>>& plans,
    const std::function<const TensorRecord*(std::string_view)>& find) {
  std::vector<std::vector<ChunkRef>> chunks(routes.routes.size());
  std::unordered_map<const TensorRecord*, ShardIndex> indexes;
  for (size_t k = 0; k < routes.routes.size(); ++k) {
    if (routes.routes[k].needers.empty()) continue;
    const auto [r, i] = routes.routes[k].needers.front();
    const PlanEntry& e = plans[r][i];
    const size_t cut = e.name.find('\0');
    if (cut == std::string::npos) continue;  // a blob
    const TensorRecord* t = find(std::string_view(e.name).substr(0, cut));
    if (t == nullptr) continue;
    const ShardIndex& index = indexes.try_emplace(t, *t).first->second;
    auto listed = ChunksForRegion(*t, e.region, &index);
    if (listed.ok()) chunks[k] = std::move(listed).value();
  }
  return chunks;
}

std::vector<ChunkHandoff> AssignChunkHandoffs(const LoadRoutes& routes,
                                              const std::vector<std::vector<ChunkRef>>& route_chunks) {
  std::vector<ChunkHandoff> out;
  struct Owner {
    int reader;
    size_t route;
  };
  std::unordered_map<ChunkId, Owner, ChunkIdHash> owner;
  struct Given {
    ChunkId id;
    int to;
    bool operator==(const Given&) const = default;
  };
  struct GivenHash {
    size_t operator()(const Given& g) const {
      return ChunkIdHash()(g.id) ^ (static_cast<size_t>(g.to) * 0x9e3779b97f4a7c15ull);
    }
  };
  std::unordered_set<Given, GivenHash> given;
  for (size_t k = 0; k < routes.routes.size() && k < route_chunks.size(); ++k) {
    const int reader = routes.routes[k].reader;
    for (const ChunkRef& c : route_chunks[k]) {
      auto [it, first] = owner.try_emplace(c.id, Owner{reader, k});
      if (first || it->second.reader == reader) continue;
      if (given.insert({c.id, reader}).second) {
        out.push_back({c, it->second.reader, reader, it->second.route, k, out.size()});
      }
    }
  }
  return out;
}

std::vector<std::vector<HandoffWindow>> ScheduleHandoffs(const LoadRoutes& routes,
                                                         const std::vector<std::vector<ChunkRef>>& route_chunks,
                                                         const std::vector<ChunkHandoff>& handoffs, int ranks,
                                                         uint64_t window_bytes) {
  const size_t n = routes.routes.size();
  // The window of each route: a window closes after the route whose
  // hand-offs bring it to window_bytes.
  std::vector<uint64_t> given_at(n, 0);
  for (const ChunkHandoff& h : handoffs) given_at[h.route] += h.chunk.raw_len;
  std::vector<size_t> window_of(n, 0);
  std::vector<HandoffWindow> shape(1);  // routes_end and exchange, the same for every rank
  uint64_t in_window = 0;
  for (size_t k = 0; k < n; ++k) {
    window_of[k] = shape.size() - 1;
    in_window += given_at[k];
    if (in_window >= window_bytes && k + 1 < n) {
      shape.back().routes_end = k + 1;
      shape.emplace_back();
      in_window = 0;
    }
  }
  shape.back().routes_end = n;
  for (const ChunkHandoff& h : handoffs) shape[window_of[h.route]].exchange = true;
  std::vector<std::vector<HandoffWindow>> out(static_cast<size_t>(std::max(ranks, 0)), shape);
  auto valid = [&](int r) { return r >= 0 && r < ranks; };
  for (const ChunkHandoff& h : handoffs) {
    const size_t w = window_of[h.route];
    if (valid(h.from)) out[h.from][w].handoffs.push_back(h);
    if (valid(h.to) && h.to != h.from) out[h.to][w].handoffs.push_back(h);
  }
  // What each rank holds, from when, and until its last use: a chunk it
  // owns from its first route needing it (so the store is read once), one
  // handed to it from the window it arrives in.
  struct Held {
    ChunkRef chunk;
    size_t last = 0;
  };
  using HeldMap = std::unordered_map<ChunkId, Held, ChunkIdHash>;
  std::vector<HeldMap> held(out.size());
  for (const ChunkHandoff& h : handoffs) {
    if (valid(h.from)) {
      auto [it, first] = held[h.from].try_emplace(h.chunk.id, Held{h.chunk, window_of[h.route]});
      if (first) out[h.from][window_of[h.owner_route]].hold.push_back(h.chunk);
      it->second.last = std::max(it->second.last, window_of[h.route]);
    }
    if (valid(h.to)) held[h.to].try_emplace(h.chunk.id, Held{h.chunk, window_of[h.route]});
  }
  for (size_t k = 0; k < n && k < route_chunks.size(); ++k) {
    const int reader = routes.routes[k].reader;
    if (!valid(reader) || held[reader].empty()) continue;
    for (const ChunkRef& c : route_chunks[k]) {
      auto it = held[reader].find(c.id);
      if (it != held[reader].end()) it->second.last = std::max(it->second.last, window_of[k]);
    }
  }
  // Released in a fixed order (the hand-offs'), so every run is the same.
  for (const ChunkHandoff& h : handoffs) {
    for (int r : {h.from, h.to}) {
      if (!valid(r)) continue;
      auto it = held[r].find(h.chunk.id);
      if (it == held[r].end()) continue;  // released already
      out[r][it->second.last].release.push_back(it->second.chunk);
      held[r].erase(it);
    }
  }
  return out;
}

namespace {

// PlanLoadForRanks's `near`: each route's reader chosen again, among the
// needers whose nearer tier holds every chunk of the route when any does.
void PreferNearReaders(LoadRoutes& routes, const std::vector<std::vector<ChunkRef>>& chunks,
                       const std::vector<std::vector<PlanEntry>>& plans,
                       const std::function<const TensorRecord*(std::string_view)>& find,
                       const std::vector<std::vector<uint32_t>>& near) {
  // The saving ranks of each chunk of the tensors the routes read.
  std::unordered_map<ChunkId, std::vector<uint32_t>, ChunkIdHash> savers;
  std::unordered_set<const TensorRecord*> indexed;
  for (const LoadRoute& route : routes.routes) {
    if (route.needers.empty()) continue;
    const PlanEntry& e = plans[route.needers.front().first][route.needers.front().second];
    const size_t cut = e.name.find('\0');
    const TensorRecord* t = cut == std::string::npos ? nullptr : find(std::string_view(e.name).substr(0, cut));
    if (t == nullptr || !indexed.insert(t).second) continue;
    for (const ShardRecord& sh : t->shards) {
      for (const ChunkRef& c : sh.chunks) {
        std::vector<uint32_t>& s = savers[c.id];
        s.insert(s.end(), sh.ranks.begin(), sh.ranks.end());
      }
    }
  }
  std::vector<std::unordered_set<uint32_t>> holds(plans.size());
  for (size_t r = 0; r < near.size() && r < holds.size(); ++r) holds[r].insert(near[r].begin(), near[r].end());
  auto holds_all = [&](int r, const std::vector<ChunkRef>& of) {
    if (of.empty()) return false;
    for (const ChunkRef& c : of) {
      auto it = savers.find(c.id);
      if (it == savers.end()) return false;
      if (std::none_of(it->second.begin(), it->second.end(), [&](uint32_t s) { return holds[r].count(s) > 0; })) {
        return false;
      }
    }
    return true;
  };
  std::fill(routes.bytes_per_rank.begin(), routes.bytes_per_rank.end(), 0);
  for (size_t k = 0; k < routes.routes.size(); ++k) {
    LoadRoute& route = routes.routes[k];
    int best = -1, any = -1;
    for (const auto& [r, i] : route.needers) {
      if (any < 0 || routes.bytes_per_rank[r] < routes.bytes_per_rank[any]) any = r;
      if (k < chunks.size() && holds_all(r, chunks[k]) &&
          (best < 0 || routes.bytes_per_rank[r] < routes.bytes_per_rank[best])) {
        best = r;
      }
    }
    if (any >= 0) route.reader = best >= 0 ? best : any;
    routes.bytes_per_rank[route.reader] += route.bytes;
  }
}

}  // namespace

std::vector<RankLoadPlan> PlanLoadForRanks(const std::vector<std::vector<PlanEntry>>& plans,
                                           const std::function<const TensorRecord*(std::string_view)>& find,
                                           uint64_t window_bytes, const std::vector<std::vector<uint32_t>>& near) {
  LoadRoutes routes = AssignLoadReaders(plans);
  const int ranks = static_cast<int>(plans.size());
  std::vector<std::vector<HandoffWindow>> windows;
  if (find) {
    const auto chunks = ChunksOfRoutes(routes, plans, find);
    if (std::any_of(near.begin(), near.end(), [](const std::vector<uint32_t>& n) { return !n.empty(); })) {
      PreferNearReaders(routes, chunks, plans, find, near);
    }
    windows = ScheduleHandoffs(routes, chunks, AssignChunkHandoffs(routes, chunks), ranks, window_bytes);
  } else {
    windows.assign(plans.size(), std::vector<HandoffWindow>{HandoffWindow{routes.routes.size()}});
  }
  std::vector<RankLoadPlan> out(plans.size());
  for (size_t r = 0; r < out.size(); ++r) {
    out[r].unique_bytes = routes.unique_bytes;
    out[r].needed_bytes = routes.needed_bytes;
    out[r].fetch_bytes = routes.bytes_per_rank[r];
  }
  // Each route to the ranks needing it (needers come in rank order, so
  // each rank's entries on a route are adjacent).
  for (size_t k = 0; k < routes.routes.size(); ++k) {
    const LoadRoute& route = routes.routes[k];
    std::vector<int> peers;
    for (const auto& [r, i] : route.needers) {
      if (r != route.reader && (peers.empty() || peers.back() != r)) peers.push_back(r);
    }
    for (const auto& [r, i] : route.needers) {
      std::vector<RankRoute>& mine = out[r].routes;
      if (mine.empty() || mine.back().route != k) {
        mine.push_back({k, route.reader, route.bytes, {}, r == route.reader ? peers : std::vector<int>{}});
      }
      mine.back().entries.push_back(i);
    }
  }
  // Each window's end, counted in the rank's own routes.
  for (size_t r = 0; r < out.size(); ++r) {
    out[r].windows = std::move(windows[r]);
    size_t at = 0;
    for (HandoffWindow& w : out[r].windows) {
      while (at < out[r].routes.size() && out[r].routes[at].route < w.routes_end) ++at;
      w.routes_end = at;
    }
  }
  return out;
}

}  // namespace ckptfs
