#include "core/json.h"

#include <gtest/gtest.h>

#include <clocale>
#include <cmath>

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

TEST(Json, ValuesAreCountedAgainstTheirBound) {
  EXPECT_TRUE(Json::Parse("[1, [2, 3], {\"a\": 4}]", 7).ok());  // seven values: keys are not counted
  auto over = Json::Parse("[1, [2, 3], {\"a\": 4}]", 6);
  ASSERT_FALSE(over.ok());
  EXPECT_NE(over.status().message().find("more values than such a document may hold"), std::string::npos);
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

TEST(Json, NegativeZeroStaysADoubleThroughRoundTrips) {
  for (const char* text : {"-0.0", "-0", "-0e3", "-0.000"}) {
    auto j = Json::Parse(text);
    ASSERT_TRUE(j.ok()) << text;
    EXPECT_FALSE(j->is_int()) << text;
    EXPECT_TRUE(std::signbit(j->as_double())) << text;
    EXPECT_EQ(j->Dump(), "-0.0") << text;
    EXPECT_TRUE(*Json::Parse(j->Dump()) == *j);
  }
  auto zero = Json::Parse("0");
  ASSERT_TRUE(zero.ok());
  EXPECT_TRUE(zero->is_uint());
  EXPECT_EQ(zero->Dump(), "0");
}

TEST(Json, NumbersFollowTheGrammar) {
  for (const char* bad : {"-00.0", "00", "01", "-01", "1.", ".5", "1e", "1e+", "+1", "-", "0x10", "1.5.2", "--1"}) {
    EXPECT_FALSE(Json::Parse(bad).ok()) << bad;
  }
  for (const char* good : {"0", "-0.5", "0.25", "0e10", "10", "1E5", "1e-5", "123456789012345678901234567890"}) {
    EXPECT_TRUE(Json::Parse(good).ok()) << good;
  }
  // Too large for a double is an error; too small is zero.
  EXPECT_FALSE(Json::Parse("1e999").ok());
  EXPECT_FALSE(Json::Parse("-123456789e400").ok());
  EXPECT_EQ(Json::Parse("1e-999")->as_double(), 0.0);
  EXPECT_TRUE(std::signbit(Json::Parse("-1e-999")->as_double()));
  EXPECT_EQ(Json::Parse("0." + std::string(400, '0') + "1")->as_double(), 0.0);  // no exponent
  // Integers beyond 64 bits are doubles; those that fit stay exact.
  EXPECT_FALSE(Json::Parse("18446744073709551616")->is_uint());
  EXPECT_EQ(Json::Parse("-9223372036854775808")->as_int(), INT64_MIN);
}

TEST(Json, DoublesWriteBackExactlyAndStayDoubles) {
  for (double v : {3.0, 0.1, -2.5e-300, 1.7976931348623157e308, 5e-324, 123456789.125}) {
    const std::string text = Json(v).Dump();
    auto back = Json::Parse(text);
    ASSERT_TRUE(back.ok()) << text;
    EXPECT_FALSE(back->is_int()) << text;
    EXPECT_EQ(back->as_double(), v) << text;
    EXPECT_EQ(back->Dump(), text);
  }
  EXPECT_EQ(Json(3.0).Dump(), "3.0");
  EXPECT_FALSE(Json(3.0) == Json(uint64_t{3}));
}

TEST(Json, NumbersDoNotDependOnTheLocale) {
  // A locale whose decimal separator is a comma broke strtod/printf-based
  // parsing and writing. The setup script generates de_DE.UTF-8.
  const char* previous = std::setlocale(LC_NUMERIC, nullptr);
  const std::string saved = previous ? previous : "C";
  if (!std::setlocale(LC_NUMERIC, "de_DE.UTF-8")) GTEST_SKIP() << "locale de_DE.UTF-8 is not installed";
  auto j = Json::Parse("[2.5, 1e-3]");
  const std::string dumped = j.ok() ? j->Dump() : "";
  std::setlocale(LC_NUMERIC, saved.c_str());
  ASSERT_TRUE(j.ok()) << j.status().ToString();
  EXPECT_EQ(j->as_array()[0].as_double(), 2.5);
  EXPECT_EQ(dumped, "[2.5,0.001]");
}

}  // namespace
}  // namespace ckptfs
