// The per-chunk work of a save on one chunk of LLM-like values, in one
// thread, with every buffer allocated before the clock starts: the chunk's
// XXH3-128 id (ChunkId::Of) and byte grouping plus zstd (ckptfs's encoder),
// against plain zstd at level 1 on the same bytes, and all against memcpy
// of them, the floor of any pass over a chunk. Medians of --runs; minor
// page faults beside each.
//
//   build/tools/codec_bench [--mib 4] [--runs 200] [--input DTYPE:FILE:LABEL]...
//
// With --input, the chunk is the first --mib MiB of each FILE (values of
// DTYPE, such as BF16 or F32: a kind of state saved by a real training
// run, kinds_bench.py's) instead of the generated values.
#include <zstd.h>

#include "bench_util.h"
#include "codec/codec.h"
#include "core/chunk_id.h"
#include "core/dtype.h"

#include <fstream>
#include <iterator>


namespace {

using namespace ckptfs;
using Clock = std::chrono::steady_clock;

// Normal values of `dtype` (bf16 rounded from fp32), scaled as weights
// or moments are.
std::vector<std::byte> Values(size_t bytes, DType dtype, float scale) {
  const size_t n = bytes / DTypeSize(dtype);
  std::vector<float> values(n);
  bench::Rng rng{7};
  rng.Normals(values.data(), n, scale);
  std::vector<std::byte> out(bytes);
  if (dtype == DType::kF32) {
    std::memcpy(out.data(), values.data(), n * 4);
  } else {
    for (size_t i = 0; i < n; ++i) {
      const uint16_t h = bench::ToBf16(values[i]);
      std::memcpy(&out[2 * i], &h, 2);
    }
  }
  return out;
}

struct Figure {
  double gbps = 0;
  long long faults = 0;
};

template <typename Fn>
Figure Time(int runs, size_t bytes, Fn&& fn) {
  std::vector<double> t;
  const long long f0 = bench::MinorFaults(::getpid());
  for (int r = 0; r < runs; ++r) {
    const auto start = Clock::now();
    fn();
    t.push_back(std::chrono::duration<double>(Clock::now() - start).count());
  }
  const long long faults = bench::MinorFaults(::getpid()) - f0;
  std::sort(t.begin(), t.end());
  return {bytes / t[t.size() / 2] / 1e9, faults};
}

}  // namespace

int main(int argc, char** argv) {
  size_t mib = 4;
  int runs = 200;
  struct Input {
    DType dtype;
    std::string path, label;
  };
  std::vector<Input> inputs;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--mib") {
      mib = std::stoul(bench::NextArg(argc, argv, i));
    } else if (a == "--runs") {
      runs = std::stoi(bench::NextArg(argc, argv, i));
    } else if (a == "--input") {
      const std::string v = bench::NextArg(argc, argv, i);
      const size_t c1 = v.find(':'), c2 = v.rfind(':');
      const auto dtype = c1 == std::string::npos ? std::nullopt : ParseDType(v.substr(0, c1));
      if (!dtype || c2 == c1) {
        std::fprintf(stderr, "codec_bench: --input wants DTYPE:FILE:LABEL, not '%s'\n", v.c_str());
        return 2;
      }
      inputs.push_back({*dtype, v.substr(c1 + 1, c2 - c1 - 1), v.substr(c2 + 1)});
    } else {
      std::fprintf(stderr, "usage: codec_bench [--mib N] [--runs N] [--input DTYPE:FILE:LABEL]...\n");
      return a == "--help" ? 0 : 2;
    }
  }
  size_t bytes = mib << 20;
  // The chunk of each input: the first `bytes` of its file (all of a
  // shorter one), whole values.
  std::vector<std::vector<std::byte>> given;
  for (const Input& in : inputs) {
    std::ifstream f(in.path, std::ios::binary);
    std::vector<char> data((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    if (!f.eof() && f.fail()) {
      std::fprintf(stderr, "codec_bench: cannot read %s\n", in.path.c_str());
      return 1;
    }
    size_t n = std::min(bytes, data.size());
    n -= n % DTypeSize(in.dtype);
    if (n == 0) {
      std::fprintf(stderr, "codec_bench: %s holds no whole value\n", in.path.c_str());
      return 1;
    }
    given.emplace_back(reinterpret_cast<const std::byte*>(data.data()),
                       reinterpret_cast<const std::byte*>(data.data()) + n);
  }
  for (const auto& g : given) bytes = std::max(bytes, g.size());
  std::printf("one %zu MiB chunk, one thread, median of %d runs\n", mib, runs);
  std::printf("%-22s %10s %10s %10s %10s %10s %12s %12s\n", "values", "memcpy", "hash", "zstd -1", "ckptfs",
              "decode", "ckptfs/zstd", "stored z/c");
  const struct {
    const char* name;
    DType dtype;
    float scale;
  } kinds[] = {{"bf16 weights", DType::kBF16, 0.02f}, {"fp32 master weights", DType::kF32, 0.02f},
               {"fp32 Adam moments", DType::kF32, 1e-3f}};
  ChunkEncoder encoder({});
  ZSTD_CCtx* zc = ZSTD_createCCtx();
  std::vector<std::byte> copy(bytes), encoded(ZSTD_compressBound(bytes) + 4096), back(bytes);
  std::vector<char> zout(ZSTD_compressBound(bytes));
  struct Case {
    std::string name;
    DType dtype;
    std::vector<std::byte> raw;
  };
  std::vector<Case> cases;
  for (size_t i = 0; i < inputs.size(); ++i) cases.push_back({inputs[i].label, inputs[i].dtype, std::move(given[i])});
  if (cases.empty()) {
    for (const auto& k : kinds) cases.push_back({k.name, k.dtype, Values(bytes, k.dtype, k.scale)});
  }
  for (const Case& k : cases) {
    const std::vector<std::byte>& raw = k.raw;
    const size_t bytes = raw.size();
    const Figure mem = Time(runs, bytes, [&] { std::memcpy(copy.data(), raw.data(), bytes); });
    ChunkId id;
    const Figure h = Time(runs, bytes, [&] { id = ChunkId::Of(raw); });
    size_t zsize = 0;
    const Figure z = Time(runs, bytes, [&] { zsize = ZSTD_compressCCtx(zc, zout.data(), zout.size(), raw.data(), bytes, 1); });
    EncodedChunk enc{};
    const Figure c = Time(runs, bytes, [&] { enc = std::move(encoder.EncodeInto(raw, k.dtype, encoded)).value(); });
    const std::span<const std::byte> stored(encoded.data(), enc.size);
    back.resize(bytes);
    const Figure d = Time(runs, bytes, [&] {
      if (!DecodeChunk(enc.codec, stored, back).ok()) std::abort();
    });
    if (back != raw) {
      std::fprintf(stderr, "%s: the chunk did not decode to its bytes\n", k.name.c_str());
      return 1;
    }
    std::printf("%-22s %5.1f GB/s %5.1f GB/s %5.2f GB/s %5.2f GB/s %5.2f GB/s %11.2fx %6.3f/%.3f\n", k.name.c_str(),
                mem.gbps, h.gbps, z.gbps, c.gbps, d.gbps, c.gbps / z.gbps, double(zsize) / bytes,
                double(enc.size) / bytes);
    std::printf("%-22s minor faults: memcpy %lld, hash %lld, zstd %lld, ckptfs %lld, decode %lld (all runs); id %s\n",
                "", mem.faults, h.faults, z.faults, c.faults, d.faults, id.ToHex().c_str());
  }
  ZSTD_freeCCtx(zc);
  return 0;
}
