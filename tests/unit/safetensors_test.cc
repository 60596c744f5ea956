#include "io/safetensors.h"

#include <gtest/gtest.h>

#include <cstring>
#include <fstream>

#include "test_util.h"

namespace ckptfs {
namespace {

using testing::TempDir;

std::string File(const std::string& header, const std::string& data) {
  uint64_t n = header.size();
  return std::string(reinterpret_cast<const char*>(&n), 8) + header + data;
}

Status OpenBytes(const TempDir& dir, const std::string& bytes) {
  std::string path = dir / "f.safetensors";
  std::ofstream(path, std::ios::binary) << bytes;
  return SafetensorsFile::Open(path).status();
}

TEST(Safetensors, ParsesTensorsAndMetadata) {
  auto h = ParseSafetensorsHeader(
      R"({"__metadata__": {"format": "pt"}, "b": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [8, 16]},
          "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "s": {"dtype": "I64", "shape": [], "data_offsets": [16, 24]}})",
      24);
  ASSERT_OK(h);
  ASSERT_EQ(h->tensors.size(), 3u);
  EXPECT_EQ(h->tensors[0].name, "a");  // data order
  EXPECT_EQ(h->tensors[1].dtype, DType::kBF16);
  EXPECT_TRUE(h->tensors[2].shape.empty());
  EXPECT_EQ(h->metadata[0].second, "pt");
}

TEST(Safetensors, RejectsMalformedHeaders) {
  struct Case {
    const char* json;
    uint64_t data;
    const char* expect;
  } cases[] = {
      {"{", 0, "not valid JSON"},
      {"[]", 0, "not a JSON object"},
      {R"({"a": {"dtype": "F33", "shape": [1], "data_offsets": [0, 4]}})", 4, "unknown dtype 'F33'"},
      {R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", 4, "past the end"},
      {R"({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})", 8, "needs 12 bytes"},
      {R"({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}})", 4, "non-negative"},
      {R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}})", 8, "reversed"},
      {R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})", 8, "share bytes"},
      {R"({"a": {"dtype": "F32", "shape": [1]}})", 4, "data_offsets"},
      {R"({"__metadata__": {"k": 1}})", 0, "not a string"},
  };
  for (const auto& c : cases) {
    auto h = ParseSafetensorsHeader(c.json, c.data);
    ASSERT_FALSE(h.ok()) << c.json;
    EXPECT_NE(h.status().message().find(c.expect), std::string::npos) << h.status().message();
  }
}

TEST(Safetensors, AHeaderOfTinyValuesIsRefusedBeforeItCostsGigabytes) {
  // 10 MiB of "0," would be 5 Mi JSON nodes (about half a gigabyte).
  std::string tiny = R"({"__metadata__": {"k": "v"}, "x": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}, "a": [)";
  while (tiny.size() < (10u << 20)) tiny += "0,";
  tiny += "0]}";
  auto h = ParseSafetensorsHeader(tiny, 0);
  ASSERT_FALSE(h.ok());
  EXPECT_NE(h.status().message().find("more values than such a document may hold"), std::string::npos)
      << h.status().message();
  // A real header of many tensors is far below the bound.
  std::string many = "{";
  for (int i = 0; i < 20000; ++i) {
    if (i) many += ",";
    many += "\"layer." + std::to_string(i) + R"(.w": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]})";
  }
  many += "}";
  auto ok = ParseSafetensorsHeader(many, 0);
  ASSERT_OK(ok);
  EXPECT_EQ(ok->tensors.size(), 20000u);
}

