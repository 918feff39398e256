#!/usr/bin/env bash
# Run an executable again and again with core dumps on, then print every thread's stack
# from the newest cores. The device machines have no gdb, but their cuda-gdb reads host
# cores; this is what caught `cuda_conformance`'s crash inside the driver (docs/perf.md,
# "FP8 keys turned into bf16 by placing their bits; the `cuda_conformance` crash").
#
#   tools/bench/crash_loop.sh EXE [SECONDS] [ARGS...]     (device machine, repo root)
#
# SECONDS (default 270) bounds the loop; each run is killed after RUN_LIMIT seconds
# (default 120). Env: OUT (default /tmp): each failing run's output (crash_N.log) and the
# stacks (bt_core.PID.txt); CORES (default /tmp/cores); KEEP (default 2): cores kept (each
# can be gigabytes: the process's pinned host memory is in it); SYMBOLS: a copy of EXE
# that keeps its symbol table (`objcopy --strip-debug`; the carried executables are
# stripped), run in its place so the stacks name functions.
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: $0 EXE [SECONDS] [ARGS...]" >&2; exit 2; }
exe=$1
secs=${2:-270}
shift $(($# >= 2 ? 2 : 1))
out=${OUT:-/tmp}
cores=${CORES:-/tmp/cores}
keep=${KEEP:-2}
run=${SYMBOLS:-$exe}
mkdir -p "$cores" "$out"
ulimit -c unlimited
if [ -w /proc/sys/kernel/core_pattern ] && echo "$cores/core.%p" >/proc/sys/kernel/core_pattern 2>/dev/null; then
  :
else
  echo "core_pattern is not writable here; cores go where it says: $(cat /proc/sys/kernel/core_pattern)"
fi

start=$SECONDS
i=0
failed=0
while ((SECONDS - start < secs)); do
  i=$((i + 1))
  (cd "$cores" && timeout -s KILL "${RUN_LIMIT:-120}" "$run" "$@") >"$out/crash_run.log" 2>&1
  rc=$?
  if [ $rc -ne 0 ]; then
    failed=$((failed + 1))
    cp "$out/crash_run.log" "$out/crash_$i.log"
    # Only the newest cores stay: a loop of crashes would fill the disk.
    ls -t "$cores"/core* 2>/dev/null | tail -n +$((keep + 1)) | xargs -r rm -f
  fi
  echo "run $i: exit $rc"
done
echo "$failed of $i runs failed (exit 137: killed after ${RUN_LIMIT:-120} s, a hang; 139: SIGSEGV; 134: abort)"

gdb=$(command -v cuda-gdb || command -v gdb || ls /usr/local/cuda/bin/cuda-gdb 2>/dev/null || true)
if [ -z "$gdb" ]; then
  echo "no cuda-gdb or gdb here: the cores are left in $cores"
  exit 0
fi
for c in $(ls -t "$cores"/core* 2>/dev/null | head -"$keep"); do
  bt="$out/bt_$(basename "$c").txt"
  timeout 300 "$gdb" -q -batch -ex "set pagination off" -ex "info proc mappings" -ex "thread apply all bt 40" \
    "$run" "$c" >"$bt" 2>&1
  echo "== $c (all threads: $bt)"
  grep -A3 "Program terminated" "$bt"
done
