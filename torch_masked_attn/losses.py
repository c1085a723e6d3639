"""Cross-entropy drop-ins: functional ``cross_entropy``, the ``CrossEntropyLoss``
module and a ``perplexity`` helper, computed by torch.ops.masked_attn.cross_entropy
(C11 kernels on PyTorch's intra-op thread pool).

``cross_entropy`` takes F.cross_entropy's arguments and returns its values,
gradients and exceptions (type and message, as torch 2.13 raises them). It
converts PyTorch's conventions into the op's:

* the deprecated ``size_average`` / ``reduce`` and ``reduction`` into one of
  'none' | 'mean' | 'sum';
* ``label_smoothing <= 0`` (or NaN) into 0, as PyTorch does; above 1 is an error;
* uint8 class targets into int64;
* probability targets (same shape as input) of another dtype than the input:
  input, target and weight are computed in their promoted dtype, as PyTorch's
  ``-(log_softmax(input) * target * weight)`` is.

Where we differ from PyTorch (on purpose):

* gradients for ``weight`` are not computed. With class-index targets PyTorch
  refuses a weight that requires grad, and so do we (same message); with
  probability targets PyTorch differentiates it, we raise NotImplementedError.
* a (C,) input with a (1,) target and label_smoothing > 0 gives the loss;
  PyTorch 2.13 raises a broadcasting RuntimeError there.
"""

import functools
import math
import numbers
import operator
import re

import torch
from torch import Tensor, nn
from torch.nn import _reduction as _Reduction
from torch.overrides import handle_torch_function, has_torch_function_variadic

from . import (
    _validate,
    ops,  # noqa: F401  (registers torch.ops.masked_attn)
)
from .autocast import autocast_cast, autocast_dtype
from .devices import uses_kernels

__all__ = ["cross_entropy", "CrossEntropyLoss", "perplexity", "native_cross_entropy"]

_KERNEL_DTYPES = _validate.FLOATS
_REDUCTIONS = ("none", "mean", "sum")  # index = PyTorch's reduction enum
_OUT_OF_BOUNDS = re.compile(r"Target -?\d+ is out of bounds\.")

# c10::ScalarType names, as PyTorch's messages print dtypes.
_SCALAR_TYPE_NAMES = {
    torch.float32: "Float",
    torch.float64: "Double",
    torch.float16: "Half",
    torch.bfloat16: "BFloat16",
    torch.int64: "Long",
    torch.int32: "Int",
    torch.int16: "Short",
    torch.int8: "Char",
    torch.uint8: "Byte",
    torch.bool: "Bool",
    torch.complex64: "ComplexFloat",
    torch.complex128: "ComplexDouble",
    torch.complex32: "ComplexHalf",
    torch.uint16: "UInt16",
    torch.uint32: "UInt32",
    torch.uint64: "UInt64",
}


def _st(dtype):
    name = _SCALAR_TYPE_NAMES.get(dtype)
    if name is None:  # float8 and friends: torch.float8_e4m3fn -> Float8_e4m3fn
        name = str(dtype).replace("torch.", "")
        name = name[:1].upper() + name[1:]
    return name


def _sizes(shape):
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


# ---- argument checks, in the order PyTorch makes them -----------------------


def _check_arg_types(input, target, weight, ignore_index, label_smoothing):
    """What torch._C._nn.cross_entropy_loss's argument parser checks."""

    def bad(name, pos, want, got):
        return TypeError(
            f"cross_entropy_loss(): argument '{name}' (position {pos}) must be {want}, not {type(got).__name__}"
        )

    if not isinstance(input, torch.Tensor):
        raise bad("input", 1, "Tensor", input)
    if not isinstance(target, torch.Tensor):
        raise bad("target", 2, "Tensor", target)
    if weight is not None and not isinstance(weight, torch.Tensor):
        raise bad("weight", 3, "Tensor", weight)
    if isinstance(ignore_index, bool):
        raise bad("ignore_index", 5, "int", ignore_index)
    try:
        ignore_index = operator.index(ignore_index)
    except TypeError:
        raise bad("ignore_index", 5, "int", ignore_index) from None
    if isinstance(label_smoothing, torch.Tensor):
        if label_smoothing.dim() != 0:
            raise bad("label_smoothing", 6, "float", label_smoothing)
    elif not isinstance(label_smoothing, numbers.Real):
        raise bad("label_smoothing", 6, "float", label_smoothing)
    return ignore_index, float(label_smoothing)


