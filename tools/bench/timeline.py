#!/usr/bin/env python3
"""Where one decode step's time goes, from the kernel timeline tools/bench/timeline.sh
records (CUPTI concurrent-kernel records: each kernel's real start and end, overlaps
included, unlike Nsight Compute's one-kernel-at-a-time durations).

`sluice bench engine` times the device's own step by queueing a step behind a
`gpu_sleep` hold; the kernels after each hold, up to the first idle gap longer than
--gap-us, are one step run back to back. For the step of median length this prints:

- the step's span next to the benchmark's own "on the device alone" figure (what the
  recording costs);
- per kernel name, its calls, time from start to end (with programmatic dependent
  launch a kernel starts while the one before still runs, so this includes waiting),
  and its *exposed* time: how far its end moved the step's end (kernels sorted by end,
  each one's end minus the latest end before it). The exposed times add up to the
  step, so they say which kernels the step really waits for; `idle` is the part of
  that when no kernel ran at all (launch gaps, dependencies resolved late);
- the step in order, for reading a layer's chain;
- with `--gap KERNEL:BEFORE` (repeatable), over the benchmark's device steps: each call of
  KERNEL's end minus the end of the last BEFORE call on its stream that started before
  it (how long KERNEL keeps the chain waiting after what it depends on), median and
  range; `--gap-from N` leaves out each step's first N calls (e.g. V4's hash-routed
  layers, whose routing differs).

    timeline.py TIMELINE.csv [BENCH_LOG] [--gap-us 20] [--order 60] [--skip 0] [--steps 3]
                [--gap KERNEL:BEFORE]... [--gap-from N]
"""
import argparse
import csv
import gzip
import re
import sys
from collections import defaultdict


