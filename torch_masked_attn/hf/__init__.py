"""Hugging Face transformers integration.

Importing this module registers ``attn_implementation="masked_attn"``::

    import torch_masked_attn.hf                      # registers "masked_attn"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="masked_attn")
    torch_masked_attn.hf.apply(model)                # fused linear-cross-entropy loss

Two parts, both registered in transformers' own interfaces:

* a mask function (``AttentionMaskInterface``) that does not build the 4-D mask
  when it knows the structure (causal, bidirectional, sliding window over
  causal): it returns a :class:`StructuredMask` (the 2-D key padding, the
  query / key offsets and the pattern) which the attention function turns into
  ``key_padding_mask`` + ``is_causal`` + ``diagonal`` (the query / key offsets'
  difference) (+ a window), which the kernels take as they are. Any other
  pattern (``or_mask_function`` / ``and_mask_function`` overlays, chunked and
  blockwise attention, callers that ask for a tensor) is built by
  transformers' own ``sdpa_mask`` and goes through as a mask.
* an attention function (``AttentionInterface``) that calls
  :func:`torch_masked_attn.functional.masked_attention` on (B, H, L, D) with
  grouped-query heads as they are (sliding windows, soft-capping and sinks
  through its own arguments), packed sequences through
  :func:`torch_masked_attn.functional.varlen_attn`, and T5-style position
  biases through transformers' own sdpa attention.

And a cache: :class:`Int8Cache`, an 8-bit KV cache the kernels read as it is
(``model.generate(..., past_key_values=Int8Cache())``).

Every name taken from transformers comes through ``_compat`` (the seam): it
warns (:class:`TransformersVersionWarning`) when the installed transformers is
outside the tested range, and raises :class:`TransformersCompatError`, naming
the name, where one this package borrows is missing.
"""

from __future__ import annotations

import contextvars
import functools
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import Tensor, nn

from .. import functional as _F
from .. import ops as _ops
from . import _compat  # every name taken from transformers comes through here
from ._compat import (  # what registration, the mask function and Int8Cache need at import
    AttentionInterface,
    AttentionMaskInterface,
    Cache,
    DynamicLayer,
    TransformersCompatError,
    TransformersVersionWarning,
    causal_mask_function,
    prepare_padding_mask,
    sdpa_attention_forward,
    sdpa_mask,
)

_compat.require("import")  # the other names of registration, the mask function and the attention

__all__ = [
    "ATTN_IMPLEMENTATION",
    "Int8Cache",
    "StructuredMask",
    "TransformersCompatError",
    "TransformersVersionWarning",
    "apply",
    "attention_forward",
    "mask_function",
]

ATTN_IMPLEMENTATION = "masked_attn"

# continuous batching: None where transformers lacks it (a manager then raises TransformersCompatError)
PagedAttentionCache = _compat.optional("PagedAttentionCache")
ContinuousBatchingManager = _compat.optional("ContinuousBatchingManager")


# ---------------------------------------------------------------------------------------------
# The mask function
# ---------------------------------------------------------------------------------------------


@dataclass(eq=False)
class StructuredMask:
    """What transformers' mask says, without the 4-D tensor.

    Query row i is at absolute position ``q_offset + i``, key column j at
    ``kv_offset + j`` (transformers' convention). ``causal``: j's position <=
    i's; ``sliding_window`` w (with causal): also j's position > i's - w.
    ``padding``: (B, kv_length) bool, True = blocked (our convention), or None.
    The model hands this object to every attention layer of its kind, so the
    per-shape pieces are cached on it.
    """

    batch_size: int
    q_length: int
    kv_length: int
    q_offset: int
    kv_offset: int
    causal: bool
    sliding_window: int | None
    padding: Tensor | None
    packed: Tensor | None = None  # (B, L) sequence ids of packed sequences (varlen_attn), or None
    _hf_args: dict = field(repr=False, default_factory=dict)
    _cache: dict = field(repr=False, default_factory=dict)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.batch_size, 1, self.q_length, self.kv_length)

    @property
    def ndim(self) -> int:  # 4: transformers takes it for a prepared mask, not a 2-D padding mask
        return 4

    def contiguous(self) -> StructuredMask:  # generate() calls it on the mask it prepares
        return self

    def to_bool(self) -> Tensor:
        """transformers' own (B, 1, Lq, Lk) bool mask, True = attend (sdpa's
        convention), for the fallbacks."""
        if "bool" not in self._cache:
            self._cache["bool"] = sdpa_mask(  # a tensor: no skip allowed
                **self._hf_args, allow_is_causal_skip=False, allow_is_bidirectional_skip=False
            )
        return cast(Tensor, self._cache["bool"])

    def kernel_args(self, lq: int, lk: int) -> dict:
        """masked_attention's keyword arguments for queries (.., lq, ..) and
        keys (.., lk, ..): key_padding_mask, is_causal, the diagonal and the window."""
        if lk != self.kv_length or lq != self.q_length:
            raise ValueError(
                f"masked_attn: the attention mask was made for {self.q_length} queries and "
                f"{self.kv_length} keys, the layer has {lq} queries and {lk} keys"
            )
        if lq in self._cache:
            return self._cache[lq]
        args: dict = {"key_padding_mask": self.padding, "is_causal": False}
        if self.causal:
            # allowed: i + d - w < j <= i + d, with d = q_offset - kv_offset the diagonal
            args["is_causal"], args["diagonal"] = True, int(self.q_offset) - int(self.kv_offset)
            if self.sliding_window is not None:
                args["window"] = (self.sliding_window - 1, None)
        self._cache[lq] = args
        return args


