"""Properties (docs/design.md, "Testing"): causal no-look-ahead and padding
invariance, through functional.masked_attention and MultiheadAttention."""

import pytest
import torch
import torch.nn as nn

import torch_masked_attn as tma
from conftest import blocked_to_additive
from reference import attention64

tmaF = tma.functional

B, H, L, D = 2, 3, 33, 16


def _perturb_after(x, t, dim):
    """Copy of x with every position > t along dim replaced by fresh noise."""
    y = x.clone()
    idx = [slice(None)] * x.dim()
    idx[dim] = slice(t + 1, None)
    y[tuple(idx)] = torch.randn_like(y[tuple(idx)]) * 3
    return y


# ---------------------------------------------------------------------------
# causal no-look-ahead
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("padding", [False, True], ids=["nopad", "kpm"])
@pytest.mark.parametrize("t", [0, 6, 15, 16, 31])
def test_causal_no_look_ahead_functional(t, padding, dtype):
    q, k, v = (torch.randn(B, H, L, D, dtype=torch.float64).to(dtype) for _ in range(3))
    kw = dict(is_causal=True)
    if padding:
        kpm = torch.rand(B, L) < 0.3
        kpm[:, 0] = False
        kw["key_padding_mask"] = kpm
    out = tmaF.masked_attention(q, k, v, **kw)
    for which in ("q", "k", "v", "qkv"):
        q2 = _perturb_after(q, t, 2) if "q" in which else q
        k2 = _perturb_after(k, t, 2) if "k" in which else k
        v2 = _perturb_after(v, t, 2) if "v" in which else v
        out2 = tmaF.masked_attention(q2, k2, v2, **kw)
        assert torch.equal(out[:, :, : t + 1], out2[:, :, : t + 1]), f"perturbing {which} after {t}"
        if t + 1 < L and "q" in which:
            # the perturbation is real: later rows do change
            assert not torch.equal(out[:, :, t + 1 :], out2[:, :, t + 1 :])


@pytest.mark.parametrize("t", [0, 6, 16, 31])
def test_causal_no_look_ahead_gradients(t):
    """dq of rows <= t depends only on keys/values <= t."""
    q, k, v = (torch.randn(B, H, L, D, dtype=torch.float32) for _ in range(3))
    dout = torch.randn(B, H, L, D)

    def dq(k, v):
        qq = q.clone().requires_grad_()
        tmaF.masked_attention(qq, k, v, is_causal=True).backward(dout)
        return qq.grad

    g1 = dq(k, v)
    g2 = dq(_perturb_after(k, t, 2), _perturb_after(v, t, 2))
    assert torch.equal(g1[:, :, : t + 1], g2[:, :, : t + 1])


@pytest.mark.parametrize("padding", [False, True], ids=["nopad", "kpm"])
@pytest.mark.parametrize("batch_first", [False, True], ids=["seqfirst", "batchfirst"])
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("t", [0, 9, 31])
def test_causal_no_look_ahead_mha(t, need_weights, batch_first, padding):
    E, nh, n = 32, 4, 2
    mod = tma.MultiheadAttention(E, nh, batch_first=batch_first)
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    seq_dim = 1 if batch_first else 0
    x = torch.randn((n, L, E) if batch_first else (L, n, E))
    causal = nn.Transformer.generate_square_subsequent_mask(L)
    kw = dict(attn_mask=causal, is_causal=True, need_weights=need_weights)
    if padding:
        kpm = torch.rand(n, L) < 0.3
        kpm[:, 0] = False
        kw["key_padding_mask"] = kpm
    out, w = mod(x, x, x, **kw)
    x2 = _perturb_after(x, t, seq_dim)
    out2, w2 = mod(x2, x2, x2, **kw)
    sl = [slice(None)] * 3
    sl[seq_dim] = slice(0, t + 1)
    assert torch.equal(out[tuple(sl)], out2[tuple(sl)])
    if need_weights:
        assert torch.equal(w[:, : t + 1], w2[:, : t + 1])
        assert torch.all(w[:, torch.ones(L, L, dtype=torch.bool).triu(1)] == 0)


# ---------------------------------------------------------------------------
# padding invariance
# ---------------------------------------------------------------------------


