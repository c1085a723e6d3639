"""Side-by-side benchmarks: torch_masked_attn against native PyTorch.

    .venv/bin/python benchmarks/run.py --record      # --quick, into the record (what `make bench` runs)
    .venv/bin/python benchmarks/run.py --full        # the whole sweep, more repetitions
    .venv/bin/python benchmarks/run.py --cases gpt-train,ce
    .venv/bin/python benchmarks/run.py --list

Each case is timed in this one process, native and ours interleaved
repetition by repetition (the order alternating), after one warm-up call of
each; the reported times are medians and ratio = native ms / ours ms (above
1: ours is faster). Peak memory is measured separately for each
(case, implementation) in a fresh process (see --probe). Every number of the
run goes to benchmarks/out/results.json (rewritten after every case), the
sweep's plot to benchmarks/out/ratio_vs_length.png. --record then merges one
row per case into this machine's record, benchmarks/results_<machine>.json
(benchmarks/record.py), from which `make docs` writes its page, docs/performance/<machine>.md.
See benchmarks/README.md.
"""

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

import bench_cases as cases
import bench_machine as machine
from torch_masked_attn import ops as tma_ops

HERE = machine.HERE
OUT = machine.OUT
RESULTS = os.path.join(OUT, "results.json")

MODES = {
    #         sweep grid          min reps, max reps, seconds of timed reps per case (after min reps)
    "quick": (cases.SWEEP_QUICK, 3, 10, 5.0),
    "full": (cases.SWEEP_FULL, 5, 25, 20.0),
}
CE_GRIDS = {"quick": cases.CE_SWEEP_QUICK, "full": cases.CE_SWEEP_FULL}  # the cross-entropy vocabulary sweep


def log(msg):
    print(msg, flush=True)


# ---------------------------------------------------------------- timing

PRUNE = 2.0  # a native variant whose warm-up is this much slower than the fastest one is not timed further


def minor_faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def time_interleaved(impls, min_reps, max_reps, budget_s, between=None):
    """One warm-up call of each implementation (its output kept for the
    cross-check), then repetitions in which every implementation runs once,
    in alternating order, until min_reps are done and budget_s has passed
    (or max_reps). Native variants more than PRUNE times slower than the
    fastest native in the warm-up are dropped (only the fastest native counts).
    between(), if given, runs after every repetition (untimed): the FMA peak
    measured alongside. The page faults of every call are counted too
    (memory the allocator handed back to the OS and takes again costs a
    fault per 4 KB page on first touch).
    Returns ({name: median seconds}, {name: warm-up output}, reps, {dropped name: warm-up seconds},
    {name: median page faults per call})."""
    outs, warm = {}, {}
    for name, fn in impls.items():
        t0 = time.perf_counter()
        outs[name] = fn()
        warm[name] = time.perf_counter() - t0
    fastest = min(t for n, t in warm.items() if n.startswith("native:"))
    dropped = {n: t for n, t in warm.items() if n.startswith("native:") and t > PRUNE * fastest}
    names = [n for n in impls if n not in dropped]
    times = {name: [] for name in names}
    faults = {name: [] for name in names}
    start, reps = time.perf_counter(), 0
    gc.collect()
    gc.disable()  # as timeit does: a collection landing in one call is not that call's cost
    try:
        while reps < max_reps and (reps < min_reps or time.perf_counter() - start < budget_s):
            for name in names if reps % 2 == 0 else names[::-1]:
                f0 = minor_faults()
                t0 = time.perf_counter()
                impls[name]()
                times[name].append(time.perf_counter() - t0)
                faults[name].append(minor_faults() - f0)
            if between is not None:
                t0 = time.perf_counter()
                between()
                start += time.perf_counter() - t0  # not counted in the case's budget
            reps += 1
    finally:
        gc.enable()
    return (
        {n: statistics.median(t) for n, t in times.items()},
        outs,
        reps,
        dropped,
        {n: statistics.median(f) for n, f in faults.items()},
    )


def max_abs_diff(a, b):
    return (a.float() - b.float()).abs().max().item()


# ---------------------------------------------------------------- memory probes


