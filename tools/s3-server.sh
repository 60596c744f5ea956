#!/usr/bin/env bash
# A real S3 server for tests and benchmarks: a one-node Ceph cluster (one
# monitor, one memstore OSD) and its RADOS Gateway on 127.0.0.1, started by
# hand (no systemd), all state under one scratch directory.
#
#   tools/s3-server.sh start DIR [PORT]   start (about 15 s); prints the environment to use
#                                         (gateway on PORT, default 7480; monitor on PORT-4180)
#   tools/s3-server.sh stop DIR           stop every daemon and wait for it to exit
#   tools/s3-server.sh env DIR            print the environment again
#
# Data lives in RAM (memstore): S3_SERVER_GIB (default 2) bounds it. A full
# store blocks writes rather than failing them, and the gateway reclaims
# deleted objects only later, so give benchmarks room.
#
# The environment printed (eval it) is what ckptfs and the AWS tools read:
# AWS_ENDPOINT_URL, AWS_REGION, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY.
# Needs the Debian packages ceph-mon, ceph-osd and radosgw (tools/setup-debian.sh).
set -euo pipefail

cmd=${1:-}
dir=${2:-}
port=${3:-7480}
mon_port=$((port - 4180))   # 3300 beside the default gateway port
if [ -z "$cmd" ] || [ -z "$dir" ]; then
  sed -n '2,13p' "$0" >&2
  exit 2
fi
ACCESS_KEY=ckptfs-test-access
SECRET_KEY=ckptfs-test-secret-0123456789

print_env() {
  local p
  p=$(cat "$dir/port")
  echo "export AWS_ENDPOINT_URL=http://127.0.0.1:$p"
  echo "export AWS_REGION=us-east-1"
  echo "export AWS_ACCESS_KEY_ID=$ACCESS_KEY"
  echo "export AWS_SECRET_ACCESS_KEY=$SECRET_KEY"
}

stop() {
  local pids=()
  for f in "$dir"/run/*.pid; do
    [ -e "$f" ] || continue
    local pid
    pid=$(cat "$f")
    if kill "$pid" 2>/dev/null; then pids+=("$pid"); fi
    rm -f "$f"
  done
  # Daemons take a few seconds to exit; the ports must be free before a restart.
  for pid in "${pids[@]}"; do
    for _ in $(seq 1 150); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    kill -9 "$pid" 2>/dev/null || true
  done
}

wait_for() {  # seconds, description, command...
  local limit=$1 what=$2
  shift 2
  for _ in $(seq 1 $((limit * 10))); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.1
  done
  echo "s3-server: $what did not come up within ${limit} s; logs in $dir/log" >&2
  return 1
}

start() {
  for b in ceph-mon ceph-osd radosgw ceph-authtool monmaptool; do
    command -v "$b" >/dev/null || { echo "s3-server: $b not found (apt-get install ceph-mon ceph-osd radosgw)" >&2; exit 1; }
  done
  if [ -e "$dir/run" ] && ls "$dir"/run/*.pid >/dev/null 2>&1; then stop; fi
  rm -rf "$dir"
  mkdir -p "$dir"/{run,log,mon,osd,rgw}
  dir=$(cd "$dir" && pwd)
  echo "$port" >"$dir/port"
  local fsid conf keyring
  fsid=$(cat /proc/sys/kernel/random/uuid)
  conf=$dir/ceph.conf
  keyring=$dir/keyring
  cat >"$conf" <<EOF
[global]
fsid = $fsid
mon host = v2:127.0.0.1:$mon_port
mon initial members = a
public network = 127.0.0.0/8
ms bind ipv6 = false
auth cluster required = cephx
auth service required = cephx
auth client required = cephx
keyring = $keyring
osd pool default size = 1
osd pool default min size = 1
mon allow pool size one = true
mon allow pool delete = true
osd crush chooseleaf type = 0
osd objectstore = memstore
memstore device bytes = $(( ${S3_SERVER_GIB:-2} << 30 ))
run dir = $dir/run
pid file = $dir/run/\$name.pid
admin socket = $dir/run/\$name.asok
log file = $dir/log/\$name.log
mon data = $dir/mon/\$name
osd data = $dir/osd/\$name
mon warn on pool no redundancy = false
[client.rgw.a]
rgw frontends = beast endpoint=127.0.0.1:$port tcp_nodelay=1
rgw data = $dir/rgw
rgw dns name = 127.0.0.1
# Deleted objects' data is freed by the gateway's garbage collector, two
# hours later by default: too late for a server whose data lives in memory
# and for tests and benchmarks that delete what they wrote.
rgw gc obj min wait = 5
rgw gc processor period = 10
EOF
  ceph-authtool --create-keyring "$keyring" --gen-key -n mon. --cap mon 'allow *' >/dev/null
  ceph-authtool "$keyring" --gen-key -n client.admin --cap mon 'allow *' --cap osd 'allow *' --cap mgr 'allow *' >/dev/null
  ceph-authtool "$keyring" --gen-key -n osd.0 --cap mon 'allow profile osd' --cap osd 'allow *' --cap mgr 'allow profile osd' >/dev/null
  ceph-authtool "$keyring" --gen-key -n client.rgw.a --cap mon 'allow rw' --cap osd 'allow rwx' --cap mgr 'allow rw' >/dev/null
  monmaptool --create --addv a "[v2:127.0.0.1:$mon_port]" --fsid "$fsid" "$dir/monmap" >/dev/null
  ceph-mon -c "$conf" --mkfs -i a --monmap "$dir/monmap" --keyring "$keyring"
  ceph-mon -c "$conf" -i a
  wait_for 20 "the monitor" ceph -c "$conf" mon stat
  local uuid id
  uuid=$(cat /proc/sys/kernel/random/uuid)
  id=$(ceph -c "$conf" osd new "$uuid")
  mkdir -p "$dir/osd/osd.$id"
  ceph-osd -c "$conf" -i "$id" --mkfs --osd-uuid "$uuid" >/dev/null 2>&1
  ceph-osd -c "$conf" -i "$id" 2>>"$dir/log/osd-start.log"
  wait_for 30 "the OSD" sh -c "ceph -c '$conf' osd stat | grep -q '1 up'"
  radosgw -c "$conf" -n client.rgw.a
  wait_for 60 "radosgw" curl -sf "http://127.0.0.1:$port/"
  radosgw-admin -c "$conf" user create --uid=ckptfs-test --display-name=ckptfs-test \
    --access-key="$ACCESS_KEY" --secret="$SECRET_KEY" >/dev/null
  print_env
}

case "$cmd" in
  start) start ;;
  stop) stop ;;
  env) print_env ;;
  *) sed -n '2,13p' "$0" >&2; exit 2 ;;
esac
