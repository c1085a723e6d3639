"""Runs the attention kernels of an instruction-set variant this CPU lacks
(avx512, avx512bf16) on an emulated CPU, and checks them against the scalar
reference and float64: forward (out, lse) and single-pass backward (dq, dk,
dv), bfloat16 (or float32) inputs, every mask kind the C interface takes; and
forwards over the 8-bit cache (the decode's integer scores among them).

    python tools/emulate/run.py [--isa avx512bf16,avx512] [--dtype bf16|f32] [--quick] [--fuzz N [--seed S]]
    python tools/emulate/run.py --count B,H,L,D [--isa ...]     (instructions executed, by class)

The emulator is Bochs's CPU, through bochscpu-python (PyPI): it has AVX-512
F/BW/DQ/VL but not AVX512-BF16, so the avx512bf16 build replaces the two
AVX512-BF16 intrinsics the kernels use with AVX-512 code of the same
semantics (tools/emulate/emu_bf16.h); everything else (packing, blocking,
edges, the template's loops) runs as compiled. tools/emulate/harness.c is
the C side: no C library, one thread, params filled as the shim fills them.

`make test` runs a slice (tests/project/test_emulated_isa.py); `make emulate` more.
bochscpu is a test dependency (make setup installs it), not the package's,
and its wheel needs glibc 2.38's C23 symbols (this script supplies them
with a small preloaded library where the system lacks them). Exit status 1
when any case exceeds its tolerance.
"""

import argparse
import collections
import os
import re
import struct
import subprocess
import sys
import tempfile
import zlib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.join(ROOT, "tools", "emulate")
sys.path.insert(0, ROOT)
sys.path.insert(1, os.path.join(ROOT, "tests"))  # reference.py: the 8-bit cache's float64 reference

_C23_SHIM = r"""
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
unsigned long long __isoc23_strtoull(const char *s, char **e, int b) { return strtoull(s, e, b); }
int __isoc23_sscanf(const char *s, const char *f, ...) {
    va_list a; va_start(a, f); int r = vsscanf(s, f, a); va_end(a); return r;
}
"""


def import_bochscpu():
    try:
        import bochscpu  # noqa: F401
        import bochscpu.cpu  # noqa: F401
        import bochscpu.memory  # noqa: F401

        return sys.modules["bochscpu"]
    except ImportError as e:
        if "__isoc23" not in str(e) or os.environ.get("MA_EMU_PRELOADED"):
            raise SystemExit(f"bochscpu-python is needed (pip install bochscpu-python): {e}") from e
    # an older glibc: supply the two C23 functions the wheel links against, and start again
    d = tempfile.mkdtemp(prefix="ma_emu_")
    src, lib = os.path.join(d, "c23.c"), os.path.join(d, "libc23.so")
    with open(src, "w") as f:
        f.write(_C23_SHIM)
    subprocess.run(["cc", "-shared", "-fPIC", "-O2", src, "-o", lib], check=True)
    env = dict(os.environ, LD_PRELOAD=lib, MA_EMU_PRELOADED="1")
    os.execve(sys.executable, [sys.executable] + sys.argv, env)


# ---- the build ------------------------------------------------------------------


