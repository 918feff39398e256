#!/usr/bin/env bash
# The whole test suite: formatting, lints, and every test in the workspace (unit,
# kernel parity, reference conformance, CLI, UCX transfer, real etcd, and end-to-end
# clusters of real router/prefill/decode processes). Installs what it needs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
# A one-off build gains nothing from incremental caches, which double the target dir.
export CARGO_INCREMENTAL=0
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
# End-to-end tests start the service binaries, so build them first (same profile).
cargo build --workspace --bins --locked
# cargo-nextest runs each test in its own process under a time bound (.config/nextest.toml)
# and reports a stuck test by name; without it, cargo's own runner.
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --locked
  cargo test --workspace --locked --doc
else
  cargo test --workspace --locked
fi
# The build's footprint, so a CI disk running short shows in the log before it fails.
du -sh target 2>/dev/null || true
