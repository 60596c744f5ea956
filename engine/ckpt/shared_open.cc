// Repository::OpenShared (repository.h): one Repository per repository per
// process, shared by every caller that opens it this way.
#include <sys/stat.h>

#include <chrono>
#include <filesystem>
#include <map>
#include <mutex>
#include <thread>

#include "ckpt/layout.h"
#include "ckpt/repository.h"
#include "core/fork.h"

namespace ckptfs {
namespace {

// Which repository lives at a local path: its config file's device, inode
// and modification time (written once, by init, through a rename). Empty
// for object stores and where there is none.
std::string LocalIdentity(const std::string& path) {
  struct stat sb;
  if (::stat((path + "/" + keys::kConfigFile).c_str(), &sb) != 0) return {};
  return std::to_string(sb.st_dev) + ':' + std::to_string(sb.st_ino) + ':' + std::to_string(sb.st_mtim.tv_sec) +
         '.' + std::to_string(sb.st_mtim.tv_nsec);
}

struct Entry {
  std::weak_ptr<Repository> repo;
  std::string identity;
};

struct Registry {
  std::mutex mu;
  std::map<std::string, Entry> open;        // guarded by mu
  uint64_t generation = ForkGeneration();   // guarded by mu
};

Registry& TheRegistry() {
  // Never destroyed: a Repository may be let go while the process exits.
  static Registry* r = new Registry;
  return *r;
}

// How long an open waits for a catalog this process is still closing.
constexpr int kClosingAttempts = 300;
constexpr std::chrono::milliseconds kClosingPoll{10};

}  // namespace

Result<std::shared_ptr<Repository>> Repository::OpenShared(const std::string& path, const OpenOptions& options) {
  std::error_code ec;
  std::string key = std::filesystem::weakly_canonical(path, ec).string();
  if (ec) key = path;
  // Another cache directory is another catalog: another Repository.
  key += '\0' + options.cache_dir;
  Registry& registry = TheRegistry();
  for (int attempt = 0;; ++attempt) {
    {
      std::lock_guard lock(registry.mu);
      if (registry.generation != ForkGeneration()) {
        // The parent's repositories refuse to work in a forked child:
        // forget them and open anew.
        registry.open.clear();
        registry.generation = ForkGeneration();
      }
      const std::string identity = LocalIdentity(path);
      auto it = registry.open.find(key);
      if (it != registry.open.end() && it->second.identity != identity) {
        // Another repository now lives at this path: its holders keep the
        // old one; this opens the new one.
        registry.open.erase(it);
        it = registry.open.end();
      }
      if (it != registry.open.end()) {
        if (auto live = it->second.repo.lock()) return live;
      }
      auto opened = Open(path, options);
      // The catalog of one this process let go may still be closing: the
      // last reference was dropped on another thread, whose destructor is
      // shutting the engine down. Wait for it rather than fail.
      const bool closing = it != registry.open.end() && !opened.ok() &&
                           opened.status().detail() == StatusDetail::kCatalogOpenInProcess;
      if (!closing || attempt >= kClosingAttempts) {
        if (!opened.ok()) return opened.status();
        std::shared_ptr<Repository> out = std::move(opened).value();
        registry.open[key] = Entry{out, identity};
        return out;
      }
    }
    std::this_thread::sleep_for(kClosingPoll);
  }
}

}  // namespace ckptfs