def _check_label_smoothing(ls):
    if not ls <= 1.0:
        raise RuntimeError(f"label_smoothing must be between 0.0 and 1.0. Got: {ls:g}")


def _check_logits(input, class_dim):
    """log_softmax's refusal of non-floating inputs (what PyTorch hits first)."""
    if input.dtype not in _KERNEL_DTYPES:
        kernel = "log_softmax_lastdim_kernel_impl" if class_dim == input.dim() - 1 else "log_softmax_kernel_impl"
        raise NotImplementedError(f"\"{kernel}\" not implemented for '{_st(input.dtype)}'")


@functools.cache
def _native_target_dtype_error(dtype: torch.dtype) -> str | None:
    """PyTorch's own error for class-index targets of this dtype, or None when
    it accepts them. Asked of F.nll_loss on a tiny call (once per dtype): which
    dtypes pass and the message differ between torch versions (uint8 targets
    are accepted from 2.12 on)."""
    if dtype == torch.int64:
        return None
    try:
        nn.functional.nll_loss(torch.zeros(1, 2), torch.zeros(1, dtype=dtype))
    except RuntimeError as e:
        return str(e)
    return None


def _check_weight_no_grad(weight):
    if weight is not None and weight.requires_grad and torch.is_grad_enabled():
        raise RuntimeError(
            "The function 'nll_loss_forward' is not differentiable with respect to argument "
            "'weight'. This input cannot have requires_grad True."
        )


def _prepare_probabilities(input, target, weight, ignore_index, ls):
    """Probability targets (target.shape == input.shape): cross_entropy_loss_prob_target."""
    if not target.is_floating_point():
        raise RuntimeError(f"Expected floating point type for target with class probabilities, got {_st(target.dtype)}")
    if ignore_index >= 0:
        raise RuntimeError("ignore_index is not supported for floating point target")
    if input.dim() == 0:
        raise IndexError("Dimension specified as 1 but tensor has no dimensions")
    C = input.shape[0 if input.dim() == 1 else 1]
    if weight is not None and not (weight.dim() == 1 and weight.numel() == C):
        raise RuntimeError(
            f"cross_entropy: weight tensor should be defined either for all {C} "
            f"classes or no classes but got weight tensor of shape: {_sizes(weight.shape)}"
        )
    _check_logits(input, 0 if input.dim() == 1 else 1)
    if ls > 0:
        _check_label_smoothing(ls)
    if weight is not None and weight.requires_grad and torch.is_grad_enabled():
        raise NotImplementedError(
            "torch_masked_attn.cross_entropy: no gradient for weight with probability targets; pass weight.detach()"
        )
    dtype = torch.promote_types(input.dtype, target.dtype)
    if weight is not None:
        dtype = torch.promote_types(dtype, weight.dtype)
    if dtype not in _KERNEL_DTYPES:
        raise NotImplementedError(f"torch_masked_attn.cross_entropy: computing in {dtype} is not supported")
    input, target = input.to(dtype), target.to(dtype)
    weight = None if weight is None else weight.to(dtype)
    return input, target, weight


