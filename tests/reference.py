"""The tests' references in plain PyTorch, shared by every topic folder.

``from reference import ...`` (tests/ is on sys.path: conftest.py's directory).

* ``attention64``: attention with every option of masked_attention, in float64 unless told
  otherwise: the one attention reference of the suite. Tests whose calling convention differs
  (flash-attn's (B, L, H, D), packed sequences, a model's layer) call it through a thin adapter;
  the same function in the test's dtype (``dtype=``) is PyTorch's own error on the same ops, the
  yardstick of flash-attention's rule (conftest.assert_close_ref).
* ``band_blocked``: the causal and window band about a diagonal, as a bool (Lq, Lk) mask.
* ``philox``, ``keep_mask``: attention dropout's keep mask as masked_attn.h defines it
  (Philox-4x32-10; tests/attention/test_dropout.py checks it against Random123's known answers
  and the kernels' masks).
* ``q_int16``: query rows as the 8-bit cache's integer scores read them (the decode's rows);
  ``p_int16_bound``: what its integer P V may add to an output's error.
* ``cross_entropy64``: cross-entropy with every option of torch_masked_attn's (z-loss, soft-cap
  beside PyTorch's weight, ignore_index, label smoothing, probability targets), composed from
  F.cross_entropy in the inputs' dtype (tools/fuzz.py's).
"""

import math

import torch
import torch.nn.functional as F

M32 = 0xFFFFFFFF
NEG_INF = float("-inf")


# ---- dropout's keep mask, re-implemented in plain torch ---------------------------------------


def _mulhilo(a, m):
    prod = a * m  # < 2^64: int64 wraps, the low 64 bits are exact
    return (prod >> 32) & M32, prod & M32


def philox(c0, c1, c2, c3, k0, k1):
    """Philox-4x32-10 on int64 tensors holding uint32 values."""
    c = [torch.as_tensor(x, dtype=torch.int64) for x in (c0, c1, c2, c3)]
    c = torch.broadcast_tensors(*c)
    k0, k1 = k0 & M32, k1 & M32
    for _ in range(10):
        hi0, lo0 = _mulhilo(c[0], 0xD2511F53)
        hi1, lo1 = _mulhilo(c[2], 0xCD9E8D57)
        c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
        k0, k1 = (k0 + 0x9E3779B9) & M32, (k1 + 0xBB67AE85) & M32
    return c


def keep_mask(seed_tensor, B, H, Lq, Lk, p):
    """Z[b, h, i, j] as masked_attn.h defines it."""
    seed, offset = (int(x) & ((1 << 64) - 1) for x in seed_tensor.tolist())
    k0, k1 = seed & M32, (seed >> 32) ^ (offset >> 32)
    b, h, i, j = torch.meshgrid(*(torch.arange(n) for n in (B, H, Lq, Lk)), indexing="ij")
    words = philox(j >> 3, i, (b * H + h) & M32, offset & M32, k0, k1)
    w = torch.stack(words, -1)  # (..., 4)
    sel = torch.gather(w, -1, ((j & 7) >> 1).unsqueeze(-1)).squeeze(-1)
    u = (sel >> (16 * (j & 1))) & 0xFFFF
    return u >= round(p * 65536)


# ---- attention -----------------------------------------------------------------------------


