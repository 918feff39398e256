#!/usr/bin/env bash
# Nsight Compute's view of chosen kernels in the decode steps of `sluice bench engine`:
# speed of light (DRAM and SM throughput), warp states (cycles between a warp's
# instructions, the leading stall reasons), occupancy and launch figures, one block of
# lines per launch. What docs/perf.md's and NOTES-decode.md's per-kernel profiles were
# made with; the profiler serialises kernels (no overlap between them) and replays each
# launch once per section set.
#
#   tools/bench/ncu_kernels.sh MODEL 'REGEX' [BATCH] [CONTEXT]     (device machine, repo root)
#   e.g. tools/bench/ncu_kernels.sh /dev/shm/f12 '^(gemv_f8mma_r1|d2gemv_fp8_n1)$' 1 8192
# Env: B (executables, default .device), KV (kv dtype, default fp8), COUNT (launches
# profiled, default 12), SKIP (matching launches skipped first, default 0), OUT (the
# report's folder, default /tmp).
set -euo pipefail
cd "$(dirname "$0")/../.."
model=$1
regex=$2
batch=${3:-1}
ctx=${4:-8192}
# shellcheck source=tools/bench/ncu_env.sh
. tools/bench/ncu_env.sh
"$ncu" --clock-control none --kernel-name "regex:$regex" --launch-skip "${SKIP:-0}" --launch-count "${COUNT:-12}" \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
  --section LaunchStats \
  "$B/sluice" bench engine --device cuda:0 --model "$model" --kv-dtype "${KV:-fp8}" --prefill-tokens 512 \
  --contexts "$ctx" --batches "$batch" --decode-steps 1 --repeat 1 --skip-products --topk-candidates 0 \
  --compress-tokens 0 >"$OUT/ncu_kernels.txt" 2>&1 || { tail -20 "$OUT/ncu_kernels.txt"; exit 1; }
grep -E "^  [a-z_0-9]+ \(|Duration|DRAM Throughput|Compute \(SM\)|SM Active Cycles|Elapsed Cycles|L2 Hit Rate|Warp Cycles Per Issued|Achieved Occupancy|Registers Per|Dynamic Shared|Grid Size" \
  "$OUT/ncu_kernels.txt" | grep -v -- "----"
