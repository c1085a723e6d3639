"""The AVX-512 and AVX512-BF16 attention kernels on an emulated CPU, whatever
CPU runs the suite: tools/emulate/run.py builds the kernels with a C-library-
free harness, runs them on Bochs's CPU (bochscpu-python, a test dependency)
and compares forward (out, lse) and single-pass backward (dq, dk, dv) with the
scalar reference, float64 and native bfloat16's error (at most 2x). Bochs
lacks AVX512-BF16, so its two instructions are emulated with AVX-512 code of
the same semantics (tools/emulate/emu_bf16.h); everything else runs as
compiled. A slice: eight fixed cases (one a forward with no backward to
follow, whose bfloat16 products take P in one part; one a two-sided window,
whose band cuts tiles off the 32-key grid of the tile products' trimming; one
packed sequences, whose items move the tile hooks to their entry; one a decode
over the 8-bit cache, whose scores are integer products) and
two random ones per variant, in bfloat16; `make emulate` runs every case, more
random ones and float32.

The run is a process of its own, about 90 s on one core of a 2-core Zen 3 (a
third compiling): where this test is among those collected, conftest.py
starts it as collection ends (start_in_background, at the lowest priority)
and the test waits for its result, so that it runs beside the rest of the
suite rather than after it."""

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile

from conftest import require

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CMD = [
    sys.executable,
    os.path.join(ROOT, "tools", "emulate", "run.py"),
    "--isa",
    "avx512bf16,avx512",
    "--quick",
    "--fuzz",
    "2",
    "--seed",
    "7",
]
TIMEOUT = 900
_run = None  # (Popen, its output file), once started


def _have_bochscpu():
    return importlib.util.find_spec("bochscpu") is not None  # (importing it may need run.py's glibc shim)


def start_in_background():
    """Starts the emulated run (once), at the lowest priority (`nice`: no preexec_fn, which is
    unsafe in a process with threads): the suite's other tests keep their core."""
    global _run
    if _run is None and _have_bochscpu():
        out = tempfile.TemporaryFile(mode="w+")
        nice = shutil.which("nice")
        cmd = [nice, "-n", "19", *CMD] if nice else CMD
        _run = (subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True), out)


def stop_background():
    if _run is not None and _run[0].poll() is None:
        _run[0].kill()
        _run[0].wait()


def test_avx512_and_avx512bf16_on_an_emulated_cpu():
    require("bochscpu", import_it=False)  # an error where it is missing, a skip under --without emulate
    start_in_background()  # (already running where conftest.py started it)
    proc, out = _run
    try:
        rc = proc.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        stop_background()
        raise
    out.seek(0)
    stdout = out.read()
    print(stdout[-4000:])
    assert rc == 0, stdout[-8000:]
    assert "every case passed" in stdout
    assert stdout.count("\nok   avx512bf16 bf16 ") + stdout.startswith("ok   avx512bf16") == 10
    assert stdout.count("ok   avx512 bf16 ") == 10
