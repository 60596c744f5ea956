// Every Backend implementation, for test suites that run against each
// (TensorStore's habit): the in-memory reference, the local directory, and
// S3 on the server the AWS_* variables name (tools/s3-server.sh starts one;
// the test command does, and sets CKPTFS_REQUIRE_S3 so that a missing server
// fails instead of skipping).
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <string>

#include "backend/backend.h"
#include "backend/s3_backend.h"
#include "core/random.h"
#include "test_util.h"

namespace ckptfs::testing {

struct BackendFactory {
  std::string name;
  // Null with `why` set when the backend cannot be tested here.
  std::function<std::unique_ptr<Backend>(const std::string& dir, std::string* why)> make;
};
// Test names and messages show the backend's name (not the struct's bytes).
inline void PrintTo(const BackendFactory& f, std::ostream* os) { *os << f.name; }

// The S3 test server's options, from the AWS_* variables; nullopt, with
// `why`, when none is configured.
inline std::optional<ObjectStoreOptions> S3TestOptions(std::string* why) {
  auto options = ObjectStoreOptions::FromEnvironment(std::getenv);
  if (!options.ok()) {
    *why = "no S3 server (" + options.status().message() + "); tools/s3-server.sh starts one";
    return std::nullopt;
  }
  return *options;
}

// A test that cannot run here skips saying why, or fails where the test
// command promised the S3 server (CKPTFS_REQUIRE_S3).
#define CKPTFS_SKIP_UNLESS(available, why)                 \
  do {                                                     \
    if (!(available)) {                                    \
      if (std::getenv("CKPTFS_REQUIRE_S3")) FAIL() << why; \
      GTEST_SKIP() << why;                                 \
    }                                                      \
  } while (0)

// An S3 backend under a fresh prefix of bucket ckptfs-test.
inline std::unique_ptr<Backend> MakeS3TestBackend(const std::string&, std::string* why) {
  auto options = S3TestOptions(why);
  if (!options) return nullptr;
  S3Location location{"ckptfs-test", "t-" + RandomHex(12)};
  Status created = CreateS3Bucket(location, *options);
  if (!created.ok()) {
    *why = "S3 server unusable: " + created.message();
    return nullptr;
  }
  auto backend = OpenS3Backend(location, *options);
  if (!backend.ok()) {
    *why = "S3 server unusable: " + backend.status().message();
    return nullptr;
  }
  return std::move(backend).value();
}

// A memory store's objects under a prefix, beside objects that must not
// show: one outside it and one whose key starts with the prefix's letters.
inline std::unique_ptr<Backend> MakePrefixedTestBackend(const std::string&, std::string*) {
  std::shared_ptr<Backend> store = NewMemoryBackend();
  const std::byte b{1};
  EXPECT_TRUE(store->Put("outside", std::span(&b, 1)).ok());
  EXPECT_TRUE(store->Put("sub/dirx/k", std::span(&b, 1)).ok());
  return NewPrefixedBackend(store, "sub/dir");
}

inline auto AllBackendFactories() {
  return ::testing::Values(
      BackendFactory{"memory", [](const std::string&, std::string*) { return NewMemoryBackend(); }},
      BackendFactory{"prefixed", MakePrefixedTestBackend},
      // Every call forwarded: BackendWrapper leaves none out.
      BackendFactory{"wrapped",
                     [](const std::string&, std::string*) -> std::unique_ptr<Backend> {
                       return std::make_unique<BackendWrapper>(NewMemoryBackend());
                     }},
      BackendFactory{"local",
                     [](const std::string& dir, std::string*) {
                       return std::move(OpenLocalBackend(dir + "/objects")).value();
                     }},
      BackendFactory{"s3", MakeS3TestBackend});
}

// A fixture holding one backend of the parameter's kind.
class EachBackend : public ::testing::TestWithParam<BackendFactory> {
 protected:
  void SetUp() override {
    std::string why;
    backend_ = GetParam().make(dir_.path(), &why);
    CKPTFS_SKIP_UNLESS(backend_, why);
  }
  TempDir dir_;
  std::unique_ptr<Backend> backend_;
};

}  // namespace ckptfs::testing
