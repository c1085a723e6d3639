"""The fake kernels of every op: shapes and dtypes only, for torch.compile,
FakeTensor and meta tensors.

They also run for real when any argument is a meta tensor (the dispatcher
picks Meta over CPU), so they check what the CPU kernels rely on first: one
device for every tensor. Each reads the call's arguments by name (OpArgs)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import Tensor

from ._options import BACKWARD, BACKWARD_INTO, FORWARD, VARLEN_BACKWARD, VARLEN_FORWARD, _has_out_lo, _lse_dtype


def _same_device(op: str, a: SimpleNamespace | None = None, **tensors: Tensor | None) -> None:
    """All the tensors of a call (a, read by OpArgs, or the keyword arguments) on one device."""
    first_name, first = None, None
    for name, t in (vars(a) if a is not None else tensors).items():
        if not isinstance(t, Tensor):
            continue
        if first is None:
            first_name, first = name, t
        elif t.device != first.device:
            raise RuntimeError(
                f"masked_attn.{op}: expected all tensors on one device, got {first_name} "
                f"on {first.device} and {name} on {t.device}"
            )


def _blhd(like: Tensor, B: int, H: int, L: int, D: int) -> Tensor:
    """A (B, H, L, D) tensor stored as (B, L, H, D), as the shim allocates them (shim/attention.cpp)."""
    return like.new_empty(B, L, H, D).transpose(1, 2)


@torch.library.register_fake("masked_attn::forward")
def _forward_fake(*args, **kwargs):
    a = FORWARD.read(args, kwargs)
    _same_device("forward", a)
    q, k, v = a.q, a.k, a.v
    torch._check(q.dim() == 4 and k.dim() == 4 and v.dim() == 4, lambda: "masked_attn: q, k, v must be 4-D")
    B, H, Lq, _ = q.shape
    Lk, Dv = k.shape[2], v.shape[3]
    out = _blhd(q, B, H, Lq, Dv)
    lse = q.new_empty(B, H, Lq, dtype=_lse_dtype(q.dtype))
    weights = q.new_empty(B, H, Lq, Lk) if a.need_weights else q.new_empty(0)
    out_lo = _blhd(q, B, H, Lq, Dv) if _has_out_lo(q.dtype) and a.for_backward else q.new_empty(0)
    return out, lse, weights, out_lo


def _options_grads_fake(a: SimpleNamespace, like: Tensor) -> tuple[Tensor, Tensor]:
    """(grad_head_mask, grad_sinks) of a backward call: reduced to the head
    mask's and the sinks' shapes and dtypes, empty (acc type) without them."""
    acc = _lse_dtype(like.dtype)
    hm, sinks = getattr(a, "head_mask", None), a.sinks
    want = getattr(a, "head_mask_grad", False) and hm is not None
    grad_hm = hm.new_empty(hm.shape) if want and hm is not None else like.new_empty(0, dtype=acc)
    return grad_hm, (sinks.new_empty(sinks.shape) if sinks is not None else like.new_empty(0, dtype=acc))


def _backward_fake_grads(a: SimpleNamespace) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_head_mask, grad_scores, grad_sinks) of a backward call."""
    q = a.q
    B, H, Lq = q.shape[:3]
    acc = _lse_dtype(q.dtype)
    grad_hm, grad_sinks = _options_grads_fake(a, q)
    grad_scores = q.new_empty(B, H, Lq, a.k.shape[2], dtype=acc) if a.mask_grad else q.new_empty(0, dtype=acc)
    return grad_hm, grad_scores, grad_sinks


@torch.library.register_fake("masked_attn::backward_into")
def _backward_into_fake(*args, **kwargs):
    a = BACKWARD_INTO.read(args, kwargs)
    _same_device("backward_into", a)
    return _backward_fake_grads(a)


@torch.library.register_fake("masked_attn::backward")
def _backward_fake(*args, **kwargs):
    a = BACKWARD.read(args, kwargs)
    _same_device("backward", a)
    q, k, v = a.q, a.k, a.v
    grads = tuple(_blhd(q, t.shape[0], t.shape[1], t.shape[2], t.shape[3]) for t in (q, k, v))
    return (*grads, *_backward_fake_grads(a))


