"""The single-pass backward's key chunks: the rule before 2026-11-26 (enough
chunks for 8 work items, which ops.bwd_cpus(4) reproduces) against today's
(two items per CPU the process may run on), in one process, interleaved,
backward alone, medians of 7 (docs/performance.md, "Intel Xeon, 16 cores").
Identical rules on machines of up to 4 CPUs.

    .venv/bin/python benchmarks/key_chunks.py THREADS
"""
import statistics
import sys
import time

import torch

import torch_masked_attn as tma
from torch_masked_attn import ops

CASES = {  # name: (B, H, Hkv, L, D, dtype), all causal
    "long-causal f32": (1, 8, 8, 4096, 64, torch.float32),
    "long-causal bf16": (1, 8, 8, 4096, 64, torch.bfloat16),
    "one-head-long f32": (1, 1, 1, 8192, 128, torch.float32),
    "gqa B=1 H=16 Hkv=4 L=2048": (1, 16, 4, 2048, 64, torch.float32),
}


def backward_seconds(q, k, v, g):
    out = tma.functional.masked_attention(q, k, v, is_causal=True)
    t = time.perf_counter()
    out.backward(g)
    q.grad = k.grad = v.grad = None
    return time.perf_counter() - t


def main():
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else torch.get_num_threads()
    torch.set_num_threads(threads)
    print("cpus", ops._clib.ma_cpu_count(), "threads", threads)
    for name, (B, H, Hkv, L, D, dt) in CASES.items():
        q = torch.randn(B, H, L, D, dtype=dt, requires_grad=True)
        k, v = (torch.randn(B, Hkv, L, D, dtype=dt, requires_grad=True) for _ in range(2))
        g = torch.randn(B, H, L, D, dtype=dt)
        times = {"old": [], "new": []}
        for rep in range(8):  # the first repetition warms up; the order alternates
            for label in (("old", "new") if rep % 2 == 0 else ("new", "old")):
                with ops.bwd_cpus(4 if label == "old" else None):
                    t = backward_seconds(q, k, v, g)
                if rep > 0:
                    times[label].append(t)
        old, new = (statistics.median(times[x]) * 1e3 for x in ("old", "new"))
        print(f"{name:28s} backward  old {old:8.1f} ms  new {new:8.1f} ms  old/new {old / new:5.2f}")


if __name__ == "__main__":
    main()
