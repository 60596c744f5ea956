// Simulated multi-host histories (simulation.h).
#include "simulation.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <thread>
#include <utility>

#include <unistd.h>

#include "backend/backend.h"
#include "ckpt/collective.h"
#include "ckpt/communicator.h"
#include "ckpt/layout.h"
#include "ckpt/repository.h"
#include "ckpt/repository_impl.h"
#include "store/pack.h"

namespace ckptfs::sim {
namespace {

uint64_t SplitMix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// A small seeded generator for the driver's choices.
class Choices {
 public:
  explicit Choices(uint64_t seed) : state_(SplitMix(seed)) {}
  uint64_t Next() { return state_ = SplitMix(state_); }
  uint64_t Below(uint64_t n) { return n ? Next() % n : 0; }
  bool Chance(double p) { return static_cast<double>(Next() >> 11) * 0x1.0p-53 < p; }

 private:
  uint64_t state_;
};

// The bytes a version holds, a function of its id: "w" (f32 rows, each
// rank of a save putting its rows) and "base" (shared by every third
// version, so that saves deduplicate against each other).
constexpr uint64_t kRows = 8, kCols = 4096, kBaseBytes = 96 << 10;
std::vector<std::byte> Bytes(uint64_t label, size_t n) {
  std::vector<std::byte> out(n);
  uint64_t s = SplitMix(label);
  for (size_t i = 0; i < n; i += 8) {
    s = SplitMix(s);
    std::memcpy(out.data() + i, &s, std::min<size_t>(8, n - i));
  }
  return out;
}
std::vector<std::byte> WeightsOf(uint64_t version) { return Bytes(version * 2 + 1, kRows * kCols * 4); }
std::vector<std::byte> BaseOf(uint64_t version) { return Bytes((version % 3) * 2 + 1000000, kBaseBytes); }

// The fault-injecting store of one host: the shared store seen through a
// seeded plan of faults. A crash makes every later request of this host
// fail (its process is gone); a new incarnation of the host gets a new
// wrapper.
class FaultyStore final : public BackendWrapper {
 public:
  FaultyStore(std::shared_ptr<Backend> inner, uint64_t seed, const SimOptions& options)
      : BackendWrapper(std::move(inner)), seed_(seed), options_(options) {}

  enum class Fault { kNone, kBefore, kAfter, kThrottle, kCrash };
  // Faults are drawn only while armed (the driver arms them around an
  // operation) and never while quiet.
  void set_armed(bool armed) { armed_ = armed; }
  // The next operation of this host crashes at one of its first requests.
  void ArmCrash(uint64_t at_request) { crash_at_ = requests_.load() + at_request; }
  // A crash armed for an operation that made fewer requests does not wait
  // for the next one.
  void DisarmCrash() { crash_at_ = UINT64_MAX; }
  bool dead() const { return dead_.load(); }
  uint64_t injected() const { return injected_.load(); }

  Fault Draw(bool write) {
    const uint64_t n = requests_.fetch_add(1);
    if (dead_) return Fault::kCrash;
    if (n == crash_at_.load()) {
      dead_ = true;
      injected_.fetch_add(1);
      return Fault::kCrash;
    }
    if (!armed_.load() || !options_.faults) return Fault::kNone;
    const uint64_t draw = SplitMix(seed_ ^ SplitMix(n));
    const double u = static_cast<double>(draw >> 11) * 0x1.0p-53;
    // A slow request (1 in 100, up to 20 ms): background refreshes of
    // locks and leases, and other hosts' threads, move on meanwhile.
    if ((draw & 0xff) < 3) std::this_thread::sleep_for(std::chrono::milliseconds(1 + (draw >> 8) % 20));
    Fault f = Fault::kNone;
    if (u < options_.fail_before) {
      f = Fault::kBefore;
    } else if (u < options_.fail_before + options_.throttle) {
      f = Fault::kThrottle;
    } else if (write && u < options_.fail_before + options_.throttle + options_.fail_after) {
      f = Fault::kAfter;
    }
    if (f != Fault::kNone) injected_.fetch_add(1);
    return f;
  }
  // The faults injected since the last call, described (for the history).
  std::vector<std::string> TakeFaults() {
    std::lock_guard lock(log_mu_);
    return std::exchange(log_, {});
  }
  void Note(Fault f, std::string_view what) {
    static const char* names[] = {"", "failed before", "failed after", "throttled", "crashed at"};
    std::lock_guard lock(log_mu_);
    if (log_.size() < kMaxLog) log_.push_back(std::string(names[static_cast<int>(f)]) + " " + std::string(what));
  }
  static Status Injected(Fault f, std::string_view what) {
    switch (f) {
      case Fault::kCrash: return Status::IOError("simulated host crashed before " + std::string(what));
      case Fault::kThrottle: return Status::IOError("503 SlowDown (injected) on " + std::string(what));
      case Fault::kAfter: return Status::IOError("connection lost after " + std::string(what) + " took effect (injected)");
      default: return Status::IOError("connection lost before " + std::string(what) + " (injected)");
    }
  }

  // Writes: a fault after the write is reported once the write took effect.
  template <class Op>
  Status Write(std::string_view what, const Op& op) {
    const Fault f = Draw(true);
    if (f == Fault::kNone) return op();
    Note(f, what);
    if (f != Fault::kAfter) return Injected(f, what);
    Status st = op();
    return st.ok() ? Injected(f, what) : st;
  }
  template <class Op>
  auto Read(std::string_view what, const Op& op) -> decltype(op()) {
    const Fault f = Draw(false);
    if (f != Fault::kNone) {
      Note(f, what);
      return Injected(f, what);
    }
    return op();
  }

