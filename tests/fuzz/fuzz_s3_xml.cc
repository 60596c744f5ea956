// S3 answers are the store's bytes: the XML helpers never read past their
// input, never return more than it holds, and find what a well-formed
// answer holds.
#include "backend/s3_xml.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ckptfs;
  const std::string_view xml = fuzz::AsText(data, size);
  size_t total = 0;
  for (std::string_view tag : {"Key", "UploadId", "NextContinuationToken", "IsTruncated", "Code", "Upload"}) {
    for (const std::string& v : XmlAll(xml, tag)) {
      FUZZ_CHECK(v.size() <= xml.size());
      total += v.size();
    }
    FUZZ_CHECK(XmlFirst(xml, tag).size() <= xml.size());
  }
  FUZZ_CHECK(total <= 6 * xml.size(), std::to_string(total));
  FUZZ_CHECK(XmlUnescape(xml).size() <= xml.size());
  // A value wrapped in a tag comes back unchanged once escaped.
  std::string escaped;
  for (char c : xml) {
    if (c == '&') escaped += "&amp;";
    else if (c == '<') escaped += "&lt;";
    else if (c == '>') escaped += "&gt;";
    else escaped += c;
  }
  const std::string wrapped = "<R><Key>" + escaped + "</Key></R>";
  FUZZ_CHECK(XmlFirst(wrapped, "Key") == xml);
  return 0;
}
