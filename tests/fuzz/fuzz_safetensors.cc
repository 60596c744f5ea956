// The safetensors header and the ckptfs.shards (or DCP_SHARDING_INFO) map
// inside it. The input is a header's JSON; the data section is taken to be
// as long as the largest offset the first 8 bytes allow, so offsets are
// checked against a size too.
#include "fuzz_util.h"
#include "io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ckptfs;
  if (size < 1) return 0;
  const uint64_t data_size = uint64_t{data[0]} << (data[0] % 48);
  auto header = ParseSafetensorsHeader(fuzz::AsText(data + 1, size - 1), data_size);
  if (!header.ok()) return 0;
  // A parsed header keeps its promises: sizes match, offsets in range, no overlap.
  uint64_t last_end = 0;
  for (const auto& t : header->tensors) {
    FUZZ_CHECK(t.begin <= t.end && t.end <= data_size);
    FUZZ_CHECK(t.begin >= last_end);
    last_end = t.end;
    FUZZ_CHECK(NumElements(t.shape) * DTypeSize(t.dtype) == t.end - t.begin);
  }
  auto shards = ShardsOfSafetensors(*header);
  if (!shards.ok()) return 0;
  FUZZ_CHECK(shards->size() == header->tensors.size());
  for (const auto& s : *shards) {
    FUZZ_CHECK(s.tensor < header->tensors.size());
    FUZZ_CHECK(ValidateRegion(s.global_shape, s.region).ok());
    // The stored tensor holds exactly the region's elements.
    FUZZ_CHECK(s.region.NumElements() == NumElements(header->tensors[s.tensor].shape), s.region.ToString());
  }
  // Widened to the extent of its shards (here one file's), every region
  // still lies inside its global shape.
  std::vector<std::vector<SafetensorsShard>> files = {*shards};
  if (WidenToExtents({&*header}, files).ok()) {
    for (const auto& s : files[0]) FUZZ_CHECK(ValidateRegion(s.global_shape, s.region).ok());
  }
  // The layout written back for these tensors parses to the same tensors.
  if (header->tensors.size() <= 64) {
    std::vector<TensorMeta> metas;
    for (const auto& t : header->tensors) metas.push_back({t.name, t.dtype, t.shape});
    SafetensorsLayout layout = LayoutSafetensors(metas, header->metadata);
    const std::string_view json(layout.header.data() + 8, layout.header.size() - 8);
    auto again = ParseSafetensorsHeader(json, layout.total_size - layout.header.size());
    FUZZ_CHECK(again.ok(), again.status().ToString());
    FUZZ_CHECK(again->tensors.size() == header->tensors.size());
    FUZZ_CHECK(again->metadata == header->metadata);
  }
  return 0;
}
