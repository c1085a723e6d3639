"""The decode kernel (masked_attn.h, "Decoding"; csrc/attention/decode_tmpl.h): short query
blocks (1 to 16 rows) with the query heads of a key head stacked, and each sequence's keys
split in fixed chunks across work items.

Every case is checked against a float64 reference and PyTorch's own result in the same dtype
(flash-attention's rule, conftest.assert_close_ref), on every instruction-set variant this
CPU runs; and bitwise: the same output for 1 and 2 threads, for forced splits of 1, 2, 4 and
16 items per sequence, and for a row alone or among other sequences."""

import math

import pytest
import torch

from conftest import ISAS, assert_close_ref, isa_available, run_isa
from reference import attention64, p_int16_bound, q_int16
from torch_masked_attn import functional as F_
from torch_masked_attn import ops

DT = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
ISA_PARAMS = [pytest.param(i, marks=pytest.mark.skipif(not isa_available(i), reason=f"no {i}")) for i in ISAS]


def _kv(B, Hkv, Lk, D, dtype, layout, gen):
    """K, V (B, Hkv, Lk, D) views of a cache in `layout`: bhld (B, Hkv, L, D), blhd (B, L, Hkv, D)."""
    if layout == "blhd":
        k, v = (torch.randn(B, Lk, Hkv, D, generator=gen).to(dtype).transpose(1, 2) for _ in range(2))
    else:
        k, v = (torch.randn(B, Hkv, Lk, D, generator=gen).to(dtype) for _ in range(2))
    return k, v


