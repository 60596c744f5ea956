// The ckptfs.shards map of a sharded safetensors file (the __metadata__
// value `ckpt import` reads). The first byte picks the stored tensors' shapes;
// the rest is the map's JSON text. A map that is accepted gives, for every
// stored tensor, a region inside its global shape holding exactly the stored
// elements.
#include "fuzz_util.h"
#include "io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ckptfs;
  if (size < 1) return 0;
  static const Shape kShapes[][3] = {
      {{2, 3}, {3}, {}},
      {{4, 1, 5}, {0, 7}, {1}},
      {{3, 5}, {15}, {2, 2, 2}},
  };
  const auto& shapes = kShapes[data[0] % 3];
  SafetensorsHeader header;
  const char* names[] = {"w", "b", "s"};
  uint64_t offset = 0;
  for (int i = 0; i < 3; ++i) {
    const uint64_t bytes = NumElements(shapes[i]) * 4;
    header.tensors.push_back({names[i], DType::kF32, shapes[i], offset, offset + bytes});
    offset += bytes;
  }
  header.metadata.emplace_back(kShardsMetadataKey, std::string(fuzz::AsText(data + 1, size - 1)));
  auto shards = ShardsOfSafetensors(header);
  if (!shards.ok()) {
    FUZZ_CHECK(shards.status().code() == StatusCode::kInvalidArgument, shards.status().ToString());
    return 0;
  }
  FUZZ_CHECK(shards->size() == header.tensors.size());
  for (const auto& s : *shards) {
    FUZZ_CHECK(ValidateRegion(s.global_shape, s.region).ok(), s.region.ToString());
    FUZZ_CHECK(s.region.NumElements() == NumElements(header.tensors[s.tensor].shape), s.region.ToString());
  }
  return 0;
}