def _padded_batch(lengths, L1, L2, dtype, h=H):
    """q/k/v of length L2 whose first L1 positions are the length-L1 batch;
    positions >= lengths[b] are padding (random junk, masked by the kpm)."""
    n = len(lengths)
    q, k, v = (torch.randn(n, h, L2, D, dtype=torch.float64).to(dtype) for _ in range(3))
    kpm2 = torch.arange(L2).expand(n, L2) >= torch.tensor(lengths).view(n, 1)
    return q, k, v, kpm2, (q[:, :, :L1], k[:, :, :L1], v[:, :, :L1], kpm2[:, :L1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("L1,L2", [(12, 13), (12, 33), (17, 31)])
def test_padding_invariance_functional(L1, L2, causal, dtype):
    lengths = [5, L1, 1] if L1 < 17 else [L1, 9, 3]
    q, k, v, kpm2, (q1, k1, v1, kpm1) = _padded_batch(lengths, L1, L2, dtype)
    hm = torch.rand(3, H, dtype=torch.float64).to(dtype)
    kw = dict(is_causal=causal, head_mask=hm)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    short = [t.clone().requires_grad_() for t in (q1, k1, v1)]
    out2, w2, lse2 = tmaF.masked_attention(*leaves, key_padding_mask=kpm2, need_weights=True, return_lse=True, **kw)
    out1, w1, lse1 = tmaF.masked_attention(*short, key_padding_mask=kpm1, need_weights=True, return_lse=True, **kw)
    # Bitwise for the forward: the extra keys are masked and must contribute
    # exact zeros (this holds for an online-softmax kernel that skips or zeroes
    # masked keys).
    assert torch.equal(out1, out2[:, :, :L1])
    assert torch.equal(lse1, lse2[:, :, :L1])
    assert torch.equal(w1, w2[:, :, :L1, :L1])
    assert torch.all(w2[:, :, :, L1:] == 0)
    # gradients of the real positions are unchanged when the extra query rows
    # get no output gradient
    dout = torch.randn(out1.shape, dtype=torch.float64).to(dtype)
    dout2 = torch.zeros(out2.shape, dtype=dtype)
    dout2[:, :, :L1] = dout
    out1.backward(dout)
    out2.backward(dout2)
    tol = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]
    for a, b in zip(short, leaves):
        torch.testing.assert_close(a.grad, b.grad[:, :, :L1], atol=tol, rtol=tol)
    for b in leaves[1:]:
        assert torch.all(b.grad[:, :, L1:] == 0)
    # and both agree with the reference
    add = blocked_to_additive(kpm1).view(3, 1, 1, L1)
    ref = attention64(q1, k1, v1, attn_mask=add, is_causal=causal, head_mask=hm)
    torch.testing.assert_close(out1.double(), ref, atol=tol * 10, rtol=tol * 10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("batch_first", [False, True], ids=["seqfirst", "batchfirst"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("need_weights", [False, True])
def test_padding_invariance_mha(batch_first, causal, need_weights, dtype):
    E, nh = 32, 4
    L1, L2 = 12, 29
    lengths = [12, 7, 1]
    n = len(lengths)
    mod = tma.MultiheadAttention(E, nh, batch_first=batch_first, dtype=dtype)
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    x2 = torch.randn(n, L2, E, dtype=torch.float64).to(dtype)  # batch first here
    kpm2 = torch.arange(L2).expand(n, L2) >= torch.tensor(lengths).view(n, 1)
    x1, kpm1 = x2[:, :L1].clone(), kpm2[:, :L1].clone()

    def run(x, kpm, length):
        xx = x if batch_first else x.transpose(0, 1)
        kw = dict(key_padding_mask=kpm, need_weights=need_weights)
        if causal:
            kw.update(attn_mask=torch.ones(length, length, dtype=torch.bool).triu(1), is_causal=True)
        out, w = mod(xx, xx, xx, **kw)
        return (out if batch_first else out.transpose(0, 1)), w

    out1, w1 = run(x1, kpm1, L1)
    out2, w2 = run(x2, kpm2, L2)
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    # the real tokens' outputs (and every position < L1: its keys are the same)
    for b, ln in enumerate(lengths):
        torch.testing.assert_close(out1[b, :ln], out2[b, :ln], atol=tol, rtol=tol)
    torch.testing.assert_close(out1, out2[:, :L1], atol=tol, rtol=tol)
    if need_weights:
        torch.testing.assert_close(w1, w2[:, :L1, :L1], atol=tol, rtol=tol)
        assert torch.all(w2[:, :, L1:] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("t", [62, 63, 64, 127, 128, 150])
def test_causal_no_look_ahead_long(t, dtype):
    """Perturbation boundaries at and around kernel tile edges."""
    Ln = 160
    q, k, v = (torch.randn(1, 2, Ln, D, dtype=torch.float64).to(dtype) for _ in range(3))
    kpm = torch.rand(1, Ln) < 0.2
    kpm[:, 0] = False
    out = tmaF.masked_attention(q, k, v, is_causal=True, key_padding_mask=kpm)
    q2, k2, v2 = (_perturb_after(x, t, 2) for x in (q, k, v))
    out2 = tmaF.masked_attention(q2, k2, v2, is_causal=True, key_padding_mask=kpm)
    assert torch.equal(out[:, :, : t + 1], out2[:, :, : t + 1])
    assert not torch.equal(out[:, :, t + 1 :], out2[:, :, t + 1 :])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("L1,L2", [(70, 200), (64, 65), (129, 256)])
def test_padding_invariance_long(L1, L2, dtype):
    lengths = [L1, 3, 64]
    q, k, v, kpm2, (q1, k1, v1, kpm1) = _padded_batch(lengths, L1, L2, dtype, h=2)
    out2 = tmaF.masked_attention(q, k, v, key_padding_mask=kpm2, is_causal=True)
    out1 = tmaF.masked_attention(q1, k1, v1, key_padding_mask=kpm1, is_causal=True)
    assert torch.equal(out1, out2[:, :, :L1])
