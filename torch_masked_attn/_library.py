"""Loads the compiled library (torch.ops.masked_attn's schemas and kernels) and
reaches the C functions the ops do not cover through ctypes: the instruction-set
variant and its kernels' constants, the decode plan, the kernels' scratch memory,
and knobs for tests and benchmarks. The library is plain C past the registration shim (masked_attn.h),
so these calls pass no tensors but the huge-page hint's pointer."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import math
import os
from collections.abc import Iterator

import torch
from torch import Tensor

_here = os.path.dirname(os.path.abspath(__file__))
_libs = sorted(glob.glob(os.path.join(_here, "_C*.so")))
if not _libs:
    raise ImportError(
        "torch_masked_attn._C is not built; run `make setup` or "
        "`pip install --no-build-isolation -e .` in the repository"
    )
torch.ops.load_library(_libs[0])

# ---- the instruction-set variant ---------------------------------------------
#
# csrc/common/isa.c owns the policy: the CPU's best variant for the dtype,
# unless MASKED_ATTN_ISA (read once, at the first op call) or use_isa forces
# one. use_isa reaches the C function directly (the library is plain C there).

_clib = ctypes.CDLL(_libs[0])
_clib.ma_isa_name.argtypes = _clib.ma_dtype_name.argtypes = _clib.ma_isa_built.argtypes = [ctypes.c_int]
_clib.ma_isa_name.restype = _clib.ma_dtype_name.restype = ctypes.c_char_p
_clib.ma_isa_built.restype = ctypes.c_int


def _enum_names(name_of) -> tuple[str, ...]:
    """An enum's names in its order, as the C library writes them (common/isa.c)."""
    names: list[str] = []
    while (n := name_of(len(names))) is not None:
        names.append(n.decode())
    return tuple(names)


_ISAS = _enum_names(_clib.ma_isa_name)  # ma_isa's (masked_attn.h)
_DTYPES = _enum_names(_clib.ma_dtype_name)  # ma_dtype's: torch's names
_clib.ma_isa_force.argtypes = [ctypes.c_int]
_clib.ma_isa_force.restype = ctypes.c_int
_clib.ma_isa_forced.restype = ctypes.c_int


_clib.ma_attn_bwd_key_group_force.argtypes = [ctypes.c_int64]
_clib.ma_attn_bwd_key_group_force.restype = ctypes.c_int64


@contextlib.contextmanager
def bwd_key_group(n: int | None) -> Iterator[None]:
    """Inside the block, the single-pass backward takes its key blocks ``n`` at
    a time (None: the shape rule, ma_attn_bwd_key_group), process-wide; the
    previous setting is restored after. The gradients are the same bits for
    every n (tests/project/test_isa.py checks it); a knob for tests and benchmarks."""
    old = _clib.ma_attn_bwd_key_group_force(0 if n is None else int(n))
    try:
        yield
    finally:
        _clib.ma_attn_bwd_key_group_force(old)


_clib.ma_attn_bwd_cpus_force.argtypes = [ctypes.c_int64]
_clib.ma_attn_bwd_cpus_force.restype = ctypes.c_int64


@contextlib.contextmanager
def bwd_cpus(n: int | None) -> Iterator[None]:
    """Inside the block, the single-pass backward sizes its key chunks as if
    the process could run on ``n`` CPUs (None: the machine's count,
    ma_attn_bwd_kv_chunks), process-wide; the previous setting is restored
    after. dk and dv are the same bits for every n, dq only for the same
    chunk count; a knob for tests and benchmarks."""
    old = _clib.ma_attn_bwd_cpus_force(0 if n is None else int(n))
    try:
        yield
    finally:
        _clib.ma_attn_bwd_cpus_force(old)


_clib.ma_attn_decode_splits_force.argtypes = [ctypes.c_int64]
_clib.ma_attn_decode_splits_force.restype = ctypes.c_int64


