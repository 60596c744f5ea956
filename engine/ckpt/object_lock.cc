#include "ckpt/object_lock.h"
#include "ckpt/layout.h"

#include <unistd.h>


#include "core/json.h"
#include "core/random.h"

namespace ckptfs {

std::string HostName() {
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) return "unknown host";
  return host;
}

uint64_t WallClockUnixMs() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                   std::chrono::system_clock::now().time_since_epoch())
                                   .count());
}

Json ThisProcess() {
  Json j = Json::MakeObject();
  j.Set("host", HostName());
  j.Set("pid", static_cast<uint64_t>(::getpid()));
  return j;
}

namespace {

using keys::kLockPrefix;

ObjectLockOptions WithDefaults(ObjectLockOptions o) {
  if (!o.now_unix_ms) o.now_unix_ms = WallClockUnixMs;
  if (o.holder.empty()) o.holder = HostName() + " pid " + std::to_string(::getpid());
  return o;
}

const char* ModeName(ObjectLock::Mode m) { return m == ObjectLock::Mode::kShared ? "shared" : "exclusive"; }

std::string LockBody(ObjectLock::Mode mode, const std::string& holder, uint64_t now_ms) {
  Json j = Json::MakeObject();
  j.Set("mode", ModeName(mode));
  j.Set("holder", holder);
  j.Set("refreshed_unix_ms", now_ms);
  return j.Dump();
}

bool Conflicts(ObjectLock::Mode mine, const ObjectLockInfo& other) {
  if (other.stale) return false;
  if (!other.readable) return true;  // cannot tell: assume the worst
  return mine == ObjectLock::Mode::kExclusive || other.mode == ObjectLock::Mode::kExclusive;
}

std::string Describe(const ObjectLockInfo& l, uint64_t now_ms) {
  if (!l.readable) return "an unreadable lock object '" + l.key + "' (delete it if no save or gc runs)";
  const uint64_t age_s = now_ms > l.refreshed_unix_ms ? (now_ms - l.refreshed_unix_ms) / 1000 : 0;
  return "a " + std::string(ModeName(l.mode)) + " lock of " + l.holder + " (refreshed " + std::to_string(age_s) +
         " s ago)";
}

}  // namespace

namespace {

// The locks under locks/; with `exclusive_only`, only the exclusive ones
// (named locks/exclusive-*): a shared lock conflicts with no shared lock,
// and listing or reading those would make every save's requests and
// answers grow with the number of saves in flight (every rank of a job
// takes one at once).
Result<std::vector<ObjectLockInfo>> ReadObjectLocks(Backend& backend, const ObjectLockOptions& options,
                                                    bool exclusive_only) {
  const std::string prefix =
      exclusive_only ? std::string(kLockPrefix) + ModeName(ObjectLock::Mode::kExclusive) + "-" : std::string(kLockPrefix);
  CKPT_ASSIGN_OR_RETURN(std::vector<std::string> keys, backend.List(prefix));
  const uint64_t now = options.now_unix_ms();
  std::vector<ObjectLockInfo> out;
  for (const std::string& key : keys) {
    auto body = backend.ReadAll(key, kMaxSmallObject);
    if (!body.ok()) {
      if (body.status().IsNotFound()) continue;  // released meanwhile
      return body.status();
    }
    ObjectLockInfo info;
    info.key = key;
    auto j = Json::Parse(*body);
    const Json* mode = j.ok() ? j->Find("mode") : nullptr;
    const Json* holder = j.ok() ? j->Find("holder") : nullptr;
    const Json* refreshed = j.ok() ? j->Find("refreshed_unix_ms") : nullptr;
    if (!mode || !mode->is_string() || !holder || !holder->is_string() || !refreshed || !refreshed->is_uint() ||
        (mode->as_string() != "shared" && mode->as_string() != "exclusive")) {
      info.readable = false;
      out.push_back(std::move(info));
      continue;
    }
    info.mode = mode->as_string() == "shared" ? ObjectLock::Mode::kShared : ObjectLock::Mode::kExclusive;
    info.holder = holder->as_string();
    info.refreshed_unix_ms = refreshed->as_uint();
    info.stale = now > info.refreshed_unix_ms &&
                 now - info.refreshed_unix_ms > static_cast<uint64_t>(options.stale_after.count());
    out.push_back(std::move(info));
  }
  return out;
}

}  // namespace

