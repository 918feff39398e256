#!/usr/bin/env bash
# Build sluice and bring up a local cluster (router + one prefill + one decode worker)
# serving the `small` preset model (written to target/models/small once), send a
# sample request that streams tokens, and keep serving until Ctrl-C.
# Extra arguments go to `sluice up` (e.g. --once to stop after the sample request,
# --model DIR, --etcd URL, --prefill N --decode N).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
cargo build --release --locked --workspace --bins
exec target/release/sluice up "$@"
