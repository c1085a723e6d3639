"""Executed instructions per attention call on aarch64, counted under qemu-user (make bench-arm).

No ARM machine is at hand, and qemu's timings mean nothing (it translates every instruction), so
this counts instead: benchmarks/kernel_bwd.c (the forward and the single-pass backward, causal,
one thread, the kernels called from C) cross-built by tools/arm.py, run under qemu-aarch64 with
benchmarks/arm/insncount.c as a plugin, once with 1 repetition and once with 3; half the
difference is one forward + backward (the set-up and the scalar reference check cancel).
Each variant runs on an emulated CPU that has it: NEON on a Neoverse N1 (no SVE), sve (the
instance of the CPU's length) and svebf16 (bfloat16 only: BFMMLA) on qemu's `max` CPU at 128,
256 and 512 bits. float32 and bfloat16 (inputs, outputs and gradients) each.

Columns: instructions per call (millions), the share that are vector instructions (Advanced
SIMD vector data processing, or SVE), the ratio to the scalar kernels' count, the multiply-add
instructions (FMLA, FMAD, BFMMLA) and the float multiply-adds they do (millions). Writes
benchmarks/out/arm_insns.json and prints a Markdown table.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import arm  # noqa: E402  (tools/arm.py: the cross-build)

CASES = [(4, 2, 256, 64), (4, 2, 256, 128)]  # (B, H, L, D): B * H >= 8, the single-pass backward
SVE = "max,sve-default-vector-length="  # + bytes
# (variant, its label in the table, qemu CPU, dtypes)
VARIANTS = [
    ("scalar", "scalar", "neoverse-n1", ("f32", "bf16")),
    ("neon", "neon", "neoverse-n1", ("f32", "bf16")),
    ("sve", "sve (SVE 128)", SVE + "16", ("f32", "bf16")),
    ("sve", "sve (SVE 256)", SVE + "32", ("f32", "bf16")),
    ("sve", "sve (SVE 512)", SVE + "64", ("f32", "bf16")),
    ("svebf16", "svebf16 (SVE 128)", SVE + "16", ("bf16",)),
    ("svebf16", "svebf16 (SVE 256)", SVE + "32", ("bf16",)),
    ("svebf16", "svebf16 (SVE 512)", SVE + "64", ("bf16",)),
]


def count(plugin, exe, cpu, case, reps, isa, dtype):
    r = subprocess.run(
        [arm.QEMU, "-L", "/usr/aarch64-linux-gnu", "-cpu", cpu, "-plugin", plugin, "-d", "plugin", exe]
        + [str(x) for x in case]
        + [str(reps), isa, dtype],
        capture_output=True,
        text=True,
        check=True,
    )
    m = re.search(
        r"insns all (\d+) sve (\d+) neon (\d+) fp (\d+) fmla (\d+) bfmmla (\d+) mac (\d+) mac_seg (\d+)",
        r.stdout + r.stderr,
    )
    all_, sve, neon, fp, fmla, bfmmla, mac, mac_seg = (int(x) for x in m.groups())
    seg = int(cpu.split("=")[-1]) // 16 if "vector-length=" in cpu else 0  # SVE's 128-bit segments
    return [all_, sve, neon, fp, fmla + bfmmla, mac + mac_seg * seg]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", choices=("f32", "bf16"), action="append", help="default: both")
    dtypes = ap.parse_args().dtype or ["f32", "bf16"]
    arm.need_toolchain()
    out = os.path.join(ROOT, "benchmarks", "out")
    os.makedirs(out, exist_ok=True)
    objs = arm.c_objects(os.path.join(arm.ARM, "harness"))
    exe = os.path.join(arm.ARM, "harness", "kernel_bwd")
    att = [o for o in objs if "attention_" in o or "common_" in o]
    kb = os.path.join(ROOT, "benchmarks", "kernel_bwd.c")
    arm.run([arm.CC, *arm.C_FLAGS, "-D_POSIX_C_SOURCE=200809L", kb, *att, "-lm", "-lpthread", "-o", exe])
    plugin = os.path.join(arm.ARM, "libinsncount.so")
    arm.run(["gcc", "-shared", "-fPIC", "-O2", "-o", plugin, os.path.join(ROOT, "benchmarks", "arm", "insncount.c")])
    rows = []
    for dtype in dtypes:
        for case in CASES:
            base = None
            for isa, label, cpu, dtypes in VARIANTS:
                if dtype not in dtypes:
                    continue
                one, three = (count(plugin, exe, cpu, case, reps, isa, dtype) for reps in (1, 3))
                per = [(b - a) / 2 for a, b in zip(one, three)]  # all, sve, neon, fp, multiply-add insns, macs
                base = base or per[0]
                rows.append(
                    dict(
                        case=case,
                        dtype=dtype,
                        isa=label,
                        cpu=cpu,
                        insns=per[0],
                        vector=(per[1] + per[2]) / per[0],
                        vs_scalar=base / per[0],
                        mla_insns=per[4],
                        macs=per[5],
                    )
                )
                print(rows[-1], flush=True)
    with open(os.path.join(out, "arm_insns.json"), "w") as f:
        json.dump(dict(date=time.strftime("%Y-%m-%d"), qemu="qemu-aarch64 7.2", rows=rows), f, indent=1)
    print(
        "\n| case (B, H, L, D) | dtype | variant | M instructions | vector share | scalar / variant "
        "| M multiply-add instructions | M multiply-adds |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        share, ratio = f"{100 * r['vector']:.0f}%", f"{r['vs_scalar']:.2f}"
        print(
            f"| {tuple(r['case'])} | {r['dtype']} | {r['isa']} | {r['insns'] / 1e6:.1f} | {share} | {ratio} "
            f"| {r['mla_insns'] / 1e6:.2f} | {r['macs'] / 1e6:.0f} |"
        )


if __name__ == "__main__":
    main()
