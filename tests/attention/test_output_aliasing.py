"""Outputs written over inputs or over each other: backward_into's gradients
aliasing q, k, v element for element (allowed: the backward reads every block
before it writes its gradient, with or without grad_weights), overlapping outputs, a gradient over
out_lo, and cross-entropy's in-place backward on an overlapping input: each
refused with an error naming the tensors, never a silent wrong answer."""

import pytest
import torch


def _qkv(B=2, H=2, L=70, D=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, L, D, generator=g, dtype=dtype) for _ in range(4)]


def _forward(q, k, v, causal=True):
    return torch.ops.masked_attn.forward(q, k, v, None, None, None, causal, None, False)


def _backward_into(go, gw, q, k, v, out, lse, dq, dk, dv):
    return torch.ops.masked_attn.backward_into(
        go, gw, q, k, v, out, lse, None, None, None, True, None, False, False, dq, dk, dv
    )


@pytest.mark.parametrize("with_weights", [False, True], ids=["plain", "grad_weights"])
def test_backward_into_over_qkv_is_exact(with_weights):
    """grad_q = q, grad_k = k, grad_v = v is allowed and gives the gradients backward gives,
    also where the weights have a gradient (their pre-pass only reads q and k)."""
    q, k, v, go = _qkv()
    out, lse, w, _ = torch.ops.masked_attn.forward(q, k, v, None, None, None, True, None, with_weights)
    gw = torch.randn_like(w) if with_weights else None
    dq, dk, dv, *_ = torch.ops.masked_attn.backward(
        go, gw, q, k, v, out, lse, None, None, None, True, None, False, False
    )
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    _backward_into(go, gw, q2, k2, v2, out, lse, q2, k2, v2)
    assert torch.equal(q2, dq) and torch.equal(k2, dk) and torch.equal(v2, dv)


def test_backward_into_over_another_input_is_refused():
    q, k, v, go = _qkv()
    out, lse, _, _ = _forward(q, k, v)
    with pytest.raises(RuntimeError, match="grad_q shares memory with k.*only grad_q = q"):
        _backward_into(go, None, q, k, v, out, lse, k, torch.empty_like(k), torch.empty_like(v))


@pytest.mark.parametrize(
    "case",
    [
        "k_and_v_one_buffer",
        "q_and_k_one_buffer",
        "self_overlapping_q",
        "q_over_out",
        "k_over_grad_out",
        "v_partly_over_k",
    ],
)
def test_backward_into_overlapping_outputs_are_refused(case):
    q, k, v, go = _qkv()
    out, lse, _, _ = _forward(q, k, v)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if case == "k_and_v_one_buffer":
        dv, match = dk, "grad_v and grad_k share memory"
    elif case == "q_and_k_one_buffer":
        dk, match = dq, "grad_k and grad_q share memory"
    elif case == "self_overlapping_q":
        base = torch.empty(q.numel())
        dq, match = base.as_strided(q.shape, (q.shape[1] * q.shape[2] * 8, q.shape[2] * 8, 8, 1)), "grad_q has elements"
    elif case == "q_over_out":
        dq, match = out, "grad_q shares memory with out"
    elif case == "k_over_grad_out":
        dk, match = go, "grad_k shares memory with grad_out"
    else:  # v a dense view starting inside k's memory
        buf = torch.empty(2 * k.numel())
        dk = buf[: k.numel()].view(k.shape)
        dv, match = buf[k.numel() // 2 : k.numel() // 2 + v.numel()].view(v.shape), "grad_v and grad_k share memory"
    with pytest.raises(RuntimeError, match=match):
        _backward_into(go, None, q, k, v, out, lse, dq, dk, dv)


def test_interleaved_views_of_one_buffer_are_allowed():
    """q, k, v gradients as the thirds of one packed (B, L, 3, H, D) buffer share no element: allowed."""
    q, k, v, go = _qkv()
    out, lse, _, _ = _forward(q, k, v)
    B, H, L, D = q.shape
    packed = torch.empty(B, L, 3, H, D)
    dq, dk, dv = (packed[:, :, i].transpose(1, 2) for i in range(3))
    _backward_into(go, None, q, k, v, out, lse, dq, dk, dv)
    ref = torch.ops.masked_attn.backward(go, None, q, k, v, out, lse, None, None, None, True, None, False, False)
    for got, want in zip((dq, dk, dv), ref[:3]):
        assert torch.equal(got, want)


def test_cross_entropy_inplace_backward_on_overlapping_input_is_refused():
    base = torch.randn(40)
    x = (base * 1.0).as_strided((4, 10), (3, 1)).requires_grad_(False)
    logits = x.clone().requires_grad_(True) * 1.0  # a non-leaf, as inplace_backward requires
    overlapping = logits.detach().as_strided((4, 10), (3, 1))
    t = torch.tensor([1, 2, 3, 4])
    with pytest.raises(RuntimeError, match="share memory"):
        torch.ops.masked_attn.cross_entropy(overlapping, t, None, "mean", -100, 0.0, 0.0, None, True)


def test_backward_into_over_out_lo_is_refused():
    """out_lo is read by the backward (delta): a gradient written over it is refused."""
    q, k, v, go = (t.bfloat16() for t in _qkv())
    out, lse, _, lo = _forward(q, k, v)
    with pytest.raises(RuntimeError, match="grad_q shares memory with out_lo"):
        torch.ops.masked_attn.backward_into(
            go,
            None,
            q,
            k,
            v,
            out,
            lse,
            None,
            None,
            None,
            True,
            None,
            False,
            False,
            lo,
            torch.empty_like(k),
            torch.empty_like(v),
            out_lo=lo,
        )
