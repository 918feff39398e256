#!/usr/bin/env bash
# Issue 19, items 1 and 3: full V4-Flash served disaggregated on one 4-GPU host
# (nvidia-h200-x4), end to end in one device call. Writes the released V4-Flash shapes
# (all 43 layers, FP8 + FP4 experts, ~156 GB; `sluice model init --preset flash`) to
# /dev/shm, starts a cluster with `sluice up` — kvstore and router on the host, one
# prefill worker over cuda:0,cuda:1 and one decode worker over cuda:2,cuda:3 — then runs
# `sluice bench serve` request-rate sweeps through the router: the `random` workload
# (vLLM's shape) and the `shared-prefix` workload (SGLang's generated-shared-prefix
# shape, with the kvstore on: prefix-cache hit rate). docs/serving-bench.md describes
# the metrics. Everything lands in $OUT:
#   init.log                  model init (GB written, GB/s)
#   plan.txt                  `sluice model inspect --device cuda` for each worker's GPUs
#   up.log, cluster/*.log     sluice up and every service's log (memory plans, load rates)
#   serve_random.{json,md}    the random sweep: per rate summary + every request; the table
#   serve_shared_prefix.{json,md}
#   router_metrics.txt        the router's /metrics after the sweeps
#   nvidia-smi.txt            GPU memory with the cluster loaded
#   summary.txt               the closing lines
#
#   tools/bench/flash_x4.sh [--rehearse] [STEPS...]   STEPS: init serve (default: both)
#
# --rehearse (or REHEARSE=1): the same script on an nvidia-h200-x2 (or x2 H100s): the
# first LAYERS=8 layers (30.75 GB), prefill on cuda:0 and decode on cuda:1, smaller sweeps.
#
# Build and pack (CPU machine; the device has no Rust toolchain):
#   cargo build --release --workspace --bins
#   rm -rf /tmp/pk && mkdir -p /tmp/pk .device && cp target/release/{sluice,router,prefill-worker,decode-worker,kvstore} /tmp/pk/ \
#     && strip /tmp/pk/* && tar -C /tmp/pk -czf .device/bins.tgz .
#   (or tools/bench/pack_device.sh, which also packs the GPU test executables)
# Run: the run tool with kind nvidia-h200-x4 and timeout_s 600:
#   OUT=$OUT tools/bench/flash_x4.sh            # or: ... init   then   ... serve   (two calls, same warm machine)
#
# Env (defaults in brackets; the rehearsal's after the slash):
#   B (executables [.device]), OUT [/tmp], LAYERS [43 / 8], KV [fp8], SWA [periodic:1024],
#   random:        RATES [1,4,inf / 2,inf], NUM_PROMPTS [64 / 24], IN_LEN [1024], OUT_LEN [128 / 64], RANGE [0]
#   shared-prefix: SP_RATES [4,inf / inf], SP_GROUPS [8 / 4], PER_GROUP [8 / 6], SYS_LEN [2048], Q_LEN [128], SP_OUT_LEN [64 / 32]
#   MAX_CONC [64 / 16] (client), MAX_BATCH [64 / 16] (decode worker), MAX_PAGES [4096] (KV pages of each
#   worker: 64 shared-prefix requests hold 18 pages each), TIMEOUT_S [300] (per request),
#   RANDOM_BUDGET_S [270 / 150] and SP_BUDGET_S [120 / 90] (each sweep is cut off there; its JSON keeps
#   the rates it finished), READY_S [400] (cluster start), KVSTORE_DIR [/tmp/sluice-kvstore], KVSTORE_CAP [48GiB];
#   MODEL, PREFILL_DEVICES, DECODE_DEVICES replace the checkpoint and the placement (a dry run of the
#   flow on the CPU: MODEL=engine/tests/golden/tiny-official/model PREFILL_DEVICES=cpu DECODE_DEVICES=cpu).
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
# NCCL as docs/perf.md "Several GPUs" loads it; NVLink multicast stays off (the lent
# machines require it: NCCL_NVLS_ENABLE=0), and every service inherits this environment.
mkdir -p /tmp/nccl && ln -sf /usr/lib/x86_64-linux-gnu/libnccl.so.2 /tmp/nccl/libnccl.so
export LD_LIBRARY_PATH=/tmp/nccl:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 SLUICE_PTX_CACHE=${SLUICE_PTX_CACHE:-/tmp/ptx} SLUICE_BIN_DIR=$B
# KV GPU to GPU: a CUDA-enabled libucx (the libucx-cu13 wheel packed into .ucx/ucx-cu13.tgz
# by tools/ucx/fetch_cuda_ucx.sh), first on the library path, so the workers' default
# --gpu-direct auto puts straight from the prefill GPUs into the decode GPUs (cuda_ipc).
# Without it they stage KV through host memory, and the logs say so.
if [ -f .ucx/ucx-cu13.tgz ]; then
  mkdir -p /tmp/ucx && tar -C /tmp/ucx -xzf .ucx/ucx-cu13.tgz
  export LD_LIBRARY_PATH=/tmp/ucx/libucx/lib:$LD_LIBRARY_PATH UCX_MODULE_DIR=/tmp/ucx/libucx/lib/ucx
