"""torch.ops.masked_attn: the ops, and the Python API around them.

Importing this module loads the compiled library and registers every op's fake
(meta) kernel and autograd. The work is in four modules, each with one job:

* _library: loads the library; the kernels' controls past the ops (ctypes:
  the instruction-set variant, the decode plan, scratch memory, test knobs);
* _options: an op call's arguments by name (OpArgs) and the options of an
  attention call (AttnOptions), checked once;
* _fake: the fake kernels (shapes and dtypes, for torch.compile and meta);
* _autograd: the gradients ("How gradients are registered" there).

This module re-exports what the rest of the package and its users call.

The ops themselves are defined in csrc/shim/ (schemas: registration.cpp).
Each signature below is its schema's arguments in order and its outputs'
names (tests/project/test_docs.py holds them to the registered schemas):
`name?` may be None, `name=x` defaults to x, `name!` is written by the op;
<options> is the tail every attention schema ends with, declared once
(kOpts, options.cpp):

    <options> = (window_left=-1, window_right=-1, softcap?, sinks?, alibi_slopes?, diagonal=0)

    masked_attn::forward(q, k, v, attn_mask?, key_padding_mask?, head_mask?,
                         is_causal=False, scale?, need_weights=False, dropout_p=0.,
                         dropout_seed?, for_backward=True, k_scale?, v_scale?, <options>)
        -> (out, lse, weights, out_lo)
    masked_attn::backward(grad_out, grad_weights?, q, k, v, out, lse, attn_mask?,
                          key_padding_mask?, head_mask?, is_causal=False, scale?,
                          head_mask_grad=False, mask_grad=False, dropout_p=0., dropout_seed?,
                          out_lo?, <options>)
        -> (grad_q, grad_k, grad_v, grad_head_mask, grad_scores, grad_sinks)
    masked_attn::backward_into(grad_out, grad_weights?, q, k, v, out, lse, attn_mask?,
                               key_padding_mask?, head_mask?, is_causal, scale?,
                               head_mask_grad, mask_grad, grad_q!, grad_k!, grad_v!,
                               dropout_p=0., dropout_seed?, out_lo?, <options>)
        -> (grad_head_mask, grad_scores, grad_sinks)

backward_into writes dq, dk, dv into the given grad_q, grad_k, grad_v (views
of one buffer: MultiheadAttention's packed projections).

out_lo (bfloat16 / float16 only; empty otherwise) is out's rounding error in
the same dtype and layout: out + out_lo is the float32 output to 16 (bf16) or
22 (fp16) bits. The backward takes delta_i = grad_out_i . (out_i + out_lo_i)
(exact whatever scaled the output before it was rounded: a head mask,
dropout, a sink); without out_lo, grad_out . out (every FlashAttention's).
for_backward=False says that no backward will follow (the wrappers pass
grad_wanted()): out_lo is then empty, and bfloat16's tile products (AMX,
AVX512-BF16) round P to bfloat16 in P V, as native's flash kernel does
(docs/design.md, section 6); a backward from such a forward takes
grad_out . out.

dropout_seed is an int64 tensor (seed, offset) of shape (2,), required when
dropout_p > 0: the keep mask is a function of it and of the element's
(b, h, i, j) (Philox-4x32-10, csrc/attention/philox.h), so the op draws
nothing and the backward, given the same seed, regenerates the same mask.
new_dropout_seed() draws one from PyTorch's default generator.

diagonal: query i's diagonal is key i + diagonal (0: top-left, SDPA's;
Lk - Lq: bottom-right, flash-attn's); is_causal sees keys j <= i + diagonal,
and window_left / window_right keys j in [i + diagonal - left, i + diagonal +
right] (-1: that side unbounded). The varlen ops align each sequence to its
own bottom right and take diagonal 0 only. softcap: scores
s -> softcap * tanh(s / softcap) before the masks are added. sinks (H,): one
logit per head in every row's softmax denominator (no value); lse includes
it. The options are built and checked once per call (AttnOptions) and passed
by their schema names (OpArgs).

grad_scores (B, H, Lq, Lk) is dL/dS, the gradient of the additive masks, and
is materialised only when mask_grad (a floating mask requires grad); it is in
the accumulation type (float32, float64 for float64), rounded to the mask's
dtype after the caller's sums. grad_head_mask (head_mask_grad) and grad_sinks
(with sinks: -sum_{b,i} exp(sink_h - lse) delta_i, delta_i the backward's
grad_out_i . (out_i + out_lo_i) (+ the weights' term)) come reduced to the
head mask's and the sinks' shapes and dtypes; empty where not asked for.

Conventions are nn.MultiheadAttention's: a bool mask is True where attention
is blocked; a floating mask is added to the scaled scores.

Packed variable-length sequences
--------------------------------
    masked_attn::varlen_forward(query, key, value, cu_seq_q, cu_seq_k?, max_q, max_k,
                                scale?, seqused_k?, block_table?, for_backward=True,
                                k_scale?, v_scale?, <options>)
        -> (out, lse, out_lo)
    masked_attn::varlen_backward(grad_out, query, key, value, out, lse, cu_seq_q,
                                 cu_seq_k, max_q, max_k, scale?, out_lo?, <options>)
        -> (grad_query, grad_key, grad_value, grad_sinks)

query (T_q, H, D), key (T_k, H_kv, D), value (T_k, H_kv, Dv); int32 offsets
(N + 1,); out (T_q, H, Dv); lse (H, T_q) (float32, float64 for float64).
The window is bottom-right aligned (flash-attn's): query i of a sequence sees
key j iff i + Lk - Lq - left <= j <= i + Lk - Lq + right, -1 = unbounded.
seqused_k and block_table (key, value then (pages, page_size, H_kv, D) pools,
page_size a multiple of 64) are inference-only (no backward). The options are
masked_attn::forward's (AttnOptions; the lse includes the sink). The
user-facing function is torch_masked_attn.functional.varlen_attn.

Cross-entropy
-------------
    masked_attn::cross_entropy(input, target, weight?, reduction='mean', ignore_index=-100,
                               label_smoothing=0.0, z_loss=0.0, softcap?,
                               inplace_backward=False)
        -> (loss, lse)
    masked_attn::cross_entropy_backward(grad_loss, input, target, weight?, lse, reduction,
                                        ignore_index, label_smoothing, target_grad=False,
                                        z_loss=0.0, softcap?)
        -> (grad_input, grad_target)
    masked_attn::cross_entropy_backward_(grad_loss, input!, target, weight?, lse, reduction,
                                         ignore_index, label_smoothing, z_loss=0.0, softcap?)
        -> ()
    masked_attn::cross_entropy_chunk_(input!, target, weight?, grad_scale?, ignore_index=-100,
                                      label_smoothing=0.0, z_loss=0.0, softcap?)
        -> (loss, lse)

cross_entropy_backward_ writes the gradient over input. cross_entropy_chunk_
gives each row's loss and lse (the accumulation type, no reduction); with
grad_scale, grad_scale * d loss_row / d input overwrites input
(linear_cross_entropy's chunks).

input (C,), (N, C) or (N, C, d1, ..., dk); target int64 class indices of
input's shape without the class dim, or probabilities of input's shape and
dtype; weight (C,) of input's dtype; reduction 'none' | 'mean' | 'sum';
label_smoothing in [0, 1]; z_loss >= 0 adds z_loss * lse^2 to each kept row;
softcap > 0 scores the row on softcap * tanh(input / softcap). lse is the
per-row log-sum-exp (float32, float64 for float64 input; 0 on ignored
rows). inplace_backward=True makes the autograd backward write the input's
gradient over input itself (no new buffer; the logits are gone after it).
The drop-in F.cross_entropy with PyTorch's argument handling and exceptions
is torch_masked_attn.losses.

KV caches
---------
    masked_attn::cache_write(key, value, key_cache!, value_cache!, slots, key_scale!?,
                             value_scale!?)
        -> ()
    masked_attn::quantize_kv(x) -> (q, scale)

cache_write writes new rows into the caches in place (functional.write_kv_cache),
quantizing them into int8 caches where key_scale and value_scale are given.
quantize_kv gives an 8-bit cache's rows: q (rows, D) int8 and scale (rows,)
float32 (functional.quantize_kv views them as x's shape).
"""

