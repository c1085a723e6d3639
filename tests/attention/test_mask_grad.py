"""Gradients of floating masks (learned position biases): gradcheck in float64
on both backward paths, and parity with F.scaled_dot_product_attention and
nn.MultiheadAttention."""

import pytest
import torch
import torch.nn.functional as F
from torch.autograd import gradcheck

import torch_masked_attn as tma


@pytest.mark.parametrize("B,H,Hkv", [(2, 2, 1), (4, 8, 4)], ids=["B2-H2-Hkv1", "B4-H8-Hkv4"])
@pytest.mark.parametrize("mask_shape", ["(Lq,Lk)", "(H,Lq,Lk)", "(B,1,1,Lk)", "(B,H,Lq,Lk)"])
def test_mask_gradcheck(B, H, Hkv, mask_shape):
    torch.manual_seed(0)
    Lq, Lk = 5, 6
    q = torch.randn(B, H, Lq, 3, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, Hkv, Lk, 3, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, Hkv, Lk, 2, dtype=torch.float64, requires_grad=True)
    shape = {"(Lq,Lk)": (Lq, Lk), "(H,Lq,Lk)": (H, Lq, Lk), "(B,1,1,Lk)": (B, 1, 1, Lk), "(B,H,Lq,Lk)": (B, H, Lq, Lk)}[
        mask_shape
    ]
    am = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    kpm = torch.randn(B, Lk, dtype=torch.float64, requires_grad=True)
    assert gradcheck(
        lambda q, k, v, am, kpm: tma.functional.masked_attention(
            q, k, v, attn_mask=am, key_padding_mask=kpm, is_causal=True
        ),
        (q, k, v, am, kpm),
    )


def test_sdpa_mask_grad_matches_torch():
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 4, 33, 8) for _ in range(3))
    bias = torch.randn(4, 33, 33, requires_grad=True)  # a learned per-head bias
    g = torch.randn(2, 4, 33, 8)
    ours = torch.autograd.grad(tma.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias), bias, g)[0]
    ref = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, attn_mask=bias), bias, g)[0]
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)


def test_mha_float_mask_grad_matches_torch():
    torch.manual_seed(2)
    native = torch.nn.MultiheadAttention(16, 4, batch_first=True)
    ours = tma.MultiheadAttention(16, 4, batch_first=True)
    ours.load_state_dict(native.state_dict())
    x = torch.randn(3, 10, 16)
    mask0 = torch.randn(3 * 4, 10, 10)  # the (N*H, L, S) form
    grads = []
    for m in (native, ours):
        mask = mask0.clone().requires_grad_()
        y, _ = m(x, x, x, attn_mask=mask)
        grads.append(torch.autograd.grad(y.sum(), mask)[0])
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-5)


def test_bool_masks_need_no_gradient_buffer():
    """The (B, H, Lq, Lk) buffer exists only when a floating mask requires grad."""
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    lse = torch.ops.masked_attn.forward(q, k, v, None, None, None, True, None, False)[1]
    out = torch.ops.masked_attn.forward(q, k, v, None, None, None, True, None, False)[0]
    res = torch.ops.masked_attn.backward(
        torch.ones_like(out), None, q, k, v, out, lse, None, None, None, True, None, False, False
    )
    assert res[4].numel() == 0
