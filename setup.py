"""Build torch_masked_attn: C11 kernels compiled by the C compiler, a C++ shim
(csrc/shim/*.cpp) against the libtorch stable ABI, linked into torch_masked_attn._C.

torch.utils.cpp_extension would compile .c files as C++17, so the kernels get
their own step here (build_ext below) and are handed to the extension as
objects. Install with `pip install --no-build-isolation -e .` (see README).
"""

import glob
import os
import platform
import subprocess
import sys
import sysconfig

from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
C_HEADERS = sorted(glob.glob(os.path.join("csrc", "**", "*.h"), recursive=True))
# the C++ shim: its .cpp files (one extension) and the header they share (.hpp: not a C header)
SHIM_SOURCES = sorted(glob.glob(os.path.join("csrc", "shim", "*.cpp")))
SHIM_HEADERS = sorted(glob.glob(os.path.join("csrc", "shim", "*.hpp")))
C_FLAGS = ["-std=c11", "-O3", "-fPIC", "-Wall", "-Wextra", "-fno-math-errno", "-I" + os.path.join(ROOT, "csrc")]
# The wheels' glibc floor: no symbol newer than manylinux_2_28 allows (PyTorch's own wheels'
# floor; tests/project/test_source_layout.py checks it; auditwheel tags today's build manylinux_2_27).
# csrc/common/glibc_compat.h binds
# the C units' exp and log to their old symbol versions; the shim renames libstdc++'s
# __libc_single_threaded (glibc 2.32) to a variable of its own (csrc/shim/registration.cpp).
C_FLAGS += ["-include", os.path.join(ROOT, "csrc", "common", "glibc_compat.h")]
SHIM_FLAGS = ["-D__libc_single_threaded=ma_libc_single_threaded"]

# The C11 translation units and the instruction-set flags of each, per machine
# architecture: the one list the build, tools/sanitize.py (make sanitize) and the
# C harnesses' tests (tests/project/test_c_harness.py) compile. An op's instance for
# instruction set X is csrc/<op>/X.c with X's flags (never -march=native); which
# one runs is decided at run time (csrc/common/isa.c, csrc/<op>/dispatch.c).
# Every csrc/**/*.c outside csrc/shim must be listed under some architecture
# (check_c_units), so a new variant cannot be left out of a build.
AVX2 = ["-mavx2", "-mfma", "-mf16c"]
AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mfma", "-mf16c"]
# + VNNI (vpdpwssd: the 8-bit cache's integer products), which every CPU with AVX512-BF16 has
AVX512BF16 = ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-mfma", "-mf16c"]
AMX = [
    "-mavx512f",
    "-mavx512bw",
    "-mavx512dq",
    "-mavx512vl",
    "-mavx512bf16",
    "-mavx512vnni",
    "-mamx-tile",
    "-mamx-bf16",
    "-mfma",
    "-mf16c",
]
# SVE: an instance per vector length (common/simd_sve.h); the variant "sve" runs the CPU's
SVE_BITS = (128, 256, 512, 1024, 2048)
SVE_UNITS = {
    f"{op}/sve{b}.c": ["-march=armv8.2-a+sve", f"-msve-vector-bits={b}"]
    for op in ("attention", "cross_entropy")
    for b in SVE_BITS
}
SVEBF16 = ["-march=armv8.6-a+sve+bf16"]  # any vector length (attention/svebf16.c)
PORTABLE = {  # no instruction-set flags: the policy, the scalar instances, the dispatch
    "common/isa.c": [],
    "attention/scalar.c": [],
    "attention/dispatch.c": [],
    "attention/head_grads.c": [],
    "cross_entropy/scalar.c": [],
    "cross_entropy/dispatch.c": [],
    "kv_cache/cache_write.c": [],
}
C_UNITS_BY_ARCH = {
    "x86_64": {
        **PORTABLE,
        "attention/avx2.c": AVX2,
        "attention/avx512.c": AVX512,
        "attention/avx512bf16.c": AVX512BF16,
        "attention/amx.c": AMX,
        "cross_entropy/avx2.c": AVX2,
        "cross_entropy/avx512.c": AVX512,
    },
    "aarch64": {  # NEON is in every aarch64 CPU: no flags
        **PORTABLE,
        "attention/neon.c": [],
        "attention/svebf16.c": SVEBF16,
        "cross_entropy/neon.c": [],
        **SVE_UNITS,
    },
}
_ARCH_ALIASES = {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}
ARCH = _ARCH_ALIASES.get(platform.machine().lower(), platform.machine().lower())
# this machine's units, as paths relative to csrc/ ({} where the architecture has no list)
C_UNITS = C_UNITS_BY_ARCH.get(ARCH, {})
C_SOURCES = sorted(os.path.join("csrc", *u.split("/")) for u in C_UNITS)
# MASKED_ATTN_CFLAGS: extra words appended to every compile (C11 and C++) and to
# the link, e.g. the sanitizers (make sanitize); unset: the flags above only.
EXTRA_FLAGS = os.environ.get("MASKED_ATTN_CFLAGS", "").split()


