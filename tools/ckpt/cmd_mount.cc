// ckpt mount: the repository as a read-only filesystem.
#include "commands.h"
#include "core/text.h"
#ifdef CKPTFS_HAVE_FUSE
#include "mount.h"
#endif

#include <cstdlib>

namespace ckptfs::cli {
namespace {

const CommandSpec kMount{
    "mount", "MOUNTPOINT", "Show the repository as a read-only filesystem of whole tensors.",
    "MOUNTPOINT/latest is a link to the newest checkpoint; MOUNTPOINT/NAME/ holds\n"
    "<tensor>.npy files, model.safetensors, metadata.json and blobs/. Tensor names\n"
    "are escaped ('/' -> %2F, '%' -> %25). Unmount with 'fusermount3 -u MOUNTPOINT'\n"
    "(or Ctrl-C / SIGTERM with --foreground).",
    {{"foreground", 'f', false, false, "", "stay in the foreground (default: daemonize once mounted)"},
     {"allow-other", 0, false, false, "", "let other users read the mount (needs user_allow_other)"},
     {"cache-size", 0, true, false, "SIZE", "decoded-chunk cache bound (default 1G)"},
     {"prefetch", 0, true, false, "N", "chunks decoded ahead of sequential readers (default 8)"},
     {"readahead", 0, true, false, "SIZE", "kernel readahead of the mount, needs root (default 16M; 0: kernel default)"},
     {"poll", 0, true, false, "SECONDS", "how often new and removed checkpoints show (default 1; 5 on S3)"},
     {"debug", 'd', false, false, "", "log every FUSE request (implies --foreground)"}},
    1, 1};

int CmdMount(const GlobalOptions& global, const Args& args) {
#ifdef CKPTFS_HAVE_FUSE
  auto path = global.RepoPath();
  if (!path.ok()) return UsageError(path.status());
  mount::MountOptions o;
  o.repository = *path;
  o.open = global.open;
  o.mountpoint = args.positional[0];
  o.foreground = args.Has("foreground") || args.Has("debug");
  o.debug = args.Has("debug");
  o.allow_other = args.Has("allow-other");
  auto cache = args.Size("cache-size");
  auto prefetch = args.Int("prefetch", 0);
  auto readahead = args.Size("readahead");
  for (const Status* st : {&cache.status(), &prefetch.status(), &readahead.status()}) {
    if (!st->ok()) return UsageError(*st);
  }
  if (*cache) o.cache_bytes = **cache;
  if (*prefetch) o.prefetch_chunks = static_cast<size_t>(**prefetch);
  if (*readahead) o.readahead_bytes = **readahead;
  if (auto poll = args.Get("poll")) {
    char* end = nullptr;
    const double seconds = std::strtod(poll->c_str(), &end);
    if (poll->empty() || *end != '\0' || !(seconds >= 0.1 && seconds <= 3600)) {
      return UsageError(Status::InvalidArgument("--poll takes seconds between 0.1 and 3600, not '" + *poll + "'"));
    }
    o.poll_seconds = seconds;
  }
  Status st = mount::RunMount(o);
  return st.ok() ? kExitOk : Fail(st);
#else
  (void)global;
  (void)args;
  return Fail(Status::Unsupported("this ckpt was built without libfuse3; install libfuse3-dev and rebuild"));
#endif
}

}  // namespace

const Command kMountCommand{&kMount, CmdMount};

}  // namespace ckptfs::cli
