"""make sanitize: the C harnesses and a Python test slice under ASan + UBSan.

Everything is built into build-sanitize/ (never build/ nor the package's own
_C.abi3.so, which the editable install and other builds own):

  build-sanitize/tmp/c11              the C11 kernels: setup.py's C units for this
                                      architecture (C_UNITS), each compiled with
                                      setup.py's compile line (C_FLAGS + its ISA
                                      flags) + the sanitizer flags;
  build-sanitize/tmp, build-sanitize/lib
                                      `setup.py build_ext` with MASKED_ATTN_CFLAGS =
                                      the sanitizer flags: the shim, linked with
                                      those kernel objects;
  build-sanitize/c/<harness>/         tests/c/*.c linked with those kernel objects
                                      (the sources of tests/project/test_c_harness.py), run;
  build-sanitize/pkg/torch_masked_attn the package's .py files + that _C.abi3.so,
                                      first on PYTHONPATH for the pytest slice.

The Python interpreter is not instrumented, so the ASan runtime is preloaded,
with libstdc++ beside it (C++ exceptions thrown by the shim must unwind through
the one libstdc++). Leak detection is off for Python (the interpreter keeps
its objects at exit by design) and on for the C harnesses. Any sanitizer
report aborts the process (abort_on_error, halt_on_error,
-fno-sanitize-recover), so a report is a failure.

  python tools/sanitize.py                 # the build, the harnesses, the slice
  python tools/sanitize.py --c-only        # the kernels and the C harnesses only (make sanitize-c)
  python tools/sanitize.py -- -k causal    # extra arguments go to pytest
  SANITIZE_TESTS="tests/project/test_isa.py" python tools/sanitize.py   # another slice (all of it)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "build-sanitize")
sys.path.insert(0, ROOT)
from setup import C_FLAGS, C_UNITS, c_object_stale, check_c_units, compile_command, object_name  # noqa: E402

SAN_FLAGS = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=undefined", "-g", "-O1"]


# the harnesses (those of tests/project/test_c_harness.py) and the C units each links: the
# units of setup.py's list for this architecture under the ops' folders, so that
# every instruction-set variant the build compiles is in its harness's link
def _units(*ops: str) -> tuple[str, ...]:
    return tuple(u for u in C_UNITS if u.split("/")[0] in ops)


HARNESSES = (("test_blocks.c", _units("common", "attention")), ("test_ce_blocks.c", _units("common", "cross_entropy")))

# the Python slice: bad input (error paths through the shim, child interpreters),
# the kernels on every variant this CPU has, SDPA and cross-entropy end to end;
# without what costs most under ASan for little new code: the float64
# gradchecks of long sequences, opcheck, the long-sequence and torch.compile
# tests, cross-entropy parity in float64/float16 (float32 and bfloat16 stay),
# and all but one case of each large streamed-output test; plus dropout, window /
# softcap / sinks (without dropout's statistical training run and torch.compile)
# and the fuzzer's seeded slice (300 random cases per ISA, every option,
# the HF backend included where transformers is installed); output aliasing and
# overlap, meta tensors, Python threads and thread counts, the extreme shapes
# (overflow probes), the low-precision backward (out_lo) and the scratch pool's (reuse across shapes and
# threads, release_memory, the key chunks' partial sums).
DEFAULT_TESTS = (
    "tests/project/test_bad_input.py tests/project/test_isa.py tests/loss/test_cross_entropy.py "
    "tests/attention/test_sdpa.py tests/attention/test_dropout.py tests/attention/test_window_softcap_sinks.py "
    "tests/project/test_fuzz.py tests/attention/test_output_aliasing.py tests/attention/test_meta_tensors.py "
    "tests/project/test_threads.py tests/attention/test_extreme_shapes.py "
    "tests/attention/test_low_precision_backward.py tests/project/test_scratch.py tests/decode/test_kv_cache.py"
)
DEFAULT_SELECT = [
    "-k",
    "not opcheck and not _long and not torch_compile and not (parity_functional and (float64 or torch.float16))"
    " and not training_equivalence and not compile_with_dropout and not broken_reference",
    *(
        f"--deselect=tests/project/test_isa.py::{t}"
        for t in (
            "test_single_pass_backward_gradcheck",
            "test_key_chunked_backward_gradcheck",
            "test_large_outputs_streamed_same_values[none",
            "test_large_outputs_streamed_same_values[causal+kpm-48",
            "test_large_outputs_streamed_same_values[causal+kpm-64",
            "test_streamed_gradients_into_misaligned_views[0",
            "test_streamed_gradients_into_misaligned_views[8",
        )
    ),
]

ASAN_OPTIONS_C = "abort_on_error=1:detect_leaks=1"
ASAN_OPTIONS_PY = "detect_leaks=0:abort_on_error=1"
UBSAN_OPTIONS = "print_stacktrace=1:halt_on_error=1"
REPORT_MARKS = ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "runtime error:", "SUMMARY: UndefinedBehavior")

# loaded into pytest with -p: refuses to run unless the package imported is
# the sanitized copy and the ASan runtime is in the process
GUARD = """
import os
import torch_masked_attn
from torch_masked_attn import _library

