"""Build and test the package for aarch64 on an x86_64 machine (make test-arm).

    python tools/arm.py harness        cross-build setup.py's aarch64 C units, run the C
                                       harnesses under qemu-user on each emulated CPU below
    python tools/arm.py setup          an aarch64 Python 3.11 and PyPI's aarch64 torch in .arm/
                                       (about 450 MB, once)
    python tools/arm.py build          cross-build _C.abi3.so against that torch: .arm/pkg/
    python tools/arm.py pytest [--sve-bits N] [ARGS]
                                       pytest under the emulated Python, on .arm/pkg, SVE at N
                                       bits (default 256; ARGS: the tests, default ARM_SLICE)
    python tools/arm.py wheel [--out D] the cp310-abi3 linux_aarch64 wheel of .arm/pkg (make wheel-arm
                                       has auditwheel give it its manylinux tag)

The cross compilers and qemu-user come from Debian (gcc-aarch64-linux-gnu,
g++-aarch64-linux-gnu, libc6-dev-arm64-cross, qemu-user); `harness` installs them
with apt-get where they are missing. qemu's timings mean nothing: a native core is
about 50 times faster. Everything built goes under .arm/ (ignored by git).
"""

import argparse
import base64
import collections
import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile

import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from setup import C_FLAGS, C_UNITS_BY_ARCH, SHIM_FLAGS, SHIM_SOURCES, object_name  # noqa: E402  (the build's own lists)

ARM = os.path.join(ROOT, ".arm")
CC, CXX = "aarch64-linux-gnu-gcc", "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"
SYSROOT = os.path.join(ARM, "sysroot")  # the aarch64 Python's files
SITE = os.path.join(ARM, "site")  # aarch64 torch, numpy, pytest
STUBS = os.path.join(ARM, "cuda-stubs")
PKG = os.path.join(ARM, "pkg")  # the package with the aarch64 extension
TORCH = "2.13.0"
APT = ["gcc-aarch64-linux-gnu", "g++-aarch64-linux-gnu", "libc6-dev-arm64-cross", "qemu-user"]

ARM_VARIANTS = ("neon", "sve", "svebf16")  # ma_isa's aarch64 variants
SVE_BITS = (128, 256, 512, 1024, 2048)  # sve's instances (setup.py)
# The emulated CPUs the C harnesses run on: (name, qemu -cpu, its SVE length in bits, 0 without).
# neoverse-n1 has no SVE (dispatch must not pick an SVE variant there); max has every extension
# qemu knows, SVE-BF16 among them, SVE at the length given: sve runs the instance of that length
# (each harness must run that one and refuse the others), svebf16, length-agnostic, runs at each.
CPUS = [
    ("neoverse-n1 (NEON, no SVE)", "neoverse-n1", 0),
    *((f"max, SVE {b} bits", f"max,sve-default-vector-length={b // 8}", b) for b in SVE_BITS),
]
# SVE without BF16 (a64fx: SVE 512): svebf16 must be refused there.
NO_BF16_CPU = "a64fx"

# The pytest slice: the ops against PyTorch and the scalar reference on every variant the
# emulated CPU has (the tests parametrize over ISAs and skip the absent ones).
ARM_SLICE = [
    "tests/project/test_isa.py::test_variant_matches_scalar_and_torch",  # every shape edge, mask kinds, fwd + bwd
    "tests/project/test_isa.py::test_converted_inputs",  # float32, bfloat16, float16
    "tests/project/test_isa.py::test_short_query_blocks_match_the_tiles",  # decode rows: the tiles' bits
    "tests/attention/test_window_softcap_sinks.py::test_isa_against_scalar",  # windows, soft-capping, sinks
    # padding + causal masks, skipped blocks
    "tests/attention/test_mask_skip.py::test_hf_mask_matches_sdpa_and_structural",
    "tests/attention/test_dropout.py::test_mask_is_the_definition",  # Philox on the vector integer ops
    "tests/loss/test_cross_entropy_options.py::test_variant_matches_scalar_and_torch",
    "tests/attention/test_varlen.py::test_thread_count_and_batch_invariance",  # bitwise, the default variant
    "tests/decode/test_kv_int8.py::test_quantize_kv_is_its_definition",  # the 8-bit cache: quantize_row
    "tests/decode/test_kv_int8.py::test_attention_over_int8_cache",  # int8 k, v: dot_rows and axpy_keys over int8 rows
    "tests/decode/test_kv_int8.py::test_decode_row_batch_invariant",
    "tests/attention/test_varlen.py::test_entries_match_dense_forward_bitwise",  # svebf16: varlen, paged = dense bits
    "tests/attention/test_varlen.py::test_tile_products_forward",  # svebf16: windows, softcap, sinks, pages
    "tests/attention/test_bf16_accuracy.py",  # svebf16 (BFMMLA's round-to-odd) against native's error
    "-k",
    # the variants of the emulated CPU (SVE at 256 bits, SVE-BF16) and its default; svebf16 in bfloat16
    # only (its float32 and float16 calls run NEON's kernels)
    "neon or None or (sve and not svebf16) or (svebf16 and (bfloat16 or not float))",
]

