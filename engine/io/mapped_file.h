// A regular file mapped read-only, whole. Shared: a writer's threads may
// hash and encode its bytes after the call that lent them has returned, and
// keep it mapped until they are done.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "core/status.h"

namespace ckptfs {

// InvalidArgument naming `path` when the open file `fd` lies on a kernel
// filesystem (procfs, sysfs, debugfs and the like), whose files report a
// size that is not what reading them gives; OK otherwise.
Status RefusePseudoFile(int fd, const std::string& path);

class MappedFile {
 public:
  // The file at `path`, which must be a regular file (not a FIFO, a device
  // or a directory) on a real filesystem (RefusePseudoFile): InvalidArgument otherwise, the errno of a failed open,
  // stat or mmap naming the path. An empty file maps to no bytes.
  // `sequential`: the bytes are read once, in order (MADV_SEQUENTIAL).
  static Result<std::shared_ptr<const MappedFile>> Open(const std::string& path, bool sequential = false);
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();

  std::span<const std::byte> bytes() const { return {data_, size_}; }
  uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  MappedFile() = default;
  std::string path_;
  const std::byte* data_ = nullptr;
  uint64_t size_ = 0;
};

}  // namespace ckptfs
