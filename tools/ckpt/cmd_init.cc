// ckpt init: create a repository.
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <map>
#include <set>

#include "backend/durable_file.h"
#include "ckpt/describe.h"
#include "ckpt/files.h"
#include "ckpt/repository.h"
#include "commands.h"
#include "core/json.h"
#include "core/text.h"
#include "io/safetensors.h"

namespace ckptfs::cli {
namespace {

const CommandSpec kInit{
    "init", "", "Create an empty repository.",
    "The repository directory is created if missing; it must not hold a repository already.\n"
    "For s3://BUCKET/PREFIX the bucket is created if missing.",
    {{"chunk-size", 0, true, false, "SIZE", "chunk size (default 4M; 64K..256M, multiple of 8)"},
     {"pack-size", 0, true, false, "SIZE", "target pack file size (default 256M)"},
     {"compression", 0, true, false, "zstd|none", "codec (default zstd)"},
     {"level", 0, true, false, "N", "zstd level, -100..19 (default 1)"},
     {"no-adaptive", 0, false, false, "", "always compress, even when the disk waits for the codec"}},
    0, 0};

int CmdInit(const GlobalOptions& global, const Args& args) {
  auto path = global.RepoPath();
  if (!path.ok()) return UsageError(path.status());
  RepositoryConfig config;
  auto chunk_size = args.Size("chunk-size");
  auto pack_size = args.Size("pack-size");
  auto level = args.Int("level");
  for (const Status* st : {&chunk_size.status(), &pack_size.status(), &level.status()}) {
    if (!st->ok()) return UsageError(*st);
  }
  if (*chunk_size) config.chunk_size = **chunk_size;
  if (*pack_size) config.pack_size = **pack_size;
  if (*level) config.codec.level = static_cast<int>(**level);
  if (auto v = args.Get("compression")) {
    if (*v == "zstd") config.codec.compression = Compression::kZstd;
    else if (*v == "none") config.codec.compression = Compression::kNone;
    else return UsageError(Status::InvalidArgument("compression must be 'zstd' or 'none', not '" + *v + "'"));
  }
  if (args.Has("no-adaptive")) config.adaptive = false;
  Status st = Repository::Init(*path, config, global.open);
  // Init rejects option values (chunk size, level) as InvalidArgument.
  if (!st.ok()) return st.code() == StatusCode::kInvalidArgument ? UsageError(st) : Fail(st);
  std::printf("initialized ckptfs repository in %s (chunk size %s, %s level %d)\n", path->c_str(),
              HumanBytes(config.chunk_size).c_str(),
              config.codec.compression == Compression::kZstd ? "zstd" : "no compression", config.codec.level);
  return kExitOk;
}

}  // namespace

const Command kInitCommand{&kInit, CmdInit};

}  // namespace ckptfs::cli
