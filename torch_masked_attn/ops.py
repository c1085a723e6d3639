"""torch.ops.masked_attn: load the compiled library, register fake (meta)
kernels and autograd for every op.

The ops themselves are defined in csrc/shim/ (schemas: registration.cpp;
every attention schema ends with the same options, declared once in
options.cpp: window_left=-1, window_right=-1, softcap?, sinks?, alibi_slopes?):

    masked_attn::forward(q, k, v, attn_mask?, key_padding_mask?, head_mask?,
                         is_causal, scale?, need_weights, dropout_p=0., dropout_seed?,
                         for_backward=True, k_scale?, v_scale?, <options>)
        -> (out, lse, weights, out_lo)
    masked_attn::backward(grad_out, grad_weights?, q, k, v, out, lse, attn_mask?,
                          key_padding_mask?, head_mask?, is_causal, scale?,
                          head_mask_grad, mask_grad, dropout_p=0., dropout_seed?,
                          out_lo?, <options>)
        -> (grad_q, grad_k, grad_v, grad_head_mask, grad_scores, grad_sinks)

out_lo (bfloat16 / float16 only; empty otherwise) is out's rounding error in
the same dtype and layout: out + out_lo is the float32 output to 16 (bf16) or
22 (fp16) bits. The backward takes delta_i = grad_out_i . (out_i + out_lo_i)
(exact whatever scaled the output before it was rounded: a head mask,
dropout, a sink); without out_lo, grad_out . out (every FlashAttention's).
for_backward=False says that no backward will follow (the wrappers pass
grad_wanted()): out_lo is then empty, and bfloat16's tile products (AMX,
AVX512-BF16) round P to bfloat16 in P V, as native's flash kernel does
(docs/design.md, section 6); a backward from such a forward takes
grad_out . out.

dropout_seed is an int64 tensor (seed, offset) of shape (2,), required when
dropout_p > 0: the keep mask is a function of it and of the element's
(b, h, i, j) (Philox-4x32-10, csrc/attention/philox.h), so the op draws
nothing and the backward, given the same seed, regenerates the same mask.
new_dropout_seed() draws one from PyTorch's default generator.

window_left / window_right: query i sees keys j in [i - left, i + right]
(-1: that side unbounded), top-left aligned like is_causal. softcap: scores
s -> softcap * tanh(s / softcap) before the masks are added. sinks (H,): one
logit per head in every row's softmax denominator (no value); lse includes
it. The options are built and checked once per call (AttnOptions) and passed
by their schema names (OpArgs).

grad_scores (B, H, Lq, Lk) is dL/dS, the gradient of the additive masks, and
is materialised only when mask_grad (a floating mask requires grad); it is in
the accumulation type (float32, float64 for float64), rounded to the mask's
dtype after the caller's sums. grad_head_mask (head_mask_grad) and grad_sinks
(with sinks: -sum_{b,i} exp(sink_h - lse) delta_i, delta_i the backward's
grad_out_i . (out_i + out_lo_i) (+ the weights' term)) come reduced to the
head mask's and the sinks' shapes and dtypes; empty where not asked for.

Conventions are nn.MultiheadAttention's: a bool mask is True where attention
is blocked; a floating mask is added to the scaled scores.

How gradients are registered
----------------------------
One mechanism for the ops: an Autograd kernel made by register_autograd
below, at the end of each op's section (masked_attn::forward ->
_forward_backward, masked_attn::cross_entropy -> _cross_entropy_backward).
It is torch.library.register_autograd's own wrapper (an autograd.Function
that redispatches below autograd and calls setup_context with every argument,
defaults filled in), with one difference: torch's fills the defaults in by
reading schema.arguments, which builds a new list of Argument objects, once
per argument, on every call: for masked_attn::forward's 15 arguments (16
now) about 67 us a call (torch 2.13, Zen 3), more than the op itself takes on a small
model's layer. Here the defaults are read once, at registration. The other ops
(backward, backward_into, cross_entropy_backward(_), cross_entropy_chunk_)
are building blocks of backwards and have no gradient of their own.

Four torch.autograd.Function subclasses remain, each for a reason the op-level
registration cannot express (a one-line comment at each points back here):

* ops.py, _FirstOrderOnly: not a gradient formula but a guard. It wraps the
  gradients our backward kernels return, so that differentiating them again
  (double backward after create_graph=True) raises instead of silently giving
  zero. It needs a node of its own in the recorded backward graph.
* modules.py, _PackedSelfAttention: self-attention on one fused qkv
  projection; its backward has the kernel write dq, dk, dv straight into one
  qkv-shaped buffer (masked_attn::backward_into). Through the op, the three
  gradients would go back through the q, k, v views of qkv: zero-filled
  buffers and copies.
* modules.py, _RecomputedSelfAttention: in-projection, attention and
  out-projection as one node, so that the forward need not save qkv (3
  activations per token) and the backward recomputes it. An op-level
  backward only sees the attention, not the projections around it.
* linear_ce.py, _LinearCrossEntropy: linear layer + cross-entropy without the
  (N, V) logits. Its chunking depends on the data (the rows kept by
  ignore_index) and, for 'mean' / 'sum', it computes the gradients in the
  forward and the backward only scales them: Python-level control flow over
  the ops, not one op with a backward.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import NamedTuple

import torch
from torch import Tensor

from . import _validate

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
    every n (tests/test_isa.py checks it); a knob for tests and benchmarks."""
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


