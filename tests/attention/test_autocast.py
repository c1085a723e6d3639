"""Under torch.autocast("cpu", dtype=torch.bfloat16) every drop-in behaves like
its native twin under autocast (docs/design.md, "Autocast"): the same output
dtype, values within the bf16 yardstick of the float64 reference, gradients in
each input's own dtype; attention computes in bfloat16 (mixed float32 /
bfloat16 inputs accepted, as native F.sdpa accepts them there), cross-entropy
in float32. Outside autocast, mixed dtypes stay an error."""

import pytest
import torch
import torch.nn.functional as F

import torch_masked_attn as tma
from conftest import allowed_to_additive, assert_close_ref
from reference import attention64
from torch_masked_attn import functional as tmf

BF16 = torch.bfloat16
F32 = torch.float32
AUTOCAST = dict(device_type="cpu", dtype=BF16)

# (q, k, v) dtypes: all float32, all bfloat16, and the mix a rotary embedding leaves
# (q, k float32 after the rotation in float32, v bfloat16 from an autocast linear)
DTYPE_SETS = {
    "f32": (F32, F32, F32),
    "bf16": (BF16, BF16, BF16),
    "rotary-mix": (F32, F32, BF16),
    "q-f32": (F32, BF16, BF16),
}


def _qkv(dtypes, B=2, H=4, Hkv=4, Lq=37, Lk=37, D=32):
    shapes = ((B, H, Lq, D), (B, Hkv, Lk, D), (B, Hkv, Lk, D))
    return [torch.randn(s, dtype=dt).requires_grad_() for s, dt in zip(shapes, dtypes)]


def _ref_grads(q, k, v, g, mask=None, is_causal=False):
    """float64 reference of what autocast computes: attention of the bf16-rounded
    inputs; output and (dq, dk, dv)."""
    q64, k64, v64 = (t.detach().to(BF16).double().requires_grad_() for t in (q, k, v))
    add = None if mask is None else allowed_to_additive(mask.to(BF16) if mask.is_floating_point() else mask)
    out = attention64(q64, k64, v64, attn_mask=add, is_causal=is_causal)
    grads = torch.autograd.grad(out, (q64, k64, v64), g.double())
    return out, grads


@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
@pytest.mark.parametrize("dtypes", list(DTYPE_SETS), ids=list(DTYPE_SETS))
def test_sdpa_autocast_matches_native(dtypes, mask_kind):
    q, k, v = _qkv(DTYPE_SETS[dtypes])
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(2, 1, 37, 37) > 0.3
        mask[..., 0] = True
    elif mask_kind == "float":
        mask = torch.randn(2, 1, 37, 37)  # float32 mask: cast to bf16 like q, k, v
    with torch.autocast(**AUTOCAST):
        ours = tmf.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        native = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
    assert ours.dtype == native.dtype == BF16
    g = torch.randn(ours.shape, dtype=BF16)
    ref, ref_grads = _ref_grads(q, k, v, g, mask, is_causal=mask is None)
    assert_close_ref(ours, native, ref, name="out", dtype=BF16)
    our_grads = torch.autograd.grad(ours, (q, k, v), g)
    native_grads = torch.autograd.grad(native, (q, k, v), g)
    for name, t, ours_g, nat_g, ref_g in zip("qkv", (q, k, v), our_grads, native_grads, ref_grads):
        assert ours_g.dtype == nat_g.dtype == t.dtype, name
        assert_close_ref(ours_g, nat_g, ref_g, name=f"d{name}", dtype=BF16)


def test_sdpa_mixed_dtypes_outside_autocast_is_an_error():
    q, k, v = _qkv(DTYPE_SETS["rotary-mix"])
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, k, v)
    with pytest.raises(ValueError, match="same dtype"):
        tmf.scaled_dot_product_attention(q, k, v)
    with pytest.raises(RuntimeError, match="same dtype"):
        torch.ops.masked_attn.forward(q, k, v, None, None, None, False, None, False)