def _prepare_class_indices(input, target, weight, ignore_index, ls):
    """Class-index targets: cross_entropy_loss_label_smoothing / nll_loss_nd."""
    if ls > 0:
        _check_label_smoothing(ls)
    if input.dim() == 0:
        raise IndexError("Dimension out of range (expected to be in range of [-1, 0], but got 1)")
    _check_logits(input, 0 if input.dim() == 1 else 1)
    # nll_loss_nd
    if input.dim() != 1:
        target_batch = target.shape[0] if target.dim() > 0 else 0
        if input.shape[0] != target_batch:
            raise ValueError(
                f"Expected input batch_size ({input.shape[0]}) to match target batch_size ({target_batch})."
            )
    _check_weight_no_grad(weight)
    dtype_msg = _native_target_dtype_error(target.dtype)
    bad_dtype = dtype_msg is not None
    C = input.shape[-1] if input.dim() == 1 else input.shape[1]
    if input.dim() <= 2:  # nll_loss
        if target.dim() > 1:
            raise RuntimeError("0D or 1D target tensor expected, multi-target not supported")
        if bad_dtype:
            raise RuntimeError(dtype_msg)
        if input.dim() == 1 and target.dim() == 1 and target.shape[0] != 1:
            raise ValueError(f"For 1D input, 1D target must have size 1, but got target size: {target.shape[0]}")
        if input.dim() == 2 and target.dim() == 0:  # batch size 0 "matched" a 0-d target
            raise IndexError("Dimension specified as 0 but tensor has no dimensions")
        if weight is not None and not (weight.dim() == 1 and weight.numel() == C):
            raise RuntimeError(
                f"weight tensor should be defined either for all {C} classes or no "
                f"classes but got weight tensor of shape: {_sizes(weight.shape)}"
            )
    else:  # nll_loss2d; 3-D and >4-D inputs are viewed as 4-D first
        if input.dim() != 4:
            if tuple(target.shape[1:]) != tuple(input.shape[2:]):
                raise RuntimeError(
                    f"Expected target size {_sizes(input.shape[:1] + input.shape[2:])}, got {_sizes(target.shape)}"
                )
        elif target.dim() != 3:
            raise RuntimeError(
                f"only batches of spatial targets supported (3D tensors) but got targets of dimension: {target.dim()}"
            )
        if bad_dtype:
            raise RuntimeError(dtype_msg)
        if weight is not None and weight.numel() != C:
            raise RuntimeError("weight tensor should be defined either for all or no classes")
        if input.dim() == 4 and tuple(target.shape) != (input.shape[0],) + tuple(input.shape[2:]):
            raise RuntimeError(f"size mismatch (got input: {_sizes(input.shape)} , target: {_sizes(target.shape)}")
        if weight is not None:
            weight = weight.reshape(C)
    if weight is not None and weight.dtype != input.dtype:
        raise RuntimeError(f"expected scalar type {_st(input.dtype)} but found {_st(weight.dtype)}")
    if target.dtype == torch.uint8:
        target = target.long()
    return input, target, weight


# ---- the drop-ins -------------------------------------------------------------


def _check_options(z_loss, softcap, where):
    """z_loss: a finite number >= 0; softcap: the shared rule (_validate.softcap: None or a finite
    number > 0)."""
    if isinstance(z_loss, bool) or not isinstance(z_loss, numbers.Real) or not math.isfinite(z_loss) or z_loss < 0:
        raise ValueError(f"{where}: z_loss must be a finite number >= 0, got {z_loss!r}")
    return float(z_loss), _validate.softcap(where, softcap)


def _check_inplace_backward(input):
    if input.requires_grad and input.is_leaf and torch.is_grad_enabled():
        raise ValueError(
            "cross_entropy(inplace_backward=True): input is a leaf tensor that requires grad; the "
            "backward would overwrite it with its own gradient. inplace_backward is meant for logits "
            "computed by the model (e.g. the output of the LM head), which nothing else reads afterwards."
        )


