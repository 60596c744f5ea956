// Pack files: the input is a whole pack. Its index and footer parse or give
// an error; every entry of an index that parses lies inside the data area
// and reads (decode + hash check) without crashing.
#include <vector>

#include "backend/backend.h"
#include "fuzz_util.h"
#include "store/pack.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ckptfs;
  static std::unique_ptr<Backend> backend = NewMemoryBackend();
  const std::string id = "000000000000000000000000";
  FUZZ_CHECK(backend->Put(PackKey(id), {reinterpret_cast<const std::byte*>(data), size}).ok());
  auto pack = ReadPackIndex(backend.get(), id);
  if (!pack.ok()) return 0;
  FUZZ_CHECK(pack->size == size);
  std::vector<std::byte> raw;
  for (const auto& e : pack->entries) {
    const ChunkLocation& loc = e.location;
    FUZZ_CHECK(loc.offset >= kPackHeaderSize && loc.offset <= size && loc.stored_len <= size - loc.offset);
    FUZZ_CHECK(loc.raw_len > 0 && loc.raw_len <= kMaxChunkSize);
    if (loc.raw_len > (1 << 20)) continue;  // bounded memory per run
    raw.resize(loc.raw_len);
    (void)ReadChunk(backend.get(), e.id, loc, raw);
  }
  return 0;
}
