#!/usr/bin/env bash
# One decode step as the device really ran it: every kernel's (and copy's and memset's)
# start and end, overlaps included (CUPTI concurrent-kernel records through an injection
# library; the device machines have no Nsight Systems, and Nsight Compute serialises
# kernels). Builds tools/bench/timeline/cupti_trace.c with the machine's CUPTI, runs
# `sluice bench engine` with it loaded, and prints tools/bench/timeline.py's breakdown of
# a step.
#
#   tools/bench/timeline.sh MODEL [BATCH] [CONTEXT]      (device machine, repo root)
# Env: B (executables, or the folder pack_device.sh filled; default .device), KV (kv
#      dtype, default fp8), OUT (default /tmp), TAG (file names, default b$BATCH), EXTRA
#      (more `bench engine` flags), ORDER (kernels of the step listed in order, default
#      60), GAPS (KERNEL:BEFORE pairs,
#      space-separated: timeline.py --gap) and GAP_FROM (its --gap-from).
#      TOTALS=1: per-kernel totals over the whole run instead (kernel_totals.py), e.g.
#      of prefills: TOTALS=1 RUN="--prefill-tokens 300 --contexts 1024 --batches 1
#      --decode-steps 1 --repeat 4" (RUN replaces the run's flags below); GAPS_TOP=N adds
#      the N largest idle gaps by the kernels around them (kernel_totals.py --gaps).
set -euo pipefail
cd "$(dirname "$0")/../.."
model=$1
batch=${2:-1}
ctx=${3:-8192}
# A packed folder (bins.txz) is unpacked first; a folder of executables is used as it is.
B=$(tools/bench/unpack_device.sh "${B:-.device}" /tmp/b)
OUT=${OUT:-/tmp}
tag=${TAG:-b$batch}
lib=$OUT/libcupti_trace.so

if [ ! -f "$lib" ]; then
  roots="/usr/local/cuda/extras/CUPTI /usr/local/cuda $(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null || true)"
  inc=$(find $roots -name cupti.h -path '*include*' 2>/dev/null | head -1 || true)
  so=$(find $roots -name 'libcupti.so*' 2>/dev/null | sort -V | tail -1 || true)
  if [ -z "$inc" ] || [ -z "$so" ]; then
    echo "timeline: no CUPTI here (cupti.h: '${inc}', libcupti: '${so}'); it comes with the CUDA toolkit or PyPI's nvidia-cuda-cupti" >&2
    exit 1
  fi
  incdir=$(dirname "$inc")
  # The newest kernel record the header declares: the one this CUPTI writes.
  rec=$(grep -rhoE 'CUpti_ActivityKernel[0-9]+' "$incdir" | sort -uV | tail -1)
  # Copies and memsets too (a step's uploads and read-back), where the header names them.
  mcp=$(grep -rhoE 'CUpti_ActivityMemcpy[0-9]+' "$incdir" | sort -uV | tail -1 || true)
  mst=$(grep -rhoE 'CUpti_ActivityMemset[0-9]+' "$incdir" | sort -uV | tail -1 || true)
  extra=()
  [ -n "$mcp" ] && extra+=(-DMEMCPY_RECORD="$mcp")
  [ -n "$mst" ] && extra+=(-DMEMSET_RECORD="$mst")
  cudainc=/usr/local/cuda/include
  cc -shared -fPIC -O2 -DKERNEL_RECORD="$rec" "${extra[@]}" -I"$incdir" -I"$cudainc" tools/bench/timeline/cupti_trace.c \
    "$so" -Wl,-rpath,"$(dirname "$so")" -o "$lib"
  echo "timeline: built with $so ($rec ${mcp:-no copies} ${mst:-no memsets})"
fi

log=$OUT/timeline_$tag.log
csv=$OUT/timeline_$tag.csv
# Few steps: the recording keeps every kernel of the run.
run=${RUN:---prefill-tokens 512 --chunk-tokens 8192 --contexts $ctx --batches $batch --decode-steps 4 --repeat 1}
CUDA_INJECTION64_PATH=$lib SLUICE_TIMELINE=$csv "$B/sluice" bench engine --device cuda:0 --model "$model" \
  --kv-dtype "${KV:-fp8}" $run --skip-products --topk-candidates 0 --compress-tokens 0 ${EXTRA:-} >/dev/null 2>"$log" ||
  { tail -20 "$log"; exit 1; }
grep -E 'cupti_trace|ms/step' "$log" || true
if [ "${TOTALS:-0}" = 1 ]; then
  exec python3 tools/bench/kernel_totals.py "$csv" --top "${ORDER:-30}" --gaps "${GAPS_TOP:-0}"
fi
gaps=()
for g in ${GAPS:-}; do gaps+=(--gap "$g"); done
python3 tools/bench/timeline.py "$csv" "$log" --order "${ORDER:-60}" --gap-from "${GAP_FROM:-0}" "${gaps[@]}"
