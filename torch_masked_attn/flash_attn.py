"""FlashAttention-2's Python API on the CPU.

Code written for flash-attn 2.x (``flash_attn.flash_attn_interface``, 2.8) runs on the CPU by
changing one import::

    from torch_masked_attn.flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

Same functions, signatures, argument names and defaults, layouts (``(B, L, H, D)``, packed
``(T, H, D)``, paged caches ``(num_blocks, page_size, H_kv, D)``), return values and semantics:
bottom-right aligned ``causal`` and ``window_size`` (query i of a sequence of Lq queries and Lk keys
sees key j iff ``i + Lk - Lq - left <= j <= i + Lk - Lq + right``), ``softcap``, GQA / MQA (K and V
never copied), ``softmax_scale``, ``alibi_slopes``, in-place KV-cache appends with rotary embedding,
``cache_batch_idx``, ``cache_leftpad``, paged caches. A query row that sees no key gives output 0
and ``softmax_lse`` +inf, as flash-attn's kernels give.

The computation is this package's C kernels: ``functional.masked_attention`` (the dense functions,
and every call with dropout or ALiBi) and ``functional.varlen_attn`` (packed sequences, KV caches,
paged caches read in place); gradients through their autograd ops.

Differences from flash-attn (every one a superset or a documented choice):

* dtypes: float32 and float64 as well as float16 / bfloat16; ``softmax_lse`` is float32 (float64 for
  float64 inputs). Any head dim (flash-attn: <= 256), any page size (flash-attn: a multiple of 256;
  ours reads pages of a multiple of 64 rows in place and gathers the used pages of other sizes), any
  even rotary dim (flash-attn: a multiple of 16), softcap with dropout (flash-attn refuses it),
  integer index tensors of any integer dtype (flash-attn: int32).
* dropout: our kernels' own Philox stream (``torch.manual_seed`` reproduces a run, any thread count
  gives the same bits): other random bits than flash-attn's CUDA generator. ``deterministic`` is
  accepted; every path here is deterministic.
* ``return_attn_probs=True``: ``S_dmask`` is, as in flash-attn, an empty tensor unless
  ``dropout_p > 0``; with dropout it is ``(B, H, round128(Lq), round128(Lk))`` (varlen:
  ``(batch, H, round128(max_seqlen_q), round128(max_seqlen_k))``), the softmax probabilities,
  negated where dropped, zero beyond the sequence (computed by a second, probability-returning pass;
  for testing, as flash-attn says).
* ``alibi_slopes`` runs in the kernels (``masked_attention`` / ``varlen_attn``'s ``alibi_slopes``),
  paged caches included. Fallbacks: varlen calls with dropout are padded to ``(batch, max_len, H, D)``
  (copies) and run there, their ALiBi then a float additive mask ``-slope * |i + Lk - Lq - j|`` of each
  sequence's own lengths. The dense functions hand the bottom-right diagonal to the kernels
  (``masked_attention``'s ``diagonal=Lk - Lq``): no mask for any window. flash-attn's kernels add
  ``slope * j`` instead of the documented bias when ``causal=True``: same output, its
  ``softmax_lse`` larger by ``slope * (i + Lk - Lq)``; ours is the documented one.
* ``flash_attn_with_kvcache`` has no backward (as flash-attn): it runs under ``torch.no_grad()``.
  ``num_splits`` is accepted and ignored (results never depend on splits or threads).
* CPU tensors only: other devices raise (use flash-attn itself there).

Window normalisation follows flash-attn's kernels, not only its docstring (it matters only when
Lq > Lk): ``causal`` sets ``right = 0``; a bound ``>= seqlen_k`` becomes unbounded, and where one
bound is set the other unbounded one becomes ``seqlen_k``, where seqlen_k is Lk
(``flash_attn_func``), ``max_seqlen_k`` (varlen) or the cache's length (``with_kvcache``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _paging, _validate
from . import functional as _fn

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]

_INTS = (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8)


# ---- argument checks (the shared ones in _validate; flash-attn's spellings translated here) ------


def _check_tensor(fn: str, name: str, t, dims: int, layout: str) -> None:
    _validate.tensor(fn, name, t, layout)
    _validate.dims(fn, name, t, dims, layout)
    _validate.floating(fn, name, t)
    if t.device.type != "cpu":
        raise ValueError(
            f"{fn}: {name} is on {t.device}; torch_masked_attn.flash_attn computes on the CPU "
            "(on a GPU, use flash-attn itself)"
        )


def _check_same_dtype(fn: str, q: Tensor, **others: Tensor) -> None:
    for name, t in others.items():
        if t.dtype != q.dtype:
            raise TypeError(f"{fn}: {name} must have q's dtype ({q.dtype}), got {t.dtype}")


def _check_heads(fn: str, H: int, Hk: int, kname: str) -> None:
    if Hk == 0 or H % Hk != 0:
        raise ValueError(
            f"{fn}: the number of heads of q ({H}) must be a multiple of the number of heads of {kname} ({Hk})"
        )


def _index(fn: str, name: str, t, dims: int, layout: str) -> Tensor:
    """t, checked: an integer CPU tensor of `dims` dims."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{fn}: {name} must be an int32 Tensor {layout}, got {type(t).__name__}")
    if t.dtype not in _INTS:
        raise TypeError(f"{fn}: {name} must be an integer (int32) tensor {layout}, got {t.dtype}")
    if t.dim() != dims:
        raise ValueError(f"{fn}: {name} must be {dims}-D {layout}, got shape {tuple(t.shape)}")
    if t.device.type != "cpu":
        raise ValueError(f"{fn}: {name} is on {t.device}; torch_masked_attn.flash_attn computes on the CPU")
    return t


def _dropout(fn: str, dropout_p) -> float:
    """flash-attn's dropout_p: the shared rule ([0, 1]) less 1, which flash-attn refuses."""
    p = _validate.dropout_p(fn, dropout_p)
    if p == 1.0:
        raise ValueError(f"{fn}: dropout_p must be in [0, 1) (flash-attn's dropout_p excludes 1), got {p}")
    return p


def _scale(fn: str, softmax_scale) -> float | None:
    if softmax_scale is None:
        return None
    s = _validate.number(fn, "softmax_scale", softmax_scale, "None or a finite float")
    if not math.isfinite(s):
        raise ValueError(f"{fn}: softmax_scale must be None or a finite float, got {s}")
    return s


