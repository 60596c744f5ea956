// A repository's ckptfs.json comes from a shared store: parsing never
// crashes, and an accepted config is valid and names a repository_id that
// is a safe file name (it names a directory of this host's cache).
#include "ckpt/repository_impl.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ckptfs;
  const std::string text(fuzz::AsText(data, size));
  std::string id;
  auto config = ParseRepositoryConfig(text, "fuzz", "fuzz/ckptfs.json", &id);
  if (!config.ok()) return 0;
  FUZZ_CHECK(!id.empty() && id.size() <= 64, id);
  for (char c : id) {
    FUZZ_CHECK((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-', id);
  }
  FUZZ_CHECK(config->chunk_size >= (64u << 10) && config->chunk_size % 8 == 0);
  return 0;
}
