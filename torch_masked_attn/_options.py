"""What an op call passes: its arguments by the names of its schema (OpArgs),
the options of an attention call checked once (AttnOptions), and the
conventions of the forward ops' outputs (out_lo, lse's dtype)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import Tensor

from . import (
    _library,  # noqa: F401  (loads the library: the schemas OpArgs reads)
    _validate,
)


def new_dropout_seed() -> Tensor:
    """(seed, offset), an int64 tensor of shape (2,) drawn from PyTorch's
    default CPU generator: torch.manual_seed reproduces it, successive calls
    differ, get_rng_state / set_rng_state replay it."""
    return torch.randint(-(2**63), 2**63 - 1, (2,), dtype=torch.int64)


class OpArgs:
    """The arguments of one op, by the names of its schema (read once): the
    positional arguments of a call from names (the schema's defaults for the
    rest), a call's arguments read back by name, and per-input gradients laid
    out in the schema's order. OpArgs counts no positions, but not every call
    of these ops goes through it: masked_attn::forward is called with its
    leading arguments by position from functional.py (1 call, q to
    for_backward) and modules.py (3 calls, q to dropout_seed), so those keep
    their places in the schema and a new argument goes after them
    (tests/project/test_docs.py finds these calls)."""

    def __init__(self, op) -> None:
        self.op = op
        self.names = tuple(a.name for a in op._schema.arguments)
        self.defaults = tuple(a.default_value for a in op._schema.arguments)
        self._index = {n: i for i, n in enumerate(self.names)}

    def __call__(self, **named) -> tuple:
        """The positional arguments of a call that passes ``named`` (the schema's defaults
        placed by index: a decoding step pays this on every layer's call)."""
        args, index = list(self.defaults), self._index
        for n, v in named.items():
            i = index.get(n)
            if i is None:
                raise TypeError(f"{self.op}: no argument {sorted(set(named) - set(index))}")
            args[i] = v
        return tuple(args)

    def read(self, args: Sequence[object], kwargs: dict | None = None) -> SimpleNamespace:
        """A call's arguments (positional, then keyword, then defaults) by name."""
        vals = dict(zip(self.names, self.defaults))
        vals.update(zip(self.names, args))
        if kwargs:
            vals.update(kwargs)
        return SimpleNamespace(**vals)

    def grads(self, named: dict[str, Tensor | None]) -> tuple[Tensor | None, ...]:
        """One gradient per argument, in the schema's order (None where not named)."""
        return tuple(named.get(n) for n in self.names)

    def tensors(self, a: SimpleNamespace) -> dict[str, Tensor]:
        """The call's tensor arguments, by name."""
        return {n: t for n, t in vars(a).items() if isinstance(t, Tensor)}


FORWARD = OpArgs(torch.ops.masked_attn.forward.default)
BACKWARD = OpArgs(torch.ops.masked_attn.backward.default)
BACKWARD_INTO = OpArgs(torch.ops.masked_attn.backward_into.default)
VARLEN_FORWARD = OpArgs(torch.ops.masked_attn.varlen_forward.default)
VARLEN_BACKWARD = OpArgs(torch.ops.masked_attn.varlen_backward.default)


def _has_out_lo(dtype):
    """Whether the forward ops return out's rounding error out_lo (see above)."""
    return dtype in (torch.bfloat16, torch.float16)


def saved_out_lo(out_lo: Tensor) -> Tensor | None:
    """What a backward keeps of the forward's out_lo (in q's dtype): the tensor
    in bfloat16 / float16, None for float32 / float64 or a forward called with
    for_backward=False (an empty placeholder)."""
    return out_lo if _has_out_lo(out_lo.dtype) and out_lo.numel() > 0 else None


def grad_wanted(*tensors: Tensor | None) -> bool:
    """The forward ops' for_backward: whether a backward may follow this call
    (grad mode on and a tensor argument requiring grad)."""
    return torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in tensors)


def _lse_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---- the options of an attention call ------------------------------------------


