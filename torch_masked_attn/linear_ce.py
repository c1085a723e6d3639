"""Fused linear cross-entropy: ``linear_cross_entropy`` and the
``LinearCrossEntropyLoss`` module, ``F.cross_entropy(F.linear(input, weight,
bias), target, ...)`` without ever holding the (N, V) logits: chunks of rows
through torch's matrix products and the cross-entropy kernel
(torch.ops.masked_attn.cross_entropy_chunk_ / cross_entropy_backward_). The
checks, reductions and the native fallback are losses.py's.
"""

from __future__ import annotations

import operator

import torch
from torch import Tensor, nn

from .devices import uses_kernels
from .losses import _KERNEL_DTYPES, _REDUCTIONS, _check_options, native_cross_entropy

__all__ = ["linear_cross_entropy", "LinearCrossEntropyLoss"]

# ---- fused linear cross-entropy -------------------------------------------------
#
# loss = cross_entropy(input @ weight.T + bias, target) without ever holding
# the (N, V) logits: the kept rows (target != ignore_index) are taken in
# chunks of chunk_size; per chunk the logits go to one (chunk, V) buffer
# (torch.mm / torch.addmm: the user's BLAS), the C kernel turns them into the
# per-row loss and, in the same pass over each row, into d loss / d logits,
# written over the buffer; two more matrix products give the chunk's share of
# grad_input and add its share of grad_weight (and grad_bias) to one
# accumulator. Peak memory: one (chunk, V) buffer + grad_weight (V, d).
#
# When a gradient is wanted and the loss is reduced ('mean' or 'sum'), the
# forward computes the gradients right away (d total / d logits is known up to
# the scalar grad_output), and the backward only scales them: three matrix
# products per chunk, as many as the unfused forward + backward. With
# reduction='none' the upstream gradient is a vector known only in the
# backward, which therefore recomputes each chunk's logits (four products).
# Ignored rows are dropped before the first product: they cost nothing.

_DEFAULT_CHUNK_BYTES = 64 << 20  # one chunk's logits: 64 MB


