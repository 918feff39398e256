#!/usr/bin/env bash
# A/B runs of `sluice bench engine` under environment knobs, alternating in one device
# call (wall times move by ±0.15 ms between calls at batch 1, so only runs of the same
# call compare), then test executables. What docs/perf.md's knob tables were made with.
#
#   BENCHES="old:SLUICE_CUDA_ATT_MMA_FROM=64,SLUICE_CUDA_MIX_ROWS_FROM=9 new:X=1 old2:... new2:X=1" \
#   TESTS="cuda_parity parity:cuda cuda_conformance" tools/bench/knob_ab.sh   (device machine, repo root)
#
# BENCHES: label:VAR=value[,VAR=value…] (X=1 sets nothing that matters; BIN=DIR runs that
# bench with the executables packed in DIR, e.g. an older build, instead). TESTS: executable
# names from tools/bench/pack_device.sh, `exe:filter` to pass a filter. Env: B (executables,
# default .device), MODEL (default /dev/shm/f8, written with the 8-layer Flash preset when
# missing), KV (fp8), CTX (8192), BATCHES (1,8,16,64), STEPS (decode steps a point, 8),
# PREFILL (prompt tokens of the timed prefills, 8192),
# OUT (the log's folder, default /tmp).
set -uo pipefail
cd "$(dirname "$0")/../.."
B=$(tools/bench/unpack_device.sh "${B:-.device}" /tmp/b)
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} SLUICE_PTX_CACHE=${SLUICE_PTX_CACHE:-/tmp/ptx}
MODEL=${MODEL:-/dev/shm/f8}
L=${OUT:-/tmp}/knob_ab.log
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$L"
t0=$SECONDS
[ -d "$MODEL" ] || "$B/sluice" model init --preset flash --layers 8 --seed 0 --out "$MODEL" >/dev/null 2>&1
for spec in ${BENCHES:-}; do
  label=${spec%%:*}
  echo "=== bench $label (${spec#*:})" | tee -a "$L"
  knobs=$(echo "${spec#*:}" | tr ',' ' ')
  exe=$B
  for kv in $knobs; do
    case $kv in BIN=*) exe=$(tools/bench/unpack_device.sh "${kv#BIN=}" "/tmp/b-$(basename "${kv#BIN=}")") ;; esac
  done
  # shellcheck disable=SC2046,SC2086 # the knobs are words on purpose
  env $knobs timeout 150 "$exe/sluice" bench engine --device cuda:0 --model "$MODEL" \
    --kv-dtype "${KV:-fp8}" --prefill-tokens "${PREFILL:-8192}" --contexts "${CTX:-8192}" --batches "${BATCHES:-1,8,16,64}" \
    --decode-steps "${STEPS:-8}" --repeat 2 --skip-products --topk-candidates 0 --compress-tokens 0 2>&1 |
    grep -E "^ +(prefill|context|[0-9])|CUDA graphs|error|panicked" | tee -a "$L"
  echo "($((SECONDS - t0)) s)" | tee -a "$L"
done
for t in ${TESTS:-}; do
  exe=${t%%:*}
  filter=()
  [ "$exe" != "$t" ] && filter=("${t#*:}")
  echo "=== $exe ${filter[*]}" | tee -a "$L"
  timeout 240 "$B/$exe" "${filter[@]}" --test-threads 1 2>&1 | grep -E "^test |test result|panicked" | tail -40 | tee -a "$L"
  echo "($((SECONDS - t0)) s)" | tee -a "$L"
done
