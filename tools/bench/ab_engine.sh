#!/usr/bin/env bash
# A/B of two sluice builds on the same GPU in one device call: the build being tested
# (packed by tools/bench/pack_device.sh into .device/) against a baseline build carried
# in the git-ignored .base/ (sluice.xz and its kernels' PTX cache, ptx/*.ptx.xz), each
# `sluice bench engine` run alternating between the two so drift hits both alike.
#
# Make the baseline (CPU machine, before changing the code):
#   mkdir -p .base && cp target/release/sluice .base/ && strip .base/sluice && xz .base/sluice
#   python3 tools/cuda/check_kernels.py --cache .base/ptx && xz .base/ptx/*.ptx
# Run (device machine; carry .device and .base):
#   OUT=$OUT tools/bench/ab_engine.sh
# Env: MODEL (default: 8 full-width Flash layers written to /dev/shm/f8), DEVICES
# [--device cuda:0], ROUNDS [2], BENCH_ARGS (the bench engine arguments after --model).
set -uo pipefail
cd "$(dirname "$0")/../.."
B=$(tools/bench/unpack_device.sh .device /tmp/b)
export SLUICE_PTX_CACHE=${SLUICE_PTX_CACHE:-/tmp/ptx} NCCL_NVLS_ENABLE=0
mkdir -p /tmp/base "$SLUICE_PTX_CACHE"
python3 - "$SLUICE_PTX_CACHE" <<'PY'
import glob, lzma, os, sys
with lzma.open(".base/sluice.xz") as f, open("/tmp/base/sluice", "wb") as o:
    o.write(f.read())
os.chmod("/tmp/base/sluice", 0o755)
for p in glob.glob(".base/ptx/*.ptx.xz"):
    with lzma.open(p) as f, open(os.path.join(sys.argv[1], os.path.basename(p)[:-3]), "wb") as o:
        o.write(f.read())
PY
OUT=${OUT:-/tmp}
model=${MODEL:-/dev/shm/f8}
[ -f "$model/config.json" ] || "$B/sluice" model init --preset flash --layers 8 --seed 0 --out "$model" 2>&1 | tail -1
args=${BENCH_ARGS:---kv-dtype fp8 --prefill-tokens 8192 --contexts 8192 --batches 1,8,32 --decode-steps 8 --repeat 3 --skip-products --topk-candidates 0 --compress-tokens 0}
for round in $(seq "${ROUNDS:-2}"); do
  for which in base new; do
    bin=$B/sluice
    [ "$which" = base ] && bin=/tmp/base/sluice
    echo "=== $which, round $round"
    # shellcheck disable=SC2086
    timeout 300 "$bin" bench engine ${DEVICES:---device cuda:0} --model "$model" $args 2>&1 |
      tee "$OUT/ab_${which}_$round.log" | grep -E "^prefill|^decode ctx"
  done
done
