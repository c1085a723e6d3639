"""The benchmark cases: shapes, inputs, the native and our callables, nominal
work. Used by run.py (timing) and by its memory probes (one fresh process per
(case, implementation)), so every case is rebuilt from its name alone and
with a fixed seed.

A case is a `Bench`: `natives` maps a variant name to a callable running the
native PyTorch computation, `ours` runs torch_masked_attn on the same inputs.
Every callable does the whole timed unit (forward, or forward + backward) and
returns a forward result for the cross-check. When there are several native
variants, the ratio is taken against the fastest.
"""

import re
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

import kv8  # the kv8 group (benchmarks/kv8.py)
import serving  # the vllm group (benchmarks/serving.py)
import torch
import torch.nn.functional as F
from torch import nn

import torch_masked_attn as tma

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Skip(Exception):
    """The case cannot run here (e.g. the op is not written yet)."""


@dataclass
class Bench:
    work: str  # one-line description for the table
    natives: Dict[str, Callable[[], torch.Tensor]]
    ours: Callable[[], torch.Tensor]
    flops: Optional[float] = None  # nominal flops of one call (None: not compute-bound)
    attn_flops: Optional[float] = None  # the attention part of `flops`
    traffic_bytes: Optional[float] = None  # minimal memory traffic of one call (cross-entropy)
    timed: bool = True  # False: peak memory only
    memory: bool = True  # False: no peak-memory probes
    reps: Optional[tuple] = None  # (min reps, max reps, seconds): overrides the mode's
    info: dict = field(default_factory=dict)  # shapes etc. for benchmarks/out/results.json

    def impls(self):
        return {**{f"native:{k}": f for k, f in self.natives.items()}, "ours": self.ours}


# ---------------------------------------------------------------- work counts


def attention_flops(B, H, Lq, Lk, D, causal, backward):
    """Nominal attention flops: forward 4*B*H*Lq*Lk*D (QK^T and PV), halved
    for causal, backward 2.5x forward. Key padding is NOT subtracted (the
    same nominal count for both implementations)."""
    fwd = 4.0 * B * H * Lq * Lk * D / (2 if causal else 1)
    return fwd * (3.5 if backward else 1.0)


def projection_flops(B, L, E, backward):
    """nn.MultiheadAttention's in-projection (E -> 3E) and out-projection (E -> E):
    2*B*L*E*4E forward; backward (input and weight gradients) 2x forward."""
    fwd = 8.0 * B * L * E * E
    return fwd * (3.0 if backward else 1.0)


def gflop(x):
    return f"{x / 1e9:.1f} GFLOP"


# ---------------------------------------------------------------- inputs


def key_padding(B, L, lengths=None, pad_fraction=None):
    """(B, L) bool, True = padding. Either random lengths uniform in [L/2, L]
    (key 0 is never padding, so no query row is fully masked) or every
    sequence with its last round(pad_fraction * L) keys padded."""
    if pad_fraction is not None:
        lengths = torch.full((B,), L - int(round(pad_fraction * L)))
    elif lengths is None:
        lengths = torch.randint(L // 2, L + 1, (B,))
    return torch.arange(L)[None, :] >= lengths[:, None]


def causal_blocked(L):
    return torch.ones(L, L, dtype=torch.bool).triu(1)  # True = blocked


def qkv(B, H, L, D, dtype):
    q, k, v = (torch.randn(B, H, L, D, dtype=dtype, requires_grad=True) for _ in range(3))
    return q, k, v, torch.randn(B, H, L, D, dtype=dtype)


def fwd_bwd(forward, inputs, grad_out):
    def run():
        out = forward()
        torch.autograd.grad(out, inputs, grad_out)
        return out.detach()

    return run


# ---------------------------------------------------------------- attention (functional)


def functional_attention(B, H, L, D, dtype, kpm, native_masks, dropout_p=0.0):
    """Causal attention, forward + backward, with optional key padding.

    native_masks: which F.scaled_dot_product_attention variants to time:
      "causal": is_causal=True (only without key padding)
      "bool":   the equivalent bool (B, 1, L, L) mask, True = take part
      "float":  the float (B, H, L, L) additive mask nn.MultiheadAttention builds
      "ours-p0": ours without dropout, as the "native" (dropout_p > 0: our
                dropout's own cost, ratio = ours at 0 / ours at dropout_p)
    The native masks are built once, outside the timed call. With dropout_p,
    both sides drop attention probabilities (the outputs then differ by the
    masks: the cross-check's difference means nothing).
    """
    p = dropout_p
    q, k, v, g = qkv(B, H, L, D, dtype)
    natives = {}
    if "causal" in native_masks:
        assert kpm is None
        natives["sdpa-causal"] = fwd_bwd(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), g)
    blocked = None
    if kpm is not None:
        blocked = causal_blocked(L)[None, None] | kpm[:, None, None, :]  # (B, 1, L, L)
    if "bool" in native_masks:
        allowed = ~blocked
        natives["sdpa-bool"] = fwd_bwd(
            lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=p), (q, k, v), g
        )
    if "float" in native_masks:
        additive = torch.zeros(B, H, L, L, dtype=dtype).masked_fill_(blocked, float("-inf"))
        natives["sdpa-float"] = fwd_bwd(
            lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=additive, dropout_p=p), (q, k, v), g
        )
    if "ours-p0" in native_masks:
        natives["ours-p0"] = fwd_bwd(
            lambda: tma.functional.masked_attention(q, k, v, key_padding_mask=kpm, is_causal=True), (q, k, v), g
        )
    ours = fwd_bwd(
        lambda: tma.functional.masked_attention(q, k, v, key_padding_mask=kpm, is_causal=True, dropout_p=p),
        (q, k, v),
        g,
    )
    fl = attention_flops(B, H, L, L, D, causal=True, backward=True)
    pad = "" if kpm is None else f", key padding {kpm.float().mean().item():.0%}"
    drop = f", dropout {p}" if p else ""
    return Bench(
        work=f"B={B} H={H} L={L} D={D} causal{pad}{drop}, fwd+bwd, {gflop(fl)}",
        natives=natives,
        ours=ours,
        flops=fl,
        attn_flops=fl,
        info=dict(B=B, H=H, L=L, D=D, dtype=str(dtype), dropout_p=p),
    )