Result<std::vector<ObjectLockInfo>> ListObjectLocks(Backend& backend, const ObjectLockOptions& options) {
  return ReadObjectLocks(backend, WithDefaults(options), false);
}

Result<size_t> RemoveStaleObjectLocks(Backend& backend, const ObjectLockOptions& options) {
  CKPT_ASSIGN_OR_RETURN(auto locks, ListObjectLocks(backend, options));
  size_t removed = 0;
  for (const auto& l : locks) {
    if (!l.stale) continue;
    Status st = backend.Delete(l.key);
    if (st.ok()) {
      ++removed;
    } else if (!st.IsNotFound()) {
      return st;
    }
  }
  return removed;
}

Result<std::unique_ptr<ObjectLock>> ObjectLock::Acquire(Backend& backend, Mode mode, const ObjectLockOptions& options_in) {
  const ObjectLockOptions options = WithDefaults(options_in);
  const auto deadline = std::chrono::steady_clock::now() + options.wait;
  for (int attempt = 0;; ++attempt) {
    const std::string key = std::string(kLockPrefix) + ModeName(mode) + "-" + RandomHex(16);
    const uint64_t now = options.now_unix_ms();
    const std::string body = LockBody(mode, options.holder, now);
    CKPT_RETURN_IF_ERROR(backend.Put(key, std::as_bytes(std::span(body))));
    auto locks = ReadObjectLocks(backend, options, mode == Mode::kShared);
    if (!locks.ok()) {
      (void)backend.Delete(key);
      return locks.status();
    }
    const ObjectLockInfo* conflict = nullptr;
    for (const auto& l : *locks) {
      if (l.key != key && Conflicts(mode, l)) {
        conflict = &l;
        break;
      }
    }
    if (!conflict) return std::unique_ptr<ObjectLock>(new ObjectLock(backend, mode, key, options, now));
    const std::string why = Describe(*conflict, now);
    Status deleted = backend.Delete(key);
    if (!deleted.ok() && !deleted.IsNotFound()) return deleted;
    if (std::chrono::steady_clock::now() >= deadline) {
      return Status::FailedPrecondition("cannot take a " + std::string(ModeName(mode)) +
                                        " lock of the repository: it holds " + why);
    }
    // Both sides of a race back off; random waits let one of them win.
    const int64_t base_ms = std::min<int64_t>(50ll << std::min(attempt, 6), 3000);
    const auto pause = std::chrono::milliseconds(base_ms / 2 + int64_t(RandomU64() % uint64_t(base_ms / 2 + 1)));
    std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(
        pause, std::max<std::chrono::steady_clock::duration>(deadline - std::chrono::steady_clock::now(),
                                                             std::chrono::milliseconds(1))));
  }
}

ObjectLock::ObjectLock(Backend& backend, Mode mode, std::string key, ObjectLockOptions options, uint64_t taken_ms)
    : backend_(backend), mode_(mode), key_(std::move(key)), options_(std::move(options)), last_refresh_ms_(taken_ms) {
  refresher_ = std::thread([this] { RefreshLoop(); });
}

ObjectLock::~ObjectLock() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  refresher_.join();
  (void)backend_.Delete(key_);
}

void ObjectLock::RefreshLoop() {
  std::unique_lock lock(mu_);
  while (!stop_) {
    cv_.wait_for(lock, options_.refresh_interval, [&] { return stop_; });
    if (stop_) break;
    lock.unlock();
    const uint64_t now = options_.now_unix_ms();
    const std::string body = LockBody(mode_, options_.holder, now);
    // A failed refresh is tried again at the next interval; Check reports
    // when too many have failed.
    Status st = backend_.Put(key_, std::as_bytes(std::span(body)));
    lock.lock();
    if (st.ok()) last_refresh_ms_ = now;
  }
}

Status ObjectLock::Check() const {
  uint64_t last;
  {
    std::lock_guard lock(mu_);
    last = last_refresh_ms_;
  }
  const uint64_t now = options_.now_unix_ms();
  // Others see the lock as stale once stale_after has passed since the last
  // refresh; stop one refresh interval before that.
  const uint64_t limit = static_cast<uint64_t>(
      std::max<int64_t>(0, options_.stale_after.count() - options_.refresh_interval.count()));
  if (now > last && now - last > limit) {
    return Status::FailedPrecondition("the repository lock " + key_ + " could not be refreshed for " +
                                      std::to_string((now - last) / 1000) +
                                      " s; other hosts may take it for stale, so this operation stops");
  }
  return Status::OK();
}

}  // namespace ckptfs
