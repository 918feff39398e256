#!/usr/bin/env bash
# GPU engine benchmark: `sluice bench engine --device cuda:N` vs transformers eager
# (tools/bench/transformers_gpu.py) on the same GPU and the same checkpoint (the
# `flash-bench` preset: V4-Flash attention dimensions, 4 layers, small MoE, random bf16
# weights written by `sluice model init` on this machine). Prints the markdown table of
# docs/perf.md with the speedups; both JSON reports are kept in $OUTDIR.
#
#   tools/bench/gpu_vs_transformers.sh [MODEL_DIR]
#
# Env: SLUICE (binary, default target/release/sluice), PYTHON (torch + transformers 5.17),
#      DEVICE (cuda:0), CONTEXTS (8192,65536), BATCHES (1,8,32), PREFILL (8192),
#      STEPS (16), OUTDIR (a temporary directory).
set -euo pipefail
cd "$(dirname "$0")/../.."
SLUICE=${SLUICE:-target/release/sluice}
PYTHON=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda:0}
CONTEXTS=${CONTEXTS:-8192,65536}
BATCHES=${BATCHES:-1,8,32}
PREFILL=${PREFILL:-8192}
STEPS=${STEPS:-16}
OUTDIR=${OUTDIR:-$(mktemp -d)}
MODEL=${1:-target/models/flash-bench}
[ -f "$MODEL/config.json" ] || "$SLUICE" model init --preset flash-bench --seed 0 --dtype bf16 --out "$MODEL"
ordinal=${DEVICE#cuda:}
"$SLUICE" bench engine --device "$DEVICE" --model "$MODEL" --kv-dtype bf16 --prefill-tokens "$PREFILL" \
  --contexts "$CONTEXTS" --batches "$BATCHES" --decode-steps "$STEPS" --json >"$OUTDIR/sluice.json"
CUDA_VISIBLE_DEVICES=$ordinal "$PYTHON" tools/bench/transformers_gpu.py --model "$MODEL" --prefill-tokens "$PREFILL" \
  --contexts "$CONTEXTS" --batches "$BATCHES" --decode-steps "$STEPS" >"$OUTDIR/hf.json"
"$PYTHON" - "$OUTDIR" <<'PY'
import json, sys
d = sys.argv[1]
s = json.load(open(f"{d}/sluice.json")); h = json.load(open(f"{d}/hf.json"))
print(f"{s['device']}; copy bandwidth {s['copy_gb_s']:.0f} GB/s; transformers {h['transformers']} / torch {h['torch']}, bf16 eager")
print()
print("| measurement | sluice | transformers eager | speedup |")
print("|---|---:|---:|---:|")
hp = h["prefill_tokens_per_s"]
print(f"| prefill {s['prefill_tokens']} tokens (tokens/s) | {s['prefill_tokens_per_s']:.0f} | "
      f"{hp and f'{hp:.0f}' or h['prefill_error']} | {hp and f'{s['prefill_tokens_per_s'] / hp:.1f}×' or '–'} |")
hd = {(r["context"], r["batch"]): r for r in h["decode"]}
for r in s["decode"]:
    o = hd.get((r["context"], r["batch"]), {})
    hm = o.get("ms_per_step")
    print(f"| decode ctx {r['context']} batch {r['batch']} (ms/step) | {r['ms_per_step']:.2f} | "
          f"{hm and f'{hm:.2f}' or o.get('error', '–')} | {hm and f'{hm / r['ms_per_step']:.1f}×' or '–'} |")
print()
print("| decode ctx | batch | device alone (ms/step) | bytes/step | achieved GB/s | of copy bandwidth |")
print("|---:|---:|---:|---:|---:|---:|")
for r in s["decode"]:
    print(f"| {r['context']} | {r['batch']} | {r['device_ms_per_step']:.2f} | {r['bytes_per_step'] / 1e6:.0f} MB | "
          f"{r['achieved_gb_s']:.0f} | {100 * r['fraction_of_copy']:.0f}% |")
# Kernel times: back to back on the device; "issued alone" adds the host's launch work.
if s.get("topk"):
    t = s["topk"]
    print(f"\ntop-{t['k']} over {t['candidates']} candidates (batch 1): {t['us']:.1f} µs "
          f"({t['issued_us']:.1f} µs issued alone)")
for c in s.get("compress") or []:
    print(f"compressor {c['kind']} over {c['tokens']} tokens: {c['us']:.1f} µs, {c['gb_s']:.0f} GB/s "
          f"({100 * c['gb_s'] / s['copy_gb_s']:.0f}% of copy; {c['issued_us']:.1f} µs issued alone)")
PY
