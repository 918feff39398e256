#!/usr/bin/env bash
# Issue 19, item 2: V4-Pro on one 8-GPU host (nvidia-h200-x8).
#   init   write the released V4-Pro shapes (`sluice model init --preset pro`: FP8
#          projections, FP4 experts) to /dev/shm — as many of its 61 layers as the host
#          can hold, see below;
#   bench  `sluice bench engine` with one engine over cuda:0..cuda:7 (expert parallel over
#          NCCL, attention data parallel): load GB/s and host memory, prefill 8K, decode
#          at CONTEXTS × BATCHES (docs/perf.md's lists);
#   split  a disaggregated 4+4 cluster (`sluice up`: prefill over cuda:0-3, decode over
#          cuda:4-7, kvstore and router on the host) and a `sluice bench serve` sweep
#          through it; with fewer layers when two copies of the weights do not fit.
# Reports in $OUT: layers.txt (what was run and why), init.log, plan_*.txt, pro_engine.json and
# bench.log, split/ (up.log, cluster/*.log, serve_random.{json,md,log}), summary.txt.
#
#   tools/bench/pro_x8.sh [--rehearse] [STEPS...]   STEPS: init bench split (default: all three)
#
# Why not all 61 layers: the checkpoint is ~851 GB of tensors (experts 822 GB, the rest
# 29 GB; `sluice model inspect engine/src/init/configs/deepseek-v4-pro.json --device cuda
# --devices 8`), and an x8 host has 560 GiB of memory and 235 GiB of disk, so no more than
# ~35 layers can be written anywhere on it, although 61 layers would fit its GPUs (131.8 GB
# per H200). LAYERS is therefore the most that fits /dev/shm (grown to 85% of the RAM) and
# the GPUs, unless set; the split uses SPLIT_LAYERS, the most for which each worker's four
# GPUs hold a full copy of the dense weights and a quarter of the experts. layers.txt and
# summary.txt say which numbers were used.
#
# --rehearse (or REHEARSE=1): on an nvidia-h200-x2 (or x2 H100s): LAYERS=3, the engine over
# cuda:0,cuda:1, the split 1+1 (prefill cuda:0, decode cuda:1), a short sweep.
#
# Build and pack as tools/bench/flash_x4.sh says (.device/bins.tgz with sluice, router,
# prefill-worker, decode-worker, kvstore). Run with the run tool, kind nvidia-h200-x8,
# timeout_s 600; the steps fit two calls on the same warm machine (`init bench`, then `split`).
#
# Env: B [.device], OUT [/tmp], LAYERS [auto / 3], SPLIT_LAYERS [auto / LAYERS], KV [fp8],
#   CONTEXTS [8192,65536], BATCHES [1,16,64,128 / 1,8,32], PREFILL [8192], STEPS_N [8],
#   BENCH_EXTRA [--skip-products --topk-candidates 0 --compress-tokens 0],
#   split sweep: RATES [1,inf], NUM_PROMPTS [32 / 16], IN_LEN [1024], OUT_LEN [64 / 32], MAX_CONC [32 / 16],
#   BUDGET_S [240 / 150], READY_S [400], TIMEOUT_S [300].
set -uo pipefail
cd "$(dirname "$0")/../.."
REHEARSE=${REHEARSE:-0}
if [ "${1:-}" = "--rehearse" ]; then
  REHEARSE=1
  shift
fi
B=${B:-.device}
# Packed by tools/bench/pack_device.sh: unpacked into /tmp/b (and the kernels' PTX into the cache).
B=$(tools/bench/unpack_device.sh "$B" /tmp/b)
B=$(cd "$B" && pwd)
OUT=${OUT:-/tmp}
mkdir -p "$OUT"
# NCCL as docs/perf.md "Several GPUs" loads it; NVLink multicast stays off (required on
# the lent machines), and every process started below inherits this environment.
mkdir -p /tmp/nccl && ln -sf /usr/lib/x86_64-linux-gnu/libnccl.so.2 /tmp/nccl/libnccl.so
export LD_LIBRARY_PATH=/tmp/nccl:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 SLUICE_PTX_CACHE=${SLUICE_PTX_CACHE:-/tmp/ptx} SLUICE_BIN_DIR=$B
if [ "$REHEARSE" = 1 ]; then
  GPUS=2 ALL=cuda:0,cuda:1 PREFILL_DEVICES=cuda:0 DECODE_DEVICES=cuda:1 WHY=${LAYERS:+LAYERS set}
  LAYERS=${LAYERS:-3} WHY=${WHY:-the rehearsal} BATCHES=${BATCHES:-1,8,32} NUM_PROMPTS=${NUM_PROMPTS:-16} OUT_LEN=${OUT_LEN:-32}
  MAX_CONC=${MAX_CONC:-16} BUDGET_S=${BUDGET_S:-150}
