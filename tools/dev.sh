#!/usr/bin/env bash
# Developer entry point: installs what ckptfs needs, builds it, and runs the
# demo or the whole test suite.
#
#   tools/dev.sh demo   set up, build, and run the demo on a local repository
#   tools/dev.sh test   set up, build (plain, ASan+UBSan, TSan, fuzz), and run every
#                       test, then each fuzz target for 6 s
#   tools/dev.sh build  set up and build (build/; the Python package for build/venv)
#   tools/dev.sh check  the inner loop, after a build or a test run: release build,
#                       unit tests, and the CLI, gc and Python package tests
#                       (no set-up, no sanitizers, no S3 server, no wheel)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
JOBS=${JOBS:-$(nproc)}

# Each stage prints its name when it starts and its time when it ends; the
# times are listed again at the end.
stage_names=()
stage_times=()
stage_start=0
stage_begin() { stage_name=$1; stage_start=$SECONDS; echo "== $1"; }
stage_end() {
  local took=$((SECONDS - stage_start))
  echo "-- $stage_name: ${took} s"
  stage_names+=("$stage_name")
  stage_times+=("$took")
}
stage_summary() {
  local i
  [ ${#stage_names[@]} -gt 0 ] || return 0
  echo "== stage times (total ${SECONDS} s)"
  for i in "${!stage_names[@]}"; do printf '%6d s  %s\n' "${stage_times[$i]}" "${stage_names[$i]}"; done
}

# Every test's time, from each ctest run's log, for the slowest-tests list
# at the end of the test command.
test_times=/tmp/ckptfs-test-times.$$
record_test_times() {  # build dir, stage label
  local log=$1/Testing/Temporary/LastTest.log
  [ -f "$log" ] || return 0
  awk -v stage="$2" '/^[0-9]+\/[0-9]+ Testing: /{name=$3} /^Test time = /{printf "%8.1f s  %s (%s)\n", $4, name, stage}' \
    "$log" >>"$test_times"
}
slowest_tests() {
  [ -s "$test_times" ] || return 0
  echo "== the 10 slowest tests"
  sort -rn "$test_times" >"$test_times.sorted"
  head -n 10 "$test_times.sorted"
  rm -f "$test_times" "$test_times.sorted"
}

setup() {  # demo|test
  stage_begin "set-up (tools/setup-debian.sh) and tool check"
  bash tools/setup-debian.sh
  bash tools/check-tools.sh "$1"
  stage_end
}

configure_build() {  # preset (CMakePresets.json), extra cmake args...
  local preset=$1; shift
  (cd "$ROOT" && cmake --preset "$preset" "$@" >/dev/null && cmake --build --preset "$preset" -j "$JOBS")
}

# The Python test environment: a venv inside the build tree with the pinned
# requirements of tests/python/requirements.txt. torch comes from a wheel
# on this machine when one is there (the CPU build), so that no CUDA build
# of several GB is downloaded by surprise.
VENV=$ROOT/build/venv
python_env() {
  stage_begin "Python test environment (build/venv, tests/python/requirements.txt)"
  if [ ! -x "$VENV/bin/python" ]; then
    "$(bash tools/check-tools.sh python)" -m venv "$VENV"
  fi
  local torch_pin
  torch_pin=$(grep -E '^torch==' tests/python/requirements.txt)
  if ! "$VENV/bin/pip" install -q --no-index --no-deps "$torch_pin" 2>/dev/null; then
    echo "python env: no local wheel for $torch_pin; pip takes it from the package index"
  fi
  "$VENV/bin/pip" install -q -r tests/python/requirements.txt
  "$VENV/bin/pip" install -q --no-deps -r tests/python/requirements-no-deps.txt
  "$VENV/bin/python" -c 'import sys, torch, numpy
print(f"python env: Python {sys.version.split()[0]}, torch {torch.__version__}, numpy {numpy.__version__}")'
  stage_end
}
# CMake arguments that build the Python package for the venv.
python_args() {
  echo "-DPython3_EXECUTABLE=$VENV/bin/python -Dpybind11_DIR=$("$VENV/bin/python" -m pybind11 --cmakedir)"
}
# The wheel, built by pip from the release build tree (nothing recompiles),
# and installed into the venv: what `pip install .` gives a user.
python_wheel() {
  stage_begin "Python package: wheel built from build/, installed into build/venv"
  rm -rf build/wheels
  "$VENV/bin/pip" wheel -q --no-deps --no-build-isolation -C build-dir=build \
    -C cmake.define.CKPTFS_BUILD_PROGRESS=OFF -w build/wheels .
  "$VENV/bin/pip" install -q --no-deps --force-reinstall build/wheels/ckptfs-*.whl
  # pip's configure leaves the wheel's staging paths in build/'s cache; a
  # plain `cmake --install build` must not use them.
  cmake -U 'SKBUILD*' -S "$ROOT" -B build >/dev/null
  ls build/wheels
  export CKPTFS_REQUIRE_WHEEL=1
  stage_end
}

cmd=${1:-}
case "$cmd" in
  build)
    setup test
    python_env
    # shellcheck disable=SC2046
    configure_build default $(python_args)
    ;;
  demo)
    setup demo
    stage_begin "build (build/)"
    configure_build default -DCKPTFS_BUILD_TESTS=OFF
    stage_end
    stage_begin "demo (tools/demo.sh)"
    bash tools/demo.sh "$ROOT/build/tools/ckpt"
    stage_end
    stage_summary
    ;;
  test)
    setup test
    stage_begin "source rules: layers, no environment reads in the engine, Python imports (tools/check_source.py)"
    python3 tools/check_source.py
    stage_end
    python_env
    stage_begin "release build with tests (build/)"
    # Tests on explicitly: the demo configures the same build/ without them.
    # shellcheck disable=SC2046
    configure_build default -DCKPTFS_BUILD_TESTS=ON $(python_args)
    stage_end
    python_wheel
    # A real S3 server (Ceph RGW on loopback) for the S3 backend's tests, up
    # until the last stage; they fail rather than skip without it.
    s3_dir=$(mktemp -d /tmp/ckptfs-s3.XXXXXX)
    trap 'bash tools/s3-server.sh stop "$s3_dir" || true; rm -rf "$s3_dir"; slowest_tests; stage_summary' EXIT
    stage_begin "start a Ceph RGW S3 server (tools/s3-server.sh)"
    if ! s3_env=$(bash tools/s3-server.sh start "$s3_dir" 2>"$s3_dir.log"); then
      cat "$s3_dir.log" >&2
      exit 1
    fi
    rm -f "$s3_dir.log"
    eval "$s3_env"
    export CKPTFS_REQUIRE_S3=1
    stage_end
    stage_begin "tests (release build)"
    # Twice as many slots as cores: the unit tests mostly wait (for the
    # S3 server, for leases and retries to expire), and the tests that keep
    # cores busy (several processes, torch) take two slots each
    # (PROCESSORS in tests/CMakeLists.txt).
    ctest --test-dir build --output-on-failure --no-tests=error -j "$((JOBS * 2))" -LE "gpu|device"
    record_test_times build release
    stage_end
    stage_begin "install, then embed the engine as a program would (find_package and pkg-config; tests/install)"
    inst=$(mktemp -d /tmp/ckptfs-install.XXXXXX)
    cmake --install build --prefix "$inst/prefix" >/dev/null
    cmake -S tests/install -B "$inst/build" -G Ninja -DCMAKE_PREFIX_PATH="$inst/prefix" >/dev/null
    cmake --build "$inst/build"
    "$inst/build/consumer" "$inst/repo-cmake"
    pc_dir=$(dirname "$(find "$inst/prefix" -name ckptfs.pc)")
    # shellcheck disable=SC2046
    c++ -O1 tests/install/consumer.cc -o "$inst/consumer-pc" $(PKG_CONFIG_PATH="$pc_dir" pkg-config --cflags --libs ckptfs)
    "$inst/consumer-pc" "$inst/repo-pkg-config"
    rm -rf "$inst"
    stage_end
    stage_begin "GPU and device tests (labels gpu, device)"
    echo "   (a GPU, or torch >= 2.4 for DCP; where those are missing, each test says so and is skipped)"
    gpu_log=$(mktemp)
    if ! ctest --test-dir build --output-on-failure --no-tests=error -L "gpu|device" -V >"$gpu_log" 2>&1; then
      cat "$gpu_log"
      exit 1
    fi
    grep -E "Test +#[0-9]+:|skipped:|skipped '|tests passed" "$gpu_log" || true
    rm -f "$gpu_log"
    stage_end
    # The sanitizer builds compile as unity builds (several sources per
    # compiler run) at -O1 -g1: a quarter of the build time of -O2 -g file
    # by file on two cores. Under the sanitizers the suites parametrised by
    # backend leave out the in-memory store: above the backend it takes the
    # object-store path that the S3 instances (against the RGW, up until
    # the last stage) take too, with the HTTP client's threads besides; the
    # release stage runs every instance.
    SANITIZER_SKIP='/memory$'
    stage_begin "engine unit tests under ASan+UBSan (build-asan/, with the Python module)"
    # shellcheck disable=SC2046
    configure_build asan -DCKPTFS_SANITIZED_PYTHON=ON $(python_args)
    ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
      ctest --test-dir build-asan --output-on-failure --no-tests=error -j "$JOBS" -L unit -E "$SANITIZER_SKIP"
    record_test_times build-asan ASan+UBSan
    stage_end
    stage_begin "Python package under ASan+UBSan: random buffer layouts (build-asan/python)"
    # Only the module is instrumented (built by the stage above, beside the
    # unit tests); the interpreter is not, so the sanitizer runtimes are
    # preloaded and leak checks (CPython's own) off.
    (cd tests/python && \
      LD_PRELOAD="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)" \
      ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
      PYTHONPATH="$ROOT/build-asan/python" "$VENV/bin/python" -m unittest -v test_python.Layouts)
    stage_end
    stage_begin "engine unit tests under TSan (build-tsan/)"
    configure_build tsan
    TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 \
      ctest --test-dir build-tsan --output-on-failure --no-tests=error -j "$JOBS" -L unit -E "$SANITIZER_SKIP"
    record_test_times build-tsan TSan
    stage_end
    stage_begin "fuzz targets, 6 s each (clang, ASan+UBSan; build-fuzz/)"
    bash tools/fuzz.sh 6
    stage_end
    ;;
  check)
    # What a change most often breaks, in a few minutes: no set-up (run
    # build or test once first), no sanitizer builds, no S3 server (the S3
    # tests skip, saying so), no wheel.
    python_env
    stage_begin "release build with tests (build/)"
    # shellcheck disable=SC2046
    configure_build default -DCKPTFS_BUILD_TESTS=ON $(python_args)
    stage_end
    stage_begin "unit tests (release build)"
    ctest --test-dir build --output-on-failure --no-tests=error -j "$JOBS" -L unit
    record_test_times build unit
    stage_end
    stage_begin "CLI, gc and Python package tests"
    CKPTFS_QUICK_CHECK=1 ctest --test-dir build --output-on-failure --no-tests=error -j "$JOBS" \
      -R '^(cli_integration|gc_integration|python_package)$'
    record_test_times build integration
    stage_end
    slowest_tests
    stage_summary
    ;;
  *)
    echo "usage: tools/dev.sh demo|test|build|check" >&2
    exit 2
    ;;
esac
