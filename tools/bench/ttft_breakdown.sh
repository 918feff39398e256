#!/usr/bin/env bash
# Where the time to first token goes on a GPU cluster, with the KV staged through host
# memory and moved GPU to GPU (GPU-direct): a truncated V4-Flash at real widths (LAYERS,
# default 8: 30.75 GB), the prefill worker on cuda:0 and the decode worker on cuda:1,
# a kvstore and the router, started by `sluice up`. For each path (`--gpu-direct off`,
# then `on`) `sluice bench serve` sends, one at a time:
#   - 8K- and 32K-token prompts (random tokens, 8 output tokens each): cold TTFT and its
#     breakdown (queue, prefix restore, prefill, KV transfer) by the servers' timings;
#   - a shared-prefix run (one 8,064-token prefix, 128-token questions, one request a
#     second so each prompt's blocks are in the store before the next arrives): TTFT of
#     prefix hits.
# Needs a CUDA-enabled libucx for the direct path (the libucx-cu13 wheel packed into
# .ucx/ucx-cu13.tgz by tools/ucx/fetch_cuda_ucx.sh); staged works with any libucx.
#
#   OUT=$OUT tools/bench/ttft_breakdown.sh [PATHS...]     PATHS: staged direct (default both)
#
# Env: B (executables [.device]), LAYERS [8], KV [fp8], MODEL [/dev/shm/flash$LAYERS,
# written when missing], READY_S [300], PREFILL_DEVICES [cuda:0], DECODE_DEVICES [cuda:1],
# LENS [8192 32768], SYS_LEN [8064] (a dry run of the flow on the CPU:
# MODEL=engine/tests/golden/tiny-official/model PREFILL_DEVICES=cpu DECODE_DEVICES=cpu LENS=300 SYS_LEN=256 ... staged).
set -uo pipefail
cd "$(dirname "$0")/../.."
B=${B:-.device}
# Packed by tools/bench/pack_device.sh: unpacked into /tmp/b (and the kernels' PTX into the cache).
B=$(tools/bench/unpack_device.sh "$B" /tmp/b)
B=$(cd "$B" && pwd)
OUT=${OUT:-/tmp}
mkdir -p "$OUT"
LAYERS=${LAYERS:-8} KV=${KV:-fp8}
DIR=${MODEL:-/dev/shm/flash$LAYERS}
export NCCL_NVLS_ENABLE=0 SLUICE_PTX_CACHE=${SLUICE_PTX_CACHE:-/tmp/ptx} SLUICE_BIN_DIR=$B
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
if [ -f .ucx/ucx-cu13.tgz ]; then
  mkdir -p /tmp/ucx && tar -C /tmp/ucx -xzf .ucx/ucx-cu13.tgz
  export LD_LIBRARY_PATH=/tmp/ucx/libucx/lib:$LD_LIBRARY_PATH UCX_MODULE_DIR=/tmp/ucx/libucx/lib/ucx
fi
SUMMARY=$OUT/ttft_summary.txt
note() { echo "$*" | tee -a "$SUMMARY"; }
if [ ! -f "$DIR/config.json" ]; then
  "$B/sluice" model init --preset flash --layers "$LAYERS" --seed 0 --out "$DIR" 2>&1 | tail -2 | tee -a "$SUMMARY"