@contextlib.contextmanager
def decode_splits(n: int | None) -> Iterator[None]:
    """Inside the block, the decode kernel splits each sequence's key chunks
    between ``n`` work items (None: the plan's rule, ma_attn_decode_shape;
    at most one chunk an item), process-wide; the previous setting is
    restored after. Outputs are the same bits for every n (tests check it);
    a knob for tests and benchmarks. The CPU count the rule assumes is
    bwd_cpus's."""
    old = _clib.ma_attn_decode_splits_force(0 if n is None else int(n))
    try:
        yield
    finally:
        _clib.ma_attn_decode_splits_force(old)


_DECODE_SHAPE = ("slab_heads", "slabs", "chunks", "splits", "items", "item_chunks")


class _DecodeShape(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in _DECODE_SHAPE]


_clib.ma_attn_decode_shape.argtypes = [ctypes.c_int64] * 7 + [ctypes.POINTER(_DecodeShape)]
_clib.ma_attn_decode_shape.restype = ctypes.c_int


def decode_plan(B: int, H: int, Hkv: int, Lq: int, Lk: int, cpus: int, kv_heads: int = 1) -> dict[str, int]:
    """The decode kernel's schedule for a call of these sizes on a machine of
    ``cpus`` CPUs (ma_attn_decode_shape; ``kv_heads``: the key heads an item
    takes together, more than 1 where the cache holds a token's heads side by
    side): query heads per slab, slabs per key head, key chunks (masked_attn.h,
    MA_DECODE_CHUNK keys each), splits per sequence, work items, and the chunks
    of the longest item."""
    s = _DecodeShape()
    if _clib.ma_attn_decode_shape(B, H, Hkv, kv_heads, Lq, Lk, cpus, ctypes.byref(s)) != 0:
        raise ValueError(f"decode_plan: no decode schedule for B={B}, H={H}, Hkv={Hkv}, Lq={Lq}, Lk={Lk}")
    return {name: getattr(s, name) for name in _DECODE_SHAPE}


_clib.ma_release_memory.restype = ctypes.c_size_t
_clib.ma_scratch_idle_bytes.restype = ctypes.c_size_t
_clib.ma_scratch_last_bytes.restype = ctypes.c_size_t
_clib.ma_advise_huge_pages.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_clib.ma_advise_huge_pages.restype = None


def release_memory() -> int:
    """Return the kernels' cached scratch memory to the OS; returns the bytes freed.

    The kernels keep the scratch blocks of their parallel regions between
    calls (a few, at most 1 GB), so that a call touches no fresh pages; this
    frees them (the next call allocates again). Process exit frees them too."""
    return int(_clib.ma_release_memory())


def empty_on_huge_pages(*shape: int, dtype: torch.dtype) -> Tensor:
    """An uninitialised CPU tensor whose 2 MB-aligned part Linux is asked to back with
    transparent huge pages (madvise, before the first touch; a hint, nothing elsewhere):
    what the kernels stream (an 8-bit cache) reads about 12% faster than from 4 KB pages."""
    t = torch.empty(*shape, dtype=dtype)
    if t.numel():
        _clib.ma_advise_huge_pages(t.data_ptr(), t.numel() * t.element_size())
    return t


def scratch_stats() -> dict[str, int]:
    """{"idle_bytes": kept between calls now, "last_call_bytes": the last parallel region's scratch}."""
    return {"idle_bytes": int(_clib.ma_scratch_idle_bytes()), "last_call_bytes": int(_clib.ma_scratch_last_bytes())}


@functools.cache
def built_isas() -> tuple[str, ...]:
    """The kernel variants this build has (this architecture's: on x86 scalar, avx2, avx512,
    amx, avx512bf16; on aarch64 scalar, neon, sve, svebf16), whether or not this CPU runs
    them (isa_available). Fixed for the library's life: read once."""
    return tuple(n for i, n in enumerate(_ISAS) if _clib.ma_isa_built(i))