def _softcap(fn: str, softcap) -> float | None:
    """flash-attn's softcap, a float: > 0 on, 0 (its default) or below off; translated to the
    shared rule's None (off) or a finite number > 0 (_validate.softcap, which refuses +-inf)."""
    if softcap is None:
        return None
    c = _validate.number(fn, "softcap", softcap, "a float (0 = off)")
    return _validate.softcap(fn, c) if c > 0 or math.isinf(c) else None


def _window(fn: str, window_size, causal: bool, seqlen_k: int) -> tuple[int, int]:
    """flash-attn's (left, right) after its kernels' normalisation: -1 unbounded, else a bound
    (bottom-right aligned). causal sets right = 0; a bound >= seqlen_k is unbounded; with one bound
    set, an unbounded right one is seqlen_k (an unbounded left one stays unbounded: seqlen_k there
    excludes nothing)."""
    if window_size is None:
        window_size = (-1, -1)
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"{fn}: window_size must be a pair (left, right) of ints, -1 = unbounded, got {window_size!r}")
    sides = []
    for side, w in zip(("left", "right"), window_size):
        if isinstance(w, Tensor) and w.numel() == 1 and not w.is_floating_point():
            w = int(w.item())
        if isinstance(w, bool) or not isinstance(w, int):
            raise TypeError(f"{fn}: window_size's {side} entry must be an int (-1 = unbounded), got {type(w).__name__}")
        sides.append(-1 if w < 0 or w >= seqlen_k else int(w))
    left, right = sides
    if causal:
        right = 0
    if left >= 0 and right < 0:
        right = seqlen_k
    return left, right


def _alibi(fn: str, alibi_slopes, B: int, H: int) -> Tensor | None:
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, Tensor):
        raise TypeError(
            f"{fn}: alibi_slopes must be None or a float32 Tensor (H,) or (B, H), got {type(alibi_slopes).__name__}"
        )
    if not alibi_slopes.is_floating_point():
        raise TypeError(f"{fn}: alibi_slopes must be float32 (H,) or (B, H), got {alibi_slopes.dtype}")
    # the kernels take float32 slopes, (H,) or (B, H)
    if tuple(alibi_slopes.shape) not in ((H,), (B, H)):
        raise ValueError(
            f"{fn}: alibi_slopes must have shape (H,) = ({H},) or (B, H) = ({B}, {H}), got {tuple(alibi_slopes.shape)}"
        )
    if alibi_slopes.device.type != "cpu":
        raise ValueError(
            f"{fn}: alibi_slopes is on {alibi_slopes.device}; torch_masked_attn.flash_attn computes on the CPU"
        )
    return alibi_slopes.detach().to(torch.float32)


def _fa_lse(lse: Tensor | None) -> Tensor:
    """flash-attn's softmax_lse: +inf (not -inf) for a row that sees no key."""
    assert lse is not None  # the callers asked the kernels for it
    return lse.masked_fill(lse == float("-inf"), float("inf"))


@functools.lru_cache(maxsize=64)
def _steps(n: int, step: int) -> Tensor:
    """int32 (0, step, 2 step, ..., n step): the offsets of n sequences of `step` rows (cached: a
    decoding step asks for the same ones every layer; never written to)."""
    return torch.arange(0, n + 1, dtype=torch.int32) * step


def _round128(n: int) -> int:
    return (n + 127) // 128 * 128


def _empty_probs(q: Tensor) -> Tensor:
    """S_dmask when it is not computed (dropout_p == 0): flash-attn's empty tensor."""
    return torch.empty(0, dtype=q.dtype, device=q.device)


# ---- the dense path: masked_attention --------------------------------------------------------------


def _per_entry(q4: Tensor, Lk: int, left: int, right: int, lq, lk, kstart) -> tuple[Tensor, Tensor]:
    """The (B, 1, Lq, Lk) boolean mask of per-entry lengths (see _dense_attention) and window,
    each entry aligned to its own bottom right, and the distances |i + lk - lq - j| (ALiBi's)."""
    B, Lq = q4.size(0), q4.size(1)
    dev = q4.device
    i = torch.arange(Lq, device=dev).view(1, Lq, 1)
    j = torch.arange(Lk, device=dev).view(1, 1, Lk)
    n_q = Lq if lq is None else lq.view(B, 1, 1)
    n_k = Lk if lk is None else lk.view(B, 1, 1)
    jr = j if kstart is None else j - kstart.view(B, 1, 1)  # the key's index in its sequence
    d = i + (n_k - n_q) - jr
    blocked = (i >= n_q) | (jr < 0) | (jr >= n_k)
    if left >= 0:
        blocked = blocked | (d > left)
    if right >= 0:
        blocked = blocked | (d < -right)
    return blocked.unsqueeze(1), d.abs().unsqueeze(1)


