"""ALiBi (flash-attn's alibi_slopes): the score of query i and key j gets
-slope * |i + Lk - Lq - j| after the scaling and the soft-cap, in
masked_attention, scaled_dot_product_attention, varlen_attn (paged caches
too) and the flash-attn API, forward and backward, on every ISA.

Checked against PyTorch given a float mask carrying the same bias (its SDPA
and plain ops in the same dtype) and a float64 reference; bad slopes raise
errors naming alibi_slopes."""

import math

import pytest
import torch
import torch.nn.functional as F

import torch_masked_attn as tma
from conftest import ISAS, assert_close64, assert_close_ref, isa_available, run_isa
from reference import attention64, band_blocked

tmaF = tma.functional


def _rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=torch.float64).to(dtype)


def alibi_bias(slopes, B, H, Lq, Lk, dtype=torch.float64):
    """(B, H, Lq, Lk) -slope * |i + Lk - Lq - j| (slopes (H,) or (B, H))."""
    d = (torch.arange(Lq)[:, None] + Lk - Lq - torch.arange(Lk)[None]).abs().to(dtype)
    s = slopes.to(dtype).reshape(-1, H)[:, :, None, None].expand(B, H, 1, 1)
    return -s * d


def fwd_bwd(fn, q, k, v, g):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), g)
    return (out.detach(), *grads)


DENSE_CASES = {
    "plain": dict(Lq=70, Lk=70),
    "causal": dict(Lq=130, Lk=130, causal=True),
    "window": dict(Lq=100, Lk=140, window=(20, 5)),
    "causal-window": dict(Lq=90, Lk=90, causal=True, window=(30, 0)),
    "decode-rows": dict(Lq=3, Lk=150),
    "softcap": dict(Lq=66, Lk=80, softcap=3.0),
    "batch-slopes-mha": dict(Lq=64, Lk=100, batch_slopes=True, Hkv=4),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(DENSE_CASES))
@pytest.mark.parametrize("isa", ISAS)
def test_masked_attention_alibi(isa, case, dtype):
    """Forward and the gradients of q, k, v against PyTorch with the bias as a
    float mask (same dtype) and the float64 reference; GQA unless noted."""
    if not isa_available(isa):
        pytest.skip(f"no {isa} on this CPU")
    c = dict(DENSE_CASES[case])
    B, H, Hkv, D = 2, 4, c.pop("Hkv", 2), 32
    Lq, Lk = c.pop("Lq"), c.pop("Lk")
    causal, window, cap = c.pop("causal", False), c.pop("window", None), c.pop("softcap", None)
    slopes = torch.rand(B, H) if c.pop("batch_slopes", False) else torch.rand(H) * 0.5 + 0.05
    q, k, v = _rand(B, H, Lq, D, dtype=dtype), _rand(B, Hkv, Lk, D, dtype=dtype), _rand(B, Hkv, Lk, D, dtype=dtype)
    g = _rand(B, H, Lq, D, dtype=dtype)
    bias = alibi_bias(slopes, B, H, Lq, Lk)
    blocked = band_blocked(Lq, Lk, is_causal=causal, window=window)

    def ours(q, k, v):
        return tmaF.masked_attention(
            q, k, v, is_causal=causal, window=window, softcap=cap, alibi_slopes=slopes.to(torch.float32)
        )

    res = run_isa(isa, lambda: fwd_bwd(ours, q, k, v, g))
    band = dict(is_causal=causal, window=window, softcap=cap)
    ref = fwd_bwd(lambda q, k, v: attention64(q, k, v, alibi_slopes=slopes, **band), q, k, v, g.double())

    def theirs_fn(q, k, v):  # PyTorch in the same dtype, the bias as a float mask
        if cap is None:
            mask = bias.to(dtype).masked_fill(blocked, float("-inf"))
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return attention64(q, k, v, attn_mask=bias, dtype=dtype, **band)

    theirs = fwd_bwd(theirs_fn, q, k, v, g)
    for name, o, t, r in zip(("out", "dq", "dk", "dv"), res, theirs, ref):
        assert_close_ref(o, t, r, name=f"{isa}-{case}-{name}", factor=3.0)


