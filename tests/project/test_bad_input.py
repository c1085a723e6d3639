"""Malformed calls raise Python exceptions naming the argument; the raw ops
raise RuntimeError and never crash the interpreter; legal edge cases behave
like native PyTorch."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import torch_masked_attn as tma
from conftest import assert_close64, assert_close_ref, blocked_to_additive, require
from reference import attention64

tmaF = tma.functional

ERRORS = (RuntimeError, ValueError, TypeError, IndexError, NotImplementedError)
B, H, LQ, LK, D = 2, 4, 5, 6, 8


def _t(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


def _qkv(h=H, hkv=None, dtype=torch.float32):
    hkv = h if hkv is None else hkv
    return _t(B, h, LQ, D, dtype=dtype), _t(B, hkv, LK, D, dtype=dtype), _t(B, hkv, LK, D, dtype=dtype)


# ---------------------------------------------------------------------------
# masked_attention
# ---------------------------------------------------------------------------


def _ma_bad_cases():
    q, k, v = _qkv()
    cases = {
        "q_rank3": (dict(q=q[0], k=k, v=v), r"\bq\b|query"),
        "q_rank5": (dict(q=q[None], k=k, v=v), r"\bq\b|query"),
        "k_rank3": (dict(q=q, k=k[0], v=v), r"\bk\b|key"),
        "v_rank2": (dict(q=q, k=k, v=v[0, 0]), r"\bv\b|value"),
        "batch_mismatch_k": (dict(q=q, k=_t(B + 1, H, LK, D), v=_t(B + 1, H, LK, D)), r"(?i)batch|\bk\b|key|\bB\b"),
        "batch_mismatch_v": (dict(q=q, k=k, v=_t(B + 1, H, LK, D)), r"(?i)batch|\bv\b|value|\bB\b"),
        "D_mismatch": (dict(q=q, k=_t(B, H, LK, D + 1), v=v), r"(?i)\bq\b|\bk\b|query|key|head dim|\bD\b"),
        "Lk_mismatch": (dict(q=q, k=k, v=_t(B, H, LK + 1, D)), r"(?i)\bk\b|\bv\b|key|value|Lk"),
        "Hkv_mismatch_kv": (dict(q=q, k=_t(B, 2, LK, D), v=_t(B, 1, LK, D)), r"(?i)\bk\b|\bv\b|head"),
        "H_not_divisible": (dict(q=q, k=_t(B, 3, LK, D), v=_t(B, 3, LK, D)), r"(?i)head|Hkv|\bH\b|divisible|multiple"),
        "int_q": (dict(q=torch.ones(B, H, LQ, D, dtype=torch.int32), k=k, v=v), r"(?i)\bq\b|query|dtype|float"),
        "int_all": (
            dict(
                q=torch.ones(B, H, LQ, D, dtype=torch.int64),
                k=torch.ones(B, H, LK, D, dtype=torch.int64),
                v=torch.ones(B, H, LK, D, dtype=torch.int64),
            ),
            r"(?i)\bq\b|query|dtype|float",
        ),
        "mixed_dtype": (dict(q=q, k=k.double(), v=v), r"(?i)dtype|\bk\b|\bq\b"),
        "mixed_dtype_v": (dict(q=q, k=k, v=v.half()), r"(?i)dtype|\bv\b|\bq\b"),
        "attn_mask_shape": (dict(q=q, k=k, v=v, attn_mask=torch.zeros(LQ, LK + 1, dtype=torch.bool)), "attn_mask"),
        "attn_mask_shape_4d": (dict(q=q, k=k, v=v, attn_mask=torch.zeros(B, 3, LQ, LK, dtype=torch.bool)), "attn_mask"),
        "attn_mask_rank5": (dict(q=q, k=k, v=v, attn_mask=torch.zeros(1, B, H, LQ, LK, dtype=torch.bool)), "attn_mask"),
        "attn_mask_int": (dict(q=q, k=k, v=v, attn_mask=torch.zeros(LQ, LK, dtype=torch.int64)), "attn_mask"),
        "attn_mask_uint8": (dict(q=q, k=k, v=v, attn_mask=torch.zeros(LQ, LK, dtype=torch.uint8)), "attn_mask"),
        "kpm_shape": (
            dict(q=q, k=k, v=v, key_padding_mask=torch.zeros(B, LK + 1, dtype=torch.bool)),
            "key_padding_mask",
        ),
        "kpm_shape_T": (dict(q=q, k=k, v=v, key_padding_mask=torch.zeros(LK, B, dtype=torch.bool)), "key_padding_mask"),
        "kpm_rank3": (
            dict(q=q, k=k, v=v, key_padding_mask=torch.zeros(B, 1, LK, dtype=torch.bool)),
            "key_padding_mask",
        ),
        "kpm_int": (dict(q=q, k=k, v=v, key_padding_mask=torch.zeros(B, LK, dtype=torch.int32)), "key_padding_mask"),
        "head_mask_shape": (dict(q=q, k=k, v=v, head_mask=torch.ones(H + 1)), "head_mask"),
        "head_mask_shape_2d": (dict(q=q, k=k, v=v, head_mask=torch.ones(H, B)), "head_mask"),
        "head_mask_rank3": (dict(q=q, k=k, v=v, head_mask=torch.ones(B, H, 1)), "head_mask"),
        # dropout
        "dropout_p_negative": (dict(q=q, k=k, v=v, dropout_p=-0.1), "dropout_p"),
        "dropout_p_above_1": (dict(q=q, k=k, v=v, dropout_p=1.5), "dropout_p"),
        "dropout_p_nan": (dict(q=q, k=k, v=v, dropout_p=float("nan")), "dropout_p"),
        "dropout_seed_shape": (
            dict(q=q, k=k, v=v, dropout_p=0.1, dropout_seed=torch.zeros(3, dtype=torch.int64)),
            "dropout_seed",
        ),
        "dropout_seed_2d": (
            dict(q=q, k=k, v=v, dropout_p=0.1, dropout_seed=torch.zeros(1, 2, dtype=torch.int64)),
            "dropout_seed",
        ),
        "dropout_seed_float": (dict(q=q, k=k, v=v, dropout_p=0.1, dropout_seed=torch.zeros(2)), "dropout_seed"),
        "dropout_seed_int32": (
            dict(q=q, k=k, v=v, dropout_p=0.1, dropout_seed=torch.zeros(2, dtype=torch.int32)),
            "dropout_seed",
        ),
        "dropout_seed_meta": (
            dict(q=q, k=k, v=v, dropout_p=0.1, dropout_seed=torch.zeros(2, dtype=torch.int64, device="meta")),
            "dropout_seed",
        ),
        "dropout_seed_list": (dict(q=q, k=k, v=v, dropout_p=0.1, dropout_seed=[1, 2]), "dropout_seed"),
        # window, softcap, sinks
        "window_left_below_minus_1": (dict(q=q, k=k, v=v, window=(-2, 0)), "window"),
        "window_right_below_minus_1": (dict(q=q, k=k, v=v, window=(0, -3)), "window"),
        "window_triple": (dict(q=q, k=k, v=v, window=(1, 2, 3)), "window"),
        "window_int": (dict(q=q, k=k, v=v, window=3), "window"),
        "window_float_side": (dict(q=q, k=k, v=v, window=(1.5, 0)), "window"),
        "softcap_zero": (dict(q=q, k=k, v=v, softcap=0.0), "softcap"),
        "softcap_negative": (dict(q=q, k=k, v=v, softcap=-1.0), "softcap"),
        "softcap_nan": (dict(q=q, k=k, v=v, softcap=float("nan")), "softcap"),
        "softcap_inf": (dict(q=q, k=k, v=v, softcap=float("inf")), "softcap"),
        "softcap_str": (dict(q=q, k=k, v=v, softcap="1"), "softcap"),
        "sinks_shape": (dict(q=q, k=k, v=v, sinks=torch.zeros(H + 1)), "sinks"),
        "sinks_2d": (dict(q=q, k=k, v=v, sinks=torch.zeros(1, H)), "sinks"),
        "sinks_0d": (dict(q=q, k=k, v=v, sinks=torch.zeros(())), "sinks"),
        "sinks_int": (dict(q=q, k=k, v=v, sinks=torch.zeros(H, dtype=torch.int64)), "sinks"),
        "sinks_bool": (dict(q=q, k=k, v=v, sinks=torch.zeros(H, dtype=torch.bool)), "sinks"),
        "sinks_meta": (dict(q=q, k=k, v=v, sinks=torch.zeros(H, device="meta")), "sinks"),
        "sinks_list": (dict(q=q, k=k, v=v, sinks=[0.0] * H), "sinks"),
    }
    return cases


MA_BAD = _ma_bad_cases()


@pytest.mark.parametrize("case", list(MA_BAD))
def test_masked_attention_bad_input(case):
    kw, pattern = _ma_bad_cases()[case]
    with pytest.raises(ERRORS, match=pattern):
        tmaF.masked_attention(**kw)


# ---------------------------------------------------------------------------
# scaled_dot_product_attention
# ---------------------------------------------------------------------------


def _sdpa_bad_cases():
    q, k, v = _qkv()
    return {
        "q_rank1": (dict(query=_t(D), key=k, value=v), r"(?i)query|\bq\b"),
        "D_mismatch": (dict(query=q, key=_t(B, H, LK, D + 2), value=v), r"(?i)query|key|dim"),
        "Lk_mismatch": (dict(query=q, key=k, value=_t(B, H, LK + 2, D)), r"(?i)key|value|length"),
        "batch_mismatch": (
            dict(query=q, key=_t(B + 1, H, LK, D), value=_t(B + 1, H, LK, D)),
            r"(?i)batch|shape|key|broadcast|size",
        ),
        "gqa_without_flag": (dict(query=q, key=_t(B, 2, LK, D), value=_t(B, 2, LK, D)), r"(?i)gqa|head"),
        "gqa_not_divisible": (
            dict(query=q, key=_t(B, 3, LK, D), value=_t(B, 3, LK, D), enable_gqa=True),
            r"(?i)head|multiple|divisible",
        ),
        "int_query": (dict(query=q.long(), key=k.long(), value=v.long()), r"(?i)query|dtype|float"),
        "mixed_dtype": (dict(query=q, key=k.double(), value=v), r"(?i)dtype"),
        "attn_mask_shape": (
            dict(query=q, key=k, value=v, attn_mask=torch.ones(LQ + 1, LK, dtype=torch.bool)),
            "attn_mask",
        ),
        "attn_mask_int": (dict(query=q, key=k, value=v, attn_mask=torch.ones(LQ, LK, dtype=torch.int32)), "attn_mask"),
    }


@pytest.mark.parametrize("case", list(_sdpa_bad_cases()))
def test_sdpa_bad_input(case):
    kw, pattern = _sdpa_bad_cases()[case]
    # PyTorch rejects the same call (its math path: the CPU flash kernel
    # silently accepts a key/value length mismatch)
    with sdpa_kernel(SDPBackend.MATH), pytest.raises(Exception):  # noqa: B017  (whatever PyTorch raises)
        F.scaled_dot_product_attention(**kw)
    with pytest.raises(ERRORS, match=pattern):
        tmaF.scaled_dot_product_attention(**kw)


# ---------------------------------------------------------------------------
# MultiheadAttention
# ---------------------------------------------------------------------------

E, NH, N, L, S = 16, 4, 3, 5, 7


@pytest.mark.parametrize("E_,H_", [(10, 3), (16, 5), (7, 2)])
def test_mha_embed_dim_not_divisible(E_, H_):
    with pytest.raises((RuntimeError, ValueError, TypeError), match=r"(?i)num_heads|embed_dim|divisible"):
        tma.MultiheadAttention(E_, H_)


def _mha_bad_cases():
    x, mem = _t(L, N, E), _t(S, N, E)
    return {
        "query_rank4": (dict(query=x[None], key=mem[None], value=mem[None]), r"(?i)query"),
        "query_rank1": (dict(query=x[0, 0], key=mem[0, 0], value=mem[0, 0]), r"(?i)query"),
        "query_embed_dim": (dict(query=_t(L, N, E + 1), key=mem, value=mem), r"(?i)query|embed_dim"),
        "key_value_len": (dict(query=x, key=mem, value=_t(S + 1, N, E)), r"(?i)key|value"),
        "key_batch": (dict(query=x, key=_t(S, N + 1, E), value=_t(S, N + 1, E)), r"(?i)key|batch"),
        "int_query": (dict(query=x.long(), key=mem.long(), value=mem.long()), r"(?i)query|dtype|float"),
        "attn_mask_2d_shape": (
            dict(query=x, key=mem, value=mem, attn_mask=torch.zeros(L, S + 1, dtype=torch.bool)),
            "attn_mask",
        ),
        "attn_mask_3d_shape": (
            dict(query=x, key=mem, value=mem, attn_mask=torch.zeros(N, L, S, dtype=torch.bool)),
            "attn_mask",
        ),
        "attn_mask_rank4": (
            dict(query=x, key=mem, value=mem, attn_mask=torch.zeros(N, NH, L, S, dtype=torch.bool)),
            "attn_mask",
        ),
        "attn_mask_int": (
            dict(query=x, key=mem, value=mem, attn_mask=torch.zeros(L, S, dtype=torch.int64)),
            "attn_mask",
        ),
        "kpm_shape": (
            dict(query=x, key=mem, value=mem, key_padding_mask=torch.zeros(N, S + 1, dtype=torch.bool)),
            "key_padding_mask",
        ),
        "kpm_transposed": (
            dict(query=x, key=mem, value=mem, key_padding_mask=torch.zeros(S, N, dtype=torch.bool)),
            "key_padding_mask",
        ),
        "kpm_int": (
            dict(query=x, key=mem, value=mem, key_padding_mask=torch.zeros(N, S, dtype=torch.int64)),
            "key_padding_mask",
        ),
        "head_mask_shape": (dict(query=x, key=mem, value=mem, head_mask=torch.ones(NH + 1)), "head_mask"),
        "head_mask_shape_2d": (dict(query=x, key=mem, value=mem, head_mask=torch.ones(N + 1, NH)), "head_mask"),
        "head_mask_rank3": (dict(query=x, key=mem, value=mem, head_mask=torch.ones(N, NH, 1)), "head_mask"),
    }


@pytest.mark.parametrize("case", list(_mha_bad_cases()))
def test_mha_bad_input(case):
    kw, pattern = _mha_bad_cases()[case]
    mod = tma.MultiheadAttention(E, NH)
    with pytest.raises(ERRORS, match=pattern):
        mod(**kw)


def test_mha_is_causal_without_mask():
    """nn.MultiheadAttention requires attn_mask with the is_causal hint."""
    mod = tma.MultiheadAttention(E, NH)
    x = _t(L, N, E)
    with pytest.raises(Exception):  # noqa: B017  (whatever PyTorch raises)
        nn.MultiheadAttention(E, NH)(x, x, x, is_causal=True)
    with pytest.raises(ERRORS, match=r"(?i)attn_mask|is_causal"):
        mod(x, x, x, is_causal=True)


# ---------------------------------------------------------------------------
# the raw ops, in a subprocess: must raise RuntimeError, never crash
# ---------------------------------------------------------------------------

_OP_SCRIPT = textwrap.dedent(r"""
    import json, sys, torch
    import torch_masked_attn  # registers torch.ops.masked_attn
    fwd = torch.ops.masked_attn.forward
    bwd = torch.ops.masked_attn.backward
    B, H, LQ, LK, D = 2, 4, 5, 6, 8
    r = torch.randn
    q, k, v = r(B, H, LQ, D), r(B, H, LK, D), r(B, H, LK, D)
    out, lse, _, _ = fwd(q, k, v, None, None, None, False, None, False)
    dout = torch.randn_like(out)
    b = torch.zeros
    seed = torch.tensor([1, 2])
    def f(**kw):
        return fwd(q, k, v, None, None, None, False, None, False, **kw)
    def g(**kw):
        return bwd(dout, None, q, k, v, out, lse, None, None, None, False, None, False, False, **kw)
    # varlen_forward / varlen_backward (packed sequences): two sequences of 5 and 7 tokens
    vf, vb = torch.ops.masked_attn.varlen_forward, torch.ops.masked_attn.varlen_backward
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    pq, pk, pv = r(12, H, D), r(12, 2, D), r(12, 2, D)
    cu = i32(0, 5, 12)
    def vfw(q=pq, k=pk, v=pv, cq=cu, ck=cu, mq=7, mk=7, wl=-1, wr=-1, **kw):
        return vf(q, k, v, cq, ck, mq, mk, None, window_left=wl, window_right=wr, **kw)
    pout, plse, _ = vfw()
    pgo = torch.randn_like(pout)
    def vbw(go=pgo, out=pout, lse=plse, cq=cu, ck=cu, mq=7, mk=7, **kw):
        return vb(go, pq, pk, pv, out, lse, cq, ck, mq, mk, None, **kw)
    cases = {
      "q_rank3": lambda: fwd(q[0], k, v, None, None, None, False, None, False),
      "k_rank5": lambda: fwd(q, k[None], v, None, None, None, False, None, False),
      "v_rank1": lambda: fwd(q, k, v[0, 0, 0], None, None, None, False, None, False),
      "batch_mismatch": lambda: fwd(q, r(B + 1, H, LK, D), r(B + 1, H, LK, D), None, None, None, False, None, False),
      "D_mismatch": lambda: fwd(q, r(B, H, LK, D + 1), v, None, None, None, False, None, False),
      "Lk_mismatch": lambda: fwd(q, k, r(B, H, LK + 1, D), None, None, None, False, None, False),
      "H_not_divisible": lambda: fwd(q, r(B, 3, LK, D), r(B, 3, LK, D), None, None, None, False, None, False),
      "Hkv_zero": lambda: fwd(q, r(B, 0, LK, D), r(B, 0, LK, D), None, None, None, False, None, False),
      "int_q": lambda: fwd(q.int(), k.int(), v.int(), None, None, None, False, None, False),
      "mixed_dtype": lambda: fwd(q, k.double(), v, None, None, None, False, None, False),
      "attn_mask_shape": lambda: fwd(q, k, v, b(B, H, LQ, LK + 1, dtype=torch.bool), None, None, False, None, False),
      "attn_mask_rank5": lambda: fwd(q, k, v, b(1, B, H, LQ, LK, dtype=torch.bool), None, None, False, None, False),
      "attn_mask_int": lambda: fwd(q, k, v, b(B, H, LQ, LK, dtype=torch.int64), None, None, False, None, False),
      "attn_mask_big": lambda: fwd(q, k, v, b(B, H, LQ + 100, LK, dtype=torch.bool), None, None, False, None, False),
      "kpm_shape": lambda: fwd(q, k, v, None, b(B, LK - 1, dtype=torch.bool), None, False, None, False),
      "kpm_rank1": lambda: fwd(q, k, v, None, b(LK, dtype=torch.bool), None, False, None, False),
      "kpm_int": lambda: fwd(q, k, v, None, b(B, LK, dtype=torch.int32), None, False, None, False),
      "head_mask_shape": lambda: fwd(q, k, v, None, None, torch.ones(H + 3), False, None, False),
      "head_mask_rank3": lambda: fwd(q, k, v, None, None, torch.ones(B, H, 2), False, None, False),
      "head_mask_int": lambda: fwd(q, k, v, None, None, torch.ones(B, H, dtype=torch.int64), False, None, False),
      "bwd_dout_shape": lambda: bwd(dout[:, :, :-1], None, q, k, v, out, lse, None, None, None, False, None, False),
      "bwd_lse_shape": lambda: bwd(dout, None, q, k, v, out, lse[:, :, :-1], None, None, None, False, None, False),
      "bwd_lse_dtype": lambda: bwd(dout, None, q, k, v, out, lse.half(), None, None, None, False, None, False),
      "bwd_out_shape": lambda: bwd(dout, None, q, k, v, out[:1], lse, None, None, None, False, None, False),
      "bwd_dweights_shape": lambda: bwd(dout, r(B, H, LQ, LK + 2), q, k, v, out, lse, None, None, None, False, None, False),
      "bwd_head_mask_grad_without_head_mask": lambda: bwd(dout, None, q, k, v, out, lse, None, None, None, False, None, True),
      "bwd_dtype": lambda: bwd(dout.double(), None, q, k, v, out, lse, None, None, None, False, None, False),
      # dropout, window, softcap, sinks (by their schema names)
      "fwd_dropout_p_negative": lambda: f(dropout_p=-0.5, dropout_seed=seed),
      "fwd_dropout_p_above_1": lambda: f(dropout_p=1.5, dropout_seed=seed),
      "fwd_dropout_p_nan": lambda: f(dropout_p=float("nan"), dropout_seed=seed),
      "fwd_dropout_seed_missing": lambda: f(dropout_p=0.1),
      "fwd_dropout_seed_shape": lambda: f(dropout_p=0.1, dropout_seed=torch.zeros(3, dtype=torch.int64)),
      "fwd_dropout_seed_float": lambda: f(dropout_p=0.1, dropout_seed=torch.zeros(2)),
      "fwd_dropout_seed_int32": lambda: f(dropout_p=0.1, dropout_seed=torch.zeros(2, dtype=torch.int32)),
      "fwd_dropout_seed_meta": lambda: f(dropout_p=0.1, dropout_seed=torch.zeros(2, dtype=torch.int64, device="meta")),
      "fwd_dropout_seed_empty": lambda: f(dropout_p=0.1, dropout_seed=torch.zeros(0, dtype=torch.int64)),
      "fwd_window_left": lambda: f(window_left=-2),
      "fwd_window_right": lambda: f(window_right=-7),
      "fwd_softcap_zero": lambda: f(softcap=0.0),
      "fwd_softcap_negative": lambda: f(softcap=-2.0),
      "fwd_softcap_nan": lambda: f(softcap=float("nan")),
      "fwd_softcap_inf": lambda: f(softcap=float("inf")),
      "fwd_sinks_shape": lambda: f(sinks=torch.zeros(H + 1)),
      "fwd_sinks_2d": lambda: f(sinks=torch.zeros(1, H)),
      "fwd_sinks_0d": lambda: f(sinks=torch.zeros(())),
      "fwd_sinks_int": lambda: f(sinks=torch.zeros(H, dtype=torch.int64)),
      "fwd_sinks_meta": lambda: f(sinks=torch.zeros(H, device="meta")),
      "bwd_dropout_p_above_1": lambda: g(dropout_p=2.0, dropout_seed=seed),
      "bwd_dropout_seed_missing": lambda: g(dropout_p=0.1),
      "bwd_dropout_seed_shape": lambda: g(dropout_p=0.1, dropout_seed=torch.zeros(5, dtype=torch.int64)),
      "bwd_window_left": lambda: g(window_left=-3),
      "bwd_softcap_nan": lambda: g(softcap=float("nan")),
      "bwd_sinks_shape": lambda: g(sinks=torch.zeros(H - 1)),
      "bwd_sinks_int": lambda: g(sinks=torch.zeros(H, dtype=torch.int32)),
      "varlen_cu_decreasing": lambda: vfw(cq=i32(0, 13, 12)),
      "varlen_cu_past_end": lambda: vfw(ck=i32(0, 5, 1000)),
      "varlen_cu_negative": lambda: vfw(cq=i32(-5, 5, 12)),
      "varlen_cu_int64": lambda: vfw(cq=cu.long()),
      "varlen_cu_2d": lambda: vfw(cq=cu[None]),
      "varlen_cu_lengths_differ": lambda: vfw(ck=i32(0, 12)),
      "varlen_max_q_short": lambda: vfw(mq=6),
      "varlen_max_k_short": lambda: vfw(mk=2),
      "varlen_window_left": lambda: vfw(wl=-2),
      "varlen_query_rank2": lambda: vfw(q=pq[:, 0]),
      "varlen_kv_heads": lambda: vfw(q=r(12, 3, D)),
      "varlen_dtype": lambda: vfw(k=pk.double()),
      "varlen_softcap_nan": lambda: vfw(softcap=float("nan")),
      "varlen_sinks_shape": lambda: vfw(sinks=torch.zeros(H + 2)),
      "varlen_seqused_k_big": lambda: vfw(seqused_k=i32(5, 90)),
      "varlen_block_table_out_of_range": lambda: vf(pq, r(4, 64, 2, D), r(4, 64, 2, D), cu, None, 7, 64, None,
                                                    -1, -1, i32(5, 7), i32(99, 0, 1, 2).view(2, 2)),
      "varlen_bwd_lse_shape": lambda: vbw(lse=plse[:, :-1]),
      "varlen_bwd_grad_out_shape": lambda: vbw(go=pgo[:-1]),
      "varlen_bwd_out_dtype": lambda: vbw(out=pout.double()),
      "varlen_bwd_cu_past_end": lambda: vbw(ck=i32(0, 5, 1000)),
    }
    names = sys.argv[1:] or list(cases)
    for name in names:
        try:
            cases[name]()
            res = {"case": name, "exc": None, "msg": ""}
        except Exception as e:
            res = {"case": name, "exc": type(e).__name__, "msg": str(e)[:300]}
        print(json.dumps(res), flush=True)
