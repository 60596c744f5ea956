#include "ckpt/lease.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <vector>

#include "ckpt/repository.h"
#include "core/json.h"
#include "core/random.h"

namespace ckptfs {


namespace {

uint64_t Now(const ObjectLockOptions& o) { return o.now_unix_ms ? o.now_unix_ms() : WallClockUnixMs(); }

Result<int> OpenLeaseFile(const std::string& state_dir, const std::string& name) {
  // The name becomes a file name: only a checkpoint name will do.
  CKPT_RETURN_IF_ERROR(ValidateCheckpointName(name));
  const std::string dir = state_dir + "/" + keys::kLeaseFilesDir;
  if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) return Status::FromErrno(errno, "creating " + dir);
  // A grouped name's '/' becomes '~' (never in a name): one file per name,
  // none a directory, so "run1" and "run1/step-1" do not collide.
  std::string file = name;
  std::replace(file.begin(), file.end(), '/', '~');
  const std::string path = dir + "/" + file;
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd < 0) return Status::FromErrno(errno, "opening " + path);
  return fd;
}

// Takes `op` on fd, retrying on EINTR: 0, or the errno.
int Flock(int fd, int op) {
  while (::flock(fd, op) != 0) {
    if (errno != EINTR) return errno;
  }
  return 0;
}

// This host's id in the store's lease names: made once per state directory
// (each host has its own), so two hosts of one name never share a lease.
Result<std::string> HostId(const std::string& state_dir) {
  const std::string path = state_dir + "/" + keys::kHostIdFile;
  for (int attempt = 0; attempt < 2; ++attempt) {
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd >= 0) {
      char buf[64] = {};
      const ssize_t n = ::read(fd, buf, sizeof buf - 1);
      ::close(fd);
      std::string id(buf, n > 0 ? static_cast<size_t>(n) : 0);
      if (id.size() == 16 && id.find_first_not_of("0123456789abcdef") == std::string::npos) return id;
      return Status::Corruption(path + " does not hold a host id (16 hex digits); delete it");
    }
    if (errno != ENOENT) return Status::FromErrno(errno, "opening " + path);
    const std::string id = RandomHex(16), tmp = path + ".tmp" + RandomHex(8);
    fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) return Status::FromErrno(errno, "creating " + tmp);
    const bool written = ::write(fd, id.data(), id.size()) == static_cast<ssize_t>(id.size()) && ::fsync(fd) == 0;
    ::close(fd);
    // link() fails when another process made the id first: then read theirs.
    const int linked = written ? ::link(tmp.c_str(), path.c_str()) : -1;
    ::unlink(tmp.c_str());
    if (!written) return Status::IOError("writing " + tmp);
    if (linked == 0) return id;
    if (errno != EEXIST) return Status::FromErrno(errno, "creating " + path);
  }
  return Status::Internal("could not read or create " + path);
}

}  // namespace

LeaseRegistry::LeaseRegistry(std::string state_dir, Backend* backend, ObjectLockOptions options)
    : state_dir_(std::move(state_dir)), backend_(backend), options_(std::move(options)) {}

LeaseRegistry::~LeaseRegistry() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (refresher_.joinable()) refresher_.join();
  // Leases still held (a reader kept past its repository, lingering ones)
  // go now rather than when they turn stale.
  std::lock_guard lock(mu_);
  while (!held_.empty()) Drop(held_.begin());
}

Status LeaseRegistry::PutObject(const std::string& name) {
  Json j = ThisProcess();
  j.Set("refreshed_unix_ms", Now(options_));
  const std::string body = j.Dump();
  return backend_->Put(keys::LeaseObject(name, host_), std::as_bytes(std::span(body)));
}

Status LeaseRegistry::Acquire(const std::string& name, bool* first) {
  if (first) *first = false;
  std::unique_lock lock(mu_);
  auto it = held_.find(name);
  if (it != held_.end()) {
    ++it->second.count;
    it->second.idle_since.reset();
    return Status::OK();
  }
  if (backend_ && host_.empty()) {
    CKPT_ASSIGN_OR_RETURN(host_, HostId(state_dir_));
  }
  CKPT_ASSIGN_OR_RETURN(int fd, OpenLeaseFile(state_dir_, name));
  // Waits while gc collects a removed checkpoint of this name.
  if (int err = Flock(fd, LOCK_SH); err != 0) {
    ::close(fd);
    return Status::FromErrno(err, "taking the read lease of checkpoint '" + name + "'");
  }
  if (backend_) {
    if (Status st = PutObject(name); !st.ok()) {
      ::close(fd);
      return st.WithContext("writing the read lease of checkpoint '" + name + "'");
    }
    if (!refresher_.joinable()) refresher_ = std::thread([this] { RefreshLoop(); });
  }
  held_[name] = Held{fd, 1, std::nullopt};
  if (first) *first = true;
  return Status::OK();
}

