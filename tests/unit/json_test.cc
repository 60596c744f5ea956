#include "core/json.h"

#include <gtest/gtest.h>

namespace ckptfs {
namespace {

TEST(Json, RoundTripsNestedValues) {
  auto j = Json::Parse(R"({"a": [1, -2, 3.5, true, null], "b": {"c": "x\"\\\n\u00e9"}, "big": 18446744073709551615})");
  ASSERT_TRUE(j.ok()) << j.status().ToString();
  EXPECT_EQ(j->Find("a")->as_array()[1].as_int(), -2);
  EXPECT_DOUBLE_EQ(j->Find("a")->as_array()[2].as_double(), 3.5);
  EXPECT_EQ(j->Find("b")->Find("c")->as_string(), "x\"\\\n\xc3\xa9");
  EXPECT_EQ(j->Find("big")->as_uint(), UINT64_MAX);
  auto again = Json::Parse(j->Dump());
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->Dump(), j->Dump());
}

TEST(Json, RejectsMalformedInputWithPosition) {
  for (const char* bad : {"", "{", "[1,]", "{\"a\" 1}", "{\"a\":1,\"a\":2}", "\"unterminated", "tru", "01x", "[1] 2",
                          "\"\\ud800\""}) {
    auto j = Json::Parse(bad);
    EXPECT_FALSE(j.ok()) << bad;
    if (!j.ok()) {
      EXPECT_NE(j.status().message().find("invalid JSON at byte"), std::string::npos);
    }
  }
  std::string deep(100, '[');
  EXPECT_FALSE(Json::Parse(deep).ok());
}

}  // namespace
}  // namespace ckptfs