def _additive(mask, dtype):
    """bool True = blocked -> -inf, float as is."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype).masked_fill(mask, NEG_INF)
    return mask.to(dtype)


def band_blocked(Lq, Lk, *, is_causal=False, window=None, diagonal=0):
    """Bool (Lq, Lk), True where key j is outside query i's band about the diagonal j = i +
    diagonal (0: top left; Lk - Lq: bottom right): after it when causal, further than left
    before or right after it for window (left, right) (None or -1: unbounded)."""
    i = torch.arange(Lq)[:, None] + diagonal
    j = torch.arange(Lk)[None, :]
    blocked = torch.zeros(Lq, Lk, dtype=torch.bool)
    if is_causal:
        blocked |= j > i
    if window is not None:
        left, right = (-1 if w is None else w for w in window)
        if left >= 0:
            blocked |= j < i - left
        if right >= 0:
            blocked |= j > i + right
    return blocked


def _per_head(x, H, dtype):
    """(H,) or (B, H) -> broadcastable against (..., H, Lq, Lk)."""
    x = x.to(dtype)
    return x.view(H, 1, 1) if x.dim() == 1 else x.view(*x.shape, 1, 1)


def attention64(
    q,
    k,
    v,
    *,
    scale=None,
    attn_mask=None,
    key_padding_mask=None,
    head_mask=None,
    is_causal=False,
    diagonal=0,
    window=None,
    softcap=None,
    sinks=None,
    alibi_slopes=None,
    dropout_keep=None,
    dropout_p=0.0,
    dtype=torch.float64,
    return_weights=False,
    return_lse=False,
    return_scores=False,
):
    """softmax(scores) v in ``dtype`` with plain PyTorch ops; differentiable in every tensor.

    q (..., H, Lq, D), k (..., Hkv, Lk, D), v (..., Hkv, Lk, Dv) (or (Lq, D), (Lk, D), (Lk, Dv)):
    query head h reads kv head h // (H // Hkv). Scores: q k^T * scale (default 1/sqrt(D)); soft-capped, s -> softcap *
    tanh(s / softcap); ALiBi, -slope * |i + Lk - Lq - j| (alibi_slopes (H,) or (B, H)); plus
    attn_mask (bool True = blocked, or additive; broadcasts to (..., H, Lq, Lk)) and
    key_padding_mask ((B, Lk), bool True = blocked, or additive); -inf outside the band of
    band_blocked(is_causal, window, diagonal). sinks (H,): a logit column of each row's softmax
    with no value. A row with no allowed key gives 0 (lse -inf, or the sink's logit).
    head_mask (H,) or (B, H) multiplies the probabilities after softmax; dropout_keep (bool,
    broadcasting to the probabilities) keeps entries, scaled by 1 / (1 - dropout_p).
    Returns out, then the weights (after head mask and dropout), lse and the scores (the
    softmax's input without the sink column: after the soft-cap, ALiBi and the masks, -inf where
    blocked) if asked for."""
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    H = q.shape[-3] if q.dim() >= 3 else 1
    Lq, D = q.shape[-2:]
    Lk = k.shape[-2]
    if q.dim() >= 3 and k.shape[-3] != H:
        k = k.repeat_interleave(H // k.shape[-3], dim=-3)
        v = v.repeat_interleave(H // v.shape[-3], dim=-3)
    s = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(D) if scale is None else scale)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        dist = (torch.arange(Lq)[:, None] + Lk - Lq - torch.arange(Lk)[None, :]).abs().to(dtype)
        s = s - _per_head(alibi_slopes, H, dtype) * dist
    if attn_mask is not None:
        s = s + _additive(attn_mask, dtype)
    if key_padding_mask is not None:
        kpm = _additive(key_padding_mask, dtype)
        s = s + kpm.view(kpm.shape[0], *([1] * (s.dim() - 2)), Lk)
    if is_causal or window is not None:
        s = s.masked_fill(band_blocked(Lq, Lk, is_causal=is_causal, window=window, diagonal=diagonal), NEG_INF)
    scores = s
    if sinks is not None:
        s = torch.cat([s, _per_head(sinks, H, dtype).expand(*s.shape[:-1], 1)], dim=-1)
    zero = torch.zeros((), dtype=dtype)
    empty = torch.isneginf(s).all(dim=-1, keepdim=True)
    p = torch.where(empty, zero, torch.softmax(torch.where(empty, zero, s), dim=-1))
    lse = torch.logsumexp(s, dim=-1)
    p = p[..., :Lk]
    if head_mask is not None:
        p = p * _per_head(head_mask, H, dtype)
    if dropout_keep is not None:
        p = p * dropout_keep.to(dtype) / (1 - dropout_p)
    out = torch.matmul(p, v)
    res = (out,) + ((p,) if return_weights else ()) + ((lse,) if return_lse else ())
    res += (scores,) if return_scores else ()
    return res[0] if len(res) == 1 else res


def q_int16(q, scale=None):
    """q as the 8-bit cache's integer scores read it (docs/design/16-kv-int8.md, "Decoding"), in
    float64: each row of scale * q, in float32, rounded to int16 steps of max |row| / Qm with
    Qm = min(32767, (2^31 - 1) // (128 D)), ties to even; then divided by the scale, so that
    attention64 with the same scale attends with those values. A row of zeros stays 0; a row
    with inf or NaN is NaN."""
    D = q.shape[-1]
    s32 = torch.tensor(1.0 / math.sqrt(D) if scale is None else scale, dtype=torch.float32)
    x = q.float() * s32
    fin = torch.isfinite(x).all(-1, keepdim=True)
    mx = x.abs().masked_fill(~torch.isfinite(x), 0).amax(-1, keepdim=True)
    qm = torch.full_like(mx, float(min(32767, (2**31 - 1) // (128 * D))))
    q16 = (x * (qm / mx)).round()  # (a float32 product, rounded half to even)
    out = q16.double() * (mx / qm).double()
    out = torch.where(mx == 0, torch.zeros_like(out), out)
    out = torch.where(fin, out, torch.full_like(out, math.nan))
    return out / s32.double()


def p_int16_bound(weights, vq, vs):
    """The most the 8-bit cache's integer P V (docs/design/16-kv-int8.md, "Decoding") adds to an
    output's error, per element, from the reference's own weights (B, H, Lq, Lk) (the
    probabilities that multiply v: head mask and sinks included) and the int8 values vq (B, Hkv,
    Lk, Dv) with their scales vs (B, Hkv, Lk): each key's p v_scale is rounded to a step of its run's
    largest over 32767, the largest of the whole row at most (a later step's rescaling divides
    both alike), so that |error| <= sum_c |vq[c, d]| max_c (p_c v_scale_c) / 65534; times 1.02 for
    the float32 roundings of p v_scale (32767 / m) and of m / 32767 (up to 0.506 of a step, not
    0.5) and the float32 probabilities it is taken from."""
    G = weights.shape[-3] // vq.shape[-3]
    w = weights.double().abs().nan_to_num(0) * vs.double().repeat_interleave(G, -2).unsqueeze(-2)
    top = w.amax(-1, keepdim=True)  # (B, H, Lq, 1)
    col = vq.double().abs().sum(-2).repeat_interleave(G, -2).unsqueeze(-2)  # (B, H, 1, Dv)
    return 1.02 * top * col / 65534


# ---- cross-entropy -------------------------------------------------------------------------


def cross_entropy64(
    x, target, *, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0, z_loss=0.0, softcap=None
):
    """torch_masked_attn's cross_entropy with plain PyTorch ops in x's dtype (pass float64 tensors
    for the reference): y = softcap * tanh(x / softcap); F.cross_entropy(y, reduction="none") +
    z_loss * logsumexp(y)^2 on the kept rows (class targets not ignore_index; every row with
    probability targets), then the reduction: "mean" divides by the kept rows' target weights (the
    number of rows with probability targets); with nothing to divide by it is NaN, and the
    gradient 0. Without z_loss, F.cross_entropy reduces itself (PyTorch's own error in a low
    precision dtype)."""
    y = softcap * torch.tanh(x / softcap) if softcap is not None else x
    prob = target.is_floating_point()
    kw = {"weight": weight, "label_smoothing": label_smoothing}
    if not prob:
        kw["ignore_index"] = ignore_index
    cdim = 0 if x.dim() == 1 else 1
    if prob:
        kept = torch.ones(y.shape[:cdim] + y.shape[cdim + 1 :], dtype=y.dtype)
    else:
        kept = (target != ignore_index).to(y.dtype)
    wt = kept if weight is None or prob else weight[target.clamp(0, x.shape[cdim] - 1)] * kept
    if reduction == "mean" and float(wt.sum()) == 0:
        return F.cross_entropy(y, target, reduction="sum", **kw) * 0 + math.nan
    if not z_loss:
        return F.cross_entropy(y, target, reduction=reduction, **kw)
    per = F.cross_entropy(y, target, reduction="none", **kw)
    per = per + z_loss * torch.logsumexp(y, dim=cdim) ** 2 * kept
    if reduction == "none":
        return per
    return per.sum() if reduction == "sum" else per.sum() / (kept.numel() if prob else wt.sum())