def gpt_train(dtype, dropout_p=0.0, natives=("bool", "float")):
    B, H, L, D = 8, 8, 512, 64
    return functional_attention(B, H, L, D, dtype, key_padding(B, L), natives, dropout_p)


def weights_train(B=8, H=8, L=512, D=64):
    """A loss on the attention weights as well as the output (distillation of attention maps):
    need_weights=True, causal + key padding, fwd+bwd through both. Native: the math path that
    nn.MultiheadAttention takes for need_weights (scores, masked softmax, P V), which keeps the
    (B, H, L, L) weights as we do. Ours: the weights' pre-pass, then the one backward."""
    q, k, v, g = qkv(B, H, L, D, torch.float32)
    gw = torch.randn(B, H, L, L)
    kpm = key_padding(B, L)
    blocked = causal_blocked(L)[None, None] | kpm[:, None, None, :]
    scale = D**-0.5

    def native():
        w = torch.softmax((q @ k.transpose(-1, -2) * scale).masked_fill(blocked, float("-inf")), -1)
        out = w @ v
        torch.autograd.grad((out, w), (q, k, v), (g, gw))
        return out.detach()

    def ours():
        out, w = tma.functional.masked_attention(q, k, v, key_padding_mask=kpm, is_causal=True, need_weights=True)
        torch.autograd.grad((out, w), (q, k, v), (g, gw))
        return out.detach()

    fl = attention_flops(B, H, L, L, D, causal=True, backward=True)
    return Bench(
        work=f"B={B} H={H} L={L} D={D} causal + key padding, need_weights with a loss on the weights, "
        f"fwd+bwd, {gflop(fl)} (the pre-pass's scores not counted)",
        natives={"math": native},
        ours=ours,
        flops=fl,
        attn_flops=fl,
        info=dict(B=B, H=H, L=L, D=D, dtype=str(torch.float32)),
    )


def hf_mask():
    """Hugging Face's attention mask: causal + key padding materialised as one
    4-D bool mask (B, 1, L, L), True = take part, passed to F.sdpa, and the same
    mask through our F.sdpa drop-in (which finds the blocked tiles by reading it)."""
    B, H, L, D = 4, 8, 1024, 64
    q, k, v, g = qkv(B, H, L, D, torch.float32)
    kpm = key_padding(B, L)
    allowed = ~(causal_blocked(L)[None, None] | kpm[:, None, None, :])  # (B, 1, L, L)
    native = fwd_bwd(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=allowed), (q, k, v), g)
    ours = fwd_bwd(lambda: tma.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed), (q, k, v), g)
    fl = attention_flops(B, H, L, L, D, causal=True, backward=True)
    return Bench(
        work=f"B={B} H={H} L={L} D={D} causal + key padding {kpm.float().mean().item():.0%} as a "
        f"4-D bool mask (B, 1, L, L), both through F.sdpa, fwd+bwd, {gflop(fl)}",
        natives={"sdpa-bool": native},
        ours=ours,
        flops=fl,
        attn_flops=fl,
        info=dict(B=B, H=H, L=L, D=D, dtype=str(torch.float32)),
    )


def sliding_window():
    """A causal sliding window of 1024 keys at L = 8192 (Mistral, Gemma 2/3,
    GPT-OSS): ours through window=(1024, 0), which skips every key block
    outside the window; native F.sdpa has no window argument, so it gets the
    window as a bool mask (1, 1, L, L) (True = take part)."""
    B, H, L, D, W = 1, 8, 8192, 64, 1024
    q, k, v, g = qkv(B, H, L, D, torch.float32)
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    allowed = ((j <= i) & (j >= i - W))[None, None]
    native = fwd_bwd(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=allowed), (q, k, v), g)
    ours = fwd_bwd(lambda: tma.functional.masked_attention(q, k, v, window=(W, 0)), (q, k, v), g)
    fl = 4.0 * B * H * L * (W + 1) * D * 3.5  # the keys in the window: ~ (W + 1) per query
    return Bench(
        work=f"B={B} H={H} L={L} D={D} causal window {W}, fwd+bwd, native with the window as a bool "
        f"mask, {gflop(fl)} in the window",
        natives={"sdpa-bool": native},
        ours=ours,
        flops=fl,
        attn_flops=fl,
        info=dict(B=B, H=H, L=L, D=D, window=W, dtype=str(torch.float32)),
    )


def long_causal(dtype):
    return functional_attention(1, 8, 4096, 64, dtype, None, ("causal",))


def long_causal_forward(dtype=torch.float32):
    """The forward of long-causal alone (inference-style, no autograd graph):
    the "% of the FMA peak" figure, and in bfloat16 that of the VDPBF16PS peak."""
    B, H, L, D = 1, 8, 4096, 64
    q, k, v = (torch.randn(B, H, L, D, dtype=dtype) for _ in range(3))

    def native():
        with torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def ours():
        with torch.no_grad():
            return tma.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    fl = attention_flops(B, H, L, L, D, causal=True, backward=False)
    return Bench(
        work=f"B={B} H={H} L={L} D={D} causal, forward only, {gflop(fl)}",
        natives={"sdpa-causal": native},
        ours=ours,
        flops=fl,
        attn_flops=fl,
        info=dict(B=B, H=H, L=L, D=D, dtype=str(dtype)),
    )


def softcap_case(cost, dtype=torch.float32, forward_only=False):
    """Causal attention with Gemma 2's logit soft-capping (softcap 50), B=2 H=8
    L=2048 D=64. cost=False: against native, which has no softcap in F.sdpa and
    composes it (softcap * tanh(s / softcap), the causal mask, softmax, P V in
    plain ops, as transformers' eager attention does); cost=True: against our
    own call without softcap (ratio = ours without / ours with: softcap's cost)."""
    B, H, L, D, cap = 2, 8, 2048, 64, 50.0
    q, k, v, g = qkv(B, H, L, D, dtype)
    blocked = causal_blocked(L)

    def composed():
        s = torch.matmul(q, k.transpose(-1, -2)) * D**-0.5
        s = (cap * torch.tanh(s / cap)).masked_fill(blocked, float("-inf"))
        return torch.matmul(torch.softmax(s, -1, dtype=torch.float32).to(dtype), v)

    def ours_fn(c):
        return lambda: tma.functional.masked_attention(q, k, v, is_causal=True, softcap=c)

    def timed(fn):
        if not forward_only:
            return fwd_bwd(fn, (q, k, v), g)

        def run():
            with torch.no_grad():
                return fn()

        return run

    natives = {"ours-nocap": timed(ours_fn(None))} if cost else {"eager-composed": timed(composed)}
    fl = attention_flops(B, H, L, L, D, causal=True, backward=not forward_only)
    what = "forward" if forward_only else "fwd+bwd"
    return Bench(
        work=f"B={B} H={H} L={L} D={D} causal + softcap {cap:g}, {what}, {gflop(fl)}"
        + (", ratio = ours without softcap / ours with" if cost else ""),
        natives=natives,
        ours=timed(ours_fn(cap)),
        flops=fl,
        attn_flops=fl,
        info=dict(B=B, H=H, L=L, D=D, softcap=cap, dtype=str(dtype)),
    )