# aarch64 Python 3.11 from Debian 12 (arm64 packages unpacked into SYSROOT, never installed).
PYTHON_DEBS = [
    "gcc-12-base",
    "libbz2-1.0",
    "libc6",
    "libcom-err2",
    "libcrypt1",
    "libdb5.3",
    "libexpat1",
    "libffi8",
    "libgcc-s1",
    "libgssapi-krb5-2",
    "libk5crypto3",
    "libkeyutils1",
    "libkrb5-3",
    "libkrb5support0",
    "liblzma5",
    "libncursesw6",
    "libnsl2",
    "libpython3-stdlib",
    "libpython3.11-minimal",
    "libpython3.11-stdlib",
    "libreadline8",
    "libsqlite3-0",
    "libssl3",
    "libstdc++6",
    "libtinfo6",
    "libtirpc3",
    "libuuid1",
    "media-types",
    "python3-minimal",
    "python3-pip-whl",
    "python3-setuptools-whl",
    "python3.11-minimal",
    "python3.11-venv",
    "python3.11",
    "python3",
    "zlib1g",
]
ARCH_ALL = {"media-types", "python3-pip-whl", "python3-setuptools-whl"}  # the others are arm64 packages

# torch's cpuinfo reads /proc/cpuinfo at import and crashes on qemu's (the host's x86 one);
# qemu's -L prefix redirects the open to SYSROOT/proc/cpuinfo, an aarch64 CPU's.
CPUINFO = """processor\t: {n}
BogoMIPS\t: 50.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc \
dcpop sha3 asimddp sha512 sve asimdfhm uscat ilrcpc flagm ssbs sb dcpodp sve2 i8mm bf16 svebf16
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x1
CPU part\t: 0xd40
CPU revision\t: 1
"""

# PyPI's aarch64 torch is a CUDA build: libtorch_cuda.so needs these at load time. Empty
# stand-ins with the sonames and symbol versions the loader checks are enough (no CUDA
# code runs); cudaGetDeviceCount reports no device.
CUDA_LIBS = [
    "libcudart.so.13",
    "libcusparse.so.12",
    "libcufft.so.12",
    "libcufile.so.0",
    "libcusparseLt.so.0",
    "libnccl.so.2",
    "libcurand.so.10",
    "libcublas.so.13",
    "libcublasLt.so.13",
    "libcudnn.so.9",
    "libnvrtc.so.13",
    "libcupti.so.13",
    "libnvshmem_host.so.3",
    "libcusolver.so.12",
]


def run(cmd, **kw):
    print("+", " ".join(cmd) if isinstance(cmd, list) else cmd, flush=True)
    return subprocess.run(cmd, check=True, **kw)


def need_toolchain():
    if all(shutil.which(t) for t in (CC, CXX, QEMU)):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        sys.exit(f"tools/arm.py: {CC}, {CXX} and {QEMU} are needed: apt-get install {' '.join(APT)}")
    run(["apt-get", "update", "-qq"])
    run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *APT])


def c_objects(out):
    """setup.py's aarch64 C units with its flags (the same list a native build compiles)."""
    os.makedirs(out, exist_ok=True)
    objs = []
    for unit, flags in C_UNITS_BY_ARCH["aarch64"].items():
        src = os.path.join(ROOT, "csrc", *unit.split("/"))
        obj = os.path.join(out, object_name(src))
        run([CC, *C_FLAGS, "-Werror", *flags, "-c", src, "-o", obj])
        objs.append(obj)
    return objs


