// Embeds the installed engine: creates a repository, saves a tensor, reads
// it back and checks the bytes. Exit 0 when they match.
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "ckpt/collective.h"  // the public headers stand on their own once installed
#include "ckpt/repository.h"
#include "core/version.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: consumer EMPTY_DIR\n");
    return 2;
  }
  using namespace ckptfs;
  const std::string dir = argv[1];
  if (Status st = Repository::Init(dir, {}); !st.ok()) {
    std::fprintf(stderr, "init: %s\n", st.ToString().c_str());
    return 1;
  }
  auto repo = Repository::Open(dir);
  if (!repo.ok()) {
    std::fprintf(stderr, "open: %s\n", repo.status().ToString().c_str());
    return 1;
  }
  std::vector<float> values(1000);
  for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i) * 0.5f;
  const auto bytes = std::as_bytes(std::span(values));
  auto writer = (*repo)->BeginCheckpoint("step-1", {});
  if (!writer.ok()) return 1;
  Status put = (*writer)->PutTensor({"w", DType::kF32, {1000}}, bytes);
  if (!put.ok()) {
    std::fprintf(stderr, "put: %s\n", put.ToString().c_str());
    return 1;
  }
  if (auto c = (*writer)->Commit().Wait(); !c.ok()) {
    std::fprintf(stderr, "commit: %s\n", c.status().ToString().c_str());
    return 1;
  }
  auto reader = (*repo)->OpenCheckpoint("step-1");
  if (!reader.ok()) return 1;
  std::vector<float> back(values.size());
  auto tensor = (*reader)->GetTensor("w");
  if (!tensor.ok()) return 1;
  Status read = (*reader)->ReadRegion(**tensor, Region::OfFlat(0, 1000), std::as_writable_bytes(std::span(back)));
  if (!read.ok() || std::memcmp(back.data(), values.data(), bytes.size()) != 0) {
    std::fprintf(stderr, "read back: %s\n", read.ok() ? "different bytes" : read.ToString().c_str());
    return 1;
  }
  std::printf("ckptfs %s embedded: saved and read back %zu bytes\n", CKPTFS_VERSION, bytes.size());
  return 0;
}
