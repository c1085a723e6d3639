"""vLLM's attention on our kernels: the backend vLLM's CPU platform builds in place of its own
CPU_ATTN when the switch is on (torch_masked_attn.vllm, docs/design/17-vllm.md).

Per layer and step: ``do_kv_cache_update`` writes the step's new key and value rows into the
layer's pages (:func:`torch_masked_attn.functional.write_kv_cache`, one C op), then ``forward``
runs every request of the step, prefills, prefill chunks and decodes mixed, in one call of
:func:`torch_masked_attn.functional.varlen_attn`'s op over the pages in place (bottom-right
causal, the request's block table and length), its arguments checked once per layer and cache.
The page layout is ours: see :func:`pages`.

Every vLLM name comes through ``_compat`` (the seam).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .. import functional as _F
from .. import ops as _ops
from . import _compat

_compat.require("backend")

# The page sizes the kernels read in place (varlen_attn gathers other sizes into rows first):
# the multiples of every variant's block_k (64), as the library states them.
PAGE_MULTIPLE = _ops.page_multiple()


INT8 = "int8_per_token_head"  # vLLM's name of a cache dtype with a scale per token and head: our int8 cache


class Pages(NamedTuple):
    """One layer's cache as the kernels read it: key and value pages (blocks, page_size, H_kv, D)
    and, in an int8 cache, their float32 scales (blocks, page_size, H_kv); else None."""

    k: Tensor
    v: Tensor
    k_scale: Tensor | None = None
    v_scale: Tensor | None = None


def pages(kv_cache: Tensor, head_size: int, head_size_v: int | None = None) -> Pages:
    """The key and value pages of one layer's cache (and its scales), strided views.

    vLLM hands a layer its cache as a (blocks, H_kv, page_size, C) view (its logical
    ``[B, H, N, C]``, layout LBHNC: a block's H_kv x page_size x C elements in one run, C = D + Dv,
    or D + Dv + 8 bytes in an int8 cache); only our ops read and write the blocks' insides, and
    vLLM moves, zeroes and shares whole blocks. So each block holds K transposed, per key head a
    (D, page_size) block (keys side by side: the kernels read them with no transposes, the tile
    path's order of the scores), then the values as rows, (page_size, H_kv, Dv) (a token's value
    heads side by side), then in an int8 cache the key scales and the value scales, float32
    (page_size, H_kv) each."""
    blocks, hkv, page, width = kv_cache.shape
    int8 = kv_cache.dtype == torch.int8
    dv = head_size_v if head_size_v is not None else width - head_size - (8 if int8 else 0)
    s = kv_cache.stride()
    if s[1:] != (page * width, width, 1) or dv <= 0 or width != head_size + dv + (8 if int8 else 0):
        raise RuntimeError(
            "torch_masked_attn.vllm: vLLM handed a KV cache of shape "
            f"{tuple(kv_cache.shape)}, strides {s}, where this version expects blocks of "
            "(H_kv, page_size, D + Dv) elements in one run (layout LBHNC)"
        )
    at = kv_cache.storage_offset()
    k = kv_cache.as_strided((blocks, page, hkv, head_size), (s[0], 1, head_size * page, page), at)
    v = kv_cache.as_strided((blocks, page, hkv, dv), (s[0], hkv * dv, dv, 1), at + hkv * page * head_size)
    if not int8:
        return Pages(k, v)
    start = int(at) + hkv * page * (head_size + dv)  # bytes
    if start % 4 or s[0] % 4:
        raise RuntimeError("torch_masked_attn.vllm: an int8 KV cache whose blocks' scales are not 4-byte aligned")
    floats = torch.empty(0, dtype=torch.float32).set_(kv_cache.untyped_storage())  # the same bytes as float32
    shape, stride = (blocks, page, hkv), (s[0] // 4, hkv, 1)
    first = start // 4  # in floats
    k_scale = floats.as_strided(shape, stride, first)
    v_scale = floats.as_strided(shape, stride, first + page * hkv)
    return Pages(k, v, k_scale, v_scale)


@dataclass
class MaskedAttnMetadata:
    """One step's requests as varlen_attn reads them (shared by every layer of a cache group)."""

    num_tokens: int  # the step's query rows (cu_q[-1]); vLLM's tensors may be longer (padding)
    cu_q: Tensor  # (N + 1,) int32: request b's rows are cu_q[b] : cu_q[b + 1]
    seq_lens: Tensor  # (N,) int32: its keys, the new ones included (written before forward)
    block_table: Tensor  # (N, max_pages) int32, contiguous
    max_query_len: int
    max_seq_len: int  # at least the longest (vLLM's may be an upper bound)
    causal: bool

    def varlen_args(self) -> dict:
        """varlen_attn's sequence arguments of the step, built once for every layer."""
        args = self.__dict__.get("_varlen_args")
        if args is None:
            args = dict(
                cu_seq_q=self.cu_q,
                cu_seq_k=None,
                max_q=self.max_query_len,
                max_k=self.max_seq_len,
                seqused_k=self.seq_lens,
            )
            self.__dict__["_varlen_args"] = args
        return args