def build(out_dir, count=False):
    """harness.elf: the harness, every attention instance and dispatch.c,
    linked statically with no C library; returns its path. count: the two
    AVX512-BF16 intrinsics as one stand-in instruction each (emu_bf16.h),
    for instruction counts, not results."""
    from setup import isa_flags

    cc = os.environ.get("CC", "cc")
    # the kernels as the build compiles them (builtins on: small memcpy inlined); the harness and
    # its libm freestanding, so that their loops never become calls of themselves
    flags = [
        "-std=c11",
        "-O3" if count else "-O2",
        "-fno-math-errno",
        "-fno-pic",
        "-fno-pie",
        "-fno-stack-protector",
        "-fno-asynchronous-unwind-tables",
        "-fno-tree-loop-distribute-patterns",
        "-I",
        os.path.join(ROOT, "csrc"),
    ]
    free = ["-ffreestanding"]
    jobs = []
    # the instances run here; avx2 and amx stand in as empty tables (harness.c, EMU_STUBS)
    for rel in ("attention/scalar.c", "attention/avx512.c", "attention/avx512bf16.c", "attention/dispatch.c"):
        path = os.path.join(ROOT, "csrc", rel)
        extra = isa_flags(path)
        if rel == "attention/avx512bf16.c":  # AVX512-BF16 emulated with AVX-512 (emu_bf16.h); VNNI's absent
            extra = [f for f in extra if f not in ("-mavx512bf16", "-mavx512vnni")]
            extra += ["-include", os.path.join(HERE, "emu_bf16.h")]
            extra += ["-DMA_EMU_COUNT"] if count else []
        jobs.append(([*flags, *extra], path, os.path.join(out_dir, rel.replace("/", "_") + ".o")))
    for name in ("harness.c", "libm.c"):
        jobs.append(([*flags, *free, "-DEMU_STUBS"], os.path.join(HERE, name), os.path.join(out_dir, name + ".o")))
    procs = [subprocess.Popen([cc, *f, "-c", src, "-o", obj], stderr=subprocess.PIPE) for f, src, obj in jobs]
    for p, (_, src, _) in zip(procs, jobs):  # all at once: the compiles take most of a short run
        err = p.communicate()[1]
        if p.returncode:
            raise SystemExit(f"compiling {src} failed:\n{err.decode(errors='replace')}")
    objs = [obj for _, _, obj in jobs]
    elf = os.path.join(out_dir, "harness.elf")
    subprocess.run([cc, "-static", "-nostdlib", "-no-pie", "-Wl,-e,emu_main", "-o", elf, *objs, "-lgcc"], check=True)
    return elf


def elf_segments(path):
    """(vaddr, bytes, memsz) of each PT_LOAD segment, and the symbol table's emu_main, emu_halt."""
    data = open(path, "rb").read()
    (phoff,) = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    segs = []
    for i in range(phnum):
        ptype, _, off, vaddr, _, filesz, memsz, _ = struct.unpack_from("<IIQQQQQQ", data, phoff + i * phentsize)
        if ptype == 1:
            segs.append((vaddr, data[off : off + filesz], memsz))
    syms = {}
    for line in subprocess.run(["nm", path], capture_output=True, text=True, check=True).stdout.splitlines():
        parts = line.split()
        if len(parts) == 3:
            syms[parts[2]] = int(parts[0], 16)
    return segs, syms


# ---- the emulated machine ----------------------------------------------------------

PAGE = 4096
STACK, STACK_BYTES = 0x0F000000, 1 << 20
DATA = 0x10000000