fi
if [ "$REHEARSE" = 1 ]; then
  LAYERS=${LAYERS:-8} PREFILL_DEVICES=${PREFILL_DEVICES:-cuda:0} DECODE_DEVICES=${DECODE_DEVICES:-cuda:1} GPUS=2
  RATES=${RATES:-2,inf} NUM_PROMPTS=${NUM_PROMPTS:-24} OUT_LEN=${OUT_LEN:-64}
  SP_RATES=${SP_RATES:-inf} SP_GROUPS=${SP_GROUPS:-4} PER_GROUP=${PER_GROUP:-6} SP_OUT_LEN=${SP_OUT_LEN:-32}
  MAX_CONC=${MAX_CONC:-16} MAX_BATCH=${MAX_BATCH:-16} RANDOM_BUDGET_S=${RANDOM_BUDGET_S:-150} SP_BUDGET_S=${SP_BUDGET_S:-90}
else
  LAYERS=${LAYERS:-43} PREFILL_DEVICES=${PREFILL_DEVICES:-cuda:0,cuda:1} DECODE_DEVICES=${DECODE_DEVICES:-cuda:2,cuda:3} GPUS=4
  RATES=${RATES:-1,4,inf} NUM_PROMPTS=${NUM_PROMPTS:-64} OUT_LEN=${OUT_LEN:-128}
  SP_RATES=${SP_RATES:-4,inf} SP_GROUPS=${SP_GROUPS:-8} PER_GROUP=${PER_GROUP:-8} SP_OUT_LEN=${SP_OUT_LEN:-64}
  MAX_CONC=${MAX_CONC:-64} MAX_BATCH=${MAX_BATCH:-64} RANDOM_BUDGET_S=${RANDOM_BUDGET_S:-270} SP_BUDGET_S=${SP_BUDGET_S:-120}
fi
KV=${KV:-fp8}
GRPC=${GRPC:-127.0.0.1:50051} HTTP=${HTTP:-127.0.0.1:8080} # the router's listeners
DIR=${MODEL:-/dev/shm/flash$LAYERS}
MODE=$([ "$REHEARSE" = 1 ] && echo "rehearsal, $LAYERS layers" || echo "$LAYERS layers")
LABEL="V4-Flash ($MODE), prefill $PREFILL_DEVICES, decode $DECODE_DEVICES, kv $KV"
SUMMARY=$OUT/summary.txt
note() { echo "$*" | tee -a "$SUMMARY"; }

case "$PREFILL_DEVICES,$DECODE_DEVICES" in
*cuda*)
  have=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  if [ "$have" -lt "$GPUS" ]; then
    note "this machine has $have GPU(s); $MODE needs $GPUS (use --rehearse on two)"
    exit 1
  fi
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpus.txt"
  ;;
esac
note "=== $LABEL; $(date -u +%FT%TZ)"

