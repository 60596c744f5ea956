#!/usr/bin/env bash
# Installs the Debian packages ckptfs needs to build, test and run.
# Idempotent; run as root (or through sudo) on Debian 12.
set -euo pipefail

packages=(
  build-essential cmake pkg-config ninja-build
  liblmdb-dev lmdb-utils libzstd-dev libxxhash-dev libgtest-dev
  libcurl4-openssl-dev                     # the S3 backend
  ceph-mon ceph-osd radosgw s3cmd          # a real S3 server for the tests (tools/s3-server.sh)
  libfuse3-dev fuse3
  python3 python3-numpy
  python3-dev pybind11-dev python3-torch   # the Python package (tools/python) and its tests
  clang-16 libfuzzer-16-dev   # fuzz targets (tools/fuzz.sh)
  locales                     # a comma-decimal locale for the locale-independence tests
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all packages present"
else
  echo "setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# The JSON tests check number parsing under a locale whose decimal separator
# is a comma.
if ! locale -a 2>/dev/null | grep -qi '^de_DE\.utf-\?8$'; then
  $SUDO localedef -i de_DE -f UTF-8 de_DE.UTF-8 || echo "setup: could not generate de_DE.UTF-8 (a locale test will skip)"
fi
