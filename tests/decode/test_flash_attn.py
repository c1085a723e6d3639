"""torch_masked_attn.flash_attn: flash-attn 2.x's Python API on the CPU, against the float64
reference (tests/reference.py) given flash-attn's definitions (explicit masks per sequence,
bottom-right alignment, its kernels' window normalisation, ALiBi's bias; rotary embedding as
flash_attn.layers.rotary defines it), the same reference in the test dtype for PyTorch's own error
(flash-attn's rule: ours at most twice that, plus a small slack), gradients, the KV cache's
contents after an append, and every refusal."""

import math

import pytest
import torch

from reference import attention64
from torch_masked_attn.flash_attn import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

INF = float("inf")
SLACK = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


# ---- the reference -------------------------------------------------------------------------------


def fa_allowed(Lq, Lk, causal=False, window=(-1, -1), seqlen_k=None):
    """flash-attn 2's mask for one sequence, (Lq, Lk) bool, True = query i sees key j.

    Documented: query i sees keys [i + Lk - Lq - left, i + Lk - Lq + right], -1 unbounded; causal
    is right = 0. flash_api.cpp then normalises window_size: a bound >= seqlen_k becomes -1, causal
    sets right = 0, and with one bound set the other one, if unbounded, becomes seqlen_k
    (seqlen_k: Lk, max_seqlen_k for varlen, the cache's length for the KV cache)."""
    seqlen_k = Lk if seqlen_k is None else seqlen_k
    left, right = window
    if left < 0 or left >= seqlen_k:
        left = -1
    if right < 0 or right >= seqlen_k:
        right = -1
    if causal:
        right = 0
    if left >= 0 or right >= 0:
        left = seqlen_k if left < 0 else left
        right = seqlen_k if right < 0 else right
    rows = []
    for i in range(Lq):
        row = []
        for j in range(Lk):
            diag = i + Lk - Lq
            ok = True
            if left >= 0 and j < diag - left:
                ok = False
            if right >= 0 and j > diag + right:
                ok = False
            row.append(ok)
        rows.append(row)
    return torch.tensor(rows, dtype=torch.bool).view(Lq, Lk)


def ref_seq(q, k, v, allowed, *, scale=None, softcap=0.0, slopes=None, keep=None, p_drop=0.0, dtype=torch.float64):
    """One sequence through the reference (tests/reference.py) in `dtype`: q (Lq, H, D), k (Lk, Hk, D),
    v (Lk, Hk, Dv), allowed (Lq, Lk). Scores q.k * scale, softcap * tanh(s / softcap) if softcap > 0,
    ALiBi's -slope * |i + Lk - Lq - j| (slopes (H,)), the mask, softmax; keep (H, Lq, Lk) bool:
    dropout's kept entries, scaled by 1 / (1 - p_drop). Returns out (Lq, H, Dv), lse (H, Lq) in float64
    (+inf for a row that sees no key), probabilities (H, Lq, Lk) before dropout. Differentiable."""
    qh, kh, vh = (t.transpose(0, 1) for t in (q, k, v))
    kw = dict(scale=scale, attn_mask=~allowed, softcap=softcap if softcap > 0 else None, alibi_slopes=slopes)
    out, p, lse = attention64(qh, kh, vh, dtype=dtype, return_weights=True, return_lse=True, **kw)
    if keep is not None:
        out = attention64(qh, kh, vh, dtype=dtype, dropout_keep=keep, dropout_p=p_drop, **kw)
    lse = lse.double().masked_fill(~allowed.any(-1).view(1, -1), INF)
    return out.transpose(0, 1), lse, p


def ref_dense(q, k, v, causal=False, window=(-1, -1), *, dtype=torch.float64, seqlen_k=None, slopes=None, **kw):
    """flash_attn_func's reference: (B, L, H, D) inputs; out (B, Lq, H, Dv), lse (B, H, Lq)."""
    B, Lq, H, _ = q.shape
    allowed = fa_allowed(Lq, k.shape[1], causal, window, seqlen_k)
    outs, lses = [], []
    for b in range(B):
        sl = None if slopes is None else (slopes if slopes.dim() == 1 else slopes[b])
        o, lse, _ = ref_seq(q[b], k[b], v[b], allowed, slopes=sl, dtype=dtype, **kw)
        outs.append(o)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def ref_varlen(
    q, k, v, lens_q, lens_k, causal=False, window=(-1, -1), *, max_seqlen_k, slopes=None, dtype=torch.float64, **kw
):
    """flash_attn_varlen_func's reference: packed (T, H, D); out (T_q, H, Dv), lse (H, T_q)."""
    outs, lses, cq, ck = [], [], 0, 0
    for b, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        sl = None if slopes is None else (slopes if slopes.dim() == 1 else slopes[b])
        o, lse, _ = ref_seq(
            q[cq : cq + lq],
            k[ck : ck + lk],
            v[ck : ck + lk],
            fa_allowed(lq, lk, causal, window, max_seqlen_k),
            slopes=sl,
            dtype=dtype,
            **kw,
        )
        outs.append(o)
        lses.append(lse)
        cq, ck = cq + lq, ck + lk
    return torch.cat(outs), torch.cat(lses, -1)


