// Catalog records as LMDB holds them. The first byte picks the record type;
// the rest is its value. A record that decodes encodes back to the same
// bytes, and tensor and blob records are safe to read through.
#include <string>

#include "ckpt/repository_impl.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ckptfs;
  if (size < 1) return 0;
  const std::string_view value = fuzz::AsText(data + 1, size - 1);
  switch (data[0] % 6) {
    case 0:
      if (auto r = DecodeCheckpoint(value); r.ok()) {
        FUZZ_CHECK(EncodeCheckpoint(*r) == value);
      }
      break;
    case 1:
      if (auto r = DecodeTensor(value); r.ok()) {
        FUZZ_CHECK(EncodeTensor(*r) == value);
        fuzz::ExerciseTensorReads(*r);
      }
      break;
    case 2:
      if (auto r = DecodeBlob(value); r.ok()) {
        FUZZ_CHECK(EncodeBlob(*r) == value);
        fuzz::ExerciseBlobReads(*r);
      }
      break;
    case 3:
      if (auto r = DecodeRank(value); r.ok()) {
        FUZZ_CHECK(EncodeRank(*r) == value);
        for (const auto& t : r->tensors) fuzz::ExerciseTensorReads(t);
        // What the last commit does with rank records.
        fuzz::PatternFetcher fetcher;
        (void)MergeRankTensors({*r, *r}, fetcher);
        (void)MergeRankBlobs({*r});
      }
      break;
    case 4:
      if (auto r = DecodeChunkLocation(value); r.ok()) {
        FUZZ_CHECK(EncodeChunkLocation(*r) == value);
        FUZZ_CHECK(r->raw_len > 0 && r->raw_len <= kMaxChunkSize);
      }
      break;
    case 5: {
      auto info = DecodePackInfo(value);
      if (info.ok()) FUZZ_CHECK(EncodePackInfo(*info) == value);
      break;
    }
  }
  return 0;
}
