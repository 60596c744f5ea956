#!/usr/bin/env bash
# Developer entry point: installs what ckptfs needs, builds it, and runs the
# demo or the whole test suite.
#
#   tools/dev.sh demo   set up, build, and run the demo on a local repository
#   tools/dev.sh test   set up, build (plain, ASan+UBSan, TSan, fuzz), and run every
#                       test, then each fuzz target for 12 s
#   tools/dev.sh build  set up and build (build/)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
JOBS=${JOBS:-$(nproc)}

setup() { bash tools/setup-debian.sh; }

configure_build() {  # dir, extra cmake args...
  local dir=$1; shift
  cmake -S "$ROOT" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DPython3_EXECUTABLE=/usr/bin/python3 "$@" >/dev/null
  cmake --build "$dir" -j "$JOBS"
}

cmd=${1:-}
case "$cmd" in
  build)
    setup
    configure_build build
    ;;
  demo)
    setup
    configure_build build -DCKPTFS_BUILD_TESTS=OFF
    bash tools/demo.sh "$ROOT/build/tools/ckpt"
    ;;
  test)
    setup
    # Tests on explicitly: the demo configures the same build/ without them.
    configure_build build -DCKPTFS_BUILD_TESTS=ON
    # A real S3 server (Ceph RGW on loopback) for the S3 backend's tests, up
    # until the last stage; they fail rather than skip without it.
    s3_dir=$(mktemp -d /tmp/ckptfs-s3.XXXXXX)
    trap 'bash tools/s3-server.sh stop "$s3_dir" || true; rm -rf "$s3_dir"' EXIT
    echo "== starting a Ceph RGW S3 server (tools/s3-server.sh)"
    if ! s3_env=$(bash tools/s3-server.sh start "$s3_dir" 2>"$s3_dir.log"); then
      cat "$s3_dir.log" >&2
      exit 1
    fi
    rm -f "$s3_dir.log"
    eval "$s3_env"
    export CKPTFS_REQUIRE_S3=1
    echo "== tests (release build)"
    ctest --test-dir build --output-on-failure --no-tests=error -j "$JOBS" -LE "gpu|device"
    echo "== GPU and device tests (labels gpu, device: a GPU, or torch >= 2.4 for DCP; where"
    echo "   those are missing, each test says so and is skipped)"
    gpu_log=$(mktemp)
    if ! ctest --test-dir build --output-on-failure --no-tests=error -L "gpu|device" -V >"$gpu_log" 2>&1; then
      cat "$gpu_log"
      exit 1
    fi
    grep -E "Test +#[0-9]+:|skipped:|skipped '|tests passed" "$gpu_log" || true
    rm -f "$gpu_log"
    # The sanitizer builds compile as unity builds (several sources per
    # compiler run): half the build time on two cores.
    echo "== engine unit tests under ASan+UBSan"
    configure_build build-asan -DCKPTFS_SANITIZE=ON -DCKPTFS_UNIT_TESTS_ONLY=ON -DCMAKE_UNITY_BUILD=ON
    ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
      ctest --test-dir build-asan --output-on-failure --no-tests=error -j "$JOBS" -L unit
    echo "== engine unit tests under TSan"
    configure_build build-tsan -DCKPTFS_SANITIZE_THREAD=ON -DCKPTFS_UNIT_TESTS_ONLY=ON -DCMAKE_UNITY_BUILD=ON
    TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 \
      ctest --test-dir build-tsan --output-on-failure --no-tests=error -j "$JOBS" -L unit
    echo "== fuzz targets, 12 s each (clang-16, ASan+UBSan)"
    bash tools/fuzz.sh 12
    ;;
  *)
    echo "usage: tools/dev.sh demo|test|build" >&2
    exit 2
    ;;
esac
