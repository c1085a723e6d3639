"""torch.ops.masked_attn: load the compiled library, register fake (meta)
kernels and autograd for every op.

The ops themselves are defined in csrc/shim.cpp:

    masked_attn::forward(q, k, v, attn_mask?, key_padding_mask?, head_mask?,
                         is_causal, scale?, need_weights) -> (out, lse, weights)
    masked_attn::backward(grad_out, grad_weights?, q, k, v, out, lse, attn_mask?,
                          key_padding_mask?, head_mask?, is_causal, scale?,
                          head_mask_grad) -> (grad_q, grad_k, grad_v, grad_head_mask)

Conventions are nn.MultiheadAttention's: a bool mask is True where attention
is blocked; a floating mask is added to the scaled scores.
"""
import glob
import os

import torch

_here = os.path.dirname(os.path.abspath(__file__))
_libs = sorted(glob.glob(os.path.join(_here, "_C*.so")))
if not _libs:
    raise ImportError(
        "torch_masked_attn._C is not built; run `make setup` or "
        "`pip install --no-build-isolation -e .` in the repository")
torch.ops.load_library(_libs[0])


def _lse_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---- fake kernels: shapes and dtypes only --------------------------------

@torch.library.register_fake("masked_attn::forward")
def _forward_fake(q, k, v, attn_mask=None, key_padding_mask=None, head_mask=None,
                  is_causal=False, scale=None, need_weights=False):
    torch._check(q.dim() == 4 and k.dim() == 4 and v.dim() == 4,
                 lambda: "masked_attn: q, k, v must be 4-D")
    B, H, Lq, _ = q.shape
    Lk, Dv = k.shape[2], v.shape[3]
    out = q.new_empty(B, H, Lq, Dv)
    lse = q.new_empty(B, H, Lq, dtype=_lse_dtype(q.dtype))
    weights = q.new_empty(B, H, Lq, Lk) if need_weights else q.new_empty(0)
    return out, lse, weights


@torch.library.register_fake("masked_attn::backward")
def _backward_fake(grad_out, grad_weights, q, k, v, out, lse, attn_mask=None,
                   key_padding_mask=None, head_mask=None, is_causal=False, scale=None,
                   head_mask_grad=False):
    B, H = q.shape[:2]
    grad_hm = q.new_empty(B, H) if head_mask_grad else q.new_empty(0)
    return (q.new_empty(q.shape), q.new_empty(k.shape), q.new_empty(v.shape), grad_hm)


# ---- autograd ------------------------------------------------------------

def _forward_setup_context(ctx, inputs, output):
    q, k, v, attn_mask, key_padding_mask, head_mask, is_causal, scale, need_weights = inputs
    out, lse, weights = output
    ctx.save_for_backward(q, k, v, out, lse, attn_mask, key_padding_mask, head_mask)
    ctx.is_causal, ctx.scale, ctx.need_weights = is_causal, scale, need_weights
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)


def _forward_backward(ctx, grad_out, grad_lse, grad_weights):
    q, k, v, out, lse, attn_mask, key_padding_mask, head_mask = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    if not ctx.need_weights:
        grad_weights = None
    head_mask_grad = head_mask is not None and ctx.needs_input_grad[5]
    dq, dk, dv, dhm = torch.ops.masked_attn.backward(
        grad_out, grad_weights, q, k, v, out, lse, attn_mask, key_padding_mask, head_mask,
        ctx.is_causal, ctx.scale, head_mask_grad)
    if head_mask_grad:
        dhm = dhm.sum(0) if head_mask.dim() == 1 else dhm
        dhm = dhm.to(head_mask.dtype)
    else:
        dhm = None
    return dq, dk, dv, None, None, dhm, None, None, None


torch.library.register_autograd(
    "masked_attn::forward", _forward_backward, setup_context=_forward_setup_context)