def mask_function(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset=0,
    kv_offset: int = 0,
    mask_function=causal_mask_function,
    attention_mask: Tensor | None = None,
    local_size: int | None = None,
    allow_is_causal_skip: bool = True,
    allow_is_bidirectional_skip: bool = False,
    use_vmap: bool = False,
    device: torch.device | str = "cpu",
    **kwargs,
):
    """transformers' mask interface for "masked_attn" (sdpa_mask's signature).

    Returns a :class:`StructuredMask` for the patterns it knows, else what
    transformers' sdpa_mask returns (a bool tensor, True = attend, or None)."""
    if isinstance(attention_mask, StructuredMask):  # prepared before (generate with a static cache)
        return attention_mask
    hf_args = dict(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        local_size=local_size,
        use_vmap=use_vmap,
        device=device,
    )
    kind, window = _compat.mask_pattern(mask_function)
    packed = None
    if (
        kind is None
        and attention_mask is None
        and not use_vmap
        and q_length == kv_length
        and not torch.compiler.is_compiling()
    ):
        # packed sequences (found by transformers from position_ids): varlen_attn, no mask at all
        kind, window, packed = _compat.packed_pattern(mask_function)
        if packed is not None and (q_offset != 0 or kv_offset != 0 or packed.shape != (batch_size, q_length)):
            kind, window, packed = None, None, None
    # a caller that turns the skips off wants a tensor (e.g. to concatenate it with another mask)
    wants_tensor = (kind == "bidirectional" and not allow_is_bidirectional_skip) or (
        kind in ("causal", "sliding") and not allow_is_causal_skip and q_length > 1 and packed is None
    )
    if kind is None or wants_tensor or use_vmap or torch.compiler.is_compiling():
        return sdpa_mask(
            **hf_args,
            allow_is_causal_skip=allow_is_causal_skip,
            allow_is_bidirectional_skip=allow_is_bidirectional_skip,
            **kwargs,
        )
    padding = None
    if attention_mask is not None:
        keep = cast(Tensor, prepare_padding_mask(attention_mask, kv_length, kv_offset))  # a tensor for a mask
        keep = keep[:, int(kv_offset) : int(kv_offset) + kv_length]
        if not bool(keep.all()):
            padding = (~keep.bool()).contiguous()
    return StructuredMask(
        batch_size,
        q_length,
        kv_length,
        int(q_offset),
        int(kv_offset),
        causal=kind != "bidirectional",
        sliding_window=window,
        padding=padding,
        packed=packed,
        _hf_args=hf_args,
    )


# ---------------------------------------------------------------------------------------------
# The attention function
# ---------------------------------------------------------------------------------------------


def _wants_weights(kwargs) -> bool:
    return bool(kwargs.get("output_attentions", False)) or _compat.wants_attentions()


def _bool_mask(attention_mask, module, query: Tensor, key: Tensor, is_causal) -> Tensor | None:
    """The mask as sdpa takes it (bool True = attend, or float added)."""
    if isinstance(attention_mask, StructuredMask):
        return attention_mask.to_bool()
    if attention_mask is None:
        lq, lk = query.shape[2], key.shape[2]
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        if causal and lq > 1:  # sdpa's is_causal: top-left
            return torch.ones(lq, lk, dtype=torch.bool, device=query.device).tril()[None, None]
    return attention_mask


def attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[Tensor, Tensor | None]:
    """transformers' attention interface for "masked_attn" (sdpa_attention_forward's
    signature): query (B, H, Lq, D), key / value (B, Hkv, Lk, D); returns
    (B, Lq, H, Dv) and the attention weights when output_attentions asks for them."""
    softcap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux")
    if PagedAttentionCache is not None and isinstance(kwargs.get("cache"), PagedAttentionCache):
        return _paged_attention(module, query, key, value, kwargs, scaling, softcap, sinks), None
    need_weights = _wants_weights(kwargs)
    if kwargs.get("position_bias") is not None:  # T5-style bias: transformers' sdpa folds it into a float mask
        mask = _bool_mask(attention_mask, module, query, key, is_causal)
        return sdpa_attention_forward(
            module, query, key, value, mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )

    lq, lk = query.shape[2], key.shape[2]
    dropout = float(dropout or 0.0)
    if isinstance(attention_mask, StructuredMask) and attention_mask.packed is not None:
        if not need_weights and dropout == 0.0:
            return _packed_attention(attention_mask, query, key, value, scaling, softcap, sinks), None
        # weights or dropout (varlen_attn has neither): a 4-D mask
        args: dict[str, Any] = {"attn_mask": ~attention_mask.to_bool()}
    elif isinstance(attention_mask, StructuredMask):
        args = dict(attention_mask.kernel_args(lq, lk))
    elif attention_mask is None:  # sdpa's rule: the layer's causality, top-left, not for one query
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        args = {"is_causal": bool(causal) and lq > 1}
    elif isinstance(attention_mask, Tensor):  # transformers' or the user's 4-D mask, sdpa's convention
        args = {"attn_mask": ~attention_mask if attention_mask.dtype == torch.bool else attention_mask}
    else:
        raise TypeError(
            f"masked_attn: attention_mask must be a Tensor, None or a StructuredMask, got "
            f"{type(attention_mask).__name__} (a flex_attention BlockMask? build the model with "
            "attn_implementation='masked_attn' so that transformers calls our mask function)"
        )
    if softcap is not None:
        args["softcap"] = float(softcap)
    if sinks is not None:
        args["sinks"] = sinks
    if dropout > 0.0:  # the model passes its attention_dropout in training only, as to sdpa
        args["dropout_p"] = dropout
    k_scale = getattr(key, _SCALE, None)
    if k_scale is not None:  # an Int8Cache's keys and values: the kernels read them with their scales
        args["k_scale"], args["v_scale"] = k_scale, getattr(value, _SCALE)
    res = _F.masked_attention(query, key, value, scale=scaling, need_weights=need_weights, **args)
    out, weights = cast("tuple[Tensor, Tensor]", res) if need_weights else (cast(Tensor, res), None)
    return out.transpose(1, 2).contiguous(), weights


