#!/usr/bin/env bash
# Checks that the programs, libraries and devices a later stage needs are
# really there, so that a missing one fails in a second with one line naming
# it (and the Debian package that has it), not minutes later in the middle
# of a stage. tools/setup-debian.sh installs all of them.
#
#   tools/check-tools.sh demo         what tools/dev.sh demo needs
#   tools/check-tools.sh test         what tools/dev.sh test needs
#   tools/check-tools.sh python       print the interpreter build/venv is made from
#   tools/check-tools.sh fuzz-clang   print the clang release the fuzz stage
#                                     uses (newest from 16 on whose ASan, UBSan
#                                     and libFuzzer runtimes link), or fail
set -euo pipefail

# Prints N for the newest clang++-N (N >= 16) that links a libFuzzer target
# with ASan and UBSan: the real test, since the runtimes come in a package
# of their own (libclang-rt-N-dev) that clang-N only recommends.
fuzz_clang() {
  local v scratch found=""
  scratch=$(mktemp -d)
  echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' \
    >"$scratch/t.cc"
  for v in 21 20 19 18 17 16; do
    command -v "clang++-$v" >/dev/null || continue
    if "clang++-$v" -fsanitize=fuzzer,address,undefined "$scratch/t.cc" -o "$scratch/t" 2>/dev/null; then
      found=$v
      break
    fi
  done
  rm -rf "$scratch"
  [ -n "$found" ] && echo "$found"
}

# The interpreter the Python test environment is made from: 3.11 when
# there is one (the release the machines' local torch wheels are built
# for), else the first python3.
python_for_venv() { command -v python3.11 || command -v python3; }

# program:package pairs.
demo_programs=(
  cmake:cmake ninja:ninja-build pkg-config:pkg-config c++:build-essential
  /usr/bin/python3:python3 fusermount3:fuse3
)
test_programs=(
  "${demo_programs[@]}"
  curl:curl ceph:ceph-common ceph-mon:ceph-mon ceph-osd:ceph-osd radosgw:radosgw
  radosgw-admin:radosgw ceph-authtool:ceph-common monmaptool:ceph-base
  mount:mount umount:mount unshare:util-linux nsenter:util-linux
  cmp:diffutils sha256sum:coreutils dd:coreutils timeout:coreutils localedef:locales
  script:bsdutils awk:mawk sort:coreutils
)
# module:package pairs for Debian's /usr/bin/python3.
demo_modules=(numpy:python3-numpy)
test_modules=("${demo_modules[@]}")

check() {  # programs-array-name modules-array-name
  local -n programs=$1 modules=$2
  local missing=() entry name
  for entry in "${programs[@]}"; do
    name=${entry%%:*}
    command -v "$name" >/dev/null || missing+=("$name (${entry#*:})")
  done
  if [ -x /usr/bin/python3 ]; then
    for entry in "${modules[@]}"; do
      name=${entry%%:*}
      /usr/bin/python3 -c "import $name" 2>/dev/null || missing+=("python module $name (${entry#*:})")
    done
  fi
  if [ "$1" = test_programs ] && ! "$(python_for_venv)" -c 'import venv, ensurepip' 2>/dev/null; then
    missing+=("a Python 3 that makes venvs with pip (python3-venv)")
  fi
  [ -c /dev/fuse ] || missing+=("/dev/fuse (the kernel's FUSE device: load the fuse module, or give the container the device)")
  if [ "$1" = test_programs ]; then
    # The Python package's sanitizer stage preloads gcc's runtimes.
    for name in libasan.so libubsan.so; do
      [ -e "$(gcc -print-file-name=$name)" ] || missing+=("gcc's $name (libgcc-N-dev, which build-essential brings)")
    done
  fi
  if [ "$1" = test_programs ] && ! fuzz_clang >/dev/null; then
    missing+=("a clang from 16 on with its sanitizer and libFuzzer runtimes (clang-N libclang-rt-N-dev libfuzzer-N-dev)")
  fi
  if [ ${#missing[@]} -gt 0 ]; then
    local list
    list=$(printf '%s, ' "${missing[@]}")
    echo "check-tools: missing ${list%, } (tools/setup-debian.sh installs them)" >&2
    return 1
  fi
}

case "${1:-}" in
  demo) check demo_programs demo_modules ;;
  test) check test_programs test_modules ;;
  python) python_for_venv ;;
  fuzz-clang)
    fuzz_clang || { echo "check-tools: no clang++-N (N >= 16) links a libFuzzer target with ASan+UBSan" \
                         "(install clang-N libclang-rt-N-dev libfuzzer-N-dev: tools/setup-debian.sh)" >&2; exit 1; } ;;
  *) sed -n '2,13p' "$0" >&2; exit 2 ;;
esac