def qemu(cpu, exe, *args, env=None, **kw):
    return subprocess.run([QEMU, "-L", "/usr/aarch64-linux-gnu", "-cpu", cpu, exe, *args], env=env, **kw)


def cmd_harness(_):
    need_toolchain()
    out = os.path.join(ARM, "harness")
    objs = c_objects(out)
    att = [o for o in objs if "attention_" in o or "common_" in o]
    ce = [o for o in objs if "cross_entropy_" in o or "common_" in o]
    tc = os.path.join(ROOT, "tests", "c")
    exes = {}
    for name, src, o in (("test_blocks", "test_blocks.c", att), ("test_ce_blocks", "test_ce_blocks.c", ce)):
        exes[name] = os.path.join(out, name)
        run([CC, *C_FLAGS, "-I" + tc, os.path.join(tc, src), *o, "-lm", "-o", exes[name]])
    exes["kernel_bwd"] = os.path.join(out, "kernel_bwd")
    kb = os.path.join(ROOT, "benchmarks", "kernel_bwd.c")
    run([CC, *C_FLAGS, "-D_POSIX_C_SOURCE=200809L", kb, *att, "-lm", "-lpthread", "-o", exes["kernel_bwd"]])
    failed = []
    # the blocks each harness prints: sve's per length; svebf16 has only its product (in 2
    # parts), and cross-entropy no svebf16 blocks (its svebf16 calls run NEON's)
    sve_blocks = [f"sve{b}" for b in SVE_BITS]
    printed = {"test_blocks": ["neon", *sve_blocks, "svebf16_2"], "test_ce_blocks": ["neon", *sve_blocks]}
    length_bits = collections.defaultdict(dict)  # (variant, dtype): output bits per SVE length
    for label, cpu, bits in CPUS:
        variants = ["neon", "sve", "svebf16"] if bits else ["neon"]
        for name in ("test_blocks", "test_ce_blocks"):
            t0 = time.time()
            r = qemu(cpu, exes[name], capture_output=True, text=True)
            # the CPU's blocks pass; the others are refused (ma_isa_available, ma_sve_bits), not run
            runs = {"scalar", "neon", f"sve{bits}", "svebf16_2"} if bits else {"scalar", "neon"}
            ok = r.returncode == 0 and all(
                f"{b:<7} {'ok' if b in runs else 'not supported'}" in r.stdout for b in ["scalar", *printed[name]]
            )
            print(f"{label:<28} {name:<15} {'ok' if ok else 'FAILED'} ({time.time() - t0:.0f} s)")
            if not ok:
                failed.append((label, name, r.stdout + r.stderr))
        for v in variants:  # the forward and the single-pass backward against the scalar kernels
            for dt in ("f32", "bf16"):  # bfloat16: the tile products of svebf16 (float32 runs NEON's)
                r = qemu(cpu, exes["kernel_bwd"], "4", "2", "70", "64", "1", v, dt, capture_output=True, text=True)
                ok = r.returncode == 0 and "from the scalar reference" in r.stdout
                if bits and v != "neon" and (v, dt) != ("svebf16", "f32"):  # svebf16's float32 is NEON's
                    m = re.search(r"output bits (\w+)", r.stdout)
                    length_bits[v, dt][bits] = m.group(1) if m else None
                print(f"{label:<28} kernel_bwd {v:<7} {dt:<4} {'ok' if ok else 'FAILED'}")
                if not ok:
                    failed.append((label, f"kernel_bwd {v} {dt}", r.stdout + r.stderr))
    # each SVE variant gives the same bits at every length (sve: each lane's FMAs in one order)
    for (v, dt), by_length in length_bits.items():
        got = set(by_length.values())
        ok = len(by_length) == len(SVE_BITS) and None not in got and len(got) == 1
        print(f"{v + ' ' + dt + ' at every SVE length':<28} same bits       {'ok' if ok else 'FAILED'}")
        if not ok:
            failed.append((v, f"{dt}: the same bits at every SVE length", str(by_length)))
    r = qemu(NO_BF16_CPU, exes["kernel_bwd"], "1", "1", "8", "8", "1", "svebf16", capture_output=True, text=True)
    ok = r.returncode == 2 and "not on this CPU" in r.stderr
    print(f"{NO_BF16_CPU + ' (SVE, no BF16)':<28} svebf16 refused  {'ok' if ok else 'FAILED'}")
    if not ok:
        failed.append((NO_BF16_CPU, "svebf16 refused", r.stdout + r.stderr))
    for label, name, text in failed:
        print(f"---- {label}: {name}\n{text}")
    sys.exit(1 if failed else 0)


