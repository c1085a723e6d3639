"""Functional drop-ins.

scaled_dot_product_attention  F.scaled_dot_product_attention's conventions
                              (bool mask True = take part)
masked_attention              the op's own conventions, nn.MultiheadAttention's
                              (bool mask True = blocked), with key padding and
                              head masks as separate arguments
varlen_attn                   torch.nn.attention.varlen.varlen_attn: packed
                              variable-length sequences, no padding
"""

from __future__ import annotations

import dataclasses
import sys
from typing import NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _paging, _validate, ops
from . import devices as _devices
from .autocast import autocast_cast, autocast_dtype
from .devices import KERNEL_DEVICE_TYPES, uses_kernels  # noqa: F401  (part of this module's API)
from .linear_ce import linear_cross_entropy  # noqa: F401  (re-exported)
from .losses import cross_entropy  # noqa: F401  (re-exported)

__all__ = [
    "masked_attention",
    "scaled_dot_product_attention",
    "varlen_attn",
    "AuxRequest",
    "cross_entropy",
    "linear_cross_entropy",
    "write_kv_cache",
    "quantize_kv",
]

# ---- native attention (every device but the CPU) ----------------------------


def native_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    head_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    need_weights: bool = False,
    return_lse: bool = False,
    dropout_p: float = 0.0,
    diagonal: int = 0,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """masked_attn::forward's semantics computed with PyTorch's native ops, on
    any device: (out, lse, weights), lse and weights None unless asked for.

    The op's conventions (bool masks True = blocked, floating masks added, all
    masks summed, is_causal (query i sees keys j <= i + diagonal; 0: top-left)
    combined with the rest, head_mask
    after softmax and after dropout), and ours where native attention differs:
    a query row that no key may attend to gives 0, zero gradients, zero
    weights and lse -inf, never NaN. Without head_mask, weights and lse this
    is one F.scaled_dot_product_attention call (the device's fused kernels);
    otherwise the probabilities are materialised (float32 for bfloat16 /
    float16). dropout_p > 0 draws from the device's generator, as F.sdpa does.
    """
    B, H, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    sc = D**-0.5 if scale is None else float(scale)
    acc = torch.float32 if q.dtype in (torch.bfloat16, torch.float16) else q.dtype
    fused = not (need_weights or return_lse or head_mask is not None)
    kpm = None if key_padding_mask is None else key_padding_mask.view(B, 1, 1, Lk)
    causal_alone = bool(is_causal) and attn_mask is None and kpm is None and diagonal == 0
    causal = bool(is_causal) and not causal_alone
    bias, dead = _native_bias(attn_mask, kpm, causal, diagonal, Lq, Lk, q.dtype if fused else acc, q.device)
    if fused:
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=bias,
            dropout_p=float(dropout_p),
            is_causal=causal_alone,
            scale=sc,
            enable_gqa=H != Hkv,
        )
        if dead is not None:
            out = out.masked_fill(dead, 0.0)
        return out, None, None
    if H != Hkv:
        k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-2, -1)) * sc
    if causal_alone:
        s = s.masked_fill(torch.ones(Lq, Lk, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    if bias is not None:
        s = s + bias
    lse = None
    if return_lse:
        with torch.no_grad():
            lse = torch.logsumexp(s, -1)
            if dead is not None:
                lse = lse.masked_fill(dead.squeeze(-1).expand_as(lse), float("-inf"))
    p = _native_probs(s, dead, dropout_p, head_mask, acc)
    out = torch.matmul(p, v.to(acc)).to(q.dtype)
    return out, lse, (p.to(q.dtype) if need_weights else None)


def _native_bias(
    attn_mask, kpm, causal: bool, diagonal: int, Lq: int, Lk: int, dtype, device
) -> tuple[Tensor | None, Tensor | None]:
    """native_attention's masks (attn_mask, the key padding mask kpm (B, 1, 1, Lk), and, with
    causal, keys j > i + diagonal blocked) summed into one additive bias of dtype, or None; and the rows no
    key may attend to (bool, (..., Lq, 1)), unmasked in the bias for the computation (no NaN
    anywhere, in the forward or the backward) and zeroed by the caller, or None."""

    def additive(m):
        if m.dtype == torch.bool:
            return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(m, float("-inf"))
        return m.to(dtype)

    bias = None
    if causal:
        bias = additive(torch.ones(Lq, Lk, dtype=torch.bool, device=device).triu(1 + diagonal))
    for m in (attn_mask, kpm):
        if m is not None:
            bias = additive(m) if bias is None else bias + additive(m)
    if bias is None:
        return None, None
    dead = torch.isneginf(bias).all(-1, keepdim=True)
    return bias.masked_fill(dead, 0.0), dead


def _native_probs(s: Tensor, dead: Tensor | None, dropout_p: float, head_mask: Tensor | None, acc) -> Tensor:
    """native_attention's probabilities of the scores s (B, H, Lq, Lk): softmax, the dead rows 0,
    dropout, the head mask."""
    p = torch.softmax(s, -1)
    if dead is not None:
        p = p.masked_fill(dead, 0.0)
    if dropout_p > 0.0:
        p = F.dropout(p, float(dropout_p))
    if head_mask is not None:
        B, H = s.size(0), s.size(1)
        hm = head_mask.to(acc)
        p = p * (hm.view(1, H, 1, 1) if hm.dim() == 1 else hm.view(B, H, 1, 1))
    return p


# ---- the plain call's short path ---------------------------------------------
#
# A decoding step or a small model's layer is a few microseconds of arithmetic;
# the checks below cost as much again (docs/design.md, "The plain call"). The
# plain call (no mask, dropout, window, softcap or sinks; CPU tensors; outside
# autocast and torch.compile) goes to the op at once: the shim checks every
# tensor property the kernels rely on. If it refuses, the call is made again
# through the checked path, which raises the drop-in's own exception (or, for
# inputs the drop-in reshapes first, computes the result).

_FORWARD = torch.ops.masked_attn.forward.default


def _plain_forward(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float | None) -> Tensor | None:
    """masked_attn::forward's out for q, k, v alone (no mask), or None where
    the op refused them."""
    try:
        return ops.call_op(
            _FORWARD,
            q,
            k,
            v,
            None,
            None,
            None,
            is_causal,
            scale,
            False,
            0.0,
            None,
            ops.grad_wanted(q, k, v),  # for_backward; the shared options (window, ...) at their defaults
        )[0]
    except (RuntimeError, TypeError):
        return None


def _plain_call(q: object, k: object, v: object) -> bool:
    """Whether a call of q, k, v with no other tensor may take the short path:
    three CPU tensors outside autocast and torch.compile (the shim checks the rest)."""
    return (
        isinstance(q, Tensor)
        and q.is_cpu
        and "cpu" in _devices.KERNEL_DEVICE_TYPES
        and isinstance(k, Tensor)
        and isinstance(v, Tensor)
        and not torch.compiler.is_compiling()
        and not torch.is_autocast_enabled("cpu")
    )


def _as_4d_attn_mask(attn_mask, B, H):
    """nn.MultiheadAttention's (B*H, Lq, Lk) form as the (B, H, Lq, Lk) it means;
    every other shape is left to broadcast by strides."""
    if attn_mask is not None and attn_mask.dim() == 3 and B > 1 and attn_mask.size(0) == B * H:
        return attn_mask.unflatten(0, (B, H))
    return attn_mask


def masked_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    attn_mask: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    head_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    need_weights: bool = False,
    return_lse: bool = False,
    dropout_seed: Tensor | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    diagonal: int = 0,
) -> Tensor | tuple[Tensor, ...]:
    """Masked multi-head attention.

    Args:
        q: (B, H, Lq, D); k: (B, Hkv, Lk, D); v: (B, Hkv, Lk, Dv), any strides,
            H a multiple of Hkv (grouped-query attention). float32, float64,
            bfloat16 or float16.
        attn_mask: bool (True = blocked) or floating (added to the scaled
            scores); any shape that broadcasts to (B, H, Lq, Lk), or
            nn.MultiheadAttention's (B*H, Lq, Lk).
        key_padding_mask: (B, Lk), bool (True = padding) or floating (added).
            A floating attn_mask or key_padding_mask that requires grad gets
            its gradient (the backward then materialises dL/dS, (B, H, Lq, Lk)).
        head_mask: (H,) or (B, H), multiplies each head's attention
            probabilities (differentiable).
        is_causal: query i sees key j only if j <= i + diagonal (top-left
            aligned by default).
        scale: defaults to 1 / sqrt(D).
        dropout_p: drop each attention probability with this probability and
            scale the kept ones by 1 / (1 - dropout_p), inside the kernels (the
            mask is never stored; the backward regenerates it). Applied
            whenever > 0, as F.scaled_dot_product_attention does.
        need_weights: also return the attention probabilities (B, H, Lq, Lk),
            after dropout and the head mask (out = weights @ v).
        dropout_seed: the int64 (seed, offset) tensor of shape (2,) the mask
            is a function of; None draws one from PyTorch's default
            generator (ops.new_dropout_seed), so torch.manual_seed reproduces.
        return_lse: also return the per-row log-sum-exp (B, H, Lq) (float32,
            float64 for float64 inputs); -inf for a fully masked row. It
            includes the sink when sinks are given.
        window: (left, right): query i sees only keys j with
            i + diagonal - left <= j <= i + diagonal + right; a side None or
            -1 is unbounded. Combined with every other mask; key blocks
            outside the window are never computed. (W, 0) is a causal window
            of W earlier keys.
        softcap: scores s (scaled q . k) become softcap * tanh(s / softcap)
            before the masks are added (Gemma 2).
        sinks: (H,) floating, one learned logit per head that joins every
            row's softmax denominator and has no value (GPT-OSS); gets a
            gradient. A row that no key may attend to still gives 0.
        alibi_slopes: (H,) or (B, H) float32, flash-attn's ALiBi: the score
            of query i and key j gets -slope * |i + Lk - Lq - j| (bottom-right
            aligned, as flash-attn), added after the scaling and the soft-cap,
            with the masks. No gradient.
        k_scale, v_scale: an 8-bit KV cache: k and v int8 and these their
            float32 scales, shaped like k and v without the last dim (one per
            key and head; :func:`quantize_kv` makes both). Key j's values are
            k_scale[j] * k[j]; the kernels apply the scales outside the dot
            products and never dequantize K or V. q float32, bfloat16 or
            float16 (the output's dtype). Inference only: no gradient.
        diagonal: query i's diagonal is key i + diagonal, the reference of
            is_causal and the window: 0 top-left aligned (SDPA's is_causal,
            the diagonal j = i also when Lq != Lk), Lk - Lq bottom-right
            (flash-attn's causal, PyTorch's causal_lower_right), or any
            offset (a cache's position: transformers' q_offset - kv_offset).
            A row whose band holds no key gives 0 (lse -inf).

    Returns:
        out (B, H, Lq, Dv), followed by weights if need_weights and by lse if
        return_lse. A query row that no key may attend to gives 0 (and zero
        gradients), never NaN.

    On a device other than the CPU this is computed by PyTorch's native ops
    (:func:`native_attention`), with the same semantics.
    """
    if (
        attn_mask is None
        and key_padding_mask is None
        and head_mask is None
        and not dropout_p
        and not need_weights
        and not return_lse
        and window is None
        and softcap is None
        and sinks is None
        and alibi_slopes is None
        and k_scale is None
        and v_scale is None
        and not diagonal
        and _plain_call(q, k, v)
    ):
        out = _plain_forward(q, k, v, bool(is_causal), None if scale is None else float(scale))
        if out is not None:
            return out
    for name, t in (("q", q), ("k", k), ("v", v)):
        _validate.dims("masked_attention", name, _validate.tensor("masked_attention", name, t), 4, "(B, H, L, D)")
    _check_dtypes("masked_attention", ("q", "k", "v"), (q, k, v), k_scale, v_scale)
    opts = ops.AttnOptions.check(
        "masked_attention",
        q,
        is_causal=is_causal,
        window=window,
        softcap=softcap,
        sinks=sinks,
        dropout_p=dropout_p,
        dropout_seed=dropout_seed,
        alibi_slopes=alibi_slopes,
        diagonal=diagonal,
    )
    return _attention(
        q,
        k,
        v,
        attn_mask,
        key_padding_mask,
        head_mask,
        scale,
        need_weights,
        return_lse,
        opts,
        kv_scales=(k_scale, v_scale),
    )


def _check_dtypes(fn: str, names: tuple[str, str, str], qkv: tuple[Tensor, Tensor, Tensor], k_scale, v_scale) -> bool:
    """The dtypes of q, k, v (named names): the kernels' floating dtypes, or k and v int8 with
    k_scale and v_scale (an 8-bit cache: _kv_scales); whether they are one."""
    quant = _kv_scales(fn, *qkv, k_scale, v_scale)
    for i, (name, t) in enumerate(zip(names, qkv)):
        if not (quant and i > 0):
            _validate.floating(fn, name, t)
    return quant


def _kv_scales(fn: str, q: Tensor, k: Tensor, v: Tensor, k_scale: object, v_scale: object) -> bool:
    """Whether k, v are an 8-bit cache (int8, with k_scale and v_scale), and
    the checks of it the Python functions promise; the scales' shapes are the
    shim's (csrc/shim/options.cpp, parse_kv_scales)."""
    if k_scale is None and v_scale is None:
        if k.dtype == torch.int8 or v.dtype == torch.int8:
            raise TypeError(f"{fn}: int8 key and value (an 8-bit cache) need k_scale and v_scale (quantize_kv)")
        return False
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a float32 Tensor (an 8-bit cache's scales), got {type(t).__name__}")
    k_scale, v_scale = cast(Tensor, k_scale), cast(Tensor, v_scale)
    if k.dtype != torch.int8 or v.dtype != torch.int8:
        raise TypeError(f"{fn}: k_scale and v_scale are an 8-bit cache's: key and value must be int8, got {k.dtype}")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"{fn}: with an 8-bit cache the queries must be float32, bfloat16 or float16, got {q.dtype}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_scale, v_scale)):
        raise RuntimeError(
            f"{fn}: an 8-bit KV cache is inference only (no gradient); "
            "call it under torch.no_grad() or on tensors that do not require grad"
        )
    if not uses_kernels(q.device):
        raise NotImplementedError(f"{fn}: an 8-bit KV cache is read by the CPU kernels only; got tensors on {q.device}")
    return True


def quantize_kv(x: Tensor, dtype: torch.dtype = torch.int8) -> tuple[Tensor, Tensor]:
    """Quantizes keys or values for an 8-bit KV cache: symmetric int8 with one
    float32 scale per row of the last dim (per token and head).

    In float32: ``scale = absmax(row) / 127`` and ``xq = round(clamp(x * (127 /
    absmax(row)), -127, 127))``, ties to even; a row of zeros has scale 0, a
    row holding an inf or NaN scale NaN (and xq 0). Dequantized, ``xq *
    scale[..., None]`` is within scale / 2 of x.

    Args:
        x: (..., D) float32, bfloat16 or float16, any strides, on the CPU.
        dtype: torch.int8 (the one 8-bit format so far).

    Returns:
        (xq, scale): xq int8 of x's shape (contiguous), scale float32 of
        x.shape[:-1]. Pass them to masked_attention / varlen_attn as k, k_scale
        (and v, v_scale).
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize_kv: x must be a Tensor, got {type(x).__name__}")
    if dtype != torch.int8:
        raise ValueError(f"quantize_kv: dtype must be torch.int8, got {dtype}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"quantize_kv: x must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() == 0 or x.size(-1) == 0:
        raise ValueError(f"quantize_kv: x must have a last dim of size > 0, got shape {tuple(x.shape)}")
    if not uses_kernels(x.device):
        raise NotImplementedError(f"quantize_kv: runs on the CPU only; got a tensor on {x.device}")
    with torch.no_grad():
        q, scale = torch.ops.masked_attn.quantize_kv(x)
    return q.view(x.shape), scale.view(x.shape[:-1])


def _attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None,
    key_padding_mask: Tensor | None,
    head_mask: Tensor | None,
    scale: float | None,
    need_weights: bool,
    return_lse: bool,
    opts: ops.AttnOptions,
    fn: str = "masked_attention",
    kv_scales: tuple[Tensor | None, Tensor | None] = (None, None),
) -> Tensor | tuple[Tensor, ...]:
    """masked_attention after its checks of q, k, v (4-D floating tensors) and
    of its options: the call."""
    attn_mask = _as_4d_attn_mask(attn_mask, q.size(0), q.size(1))
    if not uses_kernels(q.device):
        if (
            opts.window != (-1, -1)
            or opts.softcap is not None
            or opts.sinks is not None
            or opts.alibi_slopes is not None
        ):
            raise NotImplementedError(
                "masked_attention: window, softcap, sinks and alibi_slopes run in the CPU kernels only; "
                f"got tensors on {q.device}"
            )
        out, lse, weights = native_attention(
            q,
            k,
            v,
            attn_mask,
            key_padding_mask,
            head_mask,
            opts.is_causal,
            scale,
            bool(need_weights),
            bool(return_lse),
            opts.dropout_p,
            opts.diagonal,
        )
    else:
        if opts.dropout_p > 0.0 and opts.dropout_seed is None:
            opts = dataclasses.replace(opts, dropout_seed=ops.new_dropout_seed())
        out, lse, weights, _ = ops.call_op(
            _FORWARD,
            *ops.FORWARD(
                q=q,
                k=k,
                v=v,
                attn_mask=attn_mask,
                key_padding_mask=key_padding_mask,
                head_mask=head_mask,
                scale=None if scale is None else float(scale),
                need_weights=bool(need_weights),
                for_backward=ops.grad_wanted(q, k, v, attn_mask, key_padding_mask, head_mask, opts.sinks),
                **opts.op_args(),
                **_scale_args(kv_scales),
            ),
        )
    if not (need_weights or return_lse):
        return out
    return cast("tuple[Tensor, ...]", (out,) + ((weights,) if need_weights else ()) + ((lse,) if return_lse else ()))


def _causal_bias(attn_mask, is_causal, query, key) -> tuple[Tensor | None, bool, int]:
    """PyTorch's CausalBias as the kernels' causal diagonal: (attn_mask, is_causal, diagonal);
    any other attn_mask as it is (diagonal 0). torch.nn.attention.bias is not imported here (it
    imports torch._dynamo: seconds): a CausalBias exists only once its module is loaded."""
    bias = sys.modules.get("torch.nn.attention.bias")
    if bias is None or not isinstance(attn_mask, bias.CausalBias):
        return attn_mask, is_causal, 0
    if is_causal:  # F.sdpa's rule
        raise ValueError("scaled_dot_product_attention: CausalBias should not be used with is_causal=True")
    L, S = query.size(-2), key.size(-2)
    if (attn_mask.seq_len_q, attn_mask.seq_len_kv) != (L, S):
        raise ValueError(
            f"scaled_dot_product_attention: the CausalBias is for {attn_mask.seq_len_q} queries and "
            f"{attn_mask.seq_len_kv} keys, got {L} and {S}"
        )
    return None, True, S - L if attn_mask.variant == bias.CausalVariant.LOWER_RIGHT else 0


def _sdpa_checked(query, key, value, attn_mask, enable_gqa: bool):
    """scaled_dot_product_attention's checks of its tensors (F.sdpa's), under autocast after the
    cast to its dtype, as F.sdpa does: (query, key, value, attn_mask), cast."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"scaled_dot_product_attention: {name} must be a Tensor")
        if t.dim() < 2:
            raise ValueError(
                f"scaled_dot_product_attention: {name} must have at least 2 dims (L, E), got shape {tuple(t.shape)}"
            )
        if t.dtype not in _validate.FLOATS:
            raise TypeError(f"scaled_dot_product_attention: {name} must be floating point, got {t.dtype}")
    # under autocast, as F.sdpa: the inputs (and a floating mask) in the autocast dtype before any check
    cast = autocast_dtype(query.device.type, "lower")
    if cast is not None:
        dev = query.device.type
        query, key, value = (autocast_cast(t, cast, dev) for t in (query, key, value))
        attn_mask = autocast_cast(attn_mask, cast, dev)
    if not (query.dtype == key.dtype == value.dtype):
        raise ValueError(
            "scaled_dot_product_attention: query, key and value must have the same dtype, "
            f"got {query.dtype}, {key.dtype}, {value.dtype}"
        )
    if query.size(-1) != key.size(-1):
        raise ValueError(
            f"scaled_dot_product_attention: query and key must have the same embedding dim, "
            f"got query {tuple(query.shape)}, key {tuple(key.shape)}"
        )
    if key.size(-2) != value.size(-2):
        raise ValueError(
            f"scaled_dot_product_attention: key and value must have the same length, "
            f"got key {tuple(key.shape)}, value {tuple(value.shape)}"
        )
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            raise TypeError(
                f"scaled_dot_product_attention: attn_mask must be bool or floating point, got {attn_mask.dtype}"
            )
    hq = query.size(-3) if query.dim() >= 3 else 1
    hk = key.size(-3) if key.dim() >= 3 else 1
    if hq != hk and not (enable_gqa or hk == 1):
        raise ValueError(
            f"scaled_dot_product_attention: query has {hq} heads and key {hk}; "
            "pass enable_gqa=True for grouped-query attention"
        )
    _validate.heads("scaled_dot_product_attention", hq, hk)
    return query, key, value, attn_mask


def _sdpa_4d(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None):
    """F.sdpa's (..., H, L, E) tensors as (B, H, L, E), the batch dims flattened (broadcast first),
    and its mask in our convention (bool True = blocked), flattened alike: (batch, q, k, v, mask)."""
    if query.dim() == key.dim() == value.dim() == 4 and query.size(0) == key.size(0) == value.size(0):
        # the common (B, H, L, E) call, as is (torch.broadcast_shapes alone costs ~20 us a call,
        # which a decoding step notices)
        batch, q, k, v = query.shape[:1], query, key, value
    else:
        batch = torch.broadcast_shapes(query.shape[:-3], key.shape[:-3], value.shape[:-3])

        def to4d(t):
            t = t.expand(*batch, *t.shape[-3:]) if t.dim() >= 3 else t.expand(*batch, 1, *t.shape)
            if len(batch) == 0:
                return t.unsqueeze(0)
            return t if len(batch) == 1 else t.reshape(-1, *t.shape[-3:])

        q, k, v = to4d(query), to4d(key), to4d(value)
    mask = attn_mask
    if mask is not None:
        if mask.dtype == torch.bool:
            mask = ~mask  # F.sdpa: True = take part; ours: True = blocked
        if len(batch) > 1 and mask.dim() > 3:  # flatten the batch dims like q's
            mask = mask.expand(*batch, *mask.shape[-3:]).reshape(-1, *mask.shape[-3:])
    return batch, q, k, v, mask


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
) -> Tensor:
    """Drop-in for torch.nn.functional.scaled_dot_product_attention.

    query (..., Hq, L, E), key (..., H, S, E), value (..., H, S, Ev); a bool
    attn_mask is True where attention is allowed, a floating one is added;
    is_causal is top-left aligned and combines with attn_mask. Rows with no
    allowed key give 0, as PyTorch does from 2.5 on. dropout_p > 0 drops
    attention probabilities inside the kernels (whenever given, as F.sdpa),
    the mask drawn from PyTorch's default generator.

    attn_mask may be PyTorch's CausalBias (torch.nn.attention.bias.causal_upper_left /
    causal_lower_right): the kernels' causal band about its diagonal, no mask.

    Keyword-only extensions (not in PyTorch), as in masked_attention:
    window=(left, right), softcap, sinks (Hq,), alibi_slopes (Hq,) or (B, Hq)
    (B the flattened batch dims).
    """
    attn_mask, is_causal, diagonal = _causal_bias(attn_mask, is_causal, query, key)
    if (
        attn_mask is None
        and not diagonal
        and not dropout_p
        and window is None
        and softcap is None
        and sinks is None
        and alibi_slopes is None
        and _plain_call(query, key, value)
        and query.dim() == 4
        and (enable_gqa or key.dim() != 4 or query.size(1) == key.size(1))
    ):
        out = _plain_forward(query, key, value, bool(is_causal), None if scale is None else float(scale))
        if out is not None:
            return out
    query, key, value, attn_mask = _sdpa_checked(query, key, value, attn_mask, enable_gqa)
    batch, q, k, v, mask = _sdpa_4d(query, key, value, attn_mask)
    opts = ops.AttnOptions.check(
        "scaled_dot_product_attention",
        q,
        is_causal=is_causal,
        window=window,
        softcap=softcap,
        sinks=sinks,
        dropout_p=dropout_p,
        alibi_slopes=alibi_slopes,
        diagonal=diagonal,
    )
    out = _attention(q, k, v, mask, None, None, scale, False, False, opts, fn="scaled_dot_product_attention")
    assert isinstance(out, Tensor)  # neither weights nor lse asked for
    if query.dim() == 4:
        return out
    out_shape = (*batch, query.size(-3), query.size(-2), value.size(-1)) if query.dim() >= 3 else out.shape[-2:]
    return out.reshape(out_shape)


