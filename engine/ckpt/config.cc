#include "ckpt/config.h"

#include <sys/stat.h>

#include <algorithm>
#include <fstream>
#include <sstream>

#include "ckpt/layout.h"
#include "core/random.h"

namespace ckptfs {

using keys::kConfigFile;

Json ConfigToJson(const RepositoryConfig& c) {
  Json j = Json::MakeObject();
  j.Set("format", "ckptfs");
  j.Set("format_version", static_cast<uint64_t>(kFormatVersion));
  j.Set("repository_id", RandomHex(32));
  j.Set("chunk_size", c.chunk_size);
  j.Set("pack_size", c.pack_size);
  j.Set("compression", c.codec.compression == Compression::kZstd ? "zstd" : "none");
  j.Set("level", static_cast<int64_t>(c.codec.level));
  j.Set("adaptive", c.adaptive);
  return j;
}

Status ValidateConfig(const RepositoryConfig& c) {
  if (c.chunk_size % 8 != 0 || c.chunk_size < (64 << 10) || c.chunk_size > kMaxChunkSize) {
    return Status::InvalidArgument("chunk size must be a multiple of 8 between 64 KiB and 256 MiB");
  }
  if (c.pack_size < c.chunk_size) return Status::InvalidArgument("pack size must be at least the chunk size");
  if (c.codec.level < -100 || c.codec.level > 19) {
    return Status::InvalidArgument("compression level must be between -100 and 19");
  }
  return Status::OK();
}

Result<RepositoryConfig> ParseRepositoryConfig(const std::string& text, const std::string& origin,
                                               const std::string& file, std::string* id) {
  auto parsed = Json::Parse(text, 4096);  // a config has a dozen values
  const Json* fmt = parsed.ok() ? parsed->Find("format") : nullptr;
  if (!fmt || !fmt->is_string() || fmt->as_string() != "ckptfs") {
    return Status::FailedPrecondition("'" + origin + "' is not a ckptfs repository (" + kConfigFile +
                                      " is not a ckptfs config)");
  }
  const Json& j = *parsed;
  const Json* version = j.Find("format_version");
  if (!version || !version->is_uint()) return Status::Corruption(file + " lacks format_version");
  if (version->as_uint() > kFormatVersion) {
    return Status::Unsupported("repository '" + origin + "' has format version " +
                               std::to_string(version->as_uint()) + "; this ckptfs reads versions up to " +
                               std::to_string(kFormatVersion) + " (upgrade ckptfs)");
  }
  RepositoryConfig c;
  auto get_uint = [&](const char* key, uint64_t* out) -> Status {
    const Json* v = j.Find(key);
    if (!v || !v->is_uint()) return Status::Corruption(file + ": '" + key + "' is missing or not a number");
    *out = v->as_uint();
    return Status::OK();
  };
  CKPT_RETURN_IF_ERROR(get_uint("chunk_size", &c.chunk_size));
  CKPT_RETURN_IF_ERROR(get_uint("pack_size", &c.pack_size));
  const Json* comp = j.Find("compression");
  if (!comp || !comp->is_string() || (comp->as_string() != "zstd" && comp->as_string() != "none")) {
    return Status::Corruption(file + ": 'compression' must be \"zstd\" or \"none\"");
  }
  c.codec.compression = comp->as_string() == "zstd" ? Compression::kZstd : Compression::kNone;
  const Json* level = j.Find("level");
  if (!level || !level->is_int()) return Status::Corruption(file + ": 'level' is missing");
  c.codec.level = static_cast<int>(level->as_int());
  const Json* adaptive = j.Find("adaptive");
  c.adaptive = adaptive && adaptive->is_bool() ? adaptive->as_bool() : true;
  CKPT_RETURN_IF_ERROR(ValidateConfig(c).WithContext(file));
  if (id) {
    const Json* rid = j.Find("repository_id");
    if (!rid || !rid->is_string() || rid->as_string().empty()) {
      return Status::Corruption(file + ": 'repository_id' is missing");
    }
    // It names this host's state directory: a safe file name only.
    const std::string& s = rid->as_string();
    const bool safe = s.size() <= 64 && std::all_of(s.begin(), s.end(), [](char ch) {
      return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '_' || ch == '-';
    });
    if (!safe) {
      return Status::Corruption(file + ": 'repository_id' must be 1 to 64 of [A-Za-z0-9_-] (ckpt init writes 32 hex "
                                       "digits); this store's is not, and is not used");
    }
    *id = s;
  }
  return c;
}

Result<RepositoryConfig> ReadRepositoryConfig(const std::string& path) {
  struct stat sb;
  if (::stat(path.c_str(), &sb) != 0) {
    return Status::NotFound("no repository at '" + path + "': the directory does not exist (create one with 'ckpt init')");
  }
  std::string file = path + "/" + kConfigFile;
  std::ifstream f(file, std::ios::binary);
  if (!f) {
    return Status::FailedPrecondition("'" + path + "' is not a ckptfs repository (it has no " + kConfigFile + ")");
  }
  std::stringstream ss;
  ss << f.rdbuf();
  return ParseRepositoryConfig(ss.str(), path, file, nullptr);
}

}  // namespace ckptfs
