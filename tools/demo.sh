#!/usr/bin/env bash
# The ckptfs demo: a two-rank sharded checkpoint goes into a fresh local
# repository, the repository is mounted, and a whole merged tensor is read
# through the mount with NumPy and checked.
set -euo pipefail
CKPT=${1:?usage: demo.sh PATH/TO/ckpt}
PY=/usr/bin/python3
WORK=$(mktemp -d /tmp/ckptfs-demo.XXXXXX)
export CKPT_REPO=$WORK/repo
HERE=$(cd "$(dirname "$0")" && pwd)

echo "== demo workspace: $WORK"
"$PY" "$HERE/make_sharded_checkpoint.py" "$WORK" >/dev/null
"$CKPT" init
for r in 0 1; do
  "$CKPT" import step-000100 "$WORK/rank$r.safetensors" --rank $r --world-size 2 --step 100 &
done
wait
"$CKPT" ls
"$CKPT" show step-000100
MNT=$WORK/mnt
mkdir -p "$MNT"
echo "== mounting the repository on $MNT"
"$CKPT" mount "$MNT"
trap 'fusermount3 -u "$MNT" 2>/dev/null || true' EXIT
ls -l "$MNT" "$MNT/latest/"
echo "== reading the merged tensor 'layers.0.attn.qkv.weight' (box shards of 2 ranks) through the mount"
"$PY" - "$WORK" "$MNT" <<'PYEOF'
import sys, numpy as np
work, mnt = sys.argv[1], sys.argv[2]
got = np.load(f"{mnt}/latest/layers.0.attn.qkv.weight.npy", mmap_mode="r")
want = np.load(f"{work}/expected/layers.0.attn.qkv.weight.npy")
assert got.dtype == want.dtype and got.shape == want.shape and (got == want).all(), "mismatch"
print(f"{mnt}/latest/layers.0.attn.qkv.weight.npy: {got.dtype} {got.shape}, equal to the tensor the ranks saved")
flat = np.load(f"{mnt}/latest/layers.0.mlp.weight.npy")
assert (flat == np.load(f"{work}/expected/layers.0.mlp.weight.npy")).all()
print("layers.0.mlp.weight.npy (flat shards cut mid-row) matches too")
PYEOF
fusermount3 -u "$MNT"
trap - EXIT
"$CKPT" verify
echo "== demo done; repository left at $CKPT_REPO"
