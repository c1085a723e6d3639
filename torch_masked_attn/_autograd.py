"""The gradients of the ops.

How gradients are registered
----------------------------
One mechanism for the ops: an Autograd kernel made by register_autograd
below, at the end of each op's section (masked_attn::forward ->
_forward_backward, masked_attn::cross_entropy -> _cross_entropy_backward).
It is torch.library.register_autograd's own wrapper (an autograd.Function
that redispatches below autograd and calls setup_context with every argument,
defaults filled in), with one difference: torch's fills the defaults in by
reading schema.arguments, which builds a new list of Argument objects, once
per argument, on every call: for masked_attn::forward's 15 arguments (16
now) about 67 us a call (torch 2.13, Zen 3), more than the op itself takes on a small
model's layer. Here the defaults are read once, at registration. The other ops
(backward, backward_into, cross_entropy_backward(_), cross_entropy_chunk_)
are building blocks of backwards and have no gradient of their own.

Four torch.autograd.Function subclasses remain, each for a reason the op-level
registration cannot express (a one-line comment at each points back here):

* _autograd.py, _FirstOrderOnly: not a gradient formula but a guard. It wraps the
  gradients our backward kernels return, so that differentiating them again
  (double backward after create_graph=True) raises instead of silently giving
  zero. It needs a node of its own in the recorded backward graph.
* modules.py, _PackedSelfAttention: self-attention on one fused qkv
  projection; its backward has the kernel write dq, dk, dv straight into one
  qkv-shaped buffer (masked_attn::backward_into). Through the op, the three
  gradients would go back through the q, k, v views of qkv: zero-filled
  buffers and copies.
* modules.py, _RecomputedSelfAttention: in-projection, attention and
  out-projection as one node, so that the forward need not save qkv (3
  activations per token) and the backward recomputes it. An op-level
  backward only sees the attention, not the projections around it.
* linear_ce.py, _LinearCrossEntropy: linear layer + cross-entropy without the
  (N, V) logits. Its chunking depends on the data (the rows kept by
  ignore_index) and, for 'mean' / 'sum', it computes the gradients in the
  forward and the backward only scales them: Python-level control flow over
  the ops, not one op with a backward.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from types import SimpleNamespace
from typing import NamedTuple

import torch
from torch import Tensor

from ._options import BACKWARD, BACKWARD_INTO, VARLEN_BACKWARD, AttnOptions, OpArgs, saved_out_lo


def call_op(op, *args):
    """``op(*args)``; when no argument needs a gradient, past the autograd
    layer: the op's registered autograd (a Python function) would only
    redispatch, and costs a few microseconds that a decoding step or a small
    model pays on every call. Under torch.compile the plain call, which
    dynamo traces."""
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and torch._C._any_requires_grad(*args)):
        return op(*args)
    with torch._C._AutoDispatchBelowAutograd():
        return op(*args)


def register_autograd(name: str, backward, setup_context) -> None:
    """torch.library.register_autograd for masked_attn::<name>, with the op's
    defaults read once (see "How gradients are registered" above): an Autograd
    kernel, given the dispatch key set, that runs an autograd.Function when an
    input needs a gradient and otherwise redispatches below autograd.
    setup_context(ctx, args, output) gets every argument by name (OpArgs.read;
    the dispatcher drops trailing ones equal to their defaults); backward sees
    ctx.needs, whether each of the op's inputs needs a gradient by name, and
    returns a dict of gradients by argument name."""
    op = getattr(torch.ops.masked_attn, name).default
    schema = OpArgs(op)
    below_autograd = torch._C._after_autograd_keyset

    def redispatch(keyset, args):
        with torch._C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset & below_autograd, *args)

    def forward(ctx, *args):  # args: the op's, then the key set
        out = redispatch(args[-1], args[:-1])
        setup_context(ctx, schema.read(args[:-1]), out)
        return out

    def backward_(ctx, *grads):
        ctx.needs = dict(zip(schema.names, ctx.needs_input_grad))
        return (*schema.grads(backward(ctx, *grads)), None)

    function = type(
        f"masked_attn_{name}",
        (torch.autograd.Function,),
        {"forward": staticmethod(forward), "backward": staticmethod(backward_)},
    )

    def kernel(keyset, *args):
        if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
            return function.apply(*args, keyset)
        return redispatch(keyset, args)

    _autograd_lib.impl(name, kernel, "Autograd", with_keyset=True)


_autograd_lib = torch.library.Library("masked_attn", "IMPL")  # kept for the registrations' lifetime


class AttnSaved(NamedTuple):
    """What attention_backward reads of a forward, by name (a NamedTuple:
    torch.compile traces its construction inside autograd.Functions)."""

    q: Tensor
    k: Tensor
    v: Tensor
    out: Tensor
    lse: Tensor
    attn_mask: Tensor | None = None
    key_padding_mask: Tensor | None = None
    head_mask: Tensor | None = None
    out_lo: Tensor | None = None


def _save(ctx, **tensors: Tensor | None) -> None:
    """ctx.save_for_backward by name: ctx.saved() gives them back as a namespace."""
    ctx.save_for_backward(*tensors.values())
    ctx.saved_names = tuple(tensors)


def saved(ctx) -> SimpleNamespace:
    """What _save kept, by name (unpacked once: activation checkpointing
    unpacks each saved tensor only once)."""
    return SimpleNamespace(**dict(zip(ctx.saved_names, ctx.saved_tensors)))


def _no_grad_with_int8_kv(fn: str, a: SimpleNamespace) -> None:
    if getattr(a, "k_scale", None) is not None:
        raise RuntimeError(
            f"{fn}: an 8-bit KV cache (k_scale, v_scale) is inference only (no backward); "
            "call it under torch.no_grad() or on tensors that do not require grad"
        )


def _forward_setup_context(ctx, a, output):
    _no_grad_with_int8_kv("masked_attention", a)
    out, lse, weights, out_lo = output
    ctx.opts = AttnOptions.from_op(a)
    _save(
        ctx,
        q=a.q,
        k=a.k,
        v=a.v,
        out=out,
        lse=lse,
        attn_mask=a.attn_mask,
        key_padding_mask=a.key_padding_mask,
        head_mask=a.head_mask,
        dropout_seed=a.dropout_seed,
        sinks=a.sinks,
        out_lo=saved_out_lo(out_lo),
    )
    ctx.scale, ctx.need_weights = a.scale, a.need_weights
    ctx.mark_non_differentiable(lse, out_lo)
    ctx.set_materialize_grads(False)


def attention_backward(
    t: AttnSaved | SimpleNamespace,
    opts: AttnOptions,
    needs: dict[str, bool],
    grad_out: Tensor | None,
    grad_weights: Tensor | None,
    *,
    scale: float | None = None,
    into: Sequence[Tensor] | None = None,
) -> dict[str, Tensor | None]:
    """The backward of masked_attn::forward from what it saved.

    t: q, k, v, out, lse, attn_mask, key_padding_mask, head_mask and out_lo
    (the forward's fourth output, None for float32 / float64) by name;
    opts: the forward's options (the same dropout mask is regenerated);
    needs: whether attn_mask, key_padding_mask, head_mask need a gradient,
    by name; into: optional (grad_q, grad_k, grad_v) views to write the
    q/k/v gradients into (masked_attn::backward_into). Returns the gradients
    of q, k, v, of the masks and of the sinks, reduced to their shapes, by
    name (the head mask's and the sinks' as the op returns them).
    """
    am_grad = t.attn_mask is not None and needs.get("attn_mask", False)
    kpm_grad = t.key_padding_mask is not None and needs.get("key_padding_mask", False)
    hm_grad = t.head_mask is not None and needs.get("head_mask", False)
    if grad_out is None:
        grad_out = torch.zeros_like(t.out)
    named = dict(
        grad_out=grad_out,
        grad_weights=grad_weights,
        q=t.q,
        k=t.k,
        v=t.v,
        out=t.out,
        lse=t.lse,
        attn_mask=t.attn_mask,
        key_padding_mask=t.key_padding_mask,
        head_mask=t.head_mask,
        scale=scale,
        head_mask_grad=hm_grad,
        mask_grad=am_grad or kpm_grad,
        out_lo=t.out_lo,
        **opts.op_args(),
    )
    if into is None:
        dq, dk, dv, dhm, dscores, dsinks = torch.ops.masked_attn.backward(*BACKWARD(**named))
    else:
        dq, dk, dv = into
        dhm, dscores, dsinks = torch.ops.masked_attn.backward_into(
            *BACKWARD_INTO(**named, grad_q=dq, grad_k=dk, grad_v=dv)
        )
    am, kpm = t.attn_mask, t.key_padding_mask  # not None where am_grad, kpm_grad
    return dict(
        q=dq,
        k=dk,
        v=dv,
        # an additive mask receives dL/dS summed over the dimensions it broadcasts over
        attn_mask=dscores.sum_to_size(am.shape).to(am.dtype) if am_grad and am is not None else None,
        key_padding_mask=dscores.sum((1, 2)).to(kpm.dtype) if kpm_grad and kpm is not None else None,
        head_mask=dhm if hm_grad else None,
        sinks=dsinks if opts.sinks is not None and needs.get("sinks", False) else None,
    )


def _needs(ctx, *indices):
    """ctx.needs_input_grad at these input positions (the tuple can be shorter
    than the inputs when trailing optional tensors are None); for the
    autograd.Functions of modules.py."""
    n = ctx.needs_input_grad
    return tuple(bool(n[i]) if i < len(n) else False for i in indices)


# an autograd.Function, not register_autograd: see "How gradients are registered" above
class _FirstOrderOnly(torch.autograd.Function):
    """The identity on gradients our backward kernels computed. Those kernels
    are not differentiable themselves: when a backward is recorded
    (create_graph=True) and then differentiated again, this raises instead
    of letting a second-order gradient come out silently zero. The anchors
    (what the forward saw) only connect the node to the graph."""

    @staticmethod
    def forward(ctx, what, n_anchors, *tensors):
        ctx.what = what
        return tuple(g.view_as(g) for g in tensors[n_anchors:])

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(
            f"torch_masked_attn: the gradient of {ctx.what} is not differentiable: double backward "
            "(differentiating a gradient taken with create_graph=True) is not supported"
        )


def first_order_only(what: str, anchors: Iterable[object], *grads: Tensor | None) -> tuple[Tensor | None, ...]:
    """grads as they are, or, while a backward is being recorded
    (create_graph=True), routed through a node, hanging off the anchors
    (saved inputs), that raises if it is differentiated."""
    if not torch.is_grad_enabled():
        return grads
    anchors = tuple(a for a in anchors if isinstance(a, torch.Tensor) and a.requires_grad)
    idx = [i for i, g in enumerate(grads) if g is not None]
    if not idx or not anchors:
        return grads
    wrapped = _FirstOrderOnly.apply(what, len(anchors), *anchors, *(grads[i] for i in idx))
    out = list(grads)
    for i, w in zip(idx, wrapped):
        out[i] = w
    return tuple(out)


def first_order_only_named(what: str, anchors: Iterable[object], grads: dict[str, Tensor | None]) -> dict:
    """first_order_only over a dict of gradients by name."""
    return dict(zip(grads, first_order_only(what, anchors, *grads.values())))


def _forward_backward(ctx, grad_out, grad_lse, grad_weights, grad_out_lo):
    t = saved(ctx)
    grad_weights = grad_weights if ctx.need_weights else None
    grads = attention_backward(t, ctx.opts, ctx.needs, grad_out, grad_weights, scale=ctx.scale)
    return first_order_only_named("masked attention", vars(t).values(), grads)


register_autograd("forward", _forward_backward, _forward_setup_context)


def _varlen_setup_context(ctx, a, output):
    _no_grad_with_int8_kv("varlen_attn", a)
    out, lse, out_lo = output
    for name in ("block_table", "seqused_k"):
        if getattr(a, name) is not None:
            raise RuntimeError(
                f"varlen_attn: {name} is an inference-only parameter (no backward); "
                "call it under torch.no_grad() or on tensors that do not require grad"
            )
    _save(
        ctx,
        query=a.query,
        key=a.key,
        value=a.value,
        cu_seq_q=a.cu_seq_q,
        cu_seq_k=a.cu_seq_k,
        out=out,
        lse=lse,
        sinks=a.sinks,
        out_lo=saved_out_lo(out_lo),
    )
    ctx.opts = AttnOptions.from_op(a)
    ctx.max_q, ctx.max_k, ctx.scale = a.max_q, a.max_k, a.scale
    ctx.mark_non_differentiable(lse, out_lo)
    ctx.set_materialize_grads(False)


def _varlen_backward(ctx, grad_out, grad_lse, grad_out_lo):
    t = saved(ctx)
    if grad_out is None:
        return {}
    grad_out = grad_out.contiguous()
    dq, dk, dv, dsinks = torch.ops.masked_attn.varlen_backward(
        *VARLEN_BACKWARD(
            grad_out=grad_out,
            query=t.query,
            key=t.key,
            value=t.value,
            out=t.out,
            lse=t.lse,
            cu_seq_q=t.cu_seq_q,
            cu_seq_k=t.cu_seq_k,
            max_q=ctx.max_q,
            max_k=ctx.max_k,
            scale=ctx.scale,
            out_lo=t.out_lo,
            **ctx.opts.op_args(),
        )
    )
    n = ctx.needs
    grads = {"query": dq if n["query"] else None, "key": dk if n["key"] else None, "value": dv if n["value"] else None}
    grads = first_order_only_named("varlen attention", (t.query, t.key, t.value), grads)
    if t.sinks is not None and n.get("sinks"):
        grads["sinks"] = dsinks
    return grads


register_autograd("varlen_forward", _varlen_backward, _varlen_setup_context)


def _cross_entropy_setup_context(ctx, a, output):
    _, lse = output
    ctx.save_for_backward(a.input, a.target, a.weight, lse)
    ctx.reduction, ctx.ignore_index, ctx.label_smoothing = a.reduction, a.ignore_index, a.label_smoothing
    ctx.z_loss, ctx.softcap, ctx.inplace_backward = a.z_loss, a.softcap, a.inplace_backward
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)


def _cross_entropy_backward(ctx, grad_loss, grad_lse):
    input, target, weight, lse = ctx.saved_tensors
    target_grad = bool(ctx.needs["target"]) and target.is_floating_point()
    if grad_loss is None or not (ctx.needs["input"] or target_grad):
        return {}
    args = (target, weight, lse, ctx.reduction, ctx.ignore_index, ctx.label_smoothing)
    if ctx.inplace_backward and not target_grad:
        # the gradient overwrites the logits; the version bump makes any other
        # use of the saved logits in this graph fail loudly instead of silently
        torch.ops.masked_attn.cross_entropy_backward_(grad_loss, input, *args, ctx.z_loss, ctx.softcap)
        torch.autograd.graph.increment_version(input)
        return {"input": input}
    grad_input, grad_target = torch.ops.masked_attn.cross_entropy_backward(
        grad_loss, input, *args, target_grad, ctx.z_loss, ctx.softcap
    )
    return first_order_only_named(
        "cross_entropy",
        (input, target),
        {"input": grad_input if ctx.needs["input"] else None, "target": grad_target if target_grad else None},
    )


register_autograd("cross_entropy", _cross_entropy_backward, _cross_entropy_setup_context)