@pytest.mark.parametrize("case", ["causal", "window", "decode-rows", "softcap"])
def test_masked_attention_alibi_float64(case):
    """float64 (the double-accumulating kernels) agrees with the float64 reference closely."""
    c = dict(DENSE_CASES[case])
    B, H, Hkv, D = 2, 4, 2, 16
    Lq, Lk = c["Lq"], c["Lk"]
    causal, window, cap = c.get("causal", False), c.get("window"), c.get("softcap")
    slopes = torch.rand(B, H)
    q, k, v = _rand(B, H, Lq, D, dtype=torch.float64), _rand(B, Hkv, Lk, D, dtype=torch.float64), _rand(B, Hkv, Lk, D)
    v = v.double()
    g = _rand(B, H, Lq, D, dtype=torch.float64)
    res = fwd_bwd(
        lambda q, k, v: tmaF.masked_attention(
            q, k, v, is_causal=causal, window=window, softcap=cap, alibi_slopes=slopes
        ),
        q,
        k,
        v,
        g,
    )
    band = dict(is_causal=causal, window=window, softcap=cap)
    ref = fwd_bwd(lambda q, k, v: attention64(q, k, v, alibi_slopes=slopes, **band), q, k, v, g)
    for name, o, r in zip(("out", "dq", "dk", "dv"), res, ref):
        assert_close64(o, r, name=f"{case}-{name}")


def test_alibi_after_softcap():
    """The bias is added after the soft-cap (flash-attn's order): capping the
    biased score instead gives a different result."""
    q, k, v = _rand(1, 2, 20, 16), _rand(1, 2, 20, 16), _rand(1, 2, 20, 16)
    slopes = torch.tensor([0.7, 1.3])
    out = tmaF.masked_attention(q, k, v, softcap=2.0, alibi_slopes=slopes)
    bias = alibi_bias(slopes, 1, 2, 20, 20)
    ref = attention64(q, k, v, softcap=2.0, alibi_slopes=slopes)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    s = q.double() @ k.double().transpose(-1, -2) * 0.25 + bias
    wrong = torch.softmax(2.0 * torch.tanh(s / 2.0), -1) @ v.double()
    assert (out.double() - wrong).abs().max() > 1e-2


def test_sdpa_alibi_keyword():
    """scaled_dot_product_attention takes alibi_slopes as a keyword (batch dims flattened)."""
    q, k, v = _rand(2, 3, 4, 40, 16), _rand(2, 3, 4, 50, 16), _rand(2, 3, 4, 50, 16)
    slopes = torch.rand(6, 4)
    out = tmaF.scaled_dot_product_attention(q, k, v, is_causal=True, alibi_slopes=slopes)
    ref = attention64(q, k, v, is_causal=True, alibi_slopes=slopes.view(2, 3, 4))
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    with pytest.raises(TypeError):
        tmaF.scaled_dot_product_attention(q, k, v, None, 0.0, False, None, False, None, None, None, slopes)


# ---- varlen and paged ---------------------------------------------------------------------------


def _varlen_ref(q, k, v, cu_q, cu_k, slopes, window, dtype=torch.float64):
    """Per sequence: bottom-right aligned window and ALiBi, each with its own lengths."""
    outs = []
    for b in range(cu_q.numel() - 1):
        qs, ks, vs = (t[c[b] : c[b + 1]].transpose(0, 1) for t, c in ((q, cu_q), (k, cu_k), (v, cu_k)))
        sl = slopes if slopes.dim() == 1 else slopes[b]
        diagonal = ks.shape[1] - qs.shape[1]
        o = attention64(qs, ks, vs, window=window, diagonal=diagonal, alibi_slopes=sl, dtype=dtype)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (12, 3)])