@torch.library.register_fake("masked_attn::varlen_forward")
def _varlen_forward_fake(*args, **kwargs):
    a = VARLEN_FORWARD.read(args, kwargs)
    _same_device("varlen_forward", a)
    query, key, value = a.query, a.key, a.value
    kv_dim = 3 if a.block_table is None else 4
    torch._check(
        query.dim() == 3 and key.dim() == kv_dim and value.dim() == kv_dim,
        lambda: "masked_attn.varlen: query must be 3-D (T, H, D), key and value 3-D (or 4-D paged)",
    )
    T, H, _ = query.shape
    Dv = value.shape[-1]
    out_lo = query.new_empty(T, H, Dv) if _has_out_lo(query.dtype) and a.for_backward else query.new_empty(0, H, Dv)
    return query.new_empty(T, H, Dv), query.new_empty(H, T, dtype=_lse_dtype(query.dtype)), out_lo


@torch.library.register_fake("masked_attn::varlen_backward")
def _varlen_backward_fake(*args, **kwargs):
    a = VARLEN_BACKWARD.read(args, kwargs)
    _same_device("varlen_backward", a)
    grads = tuple(t.new_empty(t.shape) for t in (a.query, a.key, a.value))
    return (*grads, _options_grads_fake(a, a.query)[1])


def _ce_rows_shape(input):
    return tuple(input.shape[:1]) + tuple(input.shape[2:]) if input.dim() >= 2 else ()


@torch.library.register_fake("masked_attn::cross_entropy")
def _cross_entropy_fake(
    input,
    target,
    weight=None,
    reduction="mean",
    ignore_index=-100,
    label_smoothing=0.0,
    z_loss=0.0,
    softcap=None,
    inplace_backward=False,
):
    _same_device("cross_entropy", input=input, target=target, weight=weight)
    torch._check(input.dim() >= 1, lambda: "masked_attn.cross_entropy: input must have a class dim")
    rows = _ce_rows_shape(input)
    loss = input.new_empty(rows if reduction == "none" else ())
    lse = input.new_empty(rows, dtype=_lse_dtype(input.dtype))
    return loss, lse


@torch.library.register_fake("masked_attn::cross_entropy_backward")
def _cross_entropy_backward_fake(
    grad_loss,
    input,
    target,
    weight,
    lse,
    reduction,
    ignore_index,
    label_smoothing,
    target_grad=False,
    z_loss=0.0,
    softcap=None,
):
    _same_device("cross_entropy_backward", grad_loss=grad_loss, input=input, target=target, weight=weight, lse=lse)
    return input.new_empty(input.shape), input.new_empty(input.shape if target_grad else (0,))


@torch.library.register_fake("masked_attn::cross_entropy_backward_")
def _cross_entropy_backward_inplace_fake(
    grad_loss, input, target, weight, lse, reduction, ignore_index, label_smoothing, z_loss=0.0, softcap=None
):
    _same_device("cross_entropy_backward_", grad_loss=grad_loss, input=input, target=target, weight=weight, lse=lse)
    return None


# masked_attn::cache_write(key, value, key_cache!, value_cache!, slots) -> (): new rows written in
# place (functional.write_kv_cache); nothing to return.
@torch.library.register_fake("masked_attn::cache_write")
def _cache_write_fake(key, value, key_cache, value_cache, slots, key_scale=None, value_scale=None):
    _same_device("cache_write", key=key, value=value, key_cache=key_cache, value_cache=value_cache, slots=slots)
    return None


# masked_attn::quantize_kv(x) -> (q (rows, D) int8, scale (rows,) float32): an 8-bit cache's rows
# (functional.quantize_kv views them as x's shape).
@torch.library.register_fake("masked_attn::quantize_kv")
def _quantize_kv_fake(x):
    D = x.shape[-1]
    rows = x.numel() // D
    return x.new_empty(rows, D, dtype=torch.int8), x.new_empty(rows, dtype=torch.float32)


@torch.library.register_fake("masked_attn::cross_entropy_chunk_")
def _cross_entropy_chunk_fake(
    input, target, weight=None, grad_scale=None, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None
):
    _same_device("cross_entropy_chunk_", input=input, target=target, weight=weight)
    rows = _ce_rows_shape(input)
    acc = _lse_dtype(input.dtype)
    return input.new_empty(rows, dtype=acc), input.new_empty(rows, dtype=acc)
