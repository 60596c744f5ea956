#include "ckpt/repo_lock.h"
#include "ckpt/layout.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

namespace ckptfs {

Result<RepoLock> RepoLock::Lock(const std::string& repository, Mode mode, Name name, bool wait) {
  const std::string dir = repository + "/locks";
  if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) return Status::FromErrno(errno, "creating " + dir);
  const std::string path = dir + "/" + (name == Name::kGc      ? keys::kGcLockFile
                                        : name == Name::kGcRun ? keys::kGcRunLockFile
                                                               : keys::kDrainLockFile);
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return Status::FromErrno(errno, "opening " + path);
  int op = (mode == Mode::kShared ? LOCK_SH : LOCK_EX) | (wait ? 0 : LOCK_NB);
  while (::flock(fd, op) != 0) {
    if (errno == EINTR) continue;
    int err = errno;
    ::close(fd);
    if (err == EWOULDBLOCK) {
      if (name == Name::kGcRun) return Status::FailedPrecondition("another garbage collection is running");
      if (name == Name::kDrain) return Status::FailedPrecondition("another drain of this fast tier is running");
      return Status::FailedPrecondition(mode == Mode::kShared ? "garbage collection is running"
                                                              : "saves are in progress");
    }
    return Status::FromErrno(err, "locking " + path);
  }
  return RepoLock(fd);
}

Result<RepoLock> RepoLock::Acquire(const std::string& repository, Mode mode, Name name) {
  return Lock(repository, mode, name, true);
}
Result<RepoLock> RepoLock::TryAcquire(const std::string& repository, Mode mode, Name name) {
  return Lock(repository, mode, name, false);
}

RepoLock& RepoLock::operator=(RepoLock&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.fd_;
    other.fd_ = -1;
  }
  return *this;
}

RepoLock::~RepoLock() {
  if (fd_ >= 0) ::close(fd_);  // closing the last descriptor releases the flock
}

}  // namespace ckptfs
