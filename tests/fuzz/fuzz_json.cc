// The JSON parser (safetensors headers, the shard map, the config file):
// any input parses or gives an error; what parses writes back to text that
// parses to the same value, and writing is then stable.
#include "core/json.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ckptfs;
  auto first = Json::Parse(fuzz::AsText(data, size));
  if (!first.ok()) {
    FUZZ_CHECK(first.status().message().find("invalid JSON at byte") != std::string::npos);
    return 0;
  }
  for (int indent : {-1, 2}) {
    const std::string text = first->Dump(indent);
    auto second = Json::Parse(text);
    FUZZ_CHECK(second.ok(), second.status().ToString() + " in " + text);
    FUZZ_CHECK(*second == *first, text);
    FUZZ_CHECK(second->Dump(indent) == text, text);
  }
  return 0;
}
