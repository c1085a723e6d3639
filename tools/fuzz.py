#!/usr/bin/env python3
"""Differential fuzzer on Hypothesis: attention, packed attention and cross-entropy against the
float64 references of tests/reference.py (attention64, its dropout keep_mask, cross_entropy64).

    python tools/fuzz.py --seconds N [--isa scalar|avx2|...|all] [--kind attention|varlen|ce|all]
                         [--seed S] [--threads T (default 1)]
    python tools/fuzz.py --replay "Attention(dtype='bf16', Lk=2, causal=True)" [--isa ...]

A case is a literal (Attention, Varlen, CrossEntropy): the shapes, dtype, layouts, masks and
options, and `seed`, which fills the tensors (torch.Generator). Hypothesis draws cases
(attention_cases, varlen_cases, ce_cases) and shrinks a failing one: a finding prints a small
case, the command that replays it and the @example line that keeps it in
tests/project/test_fuzz.py. Each ISA (ops.use_isa) runs for N seconds: Hypothesis runs of up to
BATCH cases, the kinds in turn, run i seeded with --seed and i, the same runs on every ISA.

Attention (masked_attention): B, H, grouped query heads, Lq, Lk, D, Dv (tile edges often), every
dtype, q, k, v as views of other storage, bool and float attn_mask of every broadcast shape, key
padding with fully padded rows, head mask, causal, scale, need_weights, return_lse, windows,
causal and windows about another diagonal, softcap, sinks, ALiBi, dropout (the reference applies
keep_mask), the decode kernel split between forced work items (ops.decode_splits), an 8-bit KV
cache (inference only); gradients of q, k, v and of the float masks, head mask and sinks that
require grad; also through scaled_dot_product_attention (3-D too) and the Hugging Face backend
(no mask, a 4-D mask or a StructuredMask; softcap, s_aux). Varlen (varlen_attn): packed
sequences of lengths 0, 1, tile edges and more, GQA, every window, softcap, sinks, ALiBi, lse,
forward and backward. Cross-entropy: (C,), (N, C), (N, C, d1[, d2]), class targets with
ignore_index anywhere, probability targets, weight, label smoothing, every reduction, z_loss,
softcap, strided inputs; loss and input gradient.

Tolerance (flash-attention's rule), per compared tensor:

    max|ours - ref64| <= 2 * max|torch_dtype - ref64|
                         + REL_SLACK[dtype] * max|ref64|
                         + REL_SLACK[acc] * (natural + natural_acc)
                         + tiny[acc]

ref64 is the reference in float64 on the same (rounded) values; torch_dtype the same reference
in the input dtype (also with q scaled before q k^T, and F.scaled_dot_product_attention where it
applies; the largest error counts). The slack covers the cases where torch happens to be exact:
about half an ulp of the result's largest value in the input dtype, and, at the accumulation
type acc (float32; float64 for float64), the tensor's natural magnitude (the sum of |terms| it
is computed from, which stays large where the result cancels, e.g. dq = 0 for a query that sees
one key) and the error that rounding the scores makes through exp; tiny[acc] is the smallest
normal number of acc, below which the kernels' exp gives 0, never a denormal (common/simd.h's
vf_exp: a denormal costs a microcode assist), so a result that is all denormals may be 0. NaN must
appear where ref64 has NaN and nowhere else (equal infinities count as equal). Calibrated: in
600 s per ISA (scalar, avx2: about 20,000 cases each) the clean case closest to its bound used
0.94 of it (dv of a packed batch with softcap and sinks), and a reference with causal flipped,
the head mask dropped, the scale doubled or a cross-entropy option dropped gives findings (its
self-test). Exit status 1 if there is any finding.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import math
import pathlib
import sys
import time
import traceback
from dataclasses import dataclass, field

import hypothesis
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
import torch_masked_attn  # noqa: E402, F401  (registers the ops)
from reference import attention64, cross_entropy64, keep_mask, p_int16_bound, q_int16  # noqa: E402
from torch_masked_attn import functional as tmf  # noqa: E402
from torch_masked_attn import ops  # noqa: E402

try:  # the Hugging Face backend (tests/project/test_fuzz.py fails without it)
    from torch_masked_attn import hf as HF
except ImportError:
    HF = None

ISAS = ops.built_isas()
KINDS = ("attention", "varlen", "ce")
DTYPES = {"f32": torch.float32, "f64": torch.float64, "bf16": torch.bfloat16, "f16": torch.float16}
LOW = (torch.bfloat16, torch.float16)
BATCH = 200  # cases per Hypothesis run of the CLI
# Slack added to 2x torch's own error, relative (the module docstring).
REL_SLACK = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 5e-4, torch.bfloat16: 2e-3}


# ---- cases: literals ---------------------------------------------------------------------------


class _Literal:
    """A frozen dataclass whose repr is the expression that builds it, the fields left at their
    defaults left out: what a finding prints, --replay reads and @example keeps."""

    def __repr__(self):
        fields = [f for f in dataclasses.fields(self) if getattr(self, f.name) != f.default]
        return f"{type(self).__name__}({', '.join(f'{f.name}={getattr(self, f.name)!r}' for f in fields)})"


def literal(cls):
    return dataclass(frozen=True, repr=False)(cls)


@literal
class Mask(_Literal):
    """attn_mask of `shape`, each entry blocked with probability p: bool (True = blocked) or float
    (-inf where blocked, else randn * amp); the transpose of its storage if transposed."""

    kind: str = "bool"
    shape: str = "(Lq,Lk)"
    p: float = 0.0
    transposed: bool = False
    dtype: str | None = None  # None: the input's
    amp: float = 1.0
    grad: bool = False


@literal
class Padding(_Literal):
    """key_padding_mask (B, Lk): row b blocks keys lens[b]: (lens None: a random half)."""

    lens: tuple | None = None
    kind: str = "bool"
    dtype: str | None = None
    grad: bool = False


@literal
class HeadMask(_Literal):
    values: tuple = (1.0,)  # (H,) or (B, H), nested
    dtype: str | None = None
    grad: bool = False


@literal
class Sinks(_Literal):
    values: tuple = (0.0,)  # (H,)
    dtype: str | None = None
    grad: bool = False


@literal
class Dropout(_Literal):
    p: float = 0.5
    seed: tuple = (0, 0)  # dropout_seed: (seed, offset)


@literal
class HFMask(_Literal):
    """transformers' StructuredMask: causal (sliding window) at q_offset, kv_offset; padding: the
    lengths per batch entry (None: none)."""

    causal: bool = True
    window: int | None = None
    q_offset: int = 0
    kv_offset: int = 0
    padding: tuple | None = None


@literal
class Attention(_Literal):
    """masked_attention (call "masked"), the sdpa drop-in ("sdpa"; "sdpa3d": (H, L, D) inputs) or
    hf.attention_forward ("hf": causal is the layer's is_causal; attn_mask the 4-D mask; hf_mask a
    StructuredMask). layout of q, k, v: contig, blhd ((B, L, H, D) storage), pad<off>+<extra> (a
    slice of a wider last dim), step (every other row), swap (D not unit-stride), expand (zero
    batch stride). splits: the decode kernel's forced work items."""

    dtype: str = "f32"
    B: int = 1
    H: int = 1
    Hkv: int = 1
    Lq: int = 1
    Lk: int = 1
    D: int = 1
    Dv: int = 1
    call: str = "masked"
    layout: tuple = ("contig", "contig", "contig")
    amp: float = 1.0
    attn_mask: Mask | None = None
    padding: Padding | None = None
    head_mask: HeadMask | None = None
    causal: bool = False
    diagonal: int = 0
    scale: float | None = None
    need_weights: bool = False
    return_lse: bool = False
    window: tuple | None = None
    softcap: float | None = None
    sinks: Sinks | None = None
    alibi: tuple | None = None  # slopes (H,) or (B, H)
    dropout: Dropout | None = None
    int8: bool = False
    splits: int | None = None
    hf_mask: HFMask | None = None
    seed: int = 0


@literal
class Varlen(_Literal):
    """varlen_attn: sequence b has lq[b] queries, lk[b] keys; layout of q, k, v: contig, htd
    ((H, T, D) storage), pad<off>+<extra>; max_q, max_k the longest + slack_q, slack_k."""

    dtype: str = "f32"
    lq: tuple = (1,)
    lk: tuple = (1,)
    H: int = 1
    Hkv: int = 1
    D: int = 1
    Dv: int = 1
    layout: tuple = ("contig", "contig", "contig")
    amp: float = 1.0
    window: tuple = (-1, -1)
    scale: float | None = None
    enable_gqa: bool = False
    lse: bool = False
    slack_q: int = 0
    slack_k: int = 0
    softcap: float | None = None
    sinks: Sinks | None = None
    alibi: tuple | None = None  # slopes (H,) or (N, H)
    seed: int = 0


