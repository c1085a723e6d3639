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
import numbers
import operator
import re

import torch
from torch import Tensor, nn
from torch.nn import _reduction as _Reduction
from torch.overrides import handle_torch_function, has_torch_function_variadic

from . import ops  # noqa: F401  (registers torch.ops.masked_attn)

__all__ = ["cross_entropy", "CrossEntropyLoss", "perplexity"]

_KERNEL_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_REDUCTIONS = ("none", "mean", "sum")  # index = PyTorch's reduction enum
_OUT_OF_BOUNDS = re.compile(r"Target -?\d+ is out of bounds\.")

# c10::ScalarType names, as PyTorch's messages print dtypes.
_SCALAR_TYPE_NAMES = {
    torch.float32: "Float", torch.float64: "Double", torch.float16: "Half",
    torch.bfloat16: "BFloat16", torch.int64: "Long", torch.int32: "Int", torch.int16: "Short",
    torch.int8: "Char", torch.uint8: "Byte", torch.bool: "Bool", torch.complex64: "ComplexFloat",
    torch.complex128: "ComplexDouble", torch.complex32: "ComplexHalf",
    torch.uint16: "UInt16", torch.uint32: "UInt32", torch.uint64: "UInt64",
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
        return TypeError(f"cross_entropy_loss(): argument '{name}' (position {pos}) must be {want}, "
                         f"not {type(got).__name__}")

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
        kernel = "log_softmax_lastdim_kernel_impl" if class_dim == input.dim() - 1 else \
            "log_softmax_kernel_impl"
        raise NotImplementedError(f'"{kernel}" not implemented for \'{_st(input.dtype)}\'')


def _check_weight_no_grad(weight):
    if weight is not None and weight.requires_grad and torch.is_grad_enabled():
        raise RuntimeError(
            "The function 'nll_loss_forward' is not differentiable with respect to argument "
            "'weight'. This input cannot have requires_grad True.")


def _prepare_probabilities(input, target, weight, ignore_index, ls):
    """Probability targets (target.shape == input.shape): cross_entropy_loss_prob_target."""
    if not target.is_floating_point():
        raise RuntimeError("Expected floating point type for target with class probabilities, "
                           f"got {_st(target.dtype)}")
    if ignore_index >= 0:
        raise RuntimeError("ignore_index is not supported for floating point target")
    if input.dim() == 0:
        raise IndexError("Dimension specified as 1 but tensor has no dimensions")
    C = input.shape[0 if input.dim() == 1 else 1]
    if weight is not None and not (weight.dim() == 1 and weight.numel() == C):
        raise RuntimeError(f"cross_entropy: weight tensor should be defined either for all {C} "
                           f"classes or no classes but got weight tensor of shape: {_sizes(weight.shape)}")
    _check_logits(input, 0 if input.dim() == 1 else 1)
    if ls > 0:
        _check_label_smoothing(ls)
    if weight is not None and weight.requires_grad and torch.is_grad_enabled():
        raise NotImplementedError(
            "torch_masked_attn.cross_entropy: no gradient for weight with probability targets; "
            "pass weight.detach()")
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
            raise ValueError(f"Expected input batch_size ({input.shape[0]}) to match target "
                             f"batch_size ({target_batch}).")
    _check_weight_no_grad(weight)
    bad_dtype = target.dtype not in (torch.int64, torch.uint8)
    dtype_msg = f"expected target dtype to be Long or Byte, but got {_st(target.dtype)}"
    C = input.shape[-1] if input.dim() == 1 else input.shape[1]
    if input.dim() <= 2:  # nll_loss
        if target.dim() > 1:
            raise RuntimeError("0D or 1D target tensor expected, multi-target not supported")
        if bad_dtype:
            raise RuntimeError(dtype_msg)
        if input.dim() == 1 and target.dim() == 1 and target.shape[0] != 1:
            raise ValueError(f"For 1D input, 1D target must have size 1, but got target size: "
                             f"{target.shape[0]}")
        if input.dim() == 2 and target.dim() == 0:  # batch size 0 "matched" a 0-d target
            raise IndexError("Dimension specified as 0 but tensor has no dimensions")
        if weight is not None and not (weight.dim() == 1 and weight.numel() == C):
            raise RuntimeError(f"weight tensor should be defined either for all {C} classes or no "
                               f"classes but got weight tensor of shape: {_sizes(weight.shape)}")
    else:  # nll_loss2d; 3-D and >4-D inputs are viewed as 4-D first
        if input.dim() != 4:
            if tuple(target.shape[1:]) != tuple(input.shape[2:]):
                raise RuntimeError(f"Expected target size {_sizes(input.shape[:1] + input.shape[2:])}, "
                                   f"got {_sizes(target.shape)}")
        elif target.dim() != 3:
            raise RuntimeError("only batches of spatial targets supported (3D tensors) but got "
                               f"targets of dimension: {target.dim()}")
        if bad_dtype:
            raise RuntimeError(dtype_msg)
        if weight is not None and weight.numel() != C:
            raise RuntimeError("weight tensor should be defined either for all or no classes")
        if input.dim() == 4 and tuple(target.shape) != (input.shape[0],) + tuple(input.shape[2:]):
            raise RuntimeError(f"size mismatch (got input: {_sizes(input.shape)} , target: "
                               f"{_sizes(target.shape)}")
        if weight is not None:
            weight = weight.reshape(C)
    if weight is not None and weight.dtype != input.dtype:
        raise RuntimeError(f"expected scalar type {_st(input.dtype)} but found {_st(weight.dtype)}")
    if target.dtype == torch.uint8:
        target = target.long()
    return input, target, weight


# ---- the drop-ins -------------------------------------------------------------

def cross_entropy(input: Tensor, target: Tensor, weight: Tensor | None = None,
                  size_average: bool | None = None, ignore_index: int = -100,
                  reduce: bool | None = None, reduction: str = "mean",
                  label_smoothing: float = 0.0) -> Tensor:
    """Drop-in for torch.nn.functional.cross_entropy (same signature, values,
    gradients and exceptions).

    input (C,), (N, C) or (N, C, d1, ..., dk) logits, float32, float64,
    bfloat16 or float16 (float32 accumulation; float64 for float64), any
    strides: an (N, C, L) view of (N, L, C) logits (``logits.transpose(1, 2)``)
    is read in place, never copied. target: int64 (or uint8) class indices of
    input's shape without C, ``ignore_index`` anywhere, or class probabilities
    of input's shape. Rows whose target is ``ignore_index`` cost nothing: they
    are skipped by the kernel, their loss and gradient are 0. 'mean' divides by
    the summed weight of the kept rows (NaN, with a zero gradient, when none is
    kept), or by the number of rows with probability targets.
    """
    if has_torch_function_variadic(input, target, weight):
        return handle_torch_function(
            cross_entropy, (input, target, weight), input, target, weight=weight,
            size_average=size_average, ignore_index=ignore_index, reduce=reduce,
            reduction=reduction, label_smoothing=label_smoothing)
    if size_average is not None or reduce is not None:
        reduction = _Reduction.legacy_get_string(size_average, reduce)
    reduction = _REDUCTIONS[_Reduction.get_enum(reduction)]  # ValueError for a bad one
    ignore_index, ls = _check_arg_types(input, target, weight, ignore_index, label_smoothing)

    if input.shape == target.shape:
        input, target, weight = _prepare_probabilities(input, target, weight, ignore_index, ls)
    else:
        input, target, weight = _prepare_class_indices(input, target, weight, ignore_index, ls)
    ls = ls if ls > 0 else 0.0  # PyTorch ignores label_smoothing <= 0 (and NaN)
    try:
        loss, _ = torch.ops.masked_attn.cross_entropy(input, target, weight, reduction, ignore_index, ls)
    except RuntimeError as e:  # the shim's target check: PyTorch raises IndexError
        m = _OUT_OF_BOUNDS.search(str(e))
        if m is None:
            raise
        raise IndexError(m.group(0)) from None
    return loss


class CrossEntropyLoss(nn.CrossEntropyLoss):
    """Drop-in for torch.nn.CrossEntropyLoss: the same constructor, attributes,
    ``weight`` buffer and state_dict (it subclasses it), computed by
    :func:`torch_masked_attn.functional.cross_entropy`."""

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return cross_entropy(input, target, weight=self.weight, ignore_index=self.ignore_index,
                             reduction=self.reduction, label_smoothing=self.label_smoothing)


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