  Result<std::unique_ptr<ObjectWriter>> Create(std::string_view key) override;
  Status Put(std::string_view key, std::span<const std::byte> data) override {
    return Write("PUT " + std::string(key), [&] { return inner().Put(key, data); });
  }
  Status PutIfAbsent(std::string_view key, std::span<const std::byte> data) override {
    return Write("conditional PUT " + std::string(key), [&] { return inner().PutIfAbsent(key, data); });
  }
  Status ReadRange(std::string_view key, uint64_t offset, std::span<std::byte> out) override {
    return Read("GET " + std::string(key), [&] { return inner().ReadRange(key, offset, out); });
  }
  Result<std::string> ReadAll(std::string_view key, uint64_t max_bytes) override {
    return Read("GET " + std::string(key), [&] { return inner().ReadAll(key, max_bytes); });
  }
  Result<uint64_t> Size(std::string_view key) override {
    return Read("HEAD " + std::string(key), [&] { return inner().Size(key); });
  }
  Result<std::string> Tag(std::string_view key) override {
    return Read("HEAD " + std::string(key), [&] { return inner().Tag(key); });
  }
  Result<std::vector<std::string>> List(std::string_view prefix) override {
    CKPT_ASSIGN_OR_RETURN(auto listed, ListTagged(prefix));
    std::vector<std::string> keys;
    keys.reserve(listed.size());
    for (auto& o : listed) keys.push_back(std::move(o.key));
    return keys;
  }
  // A listing comes in pages, as S3 sends it: each page is a request of its
  // own (its own fault draw), and the next one starts after the last key of
  // the one before. So a listing is no snapshot: a key put or deleted while
  // it runs may or may not be in it, as on S3, where only each page is
  // current. Pages hold 10 to 100 keys (S3's 1,000 would leave the small
  // listings of a simulation in one page).
  Result<std::vector<ListedObject>> ListTagged(std::string_view prefix) override {
    const size_t page = 10 + SplitMix(seed_ ^ requests_.load() ^ 0x9e37) % 91;
    std::vector<ListedObject> out;
    std::string after;
    for (;;) {
      const std::string what = "LIST " + std::string(prefix) + (after.empty() ? "" : " after " + after);
      CKPT_ASSIGN_OR_RETURN(auto all, Read(what, [&] { return inner().ListTagged(prefix); }));
      auto from = after.empty() ? all.begin()
                                : std::upper_bound(all.begin(), all.end(), after,
                                                   [](const std::string& k, const ListedObject& o) { return k < o.key; });
      const size_t n = std::min<size_t>(page, static_cast<size_t>(all.end() - from));
      for (size_t i = 0; i < n; ++i) out.push_back(std::move(from[i]));
      if (static_cast<size_t>(all.end() - from) <= page) return out;
      after = out.back().key;
      ++pages_;
      std::this_thread::yield();  // other threads of the process move on between pages
    }
  }
  uint64_t pages() const { return pages_.load(); }
  Status Delete(std::string_view key) override {
    return Write("DELETE " + std::string(key), [&] { return inner().Delete(key); });
  }

 private:
  static constexpr size_t kMaxLog = 50;
  const uint64_t seed_;
  const SimOptions& options_;
  std::atomic<uint64_t> requests_{0};
  std::atomic<uint64_t> crash_at_{UINT64_MAX};
  std::atomic<bool> armed_{false};
  std::atomic<bool> dead_{false};
  std::atomic<uint64_t> injected_{0};
  std::atomic<uint64_t> pages_{0};  // listing pages after the first
  std::mutex log_mu_;
  std::vector<std::string> log_;  // guarded by log_mu_
};

// An object written through a FaultyStore: its commit is the write that
// may fail before or after it takes effect.
class FaultyWriter final : public ObjectWriter {
 public:
  FaultyWriter(FaultyStore& store, std::unique_ptr<ObjectWriter> inner, std::string key)
      : store_(store), inner_(std::move(inner)), key_(std::move(key)) {}
  Status Append(std::span<const std::byte> data) override {
    if (store_.dead()) return FaultyStore::Injected(FaultyStore::Fault::kCrash, "an upload of " + key_);
    return inner_->Append(data);
  }
  Status Commit() override {
    return store_.Write("upload of " + key_, [&] { return inner_->Commit(); });
  }
  void Abort() override { inner_->Abort(); }
  uint64_t size() const override { return inner_->size(); }

 private:
  FaultyStore& store_;
  std::unique_ptr<ObjectWriter> inner_;
  std::string key_;
};

Result<std::unique_ptr<ObjectWriter>> FaultyStore::Create(std::string_view key) {
  const Fault f = Draw(false);
  if (f != Fault::kNone) return Injected(f, "an upload of " + std::string(key));
  CKPT_ASSIGN_OR_RETURN(auto w, inner().Create(key));
  return std::unique_ptr<ObjectWriter>(new FaultyWriter(*this, std::move(w), std::string(key)));
}

// The process's resident memory, in MiB (0 where /proc is not there).
uint64_t ResidentMiB() {
  FILE* f = std::fopen("/proc/self/statm", "r");
  if (!f) return 0;
  unsigned long long size = 0, resident = 0;
  const int n = std::fscanf(f, "%llu %llu", &size, &resident);
  std::fclose(f);
  return n == 2 ? resident * static_cast<uint64_t>(::sysconf(_SC_PAGESIZE)) >> 20 : 0;
}

std::optional<uint64_t> VersionOf(const CheckpointRecord& rec) {
  for (const auto& [k, v] : rec.tags) {
    if (k == "v") return std::stoull(v);
  }
  return std::nullopt;
}

// What the model allows under one name.
struct NameModel {
  std::set<uint64_t> possible;       // versions that may be the current one
  std::optional<uint64_t> definite;  // the one that surely is
  bool maybe_pending = false;        // a save of it ended with ranks missing: rm before reuse
};

enum class RankState { kNotBegun, kBegun, kPut, kCommitted, kUncertain, kNever };

struct RankPlan {
  int host = 0;
  int incarnation = 0;  // of the host, when the writer was begun
  RankState state = RankState::kNotBegun;
  std::unique_ptr<CheckpointWriter> writer;
  bool will_crash = false;  // abandons before its commit
};

struct SaveInFlight {
  std::string name;
  uint64_t version = 0;
  std::vector<RankPlan> ranks;
};

struct HeldReader {
  std::string name;
  uint64_t version = 0;
  std::unique_ptr<CheckpointReader> reader;
};

struct Host {
  std::string cache_dir;
  std::shared_ptr<FaultyStore> store;
  std::unique_ptr<Repository> repo;
  int incarnation = 0;
  std::vector<HeldReader> held;
};

class Simulation {
 public:
  explicit Simulation(const SimOptions& options) : options_(options), choose_(options.seed) {
    result_.seed = options.seed;
    root_ = std::filesystem::temp_directory_path() /
            ("ckptfs-sim-" + std::to_string(::getpid()) + "-" + std::to_string(options.seed) + "-" +
             std::to_string(SplitMix(reinterpret_cast<uintptr_t>(this)) % 1000000));
  }
  ~Simulation() {
    saves_.clear();
    hosts_.clear();
    copy_repo_.reset();
    std::error_code ec;
    std::filesystem::remove_all(root_, ec);
  }

