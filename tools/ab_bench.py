"""A/B timing of two builds of the project on the named benchmark cases,
interleaved: each round runs every case once per build, each in a fresh
process (two builds register the same ops, so they cannot share one), the
build that goes first alternating from round to round.

    python tools/ab_bench.py OLD_ROOT NEW_ROOT [--threads N] [--rounds R] CASE...

A root is a tree with torch_masked_attn/ (built) and benchmarks/. Prints,
per case, the median over rounds of each build's median call time and the
ratio old/new (> 1: the new build is faster). Used to show that a
refactoring keeps the speed (docs/design.md, "Changing the kernels").
"""

import argparse
import json
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time, torch
root, case, threads, reps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
sys.path[:0] = [root, root + "/benchmarks"]
torch.set_num_threads(threads)
import bench_cases
torch.manual_seed(0)  # the same inputs in both builds (cases draw lengths and values)
bench = bench_cases.NAMED[case]()
fn = bench.ours
for _ in range(2):
    fn()
times = []
for _ in range(reps):
    t0 = time.perf_counter(); fn(); times.append(time.perf_counter() - t0)
print(json.dumps(sorted(times)[len(times) // 2] * 1e3))
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("cases", nargs="+")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    res = {c: {"old": [], "new": []} for c in args.cases}
    for r in range(args.rounds):
        for c in args.cases:
            for which in ("old", "new") if r % 2 == 0 else ("new", "old"):  # neither always runs first
                root = getattr(args, which)
                out = subprocess.run(
                    [sys.executable, "-c", CHILD, root, c, str(args.threads), str(args.reps)],
                    capture_output=True,
                    text=True,
                )
                if out.returncode:
                    sys.exit(out.stderr)
                res[c][which].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"| case | old ms | new ms | old/new |  ({args.threads} threads, {args.rounds} rounds)")
    print("|---|---:|---:|---:|")
    for c, r in res.items():
        o, n = statistics.median(r["old"]), statistics.median(r["new"])
        print(f"| {c} | {o:.1f} | {n:.1f} | {o / n:.3f} |")


if __name__ == "__main__":
    main()