def cmd_setup(_):
    need_toolchain()
    os.makedirs(ARM, exist_ok=True)
    if not os.path.exists(os.path.join(SYSROOT, "usr", "bin", "python3.11")):
        debs = os.path.join(ARM, "debs")
        os.makedirs(debs, exist_ok=True)
        if not glob.glob(os.path.join(debs, "python3.11-minimal_*_arm64.deb")):
            # the arm64 architecture only while downloading: installing arm64 python3 would
            # replace the machine's own
            run(["dpkg", "--add-architecture", "arm64"])
            try:
                run(["apt-get", "update", "-qq"])
                names = [d if d in ARCH_ALL else d + ":arm64" for d in PYTHON_DEBS]
                run(["apt-get", "download", "-qq", *names], cwd=debs)
            finally:
                run(["dpkg", "--remove-architecture", "arm64"])
                run(["apt-get", "update", "-qq"])
        for deb in sorted(glob.glob(os.path.join(debs, "*.deb"))):
            run(["dpkg", "-x", deb, SYSROOT])
    os.makedirs(os.path.join(SYSROOT, "proc"), exist_ok=True)
    with open(os.path.join(SYSROOT, "proc", "cpuinfo"), "w") as f:
        f.write("\n".join(CPUINFO.format(n=i) for i in range(2)))
    if not os.path.exists(os.path.join(SITE, "torch", "__init__.py")):
        pip = [sys.executable, "-m", "pip"]
        plat = ["--platform", "manylinux_2_28_aarch64", "--only-binary=:all:", "--python-version", "3.11"]
        plat += ["--implementation", "cp"]
        wheels = os.path.join(ARM, "wheels")
        whl = glob.glob(os.path.join(wheels, f"torch-{TORCH}-*aarch64.whl"))
        if not whl:
            run([*pip, "download", "-q", f"torch=={TORCH}", *plat, "--no-deps", "-d", wheels])
            whl = glob.glob(os.path.join(wheels, f"torch-{TORCH}-*aarch64.whl"))
        run([*pip, "install", "-q", "--target", SITE, *plat, "--no-deps", whl[0]])
        deps = ["filelock", "typing-extensions", "sympy", "networkx", "jinja2", "fsspec", "MarkupSafe", "mpmath"]
        run([*pip, "install", "-q", "--target", SITE, *plat, *deps, "pytest", "numpy"])
    make_cuda_stubs()


# torch's cpuinfo (in libc10.so) fails to initialise under qemu-user 7.2 (its Linux processor
# detection finds no valid processor there), and fbgemm's float16 conversions then raise
# "Failed to initialize cpuinfo!". Preloaded into the emulated Python, this runs cpuinfo's own
# initialisation and reports success; nothing else changes.
CPUINFO_OK = r"""/* generated: tools/arm.py */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdbool.h>
bool cpuinfo_initialize(void) {
    bool (*real)(void) = (bool (*)(void))dlsym(RTLD_NEXT, "cpuinfo_initialize");
    if (real) (void)real();
    return true;
}
"""