TINY_CALLS = 200  # calls per timed unit of a tiny case: one call is too short to time alone


def tiny_case(B, H, Lq, Lk, D, train=False):
    """Per-call overhead: F.sdpa on a tiny problem, TINY_CALLS calls per timed unit
    (a decoding step against a short cache, a small model's layer): inference
    under no_grad, or a causal training step (forward + backward)."""
    q, k, v = (torch.randn(B, H, L, D, requires_grad=train) for L in (Lq, Lk, Lk))
    g = torch.randn(B, H, Lq, D)

    def loop(fn):
        def run():
            if train:
                for _ in range(TINY_CALLS):
                    out = fn(q, k, v, is_causal=True)
                    torch.autograd.grad(out, (q, k, v), g)
                return out.detach()
            with torch.no_grad():
                for _ in range(TINY_CALLS):
                    out = fn(q, k, v)
            return out

        return run

    what = "causal fwd+bwd" if train else "inference (no_grad)"
    return Bench(
        work=f"B={B} H={H} Lq={Lq} Lk={Lk} D={D}, {what}, {TINY_CALLS} calls through F.sdpa",
        natives={"sdpa": loop(F.scaled_dot_product_attention)},
        ours=loop(tma.functional.scaled_dot_product_attention),
        memory=False,
        info=dict(B=B, H=H, Lq=Lq, Lk=Lk, D=D, calls=TINY_CALLS, train=train),
    )


def one_head_long():
    return functional_attention(1, 1, 8192, 128, torch.float32, None, ("causal",))


