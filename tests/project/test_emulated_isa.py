"""The AVX-512 and AVX512-BF16 attention kernels on an emulated CPU, whatever
CPU runs the suite: tools/emulate/run.py builds the kernels with a C-library-
free harness, runs them on Bochs's CPU (bochscpu-python, a test dependency)
and compares forward (out, lse) and single-pass backward (dq, dk, dv) with the
scalar reference, float64 and native bfloat16's error (at most 2x). Bochs
lacks AVX512-BF16, so its two instructions are emulated with AVX-512 code of
the same semantics (tools/emulate/emu_bf16.h); everything else runs as
compiled. A slice: six fixed cases (one a forward with no backward to
follow, whose bfloat16 products take P in one part; one a two-sided window,
whose band cuts tiles off the 32-key grid of the tile products' trimming) and
two random ones per variant, in bfloat16; `make emulate` runs every case, more
random ones and float32."""

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_avx512_and_avx512bf16_on_an_emulated_cpu():
    if importlib.util.find_spec("bochscpu") is None:  # (importing it may need run.py's glibc shim)
        pytest.skip("bochscpu-python is not installed (make setup installs it)")
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "tools", "emulate", "run.py"),
            "--isa",
            "avx512bf16,avx512",
            "--quick",
            "--fuzz",
            "2",
            "--seed",
            "7",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    print(r.stdout[-4000:])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "every case passed" in r.stdout
    assert r.stdout.count("\nok   avx512bf16 bf16 ") + r.stdout.startswith("ok   avx512bf16") == 8
    assert r.stdout.count("ok   avx512 bf16 ") == 8