class MaskedAttnMetadataBuilder(_compat.AttentionMetadataBuilder):
    """The step's metadata from vLLM's CommonAttentionMetadata: a few views and dtype checks, no
    scheduling (the kernels plan each call themselves)."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False) -> MaskedAttnMetadata:
        m = common_attn_metadata
        if isinstance(m.causal, Tensor):
            raise NotImplementedError(
                "torch_masked_attn.vllm: a causal flag per request (multimodal prefix-LM attention) is not supported"
            )
        n = m.num_reqs
        cu_q = _int32(m.query_start_loc_cpu[: n + 1])
        return MaskedAttnMetadata(
            num_tokens=int(cu_q[-1]),
            cu_q=cu_q,
            seq_lens=_int32(m.seq_lens[:n]),
            block_table=_int32(m.block_table_tensor[:n]),
            max_query_len=int(m.max_query_len),
            max_seq_len=max(int(m.max_seq_len), 1),
            causal=bool(m.causal),
        )


def _int32(t: Tensor) -> Tensor:
    return t.to(torch.int32).contiguous()


def _refuse(feature: str) -> NotImplementedError:
    return NotImplementedError(
        f"torch_masked_attn.vllm: {feature} is not supported by this backend; "
        "unset MASKED_ATTN_VLLM to serve with vLLM's own CPU attention"
    )


class MaskedAttnImpl(_compat.AttentionImpl):
    """One decoder attention layer on varlen_attn: causal or not, sliding window, soft-cap, sinks,
    ALiBi, grouped-query heads. What it cannot do is refused here, when vLLM builds the layer."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = "decoder",
        kv_sharing_target_layer_name: str | None = None,
        sinks: Tensor | None = None,
        **others: Any,
    ) -> None:
        _check_layer(attn_type, kv_cache_dtype, others)
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.kv_cache_dtype, self.attn_type = kv_cache_dtype, attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.sliding_window = sliding_window
        self.softcap = float(logits_soft_cap) if logits_soft_cap else None  # vLLM's 0 / None: none
        self.alibi_slopes = None if alibi_slopes is None else torch.tensor(alibi_slopes, dtype=torch.float32)
        self.sinks = sinks
        self._prepared: dict = {}  # forward's checked options and pages, by what they depend on
        if sinks is not None and tuple(sinks.shape) != (num_heads,):
            raise ValueError(
                f"torch_masked_attn.vllm: sinks must be ({num_heads},), one per query head, got {tuple(sinks.shape)}"
            )

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        """The sinks as the kernels take them, float32, once the weights are in."""
        if self.sinks is not None:
            self.sinks = self.sinks.detach().to(torch.float32)
        self._prepared.clear()  # the options hold the sinks

    def do_kv_cache_update(self, layer, key: Tensor, value: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
        """The step's new rows into the layer's pages (a negative slot: a padding row, skipped)."""
        p = pages(kv_cache, self.head_size)
        n = slot_mapping.numel()
        _F.write_kv_cache(key[:n], value[:n], p.k, p.v, slot_mapping, p.k_scale, p.v_scale)

    def forward(
        self,
        layer,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        kv_cache: Tensor,
        attn_metadata: MaskedAttnMetadata | None,
        output: Tensor,
        output_scale: Tensor | None = None,
        output_block_scale: Tensor | None = None,
    ) -> Tensor:
        """Attention of the step's query rows (T, H, D) over their requests' pages, into output
        (T, H, Dv). Without metadata (vLLM's profiling run) nothing is computed."""
        if output_scale is not None or output_block_scale is not None:
            raise _refuse("fused output quantization (output_scale)")
        if attn_metadata is None:
            return output
        m = attn_metadata
        q = query[: m.num_tokens]
        p, opts = self._prepare(q, kv_cache, m.causal, m.block_table)
        out, _ = _F._varlen_forward(
            q, p.k, p.v, m.varlen_args(), self.scale, m.block_table, opts, (p.k_scale, p.v_scale)
        )
        output[: m.num_tokens].copy_(out)
        return output

    def _prepare(self, query: Tensor, kv_cache: Tensor, causal: bool, block_table: Tensor) -> tuple[Pages, Any]:
        """The layer's pages and checked options, as varlen_attn would check them, once per cache
        tensor and query dtype: a small step's Python then is the op's call (its shim checks every
        tensor again; the page size is a multiple of what the kernels read in place, the
        builder's tensors int32)."""
        key = (id(kv_cache), kv_cache.data_ptr(), tuple(kv_cache.shape), query.dtype, causal)
        got = self._prepared.get(key)
        if got is not None and got[0] is kv_cache:
            return got[1], got[2]
        p = pages(kv_cache, self.head_size)
        if p.k.size(1) % PAGE_MULTIPLE:
            raise RuntimeError(
                f"torch_masked_attn.vllm: a page of {p.k.size(1)} tokens; expected a multiple of {PAGE_MULTIPLE}"
            )
        left = -1 if self.sliding_window is None else self.sliding_window - 1
        options = dict(
            window_size=(left, 0 if causal else -1),
            softcap=self.softcap,
            sinks=self.sinks,
            alibi_slopes=self.alibi_slopes,
        )
        scales = (p.k_scale, p.v_scale)
        gqa = self.num_kv_heads != self.num_heads
        _, opts = _F._varlen_checked(query, p.k, p.v, block_table, gqa, scales, None, options)
        if len(self._prepared) > 8:  # vLLM binds one cache per layer: a few keys at most
            self._prepared.clear()
        self._prepared[key] = (kv_cache, p, opts)
        return p, opts


def _check_layer(attn_type: str, kv_cache_dtype: str, others: dict) -> None:
    """Refuses, naming it, what a layer asks for that this backend does not serve."""
    if attn_type != _compat.AttentionType.DECODER:
        raise _refuse(f"attention of type {attn_type!r} (only decoder layers are served)")
    if kv_cache_dtype not in ("auto", INT8) and (
        kv_cache_dtype not in _CACHE_DTYPES or getattr(torch, kv_cache_dtype) != _compat.model_dtype()
    ):
        raise _refuse(f"kv_cache_dtype={kv_cache_dtype!r} (the model's dtype: 'auto'; ours in int8: {INT8!r})")
    used = {k: v for k, v in others.items() if v not in (None, False)}
    if used:
        raise _refuse(f"the attention arguments {sorted(used)}")
    for feature, used in _compat.config_checks().items():
        if used:
            raise _refuse(feature)


_CACHE_DTYPES = ("bfloat16", "float16")  # vLLM's names of a cache dtype that may be the model's


class MaskedAttnBackend(_compat.AttentionBackend):
    """What vLLM asks of an attention backend: our impl and builder, the blocks the kernels read
    in place (multiples of 64 tokens), the cache layout LBHNC (a block's heads, tokens and
    channels in one run, which :func:`pages` reinterprets)."""

    forward_includes_kv_cache_update = False  # vLLM calls do_kv_cache_update, then forward
    supported_dtypes = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes = ["auto", "bfloat16", "float16", INT8]

    @staticmethod
    def get_name() -> str:
        return _compat.BACKEND_NAME

    @classmethod
    def customize_spec(cls, spec: Any) -> Any:
        """An int8 cache's tokens carry their key and value scales (float32 per head) beside the
        rows: 8 more bytes per token and head in vLLM's page size (``pages`` places them)."""
        if spec.kv_quant_mode != _compat.KVQuantMode.INT8_PER_TOKEN_HEAD or spec.state_content_bytes is not None:
            return spec
        return dataclasses.replace(spec, state_content_bytes=spec.head_size + spec.head_size_v + 8)

    @staticmethod
    def get_impl_cls() -> type[MaskedAttnImpl]:
        return MaskedAttnImpl

    @staticmethod
    def get_builder_cls() -> type[MaskedAttnMetadataBuilder]:
        return MaskedAttnMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        return [_compat.MultipleOf(PAGE_MULTIPLE)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple:
        return (_compat.KVCacheLayout.LBHNC,)

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_non_causal(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == _compat.AttentionType.DECODER

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return True  # a row's bits depend on its own request only (docs/design/05)

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False  # connectors read CPU_ATTN's block insides
