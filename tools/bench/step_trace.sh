#!/usr/bin/env bash
# Device time of every kernel of one decode step, with Nsight Compute (the device
# machines have `ncu` but no Nsight Systems). `sluice bench engine` queues its last
# decode steps behind a `gpu_sleep` hold, so the kernels between the last two
# `gpu_sleep` launches are exactly one step; tools/bench/step_trace.py sums them per
# kernel and compares their total with the step's wall time (the rest is the gaps
# between kernels: launch processing and dependencies).
#
#   tools/bench/step_trace.sh MODEL [BATCH] [CONTEXT]     (device machine, repo root)
# Env: B (executables, default .device), KV (kv dtype, default fp8), OUT.
set -euo pipefail
cd "$(dirname "$0")/../.."
model=$1
batch=${2:-1}
ctx=${3:-8192}
# shellcheck source=tools/bench/ncu_env.sh
. tools/bench/ncu_env.sh
# The step's wall time without the profiler, for the comparison.
"$B/sluice" bench engine --device cuda:0 --model "$model" --kv-dtype "${KV:-fp8}" \
  --prefill-tokens 512 --chunk-tokens 8192 --contexts "$ctx" --batches "$batch" --decode-steps 8 --repeat 2 \
  --skip-products --topk-candidates 0 --compress-tokens 0 2>&1 | grep '^decode ctx' | tee "$OUT/step_trace.wall"
# Only the kernel duration: one pass per kernel, clocks left as they are (METHOD.md).
"$ncu" --clock-control none --metrics gpu__time_duration.sum --csv --page raw --print-units base \
  --log-file "$OUT/step_trace.csv" \
  "$B/sluice" bench engine --device cuda:0 --model "$model" --kv-dtype "${KV:-fp8}" \
  --prefill-tokens 512 --chunk-tokens 8192 --contexts "$ctx" --batches "$batch" --decode-steps 1 --repeat 1 \
  --skip-products --topk-candidates 0 --compress-tokens 0 >/dev/null 2>"$OUT/step_trace.err" ||
  { tail -20 "$OUT/step_trace.err"; exit 1; }
python3 tools/bench/step_trace.py "$OUT/step_trace.csv" "$OUT/step_trace.wall"