def check(name, ours, ref, ref_lo=None, dtype=torch.float32, slack=None):
    """max|ours - ref| <= 2 max|ref_lo - ref| + slack * max(1, max|ref|); infinities exactly where
    the reference has them."""
    ours, ref = ours.detach().double(), ref.detach().double()
    assert ours.shape == ref.shape, f"{name}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    inf = torch.isinf(ref)
    assert torch.equal(torch.isinf(ours), inf), f"{name}: infinities differ"
    assert torch.equal(ours[inf], ref[inf]), f"{name}: infinities differ in sign"
    assert not ours.isnan().any(), f"{name}: NaN"
    fin = ~inf
    err = (ours[fin] - ref[fin]).abs().max().item() if fin.any() else 0.0
    err_lo = 0.0 if ref_lo is None else (ref_lo.detach().double()[fin] - ref[fin]).abs().max().item()
    top = max(1.0, ref[fin].abs().max().item() if fin.any() else 1.0)
    bound = 2 * err_lo + (SLACK[dtype] if slack is None else slack) * top
    assert err <= bound, f"{name}: error {err:.3g} > {bound:.3g}"


def cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def rnd(*shape, dtype=torch.float32, grad=False):
    return torch.randn(*shape).to(dtype).requires_grad_(grad)


# ---- flash_attn_func ---------------------------------------------------------------------------------

# (Lq, Lk, H, Hk, causal, window, softcap, scale)
DENSE_CASES = [
    (40, 40, 4, 4, False, (-1, -1), 0.0, None),
    (40, 40, 4, 4, True, (-1, -1), 0.0, None),
    (17, 70, 4, 2, True, (-1, -1), 0.0, None),  # Lq < Lk: bottom-right causal
    (70, 17, 4, 2, True, (-1, -1), 0.0, None),  # Lq > Lk: the first 53 rows see nothing
    (20, 50, 4, 4, False, (8, -1), 0.0, None),  # left only
    (33, 33, 4, 1, False, (-1, 5), 0.0, None),  # right only, MQA
    (30, 20, 6, 2, False, (6, 3), 0.0, None),  # both, Lq > Lk (a mask in our path)
    (10, 40, 4, 4, True, (3, -1), 0.0, None),  # causal + left, window shifted past the diagonal
    (45, 45, 4, 2, True, (-1, -1), 5.0, None),  # softcap
    (25, 31, 4, 2, False, (-1, -1), 0.0, 0.3),  # softmax_scale
    (1, 50, 8, 2, True, (-1, -1), 0.0, None),  # decode step, GQA
    (24, 24, 4, 4, False, (-1, 0), 2.0, 0.2),  # window (-1, 0) = causal, softcap, scale
]


@pytest.mark.parametrize("Lq,Lk,H,Hk,causal,window,softcap,scale", DENSE_CASES)
def test_func_matches_reference(Lq, Lk, H, Hk, causal, window, softcap, scale):
    B, D = 2, 32
    q, k, v = rnd(B, Lq, H, D), rnd(B, Lk, Hk, D), rnd(B, Lk, Hk, D)
    out = flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap, softmax_scale=scale)
    out2, lse, S = flash_attn_func(q, k, v, 0.0, scale, causal, window, softcap, None, False, True)
    ref, ref_lse = ref_dense(q, k, v, causal, window, scale=scale, softcap=softcap)
    check("out", out, ref)
    assert torch.equal(out, out2)
    assert out.shape == (B, Lq, H, D) and out.is_contiguous()
    assert lse.shape == (B, H, Lq) and lse.dtype == torch.float32
    check("lse", lse, ref_lse, slack=1e-5)
    assert S.shape == (0,) and S.dtype == q.dtype  # flash-attn: empty unless dropout_p > 0
    if causal and Lq > Lk:
        assert torch.all(out[:, : Lq - Lk] == 0) and torch.all(lse[:, :, : Lq - Lk] == INF)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_func_dtypes(dtype):
    B, Lq, Lk, H, Hk, D = 2, 37, 61, 6, 2, 64
    q, k, v = rnd(B, Lq, H, D, dtype=dtype), rnd(B, Lk, Hk, D, dtype=dtype), rnd(B, Lk, Hk, D, dtype=dtype)
    for causal, window, cap in ((True, (-1, -1), 0.0), (False, (9, 4), 0.0), (True, (-1, -1), 3.0)):
        out, lse, _ = flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=cap, return_attn_probs=True)
        assert out.dtype == dtype
        ref, ref_lse = ref_dense(q, k, v, causal, window, softcap=cap)
        ref_lo, _ = ref_dense(q, k, v, causal, window, softcap=cap, dtype=dtype)
        check(f"out {dtype}", out, ref, ref_lo, dtype=dtype)
        check(f"lse {dtype}", lse, ref_lse, slack=1e-9 if dtype == torch.float64 else 1e-4)


def test_func_window_normalisation_as_flash_attn_kernels():
    """Lq > Lk: flash-attn's kernels, not only its docstring (flash_api.cpp's normalisation)."""
    B, Lq, Lk, H, D = 1, 6, 2, 2, 16
    q, k, v = rnd(B, Lq, H, D), rnd(B, Lk, H, D), rnd(B, Lk, H, D)
    # window (1, -1): the right bound becomes seqlen_k = 2: query i sees [i - 5, i - 2]
    expected = torch.tensor([[0, 0], [0, 0], [1, 0], [1, 1], [1, 1], [1, 1]], dtype=torch.bool)
    assert torch.equal(fa_allowed(Lq, Lk, False, (1, -1)), expected)
    # window (-1, 2): 2 >= seqlen_k, so unbounded: every query sees every key
    assert fa_allowed(Lq, Lk, False, (-1, 2)).all()
    for window, allowed in (((1, -1), expected), ((-1, 2), torch.ones(Lq, Lk, dtype=torch.bool))):
        out, lse, _ = flash_attn_func(q, k, v, window_size=window, return_attn_probs=True)
        ref, ref_lse, _ = ref_seq(q[0], k[0], v[0], allowed)
        check(f"out {window}", out[0], ref)
        check(f"lse {window}", lse[0], ref_lse, slack=1e-5)


