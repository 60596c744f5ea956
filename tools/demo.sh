#!/usr/bin/env bash
# The ckptfs demo: a two-rank sharded checkpoint goes into a fresh local
# repository, then a whole merged tensor is read back and checked.
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
echo "== reading the merged tensor 'layers.0.attn.qkv.weight' (box shards of 2 ranks)"
"$CKPT" cat step-000100 layers.0.attn.qkv.weight --format npy > "$WORK/qkv.npy"
"$PY" - "$WORK" <<'PYEOF'
import sys, numpy as np
work = sys.argv[1]
got = np.load(f"{work}/qkv.npy")
want = np.load(f"{work}/expected/layers.0.attn.qkv.weight.npy")
assert got.dtype == want.dtype and got.shape == want.shape and (got == want).all(), "mismatch"
print(f"qkv.npy: {got.dtype} {got.shape} matches the tensor the ranks saved")
PYEOF
"$CKPT" verify
echo "== demo done; repository left at $CKPT_REPO"
