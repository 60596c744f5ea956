// S3 backend benchmark: one large object written through the backend's
// multipart writer and read back with ranged GETs (sequentially and from
// several threads, as chunk reads do), against s3cmd's multipart upload
// and download of the same bytes to the same server, in the same run.
//
//   eval "$(tools/s3-server.sh start /tmp/s3)"
//   build/tools/s3_bench --mib 512 --runs 3
//
// The server comes from AWS_ENDPOINT_URL and the credentials from
// AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY; s3cmd (Debian package) must be
// on PATH.
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "backend/store_url.h"
#include "bench_util.h"

using namespace ckptfs;
using bench::Check;
using bench::Median;
using bench::Seconds;
using Clock = std::chrono::steady_clock;

namespace {

int Run(const std::string& cmd) { return std::system(cmd.c_str()); }

}  // namespace

int main(int argc, char** argv) {
  uint64_t mib = 512;
  int runs = 3, threads = 8;
  std::string dir = "/tmp";
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&] { return bench::NextArg(argc, argv, i); };
    if (a == "--mib") mib = std::strtoull(next().c_str(), nullptr, 10);
    else if (a == "--runs") runs = std::atoi(next().c_str());
    else if (a == "--threads") threads = std::atoi(next().c_str());
    else if (a == "--dir") dir = next();
    else {
      std::printf("usage: s3_bench [--mib N] [--runs N] [--threads N] [--dir DIR]\n"
                  "Writes and reads one object through the S3 backend and with s3cmd, same bytes,\n"
                  "same server (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY).\n");
      return a == "--help" || a == "-h" ? 0 : 2;
    }
  }
  auto options = ObjectStoreOptions::FromEnvironment(std::getenv);
  Check(options.status(), "S3 settings");
  const std::string url = "s3://ckptfs-bench/s3-bench-" + std::to_string(::getpid());
  auto backend = std::move(OpenObjectStore(url, *options, /*create=*/true)).value();
  const std::string s3cmd = bench::S3cmd(*options);

  const uint64_t size = mib << 20;
  std::vector<std::byte> data(size);
  bench::Rng rng{7};
  for (size_t i = 0; i + 8 <= data.size(); i += 8) {
    uint64_t v = rng.Next();
    std::memcpy(&data[i], &v, 8);
  }
  const std::string file = dir + "/s3-bench-" + std::to_string(::getpid()) + ".bin";
  bench::TimedWrite(file, {std::span<const std::byte>(data)});
  std::printf("object: %llu MiB of random bytes; server %s; part size %llu MiB; %d reader threads\n",
              static_cast<unsigned long long>(mib), options->endpoint.c_str(),
              static_cast<unsigned long long>(options->part_size >> 20), threads);

  bench::RunFigures fig;
  std::vector<std::byte> out(size);
  for (int run = 0; run < runs; ++run) {
    auto t0 = Clock::now();
    auto w = std::move(backend->Create("packs/object")).value();
    for (uint64_t off = 0; off < size; off += 4 << 20) {
      Check(w->Append({data.data() + off, std::min<uint64_t>(4 << 20, size - off)}), "append");
    }
    Check(w->Commit(), "commit");
    const double tp = Seconds(t0);

    t0 = Clock::now();
    if (Run(s3cmd + " put " + file + " " + url + "/s3cmd-object") != 0) {
      std::fprintf(stderr, "s3cmd put failed\n");
      return 1;
    }
    const double tcp = Seconds(t0);

    // Sequential 4 MiB ranged GETs.
    t0 = Clock::now();
    bench::ReadInPieces(*backend, "packs/object", out, 1);
    const double tgs = Seconds(t0);
    if (out != data) {
      std::fprintf(stderr, "MISMATCH in sequential read\n");
      return 1;
    }
    // The same GETs from several threads.
    std::fill(out.begin(), out.end(), std::byte{0});
    t0 = Clock::now();
    bench::ReadInPieces(*backend, "packs/object", out, threads);
    const double tgp = Seconds(t0);
    if (out != data) {
      std::fprintf(stderr, "MISMATCH in parallel read\n");
      return 1;
    }

    t0 = Clock::now();
    if (Run(s3cmd + " get --force " + url + "/s3cmd-object - > /dev/null") != 0) {
      std::fprintf(stderr, "s3cmd get failed\n");
      return 1;
    }
    const double tcg = Seconds(t0);
    const double mb = size / 1e6;
    std::printf("run %d: put %.0f MB/s, s3cmd put %.0f MB/s (%.2fx); ranged GET sequential %.0f MB/s, "
                "%d threads %.0f MB/s, s3cmd get %.0f MB/s (%.2fx); bytes checked\n",
                run + 1, mb / tp, mb / tcp, tcp / tp, mb / tgs, threads, mb / tgp, mb / tcg, tcg / tgp);
    std::fflush(stdout);
    fig.Add("put", mb / tp);
    fig.Add("cmd_put", mb / tcp);
    fig.Add("get_seq", mb / tgs);
    fig.Add("get_par", mb / tgp);
    fig.Add("cmd_get", mb / tcg);
    fig.Add("put_ratio", tcp / tp);
    fig.Add("get_ratio", tcg / tgp);
    Check(backend->Delete("packs/object"), "delete");
  }
  std::filesystem::remove(file);
  (void)Run(s3cmd + " del " + url + "/s3cmd-object > /dev/null");
  std::printf("\nmedian of %d runs:\n", runs);
  std::printf("  backend multipart put   %6.0f MB/s   ratio to s3cmd put %.2f\n", fig.Median("put"),
              fig.Median("put_ratio"));
  std::printf("  s3cmd put               %6.0f MB/s\n", fig.Median("cmd_put"));
  std::printf("  ranged GETs, 1 thread   %6.0f MB/s\n", fig.Median("get_seq"));
  std::printf("  ranged GETs, %d threads  %6.0f MB/s   ratio to s3cmd get %.2f\n", threads, fig.Median("get_par"),
              fig.Median("get_ratio"));
  std::printf("  s3cmd get               %6.0f MB/s\n", fig.Median("cmd_get"));
  return 0;
}
