#!/usr/bin/env python3
"""One decode step's kernels from an Nsight Compute CSV (tools/bench/step_trace.sh).

The kernels between the last two `gpu_sleep` launches are one step (the benchmark queues
its last steps behind a hold). Prints their count, the sum of their durations, the
step's wall time without the profiler (from the benchmark's own line), and the kernels
by total time.
"""
import csv
import re
import signal
import sys
from collections import defaultdict


def rows(path):
    with open(path) as f:
        lines = [l for l in f if not l.startswith("==")]
    start = next(i for i, l in enumerate(lines) if l.startswith('"ID"'))
    reader = csv.DictReader(lines[start:])
    for r in reader:
        v = r.get("gpu__time_duration.sum", "")
        if not v or not r["ID"].isdigit():
            continue  # the units row
        yield r["Kernel Name"], float(v.replace(",", "")), r.get("Grid Size", ""), r.get("Block Size", "")


def main():
    kernels = list(rows(sys.argv[1]))
    # Durations are in ns with --print-units base? ncu's raw page gives the unit in the
    # second row; gpu__time_duration is nanoseconds by default ("nsecond").
    holds = [i for i, k in enumerate(kernels) if k[0].startswith("gpu_sleep")]
    if len(holds) < 2:
        sys.exit(f"expected the benchmark's gpu_sleep holds, found {len(holds)}")
    step = kernels[holds[-2] + 1 : holds[-1]]
    total_us = sum(k[1] for k in step) / 1e3
    wall = ""
    if len(sys.argv) > 2:
        for line in open(sys.argv[2]):
            m = re.search(r"([\d.]+) ms/step on the device alone", line)
            if m:
                wall = float(m.group(1))
    print(f"one decode step: {len(step)} kernels, {total_us / 1e3:.3f} ms of kernel time", end="")
    if wall:
        gaps = wall * 1e3 - total_us
        print(f"; step on the device {wall:.3f} ms: {gaps / 1e3:.3f} ms between kernels "
              f"({gaps / len(step):.2f} µs a launch)")
    else:
        print()
    by = defaultdict(lambda: [0, 0.0, set()])
    for name, ns, grid, block in step:
        short = name.split("(")[0]
        by[short][0] += 1
        by[short][1] += ns / 1e3
        by[short][2].add(f"{grid}x{block}")
    print(f"{'kernel':40} {'calls':>6} {'µs':>9} {'µs/call':>8} {'share':>6}  shapes")
    for name, (n, us, shapes) in sorted(by.items(), key=lambda kv: -kv[1][1]):
        print(f"{name[:40]:40} {n:6} {us:9.1f} {us / n:8.2f} {100 * us / total_us:5.1f}%  {' '.join(sorted(shapes))[:60]}")
    # The step in order, for reading the layer's structure.
    print("\nin order (first 80):")
    for name, ns, grid, block in step[:80]:
        print(f"  {ns / 1e3:8.2f} µs  {name.split('(')[0][:40]:40} {grid} {block}")


# Piped into `head`: stop quietly when the reader goes away.
signal.signal(signal.SIGPIPE, signal.SIG_DFL)
main()