def probe(name, impl):
    """Child side: fresh process, warm up the libraries on tiny inputs, build
    the case (inputs allocated), then the peak RSS growth of one call."""
    cases.warm_up_libraries()
    if name in cases.GROUPS["hf-e2e"]:
        cases.warm_up_hf()
    bench = cases.build(name)
    fn = bench.impls()[impl]
    gc.collect()
    growth_mb, seconds, method, base_mb = machine.peak_rss_growth(fn)
    print(
        json.dumps(
            {
                "peak_mb": round(growth_mb, 1),
                "call_ms": round(seconds * 1e3, 1),
                "base_mb": round(base_mb, 1),
                "method": method,
            }
        )
    )


def measure_memory(name, impl, threads, timeout=3600):
    cmd = [sys.executable, os.path.abspath(__file__), "--probe", name, impl, "--threads", str(threads)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["?"])[-1]
        return {"error": f"exit {r.returncode}: {tail}"}
    return json.loads(r.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- one case


def run_case(name, mode, args):
    _, min_reps, max_reps, budget = MODES[mode]
    rec = {"name": name, "group": "sweep" if name.startswith("sweep-") else group_of(name)}
    t_case = time.perf_counter()
    try:
        bench = cases.build(name)
    except cases.Skip as e:
        log(f"  SKIPPED {name}: {e}")
        return {**rec, "skipped": str(e)}
    rec.update(
        work=bench.work,
        flops=bench.flops,
        attn_flops=bench.attn_flops,
        traffic_bytes=bench.traffic_bytes,
        info=bench.info,
        timed=bench.timed,
    )
    if bench.reps:
        min_reps, max_reps, budget = bench.reps
    impls = bench.impls()
    impl_list = list(impls)
    do_memory = bench.memory  # every timed native variant and ours get a memory probe
    try:
        if bench.timed:
            alongside = None
            if bench.flops and not bench.traffic_bytes and rec["group"] == "attention" and args.fma_exe:
                alongside = machine.PeakAlongside(args.fma_exe, args.threads)
            med, outs, reps, dropped, faults = time_interleaved(impls, min_reps, max_reps, budget, alongside)
            if dropped:
                rec["dropped_after_warmup_ms"] = {k: round(v * 1e3, 1) for k, v in dropped.items()}
                impl_list = [n for n in impl_list if n not in dropped]
                log(
                    "  not timed further (slower than the fastest native in the warm-up): "
                    + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in dropped.items())
                )
            natives = {k: v for k, v in med.items() if k.startswith("native:")}
            best = min(natives, key=natives.get)
            rec.update(
                reps=reps,
                ms={k: round(v * 1e3, 3) for k, v in med.items()},
                native_variant=best.split(":", 1)[1],
                native_ms=round(natives[best] * 1e3, 3),
                ours_ms=round(med["ours"] * 1e3, 3),
                ratio=round(natives[best] / med["ours"], 4),
                max_abs_diff=max_abs_diff(outs["ours"], outs[best]),
                page_faults_per_call={k: round(v) for k, v in faults.items()},
            )
            if bench.flops:
                rec["gflops"] = round(bench.flops / med["ours"] / 1e9, 2)
                rec["gflops_native"] = round(bench.flops / natives[best] / 1e9, 2)
            if alongside is not None and alongside.values:
                rec["fma_peak_alongside"] = round(statistics.median(alongside.values), 1)
                rec["pct_peak_alongside"] = round(100 * rec["gflops"] / rec["fma_peak_alongside"], 2)
            log(
                f"  {name}: "
                + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in med.items())
                + f" | ratio {rec['ratio']:.3f} | {reps} reps | max|ours-native| {rec['max_abs_diff']:.1e}"
                + " | page faults/call "
                + ", ".join(f"{k} {v:.0f}" for k, v in faults.items())
                + (
                    f" | {rec['pct_peak_alongside']:.1f}% of the FMA peak measured alongside "
                    f"({rec['fma_peak_alongside']:.0f} GFLOP/s)"
                    if "pct_peak_alongside" in rec
                    else ""
                )
            )
        del impls, bench
        gc.collect()
        if not args.no_memory and do_memory:
            mem = {}
            for impl in impl_list:
                mem[impl] = measure_memory(name, impl, args.threads)
                shown = mem[impl].get("peak_mb", mem[impl].get("error"))
                log(
                    f"    peak memory {impl}: {shown} MB"
                    if "peak_mb" in mem[impl]
                    else f"    peak memory {impl}: FAILED {shown}"
                )
            rec["memory"] = mem
            key = (
                f"native:{rec['native_variant']}"
                if "native_variant" in rec
                else next(k for k in mem if k.startswith("native:"))
            )
            rec["peak_mb_native"] = mem[key].get("peak_mb")
            rec["peak_mb_ours"] = mem["ours"].get("peak_mb")
            if not rec["timed"]:
                rec["single_call_ms"] = {k: v.get("call_ms") for k, v in mem.items()}
    except Exception as e:  # a broken case must not stop the others
        log(f"  ERROR {name}: {type(e).__name__}: {e}")
        rec["error"] = f"{type(e).__name__}: {e}"
    rec["case_wall_s"] = round(time.perf_counter() - t_case, 1)
    return rec


