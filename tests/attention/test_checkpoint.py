"""Activation checkpointing (torch.utils.checkpoint, use_reentrant=False, as Hugging Face
transformers uses it): each saved tensor may be unpacked only once in a backward."""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import torch_masked_attn as tma
from torch_masked_attn.functional import masked_attention


def _grads(fn, *inputs):
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    fn(*inputs).square().sum().backward()
    return [t.grad for t in inputs]


def test_masked_attention_under_checkpoint():
    q = torch.randn(2, 4, 9, 8, dtype=torch.float64)
    k = torch.randn(2, 2, 9, 8, dtype=torch.float64)
    v = torch.randn(2, 2, 9, 8, dtype=torch.float64)
    kpm = torch.zeros(2, 9, dtype=torch.bool)
    kpm[1, 6:] = True

    def attn(q, k, v):
        return masked_attention(q, k, v, key_padding_mask=kpm, is_causal=True)

    plain = _grads(attn, q, k, v)
    ckpt = _grads(lambda *t: checkpoint(attn, *t, use_reentrant=False), q, k, v)
    for a, b in zip(plain, ckpt):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


@pytest.mark.parametrize("recompute", [False, True])
def test_multihead_attention_under_checkpoint(recompute):
    mha = tma.MultiheadAttention(16, 4, batch_first=True, dtype=torch.float64)
    mha.recompute_projection = recompute
    x = torch.randn(2, 7, 16, dtype=torch.float64)

    def run(x):
        return mha(x, x, x, need_weights=False)[0]

    plain = _grads(run, x)
    mha.zero_grad()
    ckpt = _grads(lambda t: checkpoint(run, t, use_reentrant=False), x)
    torch.testing.assert_close(ckpt[0], plain[0], rtol=0, atol=0)