def isa_available(name: str) -> bool:
    """Whether this CPU runs the kernel variant ``name`` (a name MASKED_ATTN_ISA takes)."""
    if name not in _ISAS:
        raise ValueError(f"isa must be one of {', '.join(_ISAS)}, got {name!r}")
    return bool(_clib.ma_isa_available(_ISAS.index(name)))


_clib.ma_isa_for.argtypes = [ctypes.c_int]
_clib.ma_isa_for.restype = ctypes.c_int
# the dtypes q may have, as ma_dtype
_MA_DTYPE = {getattr(torch, n): _DTYPES.index(n) for n in ("float32", "float64", "bfloat16", "float16")}


def isa_for(dtype: torch.dtype) -> str:
    """The kernel variant an attention call in ``dtype`` gets now: the forced
    one (MASKED_ATTN_ISA, use_isa), else the CPU's best for the dtype. float64
    names it too, though its kernels are always the scalar double ones."""
    if dtype not in _MA_DTYPE:
        raise ValueError(f"dtype must be one of {', '.join(map(str, _MA_DTYPE))}, got {dtype}")
    return _ISAS[_clib.ma_isa_for(_MA_DTYPE[dtype])]


_TRAITS = ("block_q", "block_k", "decode_qrows", "decode_rows", "decode_chunk", "decode_kv_heads")


class _Traits(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in _TRAITS]


_clib.ma_attn_traits.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(_Traits)]
_clib.ma_attn_traits.restype = ctypes.c_int


def kernel_traits(dtype: torch.dtype = torch.float32, isa: str | None = None) -> dict[str, int]:
    """The constants of the attention kernels that a call in ``dtype`` runs with the variant
    ``isa`` (None: the one such a call gets now, isa_for), as the library states them
    (ma_attn_traits, from csrc/masked_attn.h's table of variants): the tile, block_q query rows
    by block_k keys (a paged cache whose page size is a multiple of block_k is read in place),
    and the decode kernel's constants (decode_qrows: the query rows it takes at most; decode_rows,
    decode_chunk, decode_kv_heads: masked_attn.h's MA_DECODE_*)."""
    name = isa_for(dtype) if isa is None else isa
    if dtype not in _MA_DTYPE:
        raise ValueError(f"dtype must be one of {', '.join(map(str, _MA_DTYPE))}, got {dtype}")
    if name not in built_isas():
        raise ValueError(f"isa must be one of {', '.join(built_isas())} (this build's), got {name!r}")
    return dict(_traits(_MA_DTYPE[dtype], _ISAS.index(name)))


@functools.cache
def _traits(dtype: int, isa: int) -> tuple[tuple[str, int], ...]:
    """kernel_traits' constants of (ma_dtype, ma_isa), read from the library once (they are
    compiled in; varlen_attn asks for them on every paged call)."""
    t = _Traits()
    if _clib.ma_attn_traits(dtype, isa, ctypes.byref(t)) != 0:
        raise ValueError(f"kernel_traits: no kernels for {_DTYPES[dtype]} and {_ISAS[isa]!r}")
    return tuple((n, getattr(t, n)) for n in _TRAITS)


def page_multiple() -> int:
    """The page sizes of a paged KV cache that every variant of this build reads in place, in
    every dtype: the multiples of this (each one's block_k divides it; kernel_traits)."""
    sizes = (kernel_traits(dt, isa)["block_k"] for isa in built_isas() for dt in _MA_DTYPE)
    return math.lcm(*sizes)


@contextlib.contextmanager
def use_isa(name: str | None) -> Iterator[None]:
    """Run the kernels with variant ``name`` inside the block (None: the CPU's
    best), for the whole process; the previous choice is restored after.
    Raises ValueError for an unknown name or one this CPU lacks."""
    if name is not None and not isa_available(name):
        raise ValueError(f"use_isa: this CPU does not support the {name!r} kernels")
    old = _clib.ma_isa_forced()
    _clib.ma_isa_force(-1 if name is None else _ISAS.index(name))
    try:
        yield
    finally:
        _clib.ma_isa_force(old)