PKG = os.environ["SANITIZE_PKG"]


def pytest_configure(config):
    lib = _library._libs[0]
    if not os.path.realpath(lib).startswith(os.path.realpath(PKG) + os.sep):
        raise SystemExit(f"sanitize: the tests import {lib}, not the sanitized build under {PKG}")
    with open("/proc/self/maps") as f:
        if "libasan" not in f.read():
            raise SystemExit("sanitize: the ASan runtime is not loaded (LD_PRELOAD)")


def pytest_report_header(config):
    return [f"sanitize: torch_masked_attn from {torch_masked_attn.__file__}",
            f"sanitize: library {_library._libs[0]} (ASan + UBSan)"]
"""


def step(msg):
    print(f"\n== sanitize: {msg}", flush=True)


def run(cmd, **kw):
    print(" ".join(cmd), flush=True)
    return subprocess.run(cmd, check=True, **kw)


def has_report(text):
    return any(m in text for m in REPORT_MARKS)


def c_harnesses(cc):
    """Link each harness with the kernels' objects from build_extension: the
    same compile line (C_FLAGS, the file's ISA flags, SAN_FLAGS), built once."""
    for harness, sources in HARNESSES:
        step(f"C harness {harness}")
        d = os.path.join(OUT, "c", harness[:-2])
        os.makedirs(d, exist_ok=True)
        objs = [os.path.join(OUT, "tmp", "c11", object_name(os.path.join(ROOT, "csrc", src))) for src in sources]
        exe = os.path.join(d, harness[:-2])
        run(
            [
                cc,
                *C_FLAGS,
                *SAN_FLAGS,
                "-I",
                os.path.join(ROOT, "csrc"),
                os.path.join(ROOT, "tests", "c", harness),
                *objs,
                "-lm",
                "-o",
                exe,
            ]
        )
        env = dict(os.environ, ASAN_OPTIONS=ASAN_OPTIONS_C, UBSAN_OPTIONS=UBSAN_OPTIONS)
        t0 = time.time()
        proc = subprocess.run([exe], capture_output=True, text=True, env=env)
        sys.stdout.write(proc.stdout)
        sys.stdout.write(proc.stderr)
        ok = proc.returncode == 0 and "scalar  ok" in proc.stdout and not has_report(proc.stdout + proc.stderr)
        print(f"-- {harness}: {'clean' if ok else 'FAILED'} (exit {proc.returncode}, {time.time() - t0:.1f} s)")
        if not ok:
            return False
    return True


def c_objects(cc):
    """The kernels' C units (setup.py's C_UNITS) compiled as setup.py compiles them, with
    SAN_FLAGS as MASKED_ATTN_CFLAGS, into setup.py's object folder build-sanitize/tmp/c11,
    the CPUs' count at a time: the build_ext that follows finds them up to date."""
    step(f"the kernels' {len(C_UNITS)} C units with the sanitizers (build-sanitize/tmp/c11)")
    check_c_units()
    obj_dir = os.path.join(OUT, "tmp", "c11")
    # setup.py rebuilds a kernel object only when its sources are newer:
    # start over when the flags (or the compiler) changed since the last build
    stamp, flags = os.path.join(OUT, "tmp", "flags"), " ".join([cc, *C_FLAGS, *SAN_FLAGS])
    if not os.path.exists(stamp) or open(stamp).read() != flags:
        shutil.rmtree(obj_dir, ignore_errors=True)
        os.makedirs(os.path.dirname(stamp), exist_ok=True)
        with open(stamp, "w") as f:
            f.write(flags)
    os.makedirs(obj_dir, exist_ok=True)
    todo = [
        compile_command(cc, src, obj, SAN_FLAGS)
        for src in (os.path.join("csrc", u) for u in sorted(C_UNITS))
        for obj in [os.path.join(obj_dir, object_name(src))]
        if c_object_stale(src, obj)
    ]
    running = []
    while todo or running:
        while todo and len(running) < (os.cpu_count() or 1):
            cmd = todo.pop(0)
            print(" ".join(cmd), flush=True)
            running.append((cmd, subprocess.Popen(cmd, cwd=ROOT)))
        cmd, proc = running.pop(0)
        if proc.wait():
            raise SystemExit(f"sanitize: compiling {cmd[-3]} failed")


def build_extension():
    step("the extension with the sanitizers (setup.py build_ext into build-sanitize/)")
    env = dict(os.environ, MASKED_ATTN_CFLAGS=" ".join(SAN_FLAGS))
    run(
        [
            sys.executable,
            "setup.py",
            "-q",
            "build_ext",
            "--build-temp",
            os.path.join(OUT, "tmp"),
            "--build-lib",
            os.path.join(OUT, "lib"),
        ],
        cwd=ROOT,
        env=env,
    )
    pkg_root = os.path.join(OUT, "pkg")
    pkg = os.path.join(pkg_root, "torch_masked_attn")
    shutil.rmtree(pkg, ignore_errors=True)
    shutil.copytree(os.path.join(ROOT, "torch_masked_attn"), pkg, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    shutil.copy2(os.path.join(OUT, "lib", "torch_masked_attn", "_C.abi3.so"), pkg)
    shutil.copy2(os.path.join(ROOT, "pyproject.toml"), pkg_root)  # __version__ reads it
    with open(os.path.join(pkg_root, "_sanitize_guard.py"), "w") as f:
        f.write(GUARD)
    return pkg_root


def python_slice(cc, pkg_root, extra):
    chosen = os.environ.get("SANITIZE_TESTS")
    tests = [os.path.join(ROOT, t) for t in (chosen or DEFAULT_TESTS).split()]
    select = [] if chosen else DEFAULT_SELECT
    step(f"pytest under ASan + UBSan: {' '.join(os.path.relpath(t, ROOT) for t in tests)}")

    def lib(name):
        return subprocess.run(
            [cc, f"-print-file-name={name}"], capture_output=True, text=True, check=True
        ).stdout.strip()

    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([pkg_root, *filter(None, [os.environ.get("PYTHONPATH")])]),
        SANITIZE_PKG=os.path.join(pkg_root, "torch_masked_attn"),
        LD_PRELOAD=f"{lib('libasan.so')} {lib('libstdc++.so')}",
        ASAN_OPTIONS=ASAN_OPTIONS_PY,
        UBSAN_OPTIONS=UBSAN_OPTIONS,
        PYTHONDONTWRITEBYTECODE="1",
    )
    # cwd build-sanitize/: `python -m` puts the cwd first on sys.path, and the
    # repository root there would give the unsanitized package; pytest itself
    # adds only tests/ (conftest's directory) and its topic folders. No .pytest_cache in the checkout.
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "_sanitize_guard",
        "-p",
        "no:cacheprovider",
        "-q",
        "-x",
        "-W",
        "ignore::DeprecationWarning",
        *tests,
        *select,
        *extra,
    ]
    print(" ".join(cmd), flush=True)
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=OUT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:  # shown as it comes, and kept to look for reports
        sys.stdout.write(line)
        sys.stdout.flush()
        lines.append(line)
    rc = proc.wait()
    ok = rc == 0 and not has_report("".join(lines))
    print(f"-- pytest: {'clean' if ok else 'FAILED'} (exit {rc}, {time.time() - t0:.0f} s)")
    return ok


def main(argv):
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    c_only = "--c-only" in (argv[: argv.index("--")] if "--" in argv else argv)
    cc = os.environ.get("CC", "cc")
    t0 = time.time()
    os.makedirs(OUT, exist_ok=True)
    c_objects(cc)
    if c_only:
        ok = c_harnesses(cc)
    else:
        pkg_root = build_extension()
        ok = c_harnesses(cc) and python_slice(cc, pkg_root, extra)
    print(f"\nsanitize: {'clean' if ok else 'FAILED'} in {time.time() - t0:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