@pytest.mark.parametrize("shape", ["H", "BH"])
def test_func_alibi(shape):
    B, H, Hk, D = 2, 4, 2, 32
    slopes = torch.rand(H) * 0.5 if shape == "H" else torch.rand(B, H) * 0.5
    for Lq, Lk, causal, window in (
        (20, 44, True, (-1, -1)),
        (30, 30, False, (-1, -1)),
        (40, 25, False, (7, 2)),
        (16, 48, True, (10, -1)),
    ):
        q, k, v = rnd(B, Lq, H, D), rnd(B, Lk, Hk, D), rnd(B, Lk, Hk, D)
        out, lse, _ = flash_attn_func(
            q, k, v, causal=causal, window_size=window, alibi_slopes=slopes, return_attn_probs=True
        )
        ref, ref_lse = ref_dense(q, k, v, causal, window, slopes=slopes)
        check(f"alibi out {Lq, Lk, causal, window}", out, ref)
        check(f"alibi lse {Lq, Lk, causal, window}", lse, ref_lse, slack=1e-5)


def test_func_dropout():
    B, Lq, Lk, H, Hk, D, p = 2, 50, 70, 4, 2, 32, 0.3
    q, k, v = rnd(B, Lq, H, D, grad=True), rnd(B, Lk, Hk, D, grad=True), rnd(B, Lk, Hk, D, grad=True)
    torch.manual_seed(7)
    out, lse, S = flash_attn_func(q, k, v, dropout_p=p, causal=True, return_attn_probs=True)
    torch.manual_seed(7)
    again = flash_attn_func(q, k, v, dropout_p=p, causal=True)
    assert torch.equal(out, again)  # torch.manual_seed reproduces the mask
    assert S.shape == (B, H, 128, 128) and S.dtype == q.dtype
    assert torch.all(S[:, :, Lq:] == 0) and torch.all(S[:, :, :, Lk:] == 0)
    S = S[:, :, :Lq, :Lk]
    allowed = fa_allowed(Lq, Lk, True)
    keep = S >= 0
    dropped = (~keep & allowed).sum().item() / (allowed.sum().item() * B * H)
    assert 0.25 < dropped < 0.35
    w = torch.randn(out.shape)
    ref_lse = []
    for b in range(B):
        o, lse_b, probs = ref_seq(q[b].double(), k[b].double(), v[b].double(), allowed, keep=keep[b], p_drop=p)
        check("|S_dmask| = probabilities", S[b].abs(), probs)
        check("out with S_dmask's dropout pattern", out[b], o)
        (o * w[b]).sum().backward()
        ref_lse.append(lse_b)
    check("lse (before dropout)", lse, torch.stack(ref_lse), slack=1e-5)
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    (out * w).sum().backward()
    for name, t, g in zip("qkv", (q, k, v), grads):
        check(f"d{name} with dropout", t.grad, g)


@pytest.mark.parametrize(
    "Lq,Lk,causal,window,cap,alibi",
    [
        (33, 47, True, (-1, -1), 0.0, False),
        (40, 20, True, (-1, -1), 0.0, False),  # rows that see no key: zero gradients
        (30, 30, False, (5, 3), 4.0, False),
        (24, 36, True, (-1, -1), 0.0, True),
    ],
)
def test_func_gradients(Lq, Lk, causal, window, cap, alibi):
    B, H, Hk, D = 2, 4, 2, 16
    q, k, v = rnd(B, Lq, H, D, grad=True), rnd(B, Lk, Hk, D, grad=True), rnd(B, Lk, Hk, D, grad=True)
    slopes = torch.rand(H) * 0.3 if alibi else None
    out = flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=cap, alibi_slopes=slopes)
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = ref_dense(q64, k64, v64, causal, window, softcap=cap, slopes=slopes)
    rq, rk, rv = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    for name, ours, r in (("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
        check(name, ours, r, slack=5e-5)
    if causal and Lq > Lk:
        assert torch.all(dq[:, : Lq - Lk] == 0)


def test_packed_variants():
    B, L, H, Hk, D = 2, 30, 4, 2, 16
    qkv = rnd(B, L, 3, H, D, grad=True)
    out, lse, _ = flash_attn_qkvpacked_func(qkv, causal=True, return_attn_probs=True)
    q, k, v = (qkv[:, :, i].detach().clone().requires_grad_() for i in range(3))
    ref = flash_attn_func(q, k, v, causal=True)
    assert torch.equal(out, ref)
    out.sum().backward()
    ref.sum().backward()
    assert torch.equal(qkv.grad, torch.stack([q.grad, k.grad, v.grad], 2))
    q = rnd(B, L, H, D)
    kv = rnd(B, L + 5, 2, Hk, D)
    assert torch.equal(
        flash_attn_kvpacked_func(q, kv, window_size=(4, 4)),
        flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], window_size=(4, 4)),
    )
    lens = [5, 0, 12]
    cus = cu(lens)
    qkv_p = rnd(sum(lens), 3, H, D)
    assert torch.equal(
        flash_attn_varlen_qkvpacked_func(qkv_p, cus, 12, causal=True),
        flash_attn_varlen_func(qkv_p[:, 0], qkv_p[:, 1], qkv_p[:, 2], cus, cus, 12, 12, causal=True),
    )
    kv_p = rnd(20, 2, Hk, D)
    cuk = cu([8, 4, 8])
    assert torch.equal(
        flash_attn_varlen_kvpacked_func(qkv_p[:, 0], kv_p, cus, cuk, 12, 8, softcap=2.0),
        flash_attn_varlen_func(qkv_p[:, 0], kv_p[:, 0], kv_p[:, 1], cus, cuk, 12, 8, softcap=2.0),
    )


# ---- flash_attn_varlen_func --------------------------------------------------------------------------