  SimResult Run() {
    const auto start = std::chrono::steady_clock::now();
    std::filesystem::create_directories(root_);
    store_ = NewMemoryBackend();
    objects_ = NewPrefixedBackend(store_, keys::kObjectsDir);
    // Another store, named apart from the first (a copy refuses a
    // destination that names itself as the source does).
    copy_store_ = NewPrefixedBackend(std::shared_ptr<Backend>(NewMemoryBackend()), "copy");
    RepositoryConfig config;
    config.chunk_size = 64 << 10;
    config.pack_size = 256 << 10;
    if (Status st = Repository::Init(*store_, config); !st.ok()) return Fail("init: " + st.ToString());
    if (Status st = Repository::Init(*copy_store_, config); !st.ok()) return Fail("init of the copy: " + st.ToString());
    hosts_.resize(options_.hosts);
    for (int h = 0; h < options_.hosts; ++h) {
      hosts_[h].cache_dir = (root_ / ("host" + std::to_string(h))).string();
      StartHost(h);
    }
    OpenOptions copy_open = HostOptions((root_ / "copy-host").string());
    auto copy = Repository::Open(copy_store_, copy_open);
    if (!copy.ok()) return Fail("open of the copy: " + copy.status().ToString());
    copy_repo_ = std::move(copy).value();

    // Memory is bounded: what the process holds beyond what it held with
    // every host open may not grow past a bound per host, however many
    // operations run (caches, catalogs' maps, held readers and their
    // leases are all bounded; a leak per operation is not).
    const uint64_t base_mib = ResidentMiB();
    for (int i = 0; i < options_.operations; ++i) {
      Step(i);
      const uint64_t now = ResidentMiB();
      result_.peak_growth_mib = std::max(result_.peak_growth_mib, now > base_mib ? now - base_mib : 0);
    }
    if (options_.max_growth_mib_per_host && base_mib &&
        result_.peak_growth_mib > options_.max_growth_mib_per_host * static_cast<uint64_t>(options_.hosts)) {
      Anomaly("resident memory grew by " + std::to_string(result_.peak_growth_mib) + " MiB over the run, more than " +
              std::to_string(options_.max_growth_mib_per_host) + " MiB per host");
    }
    FinalChecks();
    result_.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    for (const Host& h : hosts_) {
      if (h.store) result_.faults_injected += h.store->injected();
      if (h.store) result_.listing_pages += h.store->pages();
    }
    result_.faults_injected += retired_faults_;
    return std::move(result_);
  }

 private:
  SimResult Fail(const std::string& why) {
    result_.anomalies.push_back(why);
    return std::move(result_);
  }
  void Log(const std::string& line) {
    result_.history.push_back(line);
    if (result_.history.size() > options_.history_lines) result_.history.erase(result_.history.begin());
  }
  void Anomaly(const std::string& what) {
    result_.anomalies.push_back("op " + std::to_string(op_) + ": " + what);
    Log("  ANOMALY: " + what);
  }

  OpenOptions HostOptions(const std::string& cache_dir, int64_t skew_ms = 0) {
    OpenOptions o;
    if (skew_ms != 0) {
      o.wall_clock = [skew_ms] {
        const auto now = std::chrono::duration_cast<std::chrono::milliseconds>(
            std::chrono::system_clock::now().time_since_epoch());
        return static_cast<uint64_t>(now.count() + skew_ms);
      };
    }
    o.cache_dir = cache_dir;
    o.threads = 1;
    o.io_threads = 2;
    o.cache_bytes = 16 << 20;
    o.lock_wait = std::chrono::seconds(5);
    o.lock_stale_after = std::chrono::milliseconds(options_.lock_stale_ms);
    return o;
  }

  // Opens host h (a new incarnation); false while its open fails (it is
  // tried again at its next operation).
  bool StartHost(int h) {
    Host& host = hosts_[h];
    if (host.store) retired_faults_ += host.store->injected();
    if (host.store) result_.listing_pages += host.store->pages();
    host.store = std::make_shared<FaultyStore>(store_, SplitMix(options_.seed * 131 + h * 7919 + host.incarnation),
                                               options_);
    ++host.incarnation;
    host.store->set_armed(true);
    // Each incarnation's clock is off by up to a tenth of the lock stale
    // time, either way: the bound the lease design assumes.
    const int64_t tenth = options_.lock_stale_ms / 10;
    const int64_t skew = options_.faults ? static_cast<int64_t>(choose_.Below(2 * tenth + 1)) - tenth : 0;
    auto r = Repository::Open(host.store, HostOptions(host.cache_dir, skew));
    host.store->set_armed(false);
    if (!r.ok()) {
      Log("host " + std::to_string(h) + " open failed: " + r.status().ToString());
      host.repo.reset();
      if (host.store->dead()) Crash(h);
      return false;
    }
    host.repo = std::move(r).value();
    return true;
  }
  // Host h's process died: its readers, writers and repository go (its
  // threads with them); its catalog directory is kept or wiped, as a lost
  // process or a lost machine leaves it.
  void Crash(int h) {
    Host& host = hosts_[h];
    ++result_.crashes;
    host.held.clear();
    for (auto& s : saves_) {
      for (RankPlan& r : s.ranks) {
        if (r.host == h && r.writer) {
          r.writer.reset();
          if (r.state != RankState::kCommitted && r.state != RankState::kUncertain) r.state = RankState::kNever;
        }
      }
    }
    host.repo.reset();
    const bool wipe = choose_.Chance(0.5);
    if (wipe) {
      std::error_code ec;
      std::filesystem::remove_all(host.cache_dir, ec);
    }
    Log("host " + std::to_string(h) + " crashed" + (wipe ? " and lost its disk" : ""));
  }
  Repository* Live(int h) {
    if (!hosts_[h].repo && !StartHost(h)) return nullptr;
    return hosts_[h].repo.get();
  }

  // ---- the model
  NameModel& Model(const std::string& name) { return names_[name]; }
  void Committed(const std::string& name, uint64_t v) {
    NameModel& m = Model(name);
    m.possible = {v};
    m.definite = v;
  }
  void SeenCurrent(const std::string& name, uint64_t v) {
    NameModel& m = Model(name);
    if (!m.possible.count(v)) {
      Anomaly("'" + name + "' opened as version " + std::to_string(v) +
              ", which the model says is not current (removed, or never committed by every rank)");
    }
    m.possible = {v};
    m.definite = v;
  }
  void MaybeRemoved(const std::string& name) { Model(name).definite.reset(); }
  void Removed(const std::string& name) {
    NameModel& m = Model(name);
    m.possible.clear();
    m.definite.reset();
    m.maybe_pending = false;
  }

  // Reads both tensors of `reader` and compares them with its version's
  // bytes. With `must_read` (the host's faults paused) a failed read is an
  // anomaly; otherwise it counts as a failed operation.
  bool CheckReader(int h, const CheckpointReader& reader, const std::string& what, bool must_read = false) {
    auto v = VersionOf(reader.info());
    if (!v) {
      Anomaly(what + ": a checkpoint without a version tag");
      return false;
    }
    const TensorRecord* w = reader.FindTensor("w");
    const TensorRecord* base = reader.FindTensor("base");
    // A thinned version (gc's thin retention keeps "w") has "w" alone.
    const bool thinned = ThinnedNote(reader.info().tags) != nullptr;
    if (!w || (!base && !thinned) || (base && thinned)) {
      Anomaly(what + ": version " + std::to_string(*v) + (thinned ? " (thinned)" : "") +
              (w && !base ? " lacks a tensor" : " has the wrong tensors"));
      return false;
    }
    std::vector<std::byte> got(kRows * kCols * 4);
    Status st = reader.ReadBytes(*w, 0, got);
    std::vector<std::byte> got_base(thinned ? 0 : kBaseBytes);
    if (st.ok() && base) st = reader.ReadBytes(*base, 0, got_base);
    if (!st.ok()) {
      if (hosts_[h].store && hosts_[h].store->dead()) return false;
      if (must_read) Anomaly(what + " cannot read: " + st.ToString());
      Log("  read failed: " + st.ToString());
      ++result_.failed;
      return false;
    }
    ++result_.reads_checked;
    if (racy_.count(*v)) return true;  // any mix of old and new values; read, so every chunk verified
    if (got != WeightsOf(*v) || (!thinned && got_base != BaseOf(*v))) {
      Anomaly(what + ": bytes other than version " + std::to_string(*v) + "'s");
      return false;
    }
    return true;
  }

