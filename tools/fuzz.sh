#!/usr/bin/env bash
# Builds the libFuzzer targets (clang 16 or newer, ASan+UBSan) in build-fuzz/ and runs
# each for SECONDS (default 20) on a scratch copy of its seed corpus
# (tests/fuzz/corpus/TARGET), two at a time. Exits 1 if any target finds a
# crash, a leak, a hang or a failed check; the input is kept in
# build-fuzz/findings/ and the target's log is printed.
#
#   tools/fuzz.sh [SECONDS] [TARGET...]
#
# A long campaign: tools/fuzz.sh 600. Reproduce a finding:
#   build-fuzz/tests/fuzz/TARGET build-fuzz/findings/TARGET-crash-...
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
SECONDS_EACH=${1:-20}
shift || true
JOBS=${JOBS:-$(nproc)}
PARALLEL=${FUZZ_PARALLEL:-2}

# The newest installed clang whose sanitizer and libFuzzer runtimes link.
clang_version=$(bash tools/check-tools.sh fuzz-clang)
echo "fuzz: clang-$clang_version"
(cd "$ROOT" && CC=clang-$clang_version CXX=clang++-$clang_version cmake --preset fuzz >/dev/null)
cmake --build build-fuzz -j "$JOBS"

targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=(fuzz_json fuzz_safetensors fuzz_shard_map fuzz_names fuzz_chunk_codec fuzz_pack_index fuzz_manifest
           fuzz_catalog_records fuzz_repository_pack fuzz_s3_xml fuzz_repository_config)
fi
work=build-fuzz/run
rm -rf "$work"
mkdir -p "$work" build-fuzz/findings
symbolizer=/usr/lib/llvm-$clang_version/bin/llvm-symbolizer
[ -x "$symbolizer" ] || symbolizer=$(command -v "llvm-symbolizer-$clang_version" || true)
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1${symbolizer:+:external_symbolizer_path=$symbolizer}
export UBSAN_OPTIONS=print_stacktrace=1

run_one() {
  local t=$1
  mkdir -p "$work/$t"
  cp tests/fuzz/corpus/"$t"/* "$work/$t"/
  # -rss_limit_mb bounds memory; -timeout turns a hang into a finding.
  if build-fuzz/tests/fuzz/"$t" -max_total_time="$SECONDS_EACH" -timeout=10 -rss_limit_mb=2048 \
       -print_final_stats=1 -artifact_prefix="$ROOT/build-fuzz/findings/$t-" "$work/$t" \
       >"$work/$t.log" 2>&1; then
    local execs cov
    execs=$(grep -oP 'stat::number_of_executed_units: \K[0-9]+' "$work/$t.log" || echo "?")
    cov=$(grep -oP '^#[0-9]+\s+DONE\s+cov: \K[0-9]+' "$work/$t.log" || echo "?")
    printf 'fuzz: %-22s ok   %10s runs in %ss, coverage %s edges\n' "$t" "$execs" "$SECONDS_EACH" "$cov"
  else
    printf 'fuzz: %-22s FAILED (log below; input in build-fuzz/findings/)\n' "$t"
    tail -n 60 "$work/$t.log"
    return 1
  fi
}

failed=0
pids=()
for t in "${targets[@]}"; do
  run_one "$t" &
  pids+=($!)
  if [ ${#pids[@]} -ge "$PARALLEL" ]; then
    wait "${pids[0]}" || failed=1
    pids=("${pids[@]:1}")
  fi
done
for p in "${pids[@]}"; do wait "$p" || failed=1; done
if [ "$failed" -ne 0 ]; then
  echo "fuzz: a target failed" >&2
  exit 1
fi
echo "fuzz: ${#targets[@]} targets ran ${SECONDS_EACH}s each without a finding"
