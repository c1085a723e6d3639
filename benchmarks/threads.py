"""Thread sweep: gpt-train's shape (B=8 H=8 L=512 D=64, causal + key padding,
float32, fwd+bwd, gradients freed between steps as a training loop does) at
1, 2, 4, ... threads, ours against native F.scaled_dot_product_attention with
the equivalent bool mask; per call: time, minor page faults, our scratch
bytes. Plus a model of our schedule: the work items' costs (in 64 x 64 tiles,
by the kernels' own skipping rules) handed out in order to N threads, the
predicted time at N threads from the 1-thread time, and the busy fraction.

    python benchmarks/threads.py [--threads 1,2,4,...] [--out benchmarks/out/results.json] [--record]

--record merges the rows (case threads-gpt-train, one per thread count) into this
machine's record, benchmarks/results_<machine>.json (benchmarks/record.py).

On a machine with fewer cores than N, times at N are oversubscribed (the
model and the faults and bytes per call still hold); say so when quoting.
"""

import argparse
import heapq
import json
import os
import resource
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import torch_masked_attn as tma  # noqa: E402

B, H, L, D, BLK = 8, 8, 512, 64, 64


def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, go = (torch.randn(B, H, L, D, generator=g) for _ in range(4))
    lengths = torch.randint(L // 2, L + 1, (B,), generator=g)
    kpm = torch.arange(L)[None] >= lengths[:, None]
    return q, k, v, go, kpm, lengths


def step_ours(q, k, v, go, kpm):
    q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))
    tma.functional.masked_attention(q, k, v, key_padding_mask=kpm, is_causal=True).backward(go)


def step_native(q, k, v, go, allowed):
    q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))
    F.scaled_dot_product_attention(q, k, v, attn_mask=allowed).backward(go)


def measure(fn, reps):
    fn()
    times, f0 = [], faults()
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3, (faults() - f0) / reps


def item_costs(lengths):
    """Tiles per work item: forward items (b, h, q-block), interleaved as the kernel orders them;
    single-pass backward items (b, h) (one key chunk each: B*H >= 8)."""
    nb = L // BLK
    fwd, bwd = [], []
    for b in range(B):
        read = -(-int(lengths[b]) // BLK)  # key blocks not wholly padding
        order = [i // 2 if i % 2 == 0 else nb - 1 - i // 2 for i in range(nb)]
        for _ in range(H):
            fwd += [min(qb + 1, read) for qb in order]
            bwd.append(sum(nb - kb for kb in range(min(read, nb))))
    return fwd, bwd


def makespan(costs, threads, grain):
    """Items handed out `grain` at a time, in order, to whichever thread is free first."""
    free = [0.0] * threads
    for i in range(0, len(costs), grain):
        t = heapq.heappop(free)
        heapq.heappush(free, t + sum(costs[i : i + grain]))
    return max(free)


def model(lengths, n):
    fwd, bwd = item_costs(lengths)
    fwd_grain = max(1, min(L // BLK, len(fwd) // (8 * n)))  # the shim's forward grain
    out = {}
    for name, costs, grain in (("forward", fwd, fwd_grain), ("backward", bwd, 1)):
        total = sum(costs)
        span = makespan(costs, n, grain)
        out[name] = dict(items=len(costs), tiles=total, speedup=total / span, busy=total / (span * n))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default="1,2,4,8,16,32,64")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=os.path.join(HERE, "out", "results.json"))
    p.add_argument("--record", action="store_true", help="merge into benchmarks/results_<machine>.json")
    args = p.parse_args()
    counts = [int(x) for x in args.threads.split(",")]
    q, k, v, go, kpm, lengths = inputs()
    allowed = ~(torch.ones(L, L, dtype=torch.bool).triu(1)[None, None] | kpm[:, None, None, :])
    isa = next(n for n in ("amx", "avx512", "avx2", "scalar") if tma.ops.isa_available(n))
    print(
        f"kernels: ours {isa} (float32 runs {'avx512' if isa == 'amx' else isa}); "
        f"native: torch {torch.__version__}, ATen CPU capability {torch.backends.cpu.get_cpu_capability()}; "
        f"{os.cpu_count()} CPUs here"
    )
    print(
        "| threads | native ms | ours ms | ratio | faults/call native | faults/call ours | scratch MB/call "
        "| model fwd speedup (busy) | model bwd speedup (busy) | predicted ours ms |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    old = torch.get_num_threads()
    rows, t1 = [], None
    try:
        for n in counts:
            torch.set_num_threads(n)
            nat_ms, nat_f = measure(lambda: step_native(q, k, v, go, allowed), args.reps)
            our_ms, our_f = measure(lambda: step_ours(q, k, v, go, kpm), args.reps)
            scratch = tma.ops.scratch_stats()["last_call_bytes"]
            m = model(lengths, n)
            t1 = our_ms if t1 is None and n == 1 else t1
            pred = None if t1 is None else t1 / ((m["forward"]["speedup"] + m["backward"]["speedup"]) / 2)
            rows.append(
                dict(
                    threads=n,
                    native_ms=nat_ms,
                    ours_ms=our_ms,
                    native_faults=nat_f,
                    ours_faults=our_f,
                    scratch_bytes_last_region=scratch,
                    model=m,
                    predicted_ours_ms=pred,
                    oversubscribed=n > (os.cpu_count() or 1),
                )
            )
            print(
                f"| {n} | {nat_ms:.1f} | {our_ms:.1f} | {nat_ms / our_ms:.2f} | {nat_f:.0f} | {our_f:.0f} "
                f"| {scratch / 2**20:.2f} | {m['forward']['speedup']:.1f} ({m['forward']['busy']:.0%}) "
                f"| {m['backward']['speedup']:.1f} ({m['backward']['busy']:.0%}) "
                f"| {'' if pred is None else f'{pred:.1f}'} |",
                flush=True,
            )
    finally:
        torch.set_num_threads(old)
    results = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            results = json.load(f)
    results["threads_sweep"] = dict(case="gpt-train shape, fwd+bwd", isa=isa, cpus=os.cpu_count(), rows=rows)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    if args.record:
        import record

        import bench_machine

        info, date = bench_machine.cpu_info(), record.today()
        recs = []
        for r in rows:
            row = dict(case="threads-gpt-train", date=date, threads=r["threads"], native="sdpa-bool")
            row.update(native_ms=round(r["native_ms"], 3), ours_ms=round(r["ours_ms"], 3))
            row.update(ratio=round(r["native_ms"] / r["ours_ms"], 4), source="threads.py")
            if r["oversubscribed"]:
                row["note"] = "more threads than CPUs"
            recs.append(row)
        path = record.merge(bench_machine.machine_key(info), info["cpu_model"], old, torch.__version__, recs)
        print(f"recorded in {os.path.relpath(path)}")


if __name__ == "__main__":
    main()