# ---------------------------------------------------------------------------------------------
# The 8-bit KV cache
# ---------------------------------------------------------------------------------------------

_SCALE = "_masked_attn_scale"  # the attribute by which an Int8Layer's views carry their scales


class Int8Layer(DynamicLayer):
    """One layer of :class:`Int8Cache`: keys and values as int8 (B, L, H_kv, D)
    buffers (the heads of a token side by side, a layout the kernels read in
    place) with float32 scales (B, L, H_kv), one per token and head
    (functional.quantize_kv's), grown by doubling. update quantizes the new
    rows into them (functional.write_kv_cache: one C op, no float copy of the
    cache) and returns int8 (B, H_kv, L, D) views carrying their scales, which
    "masked_attn"'s attention function hands to the kernels."""

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        B, H, _, D = key_states.shape
        Dv = value_states.shape[-1]
        self.length = 0
        self._buf = self._alloc(B, 0, H, D, Dv)
        self._views()
        self.is_initialized = True

    @staticmethod
    def _alloc(B: int, cap: int, H: int, D: int, Dv: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        new, i8, f32 = _ops.empty_on_huge_pages, torch.int8, torch.float32  # decoding streams these
        return (
            new(B, cap, H, D, dtype=i8),
            new(B, cap, H, Dv, dtype=i8),
            new(B, cap, H, dtype=f32),
            new(B, cap, H, dtype=f32),
        )

    def _views(self) -> None:
        kq, vq, ks, vs = (t[:, : self.length] for t in self._buf)
        self.keys, self.values = kq.transpose(1, 2), vq.transpose(1, 2)
        setattr(self.keys, _SCALE, ks.transpose(1, 2))
        setattr(self.values, _SCALE, vs.transpose(1, 2))

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.device.type != "cpu":
            raise NotImplementedError("Int8Cache: the 8-bit cache is read by the CPU kernels only")
        B, H, n, D = key_states.shape
        kq = self._buf[0]
        cap = kq.shape[1]
        if self.length + n > cap:  # grow by doubling: each row is copied O(1) times
            new = self._alloc(B, max(self.length + n, 2 * cap, 64), H, D, value_states.shape[-1])
            for dst, src in zip(new, self._buf):
                dst[:, : self.length] = src[:, : self.length]
            self._buf, cap = new, new[0].shape[1]
        pos = self.length + torch.arange(n)
        slots = (torch.arange(B)[:, None] * cap + pos).reshape(-1)
        kq, vq, ks, vs = self._buf
        _F.write_kv_cache(
            key_states.transpose(1, 2).reshape(B * n, H, D),
            value_states.transpose(1, 2).reshape(B * n, H, -1),
            kq.view(B * cap, H, D),
            vq.view(B * cap, H, -1),
            slots,
            ks.view(B * cap, H),
            vs.view(B * cap, H),
        )
        self.length += n
        self._views()
        return cast(Tensor, self.keys), cast(Tensor, self.values)

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("Int8Cache.crop takes a negative number of tokens to remove")
        if self.is_initialized and tokens_to_remove:
            self.length = max(0, self.length + tokens_to_remove)
            self._views()

    def _rows(self, fn) -> None:
        if self.is_initialized:
            self._buf = tuple(fn(t) for t in self._buf)
            self._views()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: Tensor) -> None:
        self._rows(lambda t: t[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def reset(self) -> None:
        self.length = 0
        self.keys = self.values = None
        self.is_initialized = False


class Int8Cache(Cache):
    """An 8-bit KV cache for models on ``attn_implementation="masked_attn"``:
    keys and values stored as int8 with one float32 scale per token and head
    (:func:`torch_masked_attn.functional.quantize_kv`), about half a bfloat16
    cache's bytes and a quarter of a float32 one's, read by the attention
    kernels as they are (no dequantized copy). One line::

        out = model.generate(**inputs, past_key_values=Int8Cache())

    Every layer keeps every token (a sliding-window layer's window is applied
    by the mask, as over a full cache). On the CPU; inference only."""

    def __init__(self) -> None:
        super().__init__(layer_class_to_replicate=Int8Layer)


def _packed_attention(
    mask: StructuredMask, query: Tensor, key: Tensor, value: Tensor, scaling, softcap=None, sinks=None
) -> Tensor:
    """Packed sequences through varlen_attn: the (B, L) rows of sequence ids cut
    into cu_seqlens over the B * L tokens; causal (or a sliding window) inside
    each sequence. Returns (B, L, H, Dv), transformers' layout."""
    B, H, L, D = query.shape
    ids = cast(Tensor, mask.packed).to(query.device)  # the caller's condition
    ids = ids + torch.arange(B, device=ids.device).unsqueeze(1) * (ids.amax() + 1)  # no run across rows
    _, counts = torch.unique_consecutive(ids.reshape(-1), return_counts=True)
    cu = torch.zeros(counts.numel() + 1, dtype=torch.int32, device=query.device)
    cu[1:] = counts.cumsum(0)
    longest = int(counts.max())
    left = -1 if mask.sliding_window is None else mask.sliding_window - 1
    q = query.transpose(1, 2).reshape(B * L, H, D)
    k = key.transpose(1, 2).reshape(B * L, key.shape[1], key.shape[3])
    v = value.transpose(1, 2).reshape(B * L, value.shape[1], value.shape[3])
    extra = {}  # varlen_attn's keyword extensions, only when used (torch's own has none)
    if softcap is not None:
        extra["softcap"] = float(softcap)
    if sinks is not None:
        extra["sinks"] = sinks
    out = _F.varlen_attn(
        q, k, v, cu, cu, longest, longest, scale=scaling, window_size=(left, 0), enable_gqa=key.shape[1] != H, **extra
    )
    return cast(Tensor, out).reshape(B, L, H, value.shape[3])


# ---------------------------------------------------------------------------------------------
# Continuous batching: transformers' PagedAttentionCache, written and read by our ops
# ---------------------------------------------------------------------------------------------


def _cache_pages(cache, layer: _compat.LayerPages) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """The layer's key and value pages in transformers' pool, (pages, page_size, H_kv, D) views,
    and their scales (pages, page_size, H_kv) in an 8-bit pool (_Int8PagedCache; else None).
    Only our ops write and read the pool of a model on "masked_attn" (transformers copies and
    shares whole blocks, bytes as they are), so each key page holds K transposed: per head a
    (D, page_size) block, keys side by side (the view's strides say so; the kernels read it with
    no transposes, the same bits as rows). Values, and the scales, stay rows."""
    k_pages, v_pages = layer.k_pages, layer.v_pages  # contiguous (pages, page_size, H_kv, D)
    k_scale = v_scale = None
    if isinstance(cache, _Int8PagedCache):
        k_scale, v_scale = cache.scales_of(k_pages), cache.scales_of(v_pages)
    n, page, hkv, d = k_pages.shape
    return k_pages.view(n, hkv, d, page).permute(0, 3, 1, 2), v_pages, k_scale, v_scale


_PagedBase: Any = PagedAttentionCache if PagedAttentionCache is not None else object


class _Int8PagedCache(_PagedBase):
    """transformers' PagedAttentionCache with its pages in int8 (hf.apply(model,
    kv_cache_dtype=torch.int8)): transformers sizes the pool for one byte per value, so the same
    memory holds 2x (bfloat16) or 4x (float32) the tokens; a float32 scale per row and head lies
    beside it (scales_of), 4 / D more bytes that transformers' sizing does not count. Rows are
    quantized as functional.quantize_kv does when our cache op writes them. Forked requests copy
    their blocks' scales with the blocks; CPU offloading (cpu_offload_space) copies bytes only
    and is refused."""

    def __init__(self, config, continuous_batching_config, *args, dtype=torch.float16, **kwargs):
        if getattr(continuous_batching_config, "cpu_offload_space", None):
            raise NotImplementedError(
                "torch_masked_attn.hf: an 8-bit paged cache (kv_cache_dtype=torch.int8) does not support "
                f"cpu_offload_space (got {continuous_batching_config.cpu_offload_space}); set it to 0"
            )
        with _compat.activations_in(dtype):  # transformers sizes activations by the cache's dtype otherwise
            super().__init__(config, continuous_batching_config, *args, dtype=torch.int8, **kwargs)
        self.dtype = dtype  # the activations' (transformers' "cache and activations" dtype)
        pool, self._block_bytes, (_, _, hkv, d) = _compat.pool_geometry(self)
        self._row_bytes, self._hkv = hkv * d, hkv
        self._scales = torch.zeros(pool.numel() // self._row_bytes, hkv, dtype=torch.float32)

    def scales_of(self, pages: Tensor) -> Tensor:
        """The scales of an int8 (pages, page_size, H_kv, D) view of the pool: the rows at its bytes."""
        n, page, hkv, d = pages.shape
        if pages.stride() != (page * hkv * d, hkv * d, d, 1) or hkv * d != self._row_bytes:
            raise RuntimeError(
                "torch_masked_attn.hf: transformers' paged cache has a layout this version does not know"
            )
        start = int(pages.storage_offset()) // self._row_bytes
        return self._scales[start : start + n * page].view(n, page, hkv)

    def perform_cache_copy(self, copy_src_and_dst) -> None:
        super().perform_cache_copy(copy_src_and_dst)
        for name, (src, dst) in copy_src_and_dst.items():
            if src:
                rows = self._block_bytes[name] // self._row_bytes
                blocks = self._scales.view(-1, rows, self._hkv)
                blocks.index_copy_(0, torch.tensor(dst), blocks.index_select(0, torch.tensor(src)))


@dataclass(eq=False)
class _StepPages:
    """The page tables of one forward step of continuous batching, for one group of layers
    (transformers' cache allocator): derived once from the step's read indices, shared by
    every layer of the group."""

    read_index: Tensor
    table: Tensor  # (N, max_pages) int32: page p of sequence b is the pool's page table[b, p]
    seqused: Tensor  # (N,) int32: keys of sequence b


def _step_memo(cache, layer: _compat.LayerPages, read_index: Tensor):
    """The plans built this step, per allocator, kept on the cache object: (memo, the allocator's
    plan if it was built for this step's read-index tensor, else None)."""
    memo = cache.__dict__.setdefault("_tma_pages", {})
    hit = memo.get(layer.index)
    return memo, hit if hit is not None and hit.read_index is read_index else None


def _step_pages(cache, layer: _compat.LayerPages, read_index: Tensor, cu_k: Tensor) -> _StepPages:
    """Sequence b's keys are the pool rows read_index[cu_k[b] : cu_k[b + 1]] (whole pages but the
    last, in page order: transformers' full-attention allocator); its page table is every
    page_size-th of them over page_size. Cached on the cache object for the step."""
    memo, hit = _step_memo(cache, layer, read_index)
    if hit is not None:
        return hit
    page = layer.page_size
    cu = cu_k.to(torch.int64)
    lens = cu[1:] - cu[:-1]
    n_pages = (lens + page - 1) // page
    cols = torch.arange(max(int(n_pages.max()), 1) if n_pages.numel() else 1)
    used = cols.unsqueeze(0) < n_pages.unsqueeze(1)
    first = torch.where(used, cu[:-1].unsqueeze(1) + cols.unsqueeze(0) * page, 0)
    table = torch.where(used, read_index[first] // page, 0).to(torch.int32)
    hit = memo[layer.index] = _StepPages(read_index, table, lens.to(torch.int32))
    return hit


def _paged_attention(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, kwargs: dict, scaling, softcap, sinks
) -> Tensor:
    """One layer of a continuous-batching step: query (1, H, T, D) and the step's new key / value
    states (1, H_kv, T, D) of every sequence packed end to end (kwargs: cu_seq_lens_q,
    cu_seq_lens_k, read_index, write_index from transformers' batch). The new rows are written
    into the paged cache by our cache op; full-attention layers then read every sequence's pages
    in place (varlen_attn with a block table rebuilt from the read indices); sliding-window
    layers (transformers' ring buffer) read their at most window - 1 cached rows through the read
    indices, as transformers does, before the write. Returns (1, T, H, Dv)."""
    cache = kwargs["cache"]
    missing = [k for k in _compat.CB_KWARGS if kwargs.get(k) is None]
    if missing or query.shape[0] != 1:
        raise ValueError(
            f"masked_attn: a PagedAttentionCache comes from transformers' continuous batching, with "
            f"one packed sequence of tokens and {', '.join(missing) or 'its arguments'}; got query "
            f"{tuple(query.shape)}" + (f" without {', '.join(missing)}" if missing else "")
        )
    layer_idx = cast(int, module.layer_idx)  # transformers' attention layers' index
    layer = _compat.layer_pages(cache, layer_idx)
    k_pages, v_pages, k_scale, v_scale = _cache_pages(cache, layer)
    read_index = kwargs["read_index"][layer.index]
    write_index = kwargs["write_index"][layer.index]
    cu_q = kwargs["cu_seq_lens_q"]
    cu_k = kwargs["cu_seq_lens_k"]
    cu_k = cu_k[layer.layer_type] if isinstance(cu_k, dict) else cu_k
    cu_q, cu_k = cu_q.to(torch.int32), cu_k.to(torch.int32)
    max_q = _compat.cb_max_q(kwargs) or int((cu_q[1:] - cu_q[:-1]).max())
    q = query[0].transpose(0, 1)  # (T, H, D), a view
    k_new = key[0].transpose(0, 1)  # (T, H_kv, D)
    v_new = value[0].transpose(0, 1)
    window = layer.sliding_window
    left = -1 if window is None else window - 1
    args = {"scale": scaling, "window_size": (left, 0), "enable_gqa": k_new.size(1) != q.size(1)}
    if softcap is not None:
        args["softcap"] = float(softcap)
    if sinks is not None:
        args["sinks"] = sinks
    scales = (k_scale, v_scale) if k_scale is not None else None
    if read_index.numel() == 0:  # only new sequences in the step: their keys are the new rows
        _F.write_kv_cache(k_new, v_new, k_pages, v_pages, write_index, k_scale, v_scale)
        max_k = int((cu_k[1:] - cu_k[:-1]).max())
        out = _F.varlen_attn(q, *_as_cached(k_new, v_new, scales, args), cu_q, cu_k, max_q, max_k, **args)
    elif window is None:
        _F.write_kv_cache(k_new, v_new, k_pages, v_pages, write_index, k_scale, v_scale)
        pages = _step_pages(cache, layer, read_index, cu_k)
        if scales is not None:
            args.update(k_scale=k_scale, v_scale=v_scale)
        out = _F.varlen_attn(
            q,
            k_pages,
            v_pages,
            cu_q,
            None,
            max_q,
            int(pages.seqused.max()),
            seqused_k=pages.seqused,
            block_table=pages.table,
            **args,
        )
    else:
        out = _ring_attention(
            cache,
            layer,
            q,
            (k_new, v_new),
            (k_pages, v_pages),
            scales,
            read_index,
            write_index,
            cu_q,
            cu_k,
            max_q,
            args,
        )
    return cast(Tensor, out).unsqueeze(0)  # varlen_attn without return_aux: a tensor


def _as_cached(k: Tensor, v: Tensor, scales, args: dict) -> tuple[Tensor, Tensor]:
    """New rows as the pool holds them: in an 8-bit pool (scales given) quantized as the cache op
    quantizes them, their scales added to varlen_attn's args; else the rows."""
    if scales is None:
        return k, v
    (kq, ks), (vq, vs) = _F.quantize_kv(k), _F.quantize_kv(v)
    args.update(k_scale=ks, v_scale=vs)
    return kq, vq


@dataclass(eq=False)
class _RingStep:
    """A step's plan for one sliding-window group (transformers' ring buffer, slot = position %
    window): which sequences read the ring in place after the write, their page tables, and the
    rows the others read before it."""

    read_index: Tensor
    table: Tensor  # (N, max_pages) int32, the ring's pages in slot order from the first key
    seqused: Tensor  # (N,) int32: keys read in place (0 for the gathered sequences)
    gathered: Tensor | None  # (N,) bool: sequences whose keys are gathered, or None if there are none
    cu_g: Tensor | None  # (N + 1,) int32 offsets of the gathered keys
    src: Tensor | None  # (rows,) int64 row of each gathered key: < 0: new row -src - 1, else a ring row


def _ring_step(
    cache, layer: _compat.LayerPages, read_index: Tensor, write_index: Tensor, cu_q: Tensor, cu_k: Tensor
) -> _RingStep:
    """Sequence b has q_b new rows and c_b = k_b - q_b cached ones (at most window - 1). Its keys
    lie in the ring after this step's write, in slot order, whenever the write overwrites no row
    one of its queries still sees: one new row (a decode sees the whole window), or a past of
    c_b < window - 1 rows with c_b + q_b <= window (nothing wraps). Its rows in slot order are
    then its c_b read indices followed by its q_b write indices (a decode past the window: the
    ring rotated, which the softmax does not see; pages are whole there when window % page_size
    == 0 or the ring is one page). The others (a chunk that wraps) read their cached rows before
    the write, as transformers does."""
    memo, hit = _step_memo(cache, layer, read_index)
    if hit is not None:
        return hit
    page, window = layer.page_size, cast(int, layer.sliding_window)  # a sliding layer's
    cq, ck = cu_q.to(torch.int64), cu_k.to(torch.int64)
    nq, nk = cq[1:] - cq[:-1], ck[1:] - ck[:-1]
    cached = nk - nq
    whole_pages = window % page == 0 or window <= page
    known = cached < window - 1  # then the sequence's past is c_b; at window - 1 it may be any longer
    in_place = ((nq == 1) & (whole_pages | known)) | (known & (cached + nq <= window))
    n_pages = torch.where(in_place, (nk + page - 1) // page, 0)
    cols = torch.arange(max(int(n_pages.max()), 1) if n_pages.numel() else 1)
    used = cols.unsqueeze(0) < n_pages.unsqueeze(1)
    e = cols.unsqueeze(0) * page  # the key at the start of each page
    from_read = e < cached.unsqueeze(1)
    r = torch.where(used & from_read, ck[:-1].unsqueeze(1) + e, 0)
    w = torch.where(used & ~from_read, cq[:-1].unsqueeze(1) + e - cached.unsqueeze(1), 0)
    rows = torch.where(from_read, read_index[r] if read_index.numel() else 0, write_index[w])
    table = torch.where(used, rows // page, 0).to(torch.int32)
    seqused = torch.where(in_place, nk, 0).to(torch.int32)
    gathered = cu_g = src = None
    if not bool(in_place.all()):
        gathered = ~in_place
        counts = torch.where(gathered, nk, 0)
        cu_g = torch.zeros(nk.numel() + 1, dtype=torch.int64)
        cu_g[1:] = counts.cumsum(0)
        # key i of gathered sequence b: a ring row (read index) for i < c_b, else new row cq[b] + i - c_b
        seq = torch.repeat_interleave(torch.arange(nk.numel()), counts)
        i = torch.arange(int(cu_g[-1])) - cu_g[:-1][seq]
        is_new = i >= cached[seq]
        ring_row = read_index[ck[:-1][seq] + torch.where(is_new, 0, i)] if read_index.numel() else 0
        src = torch.where(is_new, -(cq[:-1][seq] + i - cached[seq]) - 1, ring_row)
        cu_g = cu_g.to(torch.int32)
    hit = memo[layer.index] = _RingStep(read_index, table, seqused, gathered, cu_g, src)
    return hit


def _ring_attention(
    cache, layer, q, new, pool, scales, read_index, write_index, cu_q, cu_k, max_q, args: dict[str, Any]
) -> Tensor:
    """A sliding-window layer's step (see _ring_step): the gathered sequences' keys are read first
    (at most window - 1 cached rows each), then the new rows written, then the in-place sequences
    attend to the ring's pages and the gathered ones to their rows, each call giving 0 to the other
    call's rows (no key), so the two outputs add up exactly. new: the step's (keys, values); pool:
    the layer's (key pages, value pages); scales: an 8-bit pool's (key scales, value scales), else
    None (the new rows are then quantized as the write quantizes them, and gathered with their
    scales)."""
    step = _ring_step(cache, layer, read_index, write_index, cu_q, cu_k)
    gathered, more_args = None, {**args}
    if step.gathered is not None:
        assert step.src is not None and step.cu_g is not None  # made with gathered (_ring_step)
        is_new = step.src < 0
        ring = torch.where(is_new, 0, step.src)
        fresh = torch.where(is_new, -step.src - 1, 0)
        page = layer.page_size
        rows = list(new)
        if scales is not None:
            (kq, ks), (vq, vs) = _F.quantize_kv(new[0]), _F.quantize_kv(new[1])
            rows, pool_rows = [kq, vq, ks, vs], [*pool, *scales]
        else:
            pool_rows = list(pool)
        gathered = []
        for fresh_rows, pages in zip(rows, pool_rows):
            nw = is_new.view(-1, *([1] * (fresh_rows.dim() - 1)))
            gathered.append(torch.where(nw, fresh_rows.index_select(0, fresh), pages[ring // page, ring % page]))
        if scales is not None:
            more_args.update(k_scale=gathered[2], v_scale=gathered[3])
    (k_new, v_new), (k_pages, v_pages) = new, pool
    k_scale, v_scale = scales if scales is not None else (None, None)
    _F.write_kv_cache(k_new, v_new, k_pages, v_pages, write_index, k_scale, v_scale)
    if scales is not None:
        args = {**args, "k_scale": k_scale, "v_scale": v_scale}
    out = _F.varlen_attn(
        q,
        k_pages,
        v_pages,
        cu_q,
        None,
        max_q,
        max(int(step.seqused.max()), 1),
        seqused_k=step.seqused,
        block_table=step.table,
        **args,
    )
    if gathered is not None and step.cu_g is not None:
        lens = step.cu_g[1:] - step.cu_g[:-1]
        more = _F.varlen_attn(q, gathered[0], gathered[1], cu_q, step.cu_g, max_q, max(int(lens.max()), 1), **more_args)
        out = cast(Tensor, out) + cast(Tensor, more)
    return cast(Tensor, out)  # varlen_attn without return_aux: a tensor


_ManagerBase: Any = ContinuousBatchingManager if ContinuousBatchingManager is not None else object


class MaskedAttnBatchingManager(_ManagerBase):
    """transformers' ContinuousBatchingManager for a model on "masked_attn": the one
    difference is that it keeps the model on "masked_attn" (transformers' own manager admits
    only "sdpa", "paged|eager" and flash implementations, and switches "eager"). No mask is
    built for it (transformers builds one for "sdpa" and "paged|eager" only)."""

    def switch_to_cb_friendly_attn(self, model, *args, **kwargs) -> None:
        if _compat.attn_implementation(model) != ATTN_IMPLEMENTATION:
            super().switch_to_cb_friendly_attn(model, *args, **kwargs)

    def _create_batch_processor(self):
        """transformers' own, with the paged cache in int8 when hf.apply asked for it."""
        if getattr(self.model, "_tma_kv_cache_dtype", None) != torch.int8:
            return super()._create_batch_processor()
        with _compat.swapped("PagedAttentionCache", _Int8PagedCache):
            return super()._create_batch_processor()


def _init_continuous_batching(model: Any):  # a transformers model
    """model.init_continuous_batching for apply(): transformers' own (generate_batch and
    continuous_batching_context_manager call it), building our manager where it builds its own
    when the model runs on "masked_attn"."""
    original = model.init_continuous_batching

    @functools.wraps(original)
    def init_continuous_batching(*args, **kwargs):
        if _compat.attn_implementation(model) != ATTN_IMPLEMENTATION or _compat.cached_manager(model) is not None:
            return original(*args, **kwargs)
        _compat.require("serving")
        with _compat.swapped("ContinuousBatchingManager", MaskedAttnBatchingManager):
            return original(*args, **kwargs)

    init_continuous_batching._tma_original = original  # pyright: ignore[reportAttributeAccessIssue]
    return init_continuous_batching


AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, mask_function)


# ---------------------------------------------------------------------------------------------
# apply(model): the causal-LM loss through the fused linear-cross-entropy
# ---------------------------------------------------------------------------------------------

_CAPTURE: contextvars.ContextVar = contextvars.ContextVar("torch_masked_attn_hf_capture", default=None)

# config attributes that scale the logits in some transformers models; apply() refuses them rather
# than give a loss that differs from the model's own (final_logit_softcapping is supported)
_LOGIT_TRANSFORMS = (
    "logit_scale",
    "logits_scaling",
    "output_multiplier_scale",
    "logits_scale",
    "lm_head_multiplier",
    "mup_width_multiplier",
)


def _head_capture(head: nn.Linear):
    forward = head.forward

    def capture_forward(x: Tensor) -> Tensor:
        slot = _CAPTURE.get()
        if slot is not None and slot.get("head") is head and "hidden" not in slot:
            slot["hidden"] = x
            return x.new_empty(*x.shape[:-1], 0)  # no (tokens x vocab) product
        return forward(x)

    capture_forward._tma_original = forward
    return capture_forward


def apply(model: nn.Module, *, kv_cache_dtype: torch.dtype | None = None) -> nn.Module:
    """Route ``model``'s causal-LM loss through
    :func:`torch_masked_attn.functional.linear_cross_entropy`; returns the model.

    ``kv_cache_dtype=torch.int8``: continuous batching (``generate_batch``, the
    manager) on "masked_attn" keeps its paged cache in int8, one float32 scale
    per token and head beside it (:func:`torch_masked_attn.functional.quantize_kv`),
    read by the kernels as it is; transformers sizes the pool for one byte per
    value. None (the default): the model's dtype. ``generate`` takes
    :class:`Int8Cache` instead.

    When the model gets ``labels`` in training mode (or ``skip_logits=True``),
    its forward runs with the LM head capturing the final hidden states
    instead of projecting them, and the loss is the fused
    linear-cross-entropy: the (tokens x vocab) logits are never built, and rows
    whose shifted label is ``ignore_index`` cost no matrix product. The output's
    ``logits`` is then None. In eval mode, or with ``skip_logits=False``, or
    without labels, the model runs as before (logits, its own loss).
    Same loss as transformers' ForCausalLMLoss: labels shifted by one (or
    ``shift_labels``), mean over kept tokens, or sum / ``num_items_in_batch``.
    The attention implementation is separate: pick it with
    ``attn_implementation="masked_attn"``.
    """
    if kv_cache_dtype not in (None, torch.int8):
        raise ValueError(f"torch_masked_attn.hf.apply: kv_cache_dtype must be None or torch.int8, got {kv_cache_dtype}")
    lm: Any = model  # a transformers model: attributes (config, forward, ...) nn.Module's typing does not know
    lm._tma_kv_cache_dtype = kv_cache_dtype
    if getattr(model, "_tma_hf_applied", False):
        return model
    head, softcap = _fusable_head(lm)
    head.forward = _head_capture(head)  # pyright: ignore[reportAttributeAccessIssue]  (an instance attribute)
    lm.forward = _fused_forward(lm, head, softcap)
    if hasattr(lm, "init_continuous_batching"):
        lm.init_continuous_batching = _init_continuous_batching(lm)
    lm._tma_hf_applied = True
    return model


def _fusable_head(lm: Any) -> tuple[nn.Linear, float | None]:
    """A causal LM's LM head and its final logit soft-capping (None: off), or the error saying why
    its loss cannot be fused."""
    _compat.require("apply")
    custom = _compat.custom_loss_function(lm)
    loss_type = getattr(lm, "loss_type", None)
    causal_loss = custom is _compat.ForCausalLMLoss or (
        custom is None and (loss_type == "ForCausalLM" or loss_type not in _compat.LOSS_MAPPING)
    )
    if not (causal_loss and hasattr(lm, "can_generate") and lm.can_generate()):
        raise TypeError(
            f"torch_masked_attn.hf.apply: {type(lm).__name__} is not a causal LM with "
            f"transformers' ForCausalLM loss (loss_type={loss_type!r})"
        )
    head = lm.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise TypeError(
            f"torch_masked_attn.hf.apply: the output embeddings of {type(lm).__name__} must be "
            f"an nn.Linear, got {type(head).__name__}"
        )
    config = lm.config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in _LOGIT_TRANSFORMS:
        value = getattr(text_config, name, None)
        if value is not None and value != 1 and value is not False:
            raise NotImplementedError(
                f"torch_masked_attn.hf.apply: {type(lm).__name__} scales its logits "
                f"(config.{name}={value!r}); the fused loss does not model that"
            )
    softcap = getattr(text_config, "final_logit_softcapping", None)
    return head, float(softcap) if softcap else None


def _fused_forward(model: Any, head: nn.Linear, softcap: float | None):
    """model.forward for apply(): with labels and skip_logits, the hidden states the LM head
    captured go to linear_cross_entropy (transformers' ForCausalLMLoss's reduction)."""
    forward = model.forward

    @functools.wraps(forward)
    def fused_forward(*args, labels: Tensor | None = None, skip_logits: bool | None = None, **kwargs):
        if skip_logits is None:
            skip_logits = model.training and labels is not None
        keep = kwargs.get("logits_to_keep", 0)
        if not skip_logits or labels is None or not (isinstance(keep, int) and keep == 0):
            return forward(*args, labels=labels, **kwargs)
        ignore_index = kwargs.pop("ignore_index", -100)
        shift_labels = kwargs.pop("shift_labels", None)
        num_items = kwargs.get("num_items_in_batch")
        slot: dict[str, Any] = {"head": head}
        token = _CAPTURE.set(slot)
        try:
            out = forward(*args, labels=None, **kwargs)
        finally:
            _CAPTURE.reset(token)
        hidden = slot.get("hidden")
        if hidden is None:
            raise RuntimeError(
                f"torch_masked_attn.hf.apply: {type(model).__name__}'s forward did not call its "
                "LM head; its loss cannot be fused"
            )
        if shift_labels is None:
            shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        shift_labels = shift_labels.to(hidden.device)
        if tuple(shift_labels.shape) != tuple(hidden.shape[:-1]):
            raise ValueError(
                f"torch_masked_attn.hf.apply: labels {tuple(shift_labels.shape)} do not match the "
                f"tokens {tuple(hidden.shape[:-1])}"
            )
        loss = _F.linear_cross_entropy(
            hidden,
            head.weight,
            shift_labels,
            head.bias,
            ignore_index=ignore_index,
            reduction="mean" if num_items is None else "sum",
            softcap=softcap,
        )
        if loss.dtype in (torch.bfloat16, torch.float16):  # transformers' loss is float32 for these
            loss = loss.float()
        if num_items is not None:
            loss = loss / (num_items.to(loss.device) if torch.is_tensor(num_items) else num_items)
        if isinstance(out, tuple):  # return_dict=False: (loss, <the rest without logits>)
            return (loss,) + tuple(out[1:])
        out["loss"] = loss
        out["logits"] = None
        return out

    return fused_forward