  // A save's commit failed. One lost answer must not strand it: with at
  // most one fault injected into its host's requests while it ran (and the
  // host alive), the commit took its rank's part back unless it took
  // effect (the manifest is there), so the rank may commit again. Two
  // faults in a row (the failure, then the take-back's request) may leave
  // the part: the name may then stay pending until rm. `faults_before` is
  // the host's count of injected faults when the commit began.
  void CheckFailedCommit(int h, uint64_t faults_before, const std::string& name, uint32_t rank, uint64_t v) {
    Host& host = hosts_[h];
    const uint64_t faults = host.store && !host.store->dead() ? host.store->injected() - faults_before : UINT64_MAX;
    if (faults > 1) {
      Model(name).maybe_pending = true;
      return;
    }
    auto part = ReadPendingRank(*objects_, name, rank);
    if (!part.ok() || VersionOf(part->header) != v) return;
    if (!objects_->Size(keys::ManifestObject(name)).status().IsNotFound()) return;  // committed after all
    Anomaly("the commit of rank " + std::to_string(rank) + " of '" + name + "' v" + std::to_string(v) + " failed with " +
            std::to_string(faults) + " fault(s) injected and left its part there: the rank stays "
            "'already committed' and the checkpoint pending");
    Model(name).maybe_pending = true;
  }

  // ---- operations
  void Step(int i) {
    op_ = i;
    int h = static_cast<int>(choose_.Below(hosts_.size()));
    const uint64_t kind = choose_.Below(100);
    // Advancing a save runs on the host of one of its unfinished ranks.
    if (kind >= 22 && kind < 40 && !saves_.empty()) {
      std::vector<int> ranks_hosts;
      for (const SaveInFlight& s : saves_) {
        for (const RankPlan& p : s.ranks) {
          if (p.state == RankState::kNotBegun || p.state == RankState::kBegun || p.state == RankState::kPut) {
            ranks_hosts.push_back(p.host);
          }
        }
      }
      if (!ranks_hosts.empty()) h = ranks_hosts[choose_.Below(ranks_hosts.size())];
    }
    const bool crash_now = options_.faults && choose_.Chance(options_.crash);
    const uint64_t crash_at = choose_.Below(12);
    Repository* repo = Live(h);
    if (!repo) return;
    Host& host = hosts_[h];
    if (crash_now) host.store->ArmCrash(crash_at);
    // Four operations in ten run with no request faults, so that long
    // operations (gc makes many requests) also succeed and their success
    // paths meet the faults of other operations.
    armed_ = !choose_.Chance(0.4);
    host.store->set_armed(armed_);
    const auto start = std::chrono::steady_clock::now();
    std::string line = "op " + std::to_string(i) + " host " + std::to_string(h) + ": ";
    if (kind < 3 && options_.racy_sources) {
      line += SaveRacing(h);
    } else if (kind < 22) {
      line += SaveOne(h);
    } else if (kind < 40) {
      line += AdvanceSave(h);
    } else if (kind < 48) {
      line += Remove(h);
    } else if (kind < 53) {
      line += CollectGarbage(h);
    } else if (kind < 57) {
      line += SaveWhileGc(h);
    } else if (kind < 63) {
      line += OpenAndHold(h);
    } else if (kind < 73) {
      line += ReadHeld(h);
    } else if (kind < 80) {
      line += MountRead(h);
    } else if (kind < 82) {
      line += Copy(h);
    } else if (kind < 85) {
      line += RestoreCollective(h);
    } else if (kind < 93) {
      line += Refresh(h);
    } else {
      line += VerifyOne(h);
    }
    if (hosts_[h].store) {
      hosts_[h].store->set_armed(false);
      hosts_[h].store->DisarmCrash();
    }
    ++result_.operations;
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    Log(line + " (" + std::to_string(static_cast<int64_t>(took * 1000)) + " ms)");
    if (hosts_[h].store) {
      for (const auto& f : hosts_[h].store->TakeFaults()) Log("      fault: " + f);
    }
    if (took > options_.deadline_s) Anomaly("the operation took " + std::to_string(took) + " s");
    if (hosts_[h].store && hosts_[h].store->dead()) Crash(h);
  }

  std::string PickName() { return "ckpt-" + std::to_string(choose_.Below(12)); }

  // One rank, begun, put and committed in one operation.
  std::string SaveOne(int h) {
    const std::string name = PickName();
    NameModel& m = Model(name);
    if (InFlight(name)) return "save " + name + ": skipped (a save in flight)";
    Repository& repo = *hosts_[h].repo;
    std::string again;
    // A name taken, or left pending by a save whose ranks did not all
    // commit, is removed first a third of the time and saved again; a
    // name taken is replaced by an overwriting save another third.
    bool overwrite = false;
    if (m.maybe_pending || !m.possible.empty()) {
      const uint64_t choice = choose_.Below(3);
      if (choice == 0) {
        Status st = repo.RemoveCheckpoints({name});
        if (st.ok()) {
          Removed(name);
          again = " (again, after rm)";
        } else if (!st.IsNotFound()) {
          MaybeRemoved(name);
          return Failed("rm " + name + " before saving it again (outcome unknown)", st);
        }
      } else if (choice == 1 && !m.maybe_pending) {
        overwrite = true;
        again = " (overwriting)";
      }
    }
    if (m.maybe_pending) return "save " + name + ": skipped (pending)";
    const uint64_t v = ++next_version_;
    WriterOptions wo;
    wo.tags = {{"v", std::to_string(v)}};
    wo.overwrite = overwrite;
    auto w = repo.BeginCheckpoint(name, wo);
    if (!w.ok()) return Failed("save " + name, w.status());
    const auto weights = WeightsOf(v), base = BaseOf(v);
    Status st = (*w)->PutTensor({"w", DType::kF32, {kRows, kCols}}, weights);
    if (st.ok()) st = (*w)->PutTensor({"base", DType::kU8, {kBaseBytes}}, base);
    if (!st.ok()) return Failed("save " + name + " v" + std::to_string(v), st);
    const uint64_t faults_before = hosts_[h].store->injected();
    auto c = (*w)->Commit().Wait();
    if (c.ok()) {
      Committed(name, v);
      return "save " + name + " v" + std::to_string(v) + again + ": committed";
    }
    // The commit may have taken effect (an overwriting one: the rename may
    // have, or not; the old version stays possible).
    m.possible.insert(v);
    m.definite.reset();
    // (An overwriting save commits under a name of its own, with an
    // attempt the next overwriting save supersedes.)
    if (!overwrite) CheckFailedCommit(h, faults_before, name, 0, v);
    return Failed("save " + name + " v" + std::to_string(v) + again + " (outcome unknown)", c.status());
  }