def built_isas() -> tuple[str, ...]:
    """The kernel variants this build has (this architecture's: on x86 scalar, avx2, avx512,
    amx, avx512bf16; on aarch64 scalar, neon, sve, svebf16), whether or not this CPU runs
    them (isa_available)."""
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


def new_dropout_seed() -> Tensor:
    """(seed, offset), an int64 tensor of shape (2,) drawn from PyTorch's
    default CPU generator: torch.manual_seed reproduces it, successive calls
    differ, get_rng_state / set_rng_state replay it."""
    return torch.randint(-(2**63), 2**63 - 1, (2,), dtype=torch.int64)


def call_op(op, *args):
    """``op(*args)``; when no argument needs a gradient, past the autograd
    layer: the op's registered autograd (a Python function) would only
    redispatch, and costs a few microseconds that a decoding step or a small
    model pays on every call. Under torch.compile the plain call, which
    dynamo traces."""
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and torch._C._any_requires_grad(*args)):
        return op(*args)
    with torch._C._AutoDispatchBelowAutograd():
        return op(*args)


class OpArgs:
    """The arguments of one op, by the names of its schema (read once): the
    positional arguments of a call from names (the schema's defaults for the
    rest), a call's arguments read back by name, and per-input gradients laid
    out in the schema's order. Nothing here counts positions."""

    def __init__(self, op) -> None:
        self.op = op
        self.names = tuple(a.name for a in op._schema.arguments)
        self.defaults = tuple(a.default_value for a in op._schema.arguments)
        self._known = frozenset(self.names)

    def __call__(self, **named) -> tuple:
        """The positional arguments of a call that passes ``named``."""
        if not self._known.issuperset(named):
            raise TypeError(f"{self.op}: no argument {sorted(set(named) - self._known)}")
        return tuple(named[n] if n in named else d for n, d in zip(self.names, self.defaults))

    def read(self, args: Sequence[object], kwargs: dict | None = None) -> SimpleNamespace:
        """A call's arguments (positional, then keyword, then defaults) by name."""
        vals = dict(zip(self.names, self.defaults))
        vals.update(zip(self.names, args))
        if kwargs:
            vals.update(kwargs)
        return SimpleNamespace(**vals)

    def grads(self, named: dict[str, Tensor | None]) -> tuple[Tensor | None, ...]:
        """One gradient per argument, in the schema's order (None where not named)."""
        return tuple(named.get(n) for n in self.names)

    def tensors(self, a: SimpleNamespace) -> dict[str, Tensor]:
        """The call's tensor arguments, by name."""
        return {n: t for n, t in vars(a).items() if isinstance(t, Tensor)}


def register_autograd(name: str, backward, setup_context) -> None:
    """torch.library.register_autograd for masked_attn::<name>, with the op's
    defaults read once (see "How gradients are registered" above): an Autograd
    kernel, given the dispatch key set, that runs an autograd.Function when an
    input needs a gradient and otherwise redispatches below autograd.
    setup_context(ctx, args, output) gets every argument by name (OpArgs.read;
    the dispatcher drops trailing ones equal to their defaults); backward sees
    ctx.needs, whether each of the op's inputs needs a gradient by name, and
    returns a dict of gradients by argument name."""
    op = getattr(torch.ops.masked_attn, name).default
    schema = OpArgs(op)
    below_autograd = torch._C._after_autograd_keyset

    def redispatch(keyset, args):
        with torch._C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset & below_autograd, *args)

    def forward(ctx, *args):  # args: the op's, then the key set
        out = redispatch(args[-1], args[:-1])
        setup_context(ctx, schema.read(args[:-1]), out)
        return out

    def backward_(ctx, *grads):
        ctx.needs = dict(zip(schema.names, ctx.needs_input_grad))
        return (*schema.grads(backward(ctx, *grads)), None)

    function = type(
        f"masked_attn_{name}",
        (torch.autograd.Function,),
        {"forward": staticmethod(forward), "backward": staticmethod(backward_)},
    )

    def kernel(keyset, *args):
        if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
            return function.apply(*args, keyset)
        return redispatch(keyset, args)

    _autograd_lib.impl(name, kernel, "Autograd", with_keyset=True)