def make_cuda_stubs():
    os.makedirs(STUBS, exist_ok=True)
    src = os.path.join(STUBS, "cpuinfo_ok.c")
    with open(src, "w") as f:
        f.write(CPUINFO_OK)
    run([CC, "-shared", "-fPIC", "-O2", src, "-o", os.path.join(STUBS, "libcpuinfo_ok.so"), "-ldl"])
    if os.path.exists(os.path.join(STUBS, CUDA_LIBS[0])):
        return
    lib = os.path.join(SITE, "torch", "lib")
    und, defined = [], set()
    for so in glob.glob(os.path.join(lib, "*.so*")):
        out = subprocess.run(["aarch64-linux-gnu-objdump", "-T", so], capture_output=True, text=True).stdout
        for line in out.splitlines():
            w = line.split()
            if len(w) < 4 or not w[-2].startswith("(") and "*UND*" not in line:
                continue
            if "*UND*" in line:
                und.append((w[-2].strip("()"), w[-1]))
            elif ".text" in line or ".data" in line or ".bss" in line:
                defined.add(w[-1])
    per = collections.defaultdict(set)
    for ver, sym in und:
        if ver in CUDA_LIBS:
            per[ver].add((ver, sym))
        elif ver == "NVSHMEM":
            per["libnvshmem_host.so.3"].add((ver, sym))
        elif ver == "Base" and sym not in defined and not sym.startswith(("Py", "_Py", "_Z", "_ITM", "__")):
            per["libcudart.so.13"].add((None, sym))
    for name in CUDA_LIBS:
        code, versions = ["/* generated: an empty stand-in (tools/arm.py) */"], collections.defaultdict(list)
        for ver, sym in sorted(per.get(name, ()), key=lambda t: t[1]):
            if sym == "cudaGetDeviceCount":
                code.append("int cudaGetDeviceCount(int *n) { if (n) *n = 0; return 100; }")
            elif "ErrorString" in sym or "ErrorName" in sym:
                code.append(f'const char *{sym}(int e) {{ (void)e; return "CUDA stub"; }}')
            else:
                code.append(f"long {sym}(void) {{ return 100; }}")
            versions[ver or name].append(sym)
        if name not in versions:
            versions[name] = []
        base = os.path.join(STUBS, name.replace(".", "_"))
        with open(base + ".c", "w") as f:
            f.write("\n".join(code) + "\n")
        with open(base + ".map", "w") as f:
            f.write(
                "".join(
                    f"{v} {{\n" + ("  global:\n" + "".join(f"    {s};\n" for s in syms) if syms else "") + "};\n"
                    for v, syms in versions.items()
                )
            )
        run(
            [
                CC,
                "-shared",
                "-fPIC",
                "-O0",
                "-w",
                base + ".c",
                "-o",
                os.path.join(STUBS, name),
                "-Wl,-soname," + name,
                "-Wl,--version-script=" + base + ".map",
            ]
        )


def cmd_build(_):
    need_toolchain()
    tdir = os.path.join(SITE, "torch")
    if not os.path.isdir(tdir):
        sys.exit("tools/arm.py build: run `tools/arm.py setup` first (the aarch64 torch to link against)")
    out = os.path.join(ARM, "build")
    objs = c_objects(out)
    inc = os.path.join(tdir, "include")
    cxx = [
        "-O2",
        "-std=c++17",
        "-fPIC",
        "-Wall",
        "-DTORCH_TARGET_VERSION=0x020a000000000000",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        "-DPy_LIMITED_API=0x030A0000",
        "-DTORCH_EXTENSION_NAME=_C",
        "-I" + os.path.join(ROOT, "csrc"),
        "-I" + inc,
        "-I" + os.path.join(inc, "torch", "csrc", "api", "include"),
        *SHIM_FLAGS,
    ]
    for src in SHIM_SOURCES:
        obj = os.path.join(out, "shim_" + os.path.basename(src)[:-4] + ".o")
        run([CXX, *cxx, "-c", os.path.join(ROOT, src), "-o", obj])
        objs.append(obj)
    shutil.rmtree(PKG, ignore_errors=True)
    shutil.copytree(
        os.path.join(ROOT, "torch_masked_attn"),
        os.path.join(PKG, "torch_masked_attn"),
        ignore=shutil.ignore_patterns("*.so", "__pycache__"),
    )
    so = os.path.join(PKG, "torch_masked_attn", "_C.abi3.so")
    run([CXX, "-shared", *objs, "-L" + os.path.join(tdir, "lib"), "-lc10", "-ltorch", "-ltorch_cpu", "-o", so])
    shutil.copy(os.path.join(ROOT, "pyproject.toml"), PKG)  # __version__ reads it in a checkout
    print(subprocess.run(["file", so], capture_output=True, text=True).stdout.strip())


