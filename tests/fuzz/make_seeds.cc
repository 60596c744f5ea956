// Writes the seed corpora of the fuzz targets from valid files of every
// kind: tests/fuzz/make_seeds OUTDIR writes OUTDIR/<target>/<seed>.
// The corpora in tests/fuzz/corpus were made with it.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "ckpt/repository_impl.h"
#include "codec/codec.h"
#include "core/json.h"
#include "fuzz_repo.h"
#include "io/safetensors.h"

namespace fs = std::filesystem;
using namespace ckptfs;

namespace {
std::string out_dir;

void Write(const std::string& target, const std::string& name, std::string_view bytes) {
  fs::create_directories(out_dir + "/" + target);
  std::ofstream(out_dir + "/" + target + "/" + name, std::ios::binary).write(bytes.data(), bytes.size());
}

std::string ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

TensorRecord SampleTensor(bool flat) {
  TensorRecord t{"layers.0.attn.weight", DType::kBF16, {8, 6}, {}};
  ShardRecord a, b;
  ChunkId id;
  for (int i = 0; i < 16; ++i) id.bytes[i] = static_cast<uint8_t>(i);
  if (flat) {
    a.region = Region::OfFlat(0, 20);
    b.region = Region::OfFlat(20, 48);
    a.chunks = {{id, 40}};
    b.chunks = {{id, 16}, {id, 40}};
  } else {
    a.region = Region::OfBox({{0, 0}, {8, 3}});
    b.region = Region::OfBox({{0, 3}, {8, 3}});
    a.chunks = {{id, 48}};
    b.chunks = {{id, 32}, {id, 16}};
  }
  a.ranks = {0};
  b.ranks = {1};
  for (auto* s : {&a, &b}) s->ComputeStarts();
  t.shards = {a, b};
  return t;
}
}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_seeds OUTDIR\n");
    return 2;
  }
  out_dir = argv[1];

  // JSON and safetensors headers, with and without a shard map.
  std::vector<TensorMeta> metas = {{"w", DType::kBF16, {2, 3}}, {"b", DType::kF32, {3}}, {"s", DType::kI64, {}}};
  Json shards = Json::MakeObject();
  Json box = Json::MakeObject();
  box.Set("global_shape", Json::Parse("[4, 3]").value());
  box.Set("offsets", Json::Parse("[2, 0]").value());
  shards.Set("w", box);
  Json flat = Json::MakeObject();
  flat.Set("global_shape", Json::Parse("[2, 5]").value());
  flat.Set("flat_start", uint64_t{4});
  shards.Set("b", flat);
  // And as torch's HuggingFaceStorageWriter places a rank's tensors.
  Json dcp = Json::MakeObject();
  Json at = Json::MakeObject();
  at.Set("saved_offsets", Json::Parse("[2, 0]").value());
  dcp.Set("w", at);
  int n = 0;
  for (const auto& meta : std::vector<std::vector<std::pair<std::string, std::string>>>{
           {}, {{"format", "pt"}}, {{kShardsMetadataKey, shards.Dump()}}, {{kDcpShardingMetadataKey, dcp.Dump()}}}) {
    SafetensorsLayout layout = LayoutSafetensors(metas, meta);
    std::string header = layout.header.substr(8);
    Write("fuzz_json", "header" + std::to_string(n), header);
    Write("fuzz_safetensors", "header" + std::to_string(n), std::string(1, '\x10') + header);
    ++n;
  }
  Write("fuzz_json", "numbers", R"([0, -0.0, 1.5e300, -12, 18446744073709551615, 3.25, 1e-320, "\u00e9\ud83d\ude00"])");
  Write("fuzz_json", "shards", shards.Dump(2));
  Write("fuzz_shard_map", "box-and-flat", std::string(1, '\0') + shards.Dump());
  Write("fuzz_shard_map", "flat-3d",
        std::string(1, '\2') + R"({"b": {"global_shape": [4, 5], "flat_start": 3}, "s": {"global_shape": [4, 2, 2], "offsets": [2, 0, 0]}})");

  // File names.
  Write("fuzz_names", "plain", "model.layers.0.mlp.weight");
  Write("fuzz_names", "escapes", std::string("a/b%c\x01~.", 9));
  Write("fuzz_names", "long", std::string(300, 'x'));

  // Chunks: stored forms of every codec (decode mode) and raw data of
  // several dtypes (round-trip mode).
  ChunkEncoder encoder(CodecOptions{});
  for (DType dtype : {DType::kBF16, DType::kF32, DType::kF64, DType::kI32, DType::kU8}) {
    auto raw = fuzz::Bytes(4096, static_cast<uint32_t>(dtype), 1);
    std::string stored;
    Codec codec = encoder.Encode(raw, dtype, &stored).value();
    std::string in = {static_cast<char>(static_cast<uint8_t>(dtype)), static_cast<char>(codec),
                      static_cast<char>(raw.size() & 0xff), static_cast<char>(raw.size() >> 8)};
    Write("fuzz_chunk_codec", "decode-" + std::string(DTypeName(dtype)), in + stored);
    std::string rt = {static_cast<char>(0x80 | static_cast<uint8_t>(dtype)), 7, 0, 1};
    rt.append(reinterpret_cast<const char*>(raw.data()), 1024);
    Write("fuzz_chunk_codec", "roundtrip-" + std::string(DTypeName(dtype)), rt);
  }

  // A real repository: its pack, its manifest and its catalog records.
  const std::string tmp = fs::temp_directory_path() / ("ckptfs-seeds-" + std::to_string(::getpid()));
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  fuzz::SmallRepository small = fuzz::MakeSmallRepository(tmp + "/repo");
  const std::string pack = ReadFile(small.pack_file);
  Write("fuzz_repository_pack", "pack", pack);
  Write("fuzz_pack_index", "pack", pack);
  const std::string manifest = ReadFile(small.path + "/objects/manifests/c.manifest");
  Write("fuzz_manifest", "small", manifest.substr(8, manifest.size() - 16));
  Manifest m;
  m.checkpoint.name = "step-100";
  m.checkpoint.step = 100;
  m.checkpoint.world_size = 2;
  m.checkpoint.state = CheckpointState::kCommitted;
  m.checkpoint.committed_ranks = {0, 1};
  m.checkpoint.tags = {{"run", "a"}};
  m.tensors = {SampleTensor(false), SampleTensor(true)};
  m.tensors[1].name = "flat";
  BlobRecord blob{"rng", 56, {{ChunkId{}, 56}}};
  m.blobs = {blob};
  const std::string crafted = EncodeManifest(m);
  Write("fuzz_manifest", "sharded", crafted.substr(8, crafted.size() - 16));

  auto record = [](int type, const std::string& value) { return std::string(1, static_cast<char>(type)) + value; };
  Write("fuzz_catalog_records", "checkpoint", record(0, EncodeCheckpoint(m.checkpoint)));
  Write("fuzz_catalog_records", "tensor-box", record(1, EncodeTensor(m.tensors[0])));
  Write("fuzz_catalog_records", "tensor-flat", record(1, EncodeTensor(m.tensors[1])));
  Write("fuzz_catalog_records", "blob", record(2, EncodeBlob(blob)));
  RankRecord rank{1, {m.tensors[0]}, {blob}};
  Write("fuzz_catalog_records", "rank", record(3, EncodeRank(rank)));
  Write("fuzz_catalog_records", "location",
        record(4, EncodeChunkLocation(ChunkLocation{"0123456789abcdef01234567", 16, 900, 4096, Codec::kByteGroupZstd})));
  Write("fuzz_catalog_records", "pack-info", record(5, EncodePackInfo({1 << 20, 12})));
  fs::remove_all(tmp);
  return 0;
}