@pytest.mark.parametrize("isa", ISAS)
def test_varlen_alibi(isa, window):
    """varlen_attn: per-sequence ALiBi and window, forward and backward, GQA, (N, H) slopes."""
    if not isa_available(isa):
        pytest.skip(f"no {isa} on this CPU")
    H, Hkv, D = 4, 2, 32
    cu_q = torch.tensor([0, 17, 17, 90, 95], dtype=torch.int32)
    cu_k = torch.tensor([0, 40, 45, 150, 230], dtype=torch.int32)
    q, k, v = _rand(95, H, D), _rand(230, Hkv, D), _rand(230, Hkv, D)
    g = _rand(95, H, D)
    slopes = torch.rand(4, H)

    def ours(q, k, v):
        return tmaF.varlen_attn(q, k, v, cu_q, cu_k, 73, 105, window_size=window, enable_gqa=True, alibi_slopes=slopes)

    res = run_isa(isa, lambda: fwd_bwd(ours, q, k, v, g))
    ref = fwd_bwd(lambda q, k, v: _varlen_ref(q, k, v, cu_q, cu_k, slopes, window), q, k, v, g.double())
    theirs = fwd_bwd(lambda q, k, v: _varlen_ref(q, k, v, cu_q, cu_k, slopes, window, torch.float32), q, k, v, g)
    for name, o, t, r in zip(("out", "dq", "dk", "dv"), res, theirs, ref):
        assert_close_ref(o, t, r, name=f"{isa}-varlen-{name}", factor=3.0)


@pytest.mark.parametrize("isa", ISAS)
def test_paged_alibi(isa):
    """A paged cache read in place (pages of 64 rows) with ALiBi, decoding and a short prefill."""
    if not isa_available(isa):
        pytest.skip(f"no {isa} on this CPU")
    H, Hkv, D, P = 4, 2, 32, 64
    pool_k, pool_v = _rand(6, P, Hkv, D), _rand(6, P, Hkv, D)
    table = torch.tensor([[3, 0, 5], [1, 4, 2]], dtype=torch.int32)
    used = torch.tensor([150, 70], dtype=torch.int32)
    cu_q = torch.tensor([0, 1, 6], dtype=torch.int32)
    q = _rand(6, H, D)
    slopes = torch.rand(H)
    with torch.no_grad():
        out = run_isa(
            isa,
            lambda: tmaF.varlen_attn(
                q,
                pool_k,
                pool_v,
                cu_q,
                None,
                5,
                192,
                window_size=(-1, 0),
                enable_gqa=True,
                seqused_k=used,
                block_table=table,
                alibi_slopes=slopes,
            ),
        )
    ks = torch.cat([pool_k[table[b]].reshape(-1, Hkv, D)[: used[b]] for b in range(2)])
    vs = torch.cat([pool_v[table[b]].reshape(-1, Hkv, D)[: used[b]] for b in range(2)])
    cu_k = torch.tensor([0, 150, 220], dtype=torch.int32)
    ref = _varlen_ref(q, ks, vs, cu_q, cu_k, slopes, (-1, 0))
    torch.testing.assert_close(out.double(), ref, atol=3e-5, rtol=3e-5)


# ---- the flash-attn API --------------------------------------------------------------------------


def test_flash_attn_func_alibi_native():
    """flash_attn_func's alibi_slopes runs in the kernels: no (B, H, Lq, Lk) mask is built."""
    from torch_masked_attn import flash_attn as fa

    B, L, H, D = 2, 50, 4, 16
    q, k, v = _rand(B, L, H, D), _rand(B, 70, H, D), _rand(B, 70, H, D)
    slopes = torch.rand(B, H)
    out = fa.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes)
    qkv = (t.transpose(1, 2) for t in (q, k, v))
    ref = attention64(*qkv, is_causal=True, diagonal=70 - L, alibi_slopes=slopes).transpose(1, 2)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


