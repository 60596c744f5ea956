// A file that appears at its path complete and durable, or not at all: the
// way objects of the local backend and files `ckpt export` writes are made.
//
// Bytes go to a temporary file beside the final path. Writeback starts as
// they arrive (dirty pages stay bounded and the final fsync is short).
// Commit fdatasyncs the temporary, renames it over the final path and
// fsyncs the directory. Abort, a failed Commit or destruction without
// Commit remove the temporary and leave the final path as it was.
//
// Thread safety: one thread at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "core/status.h"

namespace ckptfs {

class DurableFile {
 public:
  // `tmp_path` must be in the same directory as `final_path`.
  static Result<std::unique_ptr<DurableFile>> Create(std::string final_path, std::string tmp_path);
  ~DurableFile() { Abort(); }
  DurableFile(const DurableFile&) = delete;
  DurableFile& operator=(const DurableFile&) = delete;

  Status Append(std::span<const std::byte> data);
  // Commit; with `replace` false, AlreadyExists (and nothing changed) when
  // the final path exists: the file is linked into place, not renamed.
  Status Commit(bool replace = true);
  void Abort();
  uint64_t size() const { return size_; }

 private:
  DurableFile(std::string final_path, std::string tmp_path, int fd)
      : final_path_(std::move(final_path)), tmp_path_(std::move(tmp_path)), fd_(fd) {}
  std::string final_path_;
  std::string tmp_path_;
  int fd_;
  uint64_t size_ = 0;
  uint64_t flushed_ = 0;
};

// fsync of a directory, which makes renames and creations in it durable.
Status FsyncDir(const std::string& dir);

}  // namespace ckptfs