@literal
class CrossEntropy(_Literal):
    """cross_entropy of an input of `shape`; layout: contig, classlast ((N, d.., C) storage),
    pad<off>+<extra>; target: class (a fraction `ignored` of them ignore_index), or softmax, rand,
    onehot probabilities."""

    dtype: str = "f32"
    shape: tuple = (1, 1)
    layout: str = "contig"
    amp: float = 1.0
    target: str = "class"
    ignore_index: int = -100
    ignored: float = 0.0
    weight: bool = False
    label_smoothing: float = 0.0
    reduction: str = "mean"
    z_loss: float = 0.0
    softcap: float | None = None
    seed: int = 0


LITERALS = {c.__name__: c for c in (Attention, Varlen, CrossEntropy, Mask, Padding, HeadMask, Sinks, Dropout, HFMask)}


def parse_case(text: str):
    """The case a literal (a finding's repr) stands for."""
    return eval(text, {"__builtins__": {}}, dict(LITERALS))  # the fuzzer's own literals, nothing else


# ---- strategies: each draws its simplest value first, where shrinking heads ------------------------


def _maybe(draw, p: float) -> bool:
    """True with probability about p (shrinks to False)."""
    return draw(st.integers(0, 99)) >= 100 - round(100 * p)


def _opt(draw, force: dict, name: str, p: float, strategy):
    """An option: force[name] True draws it, False leaves it out, another value is it; else
    drawn with probability p (else None)."""
    if name in force:
        return draw(strategy) if force[name] is True else None if force[name] is False else force[name]
    return draw(strategy) if _maybe(draw, p) else None


def _milli(lo: float, hi: float):
    return st.integers(round(lo * 1000), round(hi * 1000)).map(lambda x: x / 1000)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def _sized(draw, lo: int, hi: int, edges: tuple, how=("any", "any", "edge", "small")):
    """lo..hi: uniform, one of `edges` (the kernels' tile edges) or one of the 8 smallest; which
    of them is drawn first, so that shrinking can trade an edge for a small number."""
    kind, n = draw(st.sampled_from(how)), draw(st.integers(lo, hi))
    if kind == "edge":
        return draw(st.sampled_from(edges))
    return lo + (n - lo) % 8 if kind == "small" else n


LENGTH = _sized(1, 150, (63, 64, 65, 63, 64, 65, 127, 128, 129))
DIM = _sized(1, 130, (7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 130))
SEQ_LENGTH = _sized(0, 140, (0, 1, 63, 64, 65), ("any", "edge", "small"))
SCALE = st.one_of(st.none(), _milli(0.02, 2.0))
SOFTCAP = st.one_of(_milli(0.3, 5.0), st.just(20.0))
AMP = st.sampled_from((1.0, 0.5, 2.0))
MASK_DTYPE = st.sampled_from((None, "f32"))
SEED = st.integers(0, 2**32 - 1)
DROPOUT = st.builds(
    Dropout,
    st.one_of(st.sampled_from((0.1, 0.3, 0.5, 0.9, 1.0)), _milli(0.01, 0.99)),
    st.tuples(*(st.integers(-(1 << 62), (1 << 62) - 1),) * 2),
)
VARLEN_WINDOW = st.one_of(
    st.just((-1, -1)),
    st.just((-1, 0)),
    st.tuples(st.one_of(st.sampled_from((0, 1, 5, 63, 64)), st.integers(0, 150)), st.just(0)),
    st.tuples(*(st.one_of(st.sampled_from((-1, 0, 1)), st.integers(0, 150)),) * 2),
)


@st.composite
def _layouts(draw, expand=(False, False, False), names=("contig", "contig", "blhd", "pad", "step", "swap")):
    got = []
    for e in expand:
        name = draw(st.sampled_from(names + (("expand",) if e else ())))
        got.append(f"pad{draw(st.integers(0, 3))}+{draw(st.integers(0, 5))}" if name == "pad" else name)
    return tuple(got)


@st.composite
def _mask(draw):
    kind = draw(st.sampled_from(("bool", "float")))
    shape = draw(st.sampled_from(("(Lq,Lk)", "(B,1,Lq,Lk)", "(1,H,Lq,Lk)", "(B,H,Lq,Lk)")))
    m = Mask(kind, shape, draw(st.sampled_from((0.0, 0.1, 0.3, 0.6, 0.95))), _maybe(draw, 0.25))
    if kind == "bool":
        return m
    return dataclasses.replace(m, dtype=draw(MASK_DTYPE), amp=draw(st.sampled_from((0.5, 2.0))), grad=_maybe(draw, 0.4))


@st.composite
def _padding(draw, B: int, Lk: int):
    lens = st.one_of(st.just(0), st.just(Lk), st.integers(0, Lk), st.integers(max(0, Lk - 3), Lk))
    pad = Padding(None if _maybe(draw, 0.15) else tuple(draw(lens) for _ in range(B)))
    if not _maybe(draw, 0.15):
        return pad
    return dataclasses.replace(pad, kind="float", dtype=draw(MASK_DTYPE), grad=draw(st.booleans()))


def _per_head(values, B: int, H: int, batched: bool):
    return st.tuples(*(st.tuples(*(values,) * H),) * B) if batched else st.tuples(*(values,) * H)


@st.composite
def _head_mask(draw, B: int, H: int):
    values = draw(_per_head(st.one_of(_milli(0.0, 2.0), st.sampled_from((1.0, 0.0))), B, H, draw(st.booleans())))
    return HeadMask(values, draw(MASK_DTYPE), draw(st.booleans()))


@st.composite
def _sinks(draw, H: int):
    values = st.one_of(_milli(-1.0, 1.0), _milli(-4.0, 4.0), _milli(6.0, 10.0))  # 6-10: most of the mass
    return Sinks(draw(_per_head(values, 1, H, False)), draw(MASK_DTYPE), _maybe(draw, 0.7))


def _alibi(B: int, H: int):
    slopes = st.one_of(st.sampled_from((0.5, 0.25, 0.125, 0.0625, 1.0, 0.0)), _milli(0.0, 2.0))
    return st.booleans().flatmap(lambda batched: _per_head(slopes, B, H, batched))


def _window_side(L: int):
    around = st.sampled_from((max(0, L - 2), L - 1, L, L + 3))  # where the side stops mattering
    return st.one_of(st.sampled_from((None, -1)), st.sampled_from((0, 1, 2)), around, st.integers(0, max(1, L)))


@st.composite
def _hf_mask(draw, B: int, Lq: int, Lk: int):
    causal = _maybe(draw, 0.8)
    window = draw(st.one_of(st.none(), st.sampled_from((1, 2)), st.integers(1, Lk + 2))) if causal else None
    q_offset = draw(st.one_of(st.just(0), st.just(max(0, Lk - Lq)), st.integers(0, Lk + 3)))
    lens = tuple(draw(st.one_of(st.just(Lk), st.integers(0, Lk))) for _ in range(B))
    padding = lens if any(n < Lk for n in lens) and draw(st.booleans()) else None
    return HFMask(causal, window, q_offset, draw(st.one_of(st.just(0), st.integers(0, 5))), padding)


