"""Autocast: under torch.autocast each op behaves like its native twin
(docs/design.md, "Autocast").

Attention (masked_attn::forward, varlen_forward) runs in the autocast dtype
like F.scaled_dot_product_attention (q, k, v and floating masks cast; the head
mask and sinks keep their own dtype, as the kernels read any floating dtype
for them), cross-entropy in float32 like F.cross_entropy (input, weight and
probability targets cast). A cast is torch's own .to(), so each input's
gradient comes back in its own dtype. float64 and integer tensors, and
tensors on another device type, are never cast (torch.amp's rule). The
building blocks of the backwards have no autocast kernel: the dispatcher's
fallthrough runs them as they are. The drop-ins (functional, losses) apply the
same casts before their own checks, as the native functions do.
"""

from __future__ import annotations

from typing import overload

import torch
from torch import Tensor

from . import ops  # noqa: F401  (loads the library: torch.ops.masked_attn)

__all__ = ["autocast_dtype", "autocast_cast"]

_DEVICE_TYPES = ("cpu",)  # where the ops have kernels; elsewhere the drop-ins run native ops


_available: dict[str, bool] = {}  # device type -> whether torch has autocast for it (meta has not)


def autocast_dtype(device_type: str, policy: str) -> torch.dtype | None:
    """The dtype an op under ``policy`` ('lower': the autocast dtype, 'float32')
    computes in for tensors of ``device_type`` now, or None outside autocast."""
    available = _available.get(device_type)
    if available is None:
        available = _available[device_type] = torch.amp.is_autocast_available(device_type)
    if not available or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type) if policy == "lower" else torch.float32


@overload
def autocast_cast(t: Tensor, dtype: torch.dtype | None, device_type: str) -> Tensor: ...
@overload
def autocast_cast(t: None, dtype: torch.dtype | None, device_type: str) -> None: ...
def autocast_cast(t: Tensor | None, dtype: torch.dtype | None, device_type: str) -> Tensor | None:
    """``t`` cast to ``dtype`` where autocast would cast it: a floating tensor,
    not float64, on ``device_type``; anything else as it is."""
    if (
        dtype is None
        or not isinstance(t, Tensor)
        or not t.is_floating_point()
        or t.dtype == torch.float64
        or t.device.type != device_type
        or t.dtype == dtype
    ):
        return t
    return t.to(dtype)


# op -> (policy, positions of the arguments autocast casts)
_OPS = {
    "forward": ("lower", (0, 1, 2, 3, 4)),  # q, k, v, attn_mask, key_padding_mask
    "varlen_forward": ("lower", (0, 1, 2)),  # query, key, value
    "cross_entropy": ("float32", (0, 1, 2)),  # input, target (probabilities), weight
}

_lib = torch.library.Library("masked_attn", "IMPL")  # kept for the registrations' lifetime


def _register(name: str, policy: str, positions: tuple[int, ...], device_type: str) -> None:
    op = getattr(torch.ops.masked_attn, name).default
    key_name = "Autocast" + torch._C._dispatch_key_for_device(device_type)
    key = getattr(torch._C.DispatchKey, key_name)
    excluded = torch._C.DispatchKeySet(key)
    names = {op._schema.arguments[i].name for i in positions}

    def cast_and_call(*args, **kwargs):
        dtype = autocast_dtype(device_type, policy)
        args = tuple(autocast_cast(a, dtype, device_type) if i in positions else a for i, a in enumerate(args))
        kwargs = {n: autocast_cast(a, dtype, device_type) if n in names else a for n, a in kwargs.items()}
        with torch._C._ExcludeDispatchKeyGuard(excluded):
            return op(*args, **kwargs)

    # the C++ dispatcher's kernel, and the Python dispatcher's (torch.compile traces through it)
    _lib.impl(name, lambda _keyset, *args, **kwargs: cast_and_call(*args, **kwargs), key_name, with_keyset=True)
    op.py_impl(key)(cast_and_call)


for _device_type in _DEVICE_TYPES:
    for _name, (_policy, _positions) in _OPS.items():
        _register(_name, _policy, _positions, _device_type)