def unit_name(src):
    """csrc/attention/avx2.c or its absolute path -> attention/avx2.c (C_UNITS' key)."""
    rel = os.path.relpath(os.path.abspath(os.path.join(ROOT, src)), os.path.join(ROOT, "csrc"))
    return rel.replace(os.sep, "/")


def isa_flags(src):
    """The instruction-set flags of a unit of C_UNITS (a path as C_SOURCES has it, or absolute)."""
    name = unit_name(src)
    if name not in C_UNITS:
        raise KeyError(f"{name} is not a C unit of {ARCH} in setup.py's C_UNITS_BY_ARCH")
    return C_UNITS[name]


def object_name(src):
    """csrc/attention/avx2.c -> attention_avx2.o (instances of different ops share file names)."""
    return unit_name(src)[:-2].replace("/", "_") + ".o"


def compile_command(cc, src, obj, extra=()):
    """The compile line of one C unit: C_FLAGS, its instruction-set flags, then extra."""
    return [cc, *C_FLAGS, *isa_flags(src), *extra, "-c", src, "-o", obj]


def c_object_stale(src, obj):
    """True when obj is missing or older than src or than any C header."""
    newest_header = max((os.path.getmtime(os.path.join(ROOT, h)) for h in C_HEADERS), default=0)
    newest = max(os.path.getmtime(os.path.join(ROOT, src)), newest_header)
    return not os.path.exists(obj) or os.path.getmtime(obj) < newest


def check_c_units():
    """Raises unless this architecture has a list and every C file of csrc/ (the shim aside)
    is listed under some architecture."""
    if ARCH not in C_UNITS_BY_ARCH:
        raise SystemExit(f"setup.py: no C units listed for the architecture {ARCH!r} (C_UNITS_BY_ARCH)")
    listed = {u for units in C_UNITS_BY_ARCH.values() for u in units}
    found = glob.glob(os.path.join(ROOT, "csrc", "**", "*.c"), recursive=True)
    missing = sorted(n for n in map(unit_name, found) if n not in listed and not n.startswith("shim/"))
    if missing:
        raise SystemExit(f"setup.py: C files in no architecture's list of C_UNITS_BY_ARCH: {', '.join(missing)}")


def c11_object_dir(build_temp):
    """Where build_ext keeps the C11 objects: build/temp.<platform>-<python>/c11/ in the source
    tree whatever build_temp is (pip install -e builds in a temporary build_temp), so a rebuild
    and tests/project/test_c_harness.py reuse them; with MASKED_ATTN_CFLAGS (the sanitizers:
    other flags, other objects), under the build_temp the caller chose."""
    if EXTRA_FLAGS:
        return os.path.join(build_temp, "c11")
    return os.path.join(ROOT, "build", f"temp.{sysconfig.get_platform()}-{sys.implementation.cache_tag}", "c11")


class BuildC11ThenExtension(BuildExtension):
    def build_extensions(self):
        check_c_units()
        cc = os.environ.get("CC", "cc")
        obj_dir = c11_object_dir(self.build_temp)
        os.makedirs(obj_dir, exist_ok=True)
        objects = []
        for src in C_SOURCES:
            obj = os.path.join(obj_dir, object_name(src))
            if c_object_stale(src, obj):
                cmd = compile_command(cc, src, obj, EXTRA_FLAGS)
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
                    "cxx": [
                        "-O2",
                        "-std=c++17",
                        "-DTORCH_TARGET_VERSION=0x020a000000000000",
                        *SHIM_FLAGS,
                        *EXTRA_FLAGS,
                    ],
                },
                extra_link_args=EXTRA_FLAGS,
                py_limited_api=True,
            )
        ],
        cmdclass={"build_ext": BuildC11ThenExtension},
    )