else
  GPUS=8 ALL=cuda:0,cuda:1,cuda:2,cuda:3,cuda:4,cuda:5,cuda:6,cuda:7
  PREFILL_DEVICES=cuda:0,cuda:1,cuda:2,cuda:3 DECODE_DEVICES=cuda:4,cuda:5,cuda:6,cuda:7
  BATCHES=${BATCHES:-1,16,64,128} NUM_PROMPTS=${NUM_PROMPTS:-32} OUT_LEN=${OUT_LEN:-64}
  MAX_CONC=${MAX_CONC:-32} BUDGET_S=${BUDGET_S:-240}
fi
KV=${KV:-fp8}
GRPC=${GRPC:-127.0.0.1:50051} HTTP=${HTTP:-127.0.0.1:8080} # the router's listeners
SUMMARY=$OUT/summary.txt
note() { echo "$*" | tee -a "$SUMMARY"; }

have=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if [ "$have" -lt "$GPUS" ]; then
  note "this machine has $have GPU(s); this run needs $GPUS (use --rehearse on two)"
  exit 1
fi
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpus.txt"
gpu_gb=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 | awk '{print $1 * 1048576 / 1e9}')

# Bytes of V4-Pro in the shipped formats (GB, from `sluice model inspect` of the released
# config): routed experts per layer, everything else per layer (replicated on every GPU
# of a worker), embeddings + head. A worker over n GPUs holds per GPU
# L·(EXPERTS/n + DENSE) + EMBED, and needs 5% reserve, ~6 GB of workspace, state slots
# and KV pages beside it.
EXPERTS=13.477 DENSE=0.4156 EMBED=3.71
fits_gpus() { # GPUs per worker -> layers that fit
  python3 -c "import math; print(max(0, min(61, math.floor(($gpu_gb * 0.95 - 6 - $EMBED) / ($EXPERTS / $1 + $DENSE)))))"
}
n_of() { echo "$1" | tr ',' '\n' | wc -l; }

if [ -z "${LAYERS:-}" ]; then
  mem_gb=$(awk '/MemTotal/ {print int($2 * 1024 / 1e9)}' /proc/meminfo)
  shm_gb=$((mem_gb * 85 / 100))
  by_shm=$(python3 -c "import math; print(min(61, math.floor(($shm_gb - 8 - $EMBED) / ($EXPERTS + $DENSE))))")
  by_gpu=$(fits_gpus "$GPUS")
  LAYERS=$((by_shm < by_gpu ? by_shm : by_gpu))
  note "layers: $LAYERS of 61 (host memory ${mem_gb} GB -> /dev/shm ${shm_gb} GB holds $by_shm layers; $GPUS GPUs of ${gpu_gb} GB hold $by_gpu)"
else
  note "layers: $LAYERS of 61 (${WHY:-LAYERS set})"
fi
if [ "$LAYERS" -lt 1 ]; then
  note "not even one layer of V4-Pro fits this host (set LAYERS to try anyway)"
  exit 1
fi
DIR=/dev/shm/pro$LAYERS
note "=== V4-Pro, $LAYERS layers$([ "$REHEARSE" = 1 ] && echo ", rehearsal"), kv $KV; $(date -u +%FT%TZ)"

write() { # layers -> writes /dev/shm/pro<layers> (dropping other pro checkpoints first)
  local d=/dev/shm/pro$1
  [ -f "$d/config.json" ] && return 0
  for old in /dev/shm/pro*; do [ -d "$old" ] && [ "$old" != "$d" ] && rm -rf "$old"; done
  local want_gb
  want_gb=$(python3 -c "print(int($1 * ($EXPERTS + $DENSE) + $EMBED + 8))")
  if [ "$(df -BG --output=avail /dev/shm | tail -1 | tr -dc 0-9)" -lt "$want_gb" ]; then
    mem_gb=$(awk '/MemTotal/ {print int($2 / 1048576)}' /proc/meminfo)
    mount -o remount,size=$((mem_gb * 85 / 100))G /dev/shm 2>&1 || echo "could not grow /dev/shm"
  fi
  df -h /dev/shm | tail -1
  "$B/sluice" model init --preset pro --layers "$1" --seed 0 --out "$d" 2>&1 | tee -a "$OUT/init.log"
  note "init: $(grep wrote "$OUT/init.log" | tail -1)"
}

