"""Build torch_masked_attn: C11 kernels compiled by the C compiler, a C++ shim
(csrc/shim/*.cpp) against the libtorch stable ABI, linked into torch_masked_attn._C.

torch.utils.cpp_extension would compile .c files as C++17, so the kernels get
their own step here (build_ext below) and are handed to the extension as
objects. Install with `pip install --no-build-isolation -e .` (see README).
"""

import glob
import os
import subprocess

from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
C_SOURCES = sorted(glob.glob(os.path.join("csrc", "**", "*.c"), recursive=True))
C_HEADERS = sorted(glob.glob(os.path.join("csrc", "**", "*.h"), recursive=True))
# the C++ shim: its .cpp files (one extension) and the header they share (.hpp: not a C header)
SHIM_SOURCES = sorted(glob.glob(os.path.join("csrc", "shim", "*.cpp")))
SHIM_HEADERS = sorted(glob.glob(os.path.join("csrc", "shim", "*.hpp")))
C_FLAGS = ["-std=c11", "-O3", "-fPIC", "-Wall", "-Wextra", "-fno-math-errno", "-I" + os.path.join(ROOT, "csrc")]
# Instruction-set variants: an op's instance for instruction set X is the
# file csrc/<op>/X.c, compiled with X's flags (never -march=native); which
# one runs is decided at run time (csrc/common/isa.c, csrc/<op>/dispatch.c).
ISA_FLAGS = {
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mfma", "-mf16c"],
    "amx": [
        "-mavx512f",
        "-mavx512bw",
        "-mavx512dq",
        "-mavx512vl",
        "-mavx512bf16",
        "-mamx-tile",
        "-mamx-bf16",
        "-mfma",
        "-mf16c",
    ],
    "avx512bf16": ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512bf16", "-mfma", "-mf16c"],
}
# MASKED_ATTN_CFLAGS: extra words appended to every compile (C11 and C++) and to
# the link, e.g. the sanitizers (make sanitize); unset: the flags above only.
EXTRA_FLAGS = os.environ.get("MASKED_ATTN_CFLAGS", "").split()


def isa_flags(src):
    return ISA_FLAGS.get(os.path.splitext(os.path.basename(src))[0], [])


def object_name(src):
    """csrc/attention/avx2.c -> attention_avx2.o (instances of different ops share file names)."""
    rel = os.path.relpath(src, os.path.join(ROOT, "csrc") if os.path.isabs(src) else "csrc")
    return rel[:-2].replace(os.sep, "_") + ".o"


class BuildC11ThenExtension(BuildExtension):
    def build_extensions(self):
        cc = os.environ.get("CC", "cc")
        obj_dir = os.path.join(self.build_temp, "c11")
        os.makedirs(obj_dir, exist_ok=True)
        newest_header = max((os.path.getmtime(h) for h in C_HEADERS), default=0)
        objects = []
        for src in C_SOURCES:
            obj = os.path.join(obj_dir, object_name(src))
            stale = not os.path.exists(obj) or os.path.getmtime(obj) < max(os.path.getmtime(src), newest_header)
            if stale:
                cmd = [cc, *C_FLAGS, *isa_flags(src), *EXTRA_FLAGS, "-c", src, "-o", obj]
                print(" ".join(cmd))
                subprocess.check_call(cmd)
            objects.append(obj)
        for ext in self.extensions:
            ext.extra_objects = objects
            ext.depends = C_SOURCES + C_HEADERS + SHIM_HEADERS
        super().build_extensions()


if __name__ == "__main__":  # tests import this file for the C flags
    setup(  # name, version, description, dependencies: pyproject.toml's [project]
        packages=find_packages(include=["torch_masked_attn", "torch_masked_attn.*"]),
        ext_modules=[
            CppExtension(
                "torch_masked_attn._C",
                SHIM_SOURCES,
                include_dirs=[os.path.join(ROOT, "csrc")],
                extra_compile_args={
                    "cxx": ["-O2", "-std=c++17", "-DTORCH_TARGET_VERSION=0x020a000000000000", *EXTRA_FLAGS],
                },
                extra_link_args=EXTRA_FLAGS,
                py_limited_api=True,
            )
        ],
        cmdclass={"build_ext": BuildC11ThenExtension},
    )
