// The read-only FUSE view of a repository (libfuse3 low-level API).
//
//   MOUNT/latest -> <newest committed checkpoint>
//   MOUNT/<checkpoint>/<tensor>.npy     whole merged tensor, NumPy format
//   MOUNT/<checkpoint>/model.safetensors
//   MOUNT/<checkpoint>/metadata.json
//   MOUNT/<checkpoint>/blobs/<blob>
//
// Data is produced on demand by the engine's reader; nothing is read when
// files are listed or opened. See docs/CLI.md.
#pragma once

#include <cstddef>
#include <string>

#include "ckpt/repository.h"
#include "core/status.h"

namespace ckptfs::mount {

struct MountOptions {
  std::string repository;
  std::string mountpoint;
  // How the repository is opened (cache directory, S3 settings); threads
  // and cache_bytes are this struct's own.
  OpenOptions open;
  bool foreground = false;
  bool allow_other = false;
  bool debug = false;            // libfuse's request log on stderr
  size_t cache_bytes = 1ull << 30;   // decoded-chunk cache
  size_t threads = 0;            // engine workers; 0 = hardware concurrency
  size_t prefetch_chunks = 8;    // chunks read ahead of a sequential reader
  // How often new and removed checkpoints are noticed; 0: 1 s for a
  // directory, 5 s for a repository on S3 (each poll lists the store).
  double poll_seconds = 0;
  // Kernel readahead for the mount (its BDI's read_ahead_kb). The kernel
  // default, 128 KiB, splits sequential reads into 128 KiB requests; larger
  // values let requests reach 1 MiB. Needs root; 0 keeps the default.
  size_t readahead_bytes = 16ull << 20;
};

// Checks the mountpoint (an existing, empty directory) and the repository,
// mounts, and serves until unmounted (fusermount3 -u, SIGINT, SIGTERM).
// Without `foreground` it returns in the parent once the mount is up and
// serves from a daemon. Returns the reason the mount could not be made.
Status RunMount(const MountOptions& options);

}  // namespace ckptfs::mount
