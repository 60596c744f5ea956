// Structure-aware: a valid small repository whose pack file is replaced by
// the input (seeded with the real pack). Reading every tensor and blob of
// its checkpoint either gives the original bytes or an error, never other
// bytes, and never crashes.
#include <fcntl.h>
#include <unistd.h>

#include <filesystem>

#include "fuzz_repo.h"
#include "fuzz_util.h"

namespace {
struct State {
  ckptfs::fuzz::SmallRepository small;
  std::unique_ptr<ckptfs::Repository> repo;
};

State& Get() {
  static State* s = [] {
    auto* st = new State;
    static char tmpl[] = "/tmp/ckptfs-fuzz-XXXXXX";
    if (!::mkdtemp(tmpl)) std::abort();
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(tmpl, ec);
    });
    st->small = ckptfs::fuzz::MakeSmallRepository(std::string(tmpl) + "/repo");
    // No decoded-chunk cache: every read goes to the (mutated) pack.
    auto repo = ckptfs::Repository::Open(st->small.path, ckptfs::OpenOptions{1, 0});
    if (!repo.ok()) std::abort();
    st->repo = std::move(repo).value();
    return st;
  }();
  return *s;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ckptfs;
  State& s = Get();
  // Rewritten in place, so the pack keeps its inode.
  int fd = ::open(s.small.pack_file.c_str(), O_WRONLY | O_TRUNC);
  FUZZ_CHECK(fd >= 0);
  FUZZ_CHECK(size == 0 || ::write(fd, data, size) == static_cast<ssize_t>(size));
  ::close(fd);
  auto reader = s.repo->OpenCheckpoint("c");
  FUZZ_CHECK(reader.ok(), reader.status().ToString());
  for (const auto& t : (*reader)->tensors()) {
    const auto& want = s.small.tensors.at(t.name);
    std::vector<std::byte> got(want.size());
    if ((*reader)->ReadBytes(t, 0, got).ok()) FUZZ_CHECK(got == want, "tensor " + t.name + " read wrong");
    if (got.size() > 5 && (*reader)->ReadBytes(t, 3, std::span(got).subspan(0, got.size() - 5)).ok()) {
      FUZZ_CHECK(std::equal(got.begin(), got.end() - 5, want.begin() + 3), "range of " + t.name + " read wrong");
    }
  }
  for (const auto& b : (*reader)->blobs()) {
    const auto& want = s.small.blobs.at(b.name);
    std::vector<std::byte> got(want.size());
    if ((*reader)->ReadBlob(b, 0, got).ok()) FUZZ_CHECK(got == want, "blob " + b.name + " read wrong");
  }
  return 0;
}