""")

_OP_CASES = [
    "q_rank3",
    "k_rank5",
    "v_rank1",
    "batch_mismatch",
    "D_mismatch",
    "Lk_mismatch",
    "H_not_divisible",
    "Hkv_zero",
    "int_q",
    "mixed_dtype",
    "attn_mask_shape",
    "attn_mask_rank5",
    "attn_mask_int",
    "attn_mask_big",
    "kpm_shape",
    "kpm_rank1",
    "kpm_int",
    "head_mask_shape",
    "head_mask_rank3",
    "head_mask_int",
    "bwd_dout_shape",
    "bwd_lse_shape",
    "bwd_lse_dtype",
    "bwd_out_shape",
    "bwd_dweights_shape",
    "bwd_head_mask_grad_without_head_mask",
    "bwd_dtype",
]
# the new arguments' cases, each with the argument its message must name
_OP_NEW_ARGS = {
    "fwd_dropout_p_negative": "dropout_p",
    "fwd_dropout_p_above_1": "dropout_p",
    "fwd_dropout_p_nan": "dropout_p",
    "fwd_dropout_seed_missing": "dropout_seed",
    "fwd_dropout_seed_shape": "dropout_seed",
    "fwd_dropout_seed_float": "dropout_seed",
    "fwd_dropout_seed_int32": "dropout_seed",
    "fwd_dropout_seed_meta": "dropout_seed",
    "fwd_dropout_seed_empty": "dropout_seed",
    "fwd_window_left": "window_left",
    "fwd_window_right": "window_right",
    "fwd_softcap_zero": "softcap",
    "fwd_softcap_negative": "softcap",
    "fwd_softcap_nan": "softcap",
    "fwd_softcap_inf": "softcap",
    "fwd_sinks_shape": "sinks",
    "fwd_sinks_2d": "sinks",
    "fwd_sinks_0d": "sinks",
    "fwd_sinks_int": "sinks",
    "fwd_sinks_meta": "sinks",
    "bwd_dropout_p_above_1": "dropout_p",
    "bwd_dropout_seed_missing": "dropout_seed",
    "bwd_dropout_seed_shape": "dropout_seed",
    "bwd_window_left": "window_left",
    "bwd_softcap_nan": "softcap",
    "bwd_sinks_shape": "sinks",
    "bwd_sinks_int": "sinks",
}
_OP_CASES += list(_OP_NEW_ARGS)
_OP_CASES += [
    "varlen_cu_decreasing",
    "varlen_cu_past_end",
    "varlen_cu_negative",
    "varlen_cu_int64",
    "varlen_cu_2d",
    "varlen_cu_lengths_differ",
    "varlen_max_q_short",
    "varlen_max_k_short",
    "varlen_window_left",
    "varlen_query_rank2",
    "varlen_kv_heads",
    "varlen_dtype",
    "varlen_softcap_nan",
    "varlen_sinks_shape",
    "varlen_seqused_k_big",
    "varlen_block_table_out_of_range",
    "varlen_bwd_lse_shape",
    "varlen_bwd_grad_out_shape",
    "varlen_bwd_out_dtype",
    "varlen_bwd_cu_past_end",
]


@pytest.fixture(scope="module")
def raw_op_results(tmp_path_factory):
    """Run every malformed raw-op call in one child interpreter; a crash
    (segfault, abort) leaves the remaining cases without a result."""
    script = tmp_path_factory.mktemp("ops") / "bad_ops.py"
    script.write_text(_OP_SCRIPT)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    proc = subprocess.run(
        [sys.executable, str(script), *_OP_CASES], capture_output=True, text=True, timeout=120, env=env
    )
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            d = json.loads(line)
            results[d["case"]] = d
    return results, proc


@pytest.mark.parametrize("case", _OP_CASES)
def test_raw_op_bad_input_raises(case, raw_op_results):
    results, proc = raw_op_results
    assert case in results, (
        f"child interpreter died before/at case {case!r} (returncode {proc.returncode}); "
        f"stderr tail:\n{proc.stderr[-2000:]}"
    )
    res = results[case]
    assert res["exc"] == "RuntimeError", f"{case}: expected RuntimeError, got {res['exc']}: {res['msg']}"
    assert res["msg"].strip(), f"{case}: empty error message"
    if case in _OP_NEW_ARGS:
        assert _OP_NEW_ARGS[case] in res["msg"], f"{case}: the message does not name {_OP_NEW_ARGS[case]}: {res['msg']}"


def test_raw_op_child_exits_cleanly(raw_op_results):
    _, proc = raw_op_results
    assert proc.returncode == 0, proc.stderr[-2000:]


# ---------------------------------------------------------------------------
# legal edge cases: like native PyTorch
# ---------------------------------------------------------------------------


def _both_sdpa(q, k, v, grad=True, **kw):
    qs = [t.detach().clone().requires_grad_(grad) for t in (q, k, v)]
    ts = [t.detach().clone().requires_grad_(grad) for t in (q, k, v)]
    a = tmaF.scaled_dot_product_attention(*qs, **kw)
    b = F.scaled_dot_product_attention(*ts, **kw)
    assert a.shape == b.shape and a.dtype == b.dtype
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, equal_nan=True)
    if grad and a.numel():
        g = torch.randn_like(a)
        a.backward(g)
        b.backward(g)
        for x, y in zip(qs, ts):
            torch.testing.assert_close(x.grad, y.grad, atol=1e-5, rtol=1e-5)
    return a, qs


@pytest.mark.parametrize(
    "shape",
    [
        dict(b=0, lq=LQ, lk=LK),
        dict(b=B, lq=0, lk=LK),
        dict(b=B, lq=LQ, lk=0),
        dict(b=0, lq=0, lk=0),
    ],
    ids=["B0", "Lq0", "Lk0", "all0"],
)
def test_empty_sizes_sdpa(shape):
    q = _t(shape["b"], H, shape["lq"], D)
    k, v = _t(shape["b"], H, shape["lk"], D), _t(shape["b"], H, shape["lk"], D)
    out, leaves = _both_sdpa(q, k, v, grad=False)
    if shape["lk"] == 0:
        assert torch.all(out == 0)  # PyTorch gives 0 for no keys
    _both_sdpa(q, k, v, is_causal=True, grad=False)


@pytest.mark.parametrize(
    "shape",
    [
        dict(b=0, lq=LQ, lk=LK),
        dict(b=B, lq=0, lk=LK),
        dict(b=B, lq=LQ, lk=0),
    ],
    ids=["B0", "Lq0", "Lk0"],
)
def test_empty_sizes_masked_attention(shape):
    b, lq, lk = shape["b"], shape["lq"], shape["lk"]
    q = _t(b, H, lq, D).requires_grad_()
    k, v = _t(b, H, lk, D).requires_grad_(), _t(b, H, lk, D + 1).requires_grad_()
    kpm = torch.zeros(b, lk, dtype=torch.bool)
    out, w, lse = tmaF.masked_attention(
        q, k, v, key_padding_mask=kpm, is_causal=True, need_weights=True, return_lse=True
    )
    assert out.shape == (b, H, lq, D + 1) and w.shape == (b, H, lq, lk) and lse.shape == (b, H, lq)
    assert torch.all(out == 0) or lk > 0
    if lk == 0:
        assert torch.isneginf(lse).all()
    (out.sum() + w.sum()).backward()
    for t in (q, k, v):
        assert t.grad is not None and t.grad.shape == t.shape and not t.grad.isnan().any()
    if lk == 0:
        assert torch.all(q.grad == 0)


def test_empty_mha():
    theirs = nn.MultiheadAttention(E, NH)
    ours = tma.MultiheadAttention(E, NH)
    ours.load_state_dict(theirs.state_dict())
    for qs, ks in (((L, 0, E), (S, 0, E)), ((0, N, E), (S, N, E)), ((L, N, E), (0, N, E))):
        q, k = _t(*qs), _t(*ks)
        a, wa = ours(q, k, k)
        b, wb = theirs(q, k, k)
        assert a.shape == b.shape and wa.shape == wb.shape
        if a.numel():
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("which", ["q", "k", "v", "all"])
def test_stride0_expanded_inputs(which):
    """Expanded (stride-0) views are legal inputs; gradients flow to the base."""
    base_q, base_k, base_v = _t(1, 1, LQ, D), _t(B, 1, LK, D), _t(1, H, LK, D)
    q = base_q.expand(B, H, LQ, D) if which in ("q", "all") else _t(B, H, LQ, D)
    k = base_k.expand(B, H, LK, D) if which in ("k", "all") else _t(B, H, LK, D)
    v = base_v.expand(B, H, LK, D) if which in ("v", "all") else _t(B, H, LK, D)
    res = []
    for fn in (tmaF.scaled_dot_product_attention, F.scaled_dot_product_attention):
        bases = [t.detach().clone().requires_grad_() for t in (base_q, base_k, base_v)]
        qq = bases[0].expand(B, H, LQ, D) if which in ("q", "all") else q
        kk = bases[1].expand(B, H, LK, D) if which in ("k", "all") else k
        vv = bases[2].expand(B, H, LK, D) if which in ("v", "all") else v
        m = torch.ones(LQ, LK, dtype=torch.bool).tril()
        out = fn(qq, kk, vv, attn_mask=m)
        out.backward(torch.ones_like(out))
        res.append((out, [b.grad for b in bases]))
    (a, ga), (b, gb) = res
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for x, y in zip(ga, gb):
        if y is None:
            assert x is None
        else:
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


def test_stride0_expanded_masks():
    q, k, v = _qkv()
    kpm = torch.tensor([False, True, False, False, True, False]).expand(B, LK)
    am = torch.randn(1, 1, 1, LK).expand(B, H, LQ, LK)
    out = tmaF.masked_attention(q, k, v, key_padding_mask=kpm, attn_mask=am)
    ref = attention64(q, k, v, attn_mask=blocked_to_additive(kpm).view(B, 1, 1, LK) + am.double())
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_nan_propagates(where, dtype):
    """NaN in an unmasked input position gives NaN where PyTorch's math path
    does (IEEE propagation; never silently replaced)."""
    q, k, v = _qkv(dtype=dtype)
    t = {"q": q, "k": k, "v": v}[where]
    t[1, 2, 3, 0] = float("nan")
    with sdpa_kernel(SDPBackend.MATH):
        expected = F.scaled_dot_product_attention(q, k, v)
    ours = tmaF.scaled_dot_product_attention(q, k, v)
    assert expected.isnan().any()
    assert torch.equal(ours.isnan(), expected.isnan()), (
        f"NaN pattern: ours {int(ours.isnan().sum())}, PyTorch math {int(expected.isnan().sum())}"
    )
    fin = ~expected.isnan()
    torch.testing.assert_close(ours[fin], expected[fin], atol=1e-5, rtol=1e-5)
    ma = tmaF.masked_attention(q, k, v)
    assert torch.equal(ma.isnan(), expected.isnan())


def test_inf_in_value_propagates():
    q, k, v = _qkv(dtype=torch.float64)
    v[0, 1, 2, 3] = float("inf")
    with sdpa_kernel(SDPBackend.MATH):
        expected = F.scaled_dot_product_attention(q, k, v)
    ours = tmaF.scaled_dot_product_attention(q, k, v)
    assert torch.equal(ours.isinf(), expected.isinf())
    assert torch.equal(ours.isnan(), expected.isnan())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mag", [1e2, 1e4])
def test_huge_logits_stay_finite(mag, dtype):
    """Scores of order mag^2 (values ~mag): finite like PyTorch, same result."""
    q, k, v = _qkv(dtype=torch.float64)
    q, k = (q * mag).to(dtype), (k * mag).to(dtype)
    v = v.to(dtype)
    qs = [t.clone().requires_grad_() for t in (q, k, v)]
    ts = [t.clone().requires_grad_() for t in (q, k, v)]
    ours = tmaF.scaled_dot_product_attention(*qs, is_causal=True)
    theirs = F.scaled_dot_product_attention(*ts, is_causal=True)
    assert torch.isfinite(theirs).all()
    assert torch.isfinite(ours).all()
    r = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = attention64(*r, is_causal=True)
    if dtype == torch.float64:
        assert_close64(ours, theirs, name="out", atol=1e-8, rtol=1e-8)
    else:
        assert_close_ref(ours, theirs, ref, name="out")
    g = torch.randn_like(ours)
    ours.backward(g)
    theirs.backward(g)
    for x, y in zip(qs, ts):
        assert torch.isfinite(x.grad).all() == torch.isfinite(y.grad).all()
    _, _, lse = tmaF.masked_attention(q, k, v, is_causal=True, need_weights=True, return_lse=True)
    assert torch.isfinite(lse).all()


# ---------------------------------------------------------------------------
# the Hugging Face backend's refusals (torch_masked_attn.hf; needs transformers)
# ---------------------------------------------------------------------------


class _Layer(nn.Module):
    is_causal = True


def _hf_bad_cases(hf):
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    q, k, v = _qkv(hkv=2)
    layer = _Layer()
    fwd = hf.attention_forward

    def structured(lq, lk):
        return hf.StructuredMask(B, lq, lk, 0, 0, causal=True, sliding_window=None, padding=None)

    return {
        "attention_mask_list": (lambda: fwd(layer, q, k, v, [[1, 0]]), TypeError, "attention_mask"),
        "attention_mask_shape": (
            lambda: fwd(layer, q, k, v, torch.ones(B, 1, LQ, LK + 1, dtype=torch.bool)),
            ERRORS,
            "attn_mask",
        ),
        "structured_mask_lengths": (
            lambda: fwd(layer, q, k, v, structured(LQ + 1, LK)),
            ValueError,
            "attention mask was made for",
        ),
        "paged_cache": (
            lambda: fwd(layer, q, k, v, None, cache=PagedAttentionCache.__new__(PagedAttentionCache)),
            ValueError,
            "PagedAttentionCache comes from transformers' continuous batching",
        ),
        "query_rank3": (lambda: fwd(layer, q[0], k, v, None), ERRORS, r"\bq\b"),
        "softcap_zero": (lambda: fwd(layer, q, k, v, None, softcap=0.0), ValueError, "softcap"),
        "softcap_nan": (lambda: fwd(layer, q, k, v, None, softcap=float("nan")), ValueError, "softcap"),
        "s_aux_shape": (lambda: fwd(layer, q, k, v, None, s_aux=torch.zeros(H + 1)), ValueError, "sinks"),
        "s_aux_int": (lambda: fwd(layer, q, k, v, None, s_aux=torch.zeros(H, dtype=torch.int64)), TypeError, "sinks"),
        "apply_not_a_causal_lm": (lambda: hf.apply(nn.Linear(4, 4)), TypeError, "not a causal LM"),
    }


_HF_BAD = [
    "attention_mask_list",
    "attention_mask_shape",
    "structured_mask_lengths",
    "paged_cache",
    "query_rank3",
    "softcap_zero",
    "softcap_nan",
    "s_aux_shape",
    "s_aux_int",
    "apply_not_a_causal_lm",
]


@pytest.mark.parametrize("case", _HF_BAD)
def test_hf_backend_bad_input(case):
    require("transformers")
    from torch_masked_attn import hf

    call, exc, pattern = _hf_bad_cases(hf)[case]
    with pytest.raises(exc, match=pattern):
        call()
