// Helpers shared by the unit tests.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <random>
#include <string>
#include <vector>

#if defined(__has_feature)
#define CKPT_HAS_FEATURE(x) __has_feature(x)
#else
#define CKPT_HAS_FEATURE(x) 0
#endif

namespace ckptfs::testing {

// Whether this build runs under a sanitizer: what a test may do around
// fork() differs there, and timings say nothing of the code's speed.
#if defined(__SANITIZE_ADDRESS__) || CKPT_HAS_FEATURE(address_sanitizer)
inline constexpr bool kAddressSanitizer = true;
#else
inline constexpr bool kAddressSanitizer = false;
#endif
#if defined(__SANITIZE_THREAD__) || CKPT_HAS_FEATURE(thread_sanitizer)
inline constexpr bool kThreadSanitizer = true;
#else
inline constexpr bool kThreadSanitizer = false;
#endif

// A fresh directory removed at the end of the test.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "ckptfs-test-XXXXXX").string();
    path_ = ::mkdtemp(tmpl.data());
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

inline std::vector<std::byte> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::byte> v(n);
  for (auto& b : v) b = static_cast<std::byte>(rng());
  return v;
}

inline std::span<const std::byte> AsBytes(const std::string& s) { return std::as_bytes(std::span(s)); }

#define ASSERT_OK(expr)                                  \
  do {                                                   \
    auto _s = ::ckptfs::internal::GetStatus(expr);       \
    ASSERT_TRUE(_s.ok()) << _s.ToString();               \
  } while (0)
#define EXPECT_OK(expr)                                  \
  do {                                                   \
    auto _s = ::ckptfs::internal::GetStatus(expr);       \
    EXPECT_TRUE(_s.ok()) << _s.ToString();               \
  } while (0)

}  // namespace ckptfs::testing
