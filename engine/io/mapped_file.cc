#include "io/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace ckptfs {

Result<std::shared_ptr<const MappedFile>> MappedFile::Open(const std::string& path, bool sequential) {
  int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);  // a FIFO must not block here
  if (fd < 0) return Status::FromErrno(errno, "opening " + path);
  struct stat sb;
  if (::fstat(fd, &sb) != 0) {
    int err = errno;
    ::close(fd);
    return Status::FromErrno(err, "stat of " + path);
  }
  if (!S_ISREG(sb.st_mode)) {
    ::close(fd);
    return Status::InvalidArgument(path + " is not a regular file");
  }
  std::shared_ptr<MappedFile> f(new MappedFile());
  f->path_ = path;
  f->size_ = static_cast<uint64_t>(sb.st_size);
  if (f->size_ > 0) {
    void* map = ::mmap(nullptr, f->size_, PROT_READ, MAP_PRIVATE, fd, 0);
    int err = errno;
    ::close(fd);
    if (map == MAP_FAILED) return Status::FromErrno(err, "mapping " + path);
    f->data_ = static_cast<const std::byte*>(map);
    if (sequential) ::madvise(map, f->size_, MADV_SEQUENTIAL);
  } else {
    ::close(fd);
  }
  return std::shared_ptr<const MappedFile>(std::move(f));
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(const_cast<std::byte*>(data_), size_);
}

}  // namespace ckptfs