def load(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = list(csv.DictReader(f))
    ks = [(int(r["start_ns"]), int(r["end_ns"]), r["name"], int(r["grid_x"]), int(r["block_x"]), r["stream"])
          for r in rows]
    ks.sort()
    return ks


def steps(ks, gap_ns):
    """(hold end, kernels) for every kernel run that follows a gpu_sleep hold."""
    out = []
    holds = [i for i, k in enumerate(ks) if k[2].startswith("gpu_sleep")]
    for h in holds:
        hold_end = ks[h][1]
        run, reach = [], hold_end
        for k in ks[h + 1:]:
            if k[2].startswith("gpu_sleep") or k[0] > reach + gap_ns:
                break
            run.append(k)
            reach = max(reach, k[1])
        if run:
            out.append((hold_end, run))
    return out


def merged(intervals):
    segs = []
    for a, b in sorted(intervals):
        if segs and a <= segs[-1][1]:
            segs[-1][1] = max(segs[-1][1], b)
        else:
            segs.append([a, b])
    return segs


def covered(segs, a, b):
    return sum(max(0, min(b, y) - max(a, x)) for x, y in segs if y > a and x < b)


def short(name):
    return name.split("(")[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("timeline")
    ap.add_argument("bench_log", nargs="?")
    ap.add_argument("--gap-us", type=float, default=20.0)
    ap.add_argument("--order", type=int, default=60, help="kernels of the step to list in order")
    ap.add_argument("--steps", type=int, default=3, help="the benchmark's device steps: the last holds")
    ap.add_argument("--skip", type=int, default=0, help="kernels of the step to skip before that list")
    ap.add_argument("--gap", action="append", default=[], metavar="KERNEL:BEFORE",
                    help="KERNEL's end minus the end of the BEFORE call it follows on its stream")
    ap.add_argument("--gap-from", type=int, default=0, help="--gap leaves out each step's first N calls")
    a = ap.parse_args()

    found = steps(load(a.timeline), a.gap_us * 1e3)
    if not found:
        sys.exit("no kernels after a gpu_sleep hold: was the timeline recorded from `sluice bench engine`?")
    # The benchmark's own device steps are its last holds (holds before them time other
    # things: the copy and tensor-core ceilings).
    found = found[-a.steps:]
    spans = [max(k[1] for k in run) - hold_end for hold_end, run in found]
    pick = sorted(range(len(found)), key=lambda i: spans[i])[len(found) // 2]
    hold_end, run = found[pick]
    end = hold_end + spans[pick]

    bench = []
    if a.bench_log:
        for line in open(a.bench_log):
            m = re.search(r"([\d.]+) ms/step on the device alone", line)
            if m:
                bench.append(float(m.group(1)))
    print(f"{len(found)} steps after holds, spans (ms): {' '.join(f'{s / 1e6:.3f}' for s in spans)}"
          + (f"; the benchmark's device steps without the recording: {' '.join(f'{b:.3f}' for b in bench)}" if bench else ""))

    segs = merged([(k[0], k[1]) for k in run])
    busy = covered(segs, hold_end, end)
    print(f"median step: {len(run)} kernels, {spans[pick] / 1e6:.3f} ms, no kernel running for "
          f"{(spans[pick] - busy) / 1e3:.1f} µs; kernels' start-to-end times sum to "
          f"{sum(k[1] - k[0] for k in run) / 1e6:.3f} ms")

    # Each kernel's exposed time (and the idle part of it), by its index in `run`: the
    # kernels sorted by end, each one's end minus the latest end before it.
    exposed, idle = [0] * len(run), [0] * len(run)
    latest = hold_end
    for i in sorted(range(len(run)), key=lambda i: run[i][1]):
        inc = max(0, run[i][1] - latest)
        exposed[i] = inc
        idle[i] = inc - covered(segs, latest, latest + inc) if inc else 0
        latest = max(latest, run[i][1])

    by = defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    for i, k in enumerate(run):
        e = by[short(k[2])]
        e[0] += 1
        e[1] += k[1] - k[0]
        e[2] += exposed[i]
        e[3] += idle[i]
    total = spans[pick]
    print(f"\n{'kernel':34} {'calls':>5} {'start-end µs':>12} {'exposed µs':>10} {'share':>6} {'idle µs':>8} {'exposed/call':>12}")
    for name, (n, dur, inc, idl) in sorted(by.items(), key=lambda kv: -kv[1][2]):
        print(f"{name[:34]:34} {n:5} {dur / 1e3:12.1f} {inc / 1e3:10.1f} {100 * inc / total:5.1f}% {idl / 1e3:8.1f} {inc / n / 1e3:12.2f}")

    print(f"\nin order ({a.order} from kernel {a.skip}): start µs, end µs from the hold's end, start-to-end, exposed, grid×block")
    for i in range(a.skip, min(a.skip + a.order, len(run))):
        k = run[i]
        print(f"{(k[0] - hold_end) / 1e3:9.1f} {(k[1] - hold_end) / 1e3:9.1f} {(k[1] - k[0]) / 1e3:7.1f} "
              f"{exposed[i] / 1e3:7.1f}  {short(k[2])[:40]} {k[3]}x{k[4]}")

    for spec in a.gap:
        print_gap(found, spec, a.gap_from)


def print_gap(found, spec, first):
    """--gap KERNEL:BEFORE over every device step's kernels."""
    kernel, _, before = spec.partition(":")
    if not before:
        sys.exit(f"--gap {spec}: want KERNEL:BEFORE (two kernel names)")
    gaps = []
    for _, run in found:
        calls = [i for i, k in enumerate(run) if short(k[2]) == kernel][first:]
        for i in calls:
            k = run[i]
            prev = [x for x in run[:i] if short(x[2]) == before and x[5] == k[5]]
            if prev:
                gaps.append((k[1] - prev[-1][1]) / 1e3)
    if not gaps:
        print(f"\n--gap {spec}: no {kernel} call follows a {before} call on its stream")
        return
    gaps.sort()
    print(f"\n{kernel} end - {before} end (µs, {len(gaps)} calls over {len(found)} steps"
          f"{f', each step from call {first}' if first else ''}): median {gaps[len(gaps) // 2]:.1f}, "
          f"range {gaps[0]:.1f}-{gaps[-1]:.1f}")


if __name__ == "__main__":
    main()
