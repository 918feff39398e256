#!/usr/bin/env python3
"""Where a whole run's device time went, per kernel, from a timeline.sh recording (the
CUPTI records of every kernel: real starts and ends, not serialised as Nsight Compute
runs them). For prefill, whose kernels timeline.py's decode-step view does not cover:
record `sluice bench engine --prefill-tokens N --decode-steps 1 ...` (`TOTALS=1
RUN="..." timeline.sh` does) and divide by the prefills the run made (the `calls` of a kernel a prefill runs
once a layer, divided by the layers, say how many).

Prints the run's span, the time some kernel ran (the union of all kernels' intervals:
its complement is launch gaps and host waits), then per kernel name its calls, summed
durations, share of the summed durations and mean; `--top N` rows (default 30).
`--parts`: the run cut where the device idles at least `--cut-ms` (default 0.5; the
benchmark's `gpu_sleep` holds dropped first), one line a part (its kernels, span and the
durations of its `--mark` kernel's calls, default attention_wg: an 8K prefill is the part
with four long ones); `--part N`: the totals of part N alone, then its kernels' calls in
order with `--calls NAME[,NAME…]` (substrings).
`--gaps N`: also where the device sat idle — the gaps of at least 5 µs between busy
intervals (none next to the benchmark's own `gpu_sleep` holds), summed by the kernel that
ended before each and the one that started after, the N largest pairs (a prefill's host
waits, e.g. a read-back, show up as gaps after the kernel whose results the host reads).

    kernel_totals.py TIMELINE.csv [--top 30] [--gaps 12]
"""
import argparse
import bisect
from collections import defaultdict

from timeline import load, merged, short


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("timeline")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--gaps", type=int, default=0)
    ap.add_argument("--parts", action="store_true")
    ap.add_argument("--part", type=int)
    ap.add_argument("--cut-ms", type=float, default=0.5)
    ap.add_argument("--mark", default="attention_wg")
    ap.add_argument("--calls", default="")
    a = ap.parse_args()
    ks = load(a.timeline)
    if not ks:
        raise SystemExit(f"{a.timeline}: no kernels recorded")
    if a.parts or a.part is not None:
        parts = cut(ks, a.cut_ms * 1e6)
        if a.part is None:
            for i, p in enumerate(parts):
                marks = [round((k[1] - k[0]) / 1e3) for k in p if short(k[2]) == a.mark]
                print(f"part {i}: {len(p)} kernels, {(max(k[1] for k in p) - p[0][0]) / 1e3:.1f} µs, {a.mark} {marks}")
            return
        ks = parts[a.part]
        names = [n for n in a.calls.split(",") if n]
        for k in ks if names else []:
            if any(n in k[2] for n in names):
                print(f"{(k[0] - ks[0][0]) / 1e3:>10.1f} µs {(k[1] - k[0]) / 1e3:>8.1f} µs  {short(k[2])[:48]} grid {k[3]}")
    span = max(k[1] for k in ks) - ks[0][0]
    segs = merged([(k[0], k[1]) for k in ks])
    busy = sum(b - x for x, b in segs)
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
    if a.gaps:
        idle_gaps(ks, segs, a.gaps)


def cut(ks, gap_ns):
    """The kernels but the benchmark's holds, in parts wherever the device idles gap_ns."""
    ks = [k for k in ks if not short(k[2]).startswith("gpu_sleep")]
    parts, end = [], None
    for k in ks:
        if end is None or k[0] - end > gap_ns:
            parts.append([])
        parts[-1].append(k)
        end = k[1] if end is None else max(end, k[1])
    return parts


def idle_gaps(ks, segs, top):
    """The idle time between the busy intervals `segs`, by (kernel before, kernel after)."""
    ends = sorted((k[1], short(k[2])) for k in ks)
    starts = sorted((k[0], short(k[2])) for k in ks)
    pairs = defaultdict(lambda: [0, 0])
    for (_, end), (nxt, _) in zip(segs, segs[1:]):
        gap = nxt - end
        if gap < 5000:
            continue
        before = ends[bisect.bisect_right(ends, (end, "\uffff")) - 1][1]
        after = starts[bisect.bisect_left(starts, (nxt, ""))][1]
        if before.startswith("gpu_sleep") or after.startswith("gpu_sleep"):
            continue
        p = pairs[(before, after)]
        p[0] += 1
        p[1] += gap
    idle = sum(p[1] for p in pairs.values())
    print(f"idle gaps of 5 µs or more (not next to gpu_sleep): {idle / 1e6:.1f} ms in {sum(p[0] for p in pairs.values())}")
    print(f"{'kernel before':<30} {'kernel after':<30} {'gaps':>5} {'ms':>8} {'µs a gap':>9}")
    for (b, n), (count, ns) in sorted(pairs.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"{b[:30]:<30} {n[:30]:<30} {count:>5} {ns / 1e6:>8.2f} {ns / count / 1e3:>9.1f}")


if __name__ == "__main__":
    main()
