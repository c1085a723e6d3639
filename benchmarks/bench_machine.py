"""Machine facts for the benchmarks: CPU model and flags, float32 FMA peak
(measured with benchmarks/fma_peak.c), streaming bandwidth, and peak-RSS
reading for the memory probes."""

import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "out")


def cpu_info():
    model, flags, fields = platform.processor() or "unknown", set(), {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name":
                    model = value.strip()
                elif key == "flags":
                    flags = set(value.split())
                elif key in ("vendor_id", "cpu family", "model"):
                    fields.setdefault(key, value.strip())
                if model != "unknown" and flags:
                    break
    except OSError:
        pass
    wanted = ["avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"]
    return {
        "cpu_model": model,
        "vendor": fields.get("vendor_id", "unknown"),
        "family": fields.get("cpu family"),
        "model": fields.get("model"),
        "flags": {f: f in flags for f in wanted},
        "amx": any(f.startswith("amx") for f in flags),
        "logical_cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }


VENDORS = {"GenuineIntel": "intel", "AuthenticAMD": "amd"}


def machine_key(info):
    """The machine kind a record is kept for (benchmarks/results_<key>.json):
    vendor, the widest instruction set the kernels can use on it (amx,
    avx512bf16, avx512, avx2 or scalar, from /proc/cpuinfo's flags) and the
    logical CPU count, e.g. "amd-avx2-2cpu", "intel-amx-16cpu". Family and
    model numbers are left out: a virtual machine may report another CPU's."""
    flags = info["flags"]
    if flags.get("amx_bf16") or flags.get("amx_tile"):
        isa = "amx"
    elif flags.get("avx512_bf16"):
        isa = "avx512bf16"
    elif flags.get("avx512f"):
        isa = "avx512"
    elif flags.get("avx2") and flags.get("fma"):
        isa = "avx2"
    else:
        isa = "scalar"
    return f"{VENDORS.get(info.get('vendor'), 'cpu')}-{isa}-{info['logical_cpus']}cpu"


def fma_peak(threads):
    """Compile fma_peak.c (AVX-512 if /proc/cpuinfo has avx512f, else AVX2)
    and run it on 1 thread and on `threads` threads. Returns a dict, or one
    with an "error" key if there is no compiler or no AVX2/FMA."""
    info = cpu_info()["flags"]
    if info["avx512f"]:
        isa_flags = ["-mavx512f", "-mfma"]
    elif info["avx2"] and info["fma"]:
        isa_flags = ["-mavx2", "-mfma"]
    else:
        return {"error": "no AVX2+FMA in /proc/cpuinfo"}
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return {"error": "no C compiler"}
    os.makedirs(OUT, exist_ok=True)
    exe = os.path.join(OUT, "fma_peak")
    cmd = [cc, "-O2", *isa_flags, os.path.join(HERE, "fma_peak.c"), "-o", exe, "-lpthread"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        return {"error": f"{' '.join(cmd)} failed: {r.stderr.strip()[:500]}"}
    res = {"compile": " ".join(cmd)}
    for key, t in (("gflops_1thread", 1), ("gflops_all_threads", threads)):
        r = subprocess.run([exe, str(t), "0.2"], capture_output=True, text=True)
        if r.returncode != 0:
            return {"error": f"{exe} failed: {r.stderr.strip()[:500]}"}
        out = json.loads(r.stdout)
        res[key], res["isa"] = out["gflops"], out["isa"]
    res["threads"] = threads
    res["exe"] = exe
    if info["avx512_bf16"]:  # the VDPBF16PS peak, the yardstick of bfloat16 cases
        bexe = os.path.join(OUT, "bf16_peak")
        cmd = [
            cc,
            "-O2",
            "-mavx512f",
            "-mavx512bf16",
            "-DBF16_DP",
            os.path.join(HERE, "fma_peak.c"),
            "-o",
            bexe,
            "-lpthread",
        ]
        if subprocess.run(cmd, capture_output=True, text=True).returncode == 0:
            for key, t in (("bf16_gflops_1thread", 1), ("bf16_gflops_all_threads", threads)):
                r = subprocess.run([bexe, str(t), "0.2"], capture_output=True, text=True)
                if r.returncode == 0:
                    res[key] = json.loads(r.stdout)["gflops"]
    return res


class PeakAlongside:
    """The FMA peak measured between a case's repetitions: fma_peak.c built
    by fma_peak() is run on `threads` threads after every repetition (the
    best of its 7 windows of `seconds`), so the load that slows the case in
    that moment (other work on a shared machine) lowers this yardstick too.
    Call it to take one measurement; .values holds them (GFLOP/s)."""

    def __init__(self, exe, threads, seconds=0.02):
        self.cmd, self.values = [exe, str(threads), str(seconds)], []

    def __call__(self):
        r = subprocess.run(self.cmd, capture_output=True, text=True)
        if r.returncode == 0:
            self.values.append(json.loads(r.stdout)["gflops"])


def stream_bandwidth(mbytes=256, reps=7):
    """Streaming bandwidth with torch's threads on `mbytes` MB float32 arrays:
    torch.add(a, b, out=c) moves 3 arrays (2 read, 1 written), c.copy_(a) 2.
    Medians; "best_gbs" (the faster of the two) sets the cross-entropy limit.
    Write-allocate traffic is not counted (as in STREAM)."""
    n = mbytes * 2**20 // 4
    a, b, c = torch.rand(n), torch.rand(n), torch.empty(n)
    res = {"array_mb": mbytes}
    for key, fn, arrays in (("add_gbs", lambda: torch.add(a, b, out=c), 3), ("copy_gbs", lambda: c.copy_(a), 2)):
        fn()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        res[key] = round(arrays * n * 4 / statistics.median(ts) / 1e9, 2)
    res["best_gbs"] = max(res["add_gbs"], res["copy_gbs"])
    return res


# ---------------------------------------------------------------- peak RSS


def _status_kb(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def reset_peak_rss():
    """Reset this process's peak RSS (VmHWM) to its current RSS by writing 5
    to /proc/self/clear_refs (Linux >= 4.0). Returns False if not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_growth(fn):
    """Run fn() once; return (peak RSS growth in MB above the RSS just before
    the call, seconds, method). With a resettable VmHWM the growth is exact
    for this call; otherwise ru_maxrss before/after, which is exact as long
    as the process never had a higher RSS before the call (fresh process,
    inputs just allocated)."""
    if reset_peak_rss():
        base_kb, method = _status_kb("VmRSS"), "VmHWM reset via /proc/self/clear_refs"
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        peak_kb = _status_kb("VmHWM")
    else:
        base_kb, method = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "ru_maxrss before/after"
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return max(0, peak_kb - base_kb) / 1024, dt, method, base_kb / 1024


# ---------------------------------------------------------------- best seen on this machine

BEST = os.path.join(OUT, "machine_best.json")


def remember_best(info, threads, measured):
    """Keep, in benchmarks/out/machine_best.json, the highest FMA peak and
    bandwidth ever measured on this machine (same CPU model, ISA, logical
    CPUs and thread count), and return them. Contention from other work only
    ever lowers these measurements, so the best one seen is the better
    yardstick for % peak and the bandwidth limit.

    measured: {"fma_1thread": .., "fma_all_threads": .., "bandwidth_gbs": ..} (values may be None)."""
    key = f"{info['cpu_model']} | {info.get('fma_isa')} | {info['logical_cpus']} cpus | {threads} threads"
    try:
        with open(BEST) as f:
            store = json.load(f)
    except (OSError, ValueError):
        store = {}
    entry = store.get(key, {})
    now = time.strftime("%Y-%m-%d %H:%M:%S")
    for k, v in measured.items():
        if v is not None and v > entry.get(k, {}).get("value", 0.0):
            entry[k] = {"value": v, "measured": now}
    store[key] = entry
    os.makedirs(OUT, exist_ok=True)
    with open(BEST, "w") as f:
        json.dump(store, f, indent=1)
    return {k: e["value"] for k, e in entry.items()}, {k: e["measured"] for k, e in entry.items()}
