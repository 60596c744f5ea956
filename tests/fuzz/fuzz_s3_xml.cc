// S3 answers are the store's bytes: the XML helpers never read past their
// input, never return more than it holds, and find what a well-formed
// answer holds.
#include "backend/s3_xml.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ckptfs;
  const std::string_view xml = fuzz::AsText(data, size);
  size_t total = 0;
  for (std::string_view tag :
       {"Key", "UploadId", "NextContinuationToken", "IsTruncated", "Code", "Upload", "Contents", "ETag"}) {
    for (const std::string& v : XmlAll(xml, tag)) {
      FUZZ_CHECK(v.size() <= xml.size());
      total += v.size();
    }
    FUZZ_CHECK(XmlFirst(xml, tag).size() <= xml.size());
  }
  FUZZ_CHECK(total <= 8 * xml.size(), std::to_string(total));
  // Raw elements are views into the input, and do not overlap.
  const auto raw = XmlAllRaw(xml, "Contents");
  for (size_t i = 0; i < raw.size(); ++i) {
    FUZZ_CHECK(raw[i].data() >= xml.data() && raw[i].data() + raw[i].size() <= xml.data() + xml.size());
    if (i > 0) FUZZ_CHECK(raw[i].data() >= raw[i - 1].data() + raw[i - 1].size());
  }
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
  // ... and once only when read from the raw element holding it.
  const std::string listed = "<L><Contents><Key>" + escaped + "</Key><ETag>&quot;e&quot;</ETag></Contents></L>";
  const auto objects = XmlAllRaw(listed, "Contents");
  FUZZ_CHECK(objects.size() == 1);
  FUZZ_CHECK(XmlFirst(objects[0], "Key") == xml && XmlFirst(objects[0], "ETag") == "\"e\"");
  return 0;
}
