"""bfloat16 and float16 backward: delta = dO . out taken from the float32
output (out + out_lo, the forward's fourth output) so that gradients that are
exactly zero in PyTorch's own computation stay zero, and out_lo is out's
rounding error, on every ISA."""

import pytest
import torch

import torch_masked_attn as tma
from conftest import ISAS, TILE_ISAS
from torch_masked_attn import ops


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("what", ["dropout", "sinks", "head_mask", "plain"])
def test_low_precision_delta_is_exact(dtype, what):
    """Every query sees one key (window (0, 0)): P = 1 for that key, so dS = 0
    and dq = dk = 0 exactly, as PyTorch's own bf16 computation gives. With
    delta = dO . out from the rounded out (scaled by dropout's 1 / (1 - p), a
    head mask or a sink's share), |dq| would reach ~0.02 and |dk| ~0.24 here
    (fuzzer findings). The forward's out_lo (out's rounding error) makes delta =
    dO . (out + out_lo) exact to float32 noise: with |dO| |out| ~ 1..10 (100
    with dropout's 1 / (1 - 0.9)) that is ~1e-6 (1e-5), where one bf16 ulp of
    1 is 8e-3."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 3, 70, 24, generator=g).to(dtype).requires_grad_() for _ in range(3))
    kw = {"window": (0, 0)}
    if what == "dropout":
        kw.update(dropout_p=0.9, dropout_seed=torch.tensor([3, 4]))
    if what == "head_mask":
        kw["head_mask"] = torch.tensor([0.7, 1.3, 1.1], dtype=dtype)
    if what == "sinks":
        kw["sinks"] = torch.full((3,), -1.0)  # P(key) = 1 / (1 + e^(sink - s)) < 1: dS != 0, but tiny
    out = tma.functional.masked_attention(q, k, v, **kw)
    dq, dk, _ = torch.autograd.grad(out, (q, k, v), torch.randn(out.shape, generator=g).to(dtype))
    if what != "sinks":
        bound = 1e-4 if what == "dropout" else 1e-5
        assert dq.abs().max().item() <= bound and dk.abs().max().item() <= bound
        return
    # with a sink: against float64
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out64 = tma.functional.masked_attention(q64, k64, v64, window=(0, 0), sinks=kw["sinks"].double())
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(8)).to(dtype)
    dq, dk, _ = torch.autograd.grad(tma.functional.masked_attention(q, k, v, **kw), (q, k, v), go)
    r = torch.autograd.grad(out64, (q64, k64, v64), go.double())
    tol = 2**-7 if dtype == torch.bfloat16 else 2**-10
    for ours, ref in zip((dq, dk), r):
        assert (ours.double() - ref).abs().max().item() <= tol * ref.abs().max().item() + 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("isa", ISAS)
def test_out_lo_is_outs_rounding_error(dtype, isa):
    """The forward's fourth output: out + out_lo is the float32 output before
    rounding, to 16 (bf16) / 22 (fp16) bits, where out alone has 8 / 11: against
    the float64 reference of the same (rounded) inputs, through the real and the
    varlen forward, with a head mask scaling the output."""
    if not ops.isa_available(isa):
        pytest.skip(f"this CPU does not run the {isa} kernels")
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 130, 40, generator=g).to(dtype) for _ in range(3))
    hm = torch.tensor([0.7, 1.3, 1.1], dtype=dtype)
    with ops.use_isa(isa):
        out, _, _, lo = torch.ops.masked_attn.forward(q, k, v, None, None, hm, True, None, False)
        vout, _, vlo = torch.ops.masked_attn.varlen_forward(
            q[0].transpose(0, 1).contiguous(),
            k[0].transpose(0, 1).contiguous(),
            v[0].transpose(0, 1).contiguous(),
            torch.tensor([0, 130], dtype=torch.int32),
            torch.tensor([0, 130], dtype=torch.int32),
            130,
            130,
            None,
            window_left=-1,
            window_right=0,
        )
    ref = tma.functional.masked_attention(q.double(), k.double(), v.double(), head_mask=hm.double(), is_causal=True)
    assert lo.dtype == dtype and lo.shape == out.shape
    bits = 8 if dtype == torch.bfloat16 else 11  # significand bits of the dtype
    # the float32 output o that out + out_lo holds is itself exact to float32 noise, except where the
    # tile products keep P in two bfloat16 parts (amx, avx512bf16: about 16 bits, docs/design.md,
    # section 6), which bounds float16's o below its 22 bits
    o_bits = min(2 * bits, 15) if isa in TILE_ISAS else 2 * bits
    top = ref.abs().max().item()
    err_hi = (out.double() - ref).abs().max().item()
    err = (out.double() + lo.double() - ref).abs().max().item()
    assert err_hi > 2.0 ** -(bits + 3) * top  # out alone: the dtype's rounding
    assert err <= 2.0**-o_bits * top + 2e-6, (err, err_hi)  # out + out_lo: about twice the bits
    vref = ref[0] / hm.double()[:, None, None]
    verr = (vout.double() + vlo.double() - vref.transpose(0, 1)).abs().max().item()
    assert verr <= 2.0**-o_bits * top + 2e-6, verr
    # float32: no out_lo
    assert (
        torch.ops.masked_attn.forward(q.float(), k.float(), v.float(), None, None, None, False, None, False)[3].numel()
        == 0
    )
