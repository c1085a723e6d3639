#!/usr/bin/env python3
"""Differential fuzzer: attention and cross-entropy against a float64 reference.

    python tools/fuzz.py --seconds N [--isa scalar|avx2|avx512|amx|all] [--seed S]
                         [--kind attention|ce|all] [--threads T (default 1)]
    python tools/fuzz.py --replay SEED [--isa ...]      # one case, verbose

Each ISA (kernel variant forced with torch_masked_attn.ops.use_isa) runs the
same seeded sequence of random cases for N seconds. A case is fully determined
by its seed (its kind: KINDS[seed % 3]), so every finding prints the
seed it can be replayed with.

Attention: torch_masked_attn.functional.masked_attention (random B, H, GQA,
Lq, Lk, D, Dv with the 64-wide tile edges often, every dtype, transposed /
sliced / expanded views, bool and float attn_mask of every broadcast shape,
key padding with fully padded rows, head mask, causal, scale, need_weights,
return_lse, gradients of q, k, v and of the float masks / head mask that
require grad), sliding windows (either side None / -1 / 0 / around L),
causal and windows about another diagonal (diagonal=: bottom-right or any
offset), softcap, attention sinks (+ their gradient), dropout (an explicit
dropout_seed; the reference applies the keep mask re-implemented from its
definition, Philox-4x32-10, so values and gradients are compared exactly as
without dropout), now and then the F.scaled_dot_product_attention drop-in,
and now and then the Hugging Face backend (torch_masked_attn.hf.
attention_forward, with no mask, a 4-D mask, or a StructuredMask: causal /
sliding window on an offset diagonal, padding; softcap and s_aux sinks),
where transformers is installed, and now and then an 8-bit KV cache (k, v
quantized by quantize_kv in their drawn layout; the references attend to the
dequantized values; no gradients).
Cross-entropy: torch_masked_attn.functional.cross_entropy ((C,), (N, C),
(N, C, d1[, d2]); class targets with ignore_index anywhere, probability
targets, weight, label smoothing, every reduction, z_loss and softcap), loss
and input gradient.

Tolerance (flash-attention's rule), per compared tensor:

    max|ours - ref64| <= 2 * max|torch_dtype - ref64|
                         + REL_SLACK[dtype] * max|ref64|
                         + REL_SLACK[acc] * (natural + natural_acc)

ref64 is the same math with plain torch ops in float64 on the very same
(rounded) values; torch_dtype is that computation done by torch in the input
dtype (plain ops, also with q scaled before q k^T, and torch's
F.scaled_dot_product_attention / F.cross_entropy where they apply; the largest
of their errors counts). The slack covers the cases where torch happens to be
exact: about half an ulp of the result's largest value in the input dtype,
and, at the accumulation type acc (float32; float64 for float64), the
tensor's natural magnitude (the sum of |terms| it is computed from, which
stays large where the result cancels, e.g. dq = 0 for a query that sees a
single key) and the error that rounding the scores makes through exp. NaN must
appear where ref64 has NaN and nowhere else (equal infinities count as equal).
Calibrated on 5,000 cases per ISA (scalar, avx2): the worst clean case uses
about 0.6 of the slack, and a reference with causal flipped, the head mask
dropped, the scale doubled or a cross-entropy option dropped gives findings
(tests/project/test_fuzz.py).

Exit status 1 if there is any finding.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import random
import sys
import time
import traceback
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import torch_masked_attn  # noqa: F401  (registers the ops)
from torch_masked_attn import functional as tmf
from torch_masked_attn import ops

try:  # the Hugging Face backend, where transformers is installed
    from torch_masked_attn import hf as _HF
except ImportError:
    _HF = None

ISAS = ops.built_isas()
KINDS = ("attention", "ce", "varlen")  # a case's kind: KINDS[seed % 3]
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
LOW = (torch.bfloat16, torch.float16)

# Slack added to 2x torch's own error, relative (see the module docstring).
REL_SLACK = {
    torch.float64: 1e-12,
    torch.float32: 1e-6,
    torch.float16: 5e-4,
    torch.bfloat16: 2e-3,
}

DT_NAME = {torch.float32: "f32", torch.float64: "f64", torch.bfloat16: "bf16", torch.float16: "f16"}


@dataclass
class Finding:
    seed: int
    kind: str
    isa: str
    desc: str
    problems: list[str]

    def __str__(self):
        return (
            f"FINDING [{self.isa}] seed={self.seed}: {self.desc}\n    "
            + "\n    ".join(self.problems)
            + f"\n    replay: python tools/fuzz.py --replay {self.seed} --isa {self.isa}"
        )


@dataclass
class Result:
    """What one case gave: problems (name, message, is_gradient) and the description."""

    desc: str
    problems: list[tuple[str, str, bool]] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)  # every comparison, for --replay
    metrics: list[tuple] = field(default_factory=list)  # (name, dtype, err, torch's err, slack)


# ---- comparison ---------------------------------------------------------------


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b|; equal infinities and NaN against NaN count as 0, any other
    non-finite difference as inf."""
    a, b = a.detach().double(), b.detach().double()
    if a.shape != b.shape:
        return math.inf
    if a.numel() == 0:
        return 0.0
    same = (a == b) | (a.isnan() & b.isnan())
    d = torch.where(same, torch.zeros((), dtype=torch.float64), (a - b).abs())
    return torch.nan_to_num(d, nan=math.inf).max().item()


def magnitude(t: torch.Tensor) -> float:
    t = t.detach().double().abs()
    t = t[torch.isfinite(t)]
    return t.max().item() if t.numel() else 0.0


def compare(
    res: Result,
    name: str,
    ours,
    theirs: list,
    ref,
    dtype,
    is_grad: bool,
    natural: float = 0.0,
    natural_acc: float = 0.0,
):
    """Append a problem to res unless ours is within the rule of ref (see the
    module docstring). The slack is REL_SLACK[dtype] * max|ref| (the result's
    own rounding) + REL_SLACK[acc] * (natural + natural_acc), acc the
    accumulation type (float32; float64 for float64): `natural` is the
    tensor's natural magnitude, the sum of the absolute values of the terms it
    is computed from, `natural_acc` the error that rounding the scores makes
    through exp. The kernels accumulate in acc, so these scale with acc's
    precision, not the input's; they matter where the result cancels (a query
    that sees one key has dq = 0 exactly) and torch's error happens to be 0."""
    if ref is None:
        if ours is not None and ours.abs().max().item() != 0:
            res.problems.append((name, f"{name}: expected no gradient, got one", is_grad))
        return
    if ours is None:
        res.problems.append((name, f"{name}: got None, expected shape {tuple(ref.shape)}", is_grad))
        return
    if tuple(ours.shape) != tuple(ref.shape):
        res.problems.append((name, f"{name}: shape {tuple(ours.shape)} != {tuple(ref.shape)}", is_grad))
        return
    e_ours = max_err(ours, ref)
    e_theirs = [max_err(t, ref) for t in theirs if t is not None]
    e_theirs = [e for e in e_theirs if math.isfinite(e)]
    e_t = max(e_theirs) if e_theirs else 0.0
    mag = magnitude(ref)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    slack = REL_SLACK[dtype] * mag + REL_SLACK[acc] * (natural + natural_acc)
    bound = 2.0 * e_t + slack
    line = (
        f"{name}: err {e_ours:.3g} bound {bound:.3g} (torch {e_t:.3g}, max|ref| {mag:.3g}, "
        f"natural {natural:.3g} + {natural_acc:.3g})"
    )
    res.lines.append(line)
    res.metrics.append((name, dtype, e_ours, e_t, slack))
    if not e_ours <= bound:
        res.problems.append((name, line, is_grad))


# ---- layouts: a tensor as a view of a differently shaped base ------------------


def draw_layout(r: random.Random, shape: tuple, allow_expand: bool = True):
    """(name, base shape, view function) for a 4-D tensor of `shape`."""
    B, H, L, D = shape
    opts = ["contig", "contig", "blhd", "pad", "step", "swap"]
    if allow_expand and B > 1:
        opts.append("expand")
    name = r.choice(opts)
    if name == "blhd":  # (B, L, H, D) storage, one linear projection viewed per head
        return name, (B, L, H, D), lambda t: t.transpose(1, 2)
    if name == "pad":  # a slice of a wider last dim, at an offset
        off = r.randint(0, 3)
        return f"pad{off}", (B, H, L, D + off + r.randint(0, 5)), lambda t: t[..., off : off + D]
    if name == "step":  # every other row
        return name, (B, H, 2 * L, D), lambda t: t[:, :, ::2]
    if name == "swap":  # the last two dims transposed (D not unit-stride)
        return name, (B, H, D, L), lambda t: t.transpose(-1, -2)
    if name == "expand":  # zero batch stride
        return name, (1, H, L, D), lambda t: t.expand(B, H, L, D)
    return name, shape, lambda t: t


def rounded(t: torch.Tensor, dtype) -> torch.Tensor:
    """float64 values exactly representable in dtype."""
    return t.to(dtype).to(torch.float64)


# ---- attention ------------------------------------------------------------------


def _length(r):
    x = r.random()
    if x < 0.3:
        return r.choice((63, 64, 65))
    if x < 0.45:
        return r.randint(1, 8)
    if x < 0.5:
        return r.choice((127, 128, 129))
    return r.randint(1, 150)