def sweep_point(L, D, pad, dtype, tokens=4096, H=8):
    """Sweep: causal fwd+bwd at B = tokens // L, every sequence with the last
    pad*L keys padded; native gets is_causal (no padding) or the bool mask."""
    B = max(1, tokens // L)
    kpm = key_padding(B, L, pad_fraction=pad) if pad > 0 else None
    bench = functional_attention(B, H, L, D, DTYPES[dtype], kpm, ("bool",) if pad > 0 else ("causal",))
    bench.info.update(sweep=dict(L=L, D=D, pad=pad, dtype=dtype))
    return bench


# ---------------------------------------------------------------- MultiheadAttention


def mha_pair(E, H):
    native = nn.MultiheadAttention(E, H, batch_first=True)
    ours = tma.MultiheadAttention(E, H, batch_first=True)
    ours.load_state_dict(native.state_dict())
    return native, ours


def bert_infer():
    """Encoder inference: eval mode, no_grad, key padding (native takes its fast path)."""
    B, L, E, H = 8, 512, 768, 12
    native, ours = mha_pair(E, H)
    native.eval(), ours.eval()
    x = torch.randn(B, L, E)
    kpm = key_padding(B, L)

    def call(mod):
        def run():
            with torch.no_grad():
                return mod(x, x, x, key_padding_mask=kpm, need_weights=False)[0]

        return run

    fa = attention_flops(B, H, L, L, E // H, causal=False, backward=False)
    fl = fa + projection_flops(B, L, E, backward=False)
    return Bench(
        work=f"MHA E={E} H={H} B={B} L={L} key padding, eval no_grad, {gflop(fl)} ({gflop(fa)} attn)",
        natives={"nn.MHA": call(native)},
        ours=call(ours),
        flops=fl,
        attn_flops=fa,
        info=dict(B=B, L=L, E=E, H=H),
    )


def mha_train(B, L, E=512, H=8, timed=True):
    """Training step: forward + backward into the input and all parameters,
    causal (attn_mask + is_causal hint) + key padding, need_weights=False."""
    native, ours = mha_pair(E, H)
    x = torch.randn(B, L, E, requires_grad=True)
    g = torch.randn(B, L, E)
    kpm = key_padding(B, L)
    causal = causal_blocked(L)

    def call(mod):
        def run():
            mod.zero_grad(set_to_none=True)
            x.grad = None
            out = mod(x, x, x, key_padding_mask=kpm, attn_mask=causal, is_causal=True, need_weights=False)[0]
            out.backward(g)
            return out.detach()

        return run

    fa = attention_flops(B, H, L, L, E // H, causal=True, backward=True)
    fl = fa + projection_flops(B, L, E, backward=True)
    return Bench(
        work=f"MHA E={E} H={H} B={B} L={L} causal+key padding, train fwd+bwd, {gflop(fl)} "
        f"({gflop(fa)} attn)" + ("" if timed else ", peak memory only"),
        natives={"nn.MHA": call(native)},
        ours=call(ours),
        flops=fl,
        attn_flops=fa,
        timed=timed,
        info=dict(B=B, L=L, E=E, H=H),
    )


# ---------------------------------------------------------------- cross-entropy


def cross_entropy_case(N, C, dtype, ignored_fraction=0.25, sweep=None):
    if not hasattr(tma.functional, "cross_entropy"):
        raise Skip("torch_masked_attn.functional.cross_entropy does not exist yet")
    ours_ce = tma.functional.cross_entropy
    x = torch.randn(N, C, dtype=dtype, requires_grad=True)
    t = torch.randint(0, C, (N,))
    ignored = torch.randperm(N)[: int(round(N * ignored_fraction))]
    t[ignored] = -100
    kept = N - len(ignored)

    def call(loss_fn):
        def run():
            loss = loss_fn(x, t)
            torch.autograd.grad(loss, x)
            return loss.detach().float()

        return run

    natives = {"F.cross_entropy": call(F.cross_entropy)}
    if dtype != torch.float32:
        natives["F.cross_entropy-fp32-upcast"] = call(lambda x, t: F.cross_entropy(x.float(), t))
    s = x.element_size()
    # ideal: forward reads the kept rows once, backward reads them again and
    # writes the whole gradient (zeros in ignored rows)
    traffic = s * C * (2.0 * kept + N)
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
    info = dict(N=N, C=C, dtype=str(dtype), kept=kept)
    if sweep:
        info["ce_sweep"] = sweep
    return Bench(
        work=f"{N}x{C} {name}, {ignored_fraction:.0%} ignore_index, fwd+bwd, min traffic {traffic / 1e9:.2f} GB",
        natives=natives,
        ours=call(ours_ce),
        traffic_bytes=traffic,
        info=info,
    )


def ce_sweep_point(V, pct, elements=1 << 28):
    """Vocabulary sweep: cross-entropy fwd+bwd on float32 logits, the same
    number of logits (2^28, 1 GB) at every vocabulary size V (N = 2^28 / V
    rows), pct % of the targets ignore_index."""
    return cross_entropy_case(elements // V, V, torch.float32, pct / 100, sweep=dict(V=V, ignored=pct / 100))


def linear_cross_entropy_case(N, d, V, dtype, ignored_fraction=0.25, chunk_size=None):
    """Fused linear cross-entropy (an LM head's loss) fwd+bwd into the hidden
    states and the weight; native: F.cross_entropy(hidden @ weight.T, target)."""
    if not hasattr(tma.functional, "linear_cross_entropy"):
        raise Skip("torch_masked_attn.functional.linear_cross_entropy does not exist yet")
    h = torch.randn(N, d, dtype=dtype, requires_grad=True)
    w = (torch.randn(V, d, dtype=dtype) / d**0.5).requires_grad_()
    t = torch.randint(0, V, (N,))
    t[torch.randperm(N)[: int(round(N * ignored_fraction))]] = -100

    def call(loss_fn):
        def run():
            loss = loss_fn()
            torch.autograd.grad(loss, (h, w))
            return loss.detach().float()

        return run

    natives = {"F.cross_entropy(h @ W.T)": call(lambda: F.cross_entropy(h @ w.T, t))}
    ours = call(lambda: tma.functional.linear_cross_entropy(h, w, t, chunk_size=chunk_size))
    fl = 6.0 * N * V * d  # logits, grad of hidden, grad of weight: three N x V x d products
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
    return Bench(
        work=f"hidden {N}x{d}, weight {V}x{d} {name}, {ignored_fraction:.0%} ignore_index, fwd+bwd, "
        f"{gflop(fl)} (native; ours skips ignored rows)",
        natives=natives,
        ours=ours,
        flops=fl,
        info=dict(N=N, d=d, V=V, dtype=str(dtype), ignored=ignored_fraction),
    )


def decode(dtype, B=8, H=32, Lk=2048, D=128, interleaved=False, Hkv=None):
    """One decoding step: one new query per sequence against a cache of Lk
    keys and values, no grad. Memory-bound: the work is reading K and V once
    (traffic_bytes), which both implementations must do. interleaved: the cache
    is (B, Lk, H, D), heads side by side in each row (what a (B, L, H, D)
    projection or HF's static cache gives), passed to F.sdpa as its
    (B, H, Lk, D) transposed view, to both sides. Hkv: grouped query heads (H // Hkv
    query heads per key head, enable_gqa)."""
    Hkv = Hkv or H
    q = torch.randn(B, H, 1, D, dtype=dtype)
    if interleaved:
        k, v = (torch.randn(B, Lk, Hkv, D, dtype=dtype).transpose(1, 2) for _ in range(2))
    else:
        k, v = (torch.randn(B, Hkv, Lk, D, dtype=dtype) for _ in range(2))
    gqa = Hkv != H

    def native():
        with torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)

    def ours():
        with torch.no_grad():
            return tma.functional.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)

    fl = attention_flops(B, H, 1, Lk, D, causal=False, backward=False)
    traffic = 2.0 * B * Hkv * Lk * D * k.element_size()
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
    layout = ", (B, Lk, H, D) cache" if interleaved else ""
    return Bench(
        work=f"B={B} H={H}/{Hkv} Lq=1 Lk={Lk} D={D} {name}, forward (no grad){layout}, K+V {traffic / 1e6:.0f} MB",
        natives={"sdpa": native},
        ours=ours,
        flops=fl,
        attn_flops=fl,
        traffic_bytes=traffic,
        info=dict(B=B, H=H, Hkv=Hkv, Lq=1, Lk=Lk, D=D, dtype=str(dtype), layout="BLHD" if interleaved else "BHLD"),
    )


def varlen(B=8, H=8, D=64, lo=64, hi=2048):
    """A packed causal batch, lengths uniform in [lo, hi], fwd+bwd: ours
    through varlen_attn on the packed (T, H, D) tokens (no padding), native
    F.sdpa on the same batch padded to the longest with a bool (B, 1, L, L)
    mask (causal + key padding, True = take part), built outside the timed call."""
    lengths = torch.randint(lo, hi + 1, (B,)).tolist()
    L, T = max(lengths), sum(lengths)
    cu = torch.zeros(B + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    q, k, v = (torch.randn(T, H, D, requires_grad=True) for _ in range(3))
    g = torch.randn(T, H, D)
    # the padded batch: the same values at (b, :, :len_b), zeros after
    pos = torch.arange(L)
    valid = pos[None] < torch.tensor(lengths)[:, None]  # (B, L)

    def pad(t):
        out = t.new_zeros(B, L, H, D)
        out[valid] = t.detach()
        return out.transpose(1, 2).contiguous()

    qp, kp, vp = (pad(t).requires_grad_() for t in (q, k, v))
    gp = pad(g)
    allowed = (pos[None, :] <= pos[:, None])[None, None] & valid[:, None, None, :]  # (B, 1, L, L)
    padded = fwd_bwd(lambda: F.scaled_dot_product_attention(qp, kp, vp, attn_mask=allowed), (qp, kp, vp), gp)

    def native():  # the cross-check compares the real tokens, packed (untimed work is negligible)
        return padded().transpose(1, 2)[valid]

    ours = fwd_bwd(lambda: tma.functional.varlen_attn(q, k, v, cu, cu, L, L, window_size=(-1, 0)), (q, k, v), g)
    fl = sum(attention_flops(1, H, n, n, D, causal=True, backward=True) for n in lengths)
    return Bench(
        work=f"B={B} packed causal, lengths uniform in [{lo}, {hi}] (T={T}, longest {L}) H={H} D={D}, "
        f"fwd+bwd, varlen_attn vs F.sdpa padded + bool mask, {gflop(fl)} of real work",
        natives={"sdpa-padded-bool": native},
        ours=ours,
        flops=fl,
        attn_flops=fl,
        info=dict(B=B, H=H, D=D, lengths=lengths, dtype=str(torch.float32)),
    )


def decode_paged(B=8, H=32, Lk=2048, D=128, page=256):
    """The decode case's step read from a paged KV cache: the same B x Lk keys
    and values as pages of `page` tokens in a shuffled pool, one query per
    sequence through varlen_attn(block_table=..., seqused_k=...), against
    native F.sdpa on the dense (B, H, Lk, D) cache (the decode case's native)."""
    q = torch.randn(B, H, 1, D)
    k, v = (torch.randn(B, H, Lk, D) for _ in range(2))
    n = Lk // page
    perm = torch.randperm(B * n)
    table = perm.view(B, n).to(torch.int32)

    def pool(t):  # (B, H, Lk, D) -> (B * n, page, H, D) with page (b, i) at perm[b * n + i]
        pages = t.transpose(1, 2).reshape(B * n, page, H, D)
        out = torch.empty_like(pages)
        out[perm] = pages
        return out

    kp, vp = pool(k), pool(v)
    qv = q[:, :, 0].contiguous()  # (B, H, D) = (T_q, H, D)
    cu = torch.arange(B + 1, dtype=torch.int32)
    used = torch.full((B,), Lk, dtype=torch.int32)

    def native():
        with torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v)[:, :, 0]

    def ours():
        with torch.no_grad():
            return tma.functional.varlen_attn(qv, kp, vp, cu, None, 1, Lk, seqused_k=used, block_table=table)

    fl = attention_flops(B, H, 1, Lk, D, causal=False, backward=False)
    traffic = 2.0 * B * H * Lk * D * k.element_size()
    return Bench(
        work=f"B={B} H={H} Lq=1 Lk={Lk} D={D} float32, forward (no grad), paged KV (pages of {page}) "
        f"vs native on the dense cache, K+V {traffic / 1e6:.0f} MB",
        natives={"sdpa-dense": native},
        ours=ours,
        flops=fl,
        attn_flops=fl,
        traffic_bytes=traffic,
        info=dict(B=B, H=H, Lq=1, Lk=Lk, D=D, page=page, dtype=str(torch.float32)),
    )


# ---------------------------------------------------------------- FlexAttention (compiled), forward


def flex_case(kind, dtype):
    """The same forward (no grad) through torch.compile(flex_attention) with a
    BlockMask (and a score_mod for softcap), PyTorch's own answer to masks that
    F.sdpa lacks, against ours. FlexAttention on the CPU is forward-only. The
    compile happens here, outside the timed calls.

    kind: "kpm" (B=8 H=12 L=512, key padding, lengths uniform in [L/2, L]),
    "causal" (B=1 H=8 L=4096), "window" (causal window 1024, L=8192, 8 query
    heads on 2 KV heads), "document" (the varlen case's packed batch, causal
    within each document: ours through varlen_attn), "softcap" (causal +
    softcap 50, B=2 H=8 L=2048). D=64 throughout."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as e:
        raise Skip(f"no FlexAttention in this torch: {e}") from e
    # every case compiles flex_attention anew: past dynamo's recompile limit (8 per code object)
    # a later case would silently run FlexAttention eagerly, tens of times slower
    torch._dynamo.reset()
    flex = torch.compile(flex_attention, dynamic=False)
    D, Hkv, score_mod, gqa = 64, None, None, False
    if kind == "kpm":
        B, H, L = 8, 12, 512
        lengths = torch.randint(L // 2, L + 1, (B,))
        kpm = torch.arange(L)[None, :] >= lengths[:, None]

        def mask_mod(b, h, qi, ki):
            return ki < lengths[b]

        ours_kw = dict(key_padding_mask=kpm)
        fl = attention_flops(B, H, L, L, D, causal=False, backward=False) * lengths.float().mean().item() / L
        what = f"key padding ({kpm.float().mean().item():.0%})"
    elif kind in ("causal", "softcap", "window"):
        B, H, L = {"causal": (1, 8, 4096), "softcap": (2, 8, 2048), "window": (1, 8, 8192)}[kind]

        def mask_mod(b, h, qi, ki):
            return qi >= ki

        ours_kw = dict(is_causal=True)
        fl = attention_flops(B, H, L, L, D, causal=True, backward=False)
        what = "causal"
        if kind == "softcap":
            cap = 50.0

            def score_mod(score, b, h, qi, ki):
                return cap * torch.tanh(score / cap)

            ours_kw["softcap"] = cap
            what = f"causal + softcap {cap:g}"
        if kind == "window":
            W, Hkv, gqa = 1024, 2, True

            def mask_mod(b, h, qi, ki):
                return (qi >= ki) & (qi - ki <= W)

            ours_kw = dict(window=(W, 0))
            fl = 4.0 * B * H * L * (W + 1) * D
            what = f"causal window {W}, {H} query heads on {Hkv} KV heads"
    elif kind == "document":
        B, H = 1, 8
        lengths = torch.randint(64, 2049, (8,)).tolist()
        L = T = sum(lengths)
        doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(lengths).cumsum(0)

        def mask_mod(b, h, qi, ki):
            return (doc[qi] == doc[ki]) & (qi >= ki)

        fl = sum(attention_flops(1, H, n, n, D, causal=True, backward=False) for n in lengths)
        what = f"8 packed documents, lengths uniform in [64, 2048] (T={T}), causal within each"
    else:
        raise KeyError(kind)
    q = torch.randn(B, H, L, D, dtype=dtype)
    k, v = (torch.randn(B, Hkv or H, L, D, dtype=dtype) for _ in range(2))
    block_mask = create_block_mask(mask_mod, B if kind == "kpm" else None, None, L, L, device="cpu")

    def native():
        with torch.no_grad():
            out = flex(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=gqa)
        return out[0].transpose(0, 1) if kind == "document" else out

    def ours():
        with torch.no_grad():
            if kind == "document":
                qv, kv, vv = (t[0].transpose(0, 1) for t in (q, k, v))  # (T, H, D) views
                return tma.functional.varlen_attn(qv, kv, vv, cu, cu, max(lengths), max(lengths), window_size=(-1, 0))
            return tma.functional.masked_attention(q, k, v, **ours_kw)

    native()  # compile outside the timed calls
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
    shape = f"H={H} D={D}" if kind == "document" else f"B={B} H={H} L={L} D={D}"
    return Bench(
        work=f"{shape} {name}, {what}, forward (no grad), compiled flex_attention + BlockMask vs ours, {gflop(fl)}",
        natives={"flex-compiled": native},
        ours=ours,
        flops=fl,
        attn_flops=fl,
        memory=False,
        info=dict(kind=kind, B=B, H=H, L=L, D=D, dtype=str(dtype)),
    )


def zentorch_case(kind, dtype):
    """The same forward (no grad) through AMD's zentorch plugin
    (torch.ops.zentorch.zentorch_sdpa, from PyPI; make bench installs it
    beside the package, never as a dependency) against ours. kind: "kpm" (an
    encoder, B=8 H=12 L=512 D=64, key padding with lengths uniform in [L/2,
    L], given to zentorch as a float mask), "causal" (B=1 H=8 L=4096 D=64)."""
    try:
        import zentorch  # noqa: F401  (registers torch.ops.zentorch)

        zsdpa = torch.ops.zentorch.zentorch_sdpa
    except (ImportError, AttributeError, RuntimeError) as e:
        raise Skip(f"zentorch is not installed or does not load here: {e}") from e
    D = 64
    if kind == "kpm":
        B, H, L = 8, 12, 512
        lengths = torch.randint(L // 2, L + 1, (B,))
        kpm = torch.arange(L)[None, :] >= lengths[:, None]
        bias = torch.zeros(B, 1, L, L, dtype=dtype).masked_fill(kpm[:, None, None, :], float("-inf"))
        native_kw, ours_kw = dict(attn_mask=bias), dict(key_padding_mask=kpm)
        fl = attention_flops(B, H, L, L, D, causal=False, backward=False) * lengths.float().mean().item() / L
        what = f"key padding ({kpm.float().mean().item():.0%})"
    elif kind == "causal":
        B, H, L = 1, 8, 4096
        native_kw, ours_kw = dict(is_causal=True), dict(is_causal=True)
        fl = attention_flops(B, H, L, L, D, causal=True, backward=False)
        what = "causal"
    else:
        raise KeyError(kind)
    q, k, v = (torch.randn(B, H, L, D, dtype=dtype) for _ in range(3))

    def native():
        with torch.no_grad():
            return zsdpa(q, k, v, 0.0, native_kw.get("is_causal", False), attn_mask=native_kw.get("attn_mask"))[0]

    def ours():
        with torch.no_grad():
            return tma.functional.masked_attention(q, k, v, **ours_kw)

    try:
        native()
    except RuntimeError as e:
        raise Skip(f"zentorch_sdpa does not run here: {e}") from e
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
    return Bench(
        work=f"B={B} H={H} L={L} D={D} {name}, {what}, forward (no grad), zentorch_sdpa "
        f"(zentorch {getattr(zentorch, '__version__', '?')}) vs ours, {gflop(fl)}",
        natives={"zentorch": native},
        ours=ours,
        flops=fl,
        attn_flops=fl,
        memory=False,
        info=dict(kind=kind, B=B, H=H, L=L, D=D, dtype=str(dtype)),
    )


# ---------------------------------------------------------------- Hugging Face end to end

HF_VOCAB = 32000


def _hf_models(L):
    """A Llama-style model from a random config (nothing downloaded): hidden 512, 4 layers,
    8 heads / 2 KV heads (GQA), vocab 32000; twice with the same weights: native
    (attn_implementation="sdpa", transformers' own loss) and ours ("masked_attn" +
    torch_masked_attn.hf.apply). Each gets its own copy of the config (from_config writes
    the attention implementation into the config object it is given)."""
    try:
        import copy

        from transformers import AutoModelForCausalLM, LlamaConfig

        from torch_masked_attn import hf
    except ImportError as e:
        raise Skip(f"Hugging Face transformers is not installed ({e})") from e
    cfg = LlamaConfig(
        vocab_size=HF_VOCAB,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=max(L + 64, 2048),
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    native = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="sdpa")
    ours = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="masked_attn")
    ours.load_state_dict(native.state_dict())
    hf.apply(ours)
    assert native.config._attn_implementation == "sdpa" and ours.config._attn_implementation == "masked_attn"
    return native, ours


def _hf_batch(B, L, side):
    """Token ids (B, L) and the attention mask (1 = token), lengths uniform in [L/2, L],
    padding on the right (training) or the left (prefill and generate, as generate wants)."""
    lengths = torch.randint(L // 2, L + 1, (B,))
    ids = torch.randint(3, HF_VOCAB, (B, L))
    keep = torch.arange(L)[None, :] < lengths[:, None]
    if side == "left":
        keep = keep.flip(1)
    ids = ids.masked_fill(~keep, 0)
    return ids, keep.long(), 1.0 - keep.float().mean().item()


HF_REPS = {1024: (3, 5, 10.0), 4096: (2, 2, 0.0)}  # L=4096: one warm-up and two timed calls of each


def hf_e2e(kind, L, B=4, new_tokens=32):
    """End to end on a Llama-style model (see _hf_models), native HF "sdpa" with its own loss
    against "masked_attn" + hf.apply, same weights and inputs.

    train:    model(input_ids, attention_mask, labels) and backward (padding labels -100), train mode;
    train-packed: the same sequences' tokens packed in one row without padding, position_ids
              restarting per sequence (transformers' padding-free training: DataCollatorWithFlattening),
              no cache; native builds its block-diagonal mask, ours runs varlen_attn;
    prefill:  forward, no grad, eval, logits of the last position only (logits_to_keep=1, as
              generate's first step does), left padding;
    generate: greedy generate of new_tokens tokens (exactly: min_new_tokens) with transformers'
              default dynamic KV cache from the left-padded prompts; ratio = tokens/s ratio.
    Returns a loss, the last logits or the tokens for the cross-check."""
    native, ours = _hf_models(L)
    ids, mask, pad = _hf_batch(B, L, "right" if kind == "train" else "left")
    labels = ids.masked_fill(mask == 0, -100)
    if kind == "train-packed":  # the same tokens without padding, end to end in one row
        keep = mask.bool()
        ids, labels, mask = ids[keep][None], labels[keep][None], None
        pos = torch.cat([torch.arange(int(n)) for n in keep.sum(1)])[None]

    if kind == "train":

        def call(model):
            model.train()

            def run():
                model.zero_grad(set_to_none=True)
                out = model(input_ids=ids, attention_mask=mask, labels=labels)
                out.loss.backward()
                return out.loss.detach()

            return run

        what = "training step (fwd+bwd, loss from labels, padding labels -100), right padding"
    elif kind == "train-packed":

        def call(model):
            model.train()

            def run():  # transformers finds the documents from position_ids (no mask, no cache)
                model.zero_grad(set_to_none=True)
                out = model(input_ids=ids, position_ids=pos, labels=labels, use_cache=False)
                out.loss.backward()
                return out.loss.detach()

            return run

        what = f"training step on the same {B} sequences packed (1, {ids.shape[1]}), padding-free: position_ids"
        pad = 0.0
    elif kind == "prefill":

        def call(model):
            model.eval()

            def run():
                with torch.no_grad():
                    return model(input_ids=ids, attention_mask=mask, logits_to_keep=1).logits

            return run

        what = "prefill (forward, no grad, logits_to_keep=1), left padding"
    elif kind == "generate":

        def call(model):
            model.eval()

            def run():
                with torch.no_grad():
                    out = model.generate(
                        input_ids=ids,
                        attention_mask=mask,
                        max_new_tokens=new_tokens,
                        min_new_tokens=new_tokens,
                        do_sample=False,
                        pad_token_id=0,
                    )
                return out[:, L:]

            return run

        what = f"greedy generate {new_tokens} new tokens (dynamic KV cache), left padding; ratio = tokens/s ratio"
    else:
        raise KeyError(kind)
    return Bench(
        work=f"HF Llama d=512 4 layers 8/2 heads V={HF_VOCAB} B={B} L={L} ({pad:.0%} padding), {what}",
        natives={"hf-sdpa": call(native)},
        ours=call(ours),
        memory=kind.startswith("train"),
        reps=HF_REPS.get(L),
        info=dict(B=B, L=L, kind=kind, padding=round(pad, 3), new_tokens=new_tokens if kind == "generate" else None),
    )


def warm_up_hf():
    """One tiny training step, prefill and generate through both implementations (imports,
    the attention / mask registries, lazy initialisation), for the HF cases' memory probes."""
    try:
        native, ours = _hf_models(64)
    except Skip:
        return
    ids, mask, _ = _hf_batch(2, 64, "left")
    for model in (native, ours):
        model.train()
        model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss.backward()
        model.eval()
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)


# ---------------------------------------------------------------- registry

NAMED = {
    "gpt-train": lambda: gpt_train(torch.float32),
    "long-causal": lambda: long_causal(torch.float32),
    "long-causal-fwd": long_causal_forward,
    "long-causal-fwd-bf16": lambda: long_causal_forward(torch.bfloat16),
    "one-head-long": one_head_long,
    "bert-infer": bert_infer,
    "mha-train": lambda: mha_train(8, 512),
    "gpt-train-bf16": lambda: gpt_train(torch.bfloat16),
    "long-causal-bf16": lambda: long_causal(torch.bfloat16),
    "decode": lambda: decode(torch.float32),
    "decode-bf16": lambda: decode(torch.bfloat16),
    "hf-mask": hf_mask,
    # dropout 0.1 on both sides (native F.sdpa falls back to its math path: the (B, H, L, L) mask materialised)
    "gpt-train-dropout": lambda: gpt_train(torch.float32, 0.1),
    "gpt-train-dropout-bf16": lambda: gpt_train(torch.bfloat16, 0.1),
    # our dropout's own cost: "native" = ours at dropout 0, ours at 0.1 (ratio = 1 / (1 + overhead))
    "gpt-train-dropout-cost": lambda: gpt_train(torch.float32, 0.1, ("ours-p0",)),
    "gpt-train-dropout-cost-bf16": lambda: gpt_train(torch.bfloat16, 0.1, ("ours-p0",)),
    "sliding-window": sliding_window,
    "softcap": lambda: softcap_case(False),
    "softcap-fwd": lambda: softcap_case(False, forward_only=True),
    "softcap-cost": lambda: softcap_case(True),
    "softcap-cost-fwd": lambda: softcap_case(True, forward_only=True),
    "softcap-cost-bf16": lambda: softcap_case(True, torch.bfloat16),
    "varlen": varlen,
    "weights-train": weights_train,
    "decode-paged": decode_paged,
    "decode-interleaved": lambda: decode(torch.float32, interleaved=True),
    "decode-interleaved-bf16": lambda: decode(torch.bfloat16, interleaved=True),
    "decode-gqa": lambda: decode(torch.float32, B=1, Hkv=8, Lk=32768),
    "decode-gqa-bf16": lambda: decode(torch.bfloat16, B=1, Hkv=8, Lk=32768),
    "decode-gqa-interleaved-bf16": lambda: decode(torch.bfloat16, B=1, Hkv=8, Lk=32768, interleaved=True),
    "tiny-decode-16": lambda: tiny_case(1, 8, 1, 16, 64),
    "tiny-decode-256": lambda: tiny_case(1, 8, 1, 256, 64),
    "tiny-prefill-8": lambda: tiny_case(1, 16, 8, 8, 64),
    "tiny-train": lambda: tiny_case(2, 4, 32, 32, 32, train=True),
    "mha-mem-8192": lambda: mha_train(1, 8192, timed=False),
    "ce": lambda: cross_entropy_case(8192, 32000, torch.float32),
    "ce-bf16": lambda: cross_entropy_case(4096, 128256, torch.bfloat16),
    "linear-ce": lambda: linear_cross_entropy_case(2048, 512, 65536, torch.float32),
    "flex-kpm": lambda: flex_case("kpm", torch.float32),
    "flex-kpm-bf16": lambda: flex_case("kpm", torch.bfloat16),
    "flex-causal": lambda: flex_case("causal", torch.float32),
    "flex-causal-bf16": lambda: flex_case("causal", torch.bfloat16),
    "flex-window": lambda: flex_case("window", torch.float32),
    "flex-window-bf16": lambda: flex_case("window", torch.bfloat16),
    "flex-document": lambda: flex_case("document", torch.float32),
    "flex-document-bf16": lambda: flex_case("document", torch.bfloat16),
    "flex-softcap": lambda: flex_case("softcap", torch.float32),
    "flex-softcap-bf16": lambda: flex_case("softcap", torch.bfloat16),
    "hf-train-1024": lambda: hf_e2e("train", 1024),
    "hf-train-packed-1024": lambda: hf_e2e("train-packed", 1024),
    "zentorch-kpm": lambda: zentorch_case("kpm", torch.float32),
    "zentorch-kpm-bf16": lambda: zentorch_case("kpm", torch.bfloat16),
    "zentorch-causal": lambda: zentorch_case("causal", torch.float32),
    "zentorch-causal-bf16": lambda: zentorch_case("causal", torch.bfloat16),
    "hf-prefill-1024": lambda: hf_e2e("prefill", 1024),
    "hf-generate-1024": lambda: hf_e2e("generate", 1024),
    "hf-train-4096": lambda: hf_e2e("train", 4096),
    "hf-prefill-4096": lambda: hf_e2e("prefill", 4096),
    "hf-generate-4096": lambda: hf_e2e("generate", 4096),
    **serving.NAMED,  # vllm-* and kvwrite-*: vLLM's CPU paged attention and the KV-cache write
    **kv8.NAMED,  # kv8-*: the 8-bit KV cache
}
GROUPS = {
    "attention": [
        "gpt-train",
        "long-causal",
        "long-causal-fwd",
        "one-head-long",
        "bert-infer",
        "mha-train",
        "gpt-train-bf16",
        "long-causal-bf16",
        "long-causal-fwd-bf16",
        "decode",
        "decode-bf16",
        "hf-mask",
        "sliding-window",
        "varlen",
        "weights-train",
        "decode-paged",
        "decode-interleaved",
        "decode-interleaved-bf16",
    ],
    "dropout": ["gpt-train-dropout", "gpt-train-dropout-cost", "gpt-train-dropout-bf16", "gpt-train-dropout-cost-bf16"],
    "softcap": ["softcap", "softcap-fwd", "softcap-cost", "softcap-cost-fwd", "softcap-cost-bf16"],
    "flex": [
        f"flex-{kind}{suffix}"
        for kind in ("kpm", "causal", "window", "document", "softcap")
        for suffix in ("", "-bf16")
    ],
    "zentorch": [f"zentorch-{kind}{suffix}" for kind in ("kpm", "causal") for suffix in ("", "-bf16")],
    "vllm": serving.GROUP,
    "kv8": kv8.GROUP,
    "tiny": ["tiny-decode-16", "tiny-decode-256", "tiny-prefill-8", "tiny-train"],
    "memory": ["mha-mem-8192"],
    "ce": ["ce", "ce-bf16", "linear-ce"],
    "hf-e2e": [
        "hf-train-1024",
        "hf-train-packed-1024",
        "hf-prefill-1024",
        "hf-generate-1024",
        "hf-train-4096",
        "hf-prefill-4096",
        "hf-generate-4096",
    ],
}

SWEEP_FULL = dict(L=[128, 256, 512, 1024, 2048, 4096, 8192], D=[64, 128], pad=[0.0, 0.25, 0.5], dtype=["fp32", "bf16"])
# make bench's sweep: the whole range of every axis, every other length
SWEEP_QUICK = dict(L=[128, 512, 2048, 8192], D=[64, 128], pad=[0.0, 0.25, 0.5], dtype=["fp32", "bf16"])
_SWEEP_RE = re.compile(r"sweep-L(\d+)-D(\d+)-p(\d+)-(fp32|bf16)$")

# cross-entropy vocabulary sweep: V (8k to 256k) x % of targets ignored, 2^28 float32 logits each
CE_SWEEP_FULL = dict(V=[8192, 16384, 32768, 65536, 131072, 262144], pct=[0, 25, 50])
CE_SWEEP_QUICK = dict(V=[8192, 32768, 131072, 262144], pct=[0, 50])
_CE_SWEEP_RE = re.compile(r"ce-sweep-V(\d+)-p(\d+)$")


def ce_sweep_name(V, pct):
    return f"ce-sweep-V{V}-p{pct}"


def ce_sweep_names(grid):
    return [ce_sweep_name(V, p) for p in grid["pct"] for V in grid["V"]]


def sweep_name(L, D, pad, dtype):
    return f"sweep-L{L}-D{D}-p{int(round(pad * 100))}-{dtype}"


def sweep_names(grid):
    return [sweep_name(L, D, p, dt) for dt in grid["dtype"] for D in grid["D"] for p in grid["pad"] for L in grid["L"]]


def build(name):
    """The Bench for a case name (named case or sweep point), inputs seeded."""
    torch.manual_seed(0)
    if name in NAMED:
        return NAMED[name]()
    m = _SWEEP_RE.match(name)
    if m:
        L, D, pct, dt = int(m[1]), int(m[2]), int(m[3]), m[4]
        return sweep_point(L, D, pct / 100, dt)
    m = _CE_SWEEP_RE.match(name)
    if m:
        return ce_sweep_point(int(m[1]), int(m[2]))
    raise KeyError(f"unknown case {name!r}")


def warm_up_libraries():
    """Tiny calls through every code path a case uses (thread pools, kernel
    dispatch, lazy initialisation), so a memory probe's first big call does
    not also pay one-time set-up. Both implementations get the same."""
    torch.manual_seed(0)
    for dtype in DTYPES.values():
        for f in functional_attention(2, 2, 64, 16, dtype, key_padding(2, 64), ("bool", "float")).impls().values():
            f()
        for f in functional_attention(1, 2, 64, 16, dtype, None, ("causal",)).impls().values():
            f()
    for f in mha_train(2, 64, E=32, H=2).impls().values():
        f()
    native, ours = mha_pair(32, 2)
    x = torch.randn(2, 64, 32)
    with torch.no_grad():
        for mod in (native.eval(), ours.eval()):
            mod(x, x, x, key_padding_mask=key_padding(2, 64), need_weights=False)
    for dtype in DTYPES.values():
        try:
            for f in cross_entropy_case(16, 100, dtype).impls().values():
                f()
            for f in linear_cross_entropy_case(16, 8, 100, dtype).impls().values():
                f()
        except Skip:
            pass