@dataclass(frozen=True)
class AttnOptions:
    """The options of one attention call, the masks aside: built and checked
    once per call (AttnOptions.check), then handed to the op by name
    (op_args) and read back by name by its autograd (from_op). The checks
    here are those whose exception the Python functions promise (their type
    and message); the ranges are the shim's (csrc/shim/options.cpp), which
    checks every call of the raw ops too.

    window: (left, right), -1 a side without bound; softcap > 0 or None;
    sinks (H,) floating or None; dropout_p in [0, 1] with dropout_seed (an
    int64 (seed, offset) tensor) when > 0; alibi_slopes (H,) or (B, H)
    float32 or None (flash-attn's: score += -slope * |i + Lk - Lq - j| after
    the scaling and the soft-cap); diagonal: query i's diagonal is key
    i + diagonal, what is_causal and the window are relative to (0: top-left,
    SDPA's; Lk - Lq: bottom-right, flash-attn's; the dense ops only)."""

    is_causal: bool = False
    window: tuple[int, int] = (-1, -1)
    softcap: float | None = None
    sinks: Tensor | None = None
    dropout_p: float = 0.0
    dropout_seed: Tensor | None = None
    alibi_slopes: Tensor | None = None
    diagonal: int = 0

    @classmethod
    def check(
        cls,
        fn: str,
        q: Tensor,
        *,
        is_causal: bool = False,
        window: object = None,
        softcap: float | None = None,
        sinks: Tensor | None = None,
        dropout_p: float = 0.0,
        dropout_seed: object = None,
        window_size: Iterable[int] | None = None,
        alibi_slopes: object = None,
        diagonal: object = 0,
    ) -> AttnOptions:
        """The options of a call of ``fn`` on queries ``q`` (B, H, L, D),
        checked. ``window`` is masked_attention's (left, right) with None
        sides; ``window_size`` varlen_attn's, whose softcap and sinks only the
        shim checks (varlen_attn raises its RuntimeError)."""
        dropout_p = _validate.dropout_p(fn, dropout_p)
        seed = _dropout_seed(fn, dropout_p, dropout_seed)
        if alibi_slopes is not None and not isinstance(alibi_slopes, Tensor):  # its shape and dtype: the shim's
            raise TypeError(
                f"{fn}: alibi_slopes must be None or a float32 Tensor (H,) or (B, H), got {type(alibi_slopes).__name__}"
            )
        if window_size is not None:  # varlen_attn: torch's window_size; the shim checks the rest (RuntimeError)
            softcap = None if softcap is None else float(softcap)
            return cls(False, _validate.window_size(fn, window_size), softcap, sinks, alibi_slopes=alibi_slopes)
        win, softcap = _validate.window(fn, window), _validate.softcap(fn, softcap)
        _validate.sinks(fn, q, sinks)
        diag = _validate.diagonal(fn, diagonal)
        return cls(bool(is_causal), win, softcap, sinks, dropout_p, seed, alibi_slopes, diag)

    @classmethod
    def from_op(cls, a: SimpleNamespace) -> AttnOptions:
        """The options of an op call's arguments (OpArgs.read); an op without
        one (varlen: is_causal, dropout) leaves its default."""
        return cls(
            bool(getattr(a, "is_causal", False)),
            (a.window_left, a.window_right),
            a.softcap,
            a.sinks,
            float(getattr(a, "dropout_p", 0.0)),
            getattr(a, "dropout_seed", None),
            a.alibi_slopes,
            int(getattr(a, "diagonal", 0)),
        )

    def op_args(self) -> dict[str, object]:
        """The options as the attention ops' schemas name them (their shared
        tail: csrc/shim/options.cpp); those at their default are left out
        (varlen's schema lacks some)."""
        named: dict[str, object] = {"window_left": self.window[0], "window_right": self.window[1]}
        if self.softcap is not None:
            named["softcap"] = self.softcap
        if self.sinks is not None:
            named["sinks"] = self.sinks
        if self.is_causal:
            named["is_causal"] = True
        if self.dropout_p:
            named["dropout_p"] = self.dropout_p
            named["dropout_seed"] = self.dropout_seed
        if self.alibi_slopes is not None:
            named["alibi_slopes"] = self.alibi_slopes
        if self.diagonal:
            named["diagonal"] = self.diagonal
        return named


def _dropout_seed(fn: str, dropout_p: float, seed: object) -> Tensor | None:
    """The seed (None: drawn later) when dropout_p > 0, else None."""
    if dropout_p == 0.0 or seed is None:
        return None
    if not isinstance(seed, Tensor):
        raise TypeError(
            f"{fn}: dropout_seed must be None or an int64 tensor (seed, offset) of shape (2,), "
            f"got {type(seed).__name__}"
        )
    if seed.dtype != torch.int64 or tuple(seed.shape) != (2,) or seed.device.type != "cpu":
        raise ValueError(
            f"{fn}: dropout_seed must be an int64 CPU tensor (seed, offset) of shape (2,), got "
            f"{seed.dtype} {tuple(seed.shape)} on {seed.device}"
        )
    return seed
