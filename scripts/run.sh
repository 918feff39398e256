#!/usr/bin/env bash
# Build sluice, write the `small` preset model (once), describe it, and generate
# from a sample prompt with the in-process engine.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
cargo build --release --locked -p sluice
sluice=target/release/sluice
model=${SLUICE_MODEL:-target/models/small}
[ -f "$model/config.json" ] || "$sluice" model init --preset small --seed 0 --out "$model"
"$sluice" model inspect "$model"
echo
"$sluice" generate --model "$model" --prompt-ids 1,2,3,4,5,6,7,8 --max-tokens 16 --top-logprobs 2
