"""Argument checks shared by the entry points: one rule per option, one function per rule.

Each check names the entry point (``fn``) and the argument, and raises TypeError for a value of
the wrong kind, ValueError for one out of range. A public API that spells an option its own way
translates the spelling in its wrapper and hands the result to the same check
(docs/design/03-decisions.md, "One rule per option"): flash-attn's ``softcap=0.0`` (off) becomes
None, its ``dropout_p`` excludes 1, its window bounds are normalised (``flash_attn.py``); torch's
varlen ``window_size`` keeps torch's messages (:func:`window_size`).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable

import torch
from torch import Tensor

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class ArgumentTypeError(TypeError, ValueError):
    """An option of the wrong kind: a TypeError, and a ValueError too, as the loss functions
    have raised for every bad option (one check serves the attention and the loss functions)."""


# ---- tensors ----------------------------------------------------------------------------------


def tensor(fn: str, name: str, t: object, layout: str = "") -> Tensor:
    """t, a Tensor; layout (e.g. ``"(B, H, L, D)"``) completes the message."""
    if not isinstance(t, Tensor):
        what = f"a Tensor {layout}" if layout else "a Tensor"
        raise TypeError(f"{fn}: {name} must be {what}, got {type(t).__name__}")
    return t


def dims(fn: str, name: str, t: Tensor, n: int, layout: str) -> None:
    """t has n dims, laid out as layout says."""
    if t.dim() != n:
        raise ValueError(f"{fn}: {name} must be {n}-D {layout}, got shape {tuple(t.shape)}")


def floating(fn: str, name: str, t: Tensor) -> None:
    """t holds one of the kernels' floating dtypes."""
    if t.dtype not in FLOATS:
        raise TypeError(f"{fn}: {name} must be float16, bfloat16, float32 or float64, got {t.dtype}")


def heads(fn: str, hq: int, hk: int) -> None:
    """Grouped-query attention: the query heads a multiple of the key/value heads."""
    if hk == 0 or hq % hk != 0:
        raise ValueError(
            f"{fn}: the number of query heads ({hq}) must be a multiple of the number of key/value heads ({hk})"
        )


# ---- numbers ----------------------------------------------------------------------------------


def number(fn: str, name: str, x: object, what: str) -> float:
    """x as a float: a real number (not a bool) or a one-element tensor (not bool); NaN refused."""
    if isinstance(x, Tensor) and x.numel() == 1 and x.dtype != torch.bool:
        x = x.item()
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{fn}: {name} must be {what}, got {type(x).__name__}")
    x = float(x)
    if math.isnan(x):
        raise ValueError(f"{fn}: {name} must be {what}, got nan")
    return x


# ---- the options ------------------------------------------------------------------------------


def softcap(fn: str, softcap: object) -> float | None:
    """The soft-cap (attention scores, cross-entropy logits): None (off) or a finite number > 0."""
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise ArgumentTypeError(f"{fn}: softcap must be None or a finite number > 0, got {type(softcap).__name__}")
    c = float(softcap)
    if not (math.isfinite(c) and c > 0):
        raise ValueError(f"{fn}: softcap must be None or a finite number > 0, got {softcap}")
    return c


def dropout_p(fn: str, p: object) -> float:
    """The dropout probability: a number in [0, 1] (1 drops every probability)."""
    p = number(fn, "dropout_p", p, "a number in [0, 1]")
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"{fn}: dropout_p must be in [0, 1], got {p}")
    return p


def window(fn: str, window: object) -> tuple[int, int]:
    """The sliding window (left, right): a side -1 (or None) unbounded, else a bound >= 0."""
    if window is None:
        return (-1, -1)
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"{fn}: window must be None or a pair (left, right), got {window!r}")
    sides = []
    for name, w in zip(("left", "right"), window):
        if w is None:
            w = -1
        if isinstance(w, bool) or not isinstance(w, int):
            raise TypeError(f"{fn}: window {name} must be an int or None, got {type(w).__name__}")
        if w < -1:
            raise ValueError(f"{fn}: window {name} must be >= 0, or -1 / None for no bound, got {w}")
        sides.append(int(w))
    return sides[0], sides[1]


def diagonal(fn: str, diagonal: object) -> int:
    """The diagonal: query i's is key i + diagonal, what is_causal and the window are relative to
    (0: top-left aligned, Lk - Lq: bottom-right); any int."""
    if isinstance(diagonal, Tensor) and diagonal.numel() == 1 and not diagonal.is_floating_point():
        diagonal = int(diagonal.item())
    if isinstance(diagonal, bool) or not isinstance(diagonal, int):
        raise TypeError(f"{fn}: diagonal must be an int (0: top-left, Lk - Lq: bottom-right), got {diagonal!r}")
    if not -(2**40) < diagonal < 2**40:
        raise ValueError(f"{fn}: diagonal must be within +-2**40, got {diagonal}")
    return int(diagonal)


def window_size(fn: str, window_size: Iterable[int]) -> tuple[int, int]:
    """The same window in torch's varlen spelling, window_size=(left, right) (-1 unbounded), with
    torch's messages."""
    window_size = tuple(window_size)
    if len(window_size) != 2:
        raise ValueError(f"{fn}: window_size must have length 2, got {len(window_size)}")
    left, right = (int(w) for w in window_size)
    if left < -1 or right < -1:
        raise ValueError(f"{fn}: window_size entries must be -1 (unbounded) or >= 0, got {window_size}")
    return left, right


def sinks(fn: str, q: Tensor, sinks: object) -> None:
    """Attention sinks: None, or (H,) floating on q's device, one logit per query head."""
    if sinks is None:
        return
    h = q.size(-3)
    if not isinstance(sinks, Tensor):
        raise TypeError(f"{fn}: sinks must be None or a Tensor, got {type(sinks).__name__}")
    if not sinks.is_floating_point():
        raise TypeError(f"{fn}: sinks must be floating point, got {sinks.dtype}")
    if sinks.dim() != 1 or sinks.size(0) != h:
        raise ValueError(
            f"{fn}: sinks must have shape (H,) = ({h},), one logit per query head, got {tuple(sinks.shape)}"
        )
    if sinks.device != q.device:
        raise ValueError(f"{fn}: sinks must be on q's device ({q.device}), got {sinks.device}")