LENS_Q = [7, 0, 20, 33, 5, 1]
LENS_K = [7, 9, 0, 18, 40, 64]  # an empty query sequence, an empty key one, Lq > Lk, Lq < Lk


@pytest.mark.parametrize(
    "causal,window,cap,scale,Hk",
    [
        (False, (-1, -1), 0.0, None, 4),
        (True, (-1, -1), 0.0, None, 2),
        (False, (6, -1), 0.0, None, 1),
        (False, (-1, 3), 0.0, 0.25, 2),
        (True, (10, -1), 3.0, None, 4),
        (False, (4, 2), 0.0, None, 2),
    ],
)
def test_varlen_matches_reference(causal, window, cap, scale, Hk):
    H, D = 4, 32
    q, k, v = rnd(sum(LENS_Q), H, D), rnd(sum(LENS_K), Hk, D), rnd(sum(LENS_K), Hk, D)
    out, lse, S = flash_attn_varlen_func(
        q,
        k,
        v,
        cu(LENS_Q),
        cu(LENS_K),
        max(LENS_Q),
        max(LENS_K),
        0.0,
        scale,
        causal,
        window,
        cap,
        return_attn_probs=True,
    )
    ref, ref_lse = ref_varlen(
        q, k, v, LENS_Q, LENS_K, causal, window, max_seqlen_k=max(LENS_K), scale=scale, softcap=cap
    )
    check("out", out, ref)
    assert lse.shape == (H, sum(LENS_Q))
    check("lse", lse, ref_lse, slack=1e-5)
    assert S.shape == (0,)
    # sequence 1 has queries and no key... here LENS_Q[2] = 20 queries over 0 keys: zeros, +inf
    r = slice(sum(LENS_Q[:2]), sum(LENS_Q[:3]))
    assert torch.all(out[r] == 0) and torch.all(lse[:, r] == INF)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen_low_precision(dtype):
    H, Hk, D = 4, 2, 64
    q, k, v = (rnd(sum(n), h, D, dtype=dtype) for n, h in ((LENS_Q, H), (LENS_K, Hk), (LENS_K, Hk)))
    out = flash_attn_varlen_func(q, k, v, cu(LENS_Q), cu(LENS_K), max(LENS_Q), max(LENS_K), causal=True)
    ref, _ = ref_varlen(q, k, v, LENS_Q, LENS_K, True, max_seqlen_k=max(LENS_K))
    ref_lo, _ = ref_varlen(q, k, v, LENS_Q, LENS_K, True, max_seqlen_k=max(LENS_K), dtype=dtype)
    check(f"out {dtype}", out, ref, ref_lo, dtype=dtype)


def test_varlen_window_normalised_by_max_seqlen_k():
    """flash-attn normalises window_size against max_seqlen_k, not each sequence's length."""
    lq, lk, H, D = [9, 3], [3, 4], 2, 16
    q, k, v = rnd(12, H, D), rnd(7, H, D), rnd(7, H, D)
    for window, max_k in (((2, -1), 4), ((2, -1), 20), ((-1, 4), 9), ((-1, 4), 4)):
        out, lse, _ = flash_attn_varlen_func(
            q, k, v, cu(lq), cu(lk), 9, max_k, window_size=window, return_attn_probs=True
        )
        ref, ref_lse = ref_varlen(q, k, v, lq, lk, False, window, max_seqlen_k=max_k)
        check(f"out {window} {max_k}", out, ref)
        check(f"lse {window} {max_k}", lse, ref_lse, slack=1e-5)


@pytest.mark.parametrize("mode", ["alibi", "alibi_bh", "dropout"])
def test_varlen_padded_paths(mode):
    """Dropout and ALiBi: the batch padded and run by the dense kernels."""
    H, Hk, D = 4, 2, 32
    q, k, v = rnd(sum(LENS_Q), H, D, grad=True), rnd(sum(LENS_K), Hk, D, grad=True), rnd(sum(LENS_K), Hk, D, grad=True)
    N = len(LENS_Q)
    slopes = {"alibi": torch.rand(H) * 0.4, "alibi_bh": torch.rand(N, H) * 0.4, "dropout": None}[mode]
    p = 0.25 if mode == "dropout" else 0.0
    for causal, window in ((True, (-1, -1)), (False, (5, 2))):
        out, lse, S = flash_attn_varlen_func(
            q, k, v, cu(LENS_Q), cu(LENS_K), 40, 70, p, None, causal, window, 0.0, slopes, False, True
        )
        assert out.shape == (sum(LENS_Q), H, D) and lse.shape == (H, sum(LENS_Q))
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        if mode == "dropout":
            assert S.shape == (N, H, 128, 128)
            outs, lses, cq, ck = [], [], 0, 0
            for b, (lq, lk) in enumerate(zip(LENS_Q, LENS_K)):
                allowed = fa_allowed(lq, lk, causal, window, 70)
                Sb = S[b, :, :lq, :lk]
                assert torch.all(S[b, :, lq:] == 0) and torch.all(S[b, :, :, lk:] == 0)
                o, lse_b, probs = ref_seq(
                    q64[cq : cq + lq], k64[ck : ck + lk], v64[ck : ck + lk], allowed, keep=Sb >= 0, p_drop=p
                )
                check("|S_dmask|", Sb.abs(), probs)
                outs.append(o)
                lses.append(lse_b)
                cq, ck = cq + lq, ck + lk
            ref, ref_lse = torch.cat(outs), torch.cat(lses, -1)
        else:
            assert S.shape == (0,)
            ref, ref_lse = ref_varlen(q64, k64, v64, LENS_Q, LENS_K, causal, window, max_seqlen_k=70, slopes=slopes)
        check(f"{mode} out", out, ref)
        check(f"{mode} lse", lse, ref_lse, slack=1e-5)
        for name, g, r in zip(("dq", "dk", "dv"), grads, torch.autograd.grad(ref, (q64, k64, v64), dout.double())):
            check(f"{mode} {name}", g, r, slack=5e-5)