  // A save on this host and a gc with retention on another, at once: gc
  // waits for the save's lock or the save for gc's, and gc never removes a
  // chunk the save deduplicated against. Both results go into the model
  // once both are done.
  std::string SaveWhileGc(int h) {
    FinishSaves();
    if (!saves_.empty() || !Live(h)) return "save while gc: skipped (a save in flight)";
    const std::string name = PickName();
    NameModel& m = Model(name);
    if (m.maybe_pending || !m.possible.empty()) return "save " + name + " while gc: skipped (name taken)";
    const int g = static_cast<int>((h + 1 + choose_.Below(hosts_.size() - 1)) % hosts_.size());
    if (g == h || !Live(g)) return "save while gc: no other host";
    Host& gc_host = hosts_[g];
    gc_host.store->set_armed(armed_);
    GcOptions gc;
    gc.retention.keep_last = 3 + choose_.Below(4);
    if (choose_.Chance(0.5)) {  // thinning the older ones while the save runs
      gc.retention.thin_older_than = 1 + choose_.Below(2);
      gc.retention.thin_keep = {"w"};
    }
    const uint64_t v = ++next_version_;
    Result<GcReport> collected = Status::Internal("not run");
    std::thread gc_thread([&] { collected = gc_host.repo->CollectGarbage(gc); });
    Status saved;
    {
      Repository& repo = *hosts_[h].repo;
      WriterOptions wo;
      wo.tags = {{"v", std::to_string(v)}};
      auto w = repo.BeginCheckpoint(name, wo);
      saved = w.status();
      if (saved.ok()) saved = (*w)->PutTensor({"w", DType::kF32, {kRows, kCols}}, WeightsOf(v));
      if (saved.ok()) saved = (*w)->PutTensor({"base", DType::kU8, {kBaseBytes}}, BaseOf(v));
      bool committing = saved.ok();
      const uint64_t faults_before = hosts_[h].store->injected();
      if (committing) saved = (*w)->Commit().Wait().status();
      if (committing && !saved.ok()) {
        m.possible.insert(v);  // the commit may have taken effect
        m.definite.reset();
        CheckFailedCommit(h, faults_before, name, 0, v);
      }
    }
    gc_thread.join();
    gc_host.store->set_armed(false);
    gc_host.store->DisarmCrash();
    std::string line = "save " + name + " v" + std::to_string(v) + " while host " + std::to_string(g) + " collects: ";
    if (collected.ok()) {
      for (const auto& removed : collected->removed) Removed(removed);
      line += "gc removed " + std::to_string(collected->removed.size()) + ", " +
              std::to_string(collected->packs_deleted) + " packs deleted; ";
    } else {
      for (auto& [n, model] : names_) model.definite.reset();
      line += Failed("gc", collected.status()) + "; ";
    }
    if (saved.ok()) {
      const bool removed_now = collected.ok() && std::count(collected->removed.begin(), collected->removed.end(), name);
      if (!removed_now) Committed(name, v);
      line += "committed";
    } else {
      line += Failed("save", saved);
    }
    if (gc_host.store->dead()) Crash(g);
    return line;
  }

  // Drives every save in flight to its end, rank step by rank step, as
  // the job would before it moves on (each step logged as an operation of
  // its own).
  void FinishSaves() {
    for (int round = 0; round < 12 && !saves_.empty(); ++round) {
      std::vector<int> hosts;
      for (SaveInFlight& f : saves_) {
        for (RankPlan& p : f.ranks) {
          if (p.state == RankState::kNotBegun || p.state == RankState::kBegun || p.state == RankState::kPut) {
            hosts.push_back(p.host);
          }
        }
      }
      for (int host : hosts) {
        if (!Live(host)) {
          // The rank's host is down: its rank never commits.
          for (SaveInFlight& f : saves_) {
            for (RankPlan& p : f.ranks) {
              if (p.host == host && p.state != RankState::kCommitted && p.state != RankState::kUncertain) {
                p.writer.reset();
                p.state = RankState::kNever;
              }
            }
            Settle(f);
          }
          saves_.erase(std::remove_if(saves_.begin(), saves_.end(), [](const SaveInFlight& x) { return x.ranks.empty(); }),
                       saves_.end());
          continue;
        }
        hosts_[host].store->set_armed(armed_);
        Log("  (finishing saves) host " + std::to_string(host) + ": " + AdvanceSave(host));
        hosts_[host].store->set_armed(false);
        if (hosts_[host].store->dead()) Crash(host);
      }
    }
  }

  // Training code writing its tensors while a save reads them: another
  // thread rewrites the "base" tensor's bytes all through the puts. The
  // checkpoint holds some mix of old and new values (so its bytes are not
  // checked: it is recorded as racy), but no chunk it stores may fail its
  // id: a later version with the same base deduplicates against what it
  // stored and must read back exactly.
  std::string SaveRacing(int h) {
    const std::string name = "racy-" + std::to_string(choose_.Below(3));
    Repository& repo = *hosts_[h].repo;
    Status removed = repo.RemoveCheckpoints({name});
    if (removed.ok()) Removed(name);
    if (!removed.ok() && !removed.IsNotFound()) {
      MaybeRemoved(name);
      return Failed("racy save " + name + ": rm", removed);
    }
    const uint64_t v = ++next_version_;
    racy_.insert(v);
    std::vector<std::byte> base = BaseOf(v);
    std::atomic<bool> stop{false};
    std::thread writer([&] {
      uint64_t x = v;
      while (!stop.load(std::memory_order_relaxed)) {
        x = SplitMix(x);
        volatile std::byte* p = base.data() + x % base.size();
        *p = std::byte(x >> 56);
      }
    });
    WriterOptions wo;
    wo.tags = {{"v", std::to_string(v)}};
    Status st;
    auto w = repo.BeginCheckpoint(name, wo);
    st = w.status();
    if (st.ok()) st = (*w)->PutTensor({"w", DType::kF32, {kRows, kCols}}, WeightsOf(v));
    if (st.ok()) st = (*w)->PutTensor({"base", DType::kU8, {kBaseBytes}}, base);
    stop = true;
    writer.join();
    if (!st.ok()) return Failed("racy save " + name, st);
    const uint64_t faults_before = hosts_[h].store->injected();
    auto c = (*w)->Commit().Wait();
    if (c.ok()) {
      Committed(name, v);
      return "racy save " + name + " v" + std::to_string(v) + ": committed";
    }
    Model(name).possible.insert(v);  // the commit may have taken effect
    CheckFailedCommit(h, faults_before, name, 0, v);
    return Failed("racy save " + name + " (outcome unknown)", c.status());
  }