from __future__ import annotations

from . import _fake  # noqa: F401  (registers the fake kernels)
from ._autograd import (
    AttnSaved,
    _needs,
    attention_backward,
    call_op,
    first_order_only,
    first_order_only_named,
    register_autograd,
    saved,
)
from ._library import (
    built_isas,
    bwd_cpus,
    bwd_key_group,
    decode_plan,
    decode_splits,
    empty_on_huge_pages,
    isa_available,
    isa_for,
    kernel_traits,
    page_multiple,
    release_memory,
    scratch_stats,
    use_isa,
)
from ._options import (
    BACKWARD,
    BACKWARD_INTO,
    FORWARD,
    VARLEN_BACKWARD,
    VARLEN_FORWARD,
    AttnOptions,
    OpArgs,
    grad_wanted,
    new_dropout_seed,
    saved_out_lo,
)

__all__ = [
    "BACKWARD",
    "BACKWARD_INTO",
    "FORWARD",
    "VARLEN_BACKWARD",
    "VARLEN_FORWARD",
    "AttnOptions",
    "AttnSaved",
    "OpArgs",
    "_needs",
    "attention_backward",
    "built_isas",
    "bwd_cpus",
    "bwd_key_group",
    "call_op",
    "decode_plan",
    "decode_splits",
    "empty_on_huge_pages",
    "first_order_only",
    "first_order_only_named",
    "grad_wanted",
    "isa_available",
    "isa_for",
    "kernel_traits",
    "new_dropout_seed",
    "register_autograd",
    "page_multiple",
    "release_memory",
    "saved",
    "saved_out_lo",
    "scratch_stats",
    "use_isa",
]
