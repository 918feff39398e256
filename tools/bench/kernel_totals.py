#!/usr/bin/env python3
"""Where a whole run's device time went, per kernel, from a timeline.sh recording (the
CUPTI records of every kernel: real starts and ends, not serialised as Nsight Compute
runs them). For prefill, whose kernels timeline.py's decode-step view does not cover:
record `sluice bench engine --prefill-tokens N --decode-steps 1 ...` (kernel_totals.sh
does) and divide by the prefills the run made (the `calls` of a kernel a prefill runs
once a layer, divided by the layers, say how many).

Prints the run's span, the time some kernel ran (the union of all kernels' intervals:
its complement is launch gaps and host waits), then per kernel name its calls, summed
durations, share of the summed durations and mean; `--top N` rows (default 30).

    kernel_totals.py TIMELINE.csv [--top 30]
"""
import argparse
from collections import defaultdict

from timeline import load, merged, short


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("timeline")
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args()
    ks = load(a.timeline)
    if not ks:
        raise SystemExit(f"{a.timeline}: no kernels recorded")
    span = max(k[1] for k in ks) - ks[0][0]
    busy = sum(b - x for x, b in merged([(k[0], k[1]) for k in ks]))
    per = defaultdict(lambda: [0, 0])
    for start, end, name, *_ in ks:
        p = per[short(name)]
        p[0] += 1
        p[1] += end - start
    total = sum(p[1] for p in per.values())
    print(f"{len(ks)} kernels over {span / 1e6:.1f} ms; some kernel running {busy / 1e6:.1f} ms "
          f"({100 * busy / span:.0f}%); summed durations {total / 1e6:.1f} ms")
    print(f"{'kernel':<34} {'calls':>7} {'ms':>9} {'share':>6} {'µs a call':>10}")
    for name, (calls, ns) in sorted(per.items(), key=lambda kv: -kv[1][1])[: a.top]:
        print(f"{name[:34]:<34} {calls:>7} {ns / 1e6:>9.2f} {100 * ns / total:>5.1f}% {ns / calls / 1e3:>10.1f}")


if __name__ == "__main__":
    main()