def emulated_env(cpu="max,sve-default-vector-length=32"):
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join([PKG, ROOT, SITE]),
        LD_LIBRARY_PATH=STUBS,
        QEMU_LD_PREFIX=SYSROOT,
        QEMU_CPU=cpu,
        QEMU_SET_ENV="LD_PRELOAD=" + os.path.join(STUBS, "libcpuinfo_ok.so"),
        PYTHONDONTWRITEBYTECODE="1",
    )
    return env


def cmd_pytest(ns):
    if not os.path.exists(os.path.join(PKG, "torch_masked_attn", "_C.abi3.so")):
        sys.exit("tools/arm.py pytest: run `tools/arm.py setup` and `tools/arm.py build` first")
    # the tests' paths from the checkout (pytest runs in PKG, so that `import torch_masked_attn`
    # finds the aarch64 package first)
    tests = [os.path.join(ROOT, a) if a.startswith("tests") else a for a in (ns.args or ARM_SLICE)]
    py = [QEMU, os.path.join(SYSROOT, "usr", "bin", "python3.11")]
    # PKG first: the aarch64 package, not the checkout's x86 one (ROOT is on the path for tests/)
    code = "import sys, pytest; sys.exit(pytest.main(sys.argv[1:]))"
    r = subprocess.run(
        # the emulated Python has torch, pytest and numpy: the optional groups are left out by name
        [*py, "-c", code, "-q", "-p", "no:cacheprovider", "--without", "hf", "--without", "emulate", "--rootdir", ROOT]
        + tests,
        cwd=PKG,
        env=emulated_env(f"max,sve-default-vector-length={ns.sve_bits // 8}"),
    )
    sys.exit(r.returncode)


def cmd_wheel(ns):
    so = os.path.join(PKG, "torch_masked_attn", "_C.abi3.so")
    if not os.path.exists(so):
        sys.exit("tools/arm.py wheel: run `tools/arm.py setup` and `tools/arm.py build` first")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        proj = tomllib.load(f)["project"]
    name, version = proj["name"], proj["version"]
    tag = "cp310-abi3-linux_aarch64"  # auditwheel repair sets the manylinux tag
    dist = ns.out
    os.makedirs(dist, exist_ok=True)
    path = os.path.join(dist, f"{name}-{version}-{tag}.whl")
    info = f"{name}-{version}.dist-info"
    files = {}
    for f in sorted(glob.glob(os.path.join(PKG, "torch_masked_attn", "**", "*"), recursive=True)):
        if os.path.isfile(f) and "__pycache__" not in f:
            with open(f, "rb") as fh:
                files[os.path.relpath(f, PKG)] = fh.read()
    with open(os.path.join(ROOT, "README.md"), "rb") as fh:
        readme = fh.read().decode()
    meta = [
        "Metadata-Version: 2.1",
        f"Name: {name}",
        f"Version: {version}",
        f"Summary: {proj['description']}",
        f"Requires-Python: {proj['requires-python']}",
        *[f"Requires-Dist: {d}" for d in proj["dependencies"]],
        "Description-Content-Type: text/markdown",
        "",
        readme,
    ]
    files[f"{info}/METADATA"] = "\n".join(meta).encode()
    files[f"{info}/WHEEL"] = (
        f"Wheel-Version: 1.0\nGenerator: tools/arm.py\nRoot-Is-Purelib: false\nTag: {tag}\n".encode()
    )
    record = []
    for n, data in files.items():
        h = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{n},sha256={h},{len(data)}")
    record.append(f"{info}/RECORD,,")
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for n, data in files.items():
            z.writestr(n, data)
    print(path)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("harness", "setup", "build"):
        sub.add_parser(name)
    wh = sub.add_parser("wheel")
    wh.add_argument("--out", default=os.path.join(ROOT, "dist"), help="the folder for the wheel (default dist/)")
    pt = sub.add_parser("pytest")
    pt.add_argument("--sve-bits", type=int, choices=SVE_BITS, default=256, help="the emulated SVE length")
    pt.add_argument("args", nargs=argparse.REMAINDER)
    ns = p.parse_args()
    {"harness": cmd_harness, "setup": cmd_setup, "build": cmd_build, "pytest": cmd_pytest, "wheel": cmd_wheel}[ns.cmd](
        ns
    )


if __name__ == "__main__":
    main()