def _dense_attention(
    q4: Tensor,
    k4: Tensor,
    v4: Tensor,
    *,
    scale,
    left: int,
    right: int,
    softcap,
    alibi: Tensor | None,
    dropout_p: float,
    want_lse: bool,
    want_probs: bool,
    lq: Tensor | None = None,
    lk: Tensor | None = None,
    kstart: Tensor | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Attention of q4 (B, Lq, H, D) over k4, v4 (B, Lk, H_kv, D / Dv), any strides, through
    masked_attention on (B, H, L, D) views (no copies), flash-attn's bottom-right aligned window
    (left, right) (-1 unbounded).

    lq, lk, kstart (int64 (B,), or None for Lq, Lk, 0): per-batch lengths: the query rows
    i < lq[b] and the keys kstart[b] <= j < kstart[b] + lk[b] of entry b take part, aligned to
    their own bottom right (the rest is blocked; their rows give 0).

    Returns out (B, Lq, H, Dv) (contiguous), lse (B, H, Lq) or None (-inf where a row sees no key),
    and with want_probs and dropout the probabilities (B, H, Lq, Lk), negated where dropped."""
    H, Lk = q4.size(2), k4.size(1)
    window, diagonal, mask, alibi_slopes = None, 0, None, alibi
    if lq is None and lk is None and kstart is None:  # flash-attn's bottom-right diagonal, in the kernels
        window, diagonal = (left, right), Lk - q4.size(1)
    else:
        mask, dist = _per_entry(q4, Lk, left, right, lq, lk, kstart)
        if alibi is not None:  # per-entry lengths: ALiBi as the additive mask of each entry's own
            bias_dtype = torch.float64 if q4.dtype == torch.float64 else torch.float32
            slopes = alibi.to(bias_dtype).reshape(-1, H, 1, 1)
            mask, alibi_slopes = (-slopes * dist.to(bias_dtype)).masked_fill(mask, float("-inf")), None
    qt, kt, vt = q4.transpose(1, 2), k4.transpose(1, 2), v4.transpose(1, 2)
    kw: dict[str, Any] = dict(
        attn_mask=mask, window=window, diagonal=diagonal, scale=scale, softcap=softcap, alibi_slopes=alibi_slopes
    )
    need_weights = want_probs and dropout_p > 0
    ret = _fn.masked_attention(qt, kt, vt, dropout_p=dropout_p, need_weights=need_weights, return_lse=want_lse, **kw)
    res = ret if isinstance(ret, tuple) else cast("tuple[Tensor, ...]", (ret,))
    out = res[0].transpose(1, 2)
    lse = res[-1] if want_lse else None
    probs = None
    if need_weights:
        with torch.no_grad():
            p = _fn.masked_attention(qt.detach(), kt.detach(), vt.detach(), need_weights=True, **kw)[1]
            probs = torch.where(res[1] != 0, p, -p)
    return out, lse, probs


def _pad_rows(x: Tensor, starts: Tensor, m: int) -> Tensor:
    """Packed rows x (T, ...) as (N, m, ...): entry b's row i is x[starts[b] + i] (clamped into x;
    rows past a sequence's end are padding its caller masks). A copy, differentiable."""
    N = starts.numel()
    if x.size(0) == 0:
        return x.new_zeros((N, m) + tuple(x.shape[1:]))
    idx = (starts.view(N, 1) + torch.arange(m, device=x.device).view(1, m)).clamp_(0, x.size(0) - 1)
    return x.index_select(0, idx.flatten()).view((N, m) + tuple(x.shape[1:]))


# ---- flash_attn_func and its packed forms ----------------------------------------------------------


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash_attn.flash_attn_func on the CPU.

    Args:
        q: (batch_size, seqlen_q, nheads, headdim); k: (batch_size, seqlen_k, nheads_k, headdim);
            v: (batch_size, seqlen_k, nheads_k, headdim_v); nheads a multiple of nheads_k (MQA / GQA:
            query head h uses key head h // (nheads / nheads_k)). float16, bfloat16, float32, float64.
        dropout_p: dropout probability (in our kernels, our random bits); 0.0 in evaluation.
        softmax_scale: default 1 / sqrt(headdim).
        causal: causal mask aligned to the bottom right (query i sees key j iff
            j <= i + seqlen_k - seqlen_q); a row that sees no key gives 0.
        window_size: (left, right), -1 unbounded: query i sees keys
            [i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q + right].
        softcap: > 0: scores s become softcap * tanh(s / softcap).
        alibi_slopes: (nheads,) or (batch_size, nheads) float32: the bias
            -slope * |i + seqlen_k - seqlen_q - j| (an additive mask here).
        deterministic: accepted (always deterministic).
        return_attn_probs: also return softmax_lse (batch_size, nheads, seqlen_q) (+inf for a row
            that sees no key) and S_dmask (empty unless dropout_p > 0; then
            (batch_size, nheads, round128(seqlen_q), round128(seqlen_k)), the probabilities,
            negative where dropped).

    Returns:
        out (batch_size, seqlen_q, nheads, headdim_v), or (out, softmax_lse, S_dmask).
    Differentiable in q, k, v.
    """
    fn = "flash_attn_func"
    _check_tensor(fn, "q", q, 4, "(batch_size, seqlen_q, nheads, headdim)")
    _check_tensor(fn, "k", k, 4, "(batch_size, seqlen_k, nheads_k, headdim)")
    _check_tensor(fn, "v", v, 4, "(batch_size, seqlen_k, nheads_k, headdim_v)")
    _check_same_dtype(fn, q, k=k, v=v)
    B, Lq, H, D = q.shape
    if k.size(0) != B or k.size(3) != D:
        raise ValueError(
            f"{fn}: k must have q's batch size and head dim (batch_size, seqlen_k, nheads_k, {D}) "
            f"with batch_size = {B}, got q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    if tuple(v.shape[:3]) != tuple(k.shape[:3]):
        raise ValueError(
            f"{fn}: v must have k's batch size, length and heads, got k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    _check_heads(fn, H, k.size(2), "k and v")
    dropout_p = _dropout(fn, dropout_p)
    left, right = _window(fn, window_size, bool(causal), k.size(1))
    out, lse, probs = _dense_attention(
        q,
        k,
        v,
        scale=_scale(fn, softmax_scale),
        left=left,
        right=right,
        softcap=_softcap(fn, softcap),
        alibi=_alibi(fn, alibi_slopes, B, H),
        dropout_p=dropout_p,
        want_lse=bool(return_attn_probs),
        want_probs=bool(return_attn_probs),
    )
    if not return_attn_probs:
        return out
    if probs is None:
        probs = _empty_probs(q)
    else:
        probs = F.pad(probs, (0, _round128(k.size(1)) - k.size(1), 0, _round128(Lq) - Lq))
    return out, _fa_lse(lse), probs


def flash_attn_qkvpacked_func(
    qkv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash_attn.flash_attn_qkvpacked_func: qkv (batch_size, seqlen, 3, nheads, headdim); as
    flash_attn_func on its three views (no copies; the gradient is qkv's)."""
    if not isinstance(qkv, Tensor) or qkv.dim() != 5 or qkv.size(2) != 3:
        raise ValueError(
            "flash_attn_qkvpacked_func: qkv must be a 5-D Tensor (batch_size, seqlen, 3, nheads, "
            f"headdim), got {tuple(qkv.shape) if isinstance(qkv, Tensor) else type(qkv).__name__}"
        )
    return flash_attn_func(
        qkv[:, :, 0],
        qkv[:, :, 1],
        qkv[:, :, 2],
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
    )


def flash_attn_kvpacked_func(
    q,
    kv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash_attn.flash_attn_kvpacked_func: kv (batch_size, seqlen_k, 2, nheads_k, headdim); as
    flash_attn_func on its two views."""
    if not isinstance(kv, Tensor) or kv.dim() != 5 or kv.size(2) != 2:
        raise ValueError(
            "flash_attn_kvpacked_func: kv must be a 5-D Tensor (batch_size, seqlen_k, 2, nheads_k, "
            f"headdim), got {tuple(kv.shape) if isinstance(kv, Tensor) else type(kv).__name__}"
        )
    return flash_attn_func(
        q,
        kv[:, :, 0],
        kv[:, :, 1],
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
    )


# ---- flash_attn_varlen_func and its packed forms -----------------------------------------------------


def _offsets(fn: str, name: str, cu, rows: int | None) -> Tensor:
    """cu_seqlens as int64 (N + 1,), checked: nondecreasing, within [0, rows] (rows None: >= 0)."""
    cu = _index(fn, name, cu, 1, "(batch_size + 1,)").to(torch.int64)
    if cu.numel() < 1:
        raise ValueError(f"{fn}: {name} must have batch_size + 1 >= 1 entries, got none")
    if bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"{fn}: {name} must be nondecreasing (cumulative sequence lengths), got {cu.tolist()}")
    if int(cu[0]) < 0 or (rows is not None and int(cu[-1]) > rows):
        raise ValueError(f"{fn}: {name} must lie in [0, {rows}] (the packed tensor's rows), got {cu.tolist()}")
    return cu


class _Seqs(NamedTuple):
    """flash_attn_varlen_func's sequences, checked: offsets (int64 (N + 1,)), lengths (int64 (N,)),
    the longest of each (mq, mk) and the max_seqlen_q, max_seqlen_k given (>= them)."""

    cu_q: Tensor
    cu_k: Tensor
    lens_q: Tensor
    lens_k: Tensor
    mq: int
    mk: int
    max_q: int
    max_k: int


def _varlen_tensors(fn: str, q, k, v, paged: bool) -> None:
    """flash_attn_varlen_func's q, k, v: layouts (k, v paged caches with block_table), dtypes,
    head dims and heads."""
    _check_tensor(fn, "q", q, 3, "(total_q, nheads, headdim)")
    kv_dims, kv_layout = (
        (4, "(num_blocks, page_block_size, nheads_k, headdim)") if paged else (3, "(total_k, nheads_k, headdim)")
    )
    _check_tensor(fn, "k", k, kv_dims, kv_layout + (" with block_table" if paged else ""))
    _check_tensor(fn, "v", v, kv_dims, kv_layout + (" with block_table" if paged else ""))
    _check_same_dtype(fn, q, k=k, v=v)
    D = q.size(2)
    if k.size(-1) != D:
        raise ValueError(f"{fn}: k must have q's head dim ({D}), got k {tuple(k.shape)}")
    if tuple(v.shape[:-1]) != tuple(k.shape[:-1]):
        raise ValueError(f"{fn}: v must have k's rows and heads, got k {tuple(k.shape)}, v {tuple(v.shape)}")
    _check_heads(fn, q.size(1), k.size(-2), "k and v")


def _varlen_seqs(fn: str, q: Tensor, k: Tensor, cu_seqlens_q, cu_seqlens_k, max_q, max_k, paged: bool) -> _Seqs:
    """flash_attn_varlen_func's offsets and maximum lengths, checked."""
    cu_q = _offsets(fn, "cu_seqlens_q", cu_seqlens_q, q.size(0))
    cu_k = _offsets(fn, "cu_seqlens_k", cu_seqlens_k, None if paged else k.size(0))
    if cu_k.numel() != cu_q.numel():
        raise ValueError(
            f"{fn}: cu_seqlens_k must have as many entries as cu_seqlens_q ({cu_q.numel()}), got {cu_k.numel()}"
        )
    lens_q, lens_k = cu_q.diff(), cu_k.diff()
    N = lens_q.numel()
    max_q = int(_validate.number(fn, "max_seqlen_q", max_q, "an int"))
    max_k = int(_validate.number(fn, "max_seqlen_k", max_k, "an int"))
    mq = int(lens_q.max()) if N else 0
    mk = int(lens_k.max()) if N else 0
    if max_q < mq:
        raise ValueError(f"{fn}: max_seqlen_q ({max_q}) is less than the longest query sequence ({mq})")
    if max_k < mk:
        raise ValueError(f"{fn}: max_seqlen_k ({max_k}) is less than the longest key sequence ({mk})")
    return _Seqs(cu_q, cu_k, lens_q, lens_k, mq, mk, max_q, max_k)


def _varlen_table(fn: str, block_table, q: Tensor, k: Tensor, v: Tensor, seqs: _Seqs) -> Tensor:
    """flash_attn_varlen_func's block_table, checked against the pages k, v hold and the key
    lengths; refused where a gradient is wanted (paged caches have no backward)."""
    bt = _index(fn, "block_table", block_table, 2, "(batch_size, max_num_blocks_per_seq)")
    N, page = seqs.lens_k.numel(), k.size(1)
    if bt.size(0) != N:
        raise ValueError(f"{fn}: block_table must have batch_size = {N} rows, got {tuple(bt.shape)}")
    if seqs.mk > bt.size(1) * page:
        raise ValueError(
            f"{fn}: block_table addresses {bt.size(1)} pages of {page} keys, fewer than the "
            f"longest key sequence ({seqs.mk})"
        )
    _paging.check_in_pool(fn, bt, _paging.pages_of(seqs.lens_k, page), k.size(0), "k")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise RuntimeError(
            f"{fn}: block_table (a paged KV cache) is inference-only: no backward; call it under torch.no_grad()"
        )
    return bt


def _varlen_packed(qs, k, v, seqs: _Seqs, q0: int, bt, want: bool, opts: dict):
    """flash_attn_varlen_func without dropout: varlen_attn on the packed rows qs (from q's row q0)
    and k, v (their rows from cu_k[0] on, or paged through bt). (out, lse or None)."""
    cu_q, cu_k = seqs.cu_q, seqs.cu_k
    args: dict[str, Any] = dict(return_aux=_fn.AuxRequest(lse=want), window_size=opts["window"], enable_gqa=True)
    args.update(scale=opts["scale"], softcap=opts["softcap"], alibi_slopes=opts["alibi"])
    if bt is not None:
        ks, vs, cu_k = k, v, None
        args.update(seqused_k=seqs.lens_k.to(torch.int32), block_table=bt.to(torch.int32).contiguous())
    else:
        k0, k1 = int(cu_k[0]), int(cu_k[-1])
        ks, vs = (k, v) if (k0, k1) == (0, k.size(0)) else (k[k0:k1], v[k0:k1])
        cu_k = (cu_k - k0).to(torch.int32)
    res = _fn.varlen_attn(qs, ks, vs, (cu_q - q0).to(torch.int32), cu_k, max(seqs.mq, 1), max(seqs.mk, 1), **args)
    return cast("tuple[Tensor, Tensor]", res) if want else (cast(Tensor, res), None)


def _varlen_padded(qs, k, v, seqs: _Seqs, q0: int, bt, want: bool, dropout_p: float, opts: dict):
    """flash_attn_varlen_func with dropout (the packed kernels have none): the batch padded to
    (batch_size, max_len, ...) copies, the dense kernels, the rows packed again.
    (out, lse or None, S_dmask or None)."""
    H, lens_q, lens_k, mq, mk = qs.size(1), seqs.lens_q, seqs.lens_k, seqs.mq, seqs.mk
    q4 = _pad_rows(qs, seqs.cu_q[:-1] - q0, max(mq, 1))
    if bt is not None:
        k4, v4 = _paging.gather_dense(k, bt, lens_k), _paging.gather_dense(v, bt, lens_k)
    else:
        k4, v4 = _pad_rows(k, seqs.cu_k[:-1], max(mk, 1)), _pad_rows(v, seqs.cu_k[:-1], max(mk, 1))
    left, right = opts["window"]
    out4, lse4, probs4 = _dense_attention(
        q4,
        k4,
        v4,
        scale=opts["scale"],
        left=left,
        right=right,
        softcap=opts["softcap"],
        alibi=opts["alibi"],
        dropout_p=dropout_p,
        want_lse=want,
        want_probs=want,
        lq=lens_q,
        lk=lens_k,
    )
    rows = (torch.arange(q4.size(1)).view(1, -1) < lens_q.view(-1, 1)).flatten().nonzero().flatten()
    out = out4.reshape(-1, H, out4.size(-1)).index_select(0, rows)
    lse = cast(Tensor, lse4).transpose(0, 1).reshape(H, -1).index_select(1, rows) if want else None
    probs = None
    if probs4 is not None:
        probs = F.pad(probs4[:, :, :mq, :mk], (0, _round128(seqs.max_k) - mk, 0, _round128(seqs.max_q) - mq))
    return out, lse, probs


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """flash_attn.flash_attn_varlen_func on the CPU: packed variable-length sequences.

    Args:
        q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim / headdim_v), or with
            block_table paged caches (num_blocks, page_block_size, nheads_k, headdim) (any page size).
        cu_seqlens_q, cu_seqlens_k: int32 (batch_size + 1,): sequence b is rows
            cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q and cu_seqlens_k[b]:cu_seqlens_k[b + 1] of k, v
            (paged: its key count is cu_seqlens_k[b + 1] - cu_seqlens_k[b], read from its pages
            through block_table[b]); empty sequences allowed. Rows outside [cu[0], cu[-1]) are not
            read; their output is 0.
        max_seqlen_q, max_seqlen_k: at least the longest sequences (checked).
        block_table: int32 (batch_size, max_num_blocks_per_seq): paged KV; no backward.
        The rest as flash_attn_func, each sequence aligned to its own bottom right; window bounds
        are normalised against max_seqlen_k as flash-attn's kernels do.

    Returns:
        out (total_q, nheads, headdim_v), or (out, softmax_lse (nheads, total_q), S_dmask) with
        return_attn_probs; S_dmask empty unless dropout_p > 0, then
        (batch_size, nheads, round128(max_seqlen_q), round128(max_seqlen_k)).
    Differentiable in q, k, v (not with block_table). Dropout or ALiBi pad the batch to
    (batch_size, max_len, ...) copies and run the dense kernels (the packed kernels have neither).
    """
    fn = "flash_attn_varlen_func"
    paged = block_table is not None
    _varlen_tensors(fn, q, k, v, paged)
    seqs = _varlen_seqs(fn, q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, paged)
    bt = _varlen_table(fn, block_table, q, k, v, seqs) if paged else None
    dropout_p = _dropout(fn, dropout_p)
    opts: dict[str, Any] = dict(scale=_scale(fn, softmax_scale), softcap=_softcap(fn, softcap))
    opts.update(window=_window(fn, window_size, bool(causal), seqs.max_k))
    opts.update(alibi=_alibi(fn, alibi_slopes, seqs.lens_q.numel(), q.size(1)))
    want = bool(return_attn_probs)
    q0, q1 = int(seqs.cu_q[0]), int(seqs.cu_q[-1])
    qs = q if (q0, q1) == (0, q.size(0)) else q[q0:q1]
    probs = None
    if dropout_p == 0.0:
        out, lse = _varlen_packed(qs, k, v, seqs, q0, bt, want, opts)
    else:
        out, lse, probs = _varlen_padded(qs, k, v, seqs, q0, bt, want, dropout_p, opts)
    if (q0, q1) != (0, q.size(0)):  # rows outside the sequences: output 0, softmax_lse +inf
        out = F.pad(out, (0, 0, 0, 0, q0, q.size(0) - q1))
        if lse is not None:
            lse = F.pad(lse, (q0, q.size(0) - q1), value=float("-inf"))
    if not want:
        return out
    return out, _fa_lse(lse), (_empty_probs(q) if probs is None else probs)


def flash_attn_varlen_qkvpacked_func(
    qkv,
    cu_seqlens,
    max_seqlen,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash_attn.flash_attn_varlen_qkvpacked_func: qkv (total, 3, nheads, headdim); as
    flash_attn_varlen_func on its views, with cu_seqlens and max_seqlen for queries and keys."""
    if not isinstance(qkv, Tensor) or qkv.dim() != 4 or qkv.size(1) != 3:
        raise ValueError(
            "flash_attn_varlen_qkvpacked_func: qkv must be a 4-D Tensor (total, 3, nheads, headdim), "
            f"got {tuple(qkv.shape) if isinstance(qkv, Tensor) else type(qkv).__name__}"
        )
    return flash_attn_varlen_func(
        qkv[:, 0],
        qkv[:, 1],
        qkv[:, 2],
        cu_seqlens,
        cu_seqlens,
        max_seqlen,
        max_seqlen,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
    )


def flash_attn_varlen_kvpacked_func(
    q,
    kv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash_attn.flash_attn_varlen_kvpacked_func: kv (total_k, 2, nheads_k, headdim); as
    flash_attn_varlen_func on its views."""
    if not isinstance(kv, Tensor) or kv.dim() != 4 or kv.size(1) != 2:
        raise ValueError(
            "flash_attn_varlen_kvpacked_func: kv must be a 4-D Tensor (total_k, 2, nheads_k, "
            f"headdim), got {tuple(kv.shape) if isinstance(kv, Tensor) else type(kv).__name__}"
        )
    return flash_attn_varlen_func(
        q,
        kv[:, 0],
        kv[:, 1],
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
    )


# ---- flash_attn_with_kvcache -------------------------------------------------------------------------


def _rotary(x: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, interleaved: bool) -> Tensor:
    """flash-attn's rotary embedding of x (B, L, H, D) at positions pos (B, L): the first
    rotary_dim = 2 * cos.size(1) dims rotated (interleaved: pairs (0, 1), (2, 3), ...; else
    GPT-NeoX's halves), the rest as is. Computed in float32 (float64 for float64)."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    B, L = pos.shape
    rd = 2 * cos.size(1)
    c = cos.index_select(0, pos.flatten()).to(acc).view(B, L, 1, rd // 2)
    s = sin.index_select(0, pos.flatten()).to(acc).view(B, L, 1, rd // 2)
    xr = x[..., :rd].to(acc)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., : rd // 2], xr[..., rd // 2 :]
        rot = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., rd:]), dim=-1)


@dataclasses.dataclass
class _KVCall:
    """flash_attn_with_kvcache's call, checked: the batch's sizes, the cache's layout and each
    entry's cache rows. The bookkeeping in Python ints: a decoding step's batch is small, and a
    tensor op costs more than a list's loop there."""

    B: int
    Lq: int
    H: int
    D: int
    Hk: int
    Dv: int
    Lnew: int  # new keys per entry (k's seqlen_new, set by _kv_new; 0 without k)
    bt: Tensor | None = None  # block_table (paged caches)
    page: int = 0  # the page size (paged)
    seqlen_k: int = 0  # the rows an entry may address
    ends: list[int] = dataclasses.field(default_factory=list)  # cache_seqlens (before the append)
    idx: list[int] | None = None  # cache_batch_idx
    leftpad: list[int] | None = None  # cache_leftpad

    @property
    def lengths(self) -> list[int]:
        """Each entry's keys: cache rows leftpad[b] .. ends[b] + Lnew - 1 (the seqlen_k it is aligned to)."""
        return [e + self.Lnew - lp for e, lp in zip(self.ends, self.leftpad or [0] * self.B)]


def _kv_tensors(fn: str, q, k_cache, v_cache, k, v, paged: bool) -> _KVCall:
    """flash_attn_with_kvcache's q, caches and new k, v: layouts, dtypes, sizes, heads."""
    _check_tensor(fn, "q", q, 4, "(batch_size, seqlen_q, nheads, headdim)")
    cache_layout = (
        "(num_blocks, page_block_size, nheads_k, headdim) with block_table"
        if paged
        else "(batch_size_cache, seqlen_cache, nheads_k, headdim)"
    )
    _check_tensor(fn, "k_cache", k_cache, 4, cache_layout)
    _check_tensor(fn, "v_cache", v_cache, 4, cache_layout)
    _check_same_dtype(fn, q, k_cache=k_cache, v_cache=v_cache)
    B, Lq, H, D = q.shape
    if B == 0:
        raise ValueError(f"{fn}: q must have batch_size > 0, got shape {tuple(q.shape)}")
    c = _KVCall(B, Lq, H, D, k_cache.size(2), v_cache.size(3), 0)
    if k_cache.size(3) != D:
        raise ValueError(f"{fn}: k_cache must have q's head dim ({D}), got k_cache {tuple(k_cache.shape)}")
    if tuple(v_cache.shape[:3]) != tuple(k_cache.shape[:3]):
        raise ValueError(
            f"{fn}: v_cache must have k_cache's first three dims, got k_cache "
            f"{tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
        )
    _check_heads(fn, H, c.Hk, "k_cache and v_cache")
    if (k is None) != (v is None):
        name = "v" if v is None else "k"
        raise ValueError(f"{fn}: k and v go together: {name} is None while the other is given")
    if k is not None:
        _kv_new(fn, q, k, v, c)
    return c


def _kv_new(fn: str, q: Tensor, k, v, c: _KVCall) -> None:
    """flash_attn_with_kvcache's new k, v: (batch_size, seqlen_new, nheads_k, headdim / headdim_v)."""
    _check_tensor(fn, "k", k, 4, "(batch_size, seqlen_new, nheads_k, headdim)")
    _check_tensor(fn, "v", v, 4, "(batch_size, seqlen_new, nheads_k, headdim_v)")
    _check_same_dtype(fn, q, k=k, v=v)
    c.Lnew = k.size(1)
    if tuple(k.shape) != (c.B, c.Lnew, c.Hk, c.D):
        raise ValueError(
            f"{fn}: k must have shape (batch_size, seqlen_new, nheads_k, headdim) = "
            f"({c.B}, seqlen_new, {c.Hk}, {c.D}), got {tuple(k.shape)}"
        )
    if tuple(v.shape) != (c.B, c.Lnew, c.Hk, c.Dv):
        raise ValueError(
            f"{fn}: v must have shape (batch_size, seqlen_new, nheads_k, headdim_v) = "
            f"({c.B}, {c.Lnew}, {c.Hk}, {c.Dv}), got {tuple(v.shape)}"
        )


def _kv_table(fn: str, c: _KVCall, block_table, cache_batch_idx, cache_leftpad, k_cache: Tensor) -> None:
    """flash_attn_with_kvcache's block_table (paged: neither cache_batch_idx nor cache_leftpad, as
    in flash-attn), and the rows an entry may address (c.seqlen_k)."""
    if block_table is None:
        c.seqlen_k = k_cache.size(1)
        return
    for name, t in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
        if t is not None:
            raise ValueError(f"{fn}: {name} is not supported with block_table (paged KV cache), as in flash-attn")
    c.bt = _index(fn, "block_table", block_table, 2, "(batch_size, max_num_blocks_per_seq)")
    if c.bt.size(0) != c.B:
        raise ValueError(f"{fn}: block_table must have batch_size = {c.B} rows, got {tuple(c.bt.shape)}")
    c.page = k_cache.size(1)
    c.seqlen_k = c.bt.size(1) * c.page


def _kv_ends(fn: str, c: _KVCall, cache_seqlens, has_k: bool) -> None:
    """flash_attn_with_kvcache's cache_seqlens (c.ends): an int, (batch_size,) or None (the whole
    cache); with the new keys within the addressable rows."""
    if cache_seqlens is None:
        if has_k:
            raise ValueError(f"{fn}: cache_seqlens is required when k and v are given (where to append them)")
        c.ends = [c.seqlen_k] * c.B
    elif isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        c.ends = [int(cache_seqlens)] * c.B
    else:
        c.ends = _index(fn, "cache_seqlens", cache_seqlens, 1, "(batch_size,) or an int").tolist()
        if len(c.ends) != c.B:
            raise ValueError(f"{fn}: cache_seqlens must have batch_size = {c.B} entries, got {len(c.ends)}")
    if any(e < 0 or e + c.Lnew > c.seqlen_k for e in c.ends):
        paged, Lnew = c.bt is not None, c.Lnew
        raise ValueError(
            f"{fn}: cache_seqlens{' + seqlen_new' if Lnew else ''} must lie in [0, {c.seqlen_k}] "
            f"(the cache's {'addressable ' if paged else ''}length), got cache_seqlens = "
            f"{c.ends}{f', seqlen_new = {Lnew}' if Lnew else ''}"
        )


def _kv_rows(fn: str, c: _KVCall, cache_batch_idx, cache_leftpad, B_c: int) -> None:
    """flash_attn_with_kvcache's cache_batch_idx (c.idx) and cache_leftpad (c.leftpad), and the
    pages a paged entry uses: each within the cache's B_c rows or pages."""
    if cache_batch_idx is not None:
        c.idx = _index(fn, "cache_batch_idx", cache_batch_idx, 1, "(batch_size,)").tolist()
        if len(c.idx) != c.B:
            raise ValueError(f"{fn}: cache_batch_idx must have batch_size = {c.B} entries, got {len(c.idx)}")
        if any(i < 0 or i >= B_c for i in c.idx):
            raise ValueError(f"{fn}: cache_batch_idx must index k_cache's {B_c} rows, got {c.idx}")
    elif c.bt is None and B_c < c.B:
        raise ValueError(
            f"{fn}: k_cache has {B_c} rows (batch_size_cache) for a batch of {c.B}; pass "
            "cache_batch_idx or a larger cache"
        )
    if cache_leftpad is not None:
        c.leftpad = _index(fn, "cache_leftpad", cache_leftpad, 1, "(batch_size,)").tolist()
        if len(c.leftpad) != c.B:
            raise ValueError(f"{fn}: cache_leftpad must have batch_size = {c.B} entries, got {len(c.leftpad)}")
        if any(lp < 0 or lp > e for lp, e in zip(c.leftpad, c.ends)):
            raise ValueError(
                f"{fn}: cache_leftpad must lie in [0, cache_seqlens[b]], got {c.leftpad} for cache_seqlens {c.ends}"
            )
    if c.bt is not None:
        n_pages = _paging.pages_of(torch.tensor(c.ends) + c.Lnew, c.page)
        _paging.check_in_pool(fn, c.bt, n_pages, B_c, "k_cache")


def _kv_rotary(fn: str, rotary_cos, rotary_sin, k, D: int) -> bool:
    """Whether the call rotates (rotary_cos, rotary_sin given: together, with the new k, shaped
    (seqlen_ro, rotary_dim / 2), rotary_dim <= headdim)."""
    if rotary_cos is None and rotary_sin is None:
        return False
    if rotary_cos is None or rotary_sin is None:
        missing = "rotary_cos" if rotary_cos is None else "rotary_sin"
        raise ValueError(f"{fn}: rotary_cos and rotary_sin go together; {missing} is None")
    if k is None:
        raise ValueError(
            f"{fn}: rotary_cos / rotary_sin need the new k and v (the rotary embedding is "
            "applied to the keys being appended and to q)"
        )
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        _check_tensor(fn, name, t, 2, "(seqlen_ro, rotary_dim / 2)")
    if rotary_sin.shape != rotary_cos.shape:
        raise ValueError(
            f"{fn}: rotary_sin must have rotary_cos's shape {tuple(rotary_cos.shape)}, got {tuple(rotary_sin.shape)}"
        )
    if 2 * rotary_cos.size(1) > D:
        raise ValueError(f"{fn}: rotary_cos's rotary_dim = 2 * {rotary_cos.size(1)} must be <= headdim ({D})")
    return True


def _kv_append(c: _KVCall, q, k, v, k_cache, v_cache, rotary, interleaved: bool, local: bool) -> Tensor:
    """Rotates k and q (rotary: (cos, sin), or None) and writes k, v into the caches in place at
    rows ends[b] ..; returns q, rotated. flash-attn's positions: keys at ends[b] + t; queries at
    ends[b] + i when causal or local, else all at ends[b]."""
    B, Lq, Lnew = c.B, c.Lq, c.Lnew
    if rotary is not None:
        cos, sin = rotary
        top = max(c.ends) + max(Lnew, Lq if local else 1)
        if cos.size(0) < top:
            raise ValueError(
                f"flash_attn_with_kvcache: rotary_cos has {cos.size(0)} positions, fewer than the {top} "
                "the appended keys and the queries need"
            )
    with torch.no_grad():
        if rotary is not None:
            first = torch.tensor(c.ends).view(-1, 1)
            k = _rotary(k, cos, sin, first + torch.arange(Lnew), interleaved)
            q = _rotary(q, cos, sin, first + torch.arange(Lq) if local else first.expand(B, Lq), interleaved)
        if Lnew > 0:
            if c.bt is not None:
                slots = _paging.slots(c.bt, torch.tensor(c.ends).view(-1, 1) + torch.arange(Lnew), c.page)
            else:  # a dense cache is pages of seqlen_cache rows, one per cache row
                first = torch.tensor([(b if c.idx is None else c.idx[b]) * c.seqlen_k + c.ends[b] for b in range(B)])
                slots = first if Lnew == 1 else first.view(-1, 1) + torch.arange(Lnew)
            flat_k, flat_v = k.reshape(B * Lnew, c.Hk, c.D), v.reshape(B * Lnew, c.Hk, c.Dv)
            _fn.write_kv_cache(flat_k, flat_v, k_cache, v_cache, slots.flatten())
    return q


def _kv_attend(c: _KVCall, q: Tensor, k_cache: Tensor, v_cache: Tensor, want_lse: bool, opts: dict):
    """flash_attn_with_kvcache's attention over the caches (varlen_attn: paged caches in place,
    dense ones by _kvcache_dense). (out (B, Lq, H, Dv), softmax_lse (B, H, Lq) or None)."""
    B, Lq, H = c.B, c.Lq, c.H
    qf = q.reshape(B * Lq, H, c.D)
    cu_q = _steps(B, Lq)
    common: dict[str, Any] = dict(return_aux=_fn.AuxRequest(lse=want_lse), enable_gqa=True, **opts)
    common["seqused_k"] = torch.tensor(c.lengths, dtype=torch.int32)
    with torch.no_grad():
        if c.bt is not None:
            table = c.bt.to(torch.int32).contiguous()
            res = _fn.varlen_attn(
                qf, k_cache, v_cache, cu_q, None, max(Lq, 1), max(c.seqlen_k, 1), block_table=table, **common
            )
        else:
            res = _kvcache_dense(qf, k_cache, v_cache, cu_q, Lq, c.idx, c.leftpad, common)
    out, lse = cast("tuple[Tensor, Tensor]", res) if want_lse else (cast(Tensor, res), None)
    if lse is not None:
        lse = lse.view(H, B, Lq).transpose(0, 1).contiguous()
    return out.view(B, Lq, H, c.Dv), lse


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
):
    """flash_attn.flash_attn_with_kvcache on the CPU (inference: no backward).

    Args:
        q: (batch_size, seqlen_q, nheads, headdim).
        k_cache, v_cache: (batch_size_cache, seqlen_cache, nheads_k, headdim), or with block_table
            (num_blocks, page_block_size, nheads_k, headdim) (any page size; pages of a multiple of 64
            rows are read in place, others gathered). Any strides.
        k, v: optional (batch_size, seqlen_new, nheads_k, headdim): written into the caches in
            place at rows cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1 (functional.write_kv_cache),
            then attended to. Needs cache_seqlens.
        rotary_cos, rotary_sin: optional (seqlen_ro, rotary_dim / 2): k is rotated at positions
            cache_seqlens[b] + t before it is written; q at cache_seqlens[b] + i when causal or local,
            else every query at cache_seqlens[b]. Needs k. rotary_interleaved: pairs (0, 1), (2, 3), ...
            (True) or GPT-NeoX's halves (False).
        cache_seqlens: int or (batch_size,) int32: the cache's lengths before the append (None: the
            whole cache).
        cache_batch_idx: (batch_size,) int32: the cache rows of the batch (dense caches only).
        cache_leftpad: (batch_size,) int32: the first cache row of each entry (dense caches only):
            keys cache_leftpad[b] .. cache_seqlens[b] + seqlen_new - 1. Rotary positions stay the
            cache rows, as in flash-attn.
        block_table: (batch_size, max_num_blocks_per_seq) int32: paged caches.
        num_splits: accepted, ignored.
        return_softmax_lse: also return softmax_lse (batch_size, nheads, seqlen_q) (+inf for a row
            that sees no key).
        The rest as flash_attn_func, aligned to each entry's bottom right (its seqlen_k:
        cache_seqlens[b] - cache_leftpad[b] + seqlen_new).

    Returns:
        out (batch_size, seqlen_q, nheads, headdim_v), or (out, softmax_lse).
    """
    fn = "flash_attn_with_kvcache"
    c = _kv_tensors(fn, q, k_cache, v_cache, k, v, block_table is not None)
    _kv_table(fn, c, block_table, cache_batch_idx, cache_leftpad, k_cache)
    _kv_ends(fn, c, cache_seqlens, k is not None)
    _kv_rows(fn, c, cache_batch_idx, cache_leftpad, k_cache.size(0))
    rotary = _kv_rotary(fn, rotary_cos, rotary_sin, k, c.D)
    opts: dict[str, Any] = dict(scale=_scale(fn, softmax_scale), softcap=_softcap(fn, softcap))
    left, right = opts["window_size"] = _window(fn, window_size, bool(causal), c.seqlen_k)
    opts["alibi_slopes"] = _alibi(fn, alibi_slopes, c.B, c.H)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"{fn}: num_splits must be an int >= 0, got {num_splits!r}")
    local = bool(causal) or left >= 0 or right >= 0
    q = _kv_append(
        c, q, k, v, k_cache, v_cache, (rotary_cos, rotary_sin) if rotary else None, bool(rotary_interleaved), local
    )
    out, lse = _kv_attend(c, q, k_cache, v_cache, bool(return_softmax_lse), opts)
    return (out, _fa_lse(lse)) if return_softmax_lse else out


def _views_flat(cache: Tensor) -> bool:
    """Whether a 4-D cache's first two dims view as one (rows, H_kv, D) without a copy."""
    try:
        cache.view(-1, *cache.shape[2:])
    except RuntimeError:
        return False
    return True


def _kvcache_dense(
    qf: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cu_q: Tensor,
    Lq: int,
    idx: list | None,
    leftpad: list | None,
    common: dict,
):
    """varlen_attn over a dense cache (B_c, L, H_kv, D), read in place where possible:
    - as packed rows (the cache viewed (B_c * L, H_kv, D)), entry b's keys starting at row
      idx[b] * L + leftpad[b], when the rows view flat and idx is None or increasing;
    - else, without leftpad, as a paged cache of one page of L rows per entry, block_table = idx
      (varlen_attn reads pages of a multiple of 64 rows in place and gathers other page sizes);
    - else (leftpad with repeated or decreasing cache_batch_idx, or a cache whose rows do not view
      flat) a copy of the entries' cache rows is unavoidable: index_select, then packed rows."""
    B = cu_q.numel() - 1
    L = k_cache.size(1)
    flat = _views_flat(k_cache) and _views_flat(v_cache)
    rows = list(range(B)) if idx is None else idx
    increasing = all(rows[b] < rows[b + 1] for b in range(B - 1))
    if not (flat and increasing) and leftpad is None:
        table = torch.tensor(rows, dtype=torch.int32).view(B, 1)
        return _fn.varlen_attn(qf, k_cache, v_cache, cu_q, None, max(Lq, 1), max(L, 1), block_table=table, **common)
    if not (flat and increasing):  # a copy (see above)
        sel = torch.tensor(rows)
        k_cache, v_cache, rows = k_cache.index_select(0, sel), v_cache.index_select(0, sel), list(range(B))
    kf, vf = k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:])
    if leftpad is None and idx is None:  # entry b: rows b * L .. of the flat cache
        kf, vf, cu_k = kf[: B * L], vf[: B * L], _steps(B, L)
    else:
        start = [r * L + (0 if leftpad is None else leftpad[b]) for b, r in enumerate(rows)]  # first key rows
        s0, stop = start[0], (rows[-1] + 1) * L
        kf, vf = kf[s0:stop], vf[s0:stop]
        cu_k = torch.tensor([x - s0 for x in start] + [stop - s0], dtype=torch.int32)
    return _fn.varlen_attn(qf, kf, vf, cu_q, cu_k, max(Lq, 1), max(L, 1), **common)
