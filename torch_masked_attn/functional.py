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

from typing import NamedTuple

import torch
from torch import Tensor

from . import ops  # noqa: F401  (registers torch.ops.masked_attn)

__all__ = ["masked_attention", "scaled_dot_product_attention", "varlen_attn", "AuxRequest", "cross_entropy",
           "linear_cross_entropy"]

_FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _dropout_not_implemented(dropout_p):
    raise NotImplementedError(
        f"torch_masked_attn: attention dropout (dropout_p={dropout_p}) is not implemented yet; "
        "use dropout_p=0.0, or put the module in eval mode")


def _as_4d_attn_mask(attn_mask, B, H):
    """nn.MultiheadAttention's (B*H, Lq, Lk) form as the (B, H, Lq, Lk) it means;
    every other shape is left to broadcast by strides."""
    if attn_mask is not None and attn_mask.dim() == 3 and B > 1 and attn_mask.size(0) == B * H:
        return attn_mask.unflatten(0, (B, H))
    return attn_mask


def masked_attention(q: Tensor, k: Tensor, v: Tensor, *, attn_mask: Tensor | None = None,
                     key_padding_mask: Tensor | None = None, head_mask: Tensor | None = None,
                     is_causal: bool = False, scale: float | None = None, dropout_p: float = 0.0,
                     need_weights: bool = False, return_lse: bool = False) -> Tensor | tuple[Tensor, ...]:
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
        is_causal: query i sees key j only if j <= i (top-left aligned).
        scale: defaults to 1 / sqrt(D).
        need_weights: also return the attention probabilities (B, H, Lq, Lk),
            after the head mask.
        return_lse: also return the per-row log-sum-exp (B, H, Lq) (float32,
            float64 for float64 inputs); -inf for a fully masked row.

    Returns:
        out (B, H, Lq, Dv), followed by weights if need_weights and by lse if
        return_lse. A query row that no key may attend to gives 0 (and zero
        gradients), never NaN.
    """
    if dropout_p > 0.0:
        _dropout_not_implemented(dropout_p)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"masked_attention: {name} must be a Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"masked_attention: {name} must be 4-D (B, H, L, D), got shape {tuple(t.shape)}")
        if t.dtype not in _FLOATS:
            raise TypeError(f"masked_attention: {name} must be float32, float64, bfloat16 or float16, "
                            f"got {t.dtype}")
    attn_mask = _as_4d_attn_mask(attn_mask, q.size(0), q.size(1))
    out, lse, weights = torch.ops.masked_attn.forward(
        q, k, v, attn_mask, key_padding_mask, head_mask, bool(is_causal),
        None if scale is None else float(scale), bool(need_weights))
    if not (need_weights or return_lse):
        return out
    return (out,) + ((weights,) if need_weights else ()) + ((lse,) if return_lse else ())


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                                 dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                                 enable_gqa: bool = False) -> Tensor:
    """Drop-in for torch.nn.functional.scaled_dot_product_attention.

    query (..., Hq, L, E), key (..., H, S, E), value (..., H, S, Ev); a bool
    attn_mask is True where attention is allowed, a floating one is added;
    is_causal is top-left aligned and combines with attn_mask. Rows with no
    allowed key give 0, as PyTorch does from 2.5 on.
    """
    if dropout_p > 0.0:
        _dropout_not_implemented(dropout_p)
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"scaled_dot_product_attention: {name} must be a Tensor")
        if t.dim() < 2:
            raise ValueError(f"scaled_dot_product_attention: {name} must have at least 2 dims "
                             f"(L, E), got shape {tuple(t.shape)}")
        if t.dtype not in _FLOATS:
            raise TypeError(f"scaled_dot_product_attention: {name} must be floating point, got {t.dtype}")
    if not (query.dtype == key.dtype == value.dtype):
        raise ValueError("scaled_dot_product_attention: query, key and value must have the same dtype, "
                         f"got {query.dtype}, {key.dtype}, {value.dtype}")
    if query.size(-1) != key.size(-1):
        raise ValueError(f"scaled_dot_product_attention: query and key must have the same embedding dim, "
                         f"got query {tuple(query.shape)}, key {tuple(key.shape)}")
    if key.size(-2) != value.size(-2):
        raise ValueError(f"scaled_dot_product_attention: key and value must have the same length, "
                         f"got key {tuple(key.shape)}, value {tuple(value.shape)}")
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            raise TypeError(f"scaled_dot_product_attention: attn_mask must be bool or floating point, "
                            f"got {attn_mask.dtype}")
    hq = query.size(-3) if query.dim() >= 3 else 1
    hk = key.size(-3) if key.dim() >= 3 else 1
    if hq != hk and not (enable_gqa or hk == 1):
        raise ValueError(f"scaled_dot_product_attention: query has {hq} heads and key {hk}; "
                         "pass enable_gqa=True for grouped-query attention")
    if hk == 0 or hq % hk != 0:
        raise ValueError(f"scaled_dot_product_attention: the number of query heads ({hq}) must be a "
                         f"multiple of the number of key/value heads ({hk})")

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
    out = masked_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)
    if query.dim() == 4:
        return out
    out_shape = (*batch, hq, query.size(-2), value.size(-1)) if query.dim() >= 3 else \
        (query.size(-2), value.size(-1))
    return out.reshape(out_shape)


class AuxRequest(NamedTuple):
    """Which auxiliary outputs varlen_attn returns (torch.nn.attention.varlen.AuxRequest)."""

    lse: bool = False


def _gather_pages(t: Tensor, block_table: Tensor, seqused_k: Tensor) -> tuple[Tensor, Tensor]:
    """A paged KV pool (pages, page_size, H_kv, D) read through block_table
    (N, max_pages) as packed (T_k, H_kv, D) rows and their cu_seq_k: each
    sequence's first ceil(seqused_k / page_size) pages, in table order."""
    page = t.size(1)
    n_pages = (seqused_k.to(torch.int64) + page - 1) // page
    if bool((n_pages > block_table.size(1)).any()):
        raise ValueError("varlen_attn: seqused_k needs more pages than block_table has columns")
    cols = torch.arange(block_table.size(1))
    used = cols.unsqueeze(0) < n_pages.unsqueeze(1)
    pages = block_table.to(torch.int64)[used]
    if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= t.size(0)):
        raise ValueError(f"varlen_attn: block_table holds a page outside [0, {t.size(0)})")
    rows = t.index_select(0, pages).reshape(-1, *t.shape[2:])
    cu = torch.zeros(block_table.size(0) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(n_pages * page, 0)
    return rows, cu


def varlen_attn(query: Tensor, key: Tensor, value: Tensor, cu_seq_q: Tensor, cu_seq_k: Tensor | None,
                max_q: int, max_k: int, *, return_aux: AuxRequest | None = None, scale: float | None = None,
                window_size: tuple[int, int] = (-1, -1), enable_gqa: bool = False,
                seqused_k: Tensor | None = None, block_table: Tensor | None = None,
                num_splits: int | None = None) -> Tensor | tuple[Tensor, Tensor]:
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

    Returns:
        out (T_q, H, Dv), and lse if return_aux.lse. A query row that sees no
        key (an empty key sequence, or a window that excludes every key) gives
        0 and lse -inf.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"varlen_attn: {name} must be a Tensor, got {type(t).__name__}")
        if t.dtype not in _FLOATS:
            raise TypeError(f"varlen_attn: {name} must be float32, float64, bfloat16 or float16, got {t.dtype}")
    if query.dim() != 3:
        raise ValueError(f"varlen_attn: query must be 3-D (T_q, H, D), got shape {tuple(query.shape)}")
    kv_dim = 4 if block_table is not None else 3
    for name, t in (("key", key), ("value", value)):
        if t.dim() != kv_dim:
            raise ValueError(f"varlen_attn: {name} must be {kv_dim}-D "
                             f"{'(pages, page_size, H_kv, D)' if kv_dim == 4 else '(T_k, H_kv, D)'}, "
                             f"got shape {tuple(t.shape)}")
    hq, hk = query.size(1), key.size(-2)
    if not enable_gqa and hq != hk:
        raise ValueError(f"varlen_attn: expected query and key/value to have the same number of heads, got "
                         f"H={hq} and H_kv={hk}; pass enable_gqa=True for grouped-query attention")
    if hk == 0 or hq % hk != 0:
        raise ValueError(f"varlen_attn: the number of query heads ({hq}) must be a multiple of the number "
                         f"of key/value heads ({hk})")
    if window_size is None:
        window_size = (-1, -1)
    window_size = tuple(window_size)
    if len(window_size) != 2:
        raise ValueError(f"varlen_attn: window_size must have length 2, got {len(window_size)}")
    left, right = (int(w) for w in window_size)
    if left < -1 or right < -1:
        raise ValueError(f"varlen_attn: window_size entries must be -1 (unbounded) or >= 0, got {window_size}")
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 0):
        raise ValueError(f"varlen_attn: num_splits must be None or a nonnegative int, got {num_splits!r}")
    if block_table is not None:
        if seqused_k is None:
            raise ValueError("varlen_attn: block_table requires seqused_k")
        if block_table.dtype != torch.int32 or block_table.dim() != 2:
            raise ValueError(f"varlen_attn: block_table must be a 2-D int32 (N, max_pages) tensor, got "
                             f"{block_table.dtype} of shape {tuple(block_table.shape)}")
        if seqused_k.dtype != torch.int32 or seqused_k.shape != (block_table.size(0),):
            raise ValueError("varlen_attn: seqused_k must be int32 (N,) with N = block_table.size(0)")
        if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
            raise RuntimeError("varlen_attn: block_table is an inference-only parameter (no backward)")
        if key.size(1) % 64 != 0:  # the kernels read pages of a multiple of 64 tokens in place
            key, cu_seq_k = _gather_pages(key, block_table, seqused_k)
            value, _ = _gather_pages(value, block_table, seqused_k)
            block_table = None
    elif cu_seq_k is None:
        raise ValueError("varlen_attn: cu_seq_k is required without block_table")
    out, lse = torch.ops.masked_attn.varlen_forward(
        query, key, value, cu_seq_q, cu_seq_k, int(max_q), int(max_k),
        None if scale is None else float(scale), left, right, seqused_k, block_table)
    if return_aux is not None and return_aux.lse:
        return out, lse
    return out


from .losses import cross_entropy, linear_cross_entropy  # noqa: E402
