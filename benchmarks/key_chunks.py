"""The single-pass backward's key chunks under several CPU counts of the rule
(ma_attn_bwd_kv_chunks: enough chunks for a work item per CPU, at least 8
items), in one process, interleaved, backward alone, medians of 7
(docs/performance/intel-amx-16cpu.md, "Key chunks"). A count of 8 or less gives the
rule's floor (8 items); "machine" is the CPU count the process has.

    .venv/bin/python benchmarks/key_chunks.py [THREADS] [--cpus 4,8,machine]
"""

import argparse
import statistics
import time

import torch

import torch_masked_attn as tma
from torch_masked_attn import _library, ops

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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("threads", nargs="?", type=int, default=torch.get_num_threads())
    ap.add_argument(
        "--cpus", default="8,machine", help="CPU counts for the rule, comma-separated (machine: none forced)"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    labels = args.cpus.split(",")
    cpus = _library._clib.ma_cpu_count()
    print(f"cpus {cpus}, threads {args.threads}; backward ms, median of 7, per CPU count of the rule")
    for name, (B, H, Hkv, L, D, dt) in CASES.items():
        q = torch.randn(B, H, L, D, dtype=dt, requires_grad=True)
        k, v = (torch.randn(B, Hkv, L, D, dtype=dt, requires_grad=True) for _ in range(2))
        g = torch.randn(B, H, L, D, dtype=dt)
        times = {x: [] for x in labels}
        for rep in range(8):  # the first repetition warms up; the order alternates
            for label in labels if rep % 2 == 0 else labels[::-1]:
                with ops.bwd_cpus(None if label == "machine" else int(label)):
                    t = backward_seconds(q, k, v, g)
                if rep > 0:
                    times[label].append(t)
        print(f"{name:28s} " + "  ".join(f"{x}: {statistics.median(times[x]) * 1e3:7.1f}" for x in labels))


if __name__ == "__main__":
    main()