def cross_entropy(
    input: Tensor,
    target: Tensor,
    weight: Tensor | None = None,
    size_average: bool | None = None,
    ignore_index: int = -100,
    reduce: bool | None = None,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    *,
    z_loss: float = 0.0,
    softcap: float | None = None,
    inplace_backward: bool = False,
) -> Tensor:
    """Drop-in for torch.nn.functional.cross_entropy (same signature, values,
    gradients and exceptions), with three keyword-only options that are off
    by default.

    input (C,), (N, C) or (N, C, d1, ..., dk) logits, float32, float64,
    bfloat16 or float16 (float32 accumulation; float64 for float64), any
    strides: an (N, C, L) view of (N, L, C) logits (``logits.transpose(1, 2)``)
    is read in place, never copied. target: int64 (or uint8) class indices of
    input's shape without C, ``ignore_index`` anywhere, or class probabilities
    of input's shape. Rows whose target is ``ignore_index`` cost nothing: they
    are skipped by the kernel, their loss and gradient are 0. 'mean' divides by
    the summed weight of the kept rows (NaN, with a zero gradient, when none is
    kept), or by the number of rows with probability targets.

    z_loss: adds ``z_loss * lse**2`` to every kept row's loss (PaLM's z-loss,
        lse = logsumexp of the row's logits; not multiplied by class weights),
        before the reduction.
    softcap: scores the rows on ``softcap * tanh(input / softcap)`` (logit
        soft-capping, as Gemma 2), computed inside the kernel.
    inplace_backward: the backward writes the gradient over ``input`` instead
        of a new tensor, saving one (N, C) buffer. The logits are gone after
        the backward: only for logits nothing else reads afterwards (a
        second use inside the autograd graph raises; reading them yourself
        after backward gives the gradient). Refused for a leaf input.
    """
    if has_torch_function_variadic(input, target, weight):
        return handle_torch_function(
            cross_entropy,
            (input, target, weight),
            input,
            target,
            weight=weight,
            size_average=size_average,
            ignore_index=ignore_index,
            reduce=reduce,
            reduction=reduction,
            label_smoothing=label_smoothing,
            z_loss=z_loss,
            softcap=softcap,
            inplace_backward=inplace_backward,
        )
    if size_average is not None or reduce is not None:
        reduction = _REDUCTIONS[_Reduction.get_enum(_Reduction.legacy_get_string(size_average, reduce))]
    z_loss, softcap = _check_options(z_loss, softcap, "cross_entropy")
    if isinstance(input, torch.Tensor) and not uses_kernels(input.device):
        return native_cross_entropy(
            input,
            target,
            weight,
            reduction=reduction,
            ignore_index=ignore_index,
            label_smoothing=label_smoothing,
            z_loss=z_loss,
            softcap=softcap,
        )
    reduction = _REDUCTIONS[_Reduction.get_enum(reduction)]  # ValueError for a bad one
    return _kernel_cross_entropy(
        input, target, weight, ignore_index, reduction, label_smoothing, z_loss, softcap, inplace_backward
    )


def _kernel_cross_entropy(input, target, weight, ignore_index, reduction, label_smoothing, z_loss, softcap, inplace):
    """cross_entropy in the kernel, after its options' checks: autocast, the arguments' checks
    (PyTorch's), their conventions converted, then the op."""
    cast = autocast_dtype(input.device.type, "float32") if isinstance(input, torch.Tensor) else None
    if cast is not None:  # under autocast, as F.cross_entropy: float32 before any check
        dev = input.device.type
        input, target = autocast_cast(input, cast, dev), autocast_cast(target, cast, dev)
        weight = autocast_cast(weight, cast, dev)
    ignore_index, ls = _check_arg_types(input, target, weight, ignore_index, label_smoothing)
    if input.shape == target.shape:
        input, target, weight = _prepare_probabilities(input, target, weight, ignore_index, ls)
    else:
        input, target, weight = _prepare_class_indices(input, target, weight, ignore_index, ls)
    ls = ls if ls > 0 else 0.0  # PyTorch ignores label_smoothing <= 0 (and NaN)
    inplace = bool(inplace) and input.requires_grad
    if inplace:
        _check_inplace_backward(input)
    try:
        loss, _ = torch.ops.masked_attn.cross_entropy(
            input, target, weight, reduction, ignore_index, ls, z_loss, softcap, inplace
        )
    except RuntimeError as e:  # the shim's target check: PyTorch raises IndexError
        m = _OUT_OF_BOUNDS.search(str(e))
        if m is None:
            raise
        raise IndexError(m.group(0)) from None
    return loss


