"""Drop-in modules."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .devices import uses_kernels
from .functional import native_attention
from .ops import (
    AttnOptions,
    AttnSaved,
    _needs,
    attention_backward,
    first_order_only,
    grad_wanted,
    new_dropout_seed,
    saved_out_lo,
)

__all__ = ["MultiheadAttention", "replace_attention"]


def _pad_key(mask):
    """One more key column, not masked (False / 0.0), as add_bias_kv and
    add_zero_attn append one key."""
    if mask is None:
        return None
    return torch.cat([mask, mask.new_zeros(*mask.shape[:-1], 1)], dim=-1)


def _heads(t, H, hd, batch_first):
    """A projection (N, L, H*hd) if batch_first else (L, N, H*hd) as the
    (N, H, L, hd) view the op reads (no copy)."""
    t = t.unflatten(-1, (H, hd))
    return t.permute(0, 2, 1, 3) if batch_first else t.permute(1, 2, 0, 3)


def _split_qkv(qkv, batch_first):
    """A fused projection viewed (N, L, 3, H, hd) or (L, N, 3, H, hd) as q, k, v
    (N, H, L, hd) views."""
    perm = (0, 2, 1, 3) if batch_first else (1, 2, 0, 3)
    return tuple(qkv.select(2, i).permute(*perm) for i in range(3))


# an autograd.Function, not register_autograd: see "How gradients are registered" in _autograd.py
class _PackedSelfAttention(torch.autograd.Function):
    """Self-attention on one fused in-projection qkv, (N, L, 3, H, hd) or
    (L, N, 3, H, hd). Its backward writes dq, dk, dv straight into one buffer
    shaped like qkv (masked_attn::backward_into), so the gradient of the fused
    projection needs no zero-filled buffers, no stack and no copy."""

    @staticmethod
    def forward(
        ctx,
        qkv,
        attn_mask,
        key_padding_mask,
        head_mask,
        is_causal,
        need_weights,
        batch_first,
        dropout_p,
        dropout_seed,
        grad_on,
    ):
        # grad_on: the caller's grad mode (forward runs without it, and needs_input_grad ignores it)
        q, k, v = _split_qkv(qkv, batch_first)
        out, lse, weights, out_lo = torch.ops.masked_attn.forward(
            q,
            k,
            v,
            attn_mask,
            key_padding_mask,
            head_mask,
            is_causal,
            None,
            need_weights,
            dropout_p,
            dropout_seed,
            for_backward=grad_on and any(ctx.needs_input_grad),
        )
        ctx.save_for_backward(qkv, out, lse, attn_mask, key_padding_mask, head_mask, dropout_seed, saved_out_lo(out_lo))
        ctx.is_causal, ctx.need_weights, ctx.batch_first = is_causal, need_weights, batch_first
        ctx.dropout_p = dropout_p
        ctx.set_materialize_grads(False)
        return out, weights

    @staticmethod
    def backward(ctx, grad_out, grad_weights):
        saved = ctx.saved_tensors  # once: activation checkpointing unpacks each saved tensor only once
        qkv, out, lse, attn_mask, key_padding_mask, head_mask, dropout_seed, out_lo = saved
        grad_qkv = torch.empty_like(qkv)
        q, k, v = _split_qkv(qkv, ctx.batch_first)
        g = attention_backward(
            AttnSaved(
                q=q,
                k=k,
                v=v,
                out=out,
                lse=lse,
                attn_mask=attn_mask,
                key_padding_mask=key_padding_mask,
                head_mask=head_mask,
                out_lo=out_lo,
            ),
            AttnOptions(is_causal=ctx.is_causal, dropout_p=ctx.dropout_p, dropout_seed=dropout_seed),
            dict(zip(("attn_mask", "key_padding_mask", "head_mask"), _needs(ctx, 1, 2, 3))),
            grad_out,
            grad_weights if ctx.need_weights else None,
            into=_split_qkv(grad_qkv, ctx.batch_first),
        )
        d_am, d_kpm, dhm = g["attn_mask"], g["key_padding_mask"], g["head_mask"]
        return first_order_only("MultiheadAttention", saved[:6], grad_qkv, d_am, d_kpm, dhm) + (None,) * 6


def _merge_heads(t, batch_first):
    """(N, H, L, hd) stored as (N, L, H, hd) -> (N, L, E) if batch_first else (L, N, E)."""
    N, H, L, hd = t.shape
    if batch_first:
        return t.transpose(1, 2).reshape(N, L, H * hd)
    return t.permute(2, 0, 1, 3).reshape(L, N, H * hd)


# an autograd.Function, not register_autograd: see "How gradients are registered" in _autograd.py
class _RecomputedSelfAttention(torch.autograd.Function):
    """A whole self-attention block, in-projection, attention and
    out-projection, as one autograd node, for long sequences. The forward
    keeps x, the attention output and lse, but not qkv = x W_in^T + b_in (3
    activations per token). The backward projects again into a buffer of its
    own, lets the kernel write dq, dk, dv over it (its single pass reads every
    q, k, v block before it writes that block's gradient), and frees the
    attention-output gradient before the projections' gradients are formed.
    One extra in-projection in the backward for about 3x less saved
    activation (MultiheadAttention.recompute_projection)."""

    @staticmethod
    def forward(
        ctx,
        x,
        w_in,
        b_in,
        w_out,
        b_out,
        attn_mask,
        key_padding_mask,
        head_mask,
        is_causal,
        batch_first,
        H,
        dropout_p,
        dropout_seed,
        grad_on,
    ):
        qkv = F.linear(x, w_in, b_in).unflatten(-1, (3, H, -1))
        q, k, v = _split_qkv(qkv, batch_first)
        out, lse, _, out_lo = torch.ops.masked_attn.forward(
            q,
            k,
            v,
            attn_mask,
            key_padding_mask,
            head_mask,
            is_causal,
            None,
            False,
            dropout_p,
            dropout_seed,
            for_backward=grad_on and any(ctx.needs_input_grad),
        )
        del qkv, q, k, v
        ctx.save_for_backward(
            x, w_in, b_in, w_out, out, lse, attn_mask, key_padding_mask, head_mask, dropout_seed, saved_out_lo(out_lo)
        )
        ctx.dropout_p = dropout_p
        ctx.is_causal, ctx.batch_first, ctx.H, ctx.has_b_out = is_causal, batch_first, H, b_out is not None
        return F.linear(_merge_heads(out, batch_first), w_out, b_out)

    @staticmethod
    def backward(ctx, grad_y):
        saved = ctx.saved_tensors  # once (see _PackedSelfAttention.backward)
        x, w_in, b_in, w_out, out, lse, attn_mask, key_padding_mask, head_mask, dropout_seed, out_lo = saved
        need_x, need_w_in, need_b_in, need_w_out, need_b_out = _needs(ctx, 0, 1, 2, 3, 4)
        bf, H = ctx.batch_first, ctx.H
        with torch.no_grad():
            # y = merge(out) W_out^T + b_out
            gy = grad_y.reshape(-1, grad_y.size(-1))
            dw_out = gy.t() @ _merge_heads(out, bf).reshape(gy.shape) if need_w_out else None
            db_out = gy.sum(0) if need_b_out and ctx.has_b_out else None
            grad_attn = _heads(grad_y @ w_out, H, out.size(-1), bf)  # (N, H, L, hd)
            # out = attention(split(x W_in^T + b_in)): projected again, overwritten by its gradient
            qkv = F.linear(x, w_in, b_in).unflatten(-1, (3, H, -1))
            views = _split_qkv(qkv, bf)
            g = attention_backward(
                AttnSaved(
                    q=views[0],
                    k=views[1],
                    v=views[2],
                    out=out,
                    lse=lse,
                    attn_mask=attn_mask,
                    key_padding_mask=key_padding_mask,
                    head_mask=head_mask,
                    out_lo=out_lo,
                ),
                AttnOptions(is_causal=ctx.is_causal, dropout_p=ctx.dropout_p, dropout_seed=dropout_seed),
                dict(zip(("attn_mask", "key_padding_mask", "head_mask"), _needs(ctx, 5, 6, 7))),
                grad_attn,
                None,
                into=views,
            )
            d_am, d_kpm, dhm = g["attn_mask"], g["key_padding_mask"], g["head_mask"]
            del grad_attn, views
            dqkv = qkv.flatten(-3)
            d2 = dqkv.reshape(-1, dqkv.size(-1))
            dw_in = d2.t() @ x.reshape(-1, x.size(-1)) if need_w_in else None
            db_in = d2.sum(0) if need_b_in and b_in is not None else None
            dx = dqkv @ w_in if need_x else None
        return (
            first_order_only("MultiheadAttention", saved[:9], dx, dw_in, db_in, dw_out, db_out, d_am, d_kpm, dhm)
            + (None,) * 6
        )


def _calls_self_attn(module, args):
    """A forward pre-hook that does nothing; what matters is that it is there.

    nn.TransformerEncoderLayer.forward, in inference (eval, no gradient
    recorded), computes the whole layer with torch._transformer_encoder_layer_fwd
    from self_attn's weights and never calls self_attn, unless one of its
    submodules has forward hooks. Every MultiheadAttention of ours carries
    this hook, so a layer holding one always runs its ordinary path, which
    calls our forward. Nothing is patched: a native layer elsewhere keeps its
    fast path. (TransformerEncoder's nested-tensor path still applies; it
    reaches our forward with a nested tensor: MultiheadAttention._forward_nested.)
    """
    return None


def _guard_fast_path(module):
    if _calls_self_attn not in module._forward_pre_hooks.values():
        module.register_forward_pre_hook(_calls_self_attn)


class _Call(NamedTuple):
    """MultiheadAttention.forward's inputs, checked and batched (unbatched ones get N = 1)."""

    query: Tensor
    key: Tensor
    value: Tensor
    key_padding_mask: Tensor | None
    head_mask: Tensor | None
    is_batched: bool
    bf: bool  # batch_first (and batched): the inputs are (N, L, E), else (L, N, E)
    N: int
    L: int
    S: int


class ArgumentError(ValueError, AssertionError):
    """A bad constructor argument. A ValueError, and an AssertionError too, so
    code written against nn.MultiheadAttention (which asserts) still catches it."""


class MultiheadAttention(nn.MultiheadAttention):
    """Drop-in for torch.nn.MultiheadAttention, computed by torch_masked_attn.

    Same constructor, parameters and state_dict keys (it *is* an
    nn.MultiheadAttention: load_state_dict works both ways). forward takes
    the same arguments plus a keyword-only ``head_mask`` of shape (H,) or
    (N, H) that multiplies each head's attention probabilities.

    Differences from nn.MultiheadAttention, all deliberate:
      * a query row that no key may attend to (every key masked) gives 0 and
        zero gradients; nn.MultiheadAttention gives NaN there;
      * ``is_causal=True`` is taken as the hint nn.MultiheadAttention
        documents: the attn_mask you pass must be the causal mask, and it is
        applied as a causal mask (masked key blocks are skipped) instead of
        being read; with add_bias_kv / add_zero_attn the mask is read as is;
      * dropout > 0 in training mode drops attention probabilities inside the
        kernels (Philox mask from PyTorch's default generator, never stored);
        the returned weights are after dropout and rescaling, as native.

    ``recompute_projection`` (attribute; None = automatic): whether a
    self-attention call (query is key is value) keeps its fused q, k, v
    projection for the backward (False) or recomputes it there (True), which
    cuts the activations saved per call from 4 to 1 per token and embedding
    channel. Automatic: recompute when the sequence is long enough that the
    extra projection costs under 1/16 of the attention's own work
    (7 L >= 96 E), and never when no gradient is recorded or the weights are
    returned, nor under ``torch.autocast``. Results and gradients are the same
    either way.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if embed_dim <= 0 or num_heads <= 0:
            raise ArgumentError(
                f"MultiheadAttention: embed_dim and num_heads must be > 0, got "
                f"embed_dim={embed_dim}, num_heads={num_heads}"
            )
        if embed_dim % num_heads != 0:
            raise ArgumentError(
                f"MultiheadAttention: embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})"
            )
        super().__init__(
            embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn, kdim, vdim, batch_first, device, dtype
        )
        self.recompute_projection = None
        _guard_fast_path(self)

    def _forward_nested(
        self, query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal, head_mask
    ):
        """A nested tensor (N, j, E), as nn.TransformerEncoder's inference path
        hands its layers when it was given a key padding mask: run on the
        padded batch with the padding as key_padding_mask, nested again after."""
        if (
            not (query is key and key is value)
            or attn_mask is not None
            or key_padding_mask is not None
            or not self.batch_first
        ):
            raise ValueError(
                "MultiheadAttention: a nested tensor input is supported for batch_first "
                "self-attention (query is key is value) without attn_mask or key_padding_mask"
            )
        lengths = [t.size(0) for t in query.unbind()]
        x = query.to_padded_tensor(0.0)
        n = torch.tensor(lengths, device=x.device)
        pad = torch.arange(x.size(1), device=x.device).unsqueeze(0) >= n.unsqueeze(1)
        out, weights = self.forward(
            x,
            x,
            x,
            key_padding_mask=pad,
            need_weights=need_weights,
            average_attn_weights=average_attn_weights,
            is_causal=is_causal,
            head_mask=head_mask,
        )
        out = torch.nested.as_nested_tensor([out[i, :m] for i, m in enumerate(lengths)], layout=query.layout)
        return out, weights

    def _recomputes(self, L, need_weights):
        """Does this call recompute the fused projection in the backward?
        Never under autocast: the backward would run outside the forward's
        autocast state (its products in other dtypes than the saved ones)."""
        if need_weights or not torch.is_grad_enabled() or torch.is_autocast_enabled("cpu"):
            return False
        if getattr(self, "recompute_projection", None) is not None:
            return bool(self.recompute_projection)
        # extra work 6 L E^2 vs causal attention's ~7 L^2 E per sequence: at most 1/16
        return 7 * L >= 96 * self.embed_dim

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
        *,
        head_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        if isinstance(query, torch.Tensor) and query.is_nested:
            return self._forward_nested(
                query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal, head_mask
            )
        kernels = not isinstance(query, torch.Tensor) or uses_kernels(query.device)
        # dropout on the attention probabilities in training mode, inside the kernels
        dropout_p = float(self.dropout) if self.training else 0.0
        dropout_seed = new_dropout_seed() if dropout_p > 0.0 and kernels else None
        self_attention = query is key and key is value  # before unbatched inputs get a batch dim
        c = self._checked_inputs(query, key, value, key_padding_mask, head_mask)
        attn_mask = self._checked_masks(c, attn_mask, is_causal)
        extra_keys = int(self.bias_k is not None) + int(self.add_zero_attn)
        causal = bool(is_causal and extra_keys == 0)
        if causal:
            attn_mask = None  # trust the hint: the mask is causal
        packed = self._qkv_same_embed_dim and self_attention
        fused = packed and extra_keys == 0 and kernels
        masks = (attn_mask, c.key_padding_mask, c.head_mask)
        if fused and self._recomputes(c.L, need_weights):
            # the whole block as one node; the projection recomputed in the backward (long sequences)
            attn = self._recomputed(c, masks, causal, dropout_p, dropout_seed)
            return (attn if c.is_batched else attn.squeeze(1)), None
        if fused:
            # one fused projection, and its gradient written in place by the kernel
            qkv = F.linear(c.query, self.in_proj_weight, self.in_proj_bias).unflatten(-1, (3, self.num_heads, -1))
            extra = (causal, bool(need_weights), c.bf, dropout_p, dropout_seed, torch.is_grad_enabled())
            attn, weights = _PackedSelfAttention.apply(qkv, *masks, *extra)
        else:
            attn, weights = self._attention(c, packed, masks, causal, bool(need_weights), dropout_p, dropout_seed)
        return self._output(c, attn, weights if need_weights else None, average_attn_weights)

    def _checked_inputs(self, query, key, value, key_padding_mask, head_mask) -> _Call:
        """forward's checks of query, key, value (and of the masks' ranks for unbatched inputs):
        the call, batched."""
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"MultiheadAttention: {name} must be a Tensor, got {type(t).__name__}")
        if query.dim() not in (2, 3):
            raise ValueError(
                f"MultiheadAttention: query should be unbatched 2-D or batched 3-D, "
                f"got {query.dim()}-D shape {tuple(query.shape)}"
            )
        is_batched = query.dim() == 3
        if key.dim() != query.dim() or value.dim() != query.dim():
            raise ValueError(
                f"MultiheadAttention: key and value must be {query.dim()}-D like query, "
                f"got key {tuple(key.shape)}, value {tuple(value.shape)}"
            )
        if not query.is_floating_point():
            raise TypeError(f"MultiheadAttention: query must be floating point, got {query.dtype}")
        if not is_batched:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            if key_padding_mask is not None:
                if key_padding_mask.dim() != 1:
                    raise ValueError(
                        "MultiheadAttention: for unbatched inputs key_padding_mask must be "
                        f"1-D (S,), got shape {tuple(key_padding_mask.shape)}"
                    )
                key_padding_mask = key_padding_mask.unsqueeze(0)
            if head_mask is not None and head_mask.dim() == 2:
                raise ValueError("MultiheadAttention: for unbatched inputs head_mask must be (H,)")
        # the projections run on the inputs in their own layout: (N, L, E) if bf, else (L, N, E)
        bf = self.batch_first and is_batched
        (N, L), (NK, S) = (query.shape[:2], key.shape[:2]) if bf else (query.shape[1::-1], key.shape[1::-1])
        if query.size(-1) != self.embed_dim:
            raise ValueError(
                f"MultiheadAttention: query embedding dim must be embed_dim={self.embed_dim}, got {query.size(-1)}"
            )
        if key.size(-1) != self.kdim or value.size(-1) != self.vdim:
            raise ValueError(
                f"MultiheadAttention: key/value embedding dims must be kdim={self.kdim}, "
                f"vdim={self.vdim}, got {key.size(-1)}, {value.size(-1)}"
            )
        if key.shape[:2] != value.shape[:2] or NK != N:
            raise ValueError(
                f"MultiheadAttention: key and value must share (S, N) with query's batch "
                f"{N}, got key {tuple(key.shape)}, value {tuple(value.shape)}"
            )
        return _Call(query, key, value, key_padding_mask, head_mask, is_batched, bf, N, L, S)

    def _checked_masks(self, c: _Call, attn_mask, is_causal):
        """forward's checks of the masks (nn.MultiheadAttention's messages); attn_mask, a 3-D one
        (N * H, L, S) as (N, H, L, S)."""
        N, L, S, H = c.N, c.L, c.S, self.num_heads
        for name, m in (("key_padding_mask", c.key_padding_mask), ("attn_mask", attn_mask)):
            if m is not None and m.dtype != torch.bool and not m.is_floating_point():
                raise TypeError(
                    f"MultiheadAttention: only bool and floating types of {name} are supported, got {m.dtype}"
                )
        if c.key_padding_mask is not None and tuple(c.key_padding_mask.shape) != (N, S):
            raise ValueError(
                f"MultiheadAttention: key_padding_mask must have shape (N, S) = ({N}, {S}), "
                f"got {tuple(c.key_padding_mask.shape)}"
            )
        if is_causal and attn_mask is None:
            raise RuntimeError(
                "Need attn_mask if specifying the is_causal hint. You may use the "
                "Transformer module method `generate_square_subsequent_mask` to create "
                "this mask."
            )
        if attn_mask is not None:
            if attn_mask.dim() == 2 and tuple(attn_mask.shape) != (L, S):
                raise RuntimeError(f"The shape of the 2D attn_mask is {attn_mask.shape}, but should be {(L, S)}.")
            if attn_mask.dim() == 3 and tuple(attn_mask.shape) != (N * H, L, S):
                raise RuntimeError(
                    f"The shape of the 3D attn_mask is {attn_mask.shape}, but should be {(N * H, L, S)}."
                )
            if attn_mask.dim() not in (2, 3):
                raise RuntimeError(f"attn_mask's dimension {attn_mask.dim()} is not supported")
            if attn_mask.dim() == 3:
                attn_mask = attn_mask.unflatten(0, (N, H))
        return attn_mask

    def _recomputed(self, c: _Call, masks, causal: bool, dropout_p: float, dropout_seed) -> Tensor:
        """Self-attention as one node, its in-projection recomputed in the backward
        (_RecomputedSelfAttention): the output projected, (N, L, E) or (L, N, E)."""
        weights = (self.in_proj_weight, self.in_proj_bias, self.out_proj.weight, self.out_proj.bias)
        extra = (causal, c.bf, self.num_heads, dropout_p, dropout_seed, torch.is_grad_enabled())
        return _RecomputedSelfAttention.apply(c.query, *weights, *masks, *extra)

    def _projections(self, c: _Call, packed: bool) -> tuple[Tensor, Tensor, Tensor]:
        """q (N, H, L, hd), k, v (N, H, S (+ the extra keys), hd): the in-projections, then
        add_bias_kv's and add_zero_attn's keys and values."""
        N, H, hd, bf = c.N, self.num_heads, self.head_dim, c.bf
        if packed:
            qkv = F.linear(c.query, self.in_proj_weight, self.in_proj_bias)
            q, k, v = (_heads(t, H, hd, bf) for t in qkv.chunk(3, dim=-1))
        else:
            if self._qkv_same_embed_dim:
                w_q, w_k, w_v = self.in_proj_weight.chunk(3)
            else:
                w_q, w_k, w_v = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
            b_q = b_k = b_v = None
            if self.in_proj_bias is not None:
                b_q, b_k, b_v = self.in_proj_bias.chunk(3)
            q = _heads(F.linear(c.query, w_q, b_q), H, hd, bf)  # (N, H, L, hd)
            k = _heads(F.linear(c.key, w_k, b_k), H, hd, bf)  # (N, H, S, hd)
            v = _heads(F.linear(c.value, w_v, b_v), H, hd, bf)
        if self.bias_k is not None:  # one more key and value: (1, 1, E) -> (N, H, 1, hd)
            assert self.bias_v is not None  # add_bias_kv makes both
            k = torch.cat([k, self.bias_k.view(1, H, 1, hd).expand(N, H, 1, hd)], dim=2)
            v = torch.cat([v, self.bias_v.view(1, H, 1, hd).expand(N, H, 1, hd)], dim=2)
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(N, H, 1, hd)], dim=2)
            v = torch.cat([v, v.new_zeros(N, H, 1, hd)], dim=2)
        return q, k, v

    def _attention(self, c: _Call, packed: bool, masks, causal, need_weights: bool, dropout_p, dropout_seed):
        """The in-projections (_projections) and the attention, by the kernels or (another
        device) PyTorch's native attention with our semantics (functional.native_attention):
        (out (N, H, L, hd), weights or None)."""
        q, k, v = self._projections(c, packed)
        attn_mask, key_padding_mask, head_mask = masks
        for _ in range(int(self.bias_k is not None) + int(self.add_zero_attn)):
            attn_mask = _pad_key(attn_mask)
            key_padding_mask = _pad_key(key_padding_mask)
        if not uses_kernels(q.device):
            args = (attn_mask, key_padding_mask, head_mask, causal, None, need_weights, False, dropout_p)
            out = native_attention(q, k, v, *args)
            return out[0], out[2]
        out = torch.ops.masked_attn.forward(
            q,
            k,
            v,
            attn_mask,
            key_padding_mask,
            head_mask,
            causal,
            None,
            need_weights,
            dropout_p,
            dropout_seed,
            for_backward=grad_wanted(q, k, v, attn_mask, key_padding_mask, head_mask),
        )
        return out[0], out[2]

    def _output(self, c: _Call, attn: Tensor, weights: Tensor | None, average_attn_weights: bool):
        """The out-projection of attn (N, H, L, hd) (stored as (N, L, H, hd)), unbatched again
        where the input was, and the weights (None unless asked for), averaged over the heads if
        average_attn_weights."""
        N, L, E = c.N, c.L, self.embed_dim
        if c.bf:
            attn = F.linear(attn.transpose(1, 2).reshape(N, L, E), self.out_proj.weight, self.out_proj.bias)
        else:
            attn = F.linear(attn.permute(2, 0, 1, 3).reshape(L, N, E), self.out_proj.weight, self.out_proj.bias)
        if not c.is_batched:
            attn = attn.squeeze(1)
        if weights is None:
            return attn, None
        if average_attn_weights:
            weights = weights.mean(dim=1)
        if not c.is_batched:
            weights = weights.squeeze(0)
        return attn, weights


def replace_attention(module: nn.Module) -> nn.Module:
    """Make every nn.MultiheadAttention inside ``module`` (``module`` itself
    included) a :class:`MultiheadAttention` of ours, in place, and return
    ``module``.

    Each instance is converted where it stands (its class is switched): the
    same object, so its parameters (the same Parameter objects: an optimizer
    built before keeps working), buffers, hooks and their handles, device,
    dtype, training mode and every reference to it are kept. Only instances of
    exactly nn.MultiheadAttention are converted; subclasses (your own, or
    torch.ao's quantizable one) are left alone, and ours are kept as they are.

    Inside nn.TransformerEncoderLayer, TransformerDecoderLayer, Transformer
    and TransformerEncoder, training and inference then run through our
    kernels: the layer's native inference fast path is kept off (see
    _calls_self_attn) and the encoder's nested-tensor path calls our module.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"replace_attention: expected an nn.Module, got {type(module).__name__}")
    for m in module.modules():
        if type(m) is nn.MultiheadAttention:
            if m.embed_dim % m.num_heads != 0:  # what our constructor refuses (native asserts it too)
                raise ArgumentError(
                    f"replace_attention: embed_dim ({m.embed_dim}) must be divisible by num_heads ({m.num_heads})"
                )
            m.__class__ = MultiheadAttention
            m.recompute_projection = None  # pyright: ignore[reportArgumentType]  (any value; torch's stub says Tensor | Module)
        if isinstance(m, MultiheadAttention):
            _guard_fast_path(m)
    return module