_autograd_lib = torch.library.Library("masked_attn", "IMPL")  # kept for the registrations' lifetime


def _has_out_lo(dtype):
    """Whether the forward ops return out's rounding error out_lo (see above)."""
    return dtype in (torch.bfloat16, torch.float16)


def saved_out_lo(out_lo: Tensor) -> Tensor | None:
    """What a backward keeps of the forward's out_lo (in q's dtype): the tensor
    in bfloat16 / float16, None for float32 / float64 or a forward called with
    for_backward=False (an empty placeholder)."""
    return out_lo if _has_out_lo(out_lo.dtype) and out_lo.numel() > 0 else None


def grad_wanted(*tensors: Tensor | None) -> bool:
    """The forward ops' for_backward: whether a backward may follow this call
    (grad mode on and a tensor argument requiring grad)."""
    return torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in tensors)


def _lse_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---- the options of an attention call ------------------------------------------


@dataclass(frozen=True)
class AttnOptions:
    """The options of one attention call, the masks aside: built and checked
    once per call (AttnOptions.check), then handed to the op by name
    (op_args) and read back by name by its autograd (from_op). The checks
    here are those whose exception the Python functions promise (their type
    and message); the ranges are the shim's (csrc/shim/options.cpp), which
    checks every call of the raw ops too.

    window: (left, right), -1 a side without bound; softcap > 0 or None;
    sinks (H,) floating or None; dropout_p in [0, 1] with dropout_seed (an
    int64 (seed, offset) tensor) when > 0; alibi_slopes (H,) or (B, H)
    float32 or None (flash-attn's: score += -slope * |i + Lk - Lq - j| after
    the scaling and the soft-cap)."""

    is_causal: bool = False
    window: tuple[int, int] = (-1, -1)
    softcap: float | None = None
    sinks: Tensor | None = None
    dropout_p: float = 0.0
    dropout_seed: Tensor | None = None
    alibi_slopes: Tensor | None = None

    @classmethod
    def check(
        cls,
        fn: str,
        q: Tensor,
        *,
        is_causal: bool = False,
        window: object = None,
        softcap: float | None = None,
        sinks: Tensor | None = None,
        dropout_p: float = 0.0,
        dropout_seed: object = None,
        window_size: Iterable[int] | None = None,
        alibi_slopes: object = None,
    ) -> AttnOptions:
        """The options of a call of ``fn`` on queries ``q`` (B, H, L, D),
        checked. ``window`` is masked_attention's (left, right) with None
        sides; ``window_size`` varlen_attn's, whose softcap and sinks only the
        shim checks (varlen_attn raises its RuntimeError)."""
        dropout_p = _validate.dropout_p(fn, dropout_p)
        seed = _dropout_seed(fn, dropout_p, dropout_seed)
        if alibi_slopes is not None and not isinstance(alibi_slopes, Tensor):  # its shape and dtype: the shim's
            raise TypeError(
                f"{fn}: alibi_slopes must be None or a float32 Tensor (H,) or (B, H), got {type(alibi_slopes).__name__}"
            )
        if window_size is not None:  # varlen_attn: torch's window_size; the shim checks the rest (RuntimeError)
            softcap = None if softcap is None else float(softcap)
            return cls(False, _validate.window_size(fn, window_size), softcap, sinks, alibi_slopes=alibi_slopes)
        win, softcap = _validate.window(fn, window), _validate.softcap(fn, softcap)
        _validate.sinks(fn, q, sinks)
        return cls(bool(is_causal), win, softcap, sinks, dropout_p, seed, alibi_slopes)

    @classmethod
    def from_op(cls, a: SimpleNamespace) -> AttnOptions:
        """The options of an op call's arguments (OpArgs.read); an op without
        one (varlen: is_causal, dropout) leaves its default."""
        return cls(
            bool(getattr(a, "is_causal", False)),
            (a.window_left, a.window_right),
            a.softcap,
            a.sinks,
            float(getattr(a, "dropout_p", 0.0)),
            getattr(a, "dropout_seed", None),
            a.alibi_slopes,
        )

    @property
    def plain(self) -> bool:
        """No window, soft-cap, sinks, dropout or ALiBi."""
        return (
            self.window == (-1, -1)
            and self.softcap is None
            and self.sinks is None
            and not self.dropout_p
            and self.alibi_slopes is None
        )

    def op_args(self) -> dict[str, object]:
        """The options as the attention ops' schemas name them (their shared
        tail: csrc/shim/options.cpp); those at their default are left out
        (varlen's schema lacks some)."""
        named: dict[str, object] = {"window_left": self.window[0], "window_right": self.window[1]}
        if self.softcap is not None:
            named["softcap"] = self.softcap
        if self.sinks is not None:
            named["sinks"] = self.sinks
        if self.is_causal:
            named["is_causal"] = True
        if self.dropout_p:
            named["dropout_p"] = self.dropout_p
            named["dropout_seed"] = self.dropout_seed
        if self.alibi_slopes is not None:
            named["alibi_slopes"] = self.alibi_slopes
        return named