TEST(Safetensors, RejectsBadFiles) {
  TempDir dir;
  EXPECT_FALSE(OpenBytes(dir, "abc").ok());                          // too short
  EXPECT_OK(OpenBytes(dir, File("{}", "")));  // an empty checkpoint is valid
  std::string huge_len(8, '\xff');
  EXPECT_NE(OpenBytes(dir, huge_len + "{}").message().find("bad header length"), std::string::npos);
  std::string truncated = File(R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", std::string(8, 'x'));
  EXPECT_NE(OpenBytes(dir, truncated).message().find("truncated"), std::string::npos);
  EXPECT_TRUE(SafetensorsFile::Open(dir / "missing").status().IsNotFound());
}

TEST(Safetensors, LayoutIsParseableAndAligned) {
  std::vector<TensorMeta> ts = {{"x", DType::kF32, {2, 3}}, {"y/z", DType::kBF16, {}}, {"e", DType::kU8, {0}}};
  auto layout = LayoutSafetensors(ts, {{"step", "5"}});
  EXPECT_EQ(layout.header.size() % 8, 0u);
  EXPECT_EQ(layout.total_size, layout.header.size() + 24 + 2);
  uint64_t n;
  std::memcpy(&n, layout.header.data(), 8);
  auto h = ParseSafetensorsHeader(layout.header.substr(8, n), 26);
  ASSERT_OK(h);
  EXPECT_EQ(h->tensors.size(), 3u);
  EXPECT_EQ(layout.offsets[1], layout.header.size() + 24);
}

// torch's HuggingFaceStorageWriter writes one file per rank whose
// DCP_SHARDING_INFO gives each tensor's offsets and no global shape: the
// shape is the extent of all of the tensor's shards.
TEST(Safetensors, DcpShardingInfoPlacesShardsAndTheirExtentIsTheShape) {
  auto rank_file = [](const std::string& offsets_w, uint64_t rows_w, const std::string& extra) {
    const std::string info = "{\\\"w\\\": {\\\"saved_offsets\\\": " + offsets_w + "}" + extra + "}";
    return R"({"__metadata__": {"DCP_SHARDING_INFO": ")" + info + R"(", "format": "pt"}, )" +
           R"("w": {"dtype": "F32", "shape": [)" + std::to_string(rows_w) + R"(, 6], "data_offsets": [0, )" +
           std::to_string(rows_w * 24) + "]}}";
  };
  auto a = ParseSafetensorsHeader(rank_file("[0, 0]", 3, ""), 72);
  auto b = ParseSafetensorsHeader(rank_file("[3, 0]", 2, ""), 48);
  ASSERT_OK(a);
  ASSERT_OK(b);
  auto sa = ShardsOfSafetensors(*a), sb = ShardsOfSafetensors(*b);
  ASSERT_OK(sa);
  ASSERT_OK(sb);
  ASSERT_TRUE((*sa)[0].extent_only);
  EXPECT_EQ((*sb)[0].region.ToString(), Region::OfBox(Box{{3, 0}, {2, 6}}).ToString());
  std::vector<std::vector<SafetensorsShard>> files = {*sa, *sb};
  ASSERT_OK(WidenToExtents({&*a, &*b}, files));
  EXPECT_EQ(files[0][0].global_shape, (Shape{5, 6}));
  EXPECT_EQ(files[1][0].global_shape, (Shape{5, 6}));
  // Malformed: offsets of another rank than the stored shape, a name the
  // file lacks, no saved_offsets.
  const std::string other = ", \\\"v\\\": {\\\"saved_offsets\\\": [0]}";
  for (const std::string& bad : {rank_file("[0]", 3, ""), rank_file("[0, 0]", 3, other), rank_file("{}", 3, "")}) {
    auto h = ParseSafetensorsHeader(bad, 72);
    ASSERT_OK(h);
    auto shards = ShardsOfSafetensors(*h);
    EXPECT_EQ(shards.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(shards.status().message().find("DCP_SHARDING_INFO"), std::string::npos) << shards.status().ToString();
  }
  // A tensor placed by offsets in one file and whole in another is refused.
  auto whole = ParseSafetensorsHeader(R"({"w": {"dtype": "F32", "shape": [5, 6], "data_offsets": [0, 120]}})", 120);
  ASSERT_OK(whole);
  auto sw = ShardsOfSafetensors(*whole);
  ASSERT_OK(sw);
  std::vector<std::vector<SafetensorsShard>> mixed = {*sa, *sw};
  Status st = WidenToExtents({&*a, &*whole}, mixed);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("others hold it whole"), std::string::npos) << st.ToString();
}

TEST(Npy, HeaderFollowsTheFormat) {
  std::string h = NpyHeader(DType::kBF16, {3});
  EXPECT_EQ(h.size() % 64, 0u);
  EXPECT_EQ(h.substr(0, 6), "\x93NUMPY");
  EXPECT_NE(h.find("'descr': '<u2'"), std::string::npos);
  EXPECT_NE(h.find("'shape': (3,)"), std::string::npos);
  EXPECT_EQ(h.back(), '\n');
  EXPECT_NE(NpyHeader(DType::kF32, {}).find("'shape': ()"), std::string::npos);
  EXPECT_NE(NpyHeader(DType::kF32, {2, 3}).find("'shape': (2, 3)"), std::string::npos);
}

}  // namespace
}  // namespace ckptfs
