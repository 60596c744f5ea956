#include "backend/durable_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>

#include "core/crash_point.h"

namespace ckptfs {
namespace {

// Start writeback every kWritebackStep bytes and wait for the range that is
// kWritebackLag behind, so dirty pages stay bounded and the final fsync is short.
constexpr uint64_t kWritebackStep = 8 << 20;
constexpr uint64_t kWritebackLag = 64 << 20;

}  // namespace

Status FsyncDir(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return Status::FromErrno(errno, "opening directory " + dir);
  int rc = ::fsync(fd);
  int err = errno;
  ::close(fd);
  if (rc != 0) return Status::FromErrno(err, "fsync of directory " + dir);
  return Status::OK();
}

Result<std::unique_ptr<DurableFile>> DurableFile::Create(std::string final_path, std::string tmp_path) {
  int fd = ::open(tmp_path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return Status::FromErrno(errno, "creating " + tmp_path);
  return std::unique_ptr<DurableFile>(new DurableFile(std::move(final_path), std::move(tmp_path), fd));
}

Status DurableFile::Append(std::span<const std::byte> data) {
  if (fd_ < 0) return Status::FailedPrecondition("file " + final_path_ + " is already finished");
  const std::byte* p = data.data();
  size_t n = data.size();
  while (n > 0) {
    ssize_t w = ::write(fd_, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return Status::FromErrno(errno, "writing " + tmp_path_);
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  CrashPoint();
  size_ += data.size();
  while (size_ - flushed_ >= kWritebackStep) {
    ::sync_file_range(fd_, static_cast<off_t>(flushed_), kWritebackStep, SYNC_FILE_RANGE_WRITE);
    flushed_ += kWritebackStep;
    if (flushed_ >= kWritebackLag) {
      ::sync_file_range(fd_, static_cast<off_t>(flushed_ - kWritebackLag), kWritebackStep,
                        SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER);
    }
  }
  return Status::OK();
}

Status DurableFile::Commit(bool replace) {
  if (fd_ < 0) return Status::FailedPrecondition("file " + final_path_ + " is already finished");
  if (::fdatasync(fd_) != 0) {
    Status st = Status::FromErrno(errno, "fsync of " + tmp_path_);
    Abort();
    return st;
  }
  ::close(fd_);
  fd_ = -1;
  CrashPoint();
  if (!replace) {
    // link(2) fails when the name exists: of racing writers one wins.
    const int linked = ::link(tmp_path_.c_str(), final_path_.c_str());
    const int err = errno;
    ::unlink(tmp_path_.c_str());
    if (linked != 0 && err == EEXIST) return Status::AlreadyExists(final_path_ + " exists");
    if (linked != 0) return Status::FromErrno(err, "linking " + tmp_path_ + " to " + final_path_);
  } else if (::rename(tmp_path_.c_str(), final_path_.c_str()) != 0) {
    Status st = Status::FromErrno(errno, "renaming " + tmp_path_ + " to " + final_path_);
    ::unlink(tmp_path_.c_str());
    return st;
  }
  CrashPoint();
  const size_t slash = final_path_.rfind('/');
  return FsyncDir(slash == std::string::npos ? "." : slash == 0 ? "/" : final_path_.substr(0, slash));
}

void DurableFile::Abort() {
  if (fd_ < 0) return;
  ::close(fd_);
  fd_ = -1;
  ::unlink(tmp_path_.c_str());
}

}  // namespace ckptfs
