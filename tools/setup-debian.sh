#!/usr/bin/env bash
# Installs every Debian package that ckptfs needs to build, to run the demo
# and to run the whole test command: compilers and libraries, the programs
# the tests and scripts call, a real S3 server, and the clang whose
# sanitizer and libFuzzer runtimes the fuzz stage links.
# Idempotent; run as root (or through sudo) on Debian 12 or 13.
#
# tools/check-tools.sh checks afterwards that each program is really there.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(
  build-essential cmake pkg-config ninja-build
  liblmdb-dev lmdb-utils libzstd-dev libxxhash-dev libgtest-dev
  libcurl4-openssl-dev                     # the S3 backend
  ceph-mon ceph-osd radosgw s3cmd          # a real S3 server for the tests (tools/s3-server.sh)
  curl ca-certificates                     # s3-server.sh waits for the gateway with curl
  libfuse3-dev fuse3                       # the mount, and fusermount3 in the tests
  python3 python3-numpy                    # the demo and the CLI integration tests
  python3-dev python3-venv                 # the Python package, built in a venv (tools/dev.sh)
  mount util-linux                         # mount/umount, unshare and nsenter (test_cli, test_s3)
  coreutils diffutils                      # cat, dd, sha256sum, timeout, sort; cmp (test_mount)
  bsdutils mawk                            # script (test_cli: a terminal for the build launcher); awk (dev.sh)
  locales                                  # localedef: a comma-decimal locale for the JSON tests
  zstd                                     # the zstd command: kinds_bench.py's baseline
)

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
updated=0
apt_update() {
  if [ "$updated" -eq 0 ]; then
    $SUDO apt-get update -qq
    updated=1
  fi
}
installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
available() { apt-cache policy "$1" 2>/dev/null | awk '/Candidate:/ {found = ($2 != "(none)")} END {exit !found}'; }

# The fuzz stage needs a clang with its sanitizer and libFuzzer runtimes,
# which Debian packages separately (libclang-rt-N-dev is only recommended by
# clang-N, so --no-install-recommends leaves it out). The version is not
# pinned by name, since releases differ (Debian 12 has 16 and 19, Debian 13
# 17 to 19): an installed complete set is kept, else the newest release
# from 16 on that the package lists offer is installed.
clang_set() { echo "clang-$1 libclang-rt-$1-dev libfuzzer-$1-dev llvm-$1"; }
# Prints the newest release from 16 on whose four packages all pass the
# check (installed, or available).
newest_clang() {  # check
  local v p
  for v in 21 20 19 18 17 16; do
    for p in $(clang_set "$v"); do "$1" "$p" || continue 2; done
    echo "$v"
    return 0
  done
}
clang_version=$(newest_clang installed)
if [ -z "$clang_version" ]; then
  apt_update
  clang_version=$(newest_clang available)
fi
if [ -z "$clang_version" ]; then
  echo "setup: no clang release from 16 on with its runtimes (clang-N, libclang-rt-N-dev," \
       "libfuzzer-N-dev, llvm-N) in the package lists of Debian $(cat /etc/debian_version)" >&2
  exit 1
fi
# shellcheck disable=SC2207
packages+=($(clang_set "$clang_version"))

missing=()
for p in "${packages[@]}"; do
  installed "$p" || missing+=("$p")
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all packages present (fuzz stage: clang-$clang_version)"
else
  echo "setup: installing ${missing[*]}"
  apt_update
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# The JSON tests check number parsing under a locale whose decimal separator
# is a comma.
if ! locale -a 2>/dev/null | grep -qi '^de_DE\.utf-\?8$'; then
  $SUDO localedef -i de_DE -f UTF-8 de_DE.UTF-8 || echo "setup: could not generate de_DE.UTF-8 (a locale test will skip)"
fi
