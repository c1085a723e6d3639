"""Parity of torch_masked_attn.functional.scaled_dot_product_attention with
F.scaled_dot_product_attention, and of functional.masked_attention with a
float64 plain-PyTorch reference (docs/design.md, "Attention semantics" and
"Testing")."""

import pytest
import torch
import torch.nn.functional as F

import torch_masked_attn as tma
from conftest import (
    allowed_to_additive,
    assert_close64,
    assert_close_ref,
    blocked_to_additive,
    causal_blocked,
    random_additive,
    random_blocked,
)
from reference import attention64

tmaF = tma.functional

ALL_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def _rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=torch.float64).to(dtype)


def _compare(name, ours, theirs, ref, dtype):
    if dtype == torch.float64:
        assert_close64(ours, theirs[0] if isinstance(theirs, list) else theirs, name=name)
        assert_close64(ours, ref, name=name + " vs ref", atol=1e-9, rtol=1e-7)
    else:
        assert_close_ref(ours, theirs, ref, name=name)


def run_sdpa_parity(q, k, v, *, ref_mask=None, grad=True, **kw):
    """Run ours and PyTorch's SDPA on the same (possibly strided) inputs and
    compare values and q/k/v gradients; the float64 reference gets the mask in
    additive form (``ref_mask``) and the same is_causal/scale/gqa."""
    dtype = q.dtype
    qs = [q.detach().requires_grad_(grad) for _ in range(2)]
    ks = [k.detach().requires_grad_(grad) for _ in range(2)]
    vs = [v.detach().requires_grad_(grad) for _ in range(2)]
    # same strides for both: detach() keeps the view, both are leaves
    out = tmaF.scaled_dot_product_attention(qs[0], ks[0], vs[0], **kw)
    out_pt = F.scaled_dot_product_attention(qs[1], ks[1], vs[1], **kw)

    q64 = q.detach().double().requires_grad_(grad)
    k64 = k.detach().double().requires_grad_(grad)
    v64 = v.detach().double().requires_grad_(grad)
    ref = attention64(q64, k64, v64, attn_mask=ref_mask, scale=kw.get("scale"), is_causal=kw.get("is_causal", False))
    assert out.dtype == dtype
    assert out.shape == out_pt.shape
    assert not out.isnan().any()
    _compare("out", out, out_pt, ref, dtype)
    if not grad:
        return out
    dout = torch.randn(out.shape, dtype=torch.float64).to(dtype)
    out.backward(dout)
    out_pt.backward(dout)
    ref.backward(dout.double())
    for nm, a, b, r in (("dq", qs[0], qs[1], q64), ("dk", ks[0], ks[1], k64), ("dv", vs[0], vs[1], v64)):
        assert a.grad is not None, nm
        assert a.grad.dtype == dtype and a.grad.shape == a.shape, nm
        _compare(nm, a.grad, b.grad, r.grad, dtype)
    return out


# ---------------------------------------------------------------------------
# scaled_dot_product_attention
# ---------------------------------------------------------------------------

B, H, LQ, LK, D = 2, 3, 7, 9, 8

SDPA_MASKS = [
    ("none", None, None),
    ("bool_LS", "bool", (LQ, LK)),
    ("bool_BHLS", "bool", (B, H, LQ, LK)),
    ("bool_B1LS", "bool", (B, 1, LQ, LK)),
    ("bool_1H1S", "bool", (1, H, 1, LK)),
    ("bool_1S", "bool", (1, LK)),
    ("float_H11", "float", (H, 1, 1)),
    ("float_LS", "float", (LQ, LK)),
    ("float_BHLS", "float", (B, H, LQ, LK)),
    ("float_B1LS", "float", (B, 1, LQ, LK)),
    ("float_1H1S", "float", (1, H, 1, LK)),
]