@st.composite
def attention_cases(draw, **force):
    """Attention cases; force sets dtype, call, causal or budget (the largest B H Lq Lk (D + Dv)),
    or an option (True: drawn, False: left out, or its value): decode, int8, attn_mask, padding,
    head_mask, window, diagonal, softcap, sinks, alibi, dropout, hf_mask."""
    dtype = force.get("dtype") or draw(st.sampled_from(tuple(DTYPES)))
    B, H = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    Hkv = draw(st.sampled_from(_divisors(H)))
    Lq, Lk, D = draw(LENGTH), draw(LENGTH), draw(DIM)
    Dv = draw(st.one_of(st.just(D), DIM))
    splits, decode = None, _opt(draw, force, "decode", 0.15, st.just(True))
    if decode:  # several key chunks, a kv head's query heads stacked
        Lq = draw(st.one_of(st.sampled_from((1, 2, 4, 8, 16)), st.integers(1, 16)))
        Lk = draw(st.one_of(st.sampled_from((513, 1024, 1537)), st.integers(600, 2600)))
        H = draw(st.one_of(st.sampled_from((2, 4, 6, 7, 8, 14, 16)), st.integers(1, 16)))
        Hkv = draw(st.sampled_from([d for d in _divisors(H) if d < H or H == 1]))
        D, Dv, splits = min(D, 64), min(Dv, 64), draw(st.sampled_from((None, 1, 2, 4, 16)))
    while B * H * Lq * Lk * (D + Dv) > force.get("budget", 12_000_000):  # about 10 ms a case
        if decode and D + Dv > 2:
            D, Dv = max(1, D // 2), max(1, Dv // 2)
        elif Lq >= Lk and Lq > 8:
            Lq //= 2
        elif Lk > 8:
            Lk //= 2
        else:
            D, Dv = max(1, D // 2), max(1, Dv // 2)
    call = force.get("call") or draw(st.sampled_from(("masked",) * 4 + ("sdpa", "hf")))
    call = "masked" if call == "hf" and HF is None else call
    call = "sdpa3d" if call == "sdpa" and B == 1 and draw(st.booleans()) else call
    masked, sdpa = call == "masked", call.startswith("sdpa")
    int8 = bool(masked and dtype != "f64" and _opt(draw, force, "int8", 0.15, st.just(True)))
    layout = draw(_layouts((B > 1, B > 1 and not int8, B > 1 and not int8)))
    causal = force.get("causal", _maybe(draw, 0.3))
    window = _opt(draw, force, "window", 0.3, st.tuples(_window_side(Lq), _window_side(Lk))) if masked else None
    diagonal = 0
    if masked and (causal or window is not None) and _opt(draw, force, "diagonal", 0.4, st.just(True)):
        diagonal = draw(st.one_of(st.just(Lk - Lq), st.integers(-Lq, Lk), st.integers(-3, 3)))
    c = Attention(
        dtype,
        B,
        H,
        Hkv,
        Lq,
        Lk,
        D,
        Dv,
        call,
        layout,
        draw(AMP),
        attn_mask=_opt(draw, force, "attn_mask", 0.6, _mask()),
        padding=_opt(draw, force, "padding", 0.35, _padding(B, Lk)) if masked else None,
        head_mask=_opt(draw, force, "head_mask", 0.3, _head_mask(B, H)) if masked else None,
        causal=causal,
        diagonal=diagonal,
        scale=draw(SCALE),
        need_weights=masked and _maybe(draw, 0.3),
        return_lse=masked and _maybe(draw, 0.3),
        window=window,
        softcap=_opt(draw, force, "softcap", 0.2, SOFTCAP) if not sdpa else None,
        sinks=_opt(draw, force, "sinks", 0.2, _sinks(H)) if not sdpa else None,
        alibi=_opt(draw, force, "alibi", 0.15, _alibi(B, H)) if masked else None,
        dropout=_opt(draw, force, "dropout", 0.15, DROPOUT) if masked else None,
        int8=int8,
        splits=splits,
        seed=draw(SEED),
    )
    if call == "hf" and c.attn_mask is None:
        c = dataclasses.replace(c, hf_mask=_opt(draw, force, "hf_mask", 0.6, _hf_mask(B, Lq, Lk)))
    return c


@st.composite
def varlen_cases(draw, **force):
    """Packed batches; force sets dtype, window, min_seqs or budget, or an option as
    attention_cases' does: softcap, sinks, alibi."""
    dtype = force.get("dtype") or draw(st.sampled_from(tuple(DTYPES)))
    lq = tuple(draw(st.lists(SEQ_LENGTH, min_size=force.get("min_seqs", 1), max_size=6)))
    N = len(lq)
    lk = tuple(draw(st.lists(SEQ_LENGTH, min_size=N, max_size=N))) if _maybe(draw, 0.5) else lq
    H = draw(st.integers(1, 4))
    Hkv, D = draw(st.sampled_from(_divisors(H))), draw(DIM)
    Dv = draw(st.one_of(st.just(D), DIM))
    while sum(a * b for a, b in zip(lq, lk)) * H * (D + Dv) > force.get("budget", 8_000_000) and D + Dv > 2:
        D, Dv = max(1, D // 2), max(1, Dv // 2)
    return Varlen(
        dtype,
        lq,
        lk,
        H,
        Hkv,
        D,
        Dv,
        draw(_layouts(names=("contig", "contig", "htd", "pad"))),
        draw(AMP),
        window=force["window"] if "window" in force else draw(VARLEN_WINDOW),
        scale=draw(SCALE),
        enable_gqa=H != Hkv or _maybe(draw, 0.3),
        lse=_maybe(draw, 0.3),
        slack_q=draw(st.integers(0, 5)) if _maybe(draw, 0.3) else 0,
        slack_k=draw(st.integers(0, 5)) if _maybe(draw, 0.3) else 0,
        softcap=_opt(draw, force, "softcap", 0.15, SOFTCAP),
        sinks=_opt(draw, force, "sinks", 0.15, _sinks(H)),
        alibi=_opt(draw, force, "alibi", 0.15, _alibi(N, H)),
        seed=draw(SEED),
    )


CE_EDGES = (1, 2, 3, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 1024)


@st.composite
def ce_cases(draw, **force):
    """Cross-entropy cases; force sets dtype, target, label_smoothing, z_loss or softcap."""
    dtype = force.get("dtype") or draw(st.sampled_from(tuple(DTYPES)))
    form = draw(st.sampled_from(("NC", "NC", "C", "NCd", "NCdd")))
    if _maybe(draw, 0.05):
        C = draw(st.integers(3001, 40000))
    else:  # log-uniform to 3,000, or a power-of-two edge
        C = draw(st.one_of(st.integers(0, 800).map(lambda x: int(math.exp(x / 100))), st.sampled_from(CE_EDGES)))
    N = 1 if form == "C" else draw(st.one_of(st.integers(1, 64), st.integers(1, 8)))
    ds = tuple(draw(st.integers(1, 6)) for _ in form[2:])
    while N * C * math.prod(ds) > 300_000 and (N > 1 or ds):
        N, ds = (N // 2, ds) if N > 1 else (N, tuple(max(1, d // 2) for d in ds))
    layout = draw(st.sampled_from(("contig", "pad") if form == "C" else ("contig", "contig", "classlast", "pad")))
    if layout == "pad":
        layout = f"pad{draw(st.integers(0, 3))}+{draw(st.integers(0, 4))}"
    prob = draw(st.sampled_from(("softmax", "rand", "onehot"))) if _maybe(draw, 0.3) else "class"
    target = force.get("target", prob)
    ii = draw(st.one_of(st.just(-100), st.integers(0, C - 1), st.integers(C, C + 5), st.integers(-5, -1)))
    ignored = draw(st.sampled_from((0.0, 0.2, 0.5, 1.0, 0.1)))
    ls = draw(st.one_of(st.just(1.0), _milli(0, 1))) if _maybe(draw, 0.35) else 0.0
    z = draw(st.sampled_from((1e-4, 1e-2, 0.3))) if _maybe(draw, 0.15) else 0.0
    cap = draw(_milli(0.5, 30.0)) if _maybe(draw, 0.15) else None
    return CrossEntropy(
        dtype,
        (C,) if form == "C" else (N, C, *ds),
        layout,
        draw(st.sampled_from((1.0, 3.0, 10.0)[: 2 + (dtype != "f16")])),
        target,
        ii if target == "class" else -100,
        ignored if target == "class" else 0.0,
        _maybe(draw, 0.3),
        force.get("label_smoothing", ls),
        draw(st.sampled_from(("mean", "none", "sum"))),
        force.get("z_loss", z),
        force.get("softcap", cap),
        draw(SEED),
    )


STRATEGIES = {"attention": attention_cases, "varlen": varlen_cases, "ce": ce_cases}


def cases(kinds=KINDS):
    return st.one_of(*(STRATEGIES[k]() for k in kinds))


# ---- comparison ----------------------------------------------------------------------------------


@dataclass
class Result:
    """What one case gave: problems, every comparison (for --replay) and its metrics."""

    case: object
    problems: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    metrics: list[tuple] = field(default_factory=list)  # (name, dtype, err, torch's err, slack)


def max_err(a: torch.Tensor, b: torch.Tensor, less: torch.Tensor | None = None) -> float:
    """max |a - b| (less that, element by element, first: a rounding the references do not make);
    equal infinities and NaN against NaN count as 0, any other non-finite difference as inf."""
    a, b = a.detach().double(), b.detach().double()
    if a.shape != b.shape:
        return math.inf
    if a.numel() == 0:
        return 0.0
    d = (a - b).abs() if less is None else ((a - b).abs() - less.double().expand_as(a)).clamp(min=0)
    d = torch.where((a == b) | (a.isnan() & b.isnan()), torch.zeros((), dtype=torch.float64), d)
    return torch.nan_to_num(d, nan=math.inf).max().item()


def _amax(t) -> float:
    """max of the finite |t| (0 for none; a number as it is)."""
    if not isinstance(t, torch.Tensor):
        return float(t)
    t = t.detach().double().abs()
    t = t[torch.isfinite(t)]
    return t.max().item() if t.numel() else 0.0


def compare(
    res: Result, names, ours: dict, theirs: list, ref: dict, dtypes: dict, natural: dict, natural_acc: dict, less=None
):
    """Add a problem to res for each tensor named that is not within the rule of ref (the module
    docstring): natural is its natural magnitude, natural_acc the error that rounding the scores
    makes through exp; both scale with the accumulation type's precision. less: {name: the bound,
    element by element, of a rounding of ours that the references do not make} (max_err)."""
    for name in names:
        o, r, dtype = ours.get(name), ref.get(name), dtypes[name]
        if r is None:
            if o is not None and o.abs().max().item() != 0:
                res.problems.append(f"{name}: expected no gradient, got one")
            continue
        if o is None or o.shape != r.shape:
            res.problems.append(f"{name}: got {None if o is None else tuple(o.shape)}, expected {tuple(r.shape)}")
            continue
        e_ours = max_err(o, r, (less or {}).get(name))
        e_t = max([e for t in theirs if t.get(name) is not None and math.isfinite(e := max_err(t[name], r))], default=0)
        mag, nat, nat_acc = _amax(r), natural.get(name, 0.0), natural_acc.get(name, 0.0)
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        bound = 2.0 * e_t + REL_SLACK[dtype] * mag + REL_SLACK[acc] * (nat + nat_acc) + torch.finfo(acc).tiny
        line = f"{name}: err {e_ours:.3g} bound {bound:.3g} (torch {e_t:.3g}, max|ref| {mag:.3g}, "
        line += f"natural {nat:.3g} + {nat_acc:.3g})"
        res.lines.append(line)
        res.metrics.append((name, dtype, e_ours, e_t, bound - 2.0 * e_t))
        if not e_ours <= bound:
            res.problems.append(line)


def _grads(outs: list, gouts: list, leaves: dict, zeros="") -> dict:
    """{"d" + name: gradient} of the outputs that require grad, for every leaf; the leaves named
    in zeros get zeros where autograd gives None."""
    pairs = [(o, g) for o, g in zip(outs, gouts) if o is not None and o.requires_grad]
    names = list(leaves)
    got = [None] * len(names)
    if pairs:
        outs, gouts = zip(*pairs)
        got = torch.autograd.grad(outs, [leaves[n] for n in names], gouts, allow_unused=True)
    return {"d" + n: torch.zeros_like(leaves[n]) if g is None and n in zeros else g for n, g in zip(names, got)}


@torch.no_grad()
def natural(s, lse, q, k, v, go, scale, *, gw=None, hm=None, drop=None, sinks=None, sensitivity=False) -> dict:
    """The natural magnitude of attention's outputs and gradients: the sum of |terms| each is
    computed from, in float64, from the reference's scores s (B, H, Lq, Lk) and lse, and q, k, v
    (B, H[kv], L, D). Rounding error scales with these, not with the result, which may cancel to
    0. With sensitivity every probability is weighted by |score|: the error that rounding the
    scores makes through exp. Tensors (the caller takes maxima); ds (B, H, Lq, Lk) for the masks'
    gradients, dh (B, H) for the head mask's."""
    B, H, Lq, Lk = s.shape
    G = H // k.shape[1]
    kr, vr = k.abs().repeat_interleave(G, 1), v.abs().repeat_interleave(G, 1)
    p = torch.where(torch.isneginf(s), 0.0, torch.exp(s - lse[..., None]))
    a = p * torch.where(p > 0, s.abs(), 0.0) if sensitivity else p
    hs = torch.ones((), dtype=torch.float64) if hm is None else hm.abs().view(*hm.shape[:-1], H, 1, 1)
    hs = hs if drop is None else hs * drop
    dp = torch.matmul(go.abs(), vr.transpose(-1, -2)) + (0.0 if gw is None else gw.abs())  # |dO| |v|^T (+ |dW|)
    delta = (a * dp * hs).sum(-1, keepdim=True)
    ds = a * (dp * hs + delta)  # p (dP - delta)

    def kv_sum(x):  # over the query heads that share a kv head
        return x.reshape(B, H // G, G, *x.shape[2:]).sum(2)

    m = {
        "out": torch.matmul(a * hs, vr),
        "weights": torch.maximum(a, a * hs),
        "lse": _amax(s.masked_fill(torch.isinf(s), 0)) + math.log(Lk + 1) + (0.0 if sinks is None else _amax(sinks)),
        "dq": scale * torch.matmul(ds, kr),
        "dk": kv_sum(scale * torch.matmul(ds.transpose(-1, -2), q.abs())),
        "dv": kv_sum(torch.matmul((a * hs).transpose(-1, -2), go.abs())),
        "ds": ds,
        "dh": (a * dp * (1.0 if drop is None else drop)).sum((-1, -2)),
    }
    if sinks is not None:
        psink = torch.exp(sinks.view(1, H, 1) - lse)
        m["dsinks"] = ((psink * sinks.abs().view(1, H, 1) if sensitivity else psink) + psink) * delta[..., 0]
        m["dsinks"] = m["dsinks"].sum((0, 2))
    return m


def _lse64(s, sinks):
    """logsumexp over the keys and the sink column, in float64, of scores in any dtype."""
    s = s.detach().double()
    if sinks is not None:
        s = torch.cat([s, sinks.detach().double().view(-1, 1, 1).expand(*s.shape[:-1], 1)], -1)
    return torch.logsumexp(s, -1)


def rounded(t: torch.Tensor, dtype) -> torch.Tensor:
    """float64 values exactly representable in dtype."""
    return t.to(dtype).to(torch.float64)


def _dt(name, default):
    return DTYPES[name] if name else default


def _low(mask_dtype, dtype):
    """The dtype a mask's gradient is compared in: the lower precision of the two."""
    return mask_dtype if mask_dtype in LOW or dtype not in LOW else dtype


def layout_view(name: str, shape: tuple):
    """(storage shape, view function) of a tensor of `shape` (B, H, L, D), or varlen's (T, H, D),
    in layout `name`."""
    *lead, L, D = shape
    if name.startswith("pad"):
        off, extra = map(int, name[3:].split("+"))
        return (*lead, L, D + off + extra), lambda t: t[..., off : off + D]
    if name == "blhd":
        return (lead[0], L, lead[1], D), lambda t: t.transpose(1, 2)
    if name == "htd":
        return (L, *lead, D), lambda t: t.transpose(0, 1)
    if name == "step":
        return (*lead, 2 * L, D), lambda t: t[..., ::2, :]
    if name == "swap":
        return (*lead, D, L), lambda t: t.transpose(-1, -2)
    if name == "expand":
        return (1, *lead[1:], L, D), lambda t: t.expand(*shape)
    return shape, lambda t: t


def _tensors(g, dtype, amp, shapes: dict, layouts) -> dict:
    """q, k, v as (storage, view), float64 values rounded to dtype; v not scaled by amp."""
    t = {}
    for (n, shape), lay in zip(shapes.items(), layouts):
        base, view = layout_view(lay, shape)
        t[n] = (rounded(torch.randn(base, generator=g, dtype=torch.float64) * (amp if n != "v" else 1.0), dtype), view)
    return t


# ---- attention -------------------------------------------------------------------------------------

SPECS = {"am": "attn_mask", "kpm": "padding", "hm": "head_mask", "sinks": "sinks"}


def _values(c: Attention) -> dict:
    """The case's float64 values, rounded to their dtypes: q, k, v as (storage, view); go, gw
    (dOut, dWeights); am, kpm, hm, sinks; int8: the quantized k, v and their scales."""
    dt, B, H, Lq, Lk = DTYPES[c.dtype], c.B, c.H, c.Lq, c.Lk
    g = torch.Generator().manual_seed(c.seed)
    shapes = {"q": (B, H, Lq, c.D), "k": (B, c.Hkv, Lk, c.D), "v": (B, c.Hkv, Lk, c.Dv)}
    t = _tensors(g, dt, c.amp, shapes, c.layout)
    t["go"], t["gw"] = (
        rounded(torch.randn(s, generator=g, dtype=torch.float64), dt) for s in ((B, H, Lq, c.Dv), (B, H, Lq, Lk))
    )

    def blocked_or_float(spec, shape, blocked, amp=1.0):
        if spec.kind == "bool":
            return blocked
        vals = torch.randn(shape, generator=g, dtype=torch.float64) * amp
        return rounded(vals.masked_fill(blocked, -math.inf), _dt(spec.dtype, dt))

    if (m := c.attn_mask) is not None:
        shape = tuple({"B": B, "H": H, "Lq": Lq, "Lk": Lk, "1": 1}[d] for d in m.shape[1:-1].split(","))
        shape = shape[:-2] + shape[:-3:-1] if m.transposed else shape
        t["am"] = blocked_or_float(m, shape, torch.rand(shape, generator=g) < m.p, m.amp)
    if (p := c.padding) is not None:
        j = torch.arange(Lk)[None, :]
        blocked = torch.rand(B, Lk, generator=g) < 0.5 if p.lens is None else j >= torch.tensor(p.lens)[:, None]
        t["kpm"] = blocked_or_float(p, (B, Lk), blocked)
    for n, spec in (("hm", c.head_mask), ("sinks", c.sinks)):
        if spec is not None:
            t[n] = rounded(torch.tensor(spec.values, dtype=torch.float64), _dt(spec.dtype, dt))
    if c.int8:  # k, v quantized in their layouts; the references attend to the dequantized values
        t["int8"] = {}
        for n in "kv":
            base, view = t[n]
            xq, xs = tmf.quantize_kv(view(base.to(dt)))
            base_q, deq = torch.zeros(base.shape, dtype=torch.int8), torch.zeros_like(base)
            view(base_q).copy_(xq)
            view(deq).copy_(xq.double() * xs.double()[..., None])
            t["int8"][n], t[n] = (view(base_q), xs), (deq, view)
    return t


def _leaves(c: Attention, t: dict, qkv_dtype, mask64: bool):
    """Leaf tensors (q, k, v storage in qkv_dtype; the masks and sinks in their own dtypes, float64
    when mask64, where they require grad) and the views a call takes."""
    leaves = {n: t[n][0].to(qkv_dtype).detach().requires_grad_() for n in "qkv"}
    views = {n: t[n][1](leaves[n]) for n in "qkv"}
    for n, fname in SPECS.items():
        spec, views[n] = getattr(c, fname), None
        if spec is not None:
            x = t[n] if t[n].dtype == torch.bool else t[n].to(torch.float64 if mask64 else _dt(spec.dtype, qkv_dtype))
            x = x.detach()
            if getattr(spec, "grad", False):
                leaves[n] = x.requires_grad_()
            views[n] = x.transpose(-1, -2) if getattr(spec, "transposed", False) else x
    if c.call == "sdpa3d":  # (H, L, E)
        views.update((n, views[n].squeeze(0)) for n in "qkv")
        if views["am"] is not None and views["am"].dim() == 4:
            views["am"] = views["am"].squeeze(0)
    return leaves, views


class _HFLayer(torch.nn.Module):
    """What transformers' attention interface reads from the layer: is_causal."""

    def __init__(self, is_causal: bool):
        super().__init__()
        self.is_causal = is_causal


def _hf_padding(c: Attention):
    return torch.arange(c.Lk)[None, :] >= torch.tensor(c.hf_mask.padding)[:, None]


def _ours(c: Attention, t: dict, v: dict):
    """out, weights, lse of the case's call (None where it gives none)."""
    if c.call.startswith("sdpa"):
        am = v["am"]
        am = ~am if am is not None and am.dtype == torch.bool else am  # F.sdpa's convention: True = take part
        return (
            tmf.scaled_dot_product_attention(
                v["q"], v["k"], v["v"], attn_mask=am, is_causal=c.causal, scale=c.scale, enable_gqa=c.H != c.Hkv
            ),
            None,
            None,
        )
    if c.call == "hf":
        mask, h = v["am"], c.hf_mask
        if h is not None:
            padding = None if h.padding is None else _hf_padding(c)
            mask = HF.StructuredMask(c.B, c.Lq, c.Lk, h.q_offset, h.kv_offset, h.causal, h.window, padding)
        elif mask is not None and mask.dtype == torch.bool:
            mask = ~mask  # transformers' convention: True = attend
        kw = {"softcap": c.softcap} if c.softcap is not None else {}
        kw.update({"s_aux": v["sinks"]} if v["sinks"] is not None else {})
        out, w = HF.attention_forward(_HFLayer(c.causal), v["q"], v["k"], v["v"], mask, scaling=c.scale, **kw)
        assert w is None
        return out.transpose(1, 2), None, None
    kw = dict(
        attn_mask=v["am"],
        key_padding_mask=v["kpm"],
        head_mask=v["hm"],
        is_causal=c.causal,
        scale=c.scale,
        need_weights=c.need_weights,
        return_lse=c.return_lse,
        window=c.window,
        softcap=c.softcap,
        sinks=v["sinks"],
        diagonal=c.diagonal,
        alibi_slopes=None if c.alibi is None else torch.tensor(c.alibi, dtype=torch.float32),
    )
    if c.dropout is not None:
        kw.update(dropout_p=c.dropout.p, dropout_seed=torch.tensor(c.dropout.seed, dtype=torch.int64))
    k, vv = v["k"], v["v"]
    if c.int8:  # inference only
        (k, kw["k_scale"]), (vv, kw["v_scale"]) = t["int8"]["k"], t["int8"]["v"]
    split = ops.decode_splits(c.splits) if c.splits is not None else contextlib.nullcontext()
    with torch.no_grad() if c.int8 else contextlib.nullcontext(), split:
        r = tmf.masked_attention(v["q"], k, vv, **kw)
    r = list(r) if isinstance(r, tuple) else [r]
    return r[0], r[1] if c.need_weights else None, r[-1] if c.return_lse else None


def _reference_options(c: Attention, breaks: frozenset) -> dict:
    """attention64's options for the case, where `breaks` gets them wrong on purpose (the
    self-test): causal flips is_causal, scale doubles it, diagonal takes the top-left one; window,
    softcap, alibi, dropout drop them (head_mask, sinks: run_attention drops those)."""
    scale = c.scale
    if "scale" in breaks:
        scale = 2.0 * (scale if scale is not None else 1.0 / math.sqrt(c.D))
    causal = c.causal  # through the HF backend, the layer's is_causal counts without a mask, for Lq > 1
    if c.call == "hf":
        causal = c.causal and c.attn_mask is None and c.hf_mask is None and c.Lq > 1
    kw = dict(
        scale=scale,
        is_causal=causal != ("causal" in breaks),
        diagonal=0 if "diagonal" in breaks else c.diagonal,
        window=None if "window" in breaks else c.window,
        softcap=None if "softcap" in breaks else c.softcap,
        alibi_slopes=None if "alibi" in breaks or c.alibi is None else torch.tensor(c.alibi, dtype=torch.float32),
    )
    if c.dropout is not None and "dropout" not in breaks:
        p = c.dropout.p  # p = 1: every entry dropped (keep all False, no 1 / (1 - p))
        kw.update(dropout_keep=keep_mask(torch.tensor(c.dropout.seed), c.B, c.H, c.Lq, c.Lk, p), dropout_p=p % 1)
    if c.hf_mask is not None:  # the StructuredMask as a bool (B or 1, 1, Lq, Lk) mask, True = blocked
        h = c.hf_mask
        i, j = torch.arange(c.Lq)[:, None] + h.q_offset, torch.arange(c.Lk)[None, :] + h.kv_offset
        blocked = (j > i) | (j <= i - (h.window or math.inf)) if h.causal else torch.zeros(c.Lq, c.Lk, dtype=torch.bool)
        kw["attn_mask"] = blocked[None, None] | (False if h.padding is None else _hf_padding(c)[:, None, None, :])
    return kw


def run_attention(c: Attention, breaks: frozenset = frozenset()) -> Result:
    """One attention case through ours and the references. `breaks` makes the references wrong on
    purpose (_reference_options; "head_mask", "sinks": dropped), for the self-test."""
    dt, res, t = DTYPES[c.dtype], Result(c), _values(c)
    go, gw = (t["go"][0], t["gw"][0]) if c.call == "sdpa3d" else (t["go"], t["gw"])
    leaves, v = _leaves(c, t, dt, mask64=False)
    out, w, lse = _ours(c, t, v)
    ours = {"out": out, "weights": w, "lse": lse}
    if not c.int8:
        ours.update(_grads([out, w], [go.to(dt), gw.to(dt)], leaves))
    kw = _reference_options(c, breaks)
    # the decode kernel's rows (dispatch.c, decode_applies) over the int8 cache: integer scores from
    # key rows (q as q_int16), integer P V from value rows (p_int16_bound)
    k8, v8 = (t["int8"][n][0] if c.int8 else None for n in "kv")
    pv_i8 = c.int8 and c.Lq <= 16 and not c.need_weights and v8.stride(-1) == 1 and 1 in k8.stride()[-2:]
    decode_i8 = pv_i8 and k8.stride(-1) == 1

    def reference(qkv_dtype, mask64, reorder=False):
        lv, tt = _leaves(c, t, qkv_dtype, mask64)
        q, opts = tt["q"], dict(kw)
        if decode_i8:
            q = q_int16(q.detach(), c.scale).to(qkv_dtype)  # the decode's integer scores read q so
        if reorder:  # q scaled before q k^T: flash-attention's second torch reference
            q, opts["scale"] = q * (kw["scale"] if kw["scale"] is not None else 1.0 / math.sqrt(c.D)), 1.0
        opts.setdefault("attn_mask", tt["am"])
        sinks = None if "sinks" in breaks else tt["sinks"]
        o, p, _, s = attention64(
            q,
            tt["k"],
            tt["v"],
            key_padding_mask=tt["kpm"],
            head_mask=None if "head_mask" in breaks else tt["hm"],
            sinks=sinks,
            dtype=qkv_dtype,
            return_weights=True,
            return_lse=True,
            return_scores=True,
            **opts,
        )
        got = {"p_all": p.detach()}
        p = p if c.need_weights else None
        got |= {"out": o, "weights": p, "lse": _lse64(s, None if sinks is None else sinks.to(qkv_dtype)), "s": s}
        return got | _grads([o, p], [go.to(qkv_dtype), gw.to(qkv_dtype)], lv), tt

    ref, t64 = reference(torch.float64, True)
    theirs = [reference(dt, False)[0], reference(dt, False, reorder=True)[0]]
    if c.call.startswith("sdpa"):  # torch's F.sdpa in the input dtype; a bool mask True = take part
        lv, tt = _leaves(c, t, dt, mask64=False)
        m = tt["am"] if tt["am"] is None or tt["am"].dtype != torch.bool else ~tt["am"]
        if kw["is_causal"]:
            future = torch.ones(c.Lq, c.Lk, dtype=torch.bool).triu(1)
            m = ~future if m is None else m.masked_fill(future, False if m.dtype == torch.bool else -math.inf)
        o = F.scaled_dot_product_attention(tt["q"], tt["k"], tt["v"], m, scale=kw["scale"], enable_gqa=c.H != c.Hkv)
        theirs.append({"out": o} | _grads([o], [go.to(dt)], lv))

    # the natural magnitudes, from the float64 reference's scores
    drop = None
    if "dropout_keep" in kw:
        drop = kw["dropout_keep"].double() / (1.0 - kw["dropout_p"]) * (c.dropout.p < 1)
    hm = None if "head_mask" in breaks or t64["hm"] is None else t64["hm"].detach()
    sinks = None if "sinks" in breaks or t64["sinks"] is None else t64["sinks"].detach()
    four = (lambda x: x[None]) if c.call == "sdpa3d" else (lambda x: x)
    args = (four(ref["s"]), four(ref["lse"]), *(four(t64[n].detach()) for n in "qkv"), t["go"])
    args += (kw["scale"] if kw["scale"] is not None else 1.0 / math.sqrt(c.D),)
    opts = dict(gw=t["gw"] if c.need_weights else None, hm=hm, drop=drop, sinks=sinks)
    expanded = {"d" + n: c.B if lay == "expand" else 1 for n, lay in zip("qkv", c.layout)}

    def maxima(m):  # the mask gradients: the sums of dS over their broadcast dims
        r = {n: _amax(m[n]) * expanded.get(n, 1) for n in ("out", "weights", "lse", "dq", "dk", "dv")}
        r["dam"] = _amax(m["ds"].sum_to_size(t64["am"].shape)) if c.attn_mask is not None else 0.0
        r["dkpm"] = _amax(m["ds"].sum((1, 2)))
        r["dhm"] = _amax(m["dh"].sum(0) if hm is not None and hm.dim() == 1 else m["dh"])
        return r | {"dsinks": _amax(m.get("dsinks", 0.0))}

    nat, nat_acc = (maxima(natural(*args, **opts, sensitivity=sens)) for sens in (False, True))
    dtypes = dict.fromkeys(("out", "weights", "dq", "dk", "dv"), dt) | {"lse": torch.float32 if dt in LOW else dt}
    for n, fname in SPECS.items():  # gradients come in the mask's own dtype
        spec = getattr(c, fname)
        dtypes["d" + n] = _low(_dt(spec.dtype, dt), dt) if spec is not None else dt
    names = [n for n in ("out", "weights") if ref[n] is not None] + (["lse"] if c.return_lse else [])
    if not c.int8:  # an 8-bit cache: inference only
        names += [n for n in ("dq", "dk", "dv", "dam", "dkpm", "dhm", "dsinks") if n in ref or n in ours]
    less = None
    if pv_i8:
        less = {"out": p_int16_bound(ref["p_all"], *t["int8"]["v"])}
    compare(res, names, ours, theirs, ref, dtypes, nat, nat_acc, less)
    return res


# ---- varlen_attn (packed sequences) -----------------------------------------------------------------


def _cu(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)


def run_varlen(c: Varlen, breaks: frozenset = frozenset()) -> Result:
    """One packed batch through varlen_attn and the reference per sequence (attention64 about each
    sequence's bottom-right diagonal). `breaks`: "window", "softcap", "sinks", "alibi" (the
    reference drops it), "seqs" (it takes the batch for one sequence), for the self-test."""
    dt, res = DTYPES[c.dtype], Result(c)
    g = torch.Generator().manual_seed(c.seed)
    Tq, Tk = sum(c.lq), sum(c.lk)
    base = _tensors(g, dt, c.amp, {"q": (Tq, c.H, c.D), "k": (Tk, c.Hkv, c.D), "v": (Tk, c.Hkv, c.Dv)}, c.layout)
    go = rounded(torch.randn((Tq, c.H, c.Dv), generator=g, dtype=torch.float64), dt)
    sinks = (
        None if c.sinks is None else rounded(torch.tensor(c.sinks.values, dtype=torch.float64), _dt(c.sinks.dtype, dt))
    )
    alibi = None if c.alibi is None else torch.tensor(c.alibi, dtype=torch.float32)

    def leaves(qkv_dtype, mask64=False):
        lv = {n: base[n][0].to(qkv_dtype).detach().requires_grad_() for n in "qkv"}
        views = {n: base[n][1](x) for n, x in lv.items()} | {"sinks": None}
        if sinks is not None:
            views["sinks"] = sinks.to(torch.float64 if mask64 else _dt(c.sinks.dtype, dt)).detach()
            if c.sinks.grad:
                lv["sinks"] = views["sinks"].requires_grad_()
        return lv, views

    lv, v = leaves(dt)
    aux = tmf.AuxRequest(lse=True) if c.lse else None
    r = tmf.varlen_attn(
        v["q"],
        v["k"],
        v["v"],
        _cu(c.lq),
        _cu(c.lk),
        max(c.lq) + c.slack_q,
        max(c.lk) + c.slack_k,
        scale=c.scale,
        window_size=c.window,
        enable_gqa=c.enable_gqa,
        return_aux=aux,
        softcap=c.softcap,
        sinks=v["sinks"],
        alibi_slopes=alibi,
    )
    out, lse = r if c.lse else (r, None)
    ours = {"out": out, "lse": lse} | _grads([out], [go.to(dt)], lv, zeros="qkv")  # no query or key: zeros

    lq, lk = ((Tq,), (Tk,)) if "seqs" in breaks else (c.lq, c.lk)
    cq, ck = _cu(lq).tolist(), _cu(lk).tolist()
    scale = c.scale if c.scale is not None else 1.0 / math.sqrt(c.D)
    opts = dict(window=(-1, -1) if "window" in breaks else c.window, softcap=None if "softcap" in breaks else c.softcap)
    use_sinks = "sinks" not in breaks

    def sequences(tt):  # b, (q, k, v) of sequence b as (H, L, D), its ALiBi slopes
        for b in range(len(lq)):
            qs = tt["q"][cq[b] : cq[b + 1]].transpose(0, 1)
            ks, vs = (tt[n][ck[b] : ck[b + 1]].transpose(0, 1) for n in "kv")
            slopes = (
                None if alibi is None or "alibi" in breaks else alibi if alibi.dim() == 1 else alibi[b % len(alibi)]
            )
            yield b, qs, ks, vs, slopes

    def reference(qkv_dtype, mask64, reorder=False):
        lv, tt = leaves(qkv_dtype, mask64)
        sk = tt["sinks"] if use_sinks else None
        outs, lses, ss = [], [], []
        for _, qs, ks, vs, slopes in sequences(tt):
            o, _, s = attention64(
                qs * scale if reorder else qs,
                ks,
                vs,
                scale=1.0 if reorder else scale,
                sinks=sk,
                alibi_slopes=slopes,
                diagonal=ks.shape[1] - qs.shape[1],
                dtype=qkv_dtype,
                return_lse=True,
                return_scores=True,
                **opts,
            )
            outs.append(o.transpose(0, 1))
            lses.append(_lse64(s, None if sk is None else sk.to(qkv_dtype)))
            ss.append(s)
        o = torch.cat(outs)
        got = {"out": o, "lse": torch.cat(lses, -1) if c.lse else None, "s": ss}
        return got | _grads([o], [go.to(qkv_dtype)], lv, zeros="qkv"), tt

    ref, t64 = reference(torch.float64, True)
    theirs = [reference(dt, False)[0], reference(dt, False, reorder=True)[0]]
    sk64 = t64["sinks"].detach() if use_sinks and t64["sinks"] is not None else None
    nat, nat_acc = {}, {}  # per sequence; the maxima over them (dsinks: the sum)
    for (b, qs, ks, vs, _), s in zip(sequences({n: t64[n].detach() for n in "qkv"}), ref["s"]):
        if qs.shape[1] == 0 or ks.shape[1] == 0:
            continue
        gos = go[cq[b] : cq[b + 1]].transpose(0, 1)[None]
        for acc, sens in ((nat, False), (nat_acc, True)):
            m = natural(
                s[None], _lse64(s, sk64)[None], qs[None], ks[None], vs[None], gos, scale, sinks=sk64, sensitivity=sens
            )
            acc.update((n, max(acc.get(n, 0.0), _amax(m[n]))) for n in ("out", "lse", "dq", "dk", "dv"))
            acc["dsinks"] = acc.get("dsinks", 0.0) + m.get("dsinks", 0.0)
    for acc in (nat, nat_acc):
        acc["dsinks"] = _amax(acc.get("dsinks", 0.0))
    names = ["out"] + ["lse"] * c.lse + ["dq", "dk", "dv"] + ["dsinks"] * ("dsinks" in ours or "dsinks" in ref)
    dtypes = dict.fromkeys(names, dt) | {"lse": torch.float32 if dt in LOW else dt}
    dtypes["dsinks"] = _low(_dt(c.sinks.dtype, dt), dt) if c.sinks is not None else dt
    compare(res, names, ours, theirs, ref, dtypes, nat, nat_acc)
    return res


# ---- cross-entropy ----------------------------------------------------------------------------------


def _ce_values(c: CrossEntropy) -> dict:
    """x (storage) and its view, target, weight, dLoss: float64 values rounded to the dtype (class
    targets int64)."""
    dt, g = DTYPES[c.dtype], torch.Generator().manual_seed(c.seed)
    shape, cd = c.shape, 0 if len(c.shape) == 1 else 1
    C, rows = shape[cd], shape[:cd] + shape[cd + 1 :]
    if c.layout == "classlast":  # (N, d.., C) storage viewed as (N, C, d..)
        base, view = rows + (C,), lambda t: t.movedim(-1, 1)
    elif c.layout.startswith("pad"):
        off, extra = map(int, c.layout[3:].split("+"))
        base, view = shape[:cd] + (C + off + extra,) + shape[cd + 1 :], lambda t: t.narrow(cd, off, C)
    else:
        base, view = shape, lambda t: t
    x = rounded(torch.randn(base, generator=g, dtype=torch.float64) * c.amp, dt)
    if c.target == "class":
        tgt = torch.randint(0, C, rows, generator=g)
        target = torch.where(torch.rand(rows, generator=g) < c.ignored, torch.full((), c.ignore_index), tgt)
    elif c.target == "softmax":
        target = rounded(torch.softmax(torch.randn(shape, generator=g, dtype=torch.float64) * 2, dim=cd), dt)
    elif c.target == "rand":
        target = rounded(torch.rand(shape, generator=g, dtype=torch.float64), dt)
    else:
        target = F.one_hot(torch.randint(0, C, rows, generator=g), C).to(torch.float64).movedim(-1, cd)
    weight = rounded(torch.rand(C, generator=g, dtype=torch.float64) * 2 + 0.05, dt) if c.weight else None
    go = rounded(torch.randn(rows if c.reduction == "none" else (), generator=g, dtype=torch.float64), dt)
    return {"x": x, "view": view, "target": target, "weight": weight, "go": go}


@torch.no_grad()
def _ce_natural(c: CrossEntropy, t: dict, ls: float, z: float, cap) -> tuple[dict, dict]:
    """(natural, natural_acc) of the loss and the input gradient, as for attention: the sum of
    |terms| (lse - y_c weighted by the target coefficients, z lse^2; softmax and the target
    coefficients for the gradient), and the error of lse (a sum of C exps, float32 / float64:
    about log2(C) + 1 roundings) and of exp(y_c - lse) at the accumulation type."""
    x = t["view"](t["x"])
    cd = 0 if x.dim() == 1 else 1
    y = x.movedim(cd, -1)  # (rows..., C)
    y = cap * torch.tanh(y / cap) if cap is not None else y
    C = y.shape[-1]
    lse, sm = torch.logsumexp(y, -1), torch.softmax(y, -1)
    w = t["weight"] if t["weight"] is not None else torch.ones(C, dtype=torch.float64)
    if c.target != "class":
        coef = w * ((1 - ls) * t["target"].movedim(cd, -1) + ls / C)
        kept = torch.ones(y.shape[:-1], dtype=torch.float64)
        denom = float(kept.numel())
    else:
        kept = (t["target"] != c.ignore_index).to(torch.float64)
        tc = t["target"].clamp(0, C - 1)
        coef = ls / C * w.expand(y.shape) + (1 - ls) * F.one_hot(tc, C).to(torch.float64) * w[tc][..., None]
        coef, denom = coef * kept[..., None], (w[tc] * kept).sum().item()
    rounds = math.log2(C) + 1
    a = coef.sum(-1) + 2 * z * lse.abs() * kept  # d loss / d lse
    rows = (coef * (lse[..., None].abs() + y.abs())).sum(-1) + z * lse**2 * kept
    go = t["go"].abs()
    if c.reduction == "none":
        loss, loss_acc, g = rows.max().item(), (a * rounds).max().item(), go[..., None]
    else:
        div = 1.0 if c.reduction == "sum" else denom if denom else math.inf
        loss, loss_acc = rows.sum().item() * go.item() / div, (a * rounds).sum().item() * go.item() / div
        g = go if c.reduction == "sum" else go / denom if denom else go * 0
    dx = (g * (a[..., None] * sm + coef)).max().item()
    dx_acc = (g * a[..., None] * sm * ((y - lse[..., None]).abs() + rounds)).max().item()
    return {"loss": loss, "dinput": dx}, {"loss": loss_acc, "dinput": dx_acc}


def run_ce(c: CrossEntropy, breaks: frozenset = frozenset()) -> Result:
    """One cross-entropy case. `breaks`: "label_smoothing", "z_loss", "softcap" (the reference
    drops it), for the self-test."""
    dt, res, t = DTYPES[c.dtype], Result(c), _ce_values(c)

    def call(fn, qdt, **opts):
        x = t["x"].to(qdt).requires_grad_()
        tgt = t["target"].to(qdt) if c.target != "class" else t["target"]
        kw = dict(weight=None if t["weight"] is None else t["weight"].to(qdt), reduction=c.reduction, **opts)
        kw.update({"ignore_index": c.ignore_index} if c.target == "class" else {})
        loss = fn(t["view"](x), tgt, **kw)
        return {"loss": loss, "dinput": torch.autograd.grad(loss, x, t["go"].to(qdt))[0]}

    ours = call(tmf.cross_entropy, dt, label_smoothing=c.label_smoothing, z_loss=c.z_loss, softcap=c.softcap)
    ls = 0.0 if "label_smoothing" in breaks else c.label_smoothing
    z = 0.0 if "z_loss" in breaks else c.z_loss
    cap = None if "softcap" in breaks else c.softcap
    ref, theirs = (call(cross_entropy64, qdt, label_smoothing=ls, z_loss=z, softcap=cap) for qdt in (torch.float64, dt))
    compare(res, ("loss", "dinput"), ours, [theirs], ref, {"loss": dt, "dinput": dt}, *_ce_natural(c, t, ls, z, cap))
    return res


# ---- driving ------------------------------------------------------------------------------------------

RUN = {Attention: run_attention, Varlen: run_varlen, CrossEntropy: run_ce}
KIND = {Attention: "attention", Varlen: "varlen", CrossEntropy: "ce"}


def check(case, isa: str | None = None, breaks: frozenset = frozenset()) -> Result:
    """Run the case on `isa` (None: the CPU's default); an exception is a problem too."""
    try:
        with ops.use_isa(isa):
            return RUN[type(case)](case, breaks)
    except Exception as e:
        tb = traceback.format_exc(limit=-3).strip().splitlines()
        return Result(case, [f"exception {type(e).__name__}: {str(e)[:300]}", *tb[-4:]])


@dataclass
class Finding:
    isa: str
    result: Result
    note: str = ""

    def __str__(self):
        lit, note = repr(self.result.case), f" ({self.note})" if self.note else ""
        return "\n    ".join(
            [f"FINDING [{self.isa}] {KIND[type(self.result.case)]}{note}", *self.result.problems, f"case: {lit}"]
            + [f'replay: python tools/fuzz.py --replay "{lit}" --isa {self.isa}']
            + [f"regression (tests/project/test_fuzz.py): @example(case={lit})"]
        )


@functools.lru_cache(maxsize=4096)
def assert_clean(case, isa: str | None = None) -> None:
    """For a test: raise AssertionError with the finding unless the case is clean on isa (a case
    Hypothesis draws again is not run again)."""
    res = check(case, isa)
    if res.problems:
        raise AssertionError(str(Finding(isa or "default", res)))


class _TimeUp(BaseException):  # not an Exception: Hypothesis ends the run at once, shrinks nothing
    pass


def search(strategy, isa, *, max_examples: int, seed=None, breaks=frozenset(), deadline=None, on_case=None):
    """One Hypothesis run: up to max_examples cases of the strategy on isa (seed None:
    derandomized) until `deadline` (time.monotonic()); the first failing case is shrunk. Returns
    the Finding of the smallest failing case, or None. on_case(result, shrinking) is called for
    every distinct case run."""
    failing, seen = [], {}

    @settings(
        max_examples=max_examples,
        derandomize=seed is None,
        deadline=None,
        database=None,
        print_blob=False,
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
        verbosity=Verbosity.quiet,
        phases=(Phase.explicit, Phase.generate, Phase.shrink),
    )
    @given(strategy)
    def prop(case):
        if deadline is not None and not failing and time.monotonic() > deadline:
            raise _TimeUp
        if case not in seen:  # different draws can make the same case: run it once
            seen[case] = check(case, isa, breaks)
            if on_case:
                on_case(seen[case], bool(failing))
        if seen[case].problems:
            failing.append(seen[case])
            raise AssertionError("\n".join(seen[case].problems))

    note = ""
    try:
        (prop if seed is None else hypothesis.seed(seed)(prop))()
    except (AssertionError, _TimeUp):
        pass
    except Exception as e:  # e.g. Flaky: the failure did not reproduce
        note = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return Finding(isa or "default", failing[-1], note) if failing else None


def sample(strategy, n: int, seed: int = 0) -> list:
    """n cases of the strategy, unrun: the same every time (Hypothesis seeded with `seed`)."""
    got = []

    @hypothesis.seed(seed)
    @settings(max_examples=n, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(case):
        got.append(case)

    collect()
    return got


def available_isas() -> list[str]:
    return [n for n in ISAS if ops.isa_available(n)]


def _f32_backward(res) -> bool:
    """Did the case check a float32 attention gradient (dq, dk, dv, a mask's, ...)?"""
    return any(m[0].startswith("d") and m[0] != "dinput" and m[1] == torch.float32 for m in res.metrics)


def fuzz(
    isas, seconds: float, master: int = 0, kinds=KINDS, log=print, progress_every: float = 30.0, dtype=None
) -> dict:
    """Each ISA for `seconds`: Hypothesis runs of up to BATCH cases, the kinds in turn (dtype:
    only that one), run i seeded with master and i (the same runs on every ISA). A finding is
    printed once; a run that shrinks to the same case again counts it. Returns {"cases": {isa:
    {kind: n, "f32 backward": n}}, "shrinking":
    {isa: n}, "seconds": {isa: s}, "findings": [Finding], "found": {(isa, case literal): times},
    "closest": {isa: (err / bound, name, case) of the clean case closest to its bound}}."""
    stats = {"cases": {}, "shrinking": {}, "seconds": {}, "findings": [], "found": {}, "closest": {}}
    for isa in isas:
        n, t0 = stats["cases"].setdefault(isa, dict.fromkeys((*kinds, "f32 backward"), 0)), time.monotonic()
        stats["shrinking"][isa], last, i = 0, [t0], 0

        def on_case(res, shrinking, isa=isa, n=n, t0=t0, last=last):
            stats["shrinking"][isa] += shrinking
            n[KIND[type(res.case)]] += not shrinking
            n["f32 backward"] += not shrinking and _f32_backward(res)
            for name, _, err, e_t, slack in res.metrics if not res.problems else ():
                ratio = err / (2 * e_t + slack) if err else 0.0
                if ratio > stats["closest"].get(isa, (0.0,))[0]:
                    stats["closest"][isa] = (ratio, name, res.case)
            if log and time.monotonic() - last[0] >= progress_every:
                last[0] = time.monotonic()
                log(f"[{isa}] {last[0] - t0:5.0f} s: {_counts(n)}, {len(stats['findings'])} findings")

        while time.monotonic() - t0 < seconds:
            strategy = STRATEGIES[kinds[i % len(kinds)]](**({"dtype": dtype} if dtype else {}))
            f = search(
                strategy, isa, max_examples=BATCH, seed=master * 1_000_003 + i, deadline=t0 + seconds, on_case=on_case
            )
            i += 1
            if f is not None:
                key = (isa, repr(f.result.case))
                stats["found"][key] = stats["found"].get(key, 0) + 1
                if stats["found"][key] == 1:
                    stats["findings"].append(f)
                    if log:
                        log(str(f))
        stats["seconds"][isa] = time.monotonic() - t0
    return stats


def _counts(n: dict) -> str:
    kinds = {k: v for k, v in n.items() if k != "f32 backward"}
    return f"{sum(kinds.values())} cases (" + ", ".join(f"{k} {v}" for k, v in n.items()) + ")"


def summary(stats: dict) -> str:
    per = "; ".join(
        f"{isa}: {_counts(n)} in {stats['seconds'][isa]:.0f} s, {stats['shrinking'][isa]} more while shrinking, "
        "the clean case closest to its bound at {:.2f} of it ({}: {!r})".format(*stats["closest"].get(isa, (0, "", "")))
        for isa, n in stats["cases"].items()
    )
    again = sum(stats["found"].values()) - len(stats["findings"])
    return f"fuzz summary: {per}; findings {len(stats['findings'])}" + (f" ({again} found again)" if again else "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="per ISA")
    ap.add_argument("--isa", default="all", choices=ISAS + ("all",))
    ap.add_argument("--seed", type=int, default=None, help="master seed (default: from the clock)")
    ap.add_argument("--kind", default="all", choices=KINDS + ("all",))
    ap.add_argument("--dtype", default=None, choices=tuple(DTYPES), help="draw only this dtype")
    ap.add_argument("--replay", default=None, metavar="CASE", help="run one case (a finding's literal), verbosely")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (1: small cases run faster)")
    a = ap.parse_args(argv)
    torch.set_num_threads(max(1, a.threads))
    if a.isa != "all" and not ops.isa_available(a.isa):
        print(f"fuzz: this CPU does not run the {a.isa} kernels (it runs {', '.join(available_isas())})")
        return 2
    isas = available_isas() if a.isa == "all" else [a.isa]
    if a.replay is not None:
        case, bad = parse_case(a.replay), False
        for isa in isas:
            res = check(case, isa)
            print("\n    ".join([f"[{isa}] {case!r}", *res.lines, str(Finding(isa, res)) if res.problems else "ok"]))
            bad = bad or bool(res.problems)
        return 1 if bad else 0
    if HF is None:
        print("fuzz: transformers is not installed: no cases through the Hugging Face backend")
    master = a.seed if a.seed is not None else int(time.time())
    kinds = KINDS if a.kind == "all" else (a.kind,)
    print(
        f"fuzz: seed {master}, {a.seconds:g} s per ISA on {', '.join(isas)}, kinds {', '.join(kinds)}, "
        f"dtype {a.dtype or 'all'}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}, hypothesis {hypothesis.__version__}",
        flush=True,
    )
    stats = fuzz(isas, a.seconds, master, kinds, log=lambda s: print(s, flush=True), dtype=a.dtype)
    print(summary(stats), flush=True)
    return 1 if stats["findings"] else 0


if __name__ == "__main__":
    sys.exit(main())
