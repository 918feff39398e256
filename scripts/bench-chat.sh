#!/usr/bin/env bash
# A short, bounded chat-completions load against a running sluice router with GuideLLM
# (PyPI `guidellm`, pinned; installed into target/guidellm-venv on first use). The report
# in docs/perf.md was made with it against `sluice up --model <small preset>`.
#
# Usage: bash scripts/bench-chat.sh [URL] [MODEL_DIR] [PROFILE] [REQUESTS]
#   URL        router HTTP address (default http://127.0.0.1:8080)
#   MODEL_DIR  the served model's directory; GuideLLM counts tokens with its tokenizer.json
#   PROFILE    GuideLLM profile, e.g. synchronous or kind=concurrent,streams=4 (default synchronous)
#   REQUESTS   how many requests to send (default 12)
set -euo pipefail
cd "$(dirname "$0")/.."
URL=${1:-http://127.0.0.1:8080}
MODEL_DIR=${2:?the served model directory (for its tokenizer.json)}
PROFILE=${3:-synchronous}
REQUESTS=${4:-12}
VENV=target/guidellm-venv
PIN="guidellm==0.8.1"
if [ "$(cat "$VENV/.pin" 2>/dev/null)" != "$PIN" ]; then
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --disable-pip-version-check -q "$PIN"
  echo "$PIN" > "$VENV/.pin"
fi
case "$PROFILE" in kind=*) ;; *) PROFILE="kind=$PROFILE" ;; esac
MODEL=$(curl -sf "$URL/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
# Every request is bounded: 256-token synthetic prompts, 32 output tokens, REQUESTS of them.
timeout 900 "$VENV/bin/guidellm" run \
  --backend "kind=openai_http,target=$URL,model=$MODEL" \
  --profile "$PROFILE" \
  --constraint "kind=max_requests,count=$REQUESTS" \
  --tokenizer "kind=hf_auto,model=$MODEL_DIR" \
  --data "kind=synthetic_text,prompt_tokens=256,output_tokens=32" \
  --output kind=console --disable-progress
