#!/usr/bin/env python3
"""Measure the two ceilings docs/perf.md compares against (METHOD.md): the device-to-device
copy bandwidth (bytes read + written per second) and a large bf16 matrix product, both
with CUDA events, median of repeated runs after warm-up, on random data. Prints one JSON line.
"""
import json
import statistics

import torch


def timed(fn, reps=20, warm=3):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return statistics.median(out)


def main():
    dev = torch.device("cuda:0")
    n = 1 << 30  # 1 GiB per buffer: far past the 60 MB L2
    src = torch.rand(n // 4, device=dev)  # n bytes of f32
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src))
    copy_gbs = 2 * src.numel() * 4 / t / 1e9
    m = 8192
    a = torch.randn(m, m, device=dev, dtype=torch.bfloat16)
    b = torch.randn(m, m, device=dev, dtype=torch.bfloat16)
    tg = timed(lambda: a @ b, reps=10)
    p = torch.cuda.get_device_properties(0)
    print(json.dumps({
        "device": p.name, "sms": p.multi_processor_count, "memory_gib": p.total_memory / 2**30,
        "copy_bytes": 2 * src.numel() * 4, "copy_s": t, "copy_gb_s": copy_gbs,
        "bf16_gemm_tflops": 2 * m ** 3 / tg / 1e12, "torch": torch.__version__,
    }))


if __name__ == "__main__":
    main()
