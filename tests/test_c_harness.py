"""Builds and runs the C harnesses: every SIMD variant of the kernels'
building blocks against the scalar reference, in C.

  tests/c/test_blocks.c     attention: GEMM edges (AMX tiles included), exp
                            accuracy and special values, column max/exp, transpose
  tests/c/test_ce_blocks.c  cross-entropy row blocks
"""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from setup import C_FLAGS, isa_flags  # noqa: E402  (the build's own flags)

COMMON = ("common/isa.c",)  # ma_isa_available
ATTENTION = ("attention/scalar.c", "attention/avx2.c", "attention/avx512.c", "attention/amx.c",
             "attention/dispatch.c")
CROSS_ENTROPY = ("cross_entropy/scalar.c", "cross_entropy/avx2.c", "cross_entropy/avx512.c",
                 "cross_entropy/dispatch.c")


@pytest.mark.parametrize("harness,sources", [("test_blocks.c", COMMON + ATTENTION),
                                             ("test_ce_blocks.c", COMMON + CROSS_ENTROPY)])
def test_every_variant_against_scalar(tmp_path, harness, sources):
    cc = os.environ.get("CC", "cc")
    objs = []
    for src in sources:
        path = os.path.join(ROOT, "csrc", src)
        obj = tmp_path / (src.replace("/", "_") + ".o")
        subprocess.run([cc, *C_FLAGS, *isa_flags(path), "-c", path, "-o", str(obj)], check=True)
        objs.append(str(obj))
    exe = tmp_path / harness[:-2]
    subprocess.run([cc, *C_FLAGS, "-I", os.path.join(ROOT, "csrc"), os.path.join(ROOT, "tests", "c", harness),
                    *objs, "-lm", "-o", str(exe)], check=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    print(run.stdout)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "scalar  ok" in run.stdout
