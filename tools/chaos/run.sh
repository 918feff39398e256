#!/usr/bin/env bash
# The chaos suite (tests/tests/chaos/): a local cluster under a steady streaming load
# while every role is killed and restarted, etcd restarted empty, the kvstore's disk
# filled and the kvstore stalled; prints the table of docs/reliability.md and writes it
# to ${OUT:-target}/chaos.md. Root is needed for the disk-full fault (a tmpfs mount);
# without it that row is left out.
#
#   tools/chaos/run.sh [ROUNDS]      (default 3 rounds of every fault, ~2 minutes each)
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/deps.sh
rounds=${1:-3}
out=${OUT:-target}
mkdir -p "$out"
cargo build --release --workspace --bins --locked
SLUICE_CHAOS_ROUNDS=$rounds SLUICE_CHAOS_REPORT="$out/chaos.md" \
  cargo test --release --locked -p sluice-e2e --test chaos -- --ignored --nocapture
echo "table: $out/chaos.md"
