#include "ckpt/layout.h"

#include "ckpt/repository.h"

namespace ckptfs {
namespace keys {

std::string ManifestObject(const std::string& checkpoint) {
  return std::string(kManifestPrefix) + checkpoint + ".manifest";
}
bool ParseManifestObject(const std::string& key, std::string* checkpoint) {
  const std::string prefix = kManifestPrefix, suffix = ".manifest";
  if (key.size() <= prefix.size() + suffix.size() || key.compare(0, prefix.size(), prefix) != 0 ||
      key.compare(key.size() - suffix.size(), suffix.size(), suffix) != 0) {
    return false;
  }
  *checkpoint = key.substr(prefix.size(), key.size() - prefix.size() - suffix.size());
  return IsStoredCheckpointName(*checkpoint);
}
std::string PendingPrefix(const std::string& checkpoint) { return std::string(kPendingPrefix) + checkpoint + "/"; }
bool IsPendingObjectOf(std::string_view key, const std::string& checkpoint) {
  const std::string prefix = PendingPrefix(checkpoint);
  return key.starts_with(prefix) && key.find('/', prefix.size()) == std::string_view::npos;
}
std::string CommitClaimObject(const std::string& checkpoint) { return PendingPrefix(checkpoint) + "commit"; }
std::string PendingRankObject(const std::string& checkpoint, uint32_t rank) {
  return PendingPrefix(checkpoint) + "rank-" + std::to_string(rank);
}
std::string StartedRankObject(const std::string& checkpoint, uint32_t rank) {
  return PendingPrefix(checkpoint) + "started-" + std::to_string(rank);
}
namespace {
// A rank as object names write it: decimal, no leading zeros, 32 bits.
bool ParseRank(std::string_view digits, uint32_t* rank) {
  if (digits.empty() || digits.size() > 10 || (digits[0] == '0' && digits.size() > 1)) return false;
  uint64_t r = 0;
  for (char c : digits) {
    if (c < '0' || c > '9') return false;
    r = r * 10 + static_cast<uint64_t>(c - '0');
  }
  if (r > UINT32_MAX) return false;
  *rank = static_cast<uint32_t>(r);
  return true;
}
}  // namespace
bool ParseStartedRankObject(const std::string& key, const std::string& checkpoint, uint32_t* rank) {
  const std::string prefix = PendingPrefix(checkpoint) + "started-";
  return key.starts_with(prefix) && ParseRank(std::string_view(key).substr(prefix.size()), rank);
}
bool ParsePendingRankObject(const std::string& key, std::string* checkpoint, uint32_t* rank) {
  const std::string prefix = kPendingPrefix;
  if (key.compare(0, prefix.size(), prefix) != 0) return false;
  const size_t slash = key.rfind('/');
  if (slash == std::string::npos || slash < prefix.size()) return false;
  *checkpoint = key.substr(prefix.size(), slash - prefix.size());
  const std::string tail = key.substr(slash + 1);
  if (!tail.starts_with("rank-") || !ParseRank(std::string_view(tail).substr(5), rank)) return false;
  return IsStoredCheckpointName(*checkpoint);
}

std::string RetiredCheckpoint(const std::string& name, uint64_t token) { return name + "/" + std::to_string(token); }
// A live name's last part is never digits only when it has groups
// (ValidateCheckpointName), so "NAME/DIGITS" is a retired one.
bool IsRetiredCheckpoint(std::string_view catalog_name) {
  const size_t slash = catalog_name.rfind('/');
  if (slash == std::string_view::npos) return false;
  const std::string_view token = catalog_name.substr(slash + 1);
  return !token.empty() && token.find_first_not_of("0123456789") == std::string_view::npos;
}
std::string BaseName(std::string_view catalog_name) {
  if (!IsRetiredCheckpoint(catalog_name)) return std::string(catalog_name);
  return std::string(catalog_name.substr(0, catalog_name.rfind('/')));
}
std::string RetiredObject(const std::string& catalog_name) {
  return std::string(kRetiredPrefix) + catalog_name + ".manifest";
}
bool ParseRetiredObject(const std::string& key, std::string* catalog_name) {
  const std::string prefix = kRetiredPrefix, suffix = ".manifest";
  if (key.size() <= prefix.size() + suffix.size() || !key.starts_with(prefix) || !key.ends_with(suffix)) return false;
  std::string rest = key.substr(prefix.size(), key.size() - prefix.size() - suffix.size());
  const size_t slash = rest.rfind('/');
  if (slash == std::string::npos || !ValidateCheckpointName(rest.substr(0, slash)).ok()) return false;
  const std::string token = rest.substr(slash + 1);
  if (token.empty() || token.size() > 20 || token.find_first_not_of("0123456789") != std::string::npos) return false;
  *catalog_name = std::move(rest);
  return true;
}
std::string ReplacementCheckpoint(const std::string& name) { return name + "~"; }
bool IsReplacementCheckpoint(std::string_view catalog_name) { return catalog_name.ends_with('~'); }
std::string ReplacedName(std::string_view catalog_name) {
  if (IsReplacementCheckpoint(catalog_name)) catalog_name.remove_suffix(1);
  return std::string(catalog_name);
}
bool IsStoredCheckpointName(const std::string& name) { return ValidateCheckpointName(ReplacedName(name)).ok(); }
std::string LeaseObject(const std::string& name, const std::string& host) {
  return std::string(kLeasePrefix) + name + "/" + host;
}
bool ParseLeaseObject(const std::string& key, std::string* name, std::string* host) {
  if (!key.starts_with(kLeasePrefix)) return false;
  const std::string rest = key.substr(std::string(kLeasePrefix).size());
  const size_t slash = rest.rfind('/');
  if (slash == std::string::npos || !ValidateCheckpointName(rest.substr(0, slash)).ok()) return false;
  *name = rest.substr(0, slash);
  *host = rest.substr(slash + 1);
  return !host->empty() && host->find('/') == std::string::npos;
}

}  // namespace keys
}  // namespace ckptfs