  bool InFlight(const std::string& name) const {
    return std::any_of(saves_.begin(), saves_.end(), [&](const SaveInFlight& s) { return s.name == name; });
  }

  // A save of 2 or 3 ranks on different hosts, advanced one rank step per
  // operation: begin, put, commit (or, for a crashing rank, nothing).
  std::string AdvanceSave(int h) {
    if (saves_.size() < 2 && choose_.Chance(0.35)) {
      const std::string name = PickName();
      if (Model(name).maybe_pending || InFlight(name)) return "collective save " + name + ": skipped (pending)";
      SaveInFlight s;
      s.name = name;
      s.version = ++next_version_;
      const size_t world = 2 + choose_.Below(2);
      for (size_t r = 0; r < world; ++r) {
        RankPlan p;
        p.host = static_cast<int>(choose_.Below(hosts_.size()));
        p.will_crash = choose_.Chance(0.1);
        s.ranks.push_back(std::move(p));
      }
      saves_.push_back(std::move(s));
      return "plan save " + name + " v" + std::to_string(saves_.back().version) + " of " + std::to_string(world) +
             " ranks";
    }
    if (saves_.empty()) return "no save in flight";
    // An unfinished rank that runs on this host, of any save in flight.
    for (SaveInFlight& s : saves_) {
    for (size_t r = 0; r < s.ranks.size(); ++r) {
      RankPlan& p = s.ranks[r];
      if (p.host != h || p.state == RankState::kCommitted || p.state == RankState::kUncertain ||
          p.state == RankState::kNever) {
        continue;
      }
      std::string what = "save " + s.name + " v" + std::to_string(s.version) + " rank " + std::to_string(r);
      Repository& repo = *hosts_[h].repo;
      if (p.state == RankState::kNotBegun) {
        WriterOptions wo;
        wo.rank = static_cast<uint32_t>(r);
        wo.world_size = static_cast<uint32_t>(s.ranks.size());
        wo.tags = {{"v", std::to_string(s.version)}};
        auto w = repo.BeginCheckpoint(s.name, wo);
        if (!w.ok()) {
          p.state = RankState::kNever;
          what = Failed(what + " begin", w.status());
        } else {
          p.writer = std::move(w).value();
          p.incarnation = hosts_[h].incarnation;
          p.state = RankState::kBegun;
          what += ": begun";
        }
      } else if (p.state == RankState::kBegun) {
        const auto weights = WeightsOf(s.version);
        const uint64_t world = s.ranks.size(), begin = r * kRows / world, end = (r + 1) * kRows / world;
        HostSource src(std::span<const std::byte>(weights).subspan(begin * kCols * 4, (end - begin) * kCols * 4));
        Status st = p.writer->PutShard({"w", DType::kF32, {kRows, kCols}}, Region::OfBox(Box{{begin, 0}, {end - begin, kCols}}), src);
        if (st.ok() && r == 0) st = p.writer->PutTensor({"base", DType::kU8, {kBaseBytes}}, BaseOf(s.version));
        if (!st.ok()) {
          p.writer.reset();
          p.state = RankState::kNever;
          what = Failed(what + " put", st);
        } else {
          p.state = RankState::kPut;
          what += ": put";
        }
      } else if (p.will_crash) {
        p.writer.reset();  // the rank's process died before its commit
        p.state = RankState::kNever;
        what += ": rank died before its commit";
      } else {
        const uint64_t faults_before = hosts_[h].store->injected();
        auto c = p.writer->Commit().Wait();
        p.writer.reset();
        p.state = c.ok() ? RankState::kCommitted : RankState::kUncertain;
        if (!c.ok()) CheckFailedCommit(h, faults_before, s.name, static_cast<uint32_t>(r), s.version);
        what = c.ok() ? what + ": committed" + (c->checkpoint_visible ? " (visible)" : "")
                      : Failed(what + " commit (outcome unknown)", c.status());
      }
      Settle(s);
      saves_.erase(std::remove_if(saves_.begin(), saves_.end(), [](const SaveInFlight& x) { return x.ranks.empty(); }),
                   saves_.end());
      return what;
    }
    }
    return "no rank of a save in flight on this host";
  }
  // A save every rank of which is done goes into the model and leaves the
  // list (its ranks cleared).
  void Settle(SaveInFlight& s) {
    bool all_done = true, all_committed = true, any_never = false;
    for (const RankPlan& p : s.ranks) {
      const bool done = p.state == RankState::kCommitted || p.state == RankState::kUncertain || p.state == RankState::kNever;
      all_done &= done;
      all_committed &= p.state == RankState::kCommitted;
      any_never |= p.state == RankState::kNever;
    }
    if (!all_done) return;
    NameModel& m = Model(s.name);
    if (all_committed) {
      Committed(s.name, s.version);
    } else if (any_never) {
      // Never visible; its pending ranks stay until rm.
      m.maybe_pending = true;
      never_.insert(s.version);
    } else {
      m.possible.insert(s.version);
      m.definite.reset();
      m.maybe_pending = true;  // may also stay pending
    }
    s.ranks.clear();
  }

  std::string Remove(int h) {
    const std::string name = PickName();
    if (InFlight(name)) return "rm " + name + ": skipped (a save in flight)";
    Status st = hosts_[h].repo->RemoveCheckpoints({name});
    if (st.ok()) {
      Removed(name);
      return "rm " + name + ": removed";
    }
    if (st.IsNotFound()) return "rm " + name + ": " + st.message();
    MaybeRemoved(name);
    return Failed("rm " + name + " (outcome unknown)", st);
  }

  std::string CollectGarbage(int h) {
    // gc waits for every save in flight (their shared locks), and in this
    // driver a save advances only between operations: it would wait out
    // its lock_wait.
    for (const SaveInFlight& s : saves_) {
      for (const RankPlan& p : s.ranks) {
        if (p.state == RankState::kBegun || p.state == RankState::kPut) return "gc: skipped (a save in flight)";
      }
    }
    GcOptions gc;
    if (choose_.Chance(0.7)) {
      gc.retention.keep_last = 3 + choose_.Below(4);
      gc.retention.allow_removing_newest = false;
    }
    if (choose_.Chance(0.3)) {  // thin retention: the older ones keep "w"
      gc.retention.thin_older_than = 1 + choose_.Below(3);
      gc.retention.thin_keep = {"w"};
    }
    auto r = hosts_[h].repo->CollectGarbage(gc);
    if (!r.ok()) {
      if (gc.retention.keep_last) {
        for (auto& [name, m] : names_) m.definite.reset();
      }
      return Failed("gc", r.status());
    }
    std::string removed;
    for (const auto& name : r->removed) {
      Removed(name);
      removed += " " + name;
    }
    std::string thinned;
    for (const auto& name : r->thinned) thinned += " " + name;
    return "gc: removed" + (removed.empty() ? std::string(" nothing") : removed) +
           (thinned.empty() ? std::string() : ", thinned" + thinned) + ", " + std::to_string(r->packs_deleted) +
           " packs deleted";
  }