def _dropout_seed(fn: str, dropout_p: float, seed: object) -> Tensor | None:
    """The seed (None: drawn later) when dropout_p > 0, else None."""
    if dropout_p == 0.0 or seed is None:
        return None
    if not isinstance(seed, Tensor):
        raise TypeError(
            f"{fn}: dropout_seed must be None or an int64 tensor (seed, offset) of shape (2,), "
            f"got {type(seed).__name__}"
        )
    if seed.dtype != torch.int64 or tuple(seed.shape) != (2,) or seed.device.type != "cpu":
        raise ValueError(
            f"{fn}: dropout_seed must be an int64 CPU tensor (seed, offset) of shape (2,), got "
            f"{seed.dtype} {tuple(seed.shape)} on {seed.device}"
        )
    return seed


# ---- fake kernels: shapes and dtypes only --------------------------------
#
# They also run for real when any argument is a meta tensor (the dispatcher
# picks Meta over CPU), so they check what the CPU kernels rely on first: one
# device for every tensor. Each reads the call's arguments by name (OpArgs).


def _same_device(op: str, a: SimpleNamespace | None = None, **tensors: Tensor | None) -> None:
    """All the tensors of a call (a, read by OpArgs, or the keyword arguments) on one device."""
    first_name, first = None, None
    for name, t in (vars(a) if a is not None else tensors).items():
        if not isinstance(t, Tensor):
            continue
        if first is None:
            first_name, first = name, t
        elif t.device != first.device:
            raise RuntimeError(
                f"masked_attn.{op}: expected all tensors on one device, got {first_name} "
                f"on {first.device} and {name} on {t.device}"
            )


FORWARD = OpArgs(torch.ops.masked_attn.forward.default)
BACKWARD = OpArgs(torch.ops.masked_attn.backward.default)
BACKWARD_INTO = OpArgs(torch.ops.masked_attn.backward_into.default)
VARLEN_FORWARD = OpArgs(torch.ops.masked_attn.varlen_forward.default)
VARLEN_BACKWARD = OpArgs(torch.ops.masked_attn.varlen_backward.default)


def _blhd(like: Tensor, B: int, H: int, L: int, D: int) -> Tensor:
    """A (B, H, L, D) tensor stored as (B, L, H, D), as the shim allocates them (shim/attention.cpp)."""
    return like.new_empty(B, L, H, D).transpose(1, 2)


@torch.library.register_fake("masked_attn::forward")
def _forward_fake(*args, **kwargs):
    a = FORWARD.read(args, kwargs)
    _same_device("forward", a)
    q, k, v = a.q, a.k, a.v
    torch._check(q.dim() == 4 and k.dim() == 4 and v.dim() == 4, lambda: "masked_attn: q, k, v must be 4-D")
    B, H, Lq, _ = q.shape
    Lk, Dv = k.shape[2], v.shape[3]
    out = _blhd(q, B, H, Lq, Dv)
    lse = q.new_empty(B, H, Lq, dtype=_lse_dtype(q.dtype))
    weights = q.new_empty(B, H, Lq, Lk) if a.need_weights else q.new_empty(0)
    out_lo = _blhd(q, B, H, Lq, Dv) if _has_out_lo(q.dtype) and a.for_backward else q.new_empty(0)
    return out, lse, weights, out_lo


def _options_grads_fake(a: SimpleNamespace, like: Tensor) -> tuple[Tensor, Tensor]:
    """(grad_head_mask, grad_sinks) of a backward call: reduced to the head
    mask's and the sinks' shapes and dtypes, empty (acc type) without them."""
    acc = _lse_dtype(like.dtype)
    hm, sinks = getattr(a, "head_mask", None), a.sinks
    want = getattr(a, "head_mask_grad", False) and hm is not None
    grad_hm = hm.new_empty(hm.shape) if want and hm is not None else like.new_empty(0, dtype=acc)
    return grad_hm, (sinks.new_empty(sinks.shape) if sinks is not None else like.new_empty(0, dtype=acc))


