#include "backend/store_url.h"

#include <algorithm>
#include <cctype>
#include <map>
#include <mutex>

#include "backend/s3_backend.h"

namespace ckptfs {
namespace {

Result<std::unique_ptr<Backend>> OpenS3(const std::string& url, const ObjectStoreOptions& options, bool create) {
  CKPT_ASSIGN_OR_RETURN(S3Location location, ParseS3Url(url));
  if (create) CKPT_RETURN_IF_ERROR(CreateS3Bucket(location, options));
  return OpenS3Backend(location, options);
}

struct Registry {
  std::mutex mu;
  std::map<std::string, StoreOpener> openers;  // guarded by mu
};

Registry& Schemes() {
  static Registry* r = [] {
    auto* registry = new Registry;  // never destroyed: usable from exit handlers
    registry->openers["s3"] = OpenS3;
    return registry;
  }();
  return *r;
}

}  // namespace

void RegisterStoreScheme(const std::string& scheme, StoreOpener opener) {
  Registry& r = Schemes();
  std::lock_guard lock(r.mu);
  r.openers[scheme] = std::move(opener);
}

std::string StoreScheme(std::string_view url) {
  const size_t sep = url.find("://");
  if (sep == std::string_view::npos || sep == 0) return "";
  std::string scheme(url.substr(0, sep));
  // RFC 3986: a letter, then letters, digits, '+', '-' or '.'.
  if (!std::isalpha(static_cast<unsigned char>(scheme[0]))) return "";
  for (char& c : scheme) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '+' && c != '-' && c != '.') return "";
    c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  }
  return scheme;
}

bool IsObjectStoreUrl(std::string_view url) { return !StoreScheme(url).empty(); }

std::vector<std::string> StoreSchemes() {
  Registry& r = Schemes();
  std::lock_guard lock(r.mu);
  std::vector<std::string> out;
  for (const auto& [scheme, opener] : r.openers) out.push_back(scheme);
  return out;
}

Result<std::unique_ptr<Backend>> OpenObjectStore(const std::string& url, const ObjectStoreOptions& options,
                                                 bool create) {
  const std::string scheme = StoreScheme(url);
  StoreOpener opener;
  {
    Registry& r = Schemes();
    std::lock_guard lock(r.mu);
    if (auto it = r.openers.find(scheme); it != r.openers.end()) opener = it->second;
  }
  if (!opener) {
    std::string known;
    for (const auto& s : StoreSchemes()) known += (known.empty() ? "" : ", ") + s + "://";
    return Status::InvalidArgument("no object store for '" + url + "': unknown scheme '" + scheme +
                                   "://' (known: " + known + "; a local directory is a path)");
  }
  return opener(url, options, create);
}

std::string ObjectStoreChild(std::string_view url, std::string_view name) {
  std::string out(url);
  while (!out.empty() && out.back() == '/') out.pop_back();
  return out + "/" + std::string(name);
}

}  // namespace ckptfs