def test_varlen_gradients():
    H, Hk, D = 4, 2, 16
    q, k, v = rnd(sum(LENS_Q), H, D, grad=True), rnd(sum(LENS_K), Hk, D, grad=True), rnd(sum(LENS_K), Hk, D, grad=True)
    for causal, window, cap in ((True, (-1, -1), 0.0), (False, (3, 6), 2.5)):
        out = flash_attn_varlen_func(
            q, k, v, cu(LENS_Q), cu(LENS_K), 33, 64, causal=causal, window_size=window, softcap=cap
        )
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref, _ = ref_varlen(q64, k64, v64, LENS_Q, LENS_K, causal, window, max_seqlen_k=64, softcap=cap)
        for name, g, r in zip(("dq", "dk", "dv"), grads, torch.autograd.grad(ref, (q64, k64, v64), dout.double())):
            check(f"varlen {name}", g, r, slack=5e-5)


@pytest.mark.parametrize("page", [64, 16])
def test_varlen_block_table(page):
    H, Hk, D = 4, 2, 32
    lens_q, lens_k = [3, 1, 0, 9], [70, 5, 10, 130]
    n_cols = max((n + page - 1) // page for n in lens_k)
    pool = 40
    k_pages, v_pages = rnd(pool, page, Hk, D), rnd(pool, page, Hk, D)
    perm = torch.randperm(pool)[: len(lens_k) * n_cols].view(len(lens_k), n_cols).to(torch.int32)
    q = rnd(sum(lens_q), H, D)
    # the same keys, packed: sequence b's key j is row j % page of page perm[b, j // page]
    k_packed = torch.cat([k_pages[perm[b].long()].flatten(0, 1)[:n] for b, n in enumerate(lens_k)])
    v_packed = torch.cat([v_pages[perm[b].long()].flatten(0, 1)[:n] for b, n in enumerate(lens_k)])
    for causal, window, slopes in ((True, (-1, -1), None), (False, (20, 4), None), (True, (-1, -1), torch.rand(H))):
        out, lse, _ = flash_attn_varlen_func(
            q,
            k_pages,
            v_pages,
            cu(lens_q),
            cu(lens_k),
            9,
            130,
            causal=causal,
            window_size=window,
            alibi_slopes=slopes,
            return_attn_probs=True,
            block_table=perm,
        )
        ref, ref_lse = ref_varlen(
            q, k_packed, v_packed, lens_q, lens_k, causal, window, max_seqlen_k=130, slopes=slopes
        )
        check(f"paged out {page}", out, ref)
        check(f"paged lse {page}", lse, ref_lse, slack=1e-5)


def test_varlen_rows_outside_cu_seqlens():
    """cu_seqlens need not start at 0 nor end at the last row (as in flash-attn): rows outside are
    not read, and their output is 0 (flash-attn leaves them unwritten)."""
    H, D = 2, 16
    q, k, v = rnd(30, H, D), rnd(30, H, D), rnd(30, H, D)
    cq = torch.tensor([4, 10, 20], dtype=torch.int32)
    ck = torch.tensor([2, 12, 25], dtype=torch.int32)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cq, ck, 10, 13, causal=True, return_attn_probs=True)
    ref, ref_lse = ref_varlen(q[4:20], k[2:25], v[2:25], [6, 10], [10, 13], True, max_seqlen_k=13)
    check("inside", out[4:20], ref)
    check("inside lse", lse[:, 4:20], ref_lse, slack=1e-5)
    assert torch.all(out[:4] == 0) and torch.all(out[20:] == 0)


# ---- flash_attn_with_kvcache -------------------------------------------------------------------------