def test_autocast_float64_untouched():
    """autocast never casts float64 (torch.amp's rule): a float64 call stays float64."""
    q, k, v = (t.detach().double() for t in _qkv(DTYPE_SETS["f32"]))
    with torch.autocast(**AUTOCAST):
        ours = tmf.scaled_dot_product_attention(q, k, v, is_causal=True)
        native = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert ours.dtype == native.dtype == torch.float64
    torch.testing.assert_close(ours, native, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("dtypes", ["f32", "rotary-mix"])
def test_ops_forward_autocast(dtypes):
    """The op itself (torch.ops.masked_attn.forward) is registered for autocast:
    mixed inputs, a float32 key padding mask, a float32 head mask and sinks
    (those two keep their dtype)."""
    q, k, v = _qkv(DTYPE_SETS[dtypes], Hkv=2)
    kpm = torch.zeros(2, 37)
    kpm[1, 30:] = float("-inf")
    hm = torch.rand(4)
    with torch.autocast(**AUTOCAST):
        out, lse, _, _ = torch.ops.masked_attn.forward(q, k, v, None, kpm, hm, True, None, False)
    assert out.dtype == BF16 and lse.dtype == F32
    q64, k64, v64 = (t.detach().to(BF16).double() for t in (q, k, v))
    ref = attention64(q64, k64, v64, attn_mask=kpm.to(BF16)[:, None, None, :], is_causal=True, head_mask=hm)
    with torch.autocast(**AUTOCAST):  # PyTorch on the same bf16 inputs, plain ops
        native = attention64(q, k, v, attn_mask=kpm[:, None, None, :], is_causal=True, head_mask=hm, dtype=BF16)
    assert_close_ref(out, native, ref, name="out", dtype=BF16)


def test_masked_attention_autocast_sinks_keep_dtype_and_grad():
    q, k, v = _qkv(DTYPE_SETS["rotary-mix"])
    sinks = torch.randn(4, requires_grad=True)
    with torch.autocast(**AUTOCAST):
        out = tmf.masked_attention(q, k, v, is_causal=True, sinks=sinks)
    assert out.dtype == BF16
    out.float().square().sum().backward()
    for t in (q, k, v, sinks):
        assert t.grad is not None and t.grad.dtype == t.dtype and torch.isfinite(t.grad).all()
    # the same call on bf16 inputs outside autocast gives the same bits (inputs that require grad,
    # as above: a forward with no backward to follow may round P differently on the tile variants)
    plain = tmf.masked_attention(
        *(t.detach().to(BF16).requires_grad_() for t in (q, k, v)), is_causal=True, sinks=sinks.detach()
    )
    assert torch.equal(out.detach(), plain.detach())


@pytest.mark.parametrize("dtypes", ["f32", "bf16", "rotary-mix"])
def test_varlen_autocast(dtypes):
    """varlen_attn under autocast computes in bf16 (torch's varlen_attn has no CPU
    kernel to compare with: the yardstick is our masked_attention per sequence
    on the same bf16 inputs, bit for bit, and the float64 reference)."""
    lens = [13, 29, 1]
    T, H, D = sum(lens), 4, 32
    dts = DTYPE_SETS[dtypes]
    q, k, v = (torch.randn(T, H, D, dtype=dt).requires_grad_() for dt in dts)
    cu = torch.tensor([0, 13, 42, 43], dtype=torch.int32)
    with torch.autocast(**AUTOCAST):
        out = tmf.varlen_attn(q, k, v, cu, cu, 29, 29, window_size=(-1, 0))
    assert out.dtype == BF16
    qb, kb, vb = (t.detach().to(BF16) for t in (q, k, v))
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        seq = [t[a:b].transpose(0, 1)[None] for t in (qb, kb, vb)]
        expect = tmf.masked_attention(*seq, is_causal=True)[0].transpose(0, 1)
        ref = attention64(*(s.double() for s in seq), is_causal=True)[0].transpose(0, 1)
        assert_close_ref(out[a:b], expect, ref, name=f"seq {a}:{b}", dtype=BF16)
    out.float().sum().backward()
    for t in (q, k, v):
        assert t.grad.dtype == t.dtype and torch.isfinite(t.grad).all()


@pytest.mark.parametrize("logits_dtype", [F32, BF16])
@pytest.mark.parametrize(
    "options",
    [{}, {"label_smoothing": 0.1, "reduction": "sum"}, {"reduction": "none"}, {"weight": True}],
    ids=["mean", "ls-sum", "none", "weight"],
)
def test_cross_entropy_autocast_is_float32(logits_dtype, options):
    """F.cross_entropy under autocast runs in float32 (it upcasts the logits);
    ours returns float32 too, and the same values and gradients."""
    N, C = 50, 300
    x = (3 * torch.randn(N, C)).to(logits_dtype).requires_grad_()
    y = torch.randint(0, C, (N,))
    y[::7] = -100
    kw = dict(options)
    if kw.pop("weight", False):
        kw["weight"] = torch.rand(C, dtype=BF16)  # cast to float32 by autocast, as natively
    with torch.autocast(**AUTOCAST):
        ours = tmf.cross_entropy(x, y, **kw)
        native = F.cross_entropy(x, y, **kw)
        module = tma.CrossEntropyLoss(**kw)(x, y)
    assert ours.dtype == native.dtype == module.dtype == F32
    torch.testing.assert_close(ours, native, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(module, native, atol=1e-5, rtol=1e-5)
    g = torch.rand_like(native)
    (gx_ours,) = torch.autograd.grad(ours, x, g)
    (gx_native,) = torch.autograd.grad(native, x, g)
    assert gx_ours.dtype == gx_native.dtype == logits_dtype
    tol = 1e-6 if logits_dtype == F32 else 1e-2  # both round the same float32 gradient to bf16
    torch.testing.assert_close(gx_ours, gx_native, atol=tol, rtol=tol)


def test_cross_entropy_op_autocast():
    x = torch.randn(20, 50, dtype=BF16)
    y = torch.randint(0, 50, (20,))
    with torch.autocast(**AUTOCAST):
        loss, lse = torch.ops.masked_attn.cross_entropy(x, y, None, "mean", -100, 0.0, 0.0, None, False)
    assert loss.dtype == F32
    torch.testing.assert_close(loss, F.cross_entropy(x.float(), y), atol=1e-6, rtol=1e-6)


def test_mha_autocast_matches_native():
    torch.manual_seed(0)
    native = torch.nn.MultiheadAttention(64, 4, batch_first=True)
    ours = tma.MultiheadAttention(64, 4, batch_first=True)
    ours.load_state_dict(native.state_dict())
    x = torch.randn(3, 21, 64)
    pad = torch.zeros(3, 21, dtype=torch.bool)
    pad[1, 15:] = True
    with torch.autocast(**AUTOCAST):
        o_ours, _ = ours(x, x, x, key_padding_mask=pad, need_weights=False)
        o_nat, _ = native(x, x, x, key_padding_mask=pad, need_weights=False)
    assert o_ours.dtype == o_nat.dtype
    torch.testing.assert_close(o_ours.float(), o_nat.float(), atol=3e-2, rtol=3e-2)


def test_linear_cross_entropy_autocast_matches_native():
    h = torch.randn(40, 32, requires_grad=True)
    w = torch.randn(100, 32, requires_grad=True)
    y = torch.randint(0, 100, (40,))
    with torch.autocast(**AUTOCAST):
        ours = tmf.linear_cross_entropy(h, w, y)
        native = F.cross_entropy(F.linear(h, w), y)
    assert ours.dtype == native.dtype == F32
    torch.testing.assert_close(ours, native, atol=2e-2, rtol=2e-2)
    gh, gw = torch.autograd.grad(ours, (h, w))
    nh, nw = torch.autograd.grad(native, (h, w))
    assert gh.dtype == nh.dtype == F32 and gw.dtype == nw.dtype == F32
    torch.testing.assert_close(gh, nh, atol=2e-2, rtol=5e-2)
    torch.testing.assert_close(gw, nw, atol=2e-2, rtol=5e-2)


def test_compile_under_autocast():
    """torch.compile traces the autocast registration (the Python dispatcher's kernel)."""
    q, k, v = (t.detach() for t in _qkv(DTYPE_SETS["rotary-mix"]))

    def f(q, k, v):
        with torch.autocast(**AUTOCAST):
            return tmf.masked_attention(q, k, v, is_causal=True)

    eager = f(q, k, v)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v)
    assert compiled.dtype == eager.dtype == BF16
    assert torch.equal(compiled, eager)
