#!/usr/bin/env bash
# CPU engine benchmark: sluice vs transformers eager on the same checkpoint, the same
# machine and the same thread count, runs interleaved so both see the same noise.
# Prints a markdown table (medians over ROUNDS) with the ratios sluice ÷ transformers.
#
#   tools/bench/cpu_vs_transformers.sh [MODEL_DIR]
#
# Env: PYTHON (with torch + transformers==5.17.0), THREADS (default: nproc),
#      PROMPT (512), STEPS (32), ROUNDS (3).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
THREADS=${THREADS:-$(nproc)}
PROMPT=${PROMPT:-512}
STEPS=${STEPS:-32}
ROUNDS=${ROUNDS:-3}
cargo build --release -q -p sluice
SLUICE=target/release/sluice
MODEL=${1:-target/models/small}
[ -f "$MODEL/config.json" ] || $SLUICE model init --preset small --seed 0 --out "$MODEL"
out=$(mktemp -d)
for r in $(seq "$ROUNDS"); do
  echo "round $r/$ROUNDS ..." >&2
  $SLUICE --threads "$THREADS" bench engine --model "$MODEL" --prompt-tokens "$PROMPT" --decode-steps "$STEPS" --json 2>/dev/null >>"$out/sluice.jsonl"
  $PYTHON tools/bench/transformers_cpu.py --model "$MODEL" --prompt-tokens "$PROMPT" --decode-steps "$STEPS" --threads "$THREADS" 2>/dev/null | tail -1 >>"$out/hf.jsonl"
done
$PYTHON - "$out" "$THREADS" "$PROMPT" <<'PY'
import json, statistics, sys, platform
d, threads, prompt = sys.argv[1], sys.argv[2], sys.argv[3]
def load(n):
    rows = [json.loads(l) for l in open(f"{d}/{n}.jsonl")]
    return {k: statistics.median(r[k] for r in rows) for k in ("prefill_tokens_per_s", "decode_ms_per_step")}, rows[0]
s, s0 = load("sluice"); h, h0 = load("hf")
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
print(f"CPU: {cpu}, {threads} threads; prompt {prompt} tokens; {h0.get('transformers')} / torch {h0.get('torch')}")
print()
print("| metric | sluice | transformers eager | sluice ÷ transformers |")
print("|---|---:|---:|---:|")
print(f"| prefill tokens/s | {s['prefill_tokens_per_s']:.0f} | {h['prefill_tokens_per_s']:.0f} | {s['prefill_tokens_per_s']/h['prefill_tokens_per_s']:.2f}× |")
print(f"| decode ms/step (batch 1) | {s['decode_ms_per_step']:.2f} | {h['decode_ms_per_step']:.2f} | {h['decode_ms_per_step']/s['decode_ms_per_step']:.2f}× faster |")
PY
rm -rf "$out"