def _sdpa_mask(kind, shape, dtype):
    if kind is None:
        return None
    if kind == "bool":
        return ~random_blocked(shape)  # True = takes part
    return random_additive(shape, dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("name,kind,shape", SDPA_MASKS, ids=[m[0] for m in SDPA_MASKS])
def test_sdpa_masks(name, kind, shape, dtype):
    q, k, v = _rand(B, H, LQ, D, dtype=dtype), _rand(B, H, LK, D, dtype=dtype), _rand(B, H, LK, D, dtype=dtype)
    m = _sdpa_mask(kind, shape, dtype)
    run_sdpa_parity(q, k, v, attn_mask=m, ref_mask=allowed_to_additive(m))


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("lq,lk", [(7, 7), (5, 9), (9, 5), (1, 6), (33, 17)])
def test_sdpa_causal(lq, lk, dtype):
    q, k, v = _rand(B, H, lq, D, dtype=dtype), _rand(B, H, lk, D, dtype=dtype), _rand(B, H, lk, D, dtype=dtype)
    run_sdpa_parity(q, k, v, is_causal=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("lq,lk", [(7, 7), (5, 9), (9, 5), (70, 130)])
@pytest.mark.parametrize("variant", ["upper_left", "lower_right"])
def test_sdpa_causal_bias(variant, lq, lk, dtype):
    """PyTorch's CausalBias: the kernels' causal band about its diagonal, no mask built."""
    from torch.nn.attention import bias

    make = bias.causal_upper_left if variant == "upper_left" else bias.causal_lower_right
    q, k, v = _rand(B, H, lq, D, dtype=dtype), _rand(B, H, lk, D, dtype=dtype), _rand(B, H, lk, D, dtype=dtype)
    d = lk - lq if variant == "lower_right" else 0
    blocked = torch.arange(lk)[None, :] > torch.arange(lq)[:, None] + d
    run_sdpa_parity(q, k, v, attn_mask=make(lq, lk), ref_mask=blocked_to_additive(blocked))
    with pytest.raises(ValueError, match="CausalBias should not be used with is_causal=True"):
        tmaF.scaled_dot_product_attention(q, k, v, attn_mask=make(lq, lk), is_causal=True)
    with pytest.raises(ValueError, match="the CausalBias is for"):
        tmaF.scaled_dot_product_attention(q, k, v, attn_mask=make(lq + 1, lk))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("scale", [0.3, 1.0, 2.5e-2])
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_scale(scale, causal, dtype):
    q, k, v = _rand(B, H, LQ, D, dtype=dtype), _rand(B, H, LQ, D, dtype=dtype), _rand(B, H, LQ, D, dtype=dtype)
    run_sdpa_parity(q, k, v, scale=scale, is_causal=causal)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("hkv", [2, 1])
@pytest.mark.parametrize("variant", ["plain", "causal", "mask"])
def test_sdpa_gqa(hkv, variant, dtype):
    hq = 4
    q = _rand(B, hq, LQ, D, dtype=dtype)
    k, v = _rand(B, hkv, LK, D, dtype=dtype), _rand(B, hkv, LK, D, dtype=dtype)
    kw = dict(enable_gqa=True)
    ref_mask = None
    if variant == "causal":
        kw["is_causal"] = True
    elif variant == "mask":
        m = ~random_blocked((B, hq, LQ, LK))
        kw["attn_mask"] = m
        ref_mask = allowed_to_additive(m)
    run_sdpa_parity(q, k, v, ref_mask=ref_mask, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("mask", [None, "LS", "NLS"])
def test_sdpa_3d(mask, dtype):
    n, e = 3, 16
    q, k, v = _rand(n, LQ, e, dtype=dtype), _rand(n, LK, e, dtype=dtype), _rand(n, LK, 12, dtype=dtype)
    m = None
    if mask == "LS":
        m = ~random_blocked((LQ, LK))
    elif mask == "NLS":
        m = random_additive((n, LQ, LK), dtype=torch.float64).to(dtype)
    run_sdpa_parity(q, k, v, attn_mask=m, ref_mask=allowed_to_additive(m))


def test_sdpa_dv_differs_from_d():
    q, k, v = _rand(B, H, LQ, 8), _rand(B, H, LK, 8), _rand(B, H, LK, 5)
    run_sdpa_parity(q, k, v, is_causal=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("layout", ["BLHD_transposed", "strided_slices", "D_slice", "mixed"])
def test_sdpa_noncontiguous(layout, dtype):
    if layout == "BLHD_transposed":
        # a (B, L, H, D) projection viewed as (B, H, L, D): no copy needed
        q = _rand(B, LQ, H, D, dtype=dtype).transpose(1, 2)
        k = _rand(B, LK, H, D, dtype=dtype).transpose(1, 2)
        v = _rand(B, LK, H, D, dtype=dtype).transpose(1, 2)
    elif layout == "strided_slices":
        q = _rand(B, H + 2, 2 * LQ, D, dtype=dtype)[:, 1 : H + 1, ::2]
        k = _rand(2 * B, H, LK, D, dtype=dtype)[::2]
        v = _rand(B, H, LK + 3, D, dtype=dtype)[:, :, 3:]
    elif layout == "D_slice":
        q = _rand(B, H, LQ, 2 * D, dtype=dtype)[..., ::2]  # stride 2 in D
        k = _rand(B, H, LK, D + 5, dtype=dtype)[..., 5:]
        v = _rand(B, H, LK, 3 * D, dtype=dtype)[..., D : 2 * D]
    else:
        # one packed (B, L, 3, H, D) tensor split into q, k, v (self attention)
        qkv = _rand(B, LQ, 3, H, D, dtype=dtype)
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    assert not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous())
    m = ~random_blocked((B, 1, q.shape[2], k.shape[2]))
    run_sdpa_parity(q, k, v, attn_mask=m, ref_mask=allowed_to_additive(m))


def test_sdpa_noncontiguous_mask():
    q, k, v = _rand(B, H, LQ, D), _rand(B, H, LK, D), _rand(B, H, LK, D)
    m = random_additive((B, H, LK, LQ), dtype=torch.float32).transpose(-1, -2)
    assert not m.is_contiguous()
    run_sdpa_parity(q, k, v, attn_mask=m, ref_mask=m)
    mb = (~random_blocked((2 * LQ, LK)))[::2]
    run_sdpa_parity(q, k, v, attn_mask=mb, ref_mask=allowed_to_additive(mb))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_sdpa_fully_masked_rows(kind, dtype):
    """A query row with no allowed key: output 0, gradient 0, no NaN, as
    PyTorch >= 2.5 gives."""
    allowed = ~random_blocked((B, H, LQ, LK))
    allowed[0, 1, 2] = False
    allowed[1, :, 4] = False
    allowed[:, :, 6] = False
    if kind == "bool":
        m = allowed
    else:
        m = allowed_to_additive(allowed, torch.float64).to(dtype)
    q, k, v = _rand(B, H, LQ, D, dtype=dtype), _rand(B, H, LK, D, dtype=dtype), _rand(B, H, LK, D, dtype=dtype)
    qq = q.clone().requires_grad_()
    out = run_sdpa_parity(q, k, v, attn_mask=m, ref_mask=allowed_to_additive(m))
    assert torch.all(out[0, 1, 2] == 0)
    assert torch.all(out[1, :, 4] == 0)
    assert torch.all(out[:, :, 6] == 0)
    o = tmaF.scaled_dot_product_attention(qq, k, v, attn_mask=m)
    o.sum().backward()
    assert not qq.grad.isnan().any()
    assert torch.all(qq.grad[0, 1, 2] == 0) and torch.all(qq.grad[:, :, 6] == 0)


def test_sdpa_dropout_train():
    # dropout runs inside the kernels (tests/attention/test_dropout.py checks it); a seed reproduces it
    q = _rand(B, H, LQ, D)
    torch.manual_seed(5)
    a = tmaF.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
    torch.manual_seed(5)
    assert torch.equal(a, tmaF.scaled_dot_product_attention(q, q, q, dropout_p=0.5))
    assert not torch.equal(a, tmaF.scaled_dot_product_attention(q, q, q))


# ---------------------------------------------------------------------------
# masked_attention (the op's own conventions: bool True = blocked)
# ---------------------------------------------------------------------------


def _ma_case(case, dtype, h=H, hkv=None, lq=LQ, lk=LK, dv=D):
    """Inputs and masks for masked_attention plus the reference's additive mask."""
    hkv = h if hkv is None else hkv
    q = _rand(B, h, lq, D, dtype=dtype)
    k = _rand(B, hkv, lk, D, dtype=dtype)
    v = _rand(B, hkv, lk, dv, dtype=dtype)
    kw = {}
    add = torch.zeros(B, h, lq, lk, dtype=torch.float64)
    parts = case.split("+")
    for part in parts:
        if part == "none":
            continue
        if part == "causal":
            kw["is_causal"] = True
            add = add.masked_fill(causal_blocked(lq, lk), float("-inf"))
        elif part.startswith("am_"):
            kind, shape_name = part[3:].split("_")
            shape = {
                "LS": (lq, lk),
                "BHxLS": (B * h, lq, lk),
                "BHLS": (B, h, lq, lk),
                "B1LS": (B, 1, lq, lk),
                "1H1S": (1, h, 1, lk),
                "S": (lk,),
            }[shape_name]
            if kind == "bool":
                m = random_blocked(shape)
            else:
                m = random_additive(shape, dtype=torch.float64).to(dtype)
            kw["attn_mask"] = m
            ma = blocked_to_additive(m)
            if shape_name == "BHxLS":
                ma = ma.view(B, h, lq, lk)
            add = add + ma
        elif part.startswith("kpm_"):
            if part == "kpm_bool":
                m = random_blocked((B, lk))
            else:
                m = random_additive((B, lk), dtype=torch.float64).to(dtype)
            kw["key_padding_mask"] = m
            add = add + blocked_to_additive(m).view(B, 1, 1, lk)
        elif part.startswith("hm_"):
            shape = (h,) if part == "hm_H" else (B, h)
            kw["head_mask"] = torch.rand(shape, dtype=torch.float64).to(dtype)
        elif part == "scale":
            kw["scale"] = 0.37
        else:
            raise AssertionError(part)
    return q, k, v, kw, add


MA_CASES = [
    "none",
    "causal",
    "am_bool_LS",
    "am_bool_BHxLS",
    "am_bool_BHLS",
    "am_bool_B1LS",
    "am_bool_1H1S",
    "am_float_LS",
    "am_float_BHxLS",
    "am_float_BHLS",
    "am_float_1H1S",
    "kpm_bool",
    "kpm_float",
    "hm_H",
    "hm_BH",
    "scale",
    "causal+kpm_bool",
    "causal+am_float_BHLS",
    "am_bool_LS+kpm_float",
    "am_float_B1LS+kpm_bool+hm_BH",
    "causal+am_bool_BHxLS+kpm_bool+hm_H+scale",
]


def _unpack(res, need_weights, return_lse):
    if not need_weights and not return_lse:
        assert isinstance(res, torch.Tensor)
        return res, None, None
    assert isinstance(res, tuple)
    if need_weights and return_lse:
        assert len(res) == 3
        return res
    assert len(res) == 2
    return (res[0], res[1], None) if need_weights else (res[0], None, res[1])


def run_ma(q, k, v, kw, add, *, need_weights=False, return_lse=False, grad=True):
    dtype = q.dtype
    qo, ko, vo = (t.detach().requires_grad_(grad) for t in (q, k, v))
    kwo = dict(kw)
    hm = kw.get("head_mask")
    if hm is not None and grad:
        kwo["head_mask"] = hm.detach().clone().requires_grad_()
    res = tmaF.masked_attention(qo, ko, vo, need_weights=need_weights, return_lse=return_lse, **kwo)
    out, w, lse = _unpack(res, need_weights, return_lse)

    r = [t.detach().double().requires_grad_(grad) for t in (q, k, v)]
    hm64 = None if hm is None else hm.detach().double().requires_grad_(grad)
    ref, ref_w, ref_lse = attention64(
        *r, attn_mask=add, scale=kw.get("scale"), head_mask=hm64, return_weights=True, return_lse=True
    )
    # PyTorch's own error: the same plain ops evaluated in the input dtype
    pt_in = [t.detach().requires_grad_(grad) for t in (q, k, v)]
    hm_pt = None if hm is None else hm.detach().clone().requires_grad_(grad)
    pt, pt_w = attention64(
        *pt_in, attn_mask=add.to(dtype), scale=kw.get("scale"), head_mask=hm_pt, dtype=dtype, return_weights=True
    )

    # ... and PyTorch's SDPA kernel (flash-style; head_mask folded into v),
    # whose errors (e.g. its backward's rowsum(dO * O) on the rounded output)
    # count too
    sd_in, sd = None, None
    if dtype != torch.float64 and not need_weights:
        sd_in = [t.detach().clone().requires_grad_(grad) for t in (q, k, v)]
        sq, sk, sv = sd_in
        rep = q.shape[1] // k.shape[1]
        sk, sv = sk.repeat_interleave(rep, 1), sv.repeat_interleave(rep, 1)
        if hm is not None:
            sv = sv * (hm.view(-1, 1, 1) if hm.dim() == 1 else hm.view(B, -1, 1, 1))
        sd = F.scaled_dot_product_attention(sq, sk, sv, attn_mask=add.to(dtype), scale=kw.get("scale"))

    assert out.dtype == dtype and out.shape == ref.shape
    _compare("out", out, [pt, sd], ref, dtype)
    if need_weights:
        assert w.shape == ref_w.shape, (w.shape, ref_w.shape)
        _compare("weights", w, pt_w, ref_w, dtype)
    if return_lse:
        assert lse.shape == ref_lse.shape
        assert lse.dtype in (torch.float32, torch.float64)
        if dtype == torch.float64:
            assert_close64(lse.double(), ref_lse, name="lse", atol=1e-10, rtol=1e-10)
        else:
            torch.testing.assert_close(lse.double(), ref_lse.detach(), atol=1e-5, rtol=1e-5)
    if not grad:
        return out
    dout = torch.randn(out.shape, dtype=torch.float64).to(dtype)
    loss = (out * dout).sum()
    loss_pt = (pt * dout).sum()
    loss_ref = (ref * dout.double()).sum()
    if need_weights:
        dw = torch.randn(w.shape, dtype=torch.float64).to(dtype)
        loss = loss + (w * dw).sum()
        loss_pt = loss_pt + (pt_w * dw).sum()
        loss_ref = loss_ref + (ref_w * dw.double()).sum()
    loss.backward()
    loss_pt.backward()
    loss_ref.backward()
    if sd is not None:
        (sd * dout).sum().backward()
    pairs = [("dq", qo, pt_in[0], r[0], 0), ("dk", ko, pt_in[1], r[1], 1), ("dv", vo, pt_in[2], r[2], 2)]
    if hm is not None:
        pairs.append(("dhead_mask", kwo["head_mask"], hm_pt, hm64, None))
    for nm, a, b, rr, i in pairs:
        assert a.grad is not None, nm
        assert a.grad.shape == a.shape, nm
        theirs = [b.grad] + ([sd_in[i].grad] if sd is not None and i is not None else [])
        _compare(nm, a.grad, theirs, rr.grad, dtype)
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("case", MA_CASES)
def test_masked_attention_masks(case, dtype):
    q, k, v, kw, add = _ma_case(case, dtype)
    run_ma(q, k, v, kw, add)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("flags", ["weights", "lse", "weights+lse"])
@pytest.mark.parametrize("case", ["none", "causal+kpm_bool", "am_float_BHLS+hm_BH", "am_bool_LS+kpm_float+hm_H"])
def test_masked_attention_outputs(case, flags, dtype):
    q, k, v, kw, add = _ma_case(case, dtype)
    run_ma(q, k, v, kw, add, need_weights="weights" in flags, return_lse="lse" in flags)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("hkv", [2, 1])
@pytest.mark.parametrize("case", ["none", "causal+kpm_bool", "am_bool_BHLS+hm_H"])
def test_masked_attention_gqa(case, hkv, dtype):
    q, k, v, kw, add = _ma_case(case, dtype, h=4, hkv=hkv)
    run_ma(q, k, v, kw, add)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", ["none", "causal+kpm_bool", "am_float_BHLS+kpm_bool", "hm_BH"])
def test_masked_attention_half(case, dtype):
    q, k, v, kw, add = _ma_case(case, dtype)
    run_ma(q, k, v, kw, add)


@pytest.mark.parametrize("lq,lk", [(5, 9), (9, 5), (1, 1), (33, 17), (17, 33)])
def test_masked_attention_shapes(lq, lk):
    q, k, v, kw, add = _ma_case("causal+kpm_bool", torch.float64, lq=lq, lk=lk, dv=6)
    # keep key 0 open: causal already needs it
    kw["key_padding_mask"][:, 0] = False
    add = torch.zeros_like(add).masked_fill(causal_blocked(lq, lk), float("-inf")) + blocked_to_additive(
        kw["key_padding_mask"]
    ).view(B, 1, 1, lk)
    run_ma(q, k, v, kw, add, need_weights=True, return_lse=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_masked_attention_fully_masked_rows(dtype):
    """No allowed key: output 0, weights 0, gradients 0, no NaN; lse -inf."""
    q, k, v = _rand(B, H, LQ, D, dtype=dtype), _rand(B, H, LK, D, dtype=dtype), _rand(B, H, LK, D, dtype=dtype)
    am = random_blocked((B, H, LQ, LK))
    am[0, 1, 3] = True  # one row of one head
    am[1, :, 5] = True  # one row of every head
    kpm = torch.zeros(B, LK, dtype=torch.bool)
    kpm[1] = True  # batch 1: every key is padding
    for t in (q, k, v):
        t.requires_grad_()
    out, w, lse = tmaF.masked_attention(q, k, v, attn_mask=am, key_padding_mask=kpm, need_weights=True, return_lse=True)
    assert not out.isnan().any() and not w.isnan().any()
    assert torch.all(out[0, 1, 3] == 0) and torch.all(out[1] == 0)
    assert torch.all(w[0, 1, 3] == 0) and torch.all(w[1] == 0)
    assert torch.isneginf(lse[1]).all() and torch.isneginf(lse[0, 1, 3])
    assert torch.isfinite(lse[0, 0]).all()
    (out.sum() + w.sum()).backward()
    for t in (q, k, v):
        assert not t.grad.isnan().any()
    assert torch.all(q.grad[1] == 0) and torch.all(q.grad[0, 1, 3] == 0)
    assert torch.all(k.grad[1] == 0) and torch.all(v.grad[1] == 0)
    # the other rows still agree with the reference
    add = blocked_to_additive(am) + blocked_to_additive(kpm).view(B, 1, 1, LK)
    ref = attention64(q.detach(), k.detach(), v.detach(), attn_mask=add)
    if dtype == torch.float64:
        assert_close64(out, ref, name="out")
    else:
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_masked_attention_matches_sdpa_conventions():
    """masked_attention's bool True = blocked is the negation of SDPA's."""
    q, k, v = _rand(B, H, LQ, D), _rand(B, H, LK, D), _rand(B, H, LK, D)
    blocked = random_blocked((B, 1, LQ, LK))
    a = tmaF.masked_attention(q, k, v, attn_mask=blocked)
    b = tmaF.scaled_dot_product_attention(q, k, v, attn_mask=~blocked)
    c = F.scaled_dot_product_attention(q, k, v, attn_mask=~blocked)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-5)


def test_masked_attention_head_mask_zero_and_one():
    q, k, v = _rand(B, H, LQ, D), _rand(B, H, LK, D), _rand(B, H, LK, D)
    base = tmaF.masked_attention(q, k, v, is_causal=True)
    ones = tmaF.masked_attention(q, k, v, is_causal=True, head_mask=torch.ones(H))
    torch.testing.assert_close(base, ones, atol=0, rtol=0)
    hm = torch.ones(B, H)
    hm[1, 2] = 0
    out = tmaF.masked_attention(q, k, v, is_causal=True, head_mask=hm)
    assert torch.all(out[1, 2] == 0)
    torch.testing.assert_close(out[0], base[0], atol=0, rtol=0)


def test_masked_attention_dropout_train():
    q = _rand(B, H, LQ, D)
    out, w = tmaF.masked_attention(q, q, q, dropout_p=0.25, need_weights=True)
    torch.testing.assert_close(out, w @ q, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_sdpa_causal_with_mask(dtype):
    """PyTorch's math path rejects attn_mask together with is_causal (its CPU
    flash path accepts it); torch_masked_attn applies both masks, as documented."""
    q, k, v = _rand(B, H, LQ, D, dtype=dtype), _rand(B, H, LK, D, dtype=dtype), _rand(B, H, LK, D, dtype=dtype)
    m = ~random_blocked((B, 1, LQ, LK))
    out = tmaF.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=True)
    ref = attention64(q, k, v, attn_mask=allowed_to_additive(m), is_causal=True)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


# ---------------------------------------------------------------------------
# lengths spanning several kernel tiles (FlashAttention-style blocking: the
# online softmax across key blocks, skipped fully-masked blocks, ragged tails)
# ---------------------------------------------------------------------------

LONG_SHAPES = [(65, 64), (130, 200), (200, 129), (1, 257), (257, 3)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("lq,lk", LONG_SHAPES)
@pytest.mark.parametrize("case", ["causal+kpm_bool", "am_float_1H1S+kpm_bool+hm_BH", "none"])
def test_masked_attention_long(case, lq, lk, dtype):
    q, k, v, kw, add = _ma_case(case, dtype, h=2, lq=lq, lk=lk, dv=12)
    # Keys 0 and 1 stay open for every row: rows whose only allowed key is
    # key 0 are the degenerate bf16 case of test_bf16_head_mask_single_key.
    if "attn_mask" in kw:
        kw["attn_mask"][..., :2] = 0.0
    if "key_padding_mask" in kw:
        # pad whole tiles: batch 1 keeps only its first 12 keys
        kpm = kw["key_padding_mask"]
        kpm[1, min(lk, 12) :] = True
        kpm[:, :2] = False
    add = torch.zeros_like(add)
    if kw.get("is_causal"):
        add = add.masked_fill(causal_blocked(lq, lk), float("-inf"))
    if "attn_mask" in kw:
        add = add + blocked_to_additive(kw["attn_mask"])
    if "key_padding_mask" in kw:
        add = add + blocked_to_additive(kw["key_padding_mask"]).view(B, 1, 1, lk)
    run_ma(q, k, v, kw, add, need_weights=(lq * lk < 20000), return_lse=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("lq,lk", [(130, 200), (200, 130), (129, 129)])
@pytest.mark.parametrize("variant", ["causal", "mask", "gqa_causal"])
def test_sdpa_long(variant, lq, lk, dtype):
    h, hkv = (4, 2) if variant.startswith("gqa") else (2, 2)
    q = _rand(1, h, lq, 16, dtype=dtype)
    k, v = _rand(1, hkv, lk, 16, dtype=dtype), _rand(1, hkv, lk, 16, dtype=dtype)
    kw, ref_mask = {}, None
    if "causal" in variant:
        kw["is_causal"] = True
    if variant == "mask":
        m = ~random_blocked((lq, lk), p=0.5)
        m[:, 64:128] = False  # a whole key tile blocked
        m[:, 0] = True
        kw["attn_mask"], ref_mask = m, allowed_to_additive(m)
    if variant.startswith("gqa"):
        kw["enable_gqa"] = True
    run_sdpa_parity(q, k, v, ref_mask=ref_mask, **kw)


# ---------------------------------------------------------------------------
# more PyTorch call forms
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["5d", "5d_mask", "2d", "bcast_batch_kv", "scale0", "scale_neg"])
def test_sdpa_call_forms(form):
    kw, ref_mask = {}, None
    if form.startswith("5d"):
        q, k, v = _rand(2, 2, 3, LQ, D), _rand(2, 2, 3, LK, D), _rand(2, 2, 3, LK, D)
        if form == "5d_mask":
            m = ~random_blocked((2, 1, 3, LQ, LK))
            kw["attn_mask"], ref_mask = m, allowed_to_additive(m)
    elif form == "2d":
        q, k, v = _rand(LQ, D), _rand(LK, D), _rand(LK, 6)
        kw["is_causal"] = True
    elif form == "bcast_batch_kv":
        q, k, v = _rand(B, H, LQ, D), _rand(1, H, LK, D), _rand(1, H, LK, D)
    else:
        q, k, v = _rand(B, H, LQ, D), _rand(B, H, LK, D), _rand(B, H, LK, D)
        kw["scale"] = 0.0 if form == "scale0" else -1.5
    run_sdpa_parity(q, k, v, ref_mask=ref_mask, **kw)


@pytest.mark.parametrize("which", ["q", "k", "v", "qk"])
def test_partial_requires_grad(which):
    q, k, v = (
        _rand(B, H, LQ, D, dtype=torch.float64),
        _rand(B, H, LK, D, dtype=torch.float64),
        _rand(B, H, LK, D, dtype=torch.float64),
    )
    kpm = random_blocked((B, LK))
    ours = [t.clone().requires_grad_(n in which) for n, t in zip("qkv", (q, k, v))]
    refs = [t.clone().requires_grad_(n in which) for n, t in zip("qkv", (q, k, v))]
    out = tmaF.masked_attention(*ours, key_padding_mask=kpm, is_causal=True)
    ref = attention64(*refs, attn_mask=blocked_to_additive(kpm).view(B, 1, 1, LK), is_causal=True)
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g)
    for a, b in zip(ours, refs):
        assert (a.grad is None) == (b.grad is None)
        if b.grad is not None:
            assert_close64(a.grad, b.grad, name="grad")


@pytest.mark.parametrize("use", ["weights_only", "out_only"])
def test_need_weights_partial_loss(use):
    """need_weights=True but the loss uses only one of the two outputs."""
    q, k, v = (
        _rand(B, H, LQ, D, dtype=torch.float64),
        _rand(B, H, LK, D, dtype=torch.float64),
        _rand(B, H, LK, D, dtype=torch.float64),
    )
    am = random_blocked((LQ, LK))
    ours = [t.clone().requires_grad_() for t in (q, k, v)]
    refs = [t.clone().requires_grad_() for t in (q, k, v)]
    out, w = tmaF.masked_attention(*ours, attn_mask=am, need_weights=True)
    rout, rw = attention64(*refs, attn_mask=blocked_to_additive(am), return_weights=True)
    if use == "weights_only":
        (w**2).sum().backward()
        (rw**2).sum().backward()
    else:
        (out**2).sum().backward()
        (rout**2).sum().backward()
    for a, b in zip(ours, refs):
        if b.grad is None or torch.all(b.grad == 0):
            assert a.grad is None or torch.all(a.grad == 0)
        else:
            assert_close64(a.grad, b.grad, name="grad")


def test_mask_requires_grad():
    """A float attn_mask that requires grad (learned position bias): the
    gradient matches PyTorch's."""
    q, k, v = _rand(B, H, LQ, D), _rand(B, H, LK, D), _rand(B, H, LK, D)
    m = torch.randn(1, H, LQ, LK, requires_grad=True)
    out = tmaF.scaled_dot_product_attention(q, k, v, attn_mask=m)
    out.sum().backward()
    m2 = m.detach().clone().requires_grad_()
    F.scaled_dot_product_attention(q, k, v, attn_mask=m2).sum().backward()
    torch.testing.assert_close(m.grad, m2.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mask_dtype", [torch.float16, torch.float64])
def test_masked_attention_mask_dtype_differs(mask_dtype):
    """A floating mask of another dtype than q is applied by value."""
    q, k, v = _rand(B, H, LQ, D), _rand(B, H, LK, D), _rand(B, H, LK, D)
    am = random_additive((LQ, LK), dtype=torch.float64).to(mask_dtype)
    kpm = random_additive((B, LK), dtype=torch.float64).to(mask_dtype)
    out = tmaF.masked_attention(q, k, v, attn_mask=am, key_padding_mask=kpm)
    ref = attention64(q, k, v, attn_mask=am.double() + kpm.double().view(B, 1, 1, LK))
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_torch_compile_aot_eager():
    q, k, v = _rand(B, H, LQ, D), _rand(B, H, LK, D), _rand(B, H, LK, D)
    kpm = random_blocked((B, LK))

    def f(q, k, v):
        out, w = tmaF.masked_attention(q, k, v, key_padding_mask=kpm, is_causal=True, need_weights=True)
        return out * 2, w

    qs = [t.clone().requires_grad_() for t in (q, k, v)]
    es = [t.clone().requires_grad_() for t in (q, k, v)]
    a, wa = torch.compile(f, backend="aot_eager", fullgraph=True)(*qs)
    b, wb = f(*es)
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    torch.testing.assert_close(wa, wb, atol=0, rtol=0)
    (a.sum() + wa.sum()).backward()
    (b.sum() + wb.sum()).backward()
    for x, y in zip(qs, es):
        torch.testing.assert_close(x.grad, y.grad, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("hm_value", [1.0, 0.7])
def test_bf16_head_mask_single_key(hm_value):
    """bf16, every query row of a head may attend to one key only: the exact
    dq/dk are 0.  A flash-style backward computes D = rowsum(dO * O) from the
    bf16-rounded output; with a head mask != 1 the rounded O no longer matches
    hm * v exactly and leaves an error of the size of ordinary bf16 noise.
    The bound here is that noise level (relative to |dO| |v| |q|), not 0."""
    lq, lk, d = 200, 16, 16
    q, k, v = (_rand(1, 1, n, d, dtype=torch.bfloat16) for n in (lq, lk, lk))
    blocked = torch.ones(lq, lk, dtype=torch.bool)
    blocked[:, 0] = False
    hm = torch.tensor([hm_value], dtype=torch.bfloat16)
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    out = tmaF.masked_attention(qs, ks, vs, attn_mask=blocked, head_mask=hm)
    torch.testing.assert_close(out, (hm * v[:, :, :1]).expand_as(out), atol=0, rtol=0)
    dout = _rand(1, 1, lq, d, dtype=torch.bfloat16)
    out.backward(dout)
    noise = 2.0**-8 * dout.float().abs().max() * v.float().abs().max() * d**0.5
    assert qs.grad.float().abs().max() <= noise * q.float().abs().max()
    assert ks.grad.float().abs().max() <= noise * q.float().abs().max() * lq**0.5
    assert torch.all(ks.grad[:, :, 1:] == 0)


# ---- the plain call's short path (functional._plain_forward) ----------------


@pytest.mark.parametrize("fn", ["sdpa", "masked_attention"])
@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_call_short_path(fn, grad, causal, dtype, monkeypatch):
    """A call with no mask goes straight to the op (the short path is taken:
    counted) and gives the same bits, values and gradients, as the checked
    path, which window=(None, None) (no window) takes; with GQA, and with a
    key whose heads are interleaved (a strided view)."""
    taken = []  # the op's output, or None where it refused the short path's arguments
    plain = tmaF._plain_forward
    monkeypatch.setattr(tmaF, "_plain_forward", lambda *a: taken.append(plain(*a)) or taken[-1])
    call = tmaF.scaled_dot_product_attention if fn == "sdpa" else tmaF.masked_attention
    extra = {"enable_gqa": True} if fn == "sdpa" else {}
    q = _rand(B, 4, 3, D, dtype=dtype)
    k = _rand(B, 5, 2, D, dtype=dtype).transpose(1, 2)  # (B, 2, 5, D), heads interleaved
    v = _rand(B, 2, 5, D, dtype=dtype)
    g = _rand(B, 4, 3, D, dtype=dtype)
    results = []
    for window in (None, (None, None)):
        leaves = [t.detach().requires_grad_(grad) for t in (q, k, v)]
        out = call(*leaves, is_causal=causal, scale=0.3, window=window, **extra)
        grads = torch.autograd.grad(out, leaves, g) if grad else ()
        results.append((out, *grads))
    assert len(taken) == 1 and taken[0] is not None  # taken, and not silently refused
    for a, b in zip(*results):
        assert torch.equal(a, b)
    ref = attention64(q.double(), k.double(), v.double(), scale=0.3, is_causal=causal)
    torch.testing.assert_close(
        results[0][0].double(),
        ref,
        atol=2e-2 if dtype == torch.bfloat16 else 1e-5,
        rtol=2e-2 if dtype == torch.bfloat16 else 1e-5,
    )


@pytest.mark.parametrize(
    "case, error, message",
    [
        ("mixed_dtype", ValueError, "query, key and value must have the same dtype"),
        ("D_mismatch", ValueError, "query and key must have the same embedding dim"),
        ("Lk_mismatch", ValueError, "key and value must have the same length"),
        ("int_query", TypeError, "query must be floating point"),
        ("gqa_not_divisible", ValueError, "must be a multiple of the number of key/value heads"),
    ],
)
def test_plain_call_refused_raises_the_drop_ins_error(case, error, message):
    """Where the op refuses a plain call, the drop-in's own exception comes out,
    not the shim's."""
    q, k, v = _rand(B, 4, LQ, D), _rand(B, 4, LK, D), _rand(B, 4, LK, D)
    kw = {
        "mixed_dtype": dict(key=k.double()),
        "D_mismatch": dict(key=_rand(B, 4, LK, D + 2)),
        "Lk_mismatch": dict(value=_rand(B, 4, LK + 2, D)),
        "int_query": dict(query=q.long(), key=k.long(), value=v.long()),
        "gqa_not_divisible": dict(key=_rand(B, 3, LK, D), value=_rand(B, 3, LK, D), enable_gqa=True),
    }[case]
    args = dict(query=q, key=k, value=v) | kw
    with pytest.raises(error, match="^scaled_dot_product_attention: .*" + message):
        tmaF.scaled_dot_product_attention(**args)
