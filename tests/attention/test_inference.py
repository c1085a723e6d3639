"""The forward ops' for_backward: a call with no backward to follow (grad mode
off, or no input requiring grad) asks the kernels for no out_lo, and bfloat16's
tile products may then round P to bfloat16 (docs/design.md, section 6). The
wrappers must pass it exactly when no gradient can flow, or a backward would
lose out_lo's precision; the raw op with for_backward=False stays
differentiable (delta from out alone, as FlashAttention's)."""

import pytest
import torch

import torch_masked_attn as tma
from conftest import ISAS, TILE_ISAS, assert_close_ref
from reference import attention64

tmaF = tma.functional


class ForwardCalls(torch.utils._python_dispatch.TorchDispatchMode):
    """The for_backward of every masked_attn forward op that reaches the dispatcher."""

    def __init__(self):
        super().__init__()
        self.flags = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "masked_attn" and func.__name__.split(".")[0] in ("forward", "varlen_forward"):
            schema = [a.name for a in func._schema.arguments]
            i = schema.index("for_backward")
            self.flags.append(kwargs.get("for_backward", args[i] if len(args) > i else True))
        return func(*args, **kwargs)


def _flags(fn):
    with ForwardCalls() as rec:
        fn()
    assert rec.flags, "no masked_attn forward op was called"
    return rec.flags


def _qkv(dtype=torch.bfloat16, requires_grad=False, shape=(2, 4, 33, 16)):
    return [torch.randn(*shape, dtype=dtype).requires_grad_(requires_grad) for _ in range(3)]


@pytest.mark.parametrize("call", ["sdpa", "sdpa_mask", "masked_attention", "varlen"])
def test_wrappers_pass_for_backward(call):
    def run(q, k, v):
        if call == "sdpa":
            return tmaF.scaled_dot_product_attention(q, k, v, is_causal=True)
        if call == "sdpa_mask":
            mask = torch.rand(33, 33) > 0.3
            mask[:, 0] = True
            return tmaF.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        if call == "masked_attention":
            return tmaF.masked_attention(q, k, v, key_padding_mask=torch.zeros(2, 33, dtype=torch.bool))
        cu = torch.tensor([0, 10, 33], dtype=torch.int32)
        return tmaF.varlen_attn(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu, 23, 23)

    q, k, v = _qkv()
    assert _flags(lambda: run(q, k, v)) == [False]  # no input requires grad
    q, k, v = _qkv(requires_grad=True)
    with torch.no_grad():
        assert _flags(lambda: run(q, k, v)) == [False]  # grad mode off
    assert _flags(lambda: run(q, k, v)) == [True]
    q, k, v = _qkv()
    assert _flags(lambda: run(q, k, v.requires_grad_())) == [True]  # any one input


def test_mask_requiring_grad_is_for_backward():
    """A floating mask that requires grad gets a gradient from dS, which needs
    delta at out_lo's precision: for_backward although q, k, v need none."""
    q, k, v = _qkv()
    mask = torch.randn(2, 1, 33, 33, dtype=torch.bfloat16, requires_grad=True)
    assert _flags(lambda: tmaF.masked_attention(q, k, v, attn_mask=mask)) == [True]
    hm = torch.rand(4, dtype=torch.bfloat16, requires_grad=True)
    assert _flags(lambda: tmaF.masked_attention(q, k, v, head_mask=hm)) == [True]


def test_mha_passes_for_backward():
    mha = tma.MultiheadAttention(64, 4, batch_first=True).bfloat16()
    x = torch.randn(2, 10, 64, dtype=torch.bfloat16)
    assert _flags(lambda: mha(x, x, x)) == [True]  # its parameters require grad
    with torch.no_grad():
        assert _flags(lambda: mha(x, x, x)) == [False]
    mha.eval()
    with torch.no_grad():
        assert _flags(lambda: mha(x, x, x)) == [False]
    hm = torch.rand(4, dtype=torch.bfloat16, requires_grad=True)
    with torch.no_grad():  # an input that requires grad, grad mode off: no backward can follow
        assert _flags(lambda: mha(x, x, x, head_mask=hm)) == [False]
    mha.train()
    mha.recompute_projection = True  # the whole block as one node
    assert _flags(lambda: mha(x, x, x)) == [True]
    mha.recompute_projection = None
    mha.requires_grad_(False)
    assert _flags(lambda: mha(x, x, x)) == [False]


@pytest.mark.parametrize(
    "kw", [dict(head_mask=[1.0] * 4), dict(key_padding_mask=[[False] * 33] * 2)], ids=["head_mask", "key_padding_mask"]
)
def test_non_tensor_mask_gets_the_op_error(kw):
    """grad_wanted looks only at tensors: a list where a mask belongs still gets
    the op's own error, which names the argument."""
    q, k, v = _qkv()
    with pytest.raises(RuntimeError, match=next(iter(kw))):
        tmaF.masked_attention(q, k, v, **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_raw_op_out_lo(dtype):
    """for_backward=False: out_lo is empty (the fake kernel agrees: opcheck);
    out is the for_backward=True call's, bit for bit, on every variant without
    bfloat16 tile products, and within the 2x rule on those; a backward still
    runs, from out alone."""
    q, k, v = _qkv(dtype, requires_grad=True)
    fwd = torch.ops.masked_attn.forward.default
    args = (q, k, v, None, None, None, True, None, False, 0.0, None)
    for isa in ISAS:
        if not tma.ops.isa_available(isa):
            continue
        with tma.ops.use_isa(isa):
            out_t, _, _, lo_t = fwd(*args, True)
            out_f, _, _, lo_f = fwd(*args, False)
        assert lo_f.numel() == 0
        assert lo_t.numel() == (q.numel() if dtype != torch.float32 else 0)
        if isa in TILE_ISAS and dtype == torch.bfloat16:  # P in one part (design.md, section 6)
            q64, k64, v64 = (t.detach().double() for t in (q, k, v))
            with torch.no_grad():
                native = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            assert_close_ref(out_f, native, attention64(q64, k64, v64, is_causal=True), name=f"{isa} out")
        else:
            torch.testing.assert_close(out_f, out_t, rtol=0, atol=0, msg=lambda m: f"{isa}: {m}")
    torch.library.opcheck(
        fwd,
        args + (False,),
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"),
    )
    out_f = fwd(*args, False)[0]
    g = torch.randn_like(out_f)
    got = torch.autograd.grad(out_f, (q, k, v), g)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = torch.autograd.grad(attention64(q64, k64, v64, is_causal=True), (q64, k64, v64), g.double())
    for name, a, r in zip("qkv", got, ref):
        err = (a.double() - r).abs().max().item()
        assert err < (3e-2 if dtype != torch.float32 else 1e-4) * max(r.abs().max().item(), 1.0), (name, err)


def test_varlen_raw_op_out_lo():
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in _qkv())
    cu = torch.tensor([0, 10, 33], dtype=torch.int32)
    f = torch.ops.masked_attn.varlen_forward.default
    args = (q, k, v, cu, cu, 23, 23, None, None, None)
    assert f(*args, True)[2].shape == q.shape
    assert f(*args, False)[2].numel() == 0
    torch.library.opcheck(f, args + (False,), test_utils=("test_schema", "test_faketensor"))
