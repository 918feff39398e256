#!/usr/bin/env bash
# Coverage-guided fuzzing with libFuzzer (through cargo-fuzz) of one target or all:
#
#   scripts/fuzz.sh TARGET|all [SECONDS per target, default 300]
#
# Targets are the files in fuzz/fuzz_targets/ (docs/reliability.md, "Fuzzing"). Each run
# starts from fuzz/corpus/TARGET and fuzz/regressions/TARGET and keeps what it finds
# under target/fuzz/corpus/TARGET (not committed); a failing input is saved to
# fuzz/artifacts/TARGET/ and the script exits non-zero naming it. Minimise it
# (`cargo fuzz tmin`), fix the parser, and commit it under fuzz/regressions/TARGET/, where
# `cargo test -p sluice-fuzz` replays it from then on.
#
# cargo-fuzz needs nightly compiler flags (sanitizer coverage, AddressSanitizer); the
# stable toolchain accepts them with RUSTC_BOOTSTRAP=1, so no nightly is installed.
set -euo pipefail
cd "$(dirname "$0")/.."

target=${1:?usage: scripts/fuzz.sh TARGET|all [SECONDS]}
seconds=${2:-300}
cargo_fuzz_version=0.13.2

if ! cargo fuzz --version 2>/dev/null | grep -q "$cargo_fuzz_version"; then
    cargo install cargo-fuzz --locked --version "$cargo_fuzz_version"
fi
export RUSTC_BOOTSTRAP=1

if [ "$target" = all ]; then
    targets=$(ls fuzz/fuzz_targets | sed 's/\.rs$//')
elif [ -f "fuzz/fuzz_targets/$target.rs" ]; then
    targets=$target
else
    echo "no fuzz target \`$target\`; choose one of: all $(ls fuzz/fuzz_targets | sed 's/\.rs$//' | tr '\n' ' ')" >&2
    exit 2
fi

# Release code with debug assertions and overflow checks (an overflow is a finding),
# AddressSanitizer (its allocator turns an allocation sized by a hostile length field
# into a finding via -malloc_limit_mb), in its own target dir so that a fuzz build never
# waits on, or invalidates, the normal builds.
build=(--fuzz-dir fuzz -O -a --features libfuzzer --target-dir target/fuzz --codegen-units 16)
cargo fuzz build "${build[@]}"

mkdir -p target/fuzz/logs
status=0
for t in $targets; do
    mkdir -p "target/fuzz/corpus/$t" "fuzz/corpus/$t" "fuzz/regressions/$t"
    log="target/fuzz/logs/$t.log"
    echo "== $t: ${seconds}s (log: $log)"
    if ! cargo fuzz run "${build[@]}" "$t" "target/fuzz/corpus/$t" "fuzz/corpus/$t" "fuzz/regressions/$t" -- \
        -max_total_time="$seconds" -timeout=10 -rss_limit_mb=4096 -malloc_limit_mb=1024 -max_len=65536 \
        -print_final_stats=1 >"$log" 2>&1; then
        status=1
        echo "!! $t failed; input: $(grep -o 'fuzz/artifacts/[^ ]*' "$log" | tail -1)" >&2
        tail -30 "$log" >&2
    fi
    runs=$(grep -o 'stat::number_of_executed_units: [0-9]*' "$log" | grep -o '[0-9]*$' || echo "?")
    echo "   $t: $runs executions, corpus $(ls "target/fuzz/corpus/$t" | wc -l) new inputs"
done
exit $status