  // Opens a name and checks what it got against the model; NotFound is an
  // anomaly for a name whose commit returned and that nothing removed.
  std::unique_ptr<CheckpointReader> OpenChecked(int h, const std::string& name, bool lease, std::string* line) {
    ReadOptions ro;
    ro.lease = lease;
    auto r = hosts_[h].repo->OpenCheckpoint(name, ro);
    if (!r.ok()) {
      if (r.status().IsNotFound() && Model(name).definite && !hosts_[h].store->dead()) {
        Anomaly("'" + name + "' (version " + std::to_string(*Model(name).definite) +
                ", committed and not removed) not found: " + r.status().ToString());
      }
      *line += r.status().IsNotFound() ? ": not found" : Failed("", r.status());
      return nullptr;
    }
    auto v = VersionOf((*r)->info());
    if (v) {
      if (never_.count(*v)) Anomaly("'" + name + "' opened as version " + std::to_string(*v) + ", a rank of which never committed");
      SeenCurrent(name, *v);
      *line += ": version " + std::to_string(*v);
    }
    return std::move(r).value();
  }

  std::string OpenAndHold(int h) {
    const std::string name = PickName();
    std::string line = "open " + name;
    auto reader = OpenChecked(h, name, true, &line);
    if (!reader) return line;
    if (!CheckReader(h, *reader, "reader of '" + name + "'")) return line + ", read failed";
    if (hosts_[h].held.size() >= 2) hosts_[h].held.erase(hosts_[h].held.begin());
    hosts_[h].held.push_back({name, *VersionOf(reader->info()), std::move(reader)});
    return line + ", held";
  }

  // A reader held across whatever happened since reads its version still.
  std::string ReadHeld(int h) {
    Host& host = hosts_[h];
    if (host.held.empty()) return "no reader held";
    HeldReader held = std::move(host.held.front());
    host.held.erase(host.held.begin());
    // A held reader reads its version's bytes, or fails clearly: its lease,
    // refreshed in the background, may have lapsed while refreshes failed.
    const bool ok = CheckReader(h, *held.reader, "reader of '" + held.name + "' held since version " +
                                                     std::to_string(held.version));
    return "read held " + held.name + " v" + std::to_string(held.version) + (ok ? ": ok" : ": failed");
  }

  std::string MountRead(int h) {
    const std::string name = PickName();
    std::string line = "mount-read " + name;
    auto view = OpenChecked(h, name, false, &line);
    if (!view) return line;
    auto lease = hosts_[h].repo->LeaseCheckpoint(*view);
    if (!lease.ok()) return line + Failed(", lease", lease.status());
    CheckReader(h, *view, "mount view of '" + name + "'");
    return line + ", read";
  }

  std::string Copy(int h) {
    const std::string name = PickName();
    CopyOptions o;
    o.names = {name};
    auto r = CopyCheckpoints(*hosts_[h].repo, *copy_repo_, o);
    if (r.status().IsAlreadyExists()) {
      // The destination has another checkpoint of that name (an older
      // copy): removed there, and copied again.
      if (Status st = copy_repo_->RemoveCheckpoints({name}); !st.ok()) return Failed("copy " + name + ": rm", st);
      r = CopyCheckpoints(*hosts_[h].repo, *copy_repo_, o);
    }
    if (!r.ok()) return Failed("copy " + name, r.status());
    auto there = copy_repo_->OpenCheckpoint(name);
    if (!there.ok()) {
      Anomaly("'" + name + "' copied but not readable at the destination: " + there.status().ToString());
      return "copy " + name + ": not readable";
    }
    // The destination has no faults: its reader must read.
    CheckReader(h, **there, "copy of '" + name + "'", /*must_read=*/true);
    return "copy " + name + ": " + (r->checkpoints.empty() ? "?" : (r->checkpoints[0].outcome == CopiedCheckpoint::Outcome::kPresent ? "present" : "copied"));
  }

  // A collective restore: 2 or 3 live hosts, each a rank of an in-process
  // group, load rows of "w" of one name together (one rank fetches each
  // chunk, the others receive it). Every rank must get the rows of one and
  // the same version, and one the model allows.
  std::string RestoreCollective(int h) {
    const std::string name = PickName();
    std::vector<int> ranks = {h};
    const size_t world = 2 + choose_.Below(2);
    for (size_t i = 1; i < hosts_.size() && ranks.size() < world; ++i) {
      const int g = static_cast<int>((h + i) % hosts_.size());
      if (Live(g)) ranks.push_back(g);
    }
    if (ranks.size() < 2) return "collective restore " + name + ": no other live host";
    for (int g : ranks) hosts_[g].store->set_armed(armed_);
    auto comms = NewHostGroup(static_cast<int>(ranks.size()));
    std::vector<std::vector<std::byte>> rows(ranks.size());
    std::vector<Result<CollectiveLoadResult>> out(ranks.size(), Status::Internal("not run"));
    std::vector<std::thread> threads;
    for (size_t r = 0; r < ranks.size(); ++r) {
      const uint64_t begin = r * kRows / ranks.size(), end = (r + 1) * kRows / ranks.size();
      rows[r].resize((end - begin) * kCols * 4);
      threads.emplace_back([&, r, begin, end] {
        std::vector<CollectiveTarget> targets = {{{"w", DType::kF32, {kRows, kCols}},
                                                  Region::OfBox(Box{{begin, 0}, {end - begin, kCols}}), rows[r]}};
        out[r] = LoadCollective(*hosts_[ranks[r]].repo, name, targets, *comms[r]);
      });
    }
    for (auto& t : threads) t.join();
    for (int g : ranks) {
      hosts_[g].store->set_armed(false);
      hosts_[g].store->DisarmCrash();
    }
    std::string line = "collective restore " + name + " on " + std::to_string(ranks.size()) + " hosts: ";
    const bool all_ok = std::all_of(out.begin(), out.end(), [](const auto& r) { return r.ok(); });
    bool any_dead = false;
    for (int g : ranks) any_dead |= hosts_[g].store->dead();
    if (!all_ok) {
      const auto bad = std::find_if(out.begin(), out.end(), [](const auto& r) { return !r.ok(); });
      const bool some_ok = std::any_of(out.begin(), out.end(), [](const auto& r) { return r.ok(); });
      if (some_ok && !any_dead) Anomaly("collective restore of '" + name + "': some ranks succeeded, others failed: " + bad->status().ToString());
      line += bad->status().IsNotFound() ? "not found" : Failed("", bad->status());
    } else {
      // The rows together are one version's "w": which one, from rank 0's.
      std::optional<uint64_t> version;
      for (uint64_t v : Model(name).possible) {
        const auto w = WeightsOf(v);
        if (std::equal(rows[0].begin(), rows[0].end(), w.begin())) version = v;
      }
      if (!version) {
        Anomaly("collective restore of '" + name + "': rank 0's rows are no version the model allows");
      } else {
        const auto w = WeightsOf(*version);
        for (size_t r = 0; r < ranks.size(); ++r) {
          const uint64_t begin = r * kRows / ranks.size();
          if (!std::equal(rows[r].begin(), rows[r].end(), w.begin() + begin * kCols * 4)) {
            Anomaly("collective restore of '" + name + "': rank " + std::to_string(r) + " got rows other than version " +
                    std::to_string(*version) + "'s");
          }
        }
        ++result_.reads_checked;
        line += "version " + std::to_string(*version);
      }
    }
    for (int g : ranks) {
      if (g != h && hosts_[g].store->dead()) Crash(g);
    }
    return line;
  }