def _dim(r):
    x = r.random()
    if x < 0.35:
        return r.choice((1, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 130))
    if x < 0.5:
        return r.randint(1, 8)
    return r.randint(1, 130)


def draw_attention(seed: int, force: dict | None = None) -> dict:
    """The parameters and float64 values of one attention case (all but the
    seed's randomness can be overridden by `force`, for the self-tests)."""
    r = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    force = force or {}
    c: dict = {"seed": seed}
    c["dtype"] = dtype = force.get("dtype", r.choice(DTYPES))
    c["B"] = B = r.randint(1, 3)
    H = r.randint(1, 4)
    c["H"], c["Hkv"] = H, r.choice([d for d in range(1, H + 1) if H % d == 0])
    Lq, Lk = _length(r), _length(r)
    D = _dim(r)
    Dv = D if r.random() < 0.4 else _dim(r)
    dec = _draw_decode(seed, force)
    c["decode"] = dec is not None
    c["splits"] = dec[0] if dec else None
    if dec:  # the decode kernel over several key chunks, mostly with grouped query heads
        Lq, Lk = dec[1]
        D, Dv = min(D, 64), min(Dv, 64)
        H, c["Hkv"] = dec[2]
        c["H"] = H
    # keep one case around 10 ms: shrink the largest of L, D while B*H*Lq*Lk*(D+Dv) is big
    while B * H * Lq * Lk * (D + Dv) > 12_000_000:
        if c["decode"] and D + Dv > 2:
            D, Dv = max(1, D // 2), max(1, Dv // 2)
        elif Lq >= Lk and Lq > 8:
            Lq = max(1, Lq // 2)
        elif Lk > 8:
            Lk = max(1, Lk // 2)
        else:
            D, Dv = max(1, D // 2), max(1, Dv // 2)
    c["Lq"], c["Lk"], c["D"], c["Dv"] = Lq, Lk, D, Dv
    c["sdpa"] = sdpa = force.get("sdpa", r.random() < 0.15 and not (force.get("head_mask") or force.get("kpm")))
    c["nobatch"] = sdpa and B == 1 and r.random() < 0.3
    Hkv = c["Hkv"]
    amp = r.choice((0.5, 1.0, 1.0, 2.0))
    tensors = {}
    for name, shape in (("q", (B, H, Lq, D)), ("k", (B, Hkv, Lk, D)), ("v", (B, Hkv, Lk, Dv))):
        lname, base, view = draw_layout(r, shape)
        vals = rounded(torch.randn(base, generator=g, dtype=torch.float64) * (amp if name != "v" else 1.0), dtype)
        tensors[name] = (lname, vals, view)
    c["tensors"] = tensors

    # attn_mask: none / bool / float, of a random broadcastable shape
    c["am"] = None
    x = r.random()
    am_kind = force.get("attn_mask", "none" if x < 0.4 else "bool" if x < 0.7 else "float")
    if am_kind != "none":
        shapes = {
            "(Lq,Lk)": (Lq, Lk),
            "(B,1,Lq,Lk)": (B, 1, Lq, Lk),
            "(1,H,Lq,Lk)": (1, H, Lq, Lk),
            "(B,H,Lq,Lk)": (B, H, Lq, Lk),
        }
        sname = r.choice(list(shapes))
        shape = shapes[sname]
        swap = r.random() < 0.25
        base = shape[:-2] + (shape[-1], shape[-2]) if swap else shape
        p_block = r.choice((0.0, 0.1, 0.3, 0.6, 0.95))
        blocked = torch.rand(base, generator=g) < p_block
        if am_kind == "bool":
            vals, mdt, rg = blocked, torch.bool, False
        else:
            mdt = r.choice((dtype, torch.float32, dtype))
            vals = torch.randn(base, generator=g, dtype=torch.float64) * r.choice((0.5, 2.0))
            vals = rounded(vals.masked_fill(blocked, -math.inf), mdt)
            rg = r.random() < 0.4
        c["am"] = {
            "shape": sname,
            "kind": am_kind,
            "vals": vals,
            "dtype": mdt,
            "rg": rg,
            "swap": swap,
            "view": (lambda t: t.transpose(-1, -2)) if swap else (lambda t: t),
        }

    # key padding (B, Lk): prefix lengths, 0 (fully padded) and Lk included; rarely float
    c["kpm"] = None
    if not sdpa and (force.get("kpm") or r.random() < 0.35):
        lens = [r.choice((0, Lk, r.randint(0, Lk), r.randint(max(0, Lk - 3), Lk))) for _ in range(B)]
        blocked = torch.arange(Lk)[None, :] >= torch.tensor(lens)[:, None]
        if r.random() < 0.15:  # a random pattern rather than a prefix
            blocked = torch.rand(B, Lk, generator=g) < 0.5
            lens = "random"
        if r.random() < 0.15:
            mdt = r.choice((dtype, torch.float32))
            vals = torch.randn(B, Lk, generator=g, dtype=torch.float64).masked_fill(blocked, -math.inf)
            c["kpm"] = {"kind": "float", "vals": rounded(vals, mdt), "dtype": mdt, "rg": r.random() < 0.5, "lens": lens}
        else:
            c["kpm"] = {"kind": "bool", "vals": blocked, "dtype": torch.bool, "rg": False, "lens": lens}

    # head mask (H,) or (B, H)
    c["hm"] = None
    if not sdpa and (force.get("head_mask") or r.random() < 0.3):
        shape = (H,) if r.random() < 0.5 else (B, H)
        mdt = r.choice((dtype, torch.float32))
        vals = torch.rand(shape, generator=g, dtype=torch.float64) * 2
        vals = torch.where(torch.rand(shape, generator=g) < 0.2, torch.ones(()), vals)
        vals = torch.where(torch.rand(shape, generator=g) < 0.1, torch.zeros(()), vals)
        if force.get("head_mask"):  # the self-test needs it away from 1
            vals = vals * 0.5 + 0.25
        c["hm"] = {
            "shape": "(H,)" if len(shape) == 1 else "(B,H)",
            "vals": rounded(vals, mdt),
            "dtype": mdt,
            "rg": r.random() < 0.5,
        }

    c["causal"] = force.get("is_causal", r.random() < 0.3)
    c["scale"] = None if r.random() < 0.5 else round(r.uniform(0.02, 2.0), 3)
    c["need_weights"] = not sdpa and r.random() < 0.2
    c["return_lse"] = not sdpa and r.random() < 0.2
    go_shape = (B, H, Lq, Dv)
    c["go"] = rounded(torch.randn(go_shape, generator=g, dtype=torch.float64), dtype)
    c["gw"] = rounded(torch.randn((B, H, Lq, Lk), generator=g, dtype=torch.float64), dtype)
    _draw_new_options(c, r, g, force)
    c["diagonal"] = _draw_diagonal(seed, c, force)
    return c


def _window_side(r, L):
    x = r.random()
    if x < 0.2:
        return r.choice((None, -1))
    if x < 0.4:
        return r.choice((0, 1, 2))
    if x < 0.55:
        return r.choice((max(0, L - 2), L - 1, L, L + 3))  # around the point where the side stops mattering
    return r.randint(0, max(1, L))


def _draw_decode(seed: int, force: dict):
    """Now and then (15% of attention seeds) a decode over several key chunks: Lq 1-16 query
    rows of 1-8 query heads, each key head's G > 1 query heads stacked as one block of rows
    (but where H = 1), over Lk past one MA_DECODE_CHUNK (512 keys), the key chunks split between a forced
    number of work items (ops.decode_splits: None is the plan's rule). Drawn from a
    generator of its own, so a seed that draws no decode draws what it drew before.
    Returns None or (splits, (Lq, Lk), (H, Hkv))."""
    d = random.Random(seed ^ 0xDEC0DE3)  # (no replayed seed in tests/project/test_fuzz.py draws one)
    if not force.get("decode", d.random() < 0.15):
        return None
    Lq = d.choice((1, 1, 1, 2, 4, 8, 16, d.randint(1, 16)))
    Lk = d.choice((513, 1024, 1537, d.randint(600, 2600)))
    H = d.choice((2, 4, 6, 8, d.randint(1, 8)))
    Hkv = d.choice([g for g in range(1, H + 1) if H % g == 0 and (g < H or H == 1)])
    return force.get("splits", d.choice((None, 1, 2, 4, 16))), (Lq, Lk), (H, Hkv)


def _draw_diagonal(seed: int, c: dict, force: dict) -> int:
    """Now and then (a quarter of the masked_attention calls with is_causal or a window) a
    diagonal other than the top-left one (masked_attention's diagonal=): bottom-right, Lk - Lq,
    or any offset from -Lq to Lk. Drawn from a generator of its own, so the rest of a seed's draw
    is what it was before."""
    d = random.Random(seed ^ 0xD1A60)
    if c["sdpa"] or c["hf"] or not (c["causal"] or c["window"] is not None):
        return 0
    if not force.get("diagonal_draw", d.random() < 0.25):
        return 0
    Lq, Lk = c["Lq"], c["Lk"]
    return force.get("diagonal", d.choice((Lk - Lq, Lk - Lq, d.randint(-Lq, Lk), d.randint(-3, 3))))


def _draw_new_options(c: dict, r: random.Random, g: torch.Generator, force: dict):
    """The options that landed after the fuzzer (issues 14, 15, the HF backend):
    window, softcap, sinks, dropout, and now and then the call through
    torch_masked_attn.hf.attention_forward. Drawn after everything else, so
    that the rest of a seed's draw is what it was before they existed."""
    dtype, B, H, Lq, Lk = c["dtype"], c["B"], c["H"], c["Lq"], c["Lk"]
    sdpa = c["sdpa"]
    c["window"] = c["softcap"] = c["sinks"] = c["dropout"] = c["hf"] = None
    c["hf"] = None
    hf = not sdpa and _HF is not None and force.get("hf", r.random() < 0.1)
    if not sdpa and not hf and force.get("window", r.random() < 0.3):
        c["window"] = (_window_side(r, Lq), _window_side(r, Lk))
    if not sdpa and force.get("softcap", r.random() < 0.2):
        c["softcap"] = force.get("softcap_value", r.choice((round(r.uniform(0.3, 5.0), 2), 20.0)))
    if not sdpa and force.get("sinks", r.random() < 0.2):
        sdt = r.choice((dtype, torch.float32))
        vals = torch.randn(H, generator=g, dtype=torch.float64) * r.choice((0.5, 2.0))
        if r.random() < 0.2:
            vals = vals + 8.0  # a sink that takes most of the mass
        c["sinks"] = {"vals": rounded(vals, sdt), "dtype": sdt, "rg": r.random() < 0.7}
    if not sdpa and not hf and force.get("dropout", r.random() < 0.15):
        p = force.get(
            "dropout_p",
            r.choice((0.1, 0.3, 0.5, 0.9, round(r.uniform(0.01, 0.99), 3), 1.0 if r.random() < 0.1 else 0.2)),
        )
        seed = torch.tensor([r.getrandbits(63) - (1 << 62), r.getrandbits(63) - (1 << 62)], dtype=torch.int64)
        c["dropout"] = {"p": p, "seed": seed}
    if hf:
        # transformers' calling convention: no key padding / head mask / lse; the
        # mask is None (the layer's is_causal, not for one query), a 4-D tensor
        # (bool True = attend) or a StructuredMask (causal / sliding with an
        # offset diagonal, padding)
        c["kpm"] = c["hm"] = None
        c["need_weights"] = c["return_lse"] = False
        h = {"module_causal": c["causal"], "mask": "tensor" if c["am"] is not None else "none"}
        if c["am"] is None and r.random() < 0.6:
            lens = [r.choice((Lk, r.randint(0, Lk))) for _ in range(B)]
            pad = torch.arange(Lk)[None, :] >= torch.tensor(lens)[:, None]
            h.update(
                mask="structured",
                causal=r.random() < 0.8,
                q_offset=r.choice((0, max(0, Lk - Lq), r.randint(0, Lk + 3))),
                kv_offset=r.choice((0, 0, r.randint(0, 5))),
                padding=pad if r.random() < 0.5 and bool(pad.any()) else None,
                lens=lens,
            )
            h["window"] = r.choice((None, 1, 2, r.randint(1, Lk + 2))) if h["causal"] else None
        c["hf"] = h
        c["causal"] = h["mask"] == "none" and h["module_causal"] and Lq > 1
    # drawn last: every other draw of a seed is what it was before
    c["int8"] = None
    if not sdpa and not hf and dtype != torch.float64 and force.get("int8", r.random() < 0.1):
        _draw_int8(c)


def _draw_int8(c: dict) -> None:
    """An 8-bit KV cache (issue 40): k and v quantized by quantize_kv in their drawn layouts
    (an expanded one is left as it is: no int8 then), and the case's float64 k, v replaced by
    the dequantized values, which the references then attend to. Inference only: no
    gradients are compared."""
    got = {}
    for n in ("k", "v"):
        lname, vals, view = c["tensors"][n]
        x = view(vals.to(c["dtype"]))
        if 0 in x.stride():
            return
        xq, xs = tmf.quantize_kv(x)
        base_q = torch.empty(vals.shape, dtype=torch.int8)
        view(base_q).copy_(xq)  # the drawn layout of k (or v), in int8; the scales contiguous
        deq = torch.empty_like(vals)
        view(deq).copy_(xq.double() * xs.double()[..., None])
        got[n] = (view(base_q), xs)
        c["tensors"][n] = (lname, deq, view)
    c["int8"] = got


def describe_attention(c: dict) -> str:
    s = [
        f"attention{' sdpa' if c['sdpa'] else ''}{' hf' if c['hf'] else ''}{' 3-D' if c['nobatch'] else ''} "
        f"{DT_NAME[c['dtype']]}",
        f"B={c['B']} H={c['H']} Hkv={c['Hkv']} Lq={c['Lq']} Lk={c['Lk']} D={c['D']} Dv={c['Dv']}",
        "layout=" + ",".join(f"{n}:{t[0]}" for n, t in c["tensors"].items()),
    ]
    if c.get("decode"):
        s.append(f"decode splits={c['splits']}")
    if c["am"]:
        a = c["am"]
        s.append(
            f"attn_mask={a['kind']}{'/' + DT_NAME[a['dtype']] if a['kind'] == 'float' else ''}"
            f"{a['shape']}{'^T' if a['swap'] else ''}{'+grad' if a['rg'] else ''}"
        )
    if c["kpm"]:
        k = c["kpm"]
        s.append(f"kpm={k['kind']} lens={k['lens']}{'+grad' if k['rg'] else ''}")
    if c["hm"]:
        h = c["hm"]
        vals = [round(x, 3) for x in h["vals"].flatten().tolist()]
        s.append(f"head_mask{h['shape']}={vals}{'+grad' if h['rg'] else ''}")
    if c["causal"]:
        s.append("causal")
    if c.get("diagonal"):
        s.append(f"diagonal={c['diagonal']}")
    if c["scale"] is not None:
        s.append(f"scale={c['scale']}")
    if c["need_weights"]:
        s.append("need_weights")
    if c["return_lse"]:
        s.append("return_lse")
    if c["window"] is not None:
        s.append(f"window={c['window']}")
    if c["softcap"] is not None:
        s.append(f"softcap={c['softcap']}")
    if c["sinks"] is not None:
        sk = c["sinks"]
        s.append(
            f"sinks/{DT_NAME[sk['dtype']]}={[round(x, 3) for x in sk['vals'].tolist()]}{'+grad' if sk['rg'] else ''}"
        )
    if c["dropout"] is not None:
        s.append(f"dropout_p={c['dropout']['p']} seed={c['dropout']['seed'].tolist()}")
    if c.get("int8"):
        s.append("int8 k/v cache")
    if c["hf"]:
        h = c["hf"]
        if h["mask"] == "structured":
            s.append(
                f"hf_mask=structured(causal={h['causal']}, window={h['window']}, q_offset={h['q_offset']}, "
                f"kv_offset={h['kv_offset']}, padding={'lens=' + str(h['lens']) if h['padding'] is not None else None})"
            )
        else:
            s.append(f"hf_mask={h['mask']} module.is_causal={h['module_causal']}")
    return " ".join(s)


# ---- dropout's keep mask, re-implemented from its definition (masked_attn.h) ----

_M32 = 0xFFFFFFFF


def _philox(c0, c1, c2, c3, k0, k1):
    """Philox-4x32-10 on int64 tensors holding uint32 values (as tests/reference.py;
    tests/attention/test_dropout.py checks it against Random123's known answers)."""
    c = list(torch.broadcast_tensors(*(torch.as_tensor(x, dtype=torch.int64) for x in (c0, c1, c2, c3))))
    k0, k1 = k0 & _M32, k1 & _M32
    for _ in range(10):
        p0, p1 = c[0] * 0xD2511F53, c[2] * 0xCD9E8D57
        hi0, lo0, hi1, lo1 = (p0 >> 32) & _M32, p0 & _M32, (p1 >> 32) & _M32, p1 & _M32
        c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
        k0, k1 = (k0 + 0x9E3779B9) & _M32, (k1 + 0xBB67AE85) & _M32
    return c


def keep_mask(seed_tensor: torch.Tensor, B: int, H: int, Lq: int, Lk: int, p: float) -> torch.Tensor:
    """Z[b, h, i, j] (True = kept) of dropout with this (seed, offset): element
    (b, h, i, j) keeps iff 16 bits of Philox(counter (j >> 3, i, b H + h, offset),
    key (seed_lo, seed_hi ^ offset_hi)) are >= round(p 2^16)."""
    seed, offset = (int(x) & ((1 << 64) - 1) for x in seed_tensor.tolist())
    k0, k1 = seed & _M32, (seed >> 32) ^ (offset >> 32)
    b, h, i, j = torch.meshgrid(*(torch.arange(n) for n in (B, H, Lq, Lk)), indexing="ij")
    w = torch.stack(_philox(j >> 3, i, (b * H + h) & _M32, offset & _M32, k0, k1), -1)
    sel = torch.gather(w, -1, ((j & 7) >> 1).unsqueeze(-1)).squeeze(-1)
    return ((sel >> (16 * (j & 1))) & 0xFFFF) >= round(p * 65536)


def _dropout_scale(c: dict, breaks: frozenset):
    """Z / (1 - p) as float64 (B, H, Lq, Lk) (0 where dropped; all 0 for p = 1),
    or None without dropout (or when the reference drops it on purpose)."""
    d = c["dropout"]
    if d is None or "dropout" in breaks:
        return None
    z = keep_mask(d["seed"], c["B"], c["H"], c["Lq"], c["Lk"], d["p"])
    return z.to(torch.float64) / (1.0 - d["p"]) if d["p"] < 1.0 else torch.zeros(z.shape, dtype=torch.float64)


def _structural(c: dict, breaks: frozenset):
    """The blocked pattern of the window and of the HF backend's structured mask,
    bool (B or 1, 1, Lq, Lk), True = blocked; None if there is none. About a diagonal other
    than the top-left one (c["diagonal"]), the causal part too (the references' own causal
    is top-left)."""
    Lq, Lk, diag = c["Lq"], c["Lk"], 0 if "diagonal" in breaks else c.get("diagonal", 0)
    i = torch.arange(Lq)[:, None] + diag
    j = torch.arange(Lk)[None, :]
    blocked = None
    causal = (not c["causal"]) if "causal" in breaks else c["causal"]
    if diag and causal:
        blocked = j > i
    if c["window"] is not None and "window" not in breaks:
        left, right = c["window"]
        blocked = torch.zeros(Lq, Lk, dtype=torch.bool) if blocked is None else blocked
        if left is not None and left != -1:
            blocked |= j < i - left
        if right is not None and right != -1:
            blocked |= j > i + right
    h = c["hf"]
    if h and h["mask"] == "structured":
        ia, ja = i + h["q_offset"], j + h["kv_offset"]
        blocked = torch.zeros(Lq, Lk, dtype=torch.bool)
        if h["causal"]:
            blocked |= ja > ia
            if h["window"] is not None:
                blocked |= ja <= ia - h["window"]
        blocked = blocked[None, None]
        if h["padding"] is not None:
            blocked = blocked | h["padding"][:, None, None, :]
    return blocked


def _scores(q, k, am, kpm, causal, scale, dtype, reorder=False, softcap=None, blocked=None):
    """q k^T * scale (soft-capped), + the masks (-inf where blocked), in dtype;
    with reorder, q is scaled before the product (flash-attention's second
    torch reference)."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    s = torch.matmul(q * scale, k.transpose(-1, -2)) if reorder else torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    Lq, Lk = s.shape[-2], s.shape[-1]
    for m in (am, None if kpm is None else kpm[:, None, None, :], blocked):
        if m is None:
            continue
        s = s.masked_fill(m, -math.inf) if m.dtype == torch.bool else s + m.to(dtype)
    if causal:
        s = s.masked_fill(torch.ones(Lq, Lk, dtype=torch.bool).triu(1), -math.inf)
    return s


def _gqa(q, k, v):
    H, Hkv = q.shape[-3], k.shape[-3]
    if H != Hkv:
        k = k.repeat_interleave(H // Hkv, dim=-3)
        v = v.repeat_interleave(H // Hkv, dim=-3)
    return k, v


def _head_scale(hm, dtype):
    h = hm.to(dtype)
    return h[:, None, None] if h.dim() == 1 else h[:, :, None, None]


def _softmax(s, sinks, dtype):
    """softmax over the keys, with the sink logit (H,) as one more column that
    has no value; a row with every key blocked gives 0. Returns the keys'
    probabilities, the sink's (None without sinks) and lse (float64)."""
    empty = torch.isneginf(s).all(dim=-1, keepdim=True)
    zero = torch.zeros((), dtype=dtype)
    Lk = s.shape[-1]
    if sinks is not None:
        s = torch.cat([s, sinks.to(dtype)[:, None, None].expand(s.shape[:-1] + (1,))], dim=-1)
    p = torch.where(empty, zero, torch.softmax(torch.where(empty, zero, s), dim=-1))
    lse = torch.logsumexp(s.detach().double(), dim=-1)
    return p[..., :Lk], (p[..., Lk:] if sinks is not None else None), lse


def _ref_attention(
    q, k, v, am, kpm, hm, causal, scale, dtype, reorder=False, softcap=None, blocked=None, sinks=None, drop=None
):
    """softmax(softcap(q k^T * scale) + masks [, sink]) * head_mask * Z / (1 - p) @ v
    with plain torch ops in `dtype` (masks in the op's conventions: bool True =
    blocked, float added; drop: dropout's Z / (1 - p)); rows with every key
    masked give 0. Returns out, weights, lse."""
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    k, v = _gqa(q, k, v)
    s = _scores(q, k, am, kpm, causal, scale, dtype, reorder, softcap, blocked)
    p, _, lse = _softmax(s, sinks, dtype)
    if hm is not None:
        p = p * _head_scale(hm, dtype)
    if drop is not None:
        p = p * drop.to(dtype)
    return torch.matmul(p, v), p, lse


@torch.no_grad()
def _attention_magnitudes(
    c, t, causal, scale, hm_used, sensitivity=False, softcap=None, blocked=None, sinks_used=True, drop=None
) -> dict:
    """The natural magnitude of each compared tensor: the max over it of the
    sum of |terms| it is computed from (in float64, from the float64 views t).
    Rounding error scales with these, not with the result, which may cancel
    to 0 (a query that sees one key has dq = 0 exactly). With sensitivity,
    every probability is weighted by |score| instead: the error that the
    score's rounding (float32, float64 for float64) makes through exp."""
    q, k, v = (t[n].double() for n in ("q", "k", "v"))
    if q.dim() == 3:
        q, k, v = q[None], k[None], v[None]
    am = t["am"]
    if am is not None and am.dim() == 3 and c["nobatch"]:
        am = am[None]
    kr, vr = _gqa(q, k, v)
    sc = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    s = _scores(q, kr, am, t["kpm"], causal, sc, torch.float64, softcap=softcap, blocked=blocked)
    sinks = t.get("sinks") if sinks_used else None
    p, psink, _ = _softmax(s, None if sinks is None else sinks.double(), torch.float64)
    a = p * torch.where(p > 0, s.abs(), 0.0) if sensitivity else p
    hs = _head_scale(t["hm"].double().abs(), torch.float64) if hm_used and t["hm"] is not None else 1.0
    if drop is not None:
        hs = hs * drop
    go = c["go"].abs().reshape(a.shape[:-1] + (-1,))
    dp = torch.matmul(go, vr.abs().transpose(-1, -2))  # |dO| |v|^T
    if c["need_weights"]:
        dp = dp + c["gw"].abs()
    dp_raw, dp = dp, dp * hs
    delta = (a * dp).sum(-1, keepdim=True)
    ds = a * (dp + delta)  # p (dP - delta)
    B, H, Hkv = q.shape[0], q.shape[1], k.shape[1]

    def kv_sum(x):  # over the query heads that share a kv head
        return x.reshape(B, Hkv, H // Hkv, *x.shape[2:]).sum(2)

    def expand(n, m):  # an expanded (zero batch stride) base sums over the batch
        return m * B if c["tensors"][n][0] == "expand" else m

    lse_extra = 0.0 if sinks is None else sinks.double().abs().max().item()
    mags = {
        "out": torch.matmul(a * hs, vr.abs()).max().item(),
        "weights": max(a.max().item(), (a * hs).max().item()) if a.numel() else 0.0,
        "lse": (s.abs().masked_fill(torch.isinf(s), 0).amax() + math.log(s.shape[-1] + 1)).item() + lse_extra,
        "dq": expand("q", (sc * torch.matmul(ds, kr.abs())).max().item()),
        "dk": expand("k", kv_sum(sc * torch.matmul(ds.transpose(-1, -2), q.abs())).max().item()),
        "dv": expand("v", kv_sum(torch.matmul((a * hs).transpose(-1, -2), go)).max().item()),
    }
    if c["am"] is not None and c["am"]["rg"]:
        mags["dam"] = ds.sum_to_size(am.shape).max().item()
    if c["kpm"] is not None and c["kpm"]["rg"]:
        mags["dkpm"] = ds.sum((1, 2)).max().item()
    if c["hm"] is not None and c["hm"]["rg"]:
        dh = (a * dp_raw * (drop if drop is not None else 1.0)).sum((-1, -2))
        mags["dhm"] = (dh.sum(0) if c["hm"]["vals"].dim() == 1 else dh).max().item()
    if c["sinks"] is not None and c["sinks"]["rg"] and psink is not None:
        ps = psink * torch.where(psink > 0, sinks.double().abs()[:, None, None], 0.0) if sensitivity else psink
        mags["dsinks"] = (ps * delta + psink * delta).sum((0, 2, 3)).max().item()
    return mags


def _leaves(c: dict, qkv_dtype, mask64: bool):
    """Leaf tensors of one computation: q, k, v bases in qkv_dtype; masks and
    sinks in their own dtype (float64 when mask64)."""
    leaves, views = {}, {}
    for n, (_, vals, view) in c["tensors"].items():
        leaves[n] = vals.to(qkv_dtype).requires_grad_()
        views[n] = view(leaves[n])
    for n in ("am", "kpm", "hm", "sinks"):
        m = c[n]
        if m is None:
            views[n] = None
            continue
        dt = m["dtype"] if (m["dtype"] == torch.bool or not mask64) else torch.float64
        t = m["vals"].to(dt)
        if m["rg"]:
            t.requires_grad_()
            leaves[n] = t
        views[n] = m["view"](t) if "view" in m else t
    if c["nobatch"]:  # F.sdpa's (H, L, E) form
        for n in ("q", "k", "v"):
            views[n] = views[n].squeeze(0)
        if views["am"] is not None and views["am"].dim() == 4:
            views["am"] = views["am"].squeeze(0)
    return leaves, views


GRAD_ORDER = ("q", "k", "v", "am", "kpm", "hm", "sinks")


def _grads(outs: list, gouts: list, leaves: dict) -> dict:
    names = [n for n in GRAD_ORDER if n in leaves]
    pairs = [(o, g) for o, g in zip(outs, gouts) if o is not None and o.requires_grad]
    gr = torch.autograd.grad(
        [o for o, _ in pairs], [leaves[n] for n in names], [g for _, g in pairs], allow_unused=True
    )
    return dict(zip(names, gr))


def _sdpa_mask(am, causal, Lq, Lk, dtype):
    """our blocked-convention mask in F.sdpa's (True = take part), with causal
    folded in (F.sdpa refuses attn_mask together with is_causal)."""
    if am is None:
        if not causal:
            return None
        return torch.ones(Lq, Lk, dtype=torch.bool).tril()
    m = ~am if am.dtype == torch.bool else am.to(dtype)  # F.sdpa: a float mask of the query's dtype
    if causal:
        cb = torch.ones(Lq, Lk, dtype=torch.bool).triu(1)
        m = m & ~cb if m.dtype == torch.bool else m.masked_fill(cb, -math.inf)
    return m


class _HFLayer(torch.nn.Module):
    """What transformers' attention interface reads from the layer: is_causal."""

    def __init__(self, is_causal: bool):
        super().__init__()
        self.is_causal = is_causal


def _hf_call(c: dict, t: dict):
    """The case through torch_masked_attn.hf.attention_forward, as a transformers
    model calls it; returns out (B, H, Lq, Dv)."""
    h = c["hf"]
    if h["mask"] == "structured":
        mask = _HF.StructuredMask(
            c["B"],
            c["Lq"],
            c["Lk"],
            h["q_offset"],
            h["kv_offset"],
            causal=h["causal"],
            sliding_window=h["window"],
            padding=h["padding"],
        )
    elif h["mask"] == "tensor":
        am = t["am"]
        mask = ~am if am.dtype == torch.bool else am  # transformers' convention: True = attend
    else:
        mask = None
    kw = {}
    if c["softcap"] is not None:
        kw["softcap"] = c["softcap"]
    if t["sinks"] is not None:
        kw["s_aux"] = t["sinks"]
    out, w = _HF.attention_forward(
        _HFLayer(h["module_causal"]), t["q"], t["k"], t["v"], mask, dropout=0.0, scaling=c["scale"], **kw
    )
    assert w is None
    return out.transpose(1, 2)


def run_attention(c: dict, breaks: frozenset = frozenset()) -> Result:
    """Run one attention case through ours and the references. `breaks` makes the
    reference wrong on purpose ("causal": flips is_causal; "head_mask": drops it;
    "scale": doubles it; "window", "softcap", "sinks", "dropout": drops them; "diagonal":
    takes the top-left one), for the self-test."""
    dtype = c["dtype"]
    res = Result(describe_attention(c))
    go, gw = c["go"], c["gw"]
    if c["nobatch"]:
        go, gw = go.squeeze(0), gw.squeeze(0)

    # ours
    leaves, t = _leaves(c, dtype, mask64=False)
    if c["sdpa"]:
        am = t["am"]
        if am is not None and am.dtype == torch.bool:
            am = ~am  # F.sdpa's convention: True = take part
        out = tmf.scaled_dot_product_attention(
            t["q"], t["k"], t["v"], attn_mask=am, is_causal=c["causal"], scale=c["scale"], enable_gqa=c["H"] != c["Hkv"]
        )
        outs, w, lse = [out], None, None
    elif c["hf"]:
        out = _hf_call(c, t)
        outs, w, lse = [out], None, None
    else:
        extra = {}
        if c["window"] is not None:
            extra["window"] = c["window"]
        if c.get("diagonal"):
            extra["diagonal"] = c["diagonal"]
        if c["softcap"] is not None:
            extra["softcap"] = c["softcap"]
        if t["sinks"] is not None:
            extra["sinks"] = t["sinks"]
        if c["dropout"] is not None:
            extra["dropout_p"], extra["dropout_seed"] = c["dropout"]["p"], c["dropout"]["seed"]
        k, v = t["k"], t["v"]
        if c.get("int8"):  # inference only
            (k, extra["k_scale"]), (v, extra["v_scale"]) = c["int8"]["k"], c["int8"]["v"]
        grad = contextlib.nullcontext() if not c.get("int8") else torch.no_grad()
        split = ops.decode_splits(c["splits"]) if c.get("decode") else contextlib.nullcontext()
        with grad, split:
            r = tmf.masked_attention(
                t["q"],
                k,
                v,
                attn_mask=t["am"],
                key_padding_mask=t["kpm"],
                head_mask=t["hm"],
                is_causal=c["causal"],
                scale=c["scale"],
                need_weights=c["need_weights"],
                return_lse=c["return_lse"],
                **extra,
            )
        r = list(r) if isinstance(r, tuple) else [r]
        out = r.pop(0)
        w = r.pop(0) if c["need_weights"] else None
        lse = r.pop(0) if c["return_lse"] else None
        outs = [out, w]
    ours = {"out": out, "weights": w, "lse": lse}
    if not c.get("int8"):
        ours.update(("d" + n, g) for n, g in _grads(outs, [go.to(dtype), gw.to(dtype)], leaves).items())

    # references: float64 (ref) and the input dtype (torch's own error)
    causal = (not c["causal"]) if "causal" in breaks else c["causal"]
    if c.get("diagonal") and "diagonal" not in breaks:  # the causal part is in _structural's mask
        causal = False
    scale = c["scale"]
    if "scale" in breaks:
        scale = 2.0 * (scale if scale is not None else 1.0 / math.sqrt(c["D"]))
    softcap = None if "softcap" in breaks else c["softcap"]
    blocked = _structural(c, breaks)
    drop = _dropout_scale(c, breaks)

    def reference(qkv_dtype, mask64, reorder=False):
        lv, tt = _leaves(c, qkv_dtype, mask64)
        hm = None if "head_mask" in breaks else tt["hm"]
        sinks = None if "sinks" in breaks else tt["sinks"]
        o, p, ls = _ref_attention(
            tt["q"],
            tt["k"],
            tt["v"],
            tt["am"],
            tt["kpm"],
            hm,
            causal,
            scale,
            qkv_dtype,
            reorder,
            softcap,
            blocked,
            sinks,
            drop,
        )
        got = {"out": o, "weights": p if c["need_weights"] else None, "lse": ls if c["return_lse"] else None}
        got.update(
            ("d" + n, g) for n, g in _grads([o, got["weights"]], [go.to(qkv_dtype), gw.to(qkv_dtype)], lv).items()
        )
        return got, tt

    ref, t64 = reference(torch.float64, True)
    theirs = [reference(dtype, False)[0], reference(dtype, False, reorder=True)[0]]
    mkw = dict(softcap=softcap, blocked=blocked, sinks_used="sinks" not in breaks, drop=drop)
    natural = _attention_magnitudes(c, t64, causal, scale, "head_mask" not in breaks, **mkw)
    natural_acc = _attention_magnitudes(c, t64, causal, scale, "head_mask" not in breaks, sensitivity=True, **mkw)
    if c["sdpa"]:  # torch's F.sdpa in the input dtype
        lv, tt = _leaves(c, dtype, mask64=False)
        m = _sdpa_mask(tt["am"], causal, c["Lq"], c["Lk"], dtype)
        o = F.scaled_dot_product_attention(
            tt["q"], tt["k"], tt["v"], attn_mask=m, scale=scale, enable_gqa=c["H"] != c["Hkv"]
        )
        got = {"out": o}
        got.update(("d" + n, g) for n, g in _grads([o], [go.to(dtype)], lv).items())
        theirs.append(got)

    for name in ("out", "weights", "lse", "dq", "dk", "dv", "dam", "dkpm", "dhm", "dsinks"):
        if name in ("weights", "lse") and ref.get(name) is None:
            continue
        if name not in ref and name not in ours:
            continue
        if c.get("int8") and name.startswith("d"):  # an 8-bit cache: inference only
            continue
        cmp_dtype = dtype
        if name in ("dam", "dkpm", "dhm", "dsinks"):  # gradients come in the mask's own dtype
            cmp_dtype = c[name[1:]]["dtype"]
            cmp_dtype = cmp_dtype if cmp_dtype in LOW or dtype not in LOW else dtype
        if name == "lse" and dtype in LOW:
            cmp_dtype = torch.float32
        compare(
            res,
            name,
            ours.get(name),
            [th.get(name) for th in theirs],
            ref.get(name),
            cmp_dtype,
            is_grad=name.startswith("d"),
            natural=natural.get(name, 0.0),
            natural_acc=natural_acc.get(name, 0.0),
        )
    return res


# ---- cross-entropy ------------------------------------------------------------


def _identity(t):
    return t


def _permuted(perm):
    def view(t):
        return t.permute(perm)

    return view


def _class_slice(dim, off, C):
    def view(t):
        return t.narrow(dim, off, C)

    return view


def draw_ce(seed: int, force: dict | None = None) -> dict:
    r = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    force = force or {}
    c: dict = {"seed": seed}
    c["dtype"] = dtype = force.get("dtype", r.choice(DTYPES))
    x = r.random()
    c["form"] = form = "NC" if x < 0.55 else "C" if x < 0.65 else "NCd" if x < 0.85 else "NCdd"
    x = r.random()
    if x < 0.05:
        C = r.randint(3001, 40000)
    elif x < 0.25:
        C = r.choice((1, 2, 3, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 1024))
    else:
        C = int(math.exp(r.uniform(0, math.log(3000))))
    N = r.randint(1, 64) if r.random() < 0.7 else r.randint(1, 8)
    ds = () if form in ("NC", "C") else tuple(r.randint(1, 6) for _ in range(len(form) - 2))
    if form == "C":
        N = 1
    while N * C * math.prod(ds) > 300_000 and N > 1:
        N = max(1, N // 2)
    while N * C * math.prod(ds) > 300_000 and ds:
        ds = tuple(max(1, d // 2) for d in ds)
    c["N"], c["C"], c["ds"] = N, C, ds
    shape = (C,) if form == "C" else (N, C) + ds
    c["shape"] = shape
    rows_shape = () if form == "C" else (N,) + ds
    class_dim = 0 if form == "C" else 1

    # the input, possibly as a view with the class dim not innermost / sliced
    amp = r.choice((1.0, 3.0, 10.0)) if dtype != torch.float16 else r.choice((1.0, 3.0))
    lay = r.choice(("contig", "contig", "classlast", "pad"))
    if form == "C":
        lay = r.choice(("contig", "pad"))
    if lay == "classlast":  # (N, d.., C) storage viewed as (N, C, d..); for (N, C): a transposed (C, N)
        base = (C, N) if form == "NC" else (N,) + ds + (C,)
        perm = (1, 0) if form == "NC" else (0, len(base) - 1) + tuple(range(1, len(base) - 1))
        view = _permuted(perm)
    elif lay == "pad":
        off = r.randint(0, 3)
        base = shape[:class_dim] + (C + off + r.randint(0, 4),) + shape[class_dim + 1 :]
        view = _class_slice(class_dim, off, C)
    else:
        base, view = shape, _identity
    c["layout"], c["view"] = lay, view
    c["x"] = rounded(torch.randn(base, generator=g, dtype=torch.float64) * amp, dtype)

    c["prob"] = prob = force.get("prob", r.random() < 0.3)
    c["ignore_index"] = -100
    c["ignored"] = 0.0
    if prob:
        kind = r.choice(("softmax", "rand", "onehot"))
        if kind == "softmax":
            t = torch.softmax(torch.randn(shape, generator=g, dtype=torch.float64) * 2, dim=class_dim)
        elif kind == "rand":
            t = torch.rand(shape, generator=g, dtype=torch.float64)
        else:
            idx = torch.randint(0, C, rows_shape, generator=g)
            t = F.one_hot(idx, C).to(torch.float64).movedim(-1, class_dim)
        c["target"] = rounded(t, dtype)
        c["target_kind"] = kind
    else:
        tgt = torch.randint(0, C, rows_shape, generator=g)
        x = r.random()
        ii = (
            -100
            if x < 0.4
            else r.randint(0, C - 1)
            if x < 0.65
            else C + r.randint(0, 5)
            if x < 0.75
            else -r.randint(1, 5)
        )
        frac = r.choice((0.0, 0.0, 0.2, 0.5, 1.0 if r.random() < 0.3 else 0.1))
        drop = torch.rand(rows_shape, generator=g) < frac
        c["target"] = torch.where(drop, torch.full((), ii), tgt)
        c["ignore_index"], c["ignored"] = ii, frac
    c["weight"] = None
    if r.random() < 0.3:
        c["weight"] = rounded(torch.rand(C, generator=g, dtype=torch.float64) * 2 + 0.05, dtype)
    c["ls"] = force.get("label_smoothing", 0.0 if r.random() < 0.65 else r.choice((1.0, round(r.uniform(0, 1), 3))))
    c["reduction"] = r.choice(("none", "mean", "sum"))
    c["z_loss"] = force.get("z_loss", 0.0 if r.random() < 0.85 else r.choice((1e-4, 1e-2, 0.3)))
    c["softcap"] = force.get("softcap", None if r.random() < 0.85 else round(r.uniform(0.5, 30.0), 2))
    gshape = rows_shape if c["reduction"] == "none" else ()
    c["go"] = rounded(torch.randn(gshape, generator=g, dtype=torch.float64), dtype)
    return c


def describe_ce(c: dict) -> str:
    s = [f"ce {DT_NAME[c['dtype']]} shape={tuple(c['shape'])} layout={c['layout']}"]
    if c["prob"]:
        s.append(f"target=prob/{c['target_kind']}")
    else:
        s.append(f"target=class ignore_index={c['ignore_index']} ignored~{c['ignored']}")
    if c["weight"] is not None:
        s.append("weight")
    if c["ls"]:
        s.append(f"label_smoothing={c['ls']}")
    s.append(f"reduction={c['reduction']}")
    if c["z_loss"]:
        s.append(f"z_loss={c['z_loss']}")
    if c["softcap"] is not None:
        s.append(f"softcap={c['softcap']}")
    return " ".join(s)


def _ref_ce(x, target, weight, ii, red, ls, z, cap):
    """README's composition with plain torch ops: y = cap*tanh(x/cap);
    F.cross_entropy(y, reduction='none') + z * logsumexp(y)**2 on the kept rows,
    then the reduction ('mean': by the kept rows' target weights, or the number
    of rows with probability targets; NaN and zero gradients when that is 0)."""
    y = cap * torch.tanh(x / cap) if cap is not None else x
    kw = {"weight": weight, "label_smoothing": ls}
    prob = target.is_floating_point()
    if not prob:
        kw["ignore_index"] = ii
    if z == 0:
        if red == "mean" and not prob and not (target != ii).any():
            return F.cross_entropy(y, target, reduction="sum", **kw) * 0 + math.nan
        return F.cross_entropy(y, target, reduction=red, **kw)
    class_dim = 0 if x.dim() == 1 else 1
    per = F.cross_entropy(y, target, reduction="none", **kw)
    lse = torch.logsumexp(y, dim=class_dim)
    kept = torch.ones_like(per) if prob else (target != ii).to(per.dtype)
    per = per + z * lse**2 * kept
    if red == "none":
        return per
    if red == "sum":
        return per.sum()
    if prob:
        return per.sum() / max(1, per.numel())
    C = x.shape[class_dim]
    wt = kept if weight is None else weight[target.clamp(0, C - 1)] * kept
    denom = wt.sum()
    if denom.item() == 0:
        return per.sum() * 0 + math.nan
    return per.sum() / denom


@torch.no_grad()
def _ce_magnitudes(c: dict, ls: float, z: float, cap) -> tuple[dict, dict]:
    """(natural, natural_acc) magnitudes of the loss and the input gradient, as
    for attention: the sum of |terms| (lse - y_c weighted by the target
    coefficients, z lse^2; softmax and the target coefficients for the
    gradient), and the error of lse (a sum of C exps, float32 / float64: about
    log2(C) + 1 roundings) and of exp(y_c - lse) at the accumulation type."""
    x = c["view"](c["x"])
    cd = 0 if x.dim() == 1 else 1
    y = x.movedim(cd, -1)  # (rows..., C)
    if cap is not None:
        y = cap * torch.tanh(y / cap)
    C = y.shape[-1]
    lse = torch.logsumexp(y, -1, keepdim=True)
    sm = torch.softmax(y, -1)
    w = c["weight"] if c["weight"] is not None else torch.ones(C, dtype=torch.float64)
    if c["prob"]:
        coef = w * ((1 - ls) * c["target"].movedim(cd, -1) + ls / C)
        kept = torch.ones(y.shape[:-1], dtype=torch.float64)
        denom = float(kept.numel())
    else:
        t = c["target"]
        kept = (t != c["ignore_index"]).to(torch.float64)
        tc = t.clamp(0, C - 1)
        coef = ls / C * w.expand(y.shape) + (1 - ls) * F.one_hot(tc, C).to(torch.float64) * w[tc][..., None]
        coef = coef * kept[..., None]
        denom = (w[tc] * kept).sum().item()
    lse = lse.squeeze(-1)
    rounds = math.log2(C) + 1
    a = coef.sum(-1) + 2 * z * lse.abs() * kept  # d loss / d lse
    rows = (coef * (lse[..., None].abs() + y.abs())).sum(-1) + z * lse**2 * kept
    rows_acc = a * rounds
    red = c["reduction"]

    def reduce(r):
        if red == "none":
            return r.max().item()
        return r.sum().item() * abs(c["go"].item()) / (1.0 if red == "sum" else denom if denom else math.inf)

    g = c["go"].abs()
    if red == "mean":
        g = g / denom if denom else g * 0
    g = g[..., None] if red == "none" else g
    dx = (g * (a[..., None] * sm + coef)).max().item()
    dx_acc = (g * a[..., None] * sm * ((y - lse[..., None]).abs() + rounds)).max().item()
    return {"loss": reduce(rows), "dinput": dx}, {"loss": reduce(rows_acc), "dinput": dx_acc}


def run_ce(c: dict, breaks: frozenset = frozenset()) -> Result:
    """One cross-entropy case. `breaks`: "label_smoothing" (the reference drops
    it), "z_loss" (drops it), "softcap" (drops it), for the self-test."""
    dtype = c["dtype"]
    res = Result(describe_ce(c))

    def args(dt):
        x = c["x"].to(dt).requires_grad_()
        tgt = c["target"].to(dt) if c["prob"] else c["target"]
        w = None if c["weight"] is None else c["weight"].to(dt)
        return x, c["view"](x), tgt, w

    x, xv, tgt, w = args(dtype)
    kw = {"weight": w, "reduction": c["reduction"], "label_smoothing": c["ls"]}
    if not c["prob"]:
        kw["ignore_index"] = c["ignore_index"]
    loss = tmf.cross_entropy(xv, tgt, z_loss=c["z_loss"], softcap=c["softcap"], **kw)
    (dx,) = torch.autograd.grad(loss, x, c["go"].to(dtype))
    ours = {"loss": loss, "dinput": dx}

    ls = 0.0 if "label_smoothing" in breaks else c["ls"]
    z = 0.0 if "z_loss" in breaks else c["z_loss"]
    cap = None if "softcap" in breaks else c["softcap"]

    def reference(dt):
        x, xv, tgt, w = args(dt)
        loss = _ref_ce(xv, tgt, w, c["ignore_index"], c["reduction"], ls, z, cap)
        (dx,) = torch.autograd.grad(loss, x, c["go"].to(dt))
        return {"loss": loss, "dinput": dx}

    ref = reference(torch.float64)
    theirs = reference(dtype)
    natural, natural_acc = _ce_magnitudes(c, ls, z, cap)
    for name in ("loss", "dinput"):
        compare(
            res,
            name,
            ours[name],
            [theirs[name]],
            ref[name],
            dtype,
            is_grad=name == "dinput",
            natural=natural[name],
            natural_acc=natural_acc[name],
        )
    return res


# ---- varlen_attn (packed sequences) ---------------------------------------------

VARLEN = getattr(tmf, "varlen_attn", None)


def _seq_length(r):
    x = r.random()
    if x < 0.15:
        return r.choice((0, 1))
    if x < 0.35:
        return r.choice((63, 64, 65))
    if x < 0.55:
        return r.randint(1, 8)
    return r.randint(0, 140)


def _varlen_window(r):
    x = r.random()
    if x < 0.3:
        return (-1, -1)
    if x < 0.5:
        return (-1, 0)
    if x < 0.7:
        return (r.choice((0, 1, 5, 63, 64, r.randint(0, 150))), 0)
    return (r.choice((-1, 0, 1, r.randint(0, 150))), r.choice((-1, 0, 1, r.randint(0, 150))))


def draw_varlen(seed: int, force: dict | None = None) -> dict:
    """A packed batch for functional.varlen_attn: N sequences of query / key
    lengths 0, 1, tile edges and random (the same lengths or independent), GQA,
    every window (bottom-right aligned), scale, views of wider storage,
    return_aux(lse)."""
    r = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    force = force or {}
    c: dict = {"seed": seed}
    c["dtype"] = dtype = force.get("dtype", r.choice(DTYPES))
    N = r.randint(1, 6)
    lq = [_seq_length(r) for _ in range(N)]
    lk = list(lq) if r.random() < 0.5 else [_seq_length(r) for _ in range(N)]
    H = r.randint(1, 4)
    Hkv = r.choice([d for d in range(1, H + 1) if H % d == 0])
    D = _dim(r)
    Dv = D if r.random() < 0.4 else _dim(r)
    while sum(a * b for a, b in zip(lq, lk)) * H * (D + Dv) > 8_000_000:
        D, Dv = max(1, D // 2), max(1, Dv // 2)
        if D == 1 and Dv == 1:
            break
    c.update(N=N, lq=lq, lk=lk, H=H, Hkv=Hkv, D=D, Dv=Dv)
    c["window"] = force.get("window", _varlen_window(r))
    c["scale"] = None if r.random() < 0.5 else round(r.uniform(0.02, 2.0), 3)
    c["gqa_flag"] = H != Hkv or r.random() < 0.3
    c["lse"] = r.random() < 0.3
    # slack in max_q / max_k: "at least the longest"
    c["max_q"] = max(lq) + (r.randint(0, 5) if r.random() < 0.3 else 0)
    c["max_k"] = max(lk) + (r.randint(0, 5) if r.random() < 0.3 else 0)
    amp = r.choice((0.5, 1.0, 2.0))
    Tq, Tk = sum(lq), sum(lk)
    tensors = {}
    for name, (T, h, d) in (("q", (Tq, H, D)), ("k", (Tk, Hkv, D)), ("v", (Tk, Hkv, Dv))):
        lay = r.choice(("contig", "contig", "htd", "pad"))
        if lay == "htd":  # (H, T, D) storage: one projection per head
            base, view = (h, T, d), _permuted((1, 0, 2))
        elif lay == "pad":
            off = r.randint(0, 3)
            base, view = (T, h, d + off + r.randint(0, 4)), _class_slice(2, off, d)
        else:
            base, view = (T, h, d), _identity
        vals = rounded(torch.randn(base, generator=g, dtype=torch.float64) * (amp if name != "v" else 1.0), dtype)
        tensors[name] = (lay, vals, view)
    c["tensors"] = tensors
    c["go"] = rounded(torch.randn((Tq, H, Dv), generator=g, dtype=torch.float64), dtype)
    return c


def describe_varlen(c: dict) -> str:
    s = [
        f"varlen {DT_NAME[c['dtype']]} lq={c['lq']} lk={c['lk']} H={c['H']} Hkv={c['Hkv']} D={c['D']} "
        f"Dv={c['Dv']} window={c['window']} max_q={c['max_q']} max_k={c['max_k']}",
        "layout=" + ",".join(f"{n}:{t[0]}" for n, t in c["tensors"].items()),
    ]
    if c["scale"] is not None:
        s.append(f"scale={c['scale']}")
    if c["gqa_flag"]:
        s.append("enable_gqa")
    if c["lse"]:
        s.append("lse")
    return " ".join(s)


def _cu(lengths):
    return torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32)


def _varlen_visible(Lq, Lk, window):
    """Bool (Lq, Lk): query i sees key j (the window aligned to the bottom right, flash-attn's)."""
    left, right = window
    i = torch.arange(Lq)[:, None]
    j = torch.arange(Lk)[None, :]
    ok = torch.ones(Lq, Lk, dtype=torch.bool)
    if right >= 0:
        ok &= j <= i + Lk - Lq + right
    if left >= 0:
        ok &= j >= i + Lk - Lq - left
    return ok


def _ref_varlen(q, k, v, c, window, scale, dtype):
    """Per sequence, plain torch ops in dtype: out (T_q, H, Dv), lse (H, T_q) float64."""
    G = c["H"] // c["Hkv"]
    cq, ck = _cu(c["lq"]).tolist(), _cu(c["lk"]).tolist()
    outs, lses = [], []
    for b in range(c["N"]):
        qs = q[cq[b] : cq[b + 1]].to(dtype).transpose(0, 1)
        ks = k[ck[b] : ck[b + 1]].to(dtype).transpose(0, 1).repeat_interleave(G, 0)
        vs = v[ck[b] : ck[b + 1]].to(dtype).transpose(0, 1).repeat_interleave(G, 0)
        s = torch.matmul(qs, ks.transpose(-1, -2)) * scale
        s = s.masked_fill(~_varlen_visible(qs.shape[1], ks.shape[1], window), -math.inf)
        p, _, lse = _softmax(s, None, dtype)
        outs.append(torch.matmul(p, vs).transpose(0, 1))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, -1)


@torch.no_grad()
def _varlen_magnitudes(c, q, k, v, window, scale, sensitivity=False) -> dict:
    """_attention_magnitudes for a packed batch: per sequence, the max over all."""
    G = c["H"] // c["Hkv"]
    cq, ck = _cu(c["lq"]).tolist(), _cu(c["lk"]).tolist()
    go = c["go"].abs()
    m = dict.fromkeys(("out", "lse", "dq", "dk", "dv"), 0.0)
    for b in range(c["N"]):
        qs = q[cq[b] : cq[b + 1]].double().transpose(0, 1)
        ks = k[ck[b] : ck[b + 1]].double().transpose(0, 1)
        vs = v[ck[b] : ck[b + 1]].double().transpose(0, 1)
        if qs.shape[1] == 0 or ks.shape[1] == 0:
            continue
        kr, vr = ks.repeat_interleave(G, 0), vs.repeat_interleave(G, 0)
        s = torch.matmul(qs, kr.transpose(-1, -2)) * scale
        s = s.masked_fill(~_varlen_visible(qs.shape[1], ks.shape[1], window), -math.inf)
        p, _, _ = _softmax(s, None, torch.float64)
        a = p * torch.where(p > 0, s.abs(), 0.0) if sensitivity else p
        gos = go[cq[b] : cq[b + 1]].transpose(0, 1)
        dp = torch.matmul(gos, vr.abs().transpose(-1, -2))
        ds = a * (dp + (a * dp).sum(-1, keepdim=True))

        def kv_sum(x):
            return x.reshape(c["Hkv"], G, *x.shape[1:]).sum(1)

        m["out"] = max(m["out"], torch.matmul(a, vr.abs()).max().item())
        m["lse"] = max(m["lse"], (s.abs().masked_fill(torch.isinf(s), 0).amax() + math.log(s.shape[-1])).item())
        m["dq"] = max(m["dq"], (scale * torch.matmul(ds, kr.abs())).max().item())
        m["dk"] = max(m["dk"], kv_sum(scale * torch.matmul(ds.transpose(-1, -2), qs.abs())).max().item())
        m["dv"] = max(m["dv"], kv_sum(torch.matmul(a.transpose(-1, -2), gos)).max().item())
    return m


def run_varlen(c: dict, breaks: frozenset = frozenset()) -> Result:
    """One packed batch through varlen_attn and the per-sequence references.
    `breaks`: "window" (the reference has no window), "seqs" (the reference
    treats the batch as one sequence), for the self-test."""
    dtype = c["dtype"]
    res = Result(describe_varlen(c))

    def leaves(dt):
        lv = {n: vals.to(dt).requires_grad_() for n, (_, vals, _) in c["tensors"].items()}
        return lv, {n: c["tensors"][n][2](t) for n, t in lv.items()}

    cq, ck = _cu(c["lq"]), _cu(c["lk"])
    lv, t = leaves(dtype)
    r = VARLEN(
        t["q"],
        t["k"],
        t["v"],
        cq,
        ck,
        c["max_q"],
        c["max_k"],
        scale=c["scale"],
        window_size=c["window"],
        enable_gqa=c["gqa_flag"],
        return_aux=tmf.AuxRequest(lse=True) if c["lse"] else None,
    )
    out, lse = r if c["lse"] else (r, None)
    go = c["go"]
    ours = {"out": out, "lse": lse}
    grads = torch.autograd.grad(out, [lv["q"], lv["k"], lv["v"]], go.to(dtype), allow_unused=True)
    ours.update((n, gr if gr is not None else torch.zeros_like(lv[n[1]])) for n, gr in zip(("dq", "dk", "dv"), grads))

    window = (-1, -1) if "window" in breaks else c["window"]
    scale = c["scale"] if c["scale"] is not None else 1.0 / math.sqrt(c["D"])
    rc = dict(c, N=1, lq=[sum(c["lq"])], lk=[sum(c["lk"])]) if "seqs" in breaks else c

    def reference(dt, reorder=False):
        lv, tt = leaves(dt)
        q = tt["q"] * scale if reorder else tt["q"]
        o, ls = _ref_varlen(q, tt["k"], tt["v"], rc, window, 1.0 if reorder else scale, dt)
        got = {"out": o, "lse": ls if c["lse"] else None}
        got.update(
            zip(("dq", "dk", "dv"), torch.autograd.grad(o, [lv["q"], lv["k"], lv["v"]], go.to(dt), allow_unused=True))
        )
        for n in ("dq", "dk", "dv"):
            if got[n] is None:
                got[n] = torch.zeros_like(lv[n[1]])
        return got, tt

    ref, t64 = reference(torch.float64)
    theirs = [reference(dtype)[0], reference(dtype, reorder=True)[0]]
    natural = _varlen_magnitudes(rc, t64["q"], t64["k"], t64["v"], window, scale)
    natural_acc = _varlen_magnitudes(rc, t64["q"], t64["k"], t64["v"], window, scale, sensitivity=True)
    for name in ("out", "lse", "dq", "dk", "dv"):
        if name == "lse" and not c["lse"]:
            continue
        cmp_dtype = torch.float32 if name == "lse" and dtype in LOW else dtype
        compare(
            res,
            name,
            ours[name],
            [th[name] for th in theirs],
            ref[name],
            cmp_dtype,
            is_grad=name != "out" and name != "lse",
            natural=natural[name],
            natural_acc=natural_acc[name],
        )
    return res


# ---- driving -----------------------------------------------------------------


def kind_of(seed: int) -> str:
    return KINDS[seed % len(KINDS)]


# the kinds this build runs (varlen_attn: where functional has it)
DEFAULT_KINDS = tuple(k for k in KINDS if k != "varlen" or VARLEN is not None)
DRAW = {"attention": draw_attention, "ce": draw_ce, "varlen": draw_varlen}
DESCRIBE = {"attention": describe_attention, "ce": describe_ce, "varlen": describe_varlen}
RUN = {"attention": run_attention, "ce": run_ce, "varlen": run_varlen}


def draw(seed: int, force: dict | None = None) -> dict:
    return DRAW[kind_of(seed)](seed, force)


def run_case(
    seed: int, isa: str | None = None, breaks: frozenset = frozenset(), force: dict | None = None
) -> tuple[Result, Finding | None]:
    """Draw and run the case `seed` on `isa` (None: the CPU's default);
    returns its Result and a Finding (None if clean)."""
    kind = kind_of(seed)
    try:
        c = draw(seed, force)
    except Exception:  # a fuzzer bug: report it like a finding
        return Result("?"), Finding(seed, kind, isa or "default", "draw failed", [traceback.format_exc(limit=3)])
    desc = DESCRIBE[kind](c)
    try:
        if kind == "varlen" and VARLEN is None:
            raise RuntimeError("this build has no functional.varlen_attn")
        with ops.use_isa(isa):
            res = RUN[kind](c, breaks)
    except Exception as e:
        tb = traceback.format_exc(limit=-3).strip().splitlines()
        return Result(desc), Finding(
            seed, kind, isa or "default", desc, [f"exception {type(e).__name__}: {str(e)[:300]}"] + tb[-4:]
        )
    if not res.problems:
        return res, None
    return res, Finding(seed, kind, isa or "default", desc, [m for _, m, _ in res.problems])


def case_seeds(master: int, kinds=DEFAULT_KINDS):
    """The endless, deterministic sequence of case seeds of a run: kinds in
    turn, each seed = its kind's index in KINDS modulo 3."""
    rng = random.Random(master)
    i = 0
    while True:
        kind = kinds[i % len(kinds)]
        yield len(KINDS) * rng.getrandbits(40) + KINDS.index(kind)
        i += 1


def available_isas() -> list[str]:
    return [n for n in ISAS if ops.isa_available(n)]


@dataclass
class Stats:
    cases: dict = field(default_factory=dict)  # isa -> {kind: n}
    findings: list = field(default_factory=list)
    seconds: dict = field(default_factory=dict)


def fuzz(
    isas,
    seconds: float | None = None,
    cases: int | None = None,
    master: int = 0,
    kinds=DEFAULT_KINDS,
    breaks: frozenset = frozenset(),
    force: dict | None = None,
    log=print,
    progress_every: float = 15.0,
) -> Stats:
    """Run each ISA for `seconds` (or `cases` cases) of the seeded sequence."""
    st = Stats()
    for isa in isas:
        n = dict.fromkeys(kinds, 0)
        st.cases[isa] = n
        t0 = last = time.monotonic()
        for i, seed in enumerate(case_seeds(master, kinds)):
            now = time.monotonic()
            if (cases is not None and i >= cases) or (seconds is not None and now - t0 >= seconds):
                break
            _, f = run_case(seed, isa, breaks, force)
            n[kind_of(seed)] += 1
            if f is not None:
                st.findings.append(f)
                if log:
                    log(str(f))
            if log and progress_every and now - last >= progress_every:
                last = now
                log(f"[{isa}] {now - t0:5.0f} s: {sum(n.values())} cases ({_counts(n)}), {len(st.findings)} findings")
        st.seconds[isa] = time.monotonic() - t0
    return st


def _counts(n: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in n.items())


def summary(st: Stats) -> str:
    per = "; ".join(
        f"{isa}: {sum(n.values())} cases in {st.seconds[isa]:.0f} s ({_counts(n)}, "
        f"{60 * sum(n.values()) / max(st.seconds[isa], 1e-9):.0f}/min)"
        for isa, n in st.cases.items()
    )
    seeds = " ".join(f"{f.isa}:{f.seed}" for f in st.findings)
    return f"fuzz summary: {per}; findings {len(st.findings)}{' [' + seeds + ']' if seeds else ''}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="per ISA")
    ap.add_argument("--isa", default="all", choices=ISAS + ("all",))
    ap.add_argument("--seed", type=int, default=None, help="master seed (default: from the clock)")
    ap.add_argument("--kind", default="all", choices=DEFAULT_KINDS + ("all",))
    ap.add_argument("--replay", type=int, default=None, metavar="SEED", help="run one case, verbosely")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads (default 1: the cases are small, and one thread runs "
        "several times more of them; more exercise the kernels' threaded split)",
    )
    a = ap.parse_args(argv)
    torch.set_num_threads(max(1, a.threads))
    if a.isa == "all":
        isas = available_isas()
    elif not ops.isa_available(a.isa):
        print(f"fuzz: this CPU does not run the {a.isa} kernels (it runs {', '.join(available_isas())})")
        return 2
    else:
        isas = [a.isa]

    if a.replay is not None:
        bad = False
        for isa in isas:
            res, f = run_case(a.replay, isa)
            print(f"[{isa}] seed={a.replay}: {res.desc}")
            for line in res.lines:
                print("    " + line)
            if f is not None:
                print(str(f))
                bad = True
            else:
                print("    ok")
        return 1 if bad else 0

    master = a.seed if a.seed is not None else int(time.time())
    kinds = DEFAULT_KINDS if a.kind == "all" else (a.kind,)
    print(
        f"fuzz: seed {master}, {a.seconds:g} s per ISA on {', '.join(isas)}, kinds {', '.join(kinds)}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}",
        flush=True,
    )
    st = fuzz(isas, seconds=a.seconds, master=master, kinds=kinds, log=lambda s: print(s, flush=True))
    print(summary(st), flush=True)
    return 1 if st.findings else 0


if __name__ == "__main__":
    sys.exit(main())
