"""torch.autograd.gradcheck (float64) on functional.masked_attention for every
mask kind, and torch.library.opcheck on torch.ops.masked_attn.forward/backward
(docs/design.md, "Testing")."""

import pytest
import torch
from torch.autograd import gradcheck

import torch_masked_attn as tma
from conftest import causal_blocked, random_additive, random_blocked

tmaF = tma.functional

B, H, LQ, LK, D = 2, 2, 5, 6, 4


@pytest.fixture(autouse=True)
def _one_thread():
    """gradcheck makes hundreds of tiny calls: one intra-op thread keeps them
    fast (the parity tests elsewhere run with the default two threads)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _t(*shape):
    return torch.randn(*shape, dtype=torch.float64)


def _case(case, h=H, hkv=None):
    hkv = h if hkv is None else hkv
    q, k, v = _t(B, h, LQ, D), _t(B, hkv, LK, D), _t(B, hkv, LK, D + 1)
    kw = {}
    if case == "none":
        pass
    elif case == "causal":
        kw["is_causal"] = True
    elif case == "am_bool":
        kw["attn_mask"] = random_blocked((B, h, LQ, LK))
    elif case == "am_bool_2d":
        kw["attn_mask"] = random_blocked((LQ, LK))
    elif case == "am_float":
        kw["attn_mask"] = random_additive((B, 1, LQ, LK), dtype=torch.float64)
    elif case == "kpm_bool":
        kw["key_padding_mask"] = random_blocked((B, LK))
    elif case == "kpm_float":
        kw["key_padding_mask"] = random_additive((B, LK), dtype=torch.float64)
    elif case == "causal+kpm_bool+am_float":
        kw["is_causal"] = True
        kw["key_padding_mask"] = random_blocked((B, LK))
        kw["attn_mask"] = random_additive((LQ, LK), dtype=torch.float64)
    elif case == "scale":
        kw["scale"] = 0.7
    else:
        raise AssertionError(case)
    return q, k, v, kw


CASES = [
    "none",
    "causal",
    "am_bool",
    "am_bool_2d",
    "am_float",
    "kpm_bool",
    "kpm_float",
    "causal+kpm_bool+am_float",
    "scale",
]


@pytest.mark.parametrize("case", CASES)
def test_gradcheck_masks(case):
    q, k, v, kw = _case(case)
    inputs = tuple(t.requires_grad_() for t in (q, k, v))
    assert gradcheck(lambda q, k, v: tmaF.masked_attention(q, k, v, **kw), inputs)


@pytest.mark.parametrize("hm_shape", ["H", "BH"])
@pytest.mark.parametrize("case", ["none", "causal+kpm_bool+am_float"])
def test_gradcheck_head_mask(case, hm_shape):
    q, k, v, kw = _case(case)
    hm = torch.rand((H,) if hm_shape == "H" else (B, H), dtype=torch.float64) + 0.1
    inputs = tuple(t.requires_grad_() for t in (q, k, v, hm))

    def f(q, k, v, hm):
        return tmaF.masked_attention(q, k, v, head_mask=hm, **kw)

    assert gradcheck(f, inputs)


@pytest.mark.parametrize("hkv", [1, 2])
@pytest.mark.parametrize("case", ["none", "causal+kpm_bool+am_float"])
def test_gradcheck_gqa(case, hkv):
    q, k, v, kw = _case(case, h=4, hkv=hkv)
    inputs = tuple(t.requires_grad_() for t in (q, k, v))
    assert gradcheck(lambda q, k, v: tmaF.masked_attention(q, k, v, **kw), inputs)


@pytest.mark.parametrize("case", ["none", "causal+kpm_bool+am_float"])
@pytest.mark.parametrize("with_hm", [False, True])
def test_gradcheck_need_weights(case, with_hm):
    """The loss uses both the output and the weights."""
    q, k, v, kw = _case(case)
    hm = torch.rand(B, H, dtype=torch.float64) + 0.1
    inputs = (q, k, v, hm) if with_hm else (q, k, v)
    inputs = tuple(t.requires_grad_() for t in inputs)

    def f(q, k, v, hm=None):
        out, w = tmaF.masked_attention(q, k, v, head_mask=hm, need_weights=True, **kw)
        return out, w

    assert gradcheck(f, inputs)


def test_gradcheck_fully_masked_rows():
    """Rows with no allowed key: gradient 0 (and finite-difference 0)."""
    q, k, v, _ = _case("none")
    am = random_blocked((B, H, LQ, LK))
    am[0, 1, 2] = True
    kpm = torch.zeros(B, LK, dtype=torch.bool)
    kpm[1] = True
    inputs = tuple(t.requires_grad_() for t in (q, k, v))
    assert gradcheck(
        lambda q, k, v: tmaF.masked_attention(q, k, v, attn_mask=am, key_padding_mask=kpm, need_weights=True), inputs
    )


def test_gradcheck_sdpa():
    q, k, v = _t(B, H, LQ, D), _t(B, H, LK, D), _t(B, H, LK, D)
    m = ~random_blocked((LQ, LK))
    inputs = tuple(t.requires_grad_() for t in (q, k, v))
    assert gradcheck(lambda q, k, v: tma.functional.scaled_dot_product_attention(q, k, v, attn_mask=m), inputs)
    assert gradcheck(
        lambda q, k, v: tma.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3), inputs
    )


def test_gradcheck_mha():
    mod = tma.MultiheadAttention(8, 2, dtype=torch.float64, add_bias_kv=True, kdim=6, vdim=5)
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    q, k, v = _t(4, 2, 8), _t(5, 2, 6), _t(5, 2, 5)
    kpm = random_blocked((2, 5))
    inputs = tuple(t.requires_grad_() for t in (q, k, v))

    def f(q, k, v):
        return mod(q, k, v, key_padding_mask=kpm, average_attn_weights=False)

    assert gradcheck(f, inputs)


# ---------------------------------------------------------------------------
# opcheck on the raw ops
# ---------------------------------------------------------------------------

OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _fwd_args(case, dtype=torch.float64, need_weights=False, requires_grad=True, h=H, hkv=None):
    q, k, v, kw = _case(case if case not in ("head_mask",) else "none", h=h, hkv=hkv)
    q, k, v = (t.to(dtype).requires_grad_(requires_grad) for t in (q, k, v))
    am = kw.get("attn_mask")
    if am is not None and am.dim() == 2:
        am = am.view(1, 1, LQ, LK)  # the raw op takes masks broadcastable to 4-D
    if am is not None and am.is_floating_point():
        am = am.to(dtype)
    kpm = kw.get("key_padding_mask")
    if kpm is not None and kpm.is_floating_point():
        kpm = kpm.to(dtype)
    hm = torch.rand(B, h, dtype=torch.float64).to(dtype).requires_grad_(requires_grad) if case == "head_mask" else None
    return (q, k, v, am, kpm, hm, kw.get("is_causal", False), kw.get("scale"), need_weights)


OP_CASES = [
    "none",
    "causal",
    "am_bool",
    "am_float",
    "kpm_bool",
    "kpm_float",
    "causal+kpm_bool+am_float",
    "scale",
    "head_mask",
]


def test_op_schemas():
    fwd = str(torch.ops.masked_attn.forward.default._schema)
    bwd = str(torch.ops.masked_attn.backward.default._schema)
    assert fwd.startswith("masked_attn::forward(")
    assert bwd.startswith("masked_attn::backward(")
    # no op mutates or aliases its inputs
    assert "!" not in fwd and "!" not in bwd, (fwd, bwd)


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("case", OP_CASES)
def test_opcheck_forward(case, need_weights):
    args = _fwd_args(case, need_weights=need_weights)
    torch.library.opcheck(torch.ops.masked_attn.forward.default, args, test_utils=OPCHECK_UTILS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_opcheck_forward_dtypes(dtype):
    args = _fwd_args("causal+kpm_bool+am_float", dtype=dtype, need_weights=True)
    torch.library.opcheck(torch.ops.masked_attn.forward.default, args, test_utils=OPCHECK_UTILS)


def test_opcheck_forward_gqa():
    args = _fwd_args("causal", h=4, hkv=2)
    torch.library.opcheck(torch.ops.masked_attn.forward.default, args, test_utils=OPCHECK_UTILS)


def test_opcheck_forward_no_grad():
    args = _fwd_args("kpm_bool", requires_grad=False)
    torch.library.opcheck(torch.ops.masked_attn.forward.default, args, test_utils=OPCHECK_UTILS)


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("case", ["none", "causal+kpm_bool+am_float", "head_mask", "am_bool"])
def test_opcheck_backward(case, need_weights):
    q, k, v, am, kpm, hm, is_causal, scale, nw = _fwd_args(case, need_weights=need_weights, requires_grad=False)
    out, lse, w, _ = torch.ops.masked_attn.forward(q, k, v, am, kpm, hm, is_causal, scale, nw)
    dout = torch.randn_like(out)
    dw = torch.randn_like(w) if need_weights else None
    args = (dout, dw, q, k, v, out, lse, am, kpm, hm, is_causal, scale, hm is not None)
    torch.library.opcheck(
        torch.ops.masked_attn.backward.default,
        args,
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"),
    )


def test_backward_op_matches_autograd():
    """The backward op alone gives what autograd gives through the forward."""
    q, k, v, am, kpm, hm, is_causal, scale, nw = _fwd_args("causal+kpm_bool+am_float", need_weights=True)
    out, lse, w, _ = torch.ops.masked_attn.forward(q, k, v, am, kpm, hm, is_causal, scale, nw)
    dout, dw = torch.randn_like(out), torch.randn_like(w)
    gq, gk, gv = torch.autograd.grad((out * dout).sum() + (w * dw).sum(), (q, k, v))
    bq, bk, bv, *_ = torch.ops.masked_attn.backward(
        dout, dw, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), am, kpm, hm, is_causal, scale, False
    )
    for a, b in ((gq, bq), (gk, bk), (gv, bv)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    # and matches the float64 reference
    from conftest import blocked_to_additive
    from reference import attention64

    add = blocked_to_additive(am) + blocked_to_additive(kpm).view(B, 1, 1, LK)
    add = add.masked_fill(causal_blocked(LQ, LK), float("-inf"))
    r = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ro, rw = attention64(*r, attn_mask=add, return_weights=True)
    rg = torch.autograd.grad((ro * dout).sum() + (rw * dw).sum(), r)
    for a, b in zip((bq, bk, bv), rg):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9)


def test_opcheck_backward_into():
    """masked_attn::backward_into writes dq, dk, dv into caller views (here three
    slices of one packed (B, L, 3, H, D) buffer) and equals masked_attn::backward."""
    torch.manual_seed(7)
    B, L, H, D = 2, 9, 4, 8
    qkv = torch.randn(B, L, 3, H, D)
    q, k, v = (qkv.select(2, i).transpose(1, 2) for i in range(3))
    kpm = torch.zeros(B, L, dtype=torch.bool)
    kpm[1, 6:] = True
    out, lse, _, _ = torch.ops.masked_attn.forward(q, k, v, None, kpm, None, True, None, False)
    g = torch.randn_like(out)
    ref = torch.ops.masked_attn.backward(g, None, q, k, v, out, lse, None, kpm, None, True, None, False, False)
    buf = torch.empty_like(qkv)
    into = tuple(buf.select(2, i).transpose(1, 2) for i in range(3))
    torch.ops.masked_attn.backward_into(g, None, q, k, v, out, lse, None, kpm, None, True, None, False, False, *into)
    for a, b in zip(into, ref[:3]):
        assert torch.equal(a, b)
    args = (g, None, q, k, v, out, lse, None, kpm, None, True, None, False, False, *(t.clone() for t in into))
    torch.library.opcheck(
        torch.ops.masked_attn.backward_into.default, args, test_utils=("test_schema", "test_faketensor")
    )


@pytest.mark.parametrize("which", ["masked_attention", "mha", "mha_recompute", "cross_entropy"])
def test_double_backward_raises_not_silently_zero(which):
    """Our backward kernels are not differentiable: a gradient taken with
    create_graph=True is right, and differentiating it again raises
    NotImplementedError instead of giving a silent zero."""
    torch.manual_seed(9)
    if which == "masked_attention":
        x = torch.randn(1, 2, 5, 4, dtype=torch.float64, requires_grad=True)
        k, v = torch.randn(2, 1, 2, 5, 4, dtype=torch.float64).unbind(0)

        def f(t):
            return tma.functional.masked_attention(t, k, v, is_causal=True).sum()
    elif which.startswith("mha"):
        mod = tma.MultiheadAttention(8, 2, batch_first=True, dtype=torch.float64)
        mod.recompute_projection = which == "mha_recompute"
        x = torch.randn(1, 5, 8, dtype=torch.float64, requires_grad=True)

        def f(t):
            return mod(t, t, t, need_weights=False)[0].pow(2).sum()
    else:
        x = torch.randn(4, 7, dtype=torch.float64, requires_grad=True)
        target = torch.tensor([1, 2, -100, 3])

        def f(t):
            return tma.functional.cross_entropy(t, target)

    (g,) = torch.autograd.grad(f(x), x, create_graph=True)
    (g_plain,) = torch.autograd.grad(f(x), x)
    torch.testing.assert_close(g, g_plain, rtol=0, atol=0)
    with pytest.raises(NotImplementedError, match="not differentiable"):
        torch.autograd.grad(g.sum(), x)