def native_cross_entropy(
    input: Tensor,
    target: Tensor,
    weight: Tensor | None = None,
    *,
    reduction: str = "mean",
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
) -> Tensor:
    """:func:`cross_entropy` computed with PyTorch's native ops, on any device
    (what it runs on a device other than the CPU): F.cross_entropy itself
    (its checks, messages and values), with softcap as
    ``softcap * tanh(input / softcap)`` before it and z_loss as
    ``z_loss * logsumexp(row)**2`` added to every kept row before the
    reduction ('mean' divides by the same summed weight of kept rows, or by
    the number of rows with probability targets). Differences from the
    kernels: a NaN / inf logit in an ignored row gives NaN gradients (the
    kernels never read ignored rows), and inplace_backward has no effect."""
    if softcap is not None:
        input = softcap * torch.tanh(input / softcap)
    if not z_loss:
        return nn.functional.cross_entropy(
            input, target, weight, ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing
        )
    rows = nn.functional.cross_entropy(
        input, target, weight, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing
    )
    cdim = 0 if input.dim() == 1 else 1
    acc = torch.float64 if input.dtype == torch.float64 else torch.float32
    probabilities = target.shape == input.shape and target.is_floating_point()
    kept = None if probabilities else target != ignore_index
    x = input if kept is None else input.masked_fill((~kept).unsqueeze(cdim), 0.0)  # no NaN from ignored rows
    z = z_loss * torch.logsumexp(x.to(acc), cdim) ** 2
    if kept is not None:
        z = z.masked_fill(~kept, 0.0)
    rows = rows.to(acc) + z
    if reduction == "none":
        return rows.to(input.dtype)
    total = rows.sum()
    if reduction == "mean":
        if kept is None:
            total = total / max(rows.numel(), 1) if rows.numel() else total * float("nan")
        elif weight is None:
            total = total / kept.sum()
        else:
            total = total / torch.where(kept, weight.to(acc)[target.masked_fill(~kept, 0)], 0.0).sum()
    return total.to(input.dtype)


class CrossEntropyLoss(nn.CrossEntropyLoss):
    """Drop-in for torch.nn.CrossEntropyLoss: the same constructor, attributes,
    ``weight`` buffer and state_dict (it subclasses it), computed by
    :func:`torch_masked_attn.functional.cross_entropy`. The keyword-only
    ``z_loss``, ``softcap`` and ``inplace_backward`` are that function's
    options (off by default); they are plain attributes, not state."""

    def __init__(
        self,
        weight: Tensor | None = None,
        size_average: bool | None = None,
        ignore_index: int = -100,
        reduce: bool | None = None,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        *,
        z_loss: float = 0.0,
        softcap: float | None = None,
        inplace_backward: bool = False,
    ) -> None:
        super().__init__(weight, size_average, ignore_index, reduce, reduction, label_smoothing)
        self.z_loss, self.softcap = _check_options(z_loss, softcap, "CrossEntropyLoss")
        self.inplace_backward = bool(inplace_backward)

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return cross_entropy(
            input,
            target,
            weight=self.weight,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
            label_smoothing=self.label_smoothing,
            z_loss=self.z_loss,
            softcap=self.softcap,
            inplace_backward=self.inplace_backward,
        )


def perplexity(input: Tensor, target: Tensor, ignore_index: int = -100) -> Tensor:
    """exp of the mean negative log-likelihood over the kept tokens.

    Same input / target conventions as :func:`cross_entropy` (no weight, no
    label smoothing). The mean is taken in float32 (float64 for float64 input)
    over the per-token losses, so bfloat16 / float16 logits do not round the
    mean; the result is a 0-d float32 (float64) tensor, differentiable. NaN
    when every token is ignored.
    """
    nll = cross_entropy(input, target, ignore_index=ignore_index, reduction="none")
    acc = torch.float64 if nll.dtype == torch.float64 else torch.float32
    if isinstance(target, torch.Tensor) and target.shape == input.shape:
        kept = nll.numel()  # probability targets: every row counts
    else:
        kept = (target != ignore_index).sum()
    return torch.exp(nll.to(acc).sum() / kept)
