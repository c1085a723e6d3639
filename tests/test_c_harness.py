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

ATTENTION = ("attention.c", "attention_avx2.c", "attention_avx512.c", "attention_amx.c")  # also ma_isa_available
CROSS_ENTROPY = ("cross_entropy.c", "cross_entropy_avx2.c", "cross_entropy_avx512.c")


@pytest.mark.parametrize("harness,sources", [("test_blocks.c", ATTENTION),
                                             ("test_ce_blocks.c", CROSS_ENTROPY + ATTENTION)])
def test_every_variant_against_scalar(tmp_path, harness, sources):
    cc = os.environ.get("CC", "cc")
    objs = []
    for src in sources:
        path = os.path.join(ROOT, "csrc", src)
        obj = tmp_path / (src + ".o")
        subprocess.run([cc, *C_FLAGS, *isa_flags(path), "-c", path, "-o", str(obj)], check=True)
        objs.append(str(obj))
    exe = tmp_path / harness[:-2]
    subprocess.run([cc, *C_FLAGS, "-I", os.path.join(ROOT, "csrc"), os.path.join(ROOT, "tests", "c", harness),
                    *objs, "-lm", "-o", str(exe)], check=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    print(run.stdout)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "scalar  ok" in run.stdout
