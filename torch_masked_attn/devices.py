"""Which devices the C kernels serve.

The C kernels run on CPU tensors; meta tensors (and fake tensors of CPU
tensors, under torch.compile / torch.export) go to the ops too, whose fake
kernels give the shapes. On any other device (cuda, xpu, mps, ...) every
drop-in computes the same thing with PyTorch's native ops, so a model built
with our modules keeps working after .to(device). The decision is made in
Python, per call, from the first tensor argument's device (the ops themselves
stay CPU-only: a direct torch.ops.masked_attn.* call on a CUDA tensor raises
the dispatcher's NotImplementedError). docs/design.md, "Devices".
"""

from __future__ import annotations

import torch

__all__ = ["KERNEL_DEVICE_TYPES", "uses_kernels"]

KERNEL_DEVICE_TYPES = frozenset({"cpu", "meta"})


def uses_kernels(device: torch.device | str) -> bool:
    """Whether tensors on ``device`` are computed by our C kernels (CPU, and
    meta for shapes) or, on every other device, by PyTorch's native ops."""
    return (device.type if isinstance(device, torch.device) else torch.device(device).type) in KERNEL_DEVICE_TYPES
