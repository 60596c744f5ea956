#include "ckpt/state_dir.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "backend/backend.h"
#include "ckpt/layout.h"

namespace ckptfs {

Result<std::string> CacheDirFor(const OpenOptions& options, const std::string& id) {
  if (!options.cache_dir.empty()) return options.cache_dir;
  if (!options.cache_root.empty()) return options.cache_root + "/" + id;
  return Status::FailedPrecondition(
      "no cache directory for this host's catalog of the repository: HOME and XDG_CACHE_HOME are unset; give "
      "--cache-dir DIR (or CKPT_CACHE_DIR)");
}

Status MakePrivateDirectory(const std::string& dir) {
  const uid_t me = ::geteuid();
  std::string path;
  size_t pos = 0;
  while (pos <= dir.size()) {
    size_t next = dir.find('/', pos);
    if (next == std::string::npos) next = dir.size();
    path = dir.substr(0, next);
    pos = next + 1;
    if (path.empty() || path == "." || path == "..") continue;
    struct stat sb;
    if (::lstat(path.c_str(), &sb) != 0) {
      if (errno != ENOENT) return Status::FromErrno(errno, "cache directory " + path);
      if (::mkdir(path.c_str(), 0700) != 0 && errno != EEXIST) return Status::FromErrno(errno, "creating " + path);
      if (::lstat(path.c_str(), &sb) != 0) return Status::FromErrno(errno, "cache directory " + path);
    }
    if (S_ISLNK(sb.st_mode) && sb.st_uid != me && sb.st_uid != 0) {
      return Status::FailedPrecondition("cache directory " + dir + ": " + path + " is a symbolic link owned by user " +
                                        std::to_string(sb.st_uid) + ", not followed; give --cache-dir DIR");
    }
  }
  struct stat sb;
  if (::lstat(dir.c_str(), &sb) != 0) return Status::FromErrno(errno, "cache directory " + dir);
  if (S_ISLNK(sb.st_mode) && ::stat(dir.c_str(), &sb) != 0) return Status::FromErrno(errno, "cache directory " + dir);
  if (!S_ISDIR(sb.st_mode)) return Status::FailedPrecondition("cache directory " + dir + " is not a directory");
  if (sb.st_uid != me) {
    return Status::FailedPrecondition("cache directory " + dir + " belongs to user " + std::to_string(sb.st_uid) +
                                      ", not to this user; give --cache-dir DIR");
  }
  return Status::OK();
}

Status ClaimCacheDir(const std::string& dir, const std::string& url, const std::string& id) {
  std::error_code ec;
  CKPT_RETURN_IF_ERROR(MakePrivateDirectory(dir));
  const std::string marker = dir + "/" + keys::kRepositoryMarkerFile;
  const std::string want = id + " " + url + "\n";
  std::ifstream in(marker);
  if (in) {
    std::string have((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (have == want) return Status::OK();
    const std::string have_url = have.substr(have.find(' ') + 1);
    if (have_url != url + "\n") {
      return Status::FailedPrecondition("cache directory " + dir + " holds the state of another repository (" +
                                        have_url.substr(0, have_url.size() - 1) +
                                        "); give each repository its own --cache-dir");
    }
    std::filesystem::remove_all(dir + "/" + keys::kCatalogDir, ec);
  }
  CKPT_ASSIGN_OR_RETURN(auto local, OpenLocalBackend(dir));
  return local->Put(keys::kRepositoryMarkerFile, std::as_bytes(std::span(want)));
}

}  // namespace ckptfs