class Machine:
    """Long mode, identity-mapped pages: the harness's segments, a stack and a data region."""

    def __init__(self, bochscpu, elf, data_bytes):
        self.b = bochscpu
        mem = bochscpu.memory
        segs, self.syms = elf_segments(elf)
        self.pt = mem.PageMapLevel4Table()
        mapped = set()

        def map_range(lo, hi):
            for page in range(lo // PAGE * PAGE, hi, PAGE):
                if page not in mapped:
                    mem.page_insert(page, mem.allocate_host_page())
                    self.pt.insert(page, page, 1)
                    mapped.add(page)

        for vaddr, _, memsz in segs:
            map_range(vaddr, vaddr + memsz)
        map_range(STACK, STACK + STACK_BYTES)
        map_range(DATA, DATA + data_bytes)
        self.cr3 = 0x100000
        for hva, gpa in self.pt.commit(self.cr3):
            mem.page_insert(gpa, hva)
        for vaddr, blob, memsz in segs:
            self.write(vaddr, blob + bytes(memsz - len(blob)))
        self.data_bytes = data_bytes

    def write(self, addr, blob):
        assert self.b.memory.virt_write(self.cr3, addr, list(blob))

    def read(self, addr, n):
        return bytes(self.b.memory.virt_read(self.cr3, addr, n))

    def call(self, fn, arg, count=False):
        """fn(arg) on the emulated CPU until it returns (to emu_halt); with count, how many
        times it executed the instruction at each address, {rip: n} (slow: a Python call per
        instruction), else None."""
        b = self.b
        sess = b.Session()

        def missing(gpa):
            raise RuntimeError(f"the harness touched unmapped memory at {gpa:#x}")

        sess.missing_page_handler = missing
        st = b.State()
        b.cpu.set_long_mode(st)
        st.cr3 = self.cr3
        st.cr4 = st.cr4 | (1 << 9) | (1 << 10) | (1 << 18)  # OSFXSR, OSXMMEXCPT, OSXSAVE
        st.xcr0 = 0xE7  # x87, SSE, AVX, opmask, ZMM_Hi256, Hi16_ZMM
        st.mxcsr = 0x1F80
        top = STACK + STACK_BYTES - 72  # the return address; rsp + 8 16-aligned at entry (System V)
        self.write(top, struct.pack("<Q", self.syms["emu_halt"]))
        st.rsp, st.rip, st.rdi = top, fn, arg
        cs = b.Segment()
        cs.present, cs.selector, cs.base, cs.limit, cs.attr = True, 0x33, 0, 0xFFFFFFFF, 0x22FB
        ds = b.Segment()
        ds.present, ds.selector, ds.base, ds.limit, ds.attr = True, 0x2B, 0, 0xFFFFFFFF, 0xCF3
        st.cs, st.ds, st.ss, st.es, st.fs, st.gs = cs, ds, ds, ds, ds, ds
        sess.cpu.state = st
        fault = []
        hook = b.Hook()

        def exception(s, cpu_id, vector, error_code):
            fault.append((vector, error_code, s.cpu.state.rip))
            s.stop()

        hook.exception = exception
        executed = collections.Counter()
        if count:

            def before(s, cpu_id, insn):
                executed[s.cpu.rip] += 1

            hook.before_execution = before
        sess.run([hook])
        if fault and fault[0][0] == 13 and fault[0][2] - self.syms["emu_halt"] in (0, 1):
            if count:  # returned: HLT at user privilege faults (#GP), ending the run
                if executed[fault[0][2]] > 0:
                    executed[fault[0][2]] -= 1  # (the HLT itself)
                return executed
            return None
        if fault:
            vector, code, rip = fault[0]
            name = {v: k for k, v in self.syms.items()}
            near = max((a for a in name if a <= rip), default=0)
            raise RuntimeError(f"CPU exception {vector} (code {code}) at {rip:#x}, in {name.get(near)}")
        raise RuntimeError(f"stopped at {sess.cpu.state.rip:#x}, not at emu_halt")


# ---- the cases ---------------------------------------------------------------------

IO = struct.Struct("<12q2d16Q2q2Qq")
ISA = {"scalar": 0, "avx2": 1, "avx512": 2, "amx": 3, "avx512bf16": 4}
DTYPE = {"f32": 1, "bf16": 3}

# (name, B, H, Hkv, Lq, Lk, D, Dv, options): L off the 64-blocks, D off 16 and 32
CASES = [
    ("plain", 2, 4, 4, 130, 130, 64, 64, {}),
    ("causal", 1, 8, 8, 200, 200, 64, 64, dict(causal=True)),
    ("causal+kpm gqa", 2, 8, 2, 97, 150, 48, 40, dict(causal=True, kpm=True)),
    ("float mask + head mask", 2, 4, 4, 70, 90, 80, 24, dict(attn_mask=True, head_mask=True)),
    ("window", 1, 8, 4, 190, 190, 32, 32, dict(window=(50, 0))),
    ("window both sides", 2, 4, 4, 130, 130, 16, 16, dict(window=(40, 30))),
    ("softcap causal", 2, 4, 4, 140, 140, 128, 128, dict(causal=True, softcap=20.0)),
    ("tails", 8, 1, 1, 33, 17, 3, 5, {}),
    ("key chunks", 1, 2, 1, 150, 300, 64, 64, dict(causal=False)),  # B * Hkv < 8: partial dq sums
    # packed sequences (varlen): each entry's items on its own params, the tile hooks moved to it
    ("varlen causal", 3, 1, 1, 130, 130, 64, 64, dict(causal=True, varlen=True)),
    ("varlen softcap", 2, 1, 1, 70, 70, 32, 16, dict(softcap=5.0, varlen=True)),
    # a forward with no backward to follow (no out_lo, as the shim calls it under no_grad): the
    # bfloat16 tile products take P in one part
    ("inference causal", 1, 8, 8, 200, 200, 64, 64, dict(causal=True, inference=True)),
    ("inference masks gqa", 2, 8, 2, 97, 150, 48, 40, dict(kpm=True, attn_mask=True, inference=True)),
    # the 8-bit cache (inference only): decode rows take their scores in integers (q rounded to
    # int16), D off every vector's step; more query rows than a decode's take the tiles
    ("int8 decode gqa", 2, 8, 2, 3, 150, 80, 64, dict(causal=True, int8=True)),
    ("int8 decode mha", 1, 4, 4, 1, 200, 128, 128, dict(kpm=True, int8=True)),
    ("int8 tiles", 1, 4, 2, 40, 90, 64, 64, dict(causal=True, int8=True)),
]
QUICK = (
    "plain",
    "causal+kpm gqa",
    "float mask + head mask",
    "window both sides",
    "softcap causal",
    "inference masks gqa",
    "varlen causal",
    "int8 decode gqa",
)


def random_cases(n, seed):
    """n random cases (the fuzz slice): shapes off every block and vector width, any mix of masks."""
    import random

    rng = random.Random(seed)
    out = []
    for i in range(n):
        Hkv = rng.choice([1, 2, 4])
        H = Hkv * rng.choice([1, 2, 4])
        B = rng.randint(1, 3)
        Lq, Lk = rng.randint(1, 200), rng.randint(1, 200)
        D, Dv = rng.choice([1, 8, 13, 16, 32, 48, 64, 80, 128]), rng.choice([1, 5, 16, 24, 64, 128])
        o = {}
        if rng.random() < 0.5:
            o["causal"] = True
        if rng.random() < 0.4:
            o["kpm"] = True
        if rng.random() < 0.3:
            o["attn_mask"] = True
        if rng.random() < 0.3:
            o["head_mask"] = True
        if rng.random() < 0.25 and not o.get("causal"):
            o["window"] = (rng.choice([None, rng.randint(0, 100)]), rng.choice([None, rng.randint(0, 100)]))
        if rng.random() < 0.25:
            o["softcap"] = rng.choice([5.0, 30.0])
        if rng.random() < 0.3:
            o["inference"] = True
        out.append(
            (f"fuzz {seed}:{i} B={B} H={H}/{Hkv} L={Lq}x{Lk} D={D}/{Dv} {sorted(o)}", B, H, Hkv, Lq, Lk, D, Dv, o)
        )
    return out


# run.py --count's classes of instructions, by mnemonic (objdump). In the count build the
# VDPBF16PS stand-in is VFMADDSUB231PS (emu_bf16.h), which nothing else uses.
MIX = (
    ("VDPBF16PS", ("vfmaddsub",)),
    ("FMA", ("vfmadd", "vfmsub", "vfnmadd", "vfnmsub")),
    ("other vector", ("v",)),
    ("scalar", ("",)),
)


def instruction_mix(elf, counts):
    """{class: instructions executed} of a count ({rip: n}), by MIX."""
    ops = {}
    dump = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", elf], capture_output=True, text=True, check=True
    ).stdout
    for line in dump.splitlines():
        m = re.match(r"\s*([0-9a-f]+):\s+(\S+)", line)
        if m:
            ops[int(m.group(1), 16)] = m.group(2)
    mix = collections.Counter()
    for rip, n in counts.items():
        op = ops.get(rip, "")
        mix[next(name for name, prefixes in MIX if op.startswith(prefixes))] += n
    return mix