def group_of(name):
    if cases._CE_SWEEP_RE.match(name):
        return "ce-sweep"
    for g, names in cases.GROUPS.items():
        if name in names:
            return g
    return "?"


# ---------------------------------------------------------------- output


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def table(records):
    lines = [
        "| case | work | native ms | ours ms | ratio | GFLOP/s | % peak | % peak alongside "
        "| peak MB native | peak MB ours |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in records:
        if "skipped" in r:
            lines.append(f"| {r['name']} | skipped: {r['skipped']} | - | - | - | - | - | - | - | - |")
            continue
        native = fmt(r.get("native_ms"), ".1f")
        if r.get("native_variant") and len(r.get("ms", {})) + len(r.get("dropped_after_warmup_ms", {})) > 2:
            native += f" ({r['native_variant']})"
        work = r.get("work", "") + (f" ERROR: {r['error']}" if "error" in r else "")
        lines.append(
            f"| {r['name']} | {work} | {native} | {fmt(r.get('ours_ms'), '.1f')} | {fmt(r.get('ratio'), '.3f')} "
            f"| {fmt(r.get('gflops'), '.1f')} | {fmt(r.get('pct_peak'), '.1f')}"
            f"{' (bf16)' if r.get('peak_kind') == 'bf16' else ''} "
            f"| {fmt(r.get('pct_peak_alongside'), '.1f')} "
            f"| {fmt(r.get('peak_mb_native'), '.0f')} | {fmt(r.get('peak_mb_ours'), '.0f')} |"
        )
    return "\n".join(lines)


def bandwidth_lines(records, bw):
    lines = []
    for r in records:
        if not r.get("traffic_bytes") or "ours_ms" not in r or not bw:
            continue
        limit_ms = r["traffic_bytes"] / (bw * 1e9) * 1e3
        r["traffic_limit_ms"] = round(limit_ms, 3)
        r["ours_pct_of_bandwidth_limit"] = round(100 * limit_ms / r["ours_ms"], 1)
        r["native_pct_of_bandwidth_limit"] = round(100 * limit_ms / r["native_ms"], 1)
        lines.append(
            f"- {r['name']}: {r['traffic_bytes'] / 1e9:.2f} GB minimal traffic at {bw:.1f} GB/s "
            f"= {limit_ms:.1f} ms limit; ours {r['ours_ms']:.1f} ms "
            f"({r['ours_pct_of_bandwidth_limit']:.0f}% of the limit's speed), native "
            f"{r['native_ms']:.1f} ms ({r['native_pct_of_bandwidth_limit']:.0f}%)"
        )
    return lines


def _pyplot():
    """(matplotlib, pyplot) on the Agg backend, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker  # noqa: F401  (used as matplotlib.ticker)
    except ImportError:
        log("  (matplotlib missing: no plot)")
        return None
    return matplotlib, plt


def plot(records, path):
    pts = [r for r in records if r.get("group") == "sweep" and r.get("ratio")]
    if not pts:
        return None
    mpl = _pyplot()
    if mpl is None:
        return None
    matplotlib, plt = mpl
    lines = {}
    for r in pts:
        s = r["info"]["sweep"]
        lines.setdefault((s["D"], s["pad"], s["dtype"]), []).append((s["L"], r["ratio"]))
    dtypes = sorted({dt for _, _, dt in lines}, key=lambda d: d != "fp32")  # fp32 first
    fig, axes = plt.subplots(1, len(dtypes), figsize=(7 * len(dtypes), 5), sharey=True, squeeze=False)
    lengths = sorted({x for xy in lines.values() for x, _ in xy})
    for ax, dtype in zip(axes[0], dtypes):
        for (D, pad, dt), xy in sorted(lines.items()):
            if dt != dtype:
                continue
            xy.sort()
            ax.plot(
                [x for x, _ in xy],
                [y for _, y in xy],
                marker="o",
                linestyle="-" if D == 64 else "--",
                label=f"D={D}, pad {pad:.0%}",
            )
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(lengths, [str(x) for x in lengths])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.set_xlabel("sequence length L (B = max(1, 4096 / L), H = 8, causal, fwd+bwd)")
        ax.set_title({"fp32": "float32", "bf16": "bfloat16"}.get(dtype, dtype))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("ratio = native ms / ours ms (above 1: ours faster)")
    fig.suptitle(f"torch_masked_attn vs F.scaled_dot_product_attention, {torch.get_num_threads()} threads")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_ce_sweep(records, path):
    """The cross-entropy vocabulary sweep: speed ratio and peak-memory ratio
    (native / ours) against V, one line per ignored fraction."""
    pts = [r for r in records if r.get("group") == "ce-sweep" and r.get("ratio")]
    if not pts:
        return None
    mpl = _pyplot()
    if mpl is None:
        return None
    matplotlib, plt = mpl
    lines = {}
    for r in pts:
        s = r["info"]["ce_sweep"]
        mem = r["peak_mb_native"] / r["peak_mb_ours"] if r.get("peak_mb_native") and r.get("peak_mb_ours") else None
        lines.setdefault(s["ignored"], []).append((s["V"], r["ratio"], mem))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ign, pts_ in sorted(lines.items()):
        pts_.sort()
        axes[0].plot([v for v, _, _ in pts_], [y for _, y, _ in pts_], marker="o", label=f"{ign:.0%} ignored")
        mem = [(v, m) for v, _, m in pts_ if m]
        if mem:
            axes[1].plot([v for v, _ in mem], [m for _, m in mem], marker="o", label=f"{ign:.0%} ignored")
    vocab = sorted({v for p in lines.values() for v, _, _ in p})
    for ax, ylabel in zip(axes, ("speed: native ms / ours ms", "peak memory: native MB / ours MB")):
        ax.set_title(ylabel, fontsize=10)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(vocab, [f"{v // 1024}k" for v in vocab])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xlabel("vocabulary V (N = 2^28 / V rows, float32, fwd+bwd)")
        ax.set_ylabel("ratio (above 1: ours better)")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"torch_masked_attn cross_entropy vs F.cross_entropy, {torch.get_num_threads()} threads")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---------------------------------------------------------------- main


def select(args, mode):
    grid = MODES[mode][0]
    ce_grid = CE_GRIDS[mode]
    everything = (
        [
            n
            for g in ("attention", "dropout", "softcap", "flex", "zentorch", "vllm", "tiny", "memory")
            for n in cases.GROUPS[g]
        ]
        + cases.sweep_names(grid)
        + cases.GROUPS["ce"]
        + cases.ce_sweep_names(ce_grid)
        + cases.GROUPS["hf-e2e"]
    )
    if not args.cases:
        return everything
    chosen = []
    for item in args.cases.split(","):
        item = item.strip()
        if item == "sweep":
            chosen += cases.sweep_names(grid)
        elif item == "ce-sweep":
            chosen += cases.ce_sweep_names(ce_grid)
        elif item in cases.GROUPS:
            chosen += cases.GROUPS[item]
        elif item in cases.NAMED or cases._SWEEP_RE.match(item) or cases._CE_SWEEP_RE.match(item):
            chosen.append(item)
        elif item:
            sys.exit(f"unknown case {item!r}; see --list")
    return list(dict.fromkeys(chosen))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_mutually_exclusive_group()
    m.add_argument("--quick", action="store_true", help="subset of the sweep, fewer repetitions (default)")
    m.add_argument("--full", action="store_true", help="the whole sweep, more repetitions (an hour or more)")
    p.add_argument(
        "--cases",
        help="comma-separated case names or groups "
        "(attention, dropout, softcap, flex, zentorch, vllm, tiny, memory, sweep, ce, ce-sweep, hf-e2e); "
        "default: all",
    )
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory probes")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument(
        "--out",
        default=None,
        help="the run's JSON, every number (default benchmarks/out/results.json)",
    )
    p.add_argument(
        "--record",
        action="store_true",
        help="merge one row per case into this machine's record, benchmarks/results_<machine>.json",
    )
    p.add_argument("--plot", default=os.path.join(OUT, "ratio_vs_length.png"))
    p.add_argument("--plot-ce", default=os.path.join(OUT, "ce_vocab_sweep.png"))
    p.add_argument("--probe", nargs=2, metavar=("CASE", "IMPL"), help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    args.threads = torch.get_num_threads()
    if args.probe:
        return probe(*args.probe)

    mode = "full" if args.full else "quick"
    names = select(args, mode)
    if args.out is None:
        args.out = RESULTS
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    if args.list:
        for g, ns in cases.GROUPS.items():
            print(f"{g}: {', '.join(ns)}")
        print(f"sweep ({mode}): {', '.join(cases.sweep_names(MODES[mode][0]))}")
        print(f"ce-sweep ({mode}): {', '.join(cases.ce_sweep_names(CE_GRIDS[mode]))}")
        return

    t_start = time.perf_counter()
    info = machine.cpu_info()
    info["loadavg_start"] = os.getloadavg()
    info["variants"] = {str(dt)[6:]: tma_ops.isa_for(dt) for dt in (torch.float32, torch.bfloat16)}
    log(
        f"torch_masked_attn benchmarks ({mode}): {info['cpu_model']}, torch {info['torch']}, "
        f"{args.threads} threads, flags {', '.join(k for k, v in info['flags'].items() if v)}; kernels "
        + ", ".join(f"{v} for {dt}" for dt, v in info["variants"].items())
    )
    measurements = [measure_machine(args.threads, "start")]
    args.fma_exe = measurements[0]["fma"].get("exe")

    cases.warm_up_libraries()  # one-time initialisation out of the first case's warm-up
    results = {"mode": mode, "machine": info, "cases": []}
    yardsticks = machine_yardsticks(info, args.threads, measurements)
    for i, name in enumerate(names, 1):
        log(f"[{i}/{len(names)}] {name}  (elapsed {time.perf_counter() - t_start:.0f} s)")
        results["cases"].append(run_case(name, mode, args))
        finalize(results, yardsticks, info)
        results["wall_s"] = round(time.perf_counter() - t_start, 1)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)

    info["loadavg_end"] = os.getloadavg()
    measurements.append(measure_machine(args.threads, "end"))
    yardsticks = machine_yardsticks(info, args.threads, measurements)
    bl = finalize(results, yardsticks, info)
    png = plot(results["cases"], args.plot)
    results["plot"] = png and os.path.relpath(png, os.path.dirname(HERE))
    png_ce = plot_ce_sweep(results["cases"], args.plot_ce)
    results["plot_ce"] = png_ce and os.path.relpath(png_ce, os.path.dirname(HERE))
    results["wall_s"] = round(time.perf_counter() - t_start, 1)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)

    y = yardsticks
    log("")
    log(
        f"## torch_masked_attn vs native PyTorch ({mode}, {args.threads} threads, {info['cpu_model']}, "
        f"torch {info['torch']})"
    )
    log("")
    log(table(results["cases"]))
    log("")
    log("Kernels: " + ", ".join(f"{v} for {dt}" for dt, v in info["variants"].items()) + ".")
    if y.get("fma_all_threads"):
        log(
            f"% peak: of the float32 FMA peak, {y['fma_all_threads']:.0f} GFLOP/s on {args.threads} threads "
            f"({y['fma_1thread']:.0f} on 1 thread, {info.get('fma_isa')}; {y['fma_source']}), also for "
            "bfloat16 cases unless marked (bf16): those of the VDPBF16PS peak, where the avx512bf16 kernels run "
            "them"
            + (
                f", {y['bf16_all_threads']:.0f} GFLOP/s ({y['bf16_1thread']:.0f} on 1 thread)"
                if y.get("bf16_all_threads")
                else ""
            )
            + ". GFLOP are nominal (causal halved, padding not subtracted; MHA rows include the projections)."
            " % peak alongside: of the FMA peak measured after every repetition of "
            "the case (median), so that load from other work lowers the yardstick as it lowers the case."
        )
    log("Peak MB: peak RSS growth during one call in a fresh process, inputs already allocated.")
    if bl:
        log(
            f"Memory-bound cases (cross-entropy, decoding) against the streaming bandwidth ({y['bandwidth_gbs']:.1f} GB/s, "
            f"{y['bandwidth_source']}):"
        )
        for line in bl:
            log(line)
    log(
        f"load average at start {info['loadavg_start'][0]:.2f}, at end {info['loadavg_end'][0]:.2f} "
        f"on {info['logical_cpus']} CPUs (other work on the machine skews timings)"
    )
    log(f"wrote {os.path.relpath(args.out)}" + "".join(f" and {os.path.relpath(x)}" for x in (png, png_ce) if x))
    if args.record:
        log(f"recorded in {os.path.relpath(record_run(results, info, args.threads))}")
    log(f"wall time {results['wall_s']:.0f} s")


def record_run(results, info, threads):
    """Merge the run's cases into this machine's record (benchmarks/record.py)."""
    import record

    isa = os.environ.get("MASKED_ATTN_ISA") or None
    date = record.today()
    rows = [
        record.row_from_run(r, date, isa=isa, threads=threads, bf16_isa=info["variants"]["bfloat16"])
        for r in results["cases"]
    ]
    rows = [r for r in rows if r is not None]
    key = machine.machine_key(info)
    return record.merge(key, info["cpu_model"], os.cpu_count(), info["torch"], rows)


def measure_machine(threads, when):
    log(f"measuring float32 FMA peak (benchmarks/fma_peak.c) and streaming bandwidth ({when}) ...")
    fma = machine.fma_peak(threads)
    bw = machine.stream_bandwidth()
    log(
        f"  FMA: {fma['error']}"
        if "error" in fma
        else f"  FMA {fma['isa']}: {fma['gflops_1thread']:.0f} GFLOP/s on 1 thread, "
        f"{fma['gflops_all_threads']:.0f} GFLOP/s on {threads} threads"
    )
    log(f"  bandwidth: torch.add {bw['add_gbs']} GB/s, copy {bw['copy_gbs']} GB/s")
    return {"when": when, "loadavg": os.getloadavg(), "fma": fma, "bandwidth": bw}


def machine_yardsticks(info, threads, measurements):
    """The FMA peak and bandwidth used for % peak and the cross-entropy limit:
    the best of this run's measurements (start, end) and of earlier runs on
    this machine (benchmarks/out/machine_best.json); contention only lowers
    them. Records both in info."""
    info["measurements"] = measurements
    fmas = [m["fma"] for m in measurements if "error" not in m["fma"]]
    if fmas:
        info["fma_isa"] = fmas[0]["isa"]
    run_best = {
        "fma_1thread": max((f["gflops_1thread"] for f in fmas), default=None),
        "fma_all_threads": max((f["gflops_all_threads"] for f in fmas), default=None),
        "bf16_1thread": max((f["bf16_gflops_1thread"] for f in fmas if "bf16_gflops_1thread" in f), default=None),
        "bf16_all_threads": max(
            (f["bf16_gflops_all_threads"] for f in fmas if "bf16_gflops_all_threads" in f), default=None
        ),
        "bandwidth_gbs": max(m["bandwidth"]["best_gbs"] for m in measurements),
    }
    best, when = machine.remember_best(info, threads, run_best) if fmas else (run_best, {})
    y = dict(best)
    for k, src in (("fma_all_threads", "fma_source"), ("bandwidth_gbs", "bandwidth_source")):
        y[src] = (
            "measured in this run"
            if best.get(k) == run_best.get(k)
            else f"best seen on this machine, {when.get(k)}; this run measured {run_best.get(k)}"
        )
    info["yardsticks"] = y
    return y


def finalize(results, y, info):
    """% peak and the cross-entropy bandwidth fields from the yardsticks."""
    peak, bf16_peak = y.get("fma_all_threads"), y.get("bf16_all_threads")
    if info["variants"]["bfloat16"] != "avx512bf16":
        bf16_peak = None  # AMX or the float32 FMAs run bfloat16 here: VDPBF16PS's peak is no yardstick
    for r in results["cases"]:
        # bfloat16 cases against the VDPBF16PS peak where its kernels run them, else the float32 FMA peak
        yard = bf16_peak if bf16_peak and "bf16" in r["name"] else peak
        if yard and r.get("gflops"):
            r["pct_peak"] = round(100 * r["gflops"] / yard, 2)
            if yard is bf16_peak:
                r["peak_kind"] = "bf16"
    return bandwidth_lines(results["cases"], y.get("bandwidth_gbs"))


if __name__ == "__main__":
    main()
