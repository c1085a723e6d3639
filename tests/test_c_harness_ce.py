"""Builds and runs the cross-entropy C harness (tests/c/test_ce_blocks.c):
every SIMD variant of the cross-entropy row blocks against the scalar
reference, in C."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from setup import C_FLAGS, isa_flags  # noqa: E402  (the build's own flags)

# cross_entropy*.c, plus attention*.c for ma_isa_available (the one dispatch place)
SOURCES = ("cross_entropy.c", "cross_entropy_avx2.c", "cross_entropy_avx512.c",
           "attention.c", "attention_avx2.c", "attention_avx512.c")


def test_ce_blocks_every_variant(tmp_path):
    cc = os.environ.get("CC", "cc")
    objs = []
    for src in SOURCES:
        path = os.path.join(ROOT, "csrc", src)
        obj = tmp_path / (src + ".o")
        subprocess.run([cc, *C_FLAGS, *isa_flags(path), "-c", path, "-o", str(obj)], check=True)
        objs.append(str(obj))
    exe = tmp_path / "test_ce_blocks"
    subprocess.run([cc, *C_FLAGS, "-I", os.path.join(ROOT, "csrc"), os.path.join(ROOT, "tests", "c", "test_ce_blocks.c"),
                    *objs, "-lm", "-o", str(exe)], check=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    print(run.stdout)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "scalar  ok" in run.stdout
