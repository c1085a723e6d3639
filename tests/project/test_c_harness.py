"""Builds and runs the C harnesses: every SIMD variant of the kernels'
building blocks against the scalar reference, in C.

  tests/c/test_blocks.c     attention: GEMM edges (AMX tiles included), exp
                            accuracy and special values, column max/exp, transpose
  tests/c/test_ce_blocks.c  cross-entropy row blocks
  benchmarks/kernel_bwd.c   the attention forward and backward called from C, each
                            variant against the scalar one on a small causal shape

The kernels' objects are the build's own (build/temp.*/c11/, what setup.py links into
torch_masked_attn._C) where they are current; else compiled here with the same flags.
"""

import concurrent.futures
import os
import subprocess
import sys

import pytest

from conftest import isa_available

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
# the build's own flags, C units and objects
from setup import C_FLAGS, C_UNITS, EXTRA_FLAGS, c11_object_dir, c_object_stale, isa_flags, object_name  # noqa: E402

# setup.py's C units for this machine's architecture, by op: every variant the build compiles
COMMON = tuple(u for u in C_UNITS if u.startswith("common/"))  # ma_isa_available
ATTENTION = tuple(u for u in C_UNITS if u.startswith("attention/"))
CROSS_ENTROPY = tuple(u for u in C_UNITS if u.startswith("cross_entropy/"))


def build_objects(sources):
    """The objects setup.py's build_ext compiled from these units (build/temp.<platform>-<python>/c11/),
    or None unless every one is there and newer than its source and every C header
    (setup.c_object_stale, the build's own test) and MASKED_ATTN_CFLAGS adds no flags."""
    if EXTRA_FLAGS:
        return None
    c11 = c11_object_dir(None)
    objs = [os.path.join(c11, object_name(os.path.join("csrc", src))) for src in sources]
    if any(c_object_stale(os.path.join("csrc", src), obj) for src, obj in zip(sources, objs)):
        return None
    return objs


def compile_objects(out_dir, sources):
    """The build's objects of the kernels' sources (build_objects), or else the sources compiled
    here with the build's own flags, one compiler per CPU (without a current build, the largest
    part of make test's time on 2 cores); returns the object paths."""
    built = build_objects(sources)
    if built is not None:
        return built
    cc = os.environ.get("CC", "cc")

    def compile_one(src):
        path = os.path.join(ROOT, "csrc", src)
        obj = out_dir / (src.replace("/", "_") + ".o")
        subprocess.run([cc, *C_FLAGS, *isa_flags(path), "-c", path, "-o", str(obj)], check=True)
        return str(obj)

    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return list(pool.map(compile_one, sources))


@pytest.fixture(scope="module")
def attention_objects(tmp_path_factory):
    return compile_objects(tmp_path_factory.mktemp("attention_objects"), COMMON + ATTENTION)


@pytest.mark.parametrize("harness", ["test_blocks.c", "test_ce_blocks.c"])
def test_every_variant_against_scalar(tmp_path, harness, attention_objects):
    cc = os.environ.get("CC", "cc")
    objs = attention_objects if harness == "test_blocks.c" else compile_objects(tmp_path, COMMON + CROSS_ENTROPY)
    exe = tmp_path / harness[:-2]
    subprocess.run(
        [
            cc,
            *C_FLAGS,
            "-I",
            os.path.join(ROOT, "csrc"),
            os.path.join(ROOT, "tests", "c", harness),
            *objs,
            "-lm",
            "-o",
            str(exe),
        ],
        check=True,
    )
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    print(run.stdout)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "scalar  ok" in run.stdout


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("isa", ["avx2", "avx512", "amx", "avx512bf16"])
def test_kernel_tool_agrees_with_scalar(tmp_path, attention_objects, isa, dtype):
    """benchmarks/kernel_bwd.c (the forward and single-pass backward called
    from C, no torch) builds against the kernels, and on a small causal shape
    the variant gives out, dq, dk, dv within 1e-3 of the scalar reference
    (bfloat16: within 2^-6 (|reference| + 1); the tool exits 1 otherwise).
    make test-arm-c runs it so for the aarch64 variants under qemu."""
    if not isa_available(isa):
        pytest.skip(f"this CPU has no {isa}")
    cc = os.environ.get("CC", "cc")
    exe = tmp_path / "kernel_bwd"
    subprocess.run(
        [
            cc,
            *C_FLAGS,
            "-D_POSIX_C_SOURCE=200809L",
            os.path.join(ROOT, "benchmarks", "kernel_bwd.c"),
            *attention_objects,
            "-lm",
            "-o",
            str(exe),
        ],
        check=True,
    )
    run = subprocess.run([str(exe), "4", "2", "130", "64", "1", isa, dtype], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "from the scalar reference" in run.stdout


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_decode_blocks_tool_runs(tmp_path, isa):
    """benchmarks/decode_blocks.c (the decode kernel's products timed alone, docs/decoding-performance.md)
    builds from the blocks' template on AVX2 and on AVX-512 and prints the three dtypes' timings
    (int8: the integer scores and P V beside the float ones; the 4 x 3 prototype only on AVX2's
    8 lanes)."""
    if not isa_available(isa):
        pytest.skip(f"this CPU has no {isa}")
    from setup import AVX2, AVX512

    cc = os.environ.get("CC", "cc")
    exe = tmp_path / "decode_blocks"
    src = os.path.join(ROOT, "benchmarks", "decode_blocks.c")
    flags = AVX2 if isa == "avx2" else AVX512
    # -O0 after C_FLAGS' -O3: the build, not the timings, is under test (-O3 takes 30 s here, -O0 8)
    subprocess.run([cc, *C_FLAGS, *flags, "-O0", "-Werror", src, "-lm", "-o", str(exe)], check=True)
    run = subprocess.run([str(exe), "4", "128", "2"], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert [ln.split()[0] for ln in lines] == ["f32", "bf16", "int8"], run.stdout
    assert all("axpy_keys" in ln for ln in lines) and "dot_rows_i8" in lines[2], run.stdout
    assert all(ln.endswith("4 x 3 scores -") == (isa == "avx512") for ln in lines[:2]), run.stdout
    # the int8 line: the integer P V block beside the float one (tests/c/test_blocks.c checks its sums)
    assert "axpy_keys_i8 (integer)" in lines[2], run.stdout
    assert subprocess.run([str(exe), "17"], capture_output=True).returncode == 2  # rows past 16: refused
    assert subprocess.run([str(exe), "4", "128", "2", "72"], capture_output=True).returncode == 2  # D % 16


def test_every_c_file_is_built():
    """Every C file of csrc/ (the shim aside) is in setup.py's list of C units of some
    architecture, the list the build, make sanitize and these harnesses compile."""
    from setup import check_c_units

    check_c_units()