void LeaseRegistry::Release(const std::string& name, bool linger) {
  std::lock_guard lock(mu_);
  auto it = held_.find(name);
  if (it == held_.end() || it->second.count == 0 || --it->second.count > 0) return;
  if (backend_ && linger) {
    it->second.idle_since = std::chrono::steady_clock::now();  // the refresher drops it
    idle_changed_ = true;
    cv_.notify_all();
    return;
  }
  Drop(it);
}

void LeaseRegistry::Drop(std::map<std::string, Held>::iterator it) {
  const int fd = it->second.fd;
  const std::string name = it->first;
  held_.erase(it);
  // The host's object goes with the host's last holder: taking the file
  // exclusively, without waiting, tells that no other process holds it
  // (one that comes meanwhile waits, then writes the object again).
  if (backend_ && Flock(fd, LOCK_EX | LOCK_NB) == 0) (void)backend_->Delete(keys::LeaseObject(name, host_));
  ::close(fd);
}

void LeaseRegistry::RefreshLoop() {
  using Clock = std::chrono::steady_clock;
  const auto interval = std::max<std::chrono::milliseconds>(
      std::chrono::milliseconds(10), std::min<std::chrono::milliseconds>(std::chrono::minutes(10), options_.stale_after / 3));
  auto next_refresh = Clock::now() + interval;
  std::unique_lock lock(mu_);
  while (!stop_) {
    auto wake = next_refresh;
    for (const auto& [name, h] : held_) {
      if (h.idle_since) wake = std::min(wake, *h.idle_since + kLinger);
    }
    cv_.wait_until(lock, wake, [&] { return stop_ || idle_changed_; });
    if (stop_) return;
    idle_changed_ = false;
    const auto now = Clock::now();
    for (auto it = held_.begin(); it != held_.end();) {
      auto next = std::next(it);
      if (it->second.idle_since && now >= *it->second.idle_since + kLinger) Drop(it);
      it = next;
    }
    if (now < next_refresh) continue;
    next_refresh = now + interval;
    std::vector<std::string> names;
    for (const auto& [name, h] : held_) names.push_back(name);
    lock.unlock();
    // A failed refresh is tried again at the next interval; two in a row
    // fail before the lease could be taken for stale.
    for (const auto& name : names) (void)PutObject(name);
    lock.lock();
  }
}

LocalLeaseScan::~LocalLeaseScan() {
  for (int fd : fds_) ::close(fd);
}

Result<bool> LocalLeaseScan::Leased(const std::string& name) {
  CKPT_ASSIGN_OR_RETURN(int fd, OpenLeaseFile(state_dir_, name));
  const int err = Flock(fd, LOCK_EX | LOCK_NB);
  if (err == 0) {
    fds_.push_back(fd);
    return false;
  }
  ::close(fd);
  if (err == EWOULDBLOCK) return true;
  return Status::FromErrno(err, "checking the read leases of checkpoint '" + name + "'");
}

Result<std::set<std::string>> ListStoreLeases(Backend& backend, const ObjectLockOptions& options) {
  CKPT_ASSIGN_OR_RETURN(auto listed, backend.List(keys::kLeasePrefix));
  std::set<std::string> names;
  const uint64_t now = Now(options);
  const auto stale_ms = static_cast<uint64_t>(options.stale_after.count());
  for (const auto& key : listed) {
    std::string name, host;
    if (!keys::ParseLeaseObject(key, &name, &host)) continue;
    auto body = backend.ReadAll(key, kMaxSmallObject);
    if (!body.ok()) {
      if (body.status().IsNotFound()) continue;  // released meanwhile
      names.insert(name);
      continue;
    }
    auto j = Json::Parse(*body, 64);
    const Json* refreshed = j.ok() ? j->Find("refreshed_unix_ms") : nullptr;
    if (!refreshed || !refreshed->is_uint()) {
      names.insert(name);
      continue;
    }
    const uint64_t at = refreshed->as_uint();
    if (now > at && now - at > stale_ms) {
      (void)backend.Delete(key);  // a crashed host's
      continue;
    }
    names.insert(name);
  }
  return names;
}

}  // namespace ckptfs