fi
GRPC=127.0.0.1:50051
failed=0
for path in ${*:-staged direct}; do
  case $path in
  staged) mode=off ;;
  direct) mode=on ;;
  *) echo "unknown path $path (staged, direct)"; continue ;;
  esac
  rm -rf /tmp/sluice-kvstore-ttft
  "$B/sluice" up --model "$DIR" --prefill-devices "${PREFILL_DEVICES:-cuda:0}" \
    --decode-devices "${DECODE_DEVICES:-cuda:1}" --kv-dtype "$KV" \
    --gpu-direct "$mode" --swa-policy periodic:1024 --kvstore-dir /tmp/sluice-kvstore-ttft --kvstore-capacity 16GiB \
    --grpc "$GRPC" --http 127.0.0.1:8080 --log-dir "$OUT/cluster_$path" --no-sample \
    --ready-timeout-s "${READY_S:-300}" >"$OUT/up_$path.log" 2>&1 &
  up_pid=$!
  stop_cluster() {
    kill -TERM "$up_pid" 2>/dev/null || return 0
    for _ in $(seq 1 60); do kill -0 "$up_pid" 2>/dev/null || return 0; sleep 1; done
    kill -KILL "$up_pid" 2>/dev/null
  }
  trap stop_cluster EXIT
  t0=$SECONDS
  until grep -qs "sluice is up" "$OUT/up_$path.log"; do
    if ! kill -0 "$up_pid" 2>/dev/null || [ $((SECONDS - t0)) -gt "${READY_S:-300}" ]; then
      note "$path: the cluster did not come up after $((SECONDS - t0)) s"
      tail -5 "$OUT/up_$path.log"
      for f in "$OUT/cluster_$path"/*.log; do echo "--- $f"; tail -8 "$f"; done
      failed=1
      break
    fi
    sleep 1
  done
  if grep -qs "sluice is up" "$OUT/up_$path.log"; then
    note "=== $path (--gpu-direct $mode): cluster up in $((SECONDS - t0)) s; KV paths:"
    grep -h -E "KV paths|registered with UCX|host mirror|UCX 1\." "$OUT/cluster_$path"/*.log | sed 's/\x1b\[[0-9;]*m//g' |
      cut -c1-300 | sort -u | tee -a "$SUMMARY"
    common=(--router "http://$GRPC" --model "$DIR" --gpus 2 --max-concurrency 1 --timeout-s 120 --request-rates inf)
    for len in ${LENS:-8192 32768}; do
      "$B/sluice" bench serve "${common[@]}" --workload random --seed "$len" --num-prompts 3 --input-len "$len" \
        --output-len 8 --range-ratio 0 --label "$path, $len-token prompts" --json "$OUT/ttft_${path}_$len.json" \
        >"$OUT/ttft_${path}_$len.md" 2>"$OUT/ttft_${path}_$len.log" || failed=1
      note "--- $path, cold $len-token prompts"
      tee -a "$SUMMARY" <"$OUT/ttft_${path}_$len.md"
    done
    "$B/sluice" bench serve --router "http://$GRPC" --model "$DIR" --gpus 2 --max-concurrency 1 --timeout-s 120 \
      --workload shared-prefix --seed 7 --groups 1 --prompts-per-group 5 --system-len "${SYS_LEN:-8064}" --question-len 128 \
      --output-len 8 --request-rates 1 --label "$path, shared prefix" --json "$OUT/ttft_${path}_hits.json" \
      >"$OUT/ttft_${path}_hits.md" 2>"$OUT/ttft_${path}_hits.log" || failed=1
    note "--- $path, an 8,064-token shared prefix (the first request cold, the rest hits)"
    tee -a "$SUMMARY" <"$OUT/ttft_${path}_hits.md"
    python3 - "$OUT/ttft_${path}_hits.json" <<'EOF' | tee -a "$SUMMARY"
import json, sys
doc = json.load(open(sys.argv[1]))
for run in doc["runs"]:
    for r in run["requests"]:
        if r.get("ok"):
            t = r["server_timings_ms"]
            print(f"request {r['index']}: cached {r['usage']['cached_tokens']} of {r['usage']['prompt_tokens']}, "
                  f"TTFT {r['ttft_ms']:.1f} ms = queue {t['queue']:.1f} + restore {t['prefix_restore']:.1f} "
                  f"+ prefill {t['prefill']:.1f} + KV transfer {t['kv_transfer']:.2f} (+ routing, decode's first step)")
EOF
  fi
  stop_cluster
  trap - EXIT
  note "$path: stopped; $(grep -l -iE 'panicked|SIGSEGV|core dumped' "$OUT/cluster_$path"/*.log 2>/dev/null | wc -l) log(s) with a crash"
done
exit "$failed"
