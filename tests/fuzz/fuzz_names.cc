// File names of the mount: every tensor name gives a legal, unique file name
// that unescapes back to it (unless shortened); unescaping never crashes.
#include "fuzz_util.h"
#include "io/file_names.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ckptfs;
  const std::string name(fuzz::AsText(data, size));
  (void)UnescapeName(name);
  for (std::string_view suffix : {"", ".npy"}) {
    const std::string file = FileNameFor(name, suffix);
    FUZZ_CHECK(file.size() <= 255, std::to_string(file.size()));
    FUZZ_CHECK(file.find('/') == std::string::npos);
    FUZZ_CHECK(file.find('\0') == std::string::npos);
    FUZZ_CHECK(file != "." && file != "..");
    FUZZ_CHECK(file.size() >= suffix.size() && file.compare(file.size() - suffix.size(), suffix.size(), suffix) == 0);
    const std::string stem = file.substr(0, file.size() - suffix.size());
    if (stem.find('~') == std::string::npos || stem.size() < 200) {
      auto back = UnescapeName(stem);
      FUZZ_CHECK(back.has_value() && *back == name, stem);
    }
  }
  return 0;
}
