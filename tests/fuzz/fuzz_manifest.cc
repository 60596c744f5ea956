// Manifest objects, the input of reindex. The input is a manifest's body
// (after the magic); the harness adds the magic and a valid checksum so the
// fuzzer reaches the records. What decodes is consistent: it encodes back to
// the same bytes, and reading any of its tensors or blobs only ever touches
// the chunks' own bytes.
#include <string>

#include "core/chunk_id.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ckptfs;
  std::string object("CKPTMANI", 8);
  object.append(fuzz::AsText(data, size));
  const uint64_t sum = Checksum64(std::as_bytes(std::span(object)));
  object.append(reinterpret_cast<const char*>(&sum), 8);
  auto m = DecodeManifest(object);
  if (!m.ok()) {
    FUZZ_CHECK(m.status().IsCorruption(), m.status().ToString());
    return 0;
  }
  FUZZ_CHECK(EncodeManifest(*m) == object);
  for (const auto& t : m->tensors) fuzz::ExerciseTensorReads(t);
  for (const auto& b : m->blobs) fuzz::ExerciseBlobReads(b);
  return 0;
}
