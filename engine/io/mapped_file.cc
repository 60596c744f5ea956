#include "io/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

namespace ckptfs {

Status RefusePseudoFile(int fd, const std::string& path) {
  struct statfs fs;
  if (::fstatfs(fd, &fs) != 0) return Status::OK();  // nothing to say: the read says what is wrong
  // Kernel filesystems whose files report a size (often 0 or 4096) that is
  // not what reading them gives: procfs, sysfs, debugfs, tracefs,
  // securityfs, configfs, cgroup and cgroup2, bpf, efivarfs, pstore.
  static constexpr unsigned long kPseudo[] = {0x9fa0,     0x62656572, 0x64626720, 0x74726163, 0x73636673,
                                              0x62656570, 0x27e0eb,   0x63677270, 0xcafe4a11, 0xde5e81e4,
                                              0x6165676c};
  for (unsigned long magic : kPseudo) {
    if (static_cast<unsigned long>(fs.f_type) == magic) {
      return Status::InvalidArgument(path +
                                     " is a file of a kernel filesystem (procfs, sysfs or the like), whose size is not "
                                     "what reading it gives: refused");
    }
  }
  return Status::OK();
}

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
  if (Status pseudo = RefusePseudoFile(fd, path); !pseudo.ok()) {
    ::close(fd);
    return pseudo;
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