def rotary_ref(x, cos, sin, pos, interleaved):
    """flash_attn.layers.rotary.apply_rotary_emb_torch at positions pos (B, L): x * cos + rotate_half(x) * sin
    on the first rotary_dim dims."""
    rd = cos.shape[1] * 2
    c, s = cos[pos].double(), sin[pos].double()  # (B, L, rd / 2)
    if interleaved:
        c, s = c.repeat_interleave(2, -1), s.repeat_interleave(2, -1)
    else:
        c, s = torch.cat((c, c), -1), torch.cat((s, s), -1)
    c, s = c.unsqueeze(2), s.unsqueeze(2)
    xr = x[..., :rd].double()
    if interleaved:
        rot = torch.stack((-xr[..., 1::2], xr[..., 0::2]), -1).flatten(-2)
    else:
        rot = torch.cat((-xr[..., rd // 2 :], xr[..., : rd // 2]), -1)
    return torch.cat(((xr * c + rot * s).to(x.dtype), x[..., rd:]), -1)


KV_CASES = [
    # name, Lq, Lnew, causal, window, paged page size, batch_idx, leftpad, rotary (dim, interleaved), alibi
    ("decode", 1, 1, True, (-1, -1), None, False, False, None, False),
    ("no new kv", 3, 0, True, (-1, -1), None, False, False, None, False),
    ("prefill chunk", 5, 5, True, (-1, -1), None, False, False, None, False),
    ("non-causal, Lq > Lnew", 4, 2, False, (-1, -1), None, False, False, None, False),
    ("local", 4, 4, False, (6, 0), None, False, False, None, False),
    ("batch idx", 2, 2, True, (-1, -1), None, True, False, None, False),
    ("leftpad", 3, 3, True, (-1, -1), None, False, True, None, False),
    ("leftpad + batch idx", 2, 2, True, (5, -1), None, True, True, None, False),
    ("paged 64", 3, 3, True, (-1, -1), 64, False, False, None, False),
    ("paged 16", 2, 2, False, (-1, -1), 16, False, False, None, False),
    ("rotary interleaved", 3, 3, True, (-1, -1), None, False, False, (16, True), False),
    ("rotary halves, non-causal", 3, 3, False, (-1, -1), None, False, False, (8, False), False),
    ("rotary paged", 2, 2, True, (-1, -1), 16, False, False, (32, False), False),
    ("rotary local", 3, 3, False, (5, 2), None, False, False, (16, True), False),  # positions as causal
    ("alibi", 3, 3, True, (-1, -1), None, False, True, None, True),
    ("alibi paged", 2, 1, False, (-1, -1), 64, False, False, None, True),
    ("alibi batch idx", 2, 2, True, (-1, -1), None, True, False, None, True),
]


@pytest.mark.parametrize(
    "name,Lq,Lnew,causal,window,page,batch_idx,leftpad,rotary,alibi", KV_CASES, ids=[c[0] for c in KV_CASES]
)
def test_kvcache(name, Lq, Lnew, causal, window, page, batch_idx, leftpad, rotary, alibi):
    B, H, Hk, D, L = 3, 4, 2, 32, 80
    B_c = 5 if batch_idx else B
    q = rnd(B, Lq, H, D)
    k_new, v_new = (rnd(B, Lnew, Hk, D), rnd(B, Lnew, Hk, D)) if Lnew else (None, None)
    seqlens = torch.tensor([10, 0, L - 8], dtype=torch.int32)
    seqlens = seqlens.clamp(max=L - Lnew)
    idx = torch.tensor([3, 0, 4], dtype=torch.int32) if batch_idx else None
    pad = torch.tensor([4, 0, 30], dtype=torch.int32).minimum(seqlens) if leftpad else None
    if page is None:
        k_cache, v_cache = rnd(B_c, L, Hk, D), rnd(B_c, L, Hk, D)
        table = None
        seqlen_k = L
        # each entry's cache rows, as (B, L, Hk, D), before the append
        rows_k = lambda kc: kc[idx.long()] if batch_idx else kc[:B]  # noqa: E731
    else:
        cols = (L + page - 1) // page
        pool = B * cols + 3
        k_cache, v_cache = rnd(pool, page, Hk, D), rnd(pool, page, Hk, D)
        table = torch.randperm(pool)[: B * cols].view(B, cols).to(torch.int32)
        seqlen_k = cols * page
        rows_k = lambda kc: kc[table.long()].flatten(1, 2)  # noqa: E731
    cos = sin = None
    if rotary:
        angle = torch.rand(seqlen_k, rotary[0] // 2) * 2 * math.pi
        cos, sin = angle.cos(), angle.sin()
    slopes = torch.rand(B, H) * 0.3 if alibi else None
    k_before, v_before = k_cache.clone(), v_cache.clone()

    out, lse = flash_attn_with_kvcache(
        q,
        k_cache,
        v_cache,
        k_new,
        v_new,
        cos,
        sin,
        seqlens,
        idx,
        pad,
        table,
        causal=causal,
        window_size=window,
        rotary_interleaved=bool(rotary and rotary[1]),
        alibi_slopes=slopes,
        return_softmax_lse=True,
    )
    assert out.shape == (B, Lq, H, D) and lse.shape == (B, H, Lq) and not out.requires_grad

    # the expected cache: new rows (rotated) at cache_seqlens[b] + t, written here by indexing
    k_rot, q_rot = k_new, q
    if rotary:
        pos_k = seqlens.long().view(-1, 1) + torch.arange(Lnew)
        local = causal or window != (-1, -1)
        pos_q = seqlens.long().view(-1, 1) + (torch.arange(Lq) if local else torch.zeros(Lq, dtype=torch.long))
        k_rot = rotary_ref(k_new, cos, sin, pos_k, rotary[1])
        q_rot = rotary_ref(q, cos, sin, pos_q, rotary[1])
    k_exp, v_exp = k_before.clone(), v_before.clone()
    for b in range(B):
        for t in range(Lnew):
            pos = int(seqlens[b]) + t
            if page is None:
                r = int(idx[b]) if batch_idx else b
                k_exp[r, pos], v_exp[r, pos] = k_rot[b, t], v_new[b, t]
            else:
                pg = int(table[b, pos // page])
                k_exp[pg, pos % page], v_exp[pg, pos % page] = k_rot[b, t], v_new[b, t]
    check("k_cache after the append", k_cache, k_exp, slack=1e-6)
    assert torch.equal(v_cache, v_exp)

    ks, vs = rows_k(k_exp), rows_k(v_exp)
    for b in range(B):
        start = 0 if pad is None else int(pad[b])
        stop = int(seqlens[b]) + Lnew
        allowed = fa_allowed(Lq, stop - start, causal, window, seqlen_k)
        ref, ref_lse, _ = ref_seq(
            q_rot[b], ks[b, start:stop], vs[b, start:stop], allowed, slopes=None if slopes is None else slopes[b]
        )
        check(f"{name} out[{b}]", out[b], ref)
        check(f"{name} lse[{b}]", lse[b], ref_lse, slack=1e-5)


def test_kvcache_whole_cache_and_int_seqlens():
    """cache_seqlens None: every row of the cache; an int: the same length for every entry."""
    B, Lq, H, D, L = 2, 2, 2, 16, 24
    q, kc, vc = rnd(B, Lq, H, D), rnd(B, L, H, D), rnd(B, L, H, D)
    out = flash_attn_with_kvcache(q, kc, vc, causal=True)
    ref, _ = ref_dense(q, kc, vc, True)
    check("whole cache", out, ref)
    out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=9)
    ref, _ = ref_dense(q, kc[:, :9], vc[:, :9])
    check("int cache_seqlens", out, ref)


def test_kvcache_strided_cache():
    """A cache whose rows do not view flat (a slice of a longer one): read, and written, in place."""
    B, Lq, H, D = 2, 1, 2, 16
    big_k, big_v = rnd(B, 100, H, D), rnd(B, 100, H, D)
    kc, vc = big_k[:, :40], big_v[:, :40]
    k_new, v_new = rnd(B, 1, H, D), rnd(B, 1, H, D)
    q = rnd(B, Lq, H, D)
    seqlens = torch.tensor([5, 39], dtype=torch.int32)
    out = flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=seqlens, causal=True)
    for b in range(B):
        assert torch.equal(big_k[b, int(seqlens[b])], k_new[b, 0])
        assert torch.equal(big_v[b, int(seqlens[b])], v_new[b, 0])
        n = int(seqlens[b]) + 1
        ref, _, _ = ref_seq(q[b], big_k[b, :n], big_v[b, :n], fa_allowed(Lq, n, True))
        check("strided cache", out[b], ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kvcache_low_precision(dtype):
    B, Lq, H, Hk, D, L = 2, 4, 4, 1, 64, 128
    q, kc, vc = rnd(B, Lq, H, D, dtype=dtype), rnd(B, L, Hk, D, dtype=dtype), rnd(B, L, Hk, D, dtype=dtype)
    kn, vn = rnd(B, Lq, Hk, D, dtype=dtype), rnd(B, Lq, Hk, D, dtype=dtype)
    seqlens = torch.tensor([50, 100], dtype=torch.int32)
    out = flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens, causal=True)
    for b in range(B):
        n = int(seqlens[b]) + Lq
        assert torch.equal(kc[b, n - Lq : n], kn[b])
        allowed = fa_allowed(Lq, n, True)
        ref, _, _ = ref_seq(q[b], kc[b, :n], vc[b, :n], allowed)
        ref_lo, _, _ = ref_seq(q[b], kc[b, :n], vc[b, :n], allowed, dtype=dtype)
        check(f"kvcache {dtype}", out[b], ref, ref_lo, dtype=dtype)


# ---- refusals ----------------------------------------------------------------------------------------


def _refusals():
    q, k, v = rnd(2, 8, 4, 16), rnd(2, 8, 2, 16), rnd(2, 8, 2, 16)
    qp, kp = rnd(8, 4, 16), rnd(8, 2, 16)
    c = cu([3, 5])
    kc, vc = rnd(2, 32, 2, 16), rnd(2, 32, 2, 16)
    pages = rnd(4, 16, 2, 16)
    bt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    s = torch.tensor([3, 4], dtype=torch.int32)
    cos = torch.ones(32, 4)
    f, fv, fk = flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
    return [
        # flash_attn_func
        (lambda: f(q[0], k, v), ValueError, "q must be 4-D"),
        (lambda: f(q, k[..., :8], v), ValueError, "k must have q's batch size and head dim"),
        (lambda: f(q, k, v[:, :5]), ValueError, "v must have k's batch size"),
        (lambda: f(q, rnd(2, 8, 3, 16), rnd(2, 8, 3, 16)), ValueError, "heads of q .4. must be a multiple"),
        (lambda: f(q.int(), k, v), TypeError, "q must be float16"),
        (lambda: f(q, k.double(), v), TypeError, "k must have q's dtype"),
        (lambda: f(q, k, v, dropout_p=1.0), ValueError, "dropout_p must be in"),
        (lambda: f(q, k, v, dropout_p="x"), TypeError, "dropout_p"),
        (lambda: f(q, k, v, window_size=(3,)), TypeError, "window_size"),
        (lambda: f(q, k, v, window_size=(1.5, 2)), TypeError, "window_size"),
        (lambda: f(q, k, v, softcap=float("inf")), ValueError, "softcap"),
        (lambda: f(q, k, v, softmax_scale="a"), TypeError, "softmax_scale"),
        (lambda: f(q, k, v, alibi_slopes=torch.ones(3)), ValueError, "alibi_slopes must have shape"),
        (lambda: f(q, k, v, alibi_slopes=torch.ones(4, dtype=torch.int32)), TypeError, "alibi_slopes"),
        (lambda: f(q.to("meta"), k.to("meta"), v.to("meta")), ValueError, "q is on meta"),
        (lambda: flash_attn_qkvpacked_func(q), ValueError, "qkv must be a 5-D"),
        (lambda: flash_attn_kvpacked_func(q, k), ValueError, "kv must be a 5-D"),
        # flash_attn_varlen_func
        (lambda: fv(q, kp, kp, c, c, 5, 5), ValueError, "q must be 3-D"),
        (lambda: fv(qp, kp, kp, c.float(), c, 5, 5), TypeError, "cu_seqlens_q must be an integer"),
        (
            lambda: fv(qp, kp, kp, torch.tensor([0, 5, 3], dtype=torch.int32), c, 5, 5),
            ValueError,
            "cu_seqlens_q must be nondecreasing",
        ),
        (
            lambda: fv(qp, kp, kp, c, torch.tensor([0, 3, 9], dtype=torch.int32), 5, 5),
            ValueError,
            "cu_seqlens_k must lie in",
        ),
        (lambda: fv(qp, kp, kp, c, cu([8]), 5, 8), ValueError, "cu_seqlens_k must have as many entries"),
        (lambda: fv(qp, kp, kp, c, c, 4, 5), ValueError, "max_seqlen_q .4. is less"),
        (lambda: fv(qp, kp, kp, c, c, 5, 4), ValueError, "max_seqlen_k .4. is less"),
        (lambda: fv(qp, rnd(8, 3, 16), rnd(8, 3, 16), c, c, 5, 5), ValueError, "heads of q"),
        (lambda: fv(qp, kp, kp, c, c, 5, 5, alibi_slopes=torch.ones(3, 4)), ValueError, "alibi_slopes"),
        (lambda: fv(qp, kp, kp, c, c, 5, 5, block_table=bt), ValueError, "k must be 4-D"),
        (lambda: fv(qp, pages, pages, c, c, 5, 5, block_table=bt[:1]), ValueError, "block_table must have"),
        (lambda: fv(qp, pages, pages, c, cu([3, 40]), 5, 40, block_table=bt), ValueError, "block_table addresses"),
        (lambda: fv(qp, pages, pages, c, c, 5, 5, block_table=bt + 3), ValueError, "block_table holds a page"),
        (
            lambda: fv(qp.requires_grad_(), pages, pages, c, c, 5, 5, block_table=bt),
            RuntimeError,
            "block_table .* inference-only",
        ),
        (lambda: flash_attn_varlen_qkvpacked_func(qp, c, 5), ValueError, "qkv must be a 4-D"),
        (lambda: flash_attn_varlen_kvpacked_func(qp, kp, c, c, 5, 5), ValueError, "kv must be a 4-D"),
        # flash_attn_with_kvcache
        (lambda: fk(q, kc[0], vc), ValueError, "k_cache must be 4-D"),
        (lambda: fk(q, kc, vc.half()), TypeError, "v_cache must have q's dtype"),
        (lambda: fk(q, kc[..., :8], vc), ValueError, "k_cache must have q's head dim"),
        (lambda: fk(q, rnd(2, 32, 3, 16), rnd(2, 32, 3, 16)), ValueError, "heads of q"),
        (lambda: fk(q, kc, vc, k[:, :1], None, cache_seqlens=s), ValueError, "v is None"),
        (lambda: fk(q, kc, vc, k[:, :1], v[:, :1]), ValueError, "cache_seqlens is required"),
        (lambda: fk(q, kc, vc, k[:, :1, :1], v[:, :1], cache_seqlens=s), ValueError, "k must have shape"),
        (
            lambda: fk(q, kc, vc, k[:, :1], v[:, :1], cache_seqlens=torch.tensor([31, 32])),
            ValueError,
            "cache_seqlens .* must lie in",
        ),
        (lambda: fk(q, kc, vc, cache_seqlens=s[:1]), ValueError, "cache_seqlens must have batch_size"),
        (lambda: fk(q, kc, vc, cache_seqlens=s.float()), TypeError, "cache_seqlens must be an integer"),
        (lambda: fk(q, kc[:1], vc[:1], cache_seqlens=s), ValueError, "pass cache_batch_idx"),
        (
            lambda: fk(q, kc, vc, cache_seqlens=s, cache_batch_idx=torch.tensor([0, 2])),
            ValueError,
            "cache_batch_idx must index",
        ),
        (
            lambda: fk(q, kc, vc, cache_seqlens=s, cache_leftpad=torch.tensor([0, 5])),
            ValueError,
            "cache_leftpad must lie in",
        ),
        (
            lambda: fk(q, pages, pages, cache_seqlens=s, block_table=bt, cache_batch_idx=torch.tensor([0, 1])),
            ValueError,
            "cache_batch_idx is not supported with block_table",
        ),
        (
            lambda: fk(q, pages, pages, cache_seqlens=s, block_table=bt, cache_leftpad=torch.tensor([0, 1])),
            ValueError,
            "cache_leftpad is not supported with block_table",
        ),
        (lambda: fk(q, pages, pages, cache_seqlens=s, block_table=bt[:1]), ValueError, "block_table must have"),
        (lambda: fk(q, pages, pages, cache_seqlens=s, block_table=bt + 2), ValueError, "block_table holds a page"),
        (lambda: fk(q, kc, vc, k[:, :1], v[:, :1], cos, None, s), ValueError, "rotary_sin is None"),
        (lambda: fk(q, kc, vc, None, None, cos, cos, s), ValueError, "rotary_cos / rotary_sin need the new k"),
        (lambda: fk(q, kc, vc, k[:, :1], v[:, :1], torch.ones(32, 9), torch.ones(32, 9), s), ValueError, "rotary_dim"),
        (lambda: fk(q, kc, vc, k[:, :1], v[:, :1], cos[:4], cos[:4], s), ValueError, "rotary_cos has 4 positions"),
        (lambda: fk(q, kc, vc, k[:, :1], v[:, :1], cos, cos[:, :2], s), ValueError, "rotary_sin must have"),
        (lambda: fk(q, kc, vc, cache_seqlens=s, num_splits=-1), ValueError, "num_splits"),
        (lambda: fk(q, kc, vc, cache_seqlens=s, alibi_slopes=torch.ones(2, 3)), ValueError, "alibi_slopes"),
        (lambda: fk(q[:0], kc, vc), ValueError, "batch_size > 0"),
    ]


@pytest.mark.parametrize("case", range(len(_refusals())))
def test_refusals(case):
    call, exc, match = _refusals()[case]
    with pytest.raises(exc, match=match):
        call()


def test_refusals_leave_the_cache_alone():
    kc, vc = rnd(2, 32, 2, 16), rnd(2, 32, 2, 16)
    before = kc.clone()
    with pytest.raises(ValueError, match="rotary_cos has"):
        flash_attn_with_kvcache(
            rnd(2, 1, 4, 16),
            kc,
            vc,
            rnd(2, 1, 2, 16),
            rnd(2, 1, 2, 16),
            torch.ones(4, 4),
            torch.ones(4, 4),
            torch.tensor([10, 3], dtype=torch.int32),
        )
    assert torch.equal(kc, before)