def _default_chunk_rows(n_rows, V, element_size):
    if n_rows <= 0:
        return 1
    rows = max(1, min(n_rows, _DEFAULT_CHUNK_BYTES // max(1, V * element_size)))
    n_chunks = -(-n_rows // rows)
    return -(-n_rows // n_chunks)  # equal chunks


def _lce_chunks(
    h, weight, bias, t, chunk, opts, grad_scale=None, dloss=None, lse=None, want_grads=(False, False, False)
):
    """One sweep over the kept rows h (Nk, d), targets t (Nk,), in chunks.

    Forward sweep (dloss None): returns per-row loss and lse (acc type); with
    grad_scale, also the gradients of grad_scale * sum(loss). Backward sweep
    (dloss (Nk,) given, lse the forward's): the gradients of sum(dloss * loss).
    Gradients: (grad_h (Nk, d) or None, grad_weight (V, d) or None, grad_bias or None).
    """
    ignore_index, ls, z_loss, softcap = opts
    Nk, d = h.shape
    V = weight.shape[0]
    want_h, want_w, want_b = want_grads
    grads = dloss is not None or grad_scale is not None
    acc = torch.float64 if h.dtype == torch.float64 else torch.float32
    low = h.dtype not in (torch.float32, torch.float64)  # accumulate grad_weight / bias in float32
    loss = torch.empty(Nk, dtype=acc) if dloss is None else None
    lse_out = torch.empty(Nk, dtype=acc) if dloss is None else None
    grad_h = torch.empty(Nk, d, dtype=h.dtype) if grads and want_h else None
    grad_w = torch.zeros(V, d, dtype=acc if low else weight.dtype) if grads and want_w else None
    grad_b = torch.zeros(V, dtype=acc) if grads and want_b else None
    buf = torch.empty(min(chunk, Nk), V, dtype=h.dtype)
    wt = weight.t()
    for s in range(0, Nk, chunk):
        e = min(s + chunk, Nk)
        hc, tc, logits = h[s:e], t[s:e], buf[: e - s]
        if bias is None:
            torch.mm(hc, wt, out=logits)
        else:
            torch.addmm(bias, hc, wt, out=logits)
        if dloss is None:
            assert loss is not None and lse_out is not None  # allocated above for a forward sweep
            l_c, lse_c = torch.ops.masked_attn.cross_entropy_chunk_(
                logits, tc, None, grad_scale, ignore_index, ls, z_loss, softcap
            )
            loss[s:e], lse_out[s:e] = l_c, lse_c
        else:  # logits -> d loss / d logits, scaled row by row by dloss
            assert lse is not None  # a backward sweep is given the forward's
            torch.ops.masked_attn.cross_entropy_backward_(
                dloss[s:e], logits, tc, None, lse[s:e], "none", ignore_index, ls, z_loss, softcap
            )
        if not grads:
            continue
        if grad_h is not None:
            torch.mm(logits, weight, out=grad_h[s:e])
        if grad_w is not None:
            if low:
                grad_w.add_(torch.mm(logits.t(), hc))
            else:
                grad_w.addmm_(logits.t(), hc)
        if grad_b is not None:
            grad_b.add_(logits.sum(0, dtype=acc))
    if grad_w is not None and low:
        grad_w = grad_w.to(weight.dtype)
    if grad_b is not None:
        assert bias is not None  # grad_b is wanted only with a bias
        grad_b = grad_b.to(bias.dtype)
    return loss, lse_out, (grad_h, grad_w, grad_b)


def _scatter_rows(grad_kept, kept, N):
    """(Nk, d) gradients of the kept rows into an (N, d) zero tensor."""
    if kept is None:
        return grad_kept
    out = grad_kept.new_zeros(N, grad_kept.shape[1])
    return out.index_copy_(0, kept, grad_kept)


# an autograd.Function, not register_autograd: see "How gradients are registered" in _autograd.py
class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, bias, t, ignore_index, reduction, ls, z_loss, softcap, chunk_size):
        N = h.shape[0]
        keep = t != ignore_index
        kept = None if bool(keep.all()) else keep.nonzero().squeeze(1)
        hk, tk = (h, t) if kept is None else (h.index_select(0, kept), t.index_select(0, kept))
        Nk, V = hk.shape[0], weight.shape[0]
        if Nk and (bool((tk < 0).any()) or bool((tk >= V).any())):
            bad = tk[(tk < 0) | (tk >= V)][0].item()
            raise IndexError(f"Target {bad} is out of bounds.")
        hk, tk = hk.contiguous(), tk.contiguous()
        chunk = chunk_size or _default_chunk_rows(Nk, V, h.element_size())
        opts = (ignore_index, ls, z_loss, softcap)
        want = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
        eager = any(want) and reduction != "none"
        divisor = Nk if reduction == "mean" else 1
        scale = (1.0 / divisor if divisor else 0.0) if eager else None
        loss_rows, lse, grads = _lce_chunks(hk, weight, bias, tk, chunk, opts, grad_scale=scale, want_grads=want)
        assert loss_rows is not None  # a forward sweep returns the rows' loss

        ctx.reduction, ctx.opts, ctx.chunk, ctx.N, ctx.want = reduction, opts, chunk, N, want
        ctx.eager = eager
        if eager:  # the backward only scales these by grad_output
            ctx.save_for_backward(_scatter_rows(grads[0], kept, N) if want[0] else None, grads[1], grads[2])
        elif any(want):  # reduction 'none': the backward recomputes the logits
            ctx.save_for_backward(hk, weight, bias, tk, lse, kept)
        if reduction == "none":
            out = loss_rows.new_zeros(N)
            out = out.index_copy_(0, kept, loss_rows) if kept is not None else loss_rows
            return out.to(h.dtype)
        total = loss_rows.sum(dtype=torch.float64)
        if reduction == "mean":
            total = total / Nk if Nk else torch.tensor(float("nan"), dtype=torch.float64)
        return total.to(h.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        nones = (None,) * 7
        if ctx.eager:
            grads = ctx.saved_tensors
            if not bool((grad_out == 1).all()):
                grads = tuple(None if g is None else g * grad_out.to(g.dtype) for g in grads)
            return grads + nones
        hk, weight, bias, tk, lse, kept = ctx.saved_tensors
        dloss = grad_out if kept is None else grad_out.index_select(0, kept)
        _, _, (gh, gw, gb) = _lce_chunks(
            hk, weight, bias, tk, ctx.chunk, ctx.opts, dloss=dloss.contiguous(), lse=lse, want_grads=ctx.want
        )
        if gh is not None:
            gh = _scatter_rows(gh, kept, ctx.N)
        return (gh, gw, gb) + nones


def _check_args(input, weight, target, bias, reduction, label_smoothing, chunk_size) -> None:
    """linear_cross_entropy's checks of its tensors (kinds, shapes, dtypes) and of reduction,
    chunk_size and label_smoothing."""
    for name, tensor in (("input", input), ("weight", weight), ("target", target)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"linear_cross_entropy: {name} must be a Tensor, got {type(tensor).__name__}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"linear_cross_entropy: reduction must be 'none', 'mean' or 'sum', got {reduction!r}")
    if input.dim() < 1 or weight.dim() != 2 or weight.shape[1] != input.shape[-1]:
        raise ValueError(
            f"linear_cross_entropy: input (..., d) and weight (V, d) do not match: input "
            f"{tuple(input.shape)}, weight {tuple(weight.shape)}"
        )
    if tuple(target.shape) != tuple(input.shape[:-1]):
        raise ValueError(
            f"linear_cross_entropy: target must have input's shape without its last dim, "
            f"{tuple(input.shape[:-1])}, got {tuple(target.shape)}"
        )
    if target.dtype != torch.int64:
        raise TypeError(f"linear_cross_entropy: target must be int64 class indices, got {target.dtype}")
    if (
        input.dtype not in _KERNEL_DTYPES
        or weight.dtype != input.dtype
        or (bias is not None and bias.dtype != input.dtype)
    ):
        raise TypeError(
            "linear_cross_entropy: input, weight and bias must have one dtype among float32, "
            f"float64, bfloat16, float16; got {input.dtype}, {weight.dtype}"
            + ("" if bias is None else f", {bias.dtype}")
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"linear_cross_entropy: bias must be (V,) = ({weight.shape[0]},), got {tuple(bias.shape)}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"linear_cross_entropy: chunk_size must be a positive int or None, got {chunk_size!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"linear_cross_entropy: label_smoothing must be in [0, 1], got {label_smoothing!r}")


def linear_cross_entropy(
    input: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    chunk_size: int | None = None,
) -> Tensor:
    """``F.cross_entropy(F.linear(input, weight, bias), target, ...)`` without
    the (N, V) logits: chunked over the tokens, the matrix products by torch,
    the loss and its gradient by the C kernel in one pass per row.

    input: (..., d) hidden states; weight: (V, d) (the LM head, as
    nn.Linear(d, V).weight); bias: (V,) or None; target: input's shape
    without d, int64 class indices, ``ignore_index`` anywhere. float32,
    float64, bfloat16 or float16, one dtype for input, weight and bias.
    reduction: 'mean' (over the kept rows; NaN when there is none),
    'sum' or 'none' (input's shape without d, 0 on ignored rows).
    label_smoothing, z_loss (``z_loss * lse**2`` per kept row) and softcap
    (``softcap * tanh(logits / softcap)``) as in :func:`cross_entropy`.
    chunk_size: rows per chunk (default: as many as fit 64 MB of logits).
    Gradients flow to input, weight and bias. With 'mean' / 'sum' they are
    computed in the forward (when grad mode is on and one of them requires
    grad) and held until the backward, which scales them by grad_output.
    """
    _check_args(input, weight, target, bias, reduction, label_smoothing, chunk_size)
    ignore_index = operator.index(ignore_index)
    z_loss, softcap = _check_options(z_loss, softcap, "linear_cross_entropy")
    d = input.shape[-1]
    if not uses_kernels(input.device):
        # another device: the logits materialised, then native_cross_entropy
        logits = nn.functional.linear(input.reshape(-1, d), weight, bias)
        loss = native_cross_entropy(
            logits,
            target.reshape(-1),
            reduction=reduction,
            ignore_index=ignore_index,
            label_smoothing=float(label_smoothing),
            z_loss=z_loss,
            softcap=softcap,
        )
        return loss.reshape(target.shape) if reduction == "none" else loss
    loss = _LinearCrossEntropy.apply(
        input.reshape(-1, d),
        weight,
        bias,
        target.reshape(-1),
        ignore_index,
        reduction,
        float(label_smoothing),
        z_loss,
        softcap,
        chunk_size,
    )
    return loss.reshape(target.shape) if reduction == "none" else loss


class LinearCrossEntropyLoss(nn.Module):
    """``loss_fn(input, weight, target, bias=None)`` = :func:`linear_cross_entropy`
    with the options fixed at construction. The LM head's weight (and bias)
    stay with the model: pass ``lm_head.weight``. No parameters, no state."""

    def __init__(
        self,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
        softcap: float | None = None,
        chunk_size: int | None = None,
    ) -> None:
        super().__init__()
        if reduction not in _REDUCTIONS:
            raise ValueError(f"LinearCrossEntropyLoss: reduction must be 'none', 'mean' or 'sum', got {reduction!r}")
        self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing
        self.z_loss, self.softcap = _check_options(z_loss, softcap, "LinearCrossEntropyLoss")
        self.chunk_size = chunk_size

    def forward(self, input: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None = None) -> Tensor:
        return linear_cross_entropy(
            input,
            weight,
            target,
            bias,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
            label_smoothing=self.label_smoothing,
            z_loss=self.z_loss,
            softcap=self.softcap,
            chunk_size=self.chunk_size,
        )

    def extra_repr(self) -> str:
        return (
            f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
            f"label_smoothing={self.label_smoothing}, z_loss={self.z_loss}, softcap={self.softcap}, "
            f"chunk_size={self.chunk_size}"
        )