  std::string Refresh(int h) {
    Status st = hosts_[h].repo->Refresh();
    return st.ok() ? "refresh" : Failed("refresh", st);
  }

  std::string VerifyOne(int h) {
    const std::string name = PickName();
    hosts_[h].store->set_armed(false);
    auto r = hosts_[h].repo->Verify(name);
    if (!r.ok()) return r.status().IsNotFound() ? "verify " + name + ": not found" : Failed("verify " + name, r.status());
    if (!hosts_[h].store->dead()) {
      for (const auto& p : r->problems) Anomaly("verify of '" + name + "': " + p.what + ": " + p.message + WhereIs(p.message));
    }
    return "verify " + name + ": " + (r->ok() ? "ok" : "problems");
  }

  // For a problem naming a chunk: the packs of the store whose index holds
  // it now (what a host's catalog should point at).
  std::string WhereIs(const std::string& message) {
    const size_t at = message.find("chunk ");
    if (at == std::string::npos) return "";
    auto id = ChunkId::FromHex(message.substr(at + 6, 32));
    if (!id) return "";
    std::string where;
    auto keys = store_->List("objects/packs/");
    if (!keys.ok()) return "";
    auto objects = NewPrefixedBackend(store_, "objects");
    for (const auto& key : *keys) {
      std::string pack;
      if (!ParsePackKey(key.substr(8), &pack)) continue;
      auto index = ReadPackIndex(objects.get(), pack);
      if (!index.ok()) continue;
      for (const auto& e : index->entries) {
        if (e.id == *id) where += " " + pack;
      }
    }
    return " [the store's packs holding it:" + (where.empty() ? std::string(" none") : where) + "]";
  }

  std::string Failed(const std::string& what, const Status& st) {
    ++result_.failed;
    if (st.IsNotFound() || st.IsAlreadyExists() || st.code() == StatusCode::kInvalidArgument ||
        st.code() == StatusCode::kFailedPrecondition) {
      return what + ": refused: " + st.message();
    }
    return what + ": error: " + st.message();
  }

  // Faults stop; every host syncs; hosts agree, every checkpoint reads
  // back on two hosts, verify is clean.
  void FinalChecks() {
    op_ = options_.operations;
    saves_.clear();  // unfinished saves: their writers go
    std::map<std::string, uint64_t> first;
    int first_host = -1;
    for (int h = 0; h < static_cast<int>(hosts_.size()); ++h) {
      hosts_[h].held.clear();
      for (int attempt = 0; attempt < 3 && !hosts_[h].repo; ++attempt) StartHost(h);
      if (!hosts_[h].repo) {
        Anomaly("host " + std::to_string(h) + " cannot open the repository with faults stopped");
        continue;
      }
      if (Status st = hosts_[h].repo->Refresh(); !st.ok()) {
        Anomaly("host " + std::to_string(h) + " cannot sync with faults stopped: " + st.ToString());
        continue;
      }
      auto listed = hosts_[h].repo->ListCheckpoints();
      if (!listed.ok()) {
        Anomaly("host " + std::to_string(h) + " cannot list: " + listed.status().ToString());
        continue;
      }
      std::map<std::string, uint64_t> mine;
      for (const auto& c : *listed) mine[c.name] = VersionOf(c).value_or(0);
      ++result_.operations;
      if (first_host < 0) {
        first = mine;
        first_host = h;
        for (const auto& [name, m] : names_) {
          if (m.definite && !mine.count(name)) {
            Anomaly("after the faults, '" + name + "' (version " + std::to_string(*m.definite) + ") is not listed");
          }
        }
        for (const auto& [name, v] : mine) {
          if (!Model(name).possible.count(v)) {
            Anomaly("after the faults, '" + name + "' is listed as version " + std::to_string(v) + ", not a current one");
          }
        }
      } else if (mine != first) {
        Anomaly("host " + std::to_string(h) + " lists other checkpoints than host " + std::to_string(first_host));
      }
    }
    if (first_host < 0) return;
    for (int h : {first_host, static_cast<int>(hosts_.size()) - 1}) {
      if (!hosts_[h].repo) continue;
      for (const auto& [name, v] : first) {
        std::string line;
        auto reader = OpenChecked(h, name, true, &line);
        if (!reader) {
          Anomaly("after the faults, host " + std::to_string(h) + " cannot open '" + name + "'" + line);
          continue;
        }
        CheckReader(h, *reader, "after the faults, '" + name + "'", /*must_read=*/true);
        ++result_.operations;
      }
    }
    auto verified = hosts_[first_host].repo->Verify(std::nullopt);
    ++result_.operations;
    if (!verified.ok()) {
      Anomaly("verify after the faults failed: " + verified.status().ToString());
    } else {
      for (const auto& p : verified->problems) Anomaly("verify after the faults: " + p.checkpoint + " " + p.what + ": " + p.message);
    }
  }

  const SimOptions& options_;
  Choices choose_;
  SimResult result_;
  std::filesystem::path root_;
  std::shared_ptr<Backend> store_, copy_store_;
  std::shared_ptr<Backend> objects_;  // store_ as a repository's objects (the driver's own look: no faults)
  std::vector<Host> hosts_;
  std::unique_ptr<Repository> copy_repo_;
  std::vector<SaveInFlight> saves_;
  std::map<std::string, NameModel> names_;
  std::set<uint64_t> never_;  // versions a rank of which never committed
  std::set<uint64_t> racy_;   // versions saved while their source changed
  uint64_t next_version_ = 0;
  uint64_t retired_faults_ = 0;
  int op_ = 0;
  bool armed_ = true;  // whether the current operation draws request faults
};

}  // namespace

SimResult RunSimulation(const SimOptions& options) { return Simulation(options).Run(); }

SimResult RunAndShrink(const SimOptions& options) {
  SimResult full = RunSimulation(options);
  if (full.ok()) return full;
  int lo = 0, hi = options.operations;  // a run of hi operations finds an anomaly
  SimResult best = full;
  while (hi - lo > 1) {
    const int mid = lo + (hi - lo) / 2;
    SimOptions shorter = options;
    shorter.operations = mid;
    SimResult r = RunSimulation(shorter);
    if (r.ok()) {
      lo = mid;
    } else {
      hi = mid;
      best = std::move(r);
    }
  }
  return best;
}

}  // namespace ckptfs::sim