steps=${*:-init serve}
failed=0
for s in $steps; do
  case $s in
  init)
    # /dev/shm holds half the RAM by default; grow it when the checkpoint wants more (root here).
    want_gb=$(python3 -c "print(int($LAYERS * 3.6 + 2.2 + 8))")
    avail_gb=$(df -BG --output=avail /dev/shm | tail -1 | tr -dc 0-9)
    if [ -f "$DIR/config.json" ]; then
      note "init: $DIR already written"
    else
      if [ "$avail_gb" -lt "$want_gb" ]; then
        mem_gb=$(awk '/MemTotal/ {print int($2 / 1048576)}' /proc/meminfo)
        mount -o remount,size=$((mem_gb * 85 / 100))G /dev/shm 2>&1 || echo "could not grow /dev/shm"
      fi
      df -h /dev/shm | tail -1
      "$B/sluice" model init --preset flash --layers "$LAYERS" --seed 0 --out "$DIR" 2>&1 | tee "$OUT/init.log"
      note "init: $(grep wrote "$OUT/init.log" | tail -1)"
    fi
    ;;
  serve)
    [ -f "$DIR/config.json" ] || { note "serve: no checkpoint in $DIR (run the init step)"; exit 1; }
    for d in "$PREFILL_DEVICES" "$DECODE_DEVICES"; do
      n=$(echo "$d" | tr ',' '\n' | wc -l)
      echo "=== memory plan, one worker over $d" >>"$OUT/plan.txt"
      "$B/sluice" model inspect "$DIR" --device cuda --devices "$n" --kv-dtype "$KV" --max-batch "$MAX_BATCH" \
        --context 4096 2>&1 | sed -n '/Memory plan/,$p' >>"$OUT/plan.txt"
    done
    rm -rf "${KVSTORE_DIR:-/tmp/sluice-kvstore}"
    # Worker flags `sluice up` does not take pass as their SLUICE_* twins (the services
    # inherit this environment): the decode batch, and both workers' KV pages.
    SLUICE_MAX_BATCH=$MAX_BATCH SLUICE_MAX_PAGES=${MAX_PAGES:-4096} "$B/sluice" up --model "$DIR" --prefill-devices "$PREFILL_DEVICES" \
      --decode-devices "$DECODE_DEVICES" --kv-dtype "$KV" --swa-policy "${SWA:-periodic:1024}" \
      --kvstore-dir "${KVSTORE_DIR:-/tmp/sluice-kvstore}" --kvstore-capacity "${KVSTORE_CAP:-48GiB}" \
      --grpc "$GRPC" --http "$HTTP" --log-dir "$OUT/cluster" --no-sample \
      --ready-timeout-s "${READY_S:-400}" >"$OUT/up.log" 2>&1 &
    up_pid=$!
    # SIGTERM lets `sluice up` stop its services (bounded); whatever happens, nothing is left running.
    stop_cluster() {
      kill -TERM "$up_pid" 2>/dev/null || return 0
      for _ in $(seq 1 90); do kill -0 "$up_pid" 2>/dev/null || return 0; sleep 1; done
      kill -KILL "$up_pid" 2>/dev/null
    }
    trap stop_cluster EXIT
    t0=$SECONDS
    until grep -qs "sluice is up" "$OUT/up.log"; do
      if ! kill -0 "$up_pid" 2>/dev/null || [ $((SECONDS - t0)) -gt "${READY_S:-400}" ]; then
        note "serve: the cluster did not come up after $((SECONDS - t0)) s"
        tail -20 "$OUT/up.log"
        for f in "$OUT"/cluster/*.log; do echo "--- $f"; tail -15 "$f"; done
        exit 1
      fi
      sleep 2
    done
    note "serve: cluster up in $((SECONDS - t0)) s"
    grep -h -iE "memory plan|loaded|weights|KV paths|registered with UCX|host mirror" "$OUT"/cluster/*-*.log 2>/dev/null |
      sed 's/\x1b\[[0-9;]*m//g' | cut -c1-400 | head -24 | tee -a "$SUMMARY"
    nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv >"$OUT/nvidia-smi.txt" 2>&1
    common=(--router "http://$GRPC" --model "$DIR" --gpus "$GPUS" --max-concurrency "$MAX_CONC"
      --timeout-s "${TIMEOUT_S:-300}")
    timeout "$RANDOM_BUDGET_S" "$B/sluice" bench serve "${common[@]}" --workload random \
      --seed 0 --num-prompts "$NUM_PROMPTS" --input-len "${IN_LEN:-1024}" --output-len "$OUT_LEN" --range-ratio "${RANGE:-0}" \
      --request-rates "$RATES" --label "$LABEL, random" --json "$OUT/serve_random.json" >"$OUT/serve_random.md" \
      2>"$OUT/serve_random.log"
    rc=$?
    note "random sweep rc=$rc (124: cut off at ${RANDOM_BUDGET_S}s; the JSON keeps finished rates)"
    [ "$rc" = 0 ] || [ "$rc" = 124 ] || failed=1
    cat "$OUT/serve_random.md" "$OUT/serve_random.log" | tee -a "$SUMMARY"
    timeout "$SP_BUDGET_S" "$B/sluice" bench serve "${common[@]}" --seed 1000 --workload shared-prefix \
      --groups "$SP_GROUPS" --prompts-per-group "$PER_GROUP" --system-len "${SYS_LEN:-2048}" \
      --question-len "${Q_LEN:-128}" --output-len "$SP_OUT_LEN" --request-rates "$SP_RATES" \
      --label "$LABEL, shared-prefix" --json "$OUT/serve_shared_prefix.json" >"$OUT/serve_shared_prefix.md" \
      2>"$OUT/serve_shared_prefix.log"
    rc=$?
    note "shared-prefix sweep rc=$rc"
    [ "$rc" = 0 ] || [ "$rc" = 124 ] || failed=1
    cat "$OUT/serve_shared_prefix.md" "$OUT/serve_shared_prefix.log" | tee -a "$SUMMARY"
    python3 -c "import urllib.request; print(urllib.request.urlopen('http://$HTTP/metrics', timeout=5).read().decode())" \
      >"$OUT/router_metrics.txt" 2>&1
    stop_cluster
    trap - EXIT
    note "serve: cluster stopped; $(grep -l -iE 'panicked|SIGSEGV|core dumped' "$OUT"/cluster/*.log 2>/dev/null | wc -l) log(s) with a crash"
    ;;
  *) echo "unknown step $s (init, serve)" ;;
  esac
done
exit "$failed"