class AuxRequest(NamedTuple):
    """Which auxiliary outputs varlen_attn returns (torch.nn.attention.varlen.AuxRequest)."""

    lse: bool = False


def _scale_args(kv_scales: tuple[Tensor | None, Tensor | None]) -> dict[str, Tensor]:
    """An 8-bit cache's scales as the forward ops name them (none: nothing)."""
    k_scale, v_scale = kv_scales
    return {} if k_scale is None or v_scale is None else {"k_scale": k_scale, "v_scale": v_scale}


def varlen_attn(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cu_seq_q: Tensor,
    cu_seq_k: Tensor | None,
    max_q: int,
    max_k: int,
    *,
    return_aux: AuxRequest | None = None,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
    seqused_k: Tensor | None = None,
    block_table: Tensor | None = None,
    num_splits: int | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention over packed variable-length sequences, with
    torch.nn.attention.varlen.varlen_attn's signature and conventions, on the CPU.

    Args:
        query: (T_q, H, D); key, value: (T_k, H_kv, D) / (T_k, H_kv, Dv), or
            (pages, page_size, H_kv, D) with block_table. float32, float64,
            bfloat16 or float16, any strides.
        cu_seq_q, cu_seq_k: int32 (N + 1,) offsets: sequence b is query rows
            cu_seq_q[b] : cu_seq_q[b + 1] and key rows cu_seq_k[b] : cu_seq_k[b + 1];
            they start at 0, never decrease, and end at T_q, T_k. Empty
            sequences are allowed. cu_seq_k may be None with block_table.
        max_q, max_k: at least the longest query / key sequence (checked).
        return_aux: AuxRequest(lse=True) also returns the log-sum-exp, (H, T_q)
            (float32, float64 for float64), -inf for a row that sees no key.
        scale: default 1 / sqrt(D).
        window_size: (left, right), -1 unbounded: (-1, -1) full, (-1, 0)
            causal, (W, 0) causal sliding window. Aligned to the bottom right
            as in flash-attn: with Lq, Lk the sequence's lengths, query i sees
            key j iff i + Lk - Lq - left <= j <= i + Lk - Lq + right. A window
            larger than the sequence is the same as unbounded.
        enable_gqa: allow H_kv < H (H a multiple of H_kv); K and V are shared
            by their group of query heads, never copied.
        seqused_k: int32 (N,): only the first seqused_k[b] keys of sequence b
            take part (a KV cache slot larger than the sequence). Inference only.
        block_table: int32 (N, max_pages) paged KV cache, with seqused_k;
            inference only. With page_size a multiple of 64 the kernels read the
            pages in place; other page sizes are gathered into packed rows first.
        num_splits: accepted for compatibility; results never depend on the
            thread count or on the other sequences of the batch (batch invariant).
        softcap, sinks: extensions (not in torch's varlen_attn), as in
            masked_attention: scores -> softcap * tanh(s / softcap) before the
            window; sinks (H,) one logit per head in every row's softmax
            denominator, no value, differentiable (the lse includes it).
        alibi_slopes: (H,) or (N, H) float32, flash-attn's ALiBi: -slope *
            |i + Lk - Lq - j| with the sequence's own lengths, after the
            soft-cap. Paged caches too. No gradient.
        k_scale, v_scale: an 8-bit cache, as in masked_attention: key and
            value int8 and these float32 scales of their shapes without the
            last dim ((T_k, H_kv), or (pages, page_size, H_kv) paged).
            Inference only.

    Returns:
        out (T_q, H, Dv), and lse if return_aux.lse. A query row that sees no
        key (an empty key sequence, or a window that excludes every key) gives
        0 and lse -inf.
    """
    options = dict(window_size=window_size, softcap=softcap, sinks=sinks, alibi_slopes=alibi_slopes)
    quant, opts = _varlen_checked(query, key, value, block_table, enable_gqa, (k_scale, v_scale), num_splits, options)
    scales = (k_scale, v_scale)
    if block_table is not None:
        key, value, cu_seq_k, block_table, scales = _varlen_paged(
            query, key, value, seqused_k, block_table, scales, quant, cu_seq_k
        )
    elif cu_seq_k is None:
        raise ValueError("varlen_attn: cu_seq_k is required without block_table")
    args = dict(cu_seq_q=cu_seq_q, cu_seq_k=cu_seq_k, max_q=int(max_q), max_k=int(max_k), seqused_k=seqused_k)
    out, lse = _varlen_forward(query, key, value, args, scale, block_table, opts, scales)
    return (out, lse) if return_aux is not None and return_aux.lse else out


def _varlen_checked(query, key, value, block_table, enable_gqa, scales, num_splits, options: dict):
    """varlen_attn's checks of query, key, value (kinds, dtypes, layouts, heads) and of its
    options (window_size, softcap, sinks, alibi_slopes; num_splits): (whether key and value are
    an 8-bit cache (scales: k_scale, v_scale), the options)."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        _validate.tensor("varlen_attn", name, t)
    quant = _check_dtypes("varlen_attn", ("query", "key", "value"), (query, key, value), *scales)
    _validate.dims("varlen_attn", "query", query, 3, "(T_q, H, D)")
    kv_layout = (4, "(pages, page_size, H_kv, D)") if block_table is not None else (3, "(T_k, H_kv, D)")
    for name, t in (("key", key), ("value", value)):
        _validate.dims("varlen_attn", name, t, *kv_layout)
    hq, hk = query.size(1), key.size(-2)
    if not enable_gqa and hq != hk:
        raise ValueError(
            f"varlen_attn: expected query and key/value to have the same number of heads, got "
            f"H={hq} and H_kv={hk}; pass enable_gqa=True for grouped-query attention"
        )
    _validate.heads("varlen_attn", hq, hk)
    if options["window_size"] is None:
        options = {**options, "window_size": (-1, -1)}
    opts = ops.AttnOptions.check("varlen_attn", query, **options)
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 0):
        raise ValueError(f"varlen_attn: num_splits must be None or a nonnegative int, got {num_splits!r}")
    return quant, opts


def _varlen_paged(query, key, value, seqused_k, block_table, scales, quant: bool, cu_seq_k):
    """varlen_attn's paged cache (block_table, with seqused_k; no backward): checked, and where its
    pages are not a multiple of the kernels' block_k (64 rows, ops.kernel_traits; the kernels read
    those in place) gathered into packed rows, scales alike. (key, value, cu_seq_k, block_table
    (None once gathered), scales)."""
    if seqused_k is None:
        raise ValueError("varlen_attn: block_table requires seqused_k")
    if block_table.dtype != torch.int32 or block_table.dim() != 2:
        raise ValueError(
            f"varlen_attn: block_table must be a 2-D int32 (N, max_pages) tensor, got "
            f"{block_table.dtype} of shape {tuple(block_table.shape)}"
        )
    if seqused_k.dtype != torch.int32 or seqused_k.shape != (block_table.size(0),):
        raise ValueError("varlen_attn: seqused_k must be int32 (N,) with N = block_table.size(0)")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        raise RuntimeError("varlen_attn: block_table is an inference-only parameter (no backward)")
    if key.size(1) % ops.kernel_traits(query.dtype)["block_k"] == 0:  # the kernels read these in place
        return key, value, cu_seq_k, block_table, scales
    n_pages = _paging.pages_of(seqused_k, key.size(1))
    if bool((n_pages > block_table.size(1)).any()):
        raise ValueError("varlen_attn: seqused_k needs more pages than block_table has columns")
    _paging.check_in_pool("varlen_attn", block_table, n_pages, key.size(0), "key")
    key, cu_seq_k = _paging.gather_packed(key, block_table, seqused_k)
    value, _ = _paging.gather_packed(value, block_table, seqused_k)
    if quant:  # the scales are gathered like their rows
        scales = tuple(_paging.gather_packed(cast(Tensor, s), block_table, seqused_k)[0] for s in scales)
    return key, value, cu_seq_k, None, scales


def _varlen_forward(query, key, value, args: dict, scale, block_table, opts: ops.AttnOptions, scales):
    """varlen_attn's call of masked_attn::varlen_forward (the checked arguments): (out, lse)."""
    out, lse, _ = ops.call_op(
        torch.ops.masked_attn.varlen_forward.default,
        *ops.VARLEN_FORWARD(
            query=query,
            key=key,
            value=value,
            scale=None if scale is None else float(scale),
            block_table=block_table,
            for_backward=ops.grad_wanted(query, key, value, opts.sinks),
            **args,
            **opts.op_args(),
            **_scale_args(scales),
        ),
    )
    return out, lse


def write_kv_cache(
    key: Tensor,
    value: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    slots: Tensor,
    key_scale: Tensor | None = None,
    value_scale: Tensor | None = None,
) -> None:
    """Writes new key / value rows into a KV cache in place (vLLM's reshape_and_cache).

    Args:
        key, value: (T, H_kv, D) / (T, H_kv, Dv), the new rows, any strides, of their cache's dtype.
        key_cache, value_cache: both paged (pages, page_size, H_kv, D) with one page size, or
            both flat (rows, H_kv, D); any strides without self-overlap. A slot must lie in both.
            They may be views of one buffer (transformers' paged cache interleaves them).
        slots: int64 or int32 (T,): row t goes to slot slots[t] = page * page_size + row (in a
            flat cache, the row); a negative slot skips the row (padding). Where two rows share
            a slot, the later row is what the cache holds.
        key_scale, value_scale: float rows (float32, bfloat16 or float16) into an 8-bit cache
            (int8 key_cache, value_cache): its float32 scales, shaped like the caches without their
            last dim; each new row is quantized as :func:`quantize_kv` does, its scale written
            beside it. (int8 rows into an int8 cache are copied, without scales.)

    On the CPU one C op (masked_attn::cache_write) does the copy, no Python indexing; on other
    devices, index_copy_. No gradient flows into the cache.
    """
    if isinstance(key_cache, torch.Tensor) and uses_kernels(key_cache.device):  # the op checks every argument
        with torch.no_grad():
            torch.ops.masked_attn.cache_write(key, value, key_cache, value_cache, slots, key_scale, value_scale)
        return
    if key_scale is not None or value_scale is not None:
        raise NotImplementedError("write_kv_cache: an 8-bit cache is written by the CPU kernels only")
    for name, t in (
        ("key", key),
        ("value", value),
        ("key_cache", key_cache),
        ("value_cache", value_cache),
        ("slots", slots),
    ):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"write_kv_cache: {name} must be a Tensor, got {type(t).__name__}")
    if slots.dtype not in (torch.int64, torch.int32) or slots.dim() != 1:
        raise ValueError(
            f"write_kv_cache: slots must be a 1-D int64 or int32 tensor, got {slots.dtype} of shape "
            f"{tuple(slots.shape)}"
        )
    with torch.no_grad():  # other devices: native ops
        keep = slots >= 0
        idx = slots.to(torch.int64)
        if not bool(keep.all()):
            idx, key, value = idx[keep], key[keep], value[keep]
        for t, cache in ((key, key_cache), (value, value_cache)):
            flat = cache if cache.dim() == 3 else cache.view(-1, *cache.shape[2:])
            flat.index_copy_(0, idx, t)
