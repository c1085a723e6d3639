"""Decoding against the memory's limit: one step (a short query block over a
whole KV cache) for every cache layout the kernels read in place, grouped and
multi-query heads, float32, bfloat16 and int8 caches, against a streaming read
of the same bytes in the same run (torch.sum over a float32 tensor of the
cache's size; the caches and the stream are evicted from the caches before
every timed call by a pass over 96 MB, so both come from memory).

    .venv/bin/python benchmarks/decode.py [--threads N] [--cases a,b] [--reps 9] [--json out.json]

Roofline share = max(cache bytes / stream rate, multiply-adds / FMA peak) / time. Then the
one-sequence cases on 1 thread against all of them (the keys split across threads).
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_machine  # noqa: E402
from torch_masked_attn import flash_attn as tfa  # noqa: E402
from torch_masked_attn import functional as taf  # noqa: E402

# name: (B, H, Hkv, Lq, Lk, D, dtype, layout); layouts: bhld (B, Hkv, L, D), blhd (B, L, Hkv, D),
# paged (pages of 128 rows, (pages, 128, Hkv, D)); dtype i8: the 8-bit cache (int8 with scales, bf16 q)
CASES = {
    "mha B=8 H=32 Lk=2048 f32 bhld": (8, 32, 32, 1, 2048, 128, "f32", "bhld"),
    "gqa B=1 H=32/8 Lk=32k f32 bhld": (1, 32, 8, 1, 32768, 128, "f32", "bhld"),
    "gqa B=1 H=32/8 Lk=32k bf16 bhld": (1, 32, 8, 1, 32768, 128, "bf16", "bhld"),
    "gqa B=1 H=32/8 Lk=32k f32 blhd": (1, 32, 8, 1, 32768, 128, "f32", "blhd"),
    "gqa B=1 H=32/8 Lk=32k bf16 blhd": (1, 32, 8, 1, 32768, 128, "bf16", "blhd"),
    "mqa B=1 H=8/1 Lk=32k f32 bhld": (1, 8, 1, 1, 32768, 128, "f32", "bhld"),
    "mqa B=1 H=8/1 Lk=32k bf16 bhld": (1, 8, 1, 1, 32768, 128, "bf16", "bhld"),
    "gqa B=8 H=32/8 Lk=4096 bf16 bhld": (8, 32, 8, 1, 4096, 128, "bf16", "bhld"),
    "gqa B=8 H=32/8 Lk=4096 f32 paged": (8, 32, 8, 1, 4096, 128, "f32", "paged"),
    "gqa B=8 H=8/2 Lk=2048 f32 blhd": (8, 8, 2, 1, 2048, 128, "f32", "blhd"),
    "gqa B=8 H=8/2 Lk=2048 f32 paged": (8, 8, 2, 1, 2048, 128, "f32", "paged"),
    "gqa B=8 H=8/2 Lk=2048 bf16 paged": (8, 8, 2, 1, 2048, 128, "bf16", "paged"),
    "spec B=4 Lq=8 H=32/8 Lk=4096 f32 bhld": (4, 32, 8, 8, 4096, 128, "f32", "bhld"),
    "gqa B=1 H=32/8 Lk=32k int8 bhld": (1, 32, 8, 1, 32768, 128, "i8", "bhld"),
    "gqa B=8 H=8/2 Lk=2048 int8 blhd": (8, 8, 2, 1, 2048, 128, "i8", "blhd"),
}
DT = {"f32": torch.float32, "bf16": torch.bfloat16, "i8": torch.bfloat16}

_flush = None


def flush():
    global _flush
    if _flush is None:
        _flush = torch.ones(24 * 2**20)
    _flush.add_(1.0)


def build(B, H, Hkv, Lq, Lk, D, dt, layout, gen):
    dtype = DT[dt]
    q = torch.randn(B, H, Lq, D, generator=gen).to(dtype)
    # speculative verification (Lq > 1): bottom-right causal, query i sees keys j <= i + Lk - Lq
    window = (None, Lk - Lq) if Lq > 1 else None
    if layout == "paged":
        page = 128
        n = B * Lk // page
        kp = torch.randn(n, page, Hkv, D, generator=gen).to(dtype)
        vp = torch.randn(n, page, Hkv, D, generator=gen).to(dtype)
        table = torch.randperm(n, generator=gen).to(torch.int32).view(B, Lk // page)
        lens = torch.full((B,), Lk, dtype=torch.int32)
        qf = q.transpose(1, 2).contiguous()

        def run():
            return tfa.flash_attn_with_kvcache(qf, kp, vp, cache_seqlens=lens, block_table=table, causal=True)

        return run, (kp.numel() + vp.numel()) * kp.element_size()
    if layout == "blhd":
        k = torch.randn(B, Lk, Hkv, D, generator=gen).to(dtype).transpose(1, 2)
        v = torch.randn(B, Lk, Hkv, D, generator=gen).to(dtype).transpose(1, 2)
    else:
        k = torch.randn(B, Hkv, Lk, D, generator=gen).to(dtype)
        v = torch.randn(B, Hkv, Lk, D, generator=gen).to(dtype)
    if dt == "i8":
        k8, ks = taf.quantize_kv(k)
        v8, vs = taf.quantize_kv(v)

        def run():
            return taf.masked_attention(q, k8, v8, window=window, k_scale=ks, v_scale=vs)

        return run, (k8.numel() + v8.numel()) + (ks.numel() + vs.numel()) * 4

    def run():
        return taf.masked_attention(q, k, v, window=window)

    return run, (k.numel() + v.numel()) * k.element_size()


def timed(fn, reps):
    ts = []
    for _ in range(reps):
        flush()
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--cases", default="")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    peak = bench_machine.fma_peak(args.threads)
    gflops = peak.get("gflops_all_threads", 0.0)
    gen = torch.Generator().manual_seed(0)
    names = [n for n in CASES if not args.cases or any(c in n for c in args.cases.split(","))]
    info = bench_machine.cpu_info()
    print(f"# {info['cpu_model']}, {args.threads} threads, FMA peak {gflops:.0f} GFLOP/s, {time.strftime('%Y-%m-%d')}")
    print(f"{'case':40s} {'ms':>8s} {'floor ms':>9s} {'GB/s':>6s} {'stream':>6s} {'share':>6s}")
    rows = []
    for name in names:
        B, H, Hkv, Lq, Lk, D, dt, layout = CASES[name]
        run, nbytes = build(B, H, Hkv, Lq, Lk, D, dt, layout, gen)
        stream = torch.ones(max(nbytes // 4, 1))
        run(), stream.sum()
        t_ours = timed(run, args.reps)
        t_stream = timed(stream.sum, args.reps)
        macs = 2.0 * B * H * Lq * Lk * D
        floor = max(t_stream, 2 * macs / (gflops * 1e9) if gflops else 0.0)
        row = dict(
            case=name,
            ms=t_ours * 1e3,
            floor_ms=floor * 1e3,
            gbs=nbytes / t_ours / 1e9,
            stream_gbs=nbytes / t_stream / 1e9,
            share=floor / t_ours,
        )
        rows.append(row)
        print(
            f"{name:40s} {row['ms']:8.2f} {row['floor_ms']:9.2f} {row['gbs']:6.1f} {row['stream_gbs']:6.1f} "
            f"{row['share']:6.0%}",
            flush=True,
        )
    # one sequence's keys split across threads: 1 thread against all of them, interleaved
    scaling = []
    if args.threads > 1:
        print(f"\n{'one sequence, threads':40s} {'1 ms':>8s} {str(args.threads) + ' ms':>8s} {'speed-up':>8s}")
        for name in [n for n in names if n.startswith(("mqa B=1", "gqa B=1 H=32/8 Lk=32k f32 bhld"))]:
            run, _ = build(*CASES[name], gen)
            t = {1: [], args.threads: []}
            for rep in range(args.reps):
                for n in (1, args.threads) if rep % 2 == 0 else (args.threads, 1):
                    torch.set_num_threads(n)
                    run()
                    t[n].append(timed(run, 1))
            torch.set_num_threads(args.threads)
            one, many = statistics.median(t[1]), statistics.median(t[args.threads])
            scaling.append(dict(case=name, ms_1=one * 1e3, ms_n=many * 1e3, speedup=one / many))
            print(f"{name:40s} {one * 1e3:8.2f} {many * 1e3:8.2f} {one / many:8.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(cpu=info, threads=args.threads, fma_gflops=gflops, rows=rows, scaling=scaling), f, indent=1)


if __name__ == "__main__":
    main()
