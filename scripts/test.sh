#!/usr/bin/env bash
# The whole test suite: formatting, lints, and every test in the workspace
# (unit, kernel parity, reference conformance, CLI). Installs what it needs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo test --workspace --locked