def count_case(m, isa, dtype, case, torch):
    """Instructions the emulated CPU executes for the case's forward with no backward to follow
    (inference), its forward before a backward (training), and forward + backward."""
    name, B, H, Hkv, Lq, Lk, D, Dv, o = case
    return [
        run_case(m, m.syms, isa, dtype, (name, B, H, Hkv, Lq, Lk, D, Dv, dict(o, **extra)), torch, None, count=True)
        for extra in (dict(inference=True), dict(forward_only=True), {})
    ]


def run_case(m, elf_syms, isa, dtype, case, torch, tma, count=False):
    name, B, H, Hkv, Lq, Lk, D, Dv, o = case
    tdt = {"bf16": torch.bfloat16, "f32": torch.float32}[dtype]
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    q = torch.randn(B, H, Lq, D, generator=g).to(tdt)
    k = torch.randn(B, Hkv, Lk, D, generator=g).to(tdt)
    v = torch.randn(B, Hkv, Lk, Dv, generator=g).to(tdt)
    dout = torch.randn(B, H, Lq, Dv, generator=g).to(tdt)
    kpm = attn_mask = head_mask = None
    if o.get("kpm"):
        kpm = torch.zeros(B, Lk, dtype=torch.bool)
        kpm[0, Lk - Lk // 3 :] = True
        kpm[-1, 5:9] = True
    if o.get("attn_mask"):
        attn_mask = torch.randn(Lq, Lk, generator=g).to(tdt)
        attn_mask[min(3, Lq - 1), :] = float("-inf")  # a fully masked row
    if o.get("head_mask"):
        head_mask = torch.rand(H, generator=g).to(tdt)
    window = o.get("window")
    softcap = o.get("softcap")
    causal = bool(o.get("causal"))
    scale = 1.0 / D**0.5
    int8 = bool(o.get("int8"))
    if int8:  # the 8-bit cache, quantized natively (quantize_kv: bit for bit every variant's)
        (k8, k_scale), (v8, v_scale) = tma.functional.quantize_kv(k), tma.functional.quantize_kv(v)

    # the emulated run
    esz = q.element_size()
    layout, cursor = {}, DATA

    def put(key, nbytes, blob=None):
        """An input (blob), or an output filled with NaN bytes, so that a value the kernel does not
        write shows."""
        nonlocal cursor
        layout[key] = cursor
        m.write(cursor, blob if blob is not None else b"\xff" * nbytes)
        cursor += (nbytes + 63) // 64 * 64

    raw = (
        (lambda t: t.contiguous().view(torch.int16).numpy().tobytes())
        if esz == 2
        else (lambda t: t.contiguous().numpy().tobytes())
    )
    put("io", IO.size)
    for key, t in (("q", q), ("k", k), ("v", v), ("dout", dout)):
        if int8 and key in "kv":
            put(key, t.numel(), (k8 if key == "k" else v8).numpy().tobytes())
            put(key + "_scale", t.numel() // t.shape[-1] * 4, (k_scale if key == "k" else v_scale).numpy().tobytes())
        else:
            put(key, t.numel() * esz, raw(t))
    if kpm is not None:
        put("kpm", kpm.numel(), kpm.to(torch.uint8).numpy().tobytes())
    if attn_mask is not None:
        put("attn_mask", attn_mask.numel() * 4, attn_mask.float().numpy().tobytes())
    if head_mask is not None:
        put("head_mask", head_mask.numel() * 4, head_mask.float().numpy().tobytes())
    shapes = {
        "out": (B, H, Lq, Dv),
        "out_lo": (B, H, Lq, Dv),
        "dq": (B, H, Lq, D),
        "dk": (B, Hkv, Lk, D),
        "dv": (B, Hkv, Lk, Dv),
    }
    for key, shp in shapes.items():
        put(
            key,
            B * H * Lq * max(D, Dv) * esz
            if key in ("out", "out_lo", "dq")
            else shp[0] * shp[1] * shp[2] * shp[3] * esz,
        )
    put("lse", B * H * Lq * 4)
    put("delta", B * H * Lq * 4)
    arena = cursor
    arena_bytes = DATA + m.data_bytes - arena
    wl, wr = window if window else (-1, -1)
    fields = [
        B,
        H,
        Hkv,
        Lq,
        Lk,
        D,
        Dv,
        DTYPE[dtype],
        ISA[isa],
        int(causal),
        wl if wl is not None else -1,
        wr if wr is not None else -1,
        scale,
        softcap or 0.0,
    ]
    fields += [layout[x] for x in ("q", "k", "v", "dout")]
    fields += [layout.get(x, 0) for x in ("kpm", "attn_mask", "head_mask")]
    infer = bool(o.get("inference")) or int8  # out_lo: bf16 / f16 only, and not for inference, as the shim
    fields += [layout["out"], layout["out_lo"] if esz == 2 and not infer else 0]
    fields += [layout[x] for x in ("lse", "dq", "dk", "dv", "delta")]
    fields += [arena, arena_bytes, int(bool(o.get("forward_only")) or infer), int(bool(o.get("varlen")))]
    fields += [layout.get("k_scale", 0), layout.get("v_scale", 0), -1]
    m.write(layout["io"], IO.pack(*fields))
    executed = m.call(elf_syms["emu_main"], layout["io"], count=count)
    status = IO.unpack(m.read(layout["io"], IO.size))[-1]
    if status != 0:
        raise RuntimeError(f"{name}: harness status {status}")
    if count:
        return executed

    def get(key, shp, dt=tdt):
        n = 1
        for s in shp:
            n *= s
        blob = m.read(layout[key], n * (2 if dt == torch.bfloat16 else 4))
        if dt == torch.bfloat16:
            return torch.frombuffer(bytearray(blob), dtype=torch.int16).view(torch.bfloat16).reshape(shp).clone()
        return torch.frombuffer(bytearray(blob), dtype=dt).reshape(shp).clone()

    got = {key: get(key, shapes[key]) for key in ("out", "dq", "dk", "dv")}
    got["lse"] = get("lse", (B, H, Lq), torch.float32)

    # the scalar reference, through the package, natively
    kw = dict(
        attn_mask=attn_mask,
        key_padding_mask=kpm,
        head_mask=head_mask,
        is_causal=causal,
        scale=scale,
        window=window,
        softcap=softcap,
    )

    def fwd_bwd(dt):
        qq, kk, vv = (t.to(dt).detach().requires_grad_() for t in (q, k, v))
        kw2 = dict(kw)
        for key in ("attn_mask", "head_mask"):
            if kw2[key] is not None:
                kw2[key] = kw2[key].to(dt)
        out, lse = tma.functional.masked_attention(qq, kk, vv, return_lse=True, **kw2)
        grads = torch.autograd.grad(out, (qq, kk, vv), dout.to(dt))
        return {"out": out, "lse": lse, "dq": grads[0], "dk": grads[1], "dv": grads[2]}

    if int8:  # the scalar kernels over the same cache; float64 over its values, q as its scores read it
        from reference import attention64, q_int16

        with tma.ops.use_isa("scalar"), torch.no_grad():
            out, lse = tma.functional.masked_attention(
                q, k8, v8, k_scale=k_scale, v_scale=v_scale, return_lse=True, **kw
            )
        ref = {"out": out, "lse": lse}
        kd, vd = (x.double() * sc.double()[..., None] for x, sc in ((k8, k_scale), (v8, v_scale)))
        out, _, lse = attention64(
            q_int16(q, scale) if Lq <= 16 else q, kd, vd, return_weights=True, return_lse=True, **kw
        )
        exact = {"out": out, "lse": lse}
    else:
        with tma.ops.use_isa("scalar"):
            ref = fwd_bwd(tdt)
        exact = fwd_bwd(torch.float64)
    native = None
    if head_mask is None and softcap is None and dtype == "bf16" and not int8:  # what F.sdpa can express
        i, j = torch.arange(Lq)[:, None], torch.arange(Lk)[None, :]
        allowed = torch.ones(B, 1, Lq, Lk, dtype=torch.bool)
        if causal:
            allowed &= j <= i
        if window:
            if window[0] is not None:
                allowed &= j >= i - window[0]
            if window[1] is not None:
                allowed &= j <= i + window[1]
        if kpm is not None:
            allowed &= ~kpm[:, None, None, :]
        bias = torch.zeros(B, 1, Lq, Lk).masked_fill(~allowed, float("-inf"))
        if attn_mask is not None:
            bias = bias + attn_mask.float()
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(
            qq, kk, vv, attn_mask=bias.to(tdt), scale=scale, enable_gqa=Hkv != H
        )
        grads = torch.autograd.grad(out, (qq, kk, vv), dout)
        native = {"out": out, "dq": grads[0], "dk": grads[1], "dv": grads[2]}
    rows = []
    ok = True
    for key in ("out", "lse") if infer else ("out", "lse", "dq", "dk", "dv"):
        a, r, x = got[key].double(), ref[key].double(), exact[key].double()
        finite = torch.isfinite(x)
        if not torch.equal(torch.isfinite(a), finite):
            ok = False
            rows.append((key, float("nan"), float("nan"), float("nan"), float("nan")))
            continue
        scale_x = x[finite].abs().max().item() if finite.any() else 1.0
        d_ref = (a - r)[finite].abs().max().item() if finite.any() else 0.0
        e_got = (a - x)[finite].abs().max().item() if finite.any() else 0.0
        e_ref = (r - x)[finite].abs().max().item() if finite.any() else 0.0
        # bfloat16: within 2x the scalar reference's own error against float64 (plus a
        # rounding step of the largest value); float32: close to the reference
        tol = 2 * e_ref + (2**-8 if dtype == "bf16" else 2e-5) * max(scale_x, 1.0)
        if key == "lse":
            tol = 1e-3 if dtype == "bf16" else 2e-5
        e_nat = float("nan")
        if native is not None and key in native:  # the contract's rule: at most 2x native's own error
            n = native[key].double()
            both = finite & torch.isfinite(n)
            e_nat = (n - x)[both].abs().max().item() if both.any() else 0.0
            if not e_got <= 2 * e_nat + 1e-6:
                ok = False
        if not e_got <= tol:
            ok = False
        rows.append((key, d_ref, e_got, e_ref, e_nat))
    return ok, rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--isa", default="avx512bf16", help="avx512bf16, avx512 (or scalar), or several separated by commas"
    )
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "f32"])
    ap.add_argument("--quick", action="store_true", help="eight of the fixed cases only")
    ap.add_argument("--fuzz", type=int, default=0, metavar="N", help="N random cases after the fixed ones")
    ap.add_argument("--seed", type=int, default=0, help="of the random cases")
    ap.add_argument(
        "--count",
        metavar="B,H,L,D",
        help="instead: count the instructions a causal forward "
        "(inference, and before a backward) and backward of this shape execute, per ISA, by class "
        "(VDPBF16PS, FMA, other vector, scalar; a Python call per instruction: slow)",
    )
    args = ap.parse_args()
    isas = args.isa.split(",")
    for isa in isas:
        if isa not in ("avx512bf16", "avx512", "scalar"):
            ap.error(f"--isa: {isa!r} is not one of avx512bf16, avx512, scalar")
    bochscpu = import_bochscpu()
    import torch

    import torch_masked_attn as tma

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="ma_emu_build_") as d:
        elf = build(d, count=bool(args.count))
        m = Machine(bochscpu, elf, 48 << 20)
        if args.count:
            B, H, L, D = (int(x) for x in args.count.split(","))
            for isa in isas:
                infer, fwd, both = count_case(
                    m, isa, args.dtype, ("count", B, H, H, L, L, D, D, dict(causal=True)), torch
                )
                print(f"{isa} {args.dtype} B={B} H={H} L={L} D={D} causal:")
                mixes = [instruction_mix(elf, c) for c in (infer, fwd, both)]
                mixes[2] = {name: mixes[2][name] - mixes[1][name] for name, _ in MIX}  # the backward alone
                for what, mix in zip(("forward (inference)", "forward (training)", "backward"), mixes):
                    print(
                        f"  {what:20s} {sum(mix.values()):>12,} instructions: "
                        + ", ".join(f"{name} {mix[name]:,}" for name, _ in MIX),
                        flush=True,
                    )
            return
        failed = 0
        cases = [c for c in CASES if not args.quick or c[0] in QUICK] + random_cases(args.fuzz, args.seed)
        for isa, case in ((isa, case) for isa in isas for case in cases):
            ok, rows = run_case(m, m.syms, isa, args.dtype, case, torch, tma)
            failed += not ok
            print(
                f"{'ok  ' if ok else 'FAIL'} {isa} {args.dtype} {case[0]:24s} "
                + "  ".join(
                    f"{k}: |got-scalar| {a:.1e} |got-f64| {b:.1e} |scalar-f64| {c:.1e} |native-f64| {e:.1e}"
                    for k, a, b, c, e in rows
                ),
                flush=True,
            )
    print(f"{failed} of the cases failed" if failed else "every case passed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