def _masks(kind, B, H, Lq, Lk, gen):
    """kwargs for masked_attention (and the float64 reference) and the additive mask (B, H, Lq, Lk) that
    gives PyTorch's sdpa the same case (None: plain ops, _native)."""
    add = torch.zeros(B, H, Lq, Lk, dtype=torch.float64)
    i = torch.arange(Lq).view(Lq, 1) + Lk - Lq
    j = torch.arange(Lk).view(1, Lk)
    if kind == "none":
        return {}, add
    if kind == "causal":  # bottom-right: query i sees keys j <= i + Lk - Lq
        return {"window": (None, Lk - Lq)}, add.masked_fill(j > i, -math.inf)
    if kind == "window":  # the band ends 200 keys before the diagonal (whole chunks past it are never read)
        return {"window": (None, Lk - Lq - 200)}, add.masked_fill(j > i - 200, -math.inf)
    if kind == "kpm":
        kpm = torch.rand(B, Lk, generator=gen) < 0.3
        kpm[:, 0] = False
        kpm[0, Lk // 2 :] = True  # trailing padding: never read
        return {"key_padding_mask": kpm}, add.masked_fill(kpm.view(B, 1, 1, Lk), -math.inf)
    if kind == "mask":  # a bool mask that differs per head, one head blocked in the first keys
        m = torch.rand(B, H, Lq, Lk, generator=gen) < 0.2
        m[:, 0, :, :700] = True
        m[..., -1] = False
        return {"attn_mask": m}, add.masked_fill(m, -math.inf)
    if kind == "softcap":
        return {"softcap": 2.0}, None
    if kind == "sinks":
        return {"sinks": torch.randn(H, generator=gen)}, None
    if kind == "alibi":
        slopes = torch.rand(H, generator=gen) * 0.01
        return {"alibi_slopes": slopes}, add - slopes.view(1, H, 1, 1).double() * (i - j).abs()
    raise AssertionError(kind)


def _reference(q, k, v, kind, kw, add):
    """float64 out of the case: masked_attention's keywords given to the reference."""
    return attention64(q, k, v, **kw)


def _native(q, k, v, kind, kw, add):
    """PyTorch in the inputs' dtype: sdpa with the additive mask (the others by plain ops)."""
    G = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    if add is not None:
        return torch.nn.functional.scaled_dot_product_attention(q, kk, vv, attn_mask=add.to(q.dtype))
    s = (q @ kk.transpose(-1, -2)).float() / math.sqrt(q.shape[-1])
    if kind == "softcap":
        s = kw["softcap"] * torch.tanh(s / kw["softcap"])
        return (torch.softmax(s, -1) @ vv.float()).to(q.dtype)
    sink = kw["sinks"].float().view(1, -1, 1, 1).expand(*s.shape[:3], 1)
    return (torch.softmax(torch.cat([s, sink], -1), -1)[..., :-1] @ vv.float()).to(q.dtype)


CASES = [  # (B, H, Hkv, Lq, Lk, D): GQA ratios 1, 4, 8 and H; 1 to 16 query rows; chunks 1 to 5
    (2, 4, 4, 1, 1500, 64),
    (2, 8, 2, 1, 2100, 64),
    (1, 16, 2, 3, 700, 32),
    (1, 8, 1, 16, 1300, 64),
    (3, 4, 1, 5, 520, 40),
]


@pytest.mark.parametrize("isa", ISA_PARAMS)
@pytest.mark.parametrize("kind", ["none", "causal", "window", "kpm", "mask", "softcap", "sinks", "alibi"])
@pytest.mark.parametrize("layout", ["bhld", "blhd"])
@pytest.mark.parametrize("dt", ["f32", "bf16"])
def test_decode_against_float64(isa, kind, layout, dt):
    gen = torch.Generator().manual_seed(hash((kind, layout, dt)) % 2**31)
    for B, H, Hkv, Lq, Lk, D in CASES:
        dtype = DT[dt]
        q = torch.randn(B, H, Lq, D, generator=gen).to(dtype)
        k, v = _kv(B, Hkv, Lk, D, dtype, layout, gen)
        kw, add = _masks(kind, B, H, Lq, Lk, gen)
        ours = run_isa(isa, lambda: F_.masked_attention(q, k, v, **kw))
        ref = _reference(q, k, v, kind, kw, add)
        assert_close_ref(
            ours, _native(q, k, v, kind, kw, add), ref, name=f"{isa} {kind} {layout} {(B, H, Hkv, Lq, Lk)}"
        )


@pytest.mark.parametrize("isa", ISA_PARAMS)
@pytest.mark.parametrize("layout", ["bhld", "blhd", "paged", "int8"])
@pytest.mark.parametrize("dt", ["f32", "bf16"])
def test_decode_tile_shapes_against_float64(isa, layout, dt):
    """The products' register tiles and their edges (blocks_simd.h: dot_rows' rows x keys tiles,
    axpy_keys' runs of value rows): query heads a key head G in {1, 2, 4, 7, 8, 16}, head dims
    {64, 80, 128, 256} (80: a tail past the tiles' vectors on AVX-512), 1 to 16 query rows, 300
    keys (tails of every key group and run), over key rows one after another (bhld), key heads
    side by side (blhd), pages of those (paged, through flash_attn_with_kvcache) and the 8-bit
    cache (int8, against float64 on its dequantized values with q as its integer scores read it)."""
    from torch_masked_attn import flash_attn as fa

    gen = torch.Generator().manual_seed(hash((layout, dt)) % 2**31)
    dtype, Hkv, Lk, page = DT[dt], 2, 300, 64
    rows = [1, 2, 3, 5, 8, 16]
    for n, (G, D) in enumerate((G, D) for G in (1, 2, 4, 7, 8, 16) for D in (64, 80, 128, 256)):
        Lq, H = rows[n % len(rows)], G * Hkv
        q = torch.randn(1, H, Lq, D, generator=gen).to(dtype)
        k, v = _kv(1, Hkv, Lk, D, dtype, "bhld" if layout in ("bhld", "int8") else "blhd", gen)
        kw = {"window": (None, Lk - Lq)}  # bottom-right causal: the rows see different keys
        pv = None
        if layout == "int8":
            (k8, ks), (v8, vs) = F_.quantize_kv(k), F_.quantize_kv(v)
            ours = run_isa(isa, lambda: F_.masked_attention(q, k8, v8, k_scale=ks, v_scale=vs, **kw))
            k, v = (x.to(torch.float64) * s.unsqueeze(-1).double() for x, s in ((k8, ks), (v8, vs)))
            q = q_int16(q)  # as the integer scores read it
            pv = p_int16_bound(attention64(q, k, v, return_weights=True, **kw)[1], v8, vs)  # and integer P V
        elif layout == "paged":  # the pages of (1, L, Hkv, D) rows, in a shuffled order
            perm = torch.randperm(Lk // page + 1, generator=gen)
            kp, vp = (torch.zeros(Lk // page + 1, page, Hkv, D, dtype=dtype) for _ in range(2))
            for i, p in enumerate(perm.tolist()):
                kp[p, : min(page, Lk - i * page)] = k[0, :, i * page : (i + 1) * page].transpose(0, 1)
                vp[p, : min(page, Lk - i * page)] = v[0, :, i * page : (i + 1) * page].transpose(0, 1)
            table, lens = perm.to(torch.int32).view(1, -1), torch.tensor([Lk], dtype=torch.int32)
            qf = q.transpose(1, 2)
            ours = run_isa(
                isa,
                lambda: fa.flash_attn_with_kvcache(qf, kp, vp, cache_seqlens=lens, block_table=table, causal=True),
            ).transpose(1, 2)
        else:
            ours = run_isa(isa, lambda: F_.masked_attention(q, k, v, **kw))
        i = torch.arange(Lq).view(Lq, 1) + Lk - Lq
        add = torch.zeros(1, H, Lq, Lk, dtype=torch.float64).masked_fill(torch.arange(Lk).view(1, Lk) > i, -math.inf)
        qn, kn, vn = (x.to(dtype) for x in (q, k, v))
        assert_close_ref(
            ours,
            _native(qn, kn, vn, "causal", kw, add),
            _reference(q, k, v, "causal", kw, add),
            name=f"{isa} {layout} {dt} G={G} D={D} rows={Lq}",
            extra=pv,
        )


@pytest.mark.parametrize("isa", ISA_PARAMS)
def test_decode_float16_and_int8(isa):
    """float16 q and cache; an int8 cache with its scales (against float64 on the dequantized cache)."""
    gen = torch.Generator().manual_seed(5)
    B, H, Hkv, Lq, Lk, D = 2, 8, 2, 2, 1800, 64
    q = torch.randn(B, H, Lq, D, generator=gen)
    k, v = _kv(B, Hkv, Lk, D, torch.float32, "bhld", gen)
    zero = torch.zeros(B, H, Lq, Lk, dtype=torch.float64)  # no mask
    h = [t.half() for t in (q, k, v)]
    ours = run_isa(isa, lambda: F_.masked_attention(*h))
    assert_close_ref(ours, _native(*h, "none", {}, zero), _reference(*h, "none", {}, zero), name="float16")
    k8, ks = F_.quantize_kv(k)
    v8, vs = F_.quantize_kv(v)
    ours = run_isa(isa, lambda: F_.masked_attention(q, k8, v8, k_scale=ks, v_scale=vs))
    kd, vd = k8.float() * ks.unsqueeze(-1), v8.float() * vs.unsqueeze(-1)
    qr = q_int16(q)  # as the integer scores read it
    pv = p_int16_bound(attention64(qr, kd.double(), vd.double(), return_weights=True)[1], v8, vs)  # integer P V
    assert_close_ref(
        ours,
        _native(qr.float(), kd, vd, "none", {}, zero),
        _reference(qr, kd, vd, "none", {}, zero),
        name="int8",
        extra=pv,
    )


def test_decode_paged_against_dense():
    """Paged rows (flash-attn's layout, read in place) give what the dense cache gives, within float32 rounding."""
    from torch_masked_attn import flash_attn as fa

    gen = torch.Generator().manual_seed(3)
    B, H, Hkv, Lk, D, page = 3, 8, 2, 1536, 64, 128
    q = torch.randn(B, 1, H, D, generator=gen)
    kp, vp = (torch.randn(B * Lk // page, page, Hkv, D, generator=gen) for _ in range(2))
    table = torch.randperm(B * Lk // page, generator=gen).to(torch.int32).view(B, Lk // page)
    lens = torch.tensor([Lk, 1000, 1], dtype=torch.int32)
    out = fa.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table)
    for b in range(B):
        kd = kp[table[b].long()].reshape(-1, Hkv, D)[: lens[b]].transpose(0, 1).unsqueeze(0)
        vd = vp[table[b].long()].reshape(-1, Hkv, D)[: lens[b]].transpose(0, 1).unsqueeze(0)
        qb = q[b : b + 1].transpose(1, 2)
        zero = torch.zeros(1, H, 1, int(lens[b]), dtype=torch.float64)
        ref = _reference(qb, kd, vd, "none", {}, zero)
        assert_close_ref(out[b : b + 1].transpose(1, 2), _native(qb, kd, vd, "none", {}, zero), ref, name=f"page {b}")


@pytest.mark.parametrize("isa", ISA_PARAMS)
@pytest.mark.parametrize("dt", ["f32", "bf16"])
def test_decode_bits_independent_of_split_threads_batch(isa, dt):
    """One set of bits for any split of the keys, thread count, and batch around a row."""
    gen = torch.Generator().manual_seed(11)
    dtype = DT[dt]
    B, H, Hkv, Lq, Lk, D = 3, 8, 1, 2, 9000, 64  # 18 chunks: splits 1, 2, 4 and 16 all allowed
    q = torch.randn(B, H, Lq, D, generator=gen).to(dtype)
    k, v = _kv(B, Hkv, Lk, D, dtype, "bhld", gen)
    kw = {"window": (None, Lk - Lq), "sinks": torch.randn(H, generator=gen)}
    threads = torch.get_num_threads()

    def run(n_split, n_threads, sl=slice(None)):
        torch.set_num_threads(n_threads)
        try:
            with ops.decode_splits(n_split):
                return run_isa(isa, lambda: F_.masked_attention(q[sl], k[sl], v[sl], return_lse=True, **kw))
        finally:
            torch.set_num_threads(threads)

    out, lse = run(1, 1)
    for n_split in (1, 2, 4, 16):
        for n_threads in (1, 2):
            o2, l2 = run(n_split, n_threads)
            assert torch.equal(out, o2) and torch.equal(lse, l2), f"split {n_split}, {n_threads} threads"
    alone, lse_alone = run(None, 2, slice(1, 2))
    assert torch.equal(alone, out[1:2]) and torch.equal(lse_alone, lse[1:2]), "row alone vs in the batch"


def test_decode_plan_uses_every_cpu():
    """The plan's items for one long sequence: work for every CPU of a 64-core machine."""
    for Hkv, H in ((8, 32), (1, 8)):
        s = ops.decode_plan(1, H, Hkv, 1, 32768, 64)
        assert s["items"] >= 64, s
        assert s["item_chunks"] * s["items"] >= s["chunks"] * Hkv, s
    assert ops.decode_plan(8, 32, 8, 1, 32768, 2)["splits"] == 1  # enough (b, hkv) items: no split


@pytest.mark.parametrize("isa", ISA_PARAMS)
@pytest.mark.parametrize("kind", ["causal", "mask", "dropout"])
@pytest.mark.parametrize("dt", ["f32", "bf16"])
def test_decode_bits_independent_of_layout(isa, kind, dt):
    """A row's bits are the same whether its cache's key heads lie apart ((B, H_kv, L, D): one key
    head an item) or side by side ((B, L, H_kv, D) and pages of those: the key heads in lockstep,
    their rows read whole), with masks that differ per head and dropout; over the 8-bit cache too
    (its integer P V rounds per call)."""
    from torch_masked_attn import flash_attn as fa

    gen = torch.Generator().manual_seed(17)
    dtype = DT[dt]
    B, H, Hkv, Lq, Lk, D, page = 2, 16, 4, 3, 1280, 64, 128
    q = torch.randn(B, H, Lq, D, generator=gen).to(dtype)
    kl, vl = (torch.randn(B, Lk, Hkv, D, generator=gen).to(dtype) for _ in range(2))  # (B, L, Hkv, D)
    kw = (
        {"dropout_p": 0.3, "dropout_seed": torch.tensor([7, 0])}
        if kind == "dropout"
        else _masks(kind, B, H, Lq, Lk, gen)[0]
    )
    apart = run_isa(
        isa, lambda: F_.masked_attention(q, kl.transpose(1, 2).contiguous(), vl.transpose(1, 2).contiguous(), **kw)
    )
    side = run_isa(isa, lambda: F_.masked_attention(q, kl.transpose(1, 2), vl.transpose(1, 2), **kw))
    assert torch.equal(apart, side), kind
    if dt == "f32" and kind != "dropout":  # the 8-bit cache: its P V rounded per key block in both
        (kq, ks), (vq, vs) = (F_.quantize_kv(x) for x in (kl, vl))  # (B, L, Hkv, D), scales (B, L, Hkv)

        def int8(k8, v8, k_s, v_s):
            return run_isa(isa, lambda: F_.masked_attention(q, k8, v8, k_scale=k_s, v_scale=v_s, **kw))

        apart8 = int8(*(x.transpose(1, 2).contiguous() for x in (kq, vq, ks, vs)))
        assert torch.equal(apart8, int8(*(x.transpose(1, 2) for x in (kq, vq, ks, vs)))), f"int8 {kind}"
    if kind == "causal":  # pages of (page, H_kv, D) rows, shuffled: flash-attn's layout, bottom-right causal
        n = B * Lk // page
        perm = torch.randperm(n, generator=gen)
        kp, vp = (torch.empty(n, page, Hkv, D, dtype=dtype) for _ in range(2))
        kp[perm], vp[perm] = kl.reshape(n, page, Hkv, D), vl.reshape(n, page, Hkv, D)
        table = perm.to(torch.int32).view(B, Lk // page)
        lens = torch.full((B,), Lk, dtype=torch.int32)
        paged = run_isa(
            isa,
            lambda: fa.flash_attn_with_kvcache(
                q.transpose(1, 2), kp, vp, cache_seqlens=lens, block_table=table, causal=True
            ),
        )
        assert torch.equal(paged.transpose(1, 2), apart), "paged"