steps=${*:-init bench split}
failed=0
for s in $steps; do
  case $s in
  init) write "$LAYERS" ;;
  bench)
    [ -f "$DIR/config.json" ] || { note "bench: no checkpoint in $DIR (run the init step)"; exit 1; }
    "$B/sluice" model inspect "$DIR" --device cuda --devices "$GPUS" --kv-dtype "$KV" 2>&1 | sed -n '/Memory plan/,$p' |
      tee "$OUT/plan_engine.txt"
    # shellcheck disable=SC2086
    "$B/sluice" bench engine --devices "$ALL" --model "$DIR" --kv-dtype "$KV" --prefill-tokens "${PREFILL:-8192}" \
      --contexts "${CONTEXTS:-8192,65536}" --batches "$BATCHES" --decode-steps "${STEPS_N:-8}" --repeat 2 \
      ${BENCH_EXTRA:---skip-products --topk-candidates 0 --compress-tokens 0} --json >"$OUT/pro_engine.json" \
      2>"$OUT/bench.log"
    rc=$?
    note "bench rc=$rc"
    [ "$rc" = 0 ] || failed=1
    grep -E "loaded weights|host memory|prefill|decode ctx|memory" "$OUT/bench.log" | sed 's/\x1b\[[0-9;]*m//g' |
      tee -a "$SUMMARY"
    ;;
  split)
    per=$(n_of "$PREFILL_DEVICES")
    fit=$(fits_gpus "$per")
    split_layers=${SPLIT_LAYERS:-$((fit < LAYERS ? fit : LAYERS))}
    if [ "$split_layers" -lt 1 ]; then
      note "split: two copies of even one layer do not fit $GPUS GPUs of ${gpu_gb} GB; not run"
      continue
    fi
    note "split: $split_layers layers (one worker over $per GPUs holds $fit; the bench ran $LAYERS)"
    write "$split_layers"
    sdir=/dev/shm/pro$split_layers
    mkdir -p "$OUT/split"
    "$B/sluice" model inspect "$sdir" --device cuda --devices "$per" --kv-dtype "$KV" --max-batch "$MAX_CONC" \
      --context 4096 2>&1 | sed -n '/Memory plan/,$p' >"$OUT/plan_split.txt"
    rm -rf /tmp/sluice-kvstore
    SLUICE_MAX_BATCH=$MAX_CONC "$B/sluice" up --model "$sdir" --prefill-devices "$PREFILL_DEVICES" \
      --decode-devices "$DECODE_DEVICES" --kv-dtype "$KV" --kvstore-dir /tmp/sluice-kvstore --kvstore-capacity 48GiB \
      --grpc "$GRPC" --http "$HTTP" --log-dir "$OUT/split/cluster" --no-sample \
      --ready-timeout-s "${READY_S:-400}" >"$OUT/split/up.log" 2>&1 &
    up_pid=$!
    stop_cluster() {
      kill -TERM "$up_pid" 2>/dev/null || return 0
      for _ in $(seq 1 90); do kill -0 "$up_pid" 2>/dev/null || return 0; sleep 1; done
      kill -KILL "$up_pid" 2>/dev/null
    }
    trap stop_cluster EXIT
    t0=$SECONDS
    until grep -qs "sluice is up" "$OUT/split/up.log"; do
      if ! kill -0 "$up_pid" 2>/dev/null || [ $((SECONDS - t0)) -gt "${READY_S:-400}" ]; then
        note "split: the cluster did not come up after $((SECONDS - t0)) s"
        tail -20 "$OUT/split/up.log"
        for f in "$OUT"/split/cluster/*.log; do echo "--- $f"; tail -15 "$f"; done
        exit 1
      fi
      sleep 2
    done
    note "split: cluster up in $((SECONDS - t0)) s"
    nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv >"$OUT/split/nvidia-smi.txt"
    timeout "$BUDGET_S" "$B/sluice" bench serve --router "http://$GRPC" --model "$sdir" --gpus "$GPUS" \
      --workload random --num-prompts "$NUM_PROMPTS" --input-len "${IN_LEN:-1024}" --output-len "$OUT_LEN" \
      --request-rates "${RATES:-1,inf}" --max-concurrency "$MAX_CONC" --timeout-s "${TIMEOUT_S:-300}" \
      --label "V4-Pro ($split_layers layers), prefill $PREFILL_DEVICES, decode $DECODE_DEVICES, kv $KV" \
      --json "$OUT/split/serve_random.json" >"$OUT/split/serve_random.md" 2>"$OUT/split/serve_random.log"
    rc=$?
    note "split sweep rc=$rc (124: cut off at ${BUDGET_S}s; the JSON keeps finished rates)"
    [ "$rc" = 0 ] || [ "$rc" = 124 ] || failed=1
    cat "$OUT/split/serve_random.md" "$OUT/split/serve_random.log" | tee -a "$SUMMARY"
    stop_cluster
    trap - EXIT
    ;;
  *) echo "unknown step $s (init, bench, split)" ;;
  esac
done
exit "$failed"