# ---- bad slopes ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "slopes, exc",
    [
        (torch.rand(5), RuntimeError),
        (torch.rand(3, 4), RuntimeError),
        (torch.rand(2, 4, 1), RuntimeError),
        (torch.rand(4, dtype=torch.float64), RuntimeError),
        (torch.rand(4).half(), RuntimeError),
        (torch.ones(4, dtype=torch.int32), RuntimeError),
        ([0.5] * 4, TypeError),
    ],
)
def test_bad_slopes(slopes, exc):
    q, k, v = _rand(2, 4, 8, 16), _rand(2, 4, 8, 16), _rand(2, 4, 8, 16)
    with pytest.raises(exc, match="alibi_slopes"):
        tmaF.masked_attention(q, k, v, alibi_slopes=slopes)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    with pytest.raises(exc, match="alibi_slopes"):
        tmaF.varlen_attn(
            q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu, 5, 5, alibi_slopes=slopes
        )


def test_bad_slopes_raw_ops():
    q, k, v = _rand(2, 4, 8, 16), _rand(2, 4, 8, 16), _rand(2, 4, 8, 16)
    with pytest.raises(RuntimeError, match=r"alibi_slopes must have shape \(H,\) = \(4,\) or \(B, H\) = \(2, 4\)"):
        torch.ops.masked_attn.forward(q, k, v, alibi_slopes=torch.rand(2, 5))
    with pytest.raises(RuntimeError, match="alibi_slopes must be float32"):
        torch.ops.masked_attn.forward(q, k, v, alibi_slopes=torch.rand(4).double())
    with pytest.raises(RuntimeError, match="expected all tensors on one device"):
        torch.ops.masked_attn.forward(q, k, v, alibi_slopes=torch.rand(4, device="meta"))
    out, lse = torch.ops.masked_attn.forward(q, k, v, alibi_slopes=torch.rand(4))[:2]
    with pytest.raises(RuntimeError, match="alibi_slopes must be float32"):
        torch.ops.masked_attn.backward(torch.ones_like(out), None, q, k, v, out, lse, alibi_slopes=torch.ones(4).half())


OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def test_opcheck_alibi():
    """The ops with alibi_slopes pass torch.library.opcheck (schema, fake kernels, autograd)."""
    q, k, v = (_rand(2, 4, 20, 16).requires_grad_(True) for _ in range(3))
    slopes = torch.rand(2, 4)
    fwd = torch.ops.masked_attn.forward.default
    torch.library.opcheck(fwd, (q, k, v), {"is_causal": True, "alibi_slopes": slopes}, test_utils=OPCHECK_UTILS)
    out, lse = fwd(q.detach(), k.detach(), v.detach(), alibi_slopes=slopes)[:2]
    bwd = torch.ops.masked_attn.backward.default
    args = (torch.ones_like(out), None, q.detach(), k.detach(), v.detach(), out, lse)
    torch.library.opcheck(bwd, args, {"alibi_slopes": slopes}, test_utils=("test_schema", "test_faketensor"))
    pq, pk, pv = (_rand(20, 4, 16).requires_grad_(True) for _ in range(3))
    cu = torch.tensor([0, 7, 20], dtype=torch.int32)
    vf = torch.ops.masked_attn.varlen_forward.default
    torch.library.opcheck(vf, (pq, pk, pv, cu, cu, 13, 13), {"alibi_slopes": slopes}, test_utils=OPCHECK_UTILS)


def test_no_alibi_is_unchanged():
    """alibi_slopes of zeros gives the same bits as no alibi_slopes (the bias adds +-0)."""
    q, k, v = _rand(1, 2, 70, 16), _rand(1, 2, 70, 16), _rand(1, 2, 70, 16)
    a = tmaF.masked_attention(q, k, v, is_causal=True)
    b = tmaF.masked_attention(q, k, v, is_causal=True, alibi_slopes=torch.zeros(2))
    assert torch.equal(a, b)
    assert not math.isnan(float(b.sum()))