def _backward_fake_grads(a: SimpleNamespace) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_head_mask, grad_scores, grad_sinks) of a backward call."""
    q = a.q
    B, H, Lq = q.shape[:3]
    acc = _lse_dtype(q.dtype)
    grad_hm, grad_sinks = _options_grads_fake(a, q)
    grad_scores = q.new_empty(B, H, Lq, a.k.shape[2], dtype=acc) if a.mask_grad else q.new_empty(0, dtype=acc)
    return grad_hm, grad_scores, grad_sinks


@torch.library.register_fake("masked_attn::backward_into")
def _backward_into_fake(*args, **kwargs):
    a = BACKWARD_INTO.read(args, kwargs)
    _same_device("backward_into", a)
    return _backward_fake_grads(a)


@torch.library.register_fake("masked_attn::backward")
def _backward_fake(*args, **kwargs):
    a = BACKWARD.read(args, kwargs)
    _same_device("backward", a)
    q, k, v = a.q, a.k, a.v
    grads = tuple(_blhd(q, t.shape[0], t.shape[1], t.shape[2], t.shape[3]) for t in (q, k, v))
    return (*grads, *_backward_fake_grads(a))


# ---- autograd ------------------------------------------------------------


class AttnSaved(NamedTuple):
    """What attention_backward reads of a forward, by name (a NamedTuple:
    torch.compile traces its construction inside autograd.Functions)."""

    q: Tensor
    k: Tensor
    v: Tensor
    out: Tensor
    lse: Tensor
    attn_mask: Tensor | None = None
    key_padding_mask: Tensor | None = None
    head_mask: Tensor | None = None
    out_lo: Tensor | None = None


def _save(ctx, **tensors: Tensor | None) -> None:
    """ctx.save_for_backward by name: ctx.saved() gives them back as a namespace."""
    ctx.save_for_backward(*tensors.values())
    ctx.saved_names = tuple(tensors)


def saved(ctx) -> SimpleNamespace:
    """What _save kept, by name (unpacked once: activation checkpointing
    unpacks each saved tensor only once)."""
    return SimpleNamespace(**dict(zip(ctx.saved_names, ctx.saved_tensors)))


def _no_grad_with_int8_kv(fn: str, a: SimpleNamespace) -> None:
    if getattr(a, "k_scale", None) is not None:
        raise RuntimeError(
            f"{fn}: an 8-bit KV cache (k_scale, v_scale) is inference only (no backward); "
            "call it under torch.no_grad() or on tensors that do not require grad"
        )


def _forward_setup_context(ctx, a, output):
    _no_grad_with_int8_kv("masked_attention", a)
    out, lse, weights, out_lo = output
    ctx.opts = AttnOptions.from_op(a)
    _save(
        ctx,
        q=a.q,
        k=a.k,
        v=a.v,
        out=out,
        lse=lse,
        attn_mask=a.attn_mask,
        key_padding_mask=a.key_padding_mask,
        head_mask=a.head_mask,
        dropout_seed=a.dropout_seed,
        sinks=a.sinks,
        out_lo=saved_out_lo(out_lo),
    )
    ctx.scale, ctx.need_weights = a.scale, a.need_weights
    ctx.mark_non_differentiable(lse, out_lo)
    ctx.set_materialize_grads(False)


def attention_backward(
    t: AttnSaved | SimpleNamespace,
    opts: AttnOptions,
    needs: dict[str, bool],
    grad_out: Tensor | None,
    grad_weights: Tensor | None,
    *,
    scale: float | None = None,
    into: Sequence[Tensor] | None = None,
) -> dict[str, Tensor | None]:
    """The backward of masked_attn::forward from what it saved.

    t: q, k, v, out, lse, attn_mask, key_padding_mask, head_mask and out_lo
    (the forward's fourth output, None for float32 / float64) by name;
    opts: the forward's options (the same dropout mask is regenerated);
    needs: whether attn_mask, key_padding_mask, head_mask need a gradient,
    by name; into: optional (grad_q, grad_k, grad_v) views to write the
    q/k/v gradients into (masked_attn::backward_into). Returns the gradients
    of q, k, v, of the masks and of the sinks, reduced to their shapes, by
    name (the head mask's and the sinks' as the op returns them).
    """
    am_grad = t.attn_mask is not None and needs.get("attn_mask", False)
    kpm_grad = t.key_padding_mask is not None and needs.get("key_padding_mask", False)
    hm_grad = t.head_mask is not None and needs.get("head_mask", False)
    if grad_out is None:
        grad_out = torch.zeros_like(t.out)
    named = dict(
        grad_out=grad_out,
        grad_weights=grad_weights,
        q=t.q,
        k=t.k,
        v=t.v,
        out=t.out,
        lse=t.lse,
        attn_mask=t.attn_mask,
        key_padding_mask=t.key_padding_mask,
        head_mask=t.head_mask,
        scale=scale,
        head_mask_grad=hm_grad,
        mask_grad=am_grad or kpm_grad,
        out_lo=t.out_lo,
        **opts.op_args(),
    )
    if into is None:
        dq, dk, dv, dhm, dscores, dsinks = torch.ops.masked_attn.backward(*BACKWARD(**named))
    else:
        dq, dk, dv = into
        dhm, dscores, dsinks = torch.ops.masked_attn.backward_into(
            *BACKWARD_INTO(**named, grad_q=dq, grad_k=dk, grad_v=dv)
        )
    am, kpm = t.attn_mask, t.key_padding_mask  # not None where am_grad, kpm_grad
    return dict(
        q=dq,
        k=dk,
        v=dv,
        # an additive mask receives dL/dS summed over the dimensions it broadcasts over
        attn_mask=dscores.sum_to_size(am.shape).to(am.dtype) if am_grad and am is not None else None,
        key_padding_mask=dscores.sum((1, 2)).to(kpm.dtype) if kpm_grad and kpm is not None else None,
        head_mask=dhm if hm_grad else None,
        sinks=dsinks if opts.sinks is not None and needs.get("sinks", False) else None,
    )


def _needs(ctx, *indices):
    """ctx.needs_input_grad at these input positions (the tuple can be shorter
    than the inputs when trailing optional tensors are None); for the
    autograd.Functions of modules.py."""
    n = ctx.needs_input_grad
    return tuple(bool(n[i]) if i < len(n) else False for i in indices)


# an autograd.Function, not register_autograd: see "How gradients are registered" above
class _FirstOrderOnly(torch.autograd.Function):
    """The identity on gradients our backward kernels computed. Those kernels
    are not differentiable themselves: when a backward is recorded
    (create_graph=True) and then differentiated again, this raises instead
    of letting a second-order gradient come out silently zero. The anchors
    (what the forward saw) only connect the node to the graph."""

    @staticmethod
    def forward(ctx, what, n_anchors, *tensors):
        ctx.what = what
        return tuple(g.view_as(g) for g in tensors[n_anchors:])

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(
            f"torch_masked_attn: the gradient of {ctx.what} is not differentiable: double backward "
            "(differentiating a gradient taken with create_graph=True) is not supported"
        )


def first_order_only(what: str, anchors: Iterable[object], *grads: Tensor | None) -> tuple[Tensor | None, ...]:
    """grads as they are, or, while a backward is being recorded
    (create_graph=True), routed through a node, hanging off the anchors
    (saved inputs), that raises if it is differentiated."""
    if not torch.is_grad_enabled():
        return grads
    anchors = tuple(a for a in anchors if isinstance(a, torch.Tensor) and a.requires_grad)
    idx = [i for i, g in enumerate(grads) if g is not None]
    if not idx or not anchors:
        return grads
    wrapped = _FirstOrderOnly.apply(what, len(anchors), *anchors, *(grads[i] for i in idx))
    out = list(grads)
    for i, w in zip(idx, wrapped):
        out[i] = w
    return tuple(out)


def first_order_only_named(what: str, anchors: Iterable[object], grads: dict[str, Tensor | None]) -> dict:
    """first_order_only over a dict of gradients by name."""
    return dict(zip(grads, first_order_only(what, anchors, *grads.values())))


def _forward_backward(ctx, grad_out, grad_lse, grad_weights, grad_out_lo):
    t = saved(ctx)
    grad_weights = grad_weights if ctx.need_weights else None
    grads = attention_backward(t, ctx.opts, ctx.needs, grad_out, grad_weights, scale=ctx.scale)
    return first_order_only_named("masked attention", vars(t).values(), grads)


register_autograd("forward", _forward_backward, _forward_setup_context)


# ---- packed variable-length sequences ---------------------------------------
#
#   masked_attn::varlen_forward(query, key, value, cu_seq_q, cu_seq_k?, max_q, max_k,
#                               scale?, window_left, window_right, seqused_k?, block_table?,
#                               softcap?, sinks?, for_backward=True) -> (out, lse, out_lo)
#   masked_attn::varlen_backward(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k,
#                                max_q, max_k, scale?, window_left, window_right, softcap?,
#                                sinks?, out_lo?) -> (grad_query, grad_key, grad_value)
#
# query (T_q, H, D), key (T_k, H_kv, D), value (T_k, H_kv, Dv); int32 offsets
# (N + 1,); out (T_q, H, Dv); lse (H, T_q) (float32, float64 for float64).
# The window is bottom-right aligned (flash-attn's): query i of a sequence sees
# key j iff i + Lk - Lq - left <= j <= i + Lk - Lq + right, -1 = unbounded.
# seqused_k and block_table (key, value then (pages, page_size, H_kv, D) pools,
# page_size a multiple of 64) are inference-only (no backward). The options are
# masked_attn::forward's (AttnOptions; the lse includes the sink). The
# user-facing function is torch_masked_attn.functional.varlen_attn.


@torch.library.register_fake("masked_attn::varlen_forward")
def _varlen_forward_fake(*args, **kwargs):
    a = VARLEN_FORWARD.read(args, kwargs)
    _same_device("varlen_forward", a)
    query, key, value = a.query, a.key, a.value
    kv_dim = 3 if a.block_table is None else 4
    torch._check(
        query.dim() == 3 and key.dim() == kv_dim and value.dim() == kv_dim,
        lambda: "masked_attn.varlen: query must be 3-D (T, H, D), key and value 3-D (or 4-D paged)",
    )
    T, H, _ = query.shape
    Dv = value.shape[-1]
    out_lo = query.new_empty(T, H, Dv) if _has_out_lo(query.dtype) and a.for_backward else query.new_empty(0, H, Dv)
    return query.new_empty(T, H, Dv), query.new_empty(H, T, dtype=_lse_dtype(query.dtype)), out_lo


@torch.library.register_fake("masked_attn::varlen_backward")
def _varlen_backward_fake(*args, **kwargs):
    a = VARLEN_BACKWARD.read(args, kwargs)
    _same_device("varlen_backward", a)
    grads = tuple(t.new_empty(t.shape) for t in (a.query, a.key, a.value))
    return (*grads, _options_grads_fake(a, a.query)[1])


def _varlen_setup_context(ctx, a, output):
    _no_grad_with_int8_kv("varlen_attn", a)
    out, lse, out_lo = output
    for name in ("block_table", "seqused_k"):
        if getattr(a, name) is not None:
            raise RuntimeError(
                f"varlen_attn: {name} is an inference-only parameter (no backward); "
                "call it under torch.no_grad() or on tensors that do not require grad"
            )
    _save(
        ctx,
        query=a.query,
        key=a.key,
        value=a.value,
        cu_seq_q=a.cu_seq_q,
        cu_seq_k=a.cu_seq_k,
        out=out,
        lse=lse,
        sinks=a.sinks,
        out_lo=saved_out_lo(out_lo),
    )
    ctx.opts = AttnOptions.from_op(a)
    ctx.max_q, ctx.max_k, ctx.scale = a.max_q, a.max_k, a.scale
    ctx.mark_non_differentiable(lse, out_lo)
    ctx.set_materialize_grads(False)


def _varlen_backward(ctx, grad_out, grad_lse, grad_out_lo):
    t = saved(ctx)
    if grad_out is None:
        return {}
    grad_out = grad_out.contiguous()
    dq, dk, dv, dsinks = torch.ops.masked_attn.varlen_backward(
        *VARLEN_BACKWARD(
            grad_out=grad_out,
            query=t.query,
            key=t.key,
            value=t.value,
            out=t.out,
            lse=t.lse,
            cu_seq_q=t.cu_seq_q,
            cu_seq_k=t.cu_seq_k,
            max_q=ctx.max_q,
            max_k=ctx.max_k,
            scale=ctx.scale,
            out_lo=t.out_lo,
            **ctx.opts.op_args(),
        )
    )
    n = ctx.needs
    grads = {"query": dq if n["query"] else None, "key": dk if n["key"] else None, "value": dv if n["value"] else None}
    grads = first_order_only_named("varlen attention", (t.query, t.key, t.value), grads)
    if t.sinks is not None and n.get("sinks"):
        grads["sinks"] = dsinks
    return grads


register_autograd("varlen_forward", _varlen_backward, _varlen_setup_context)


# ---- cross-entropy ---------------------------------------------------------
#
#   masked_attn::cross_entropy(input, target, weight?, reduction, ignore_index,
#                              label_smoothing, z_loss, softcap?, inplace_backward)
#                              -> (loss, lse)
#   masked_attn::cross_entropy_backward(grad_loss, input, target, weight?, lse,
#                              reduction, ignore_index, label_smoothing,
#                              target_grad, z_loss, softcap?) -> (grad_input, grad_target)
#   masked_attn::cross_entropy_backward_(grad_loss, input!, target, weight?, lse,
#                              reduction, ignore_index, label_smoothing, z_loss,
#                              softcap?) -> ()        the gradient overwrites input
#   masked_attn::cross_entropy_chunk_(input!, target, weight?, grad_scale?,
#                              ignore_index, label_smoothing, z_loss, softcap?)
#                              -> (loss, lse)         per-row, acc type; with grad_scale,
#                                                     grad_scale * d loss_row / d input
#                                                     overwrites input
#
# input (C,), (N, C) or (N, C, d1, ..., dk); target int64 class indices of
# input's shape without the class dim, or probabilities of input's shape and
# dtype; weight (C,) of input's dtype; reduction 'none' | 'mean' | 'sum';
# label_smoothing in [0, 1]; z_loss >= 0 adds z_loss * lse^2 to each kept row;
# softcap > 0 scores the row on softcap * tanh(input / softcap). lse is the
# per-row log-sum-exp (float32, float64 for float64 input; 0 on ignored
# rows). inplace_backward=True makes the autograd backward write the input's
# gradient over input itself (no new buffer; the logits are gone after it).
# The drop-in F.cross_entropy with PyTorch's argument handling and exceptions
# is torch_masked_attn.losses.


def _ce_rows_shape(input):
    return tuple(input.shape[:1]) + tuple(input.shape[2:]) if input.dim() >= 2 else ()


@torch.library.register_fake("masked_attn::cross_entropy")
def _cross_entropy_fake(
    input,
    target,
    weight=None,
    reduction="mean",
    ignore_index=-100,
    label_smoothing=0.0,
    z_loss=0.0,
    softcap=None,
    inplace_backward=False,
):
    _same_device("cross_entropy", input=input, target=target, weight=weight)
    torch._check(input.dim() >= 1, lambda: "masked_attn.cross_entropy: input must have a class dim")
    rows = _ce_rows_shape(input)
    loss = input.new_empty(rows if reduction == "none" else ())
    lse = input.new_empty(rows, dtype=_lse_dtype(input.dtype))
    return loss, lse


@torch.library.register_fake("masked_attn::cross_entropy_backward")
def _cross_entropy_backward_fake(
    grad_loss,
    input,
    target,
    weight,
    lse,
    reduction,
    ignore_index,
    label_smoothing,
    target_grad=False,
    z_loss=0.0,
    softcap=None,
):
    _same_device("cross_entropy_backward", grad_loss=grad_loss, input=input, target=target, weight=weight, lse=lse)
    return input.new_empty(input.shape), input.new_empty(input.shape if target_grad else (0,))


@torch.library.register_fake("masked_attn::cross_entropy_backward_")
def _cross_entropy_backward_inplace_fake(
    grad_loss, input, target, weight, lse, reduction, ignore_index, label_smoothing, z_loss=0.0, softcap=None
):
    _same_device("cross_entropy_backward_", grad_loss=grad_loss, input=input, target=target, weight=weight, lse=lse)
    return None


# masked_attn::cache_write(key, value, key_cache!, value_cache!, slots) -> (): new rows written in
# place (functional.write_kv_cache); nothing to return.
@torch.library.register_fake("masked_attn::cache_write")
def _cache_write_fake(key, value, key_cache, value_cache, slots, key_scale=None, value_scale=None):
    _same_device("cache_write", key=key, value=value, key_cache=key_cache, value_cache=value_cache, slots=slots)
    return None


# masked_attn::quantize_kv(x) -> (q (rows, D) int8, scale (rows,) float32): an 8-bit cache's rows
# (functional.quantize_kv views them as x's shape).
@torch.library.register_fake("masked_attn::quantize_kv")
def _quantize_kv_fake(x):
    D = x.shape[-1]
    rows = x.numel() // D
    return x.new_empty(rows, D, dtype=torch.int8), x.new_empty(rows, dtype=torch.float32)


@torch.library.register_fake("masked_attn::cross_entropy_chunk_")
def _cross_entropy_chunk_fake(
    input, target, weight=None, grad_scale=None, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None
):
    _same_device("cross_entropy_chunk_", input=input, target=target, weight=weight)
    rows = _ce_rows_shape(input)
    acc = _lse_dtype(input.dtype)
    return input.new_empty(rows, dtype=acc), input.new_empty(rows, dtype=acc)


def _cross_entropy_setup_context(ctx, a, output):
    _, lse = output
    ctx.save_for_backward(a.input, a.target, a.weight, lse)
    ctx.reduction, ctx.ignore_index, ctx.label_smoothing = a.reduction, a.ignore_index, a.label_smoothing
    ctx.z_loss, ctx.softcap, ctx.inplace_backward = a.z_loss, a.softcap, a.inplace_backward
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)


def _cross_entropy_backward(ctx, grad_loss, grad_lse):
    input, target, weight, lse = ctx.saved_tensors
    target_grad = bool(ctx.needs["target"]) and target.is_floating_point()
    if grad_loss is None or not (ctx.needs["input"] or target_grad):
        return {}
    args = (target, weight, lse, ctx.reduction, ctx.ignore_index, ctx.label_smoothing)
    if ctx.inplace_backward and not target_grad:
        # the gradient overwrites the logits; the version bump makes any other
        # use of the saved logits in this graph fail loudly instead of silently
        torch.ops.masked_attn.cross_entropy_backward_(grad_loss, input, *args, ctx.z_loss, ctx.softcap)
        torch.autograd.graph.increment_version(input)
        return {"input": input}
    grad_input, grad_target = torch.ops.masked_attn.cross_entropy_backward(
        grad_loss, input, *args, target_grad, ctx.z_loss, ctx.softcap
    )
    return first_order_only_named(
        "cross_entropy",
        (input, target),
        {"input": grad_input if ctx.needs["input"] else None, "target": grad_target if target_grad else None},
    )


register_autograd("cross_entropy", _cross_entropy_backward, _cross_entropy_setup_context)
