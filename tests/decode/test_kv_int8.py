"""The 8-bit KV cache: quantize_kv against its definition; attention over int8
k, v against attention over the dequantized cache in float64 (every layout the
kernels read in place, every mask kind, every variant the CPU has, against the
scalar kernels too); the cache op's quantizing write; batch invariance; bad
input.

The quantization's own error is the reference's input, not ours: the reference
attends to k_scale[j] * k[j] exactly (in float64), and where the decode kernel takes
the scores in integers (at most 16 query rows: q rounded to int16, reference.q_int16)
with those q values, and our error against it must stay within flash-attention's rule
(twice PyTorch's own error in q's dtype, plus a slack) and within twice our float32
path's error over the same dequantized cache, plus, element by element, the most that its
integer P V can add (P rounded to int16 steps: reference.p_int16_bound). Against the float
cache the int8 cache was made from, the integer products keep the int8 path's error
(test_integer_scores_keep_the_caches_error)."""

import math

import pytest
import torch

import torch_masked_attn.functional as tf
from conftest import ISAS, assert_close_ref, isa_available, require, run_isa
from reference import attention64, p_int16_bound, q_int16

LOW = (torch.float32, torch.bfloat16, torch.float16)


def _need(isa):
    if not isa_available(isa):
        pytest.skip(f"this CPU has no {isa}")


def quant_ref(x):
    """quantize_kv's definition in plain PyTorch, float32 arithmetic."""
    xf = x.float()
    am = xf.abs().amax(-1)
    ok = torch.isfinite(xf).all(-1) & (am > 0)
    c127 = torch.full_like(am, 127.0)  # not 127 / am: torch computes that as am.reciprocal() * 127
    scale = torch.where(torch.isfinite(xf).all(-1), am / c127, torch.full_like(am, math.nan))
    inv = c127 / am
    q = (xf * inv[..., None]).clamp(-127, 127).round()
    q = torch.where(ok[..., None], q, torch.zeros_like(q))
    return q.to(torch.int8), scale


def deq(xq, s, dtype=torch.float64):
    return (xq.double() * s.double()[..., None]).to(dtype)


# ---- quantize_kv ---------------------------------------------------------------


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("D", [1, 7, 16, 33, 64, 128, 200])
def test_quantize_kv_is_its_definition(isa, dtype, D):
    """Bit for bit the definition (rounding ties to even, clamping, zero and non-finite rows),
    from a strided view; the dequantized values within half a step of the input."""
    _need(isa)
    x = (torch.randn(3, 4, 6, D) * torch.exp(2 * torch.randn(3, 4, 6, 1))).to(dtype).transpose(1, 2)
    x[0, 0, 0] = 0
    x[0, 1, 1, 0] = math.inf
    x[1, 2, 3, -1] = math.nan
    x[2, 0, 1] = torch.arange(D) - D / 2 + 0.5  # many values on a half step
    q, s = run_isa(isa, lambda: tf.quantize_kv(x))
    qr, sr = quant_ref(x)
    assert q.dtype == torch.int8 and q.shape == x.shape and s.shape == x.shape[:-1] and s.dtype == torch.float32
    assert torch.equal(q, qr)
    torch.testing.assert_close(s, sr, rtol=0, atol=0, equal_nan=True)
    assert s[0, 0, 0] == 0 and s[0, 1, 1].isnan() and s[1, 2, 3].isnan() and (q[0, 1, 1] == 0).all()
    fin = torch.isfinite(s)
    err = (deq(q, s) - x.double()).abs()[fin]
    step = s.double()[..., None].expand_as(x)[fin]
    assert bool((err <= step * (0.5 + 2e-5)).all())  # 127 ulps of inv and scale, rounded apart


# ---- attention ---------------------------------------------------------------------


# name: masked_attention's keywords (the reference's too) given B, H, Lq, Lk
def _masks(name, B, H, Lq, Lk):
    if name == "none":
        return {}
    if name == "causal":
        return {"is_causal": True}
    if name == "bool":
        m = torch.rand(B, 1, Lq, Lk) < 0.3
        m[..., 0] = False
        return {"attn_mask": m}
    if name == "float+kpm":
        m, kpm = torch.randn(1, H, Lq, Lk), torch.zeros(B, Lk, dtype=torch.bool)
        kpm[:, Lk - Lk // 4 :] = True
        return {"attn_mask": m, "key_padding_mask": kpm}
    if name == "head":
        return {"head_mask": torch.rand(H)}
    if name == "window":
        return {"window": (13, 2)}
    if name == "softcap+sinks":
        return {"softcap": 1.5, "sinks": torch.randn(H), "is_causal": True}
    if name == "alibi":
        return {"alibi_slopes": torch.rand(H), "is_causal": True}
    raise AssertionError(name)


MASKS = ["none", "causal", "bool", "float+kpm", "head", "window", "softcap+sinks", "alibi"]


def _cache(B, Hkv, Lk, D, layout):
    """Random k, v quantized, in `layout`: "bhld" (B, Hkv, Lk, D) or "blhd" (B, Lk, Hkv, D)
    seen as (B, Hkv, Lk, D), the scales laid out like their rows."""
    shape = (B, Hkv, Lk, D) if layout == "bhld" else (B, Lk, Hkv, D)
    k = torch.randn(shape) * torch.exp(torch.randn(*shape[:-1], 1))
    v = torch.randn(shape)
    (kq, ks), (vq, vs) = tf.quantize_kv(k), tf.quantize_kv(v)
    if layout == "blhd":
        kq, vq, ks, vs = kq.transpose(1, 2), vq.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2)
    return kq, ks, vq, vs


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("masks", MASKS)
@pytest.mark.parametrize("Lq", [1, 5, 70])
@pytest.mark.parametrize("layout", ["bhld", "blhd"])
def test_attention_over_int8_cache(isa, masks, Lq, layout):
    """float32 q over an int8 cache: within the flash rule of float64 attention over the
    dequantized cache, and within twice our own float32 path's error over that cache; and the
    variant against the scalar kernels. Lq 1 and 5 take the rows path, 70 the tiles."""
    _need(isa)
    B, H, Hkv, Lk, D = 2, 4, 2, 150, 64
    kq, ks, vq, vs = _cache(B, Hkv, Lk, D, layout)
    q = torch.randn(B, H, Lq, D)
    kw = _masks(masks, B, H, Lq, Lk)
    ours = run_isa(isa, lambda: tf.masked_attention(q, kq, vq, k_scale=ks, v_scale=vs, **kw))
    k64, v64 = deq(kq, ks), deq(vq, vs)
    qr = q_int16(q) if Lq <= 16 else q  # the decode's rows: integer scores
    ref, w64 = attention64(qr, k64, v64, return_weights=True, **kw)
    pv = p_int16_bound(w64, vq, vs) if Lq <= 16 else None  # and integer P V
    torch32 = attention64(qr, k64.float(), v64.float(), dtype=torch.float32, **kw)
    ours32 = run_isa(isa, lambda: tf.masked_attention(qr.float(), k64.float(), v64.float(), **kw))
    assert_close_ref(ours, [torch32, ours32], ref, name=f"{isa} {masks}", extra=pv)
    scalar = run_isa("scalar", lambda: tf.masked_attention(q, kq, vq, k_scale=ks, v_scale=vs, **kw))
    # (a probability's exp a few ulps off the scalar's can move its p16 a step: twice the bound)
    tol = 2e-5 * (1 + scalar.double().abs()) + (0 if pv is None else 2 * pv)
    assert bool(((ours.double() - scalar.double()).abs() <= tol).all()), f"{isa} {masks}: against the scalar kernels"


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("Lq", [1, 8, 100])
def test_low_precision_queries(isa, dtype, Lq):
    """bfloat16 / float16 q and output over an int8 cache (GQA, causal, weights too)."""
    _need(isa)
    B, H, Hkv, Lk, D = 2, 6, 3, 130, 32
    kq, ks, vq, vs = _cache(B, Hkv, Lk, D, "bhld")
    q = torch.randn(B, H, Lq, D).to(dtype)
    out, w = run_isa(
        isa,
        lambda: tf.masked_attention(q, kq, vq, k_scale=ks, v_scale=vs, is_causal=True, need_weights=True),
    )
    assert out.dtype == dtype and w.dtype == dtype
    k64, v64 = deq(kq, ks), deq(vq, vs)
    ref = attention64(q, k64, v64, is_causal=True)
    theirs = attention64(q, k64.to(dtype), v64.to(dtype), dtype=dtype, is_causal=True)
    assert_close_ref(out, theirs, ref, name=f"{isa} {dtype}")
    # weights: the probabilities over the dequantized keys
    w_ref = attention64(q, k64, v64, is_causal=True, return_weights=True)[1]
    torch.testing.assert_close(w.double(), w_ref, atol=1e-2, rtol=2e-2)


def test_dropout_draws_the_float_paths_mask():
    """Dropout over an int8 cache keeps and drops the same elements as over a float cache
    (the mask is a function of the seed and the position only)."""
    B, H, Lq, Lk, D = 1, 2, 20, 90, 16
    kq, ks, vq, vs = _cache(B, H, Lk, D, "bhld")
    q, seed = torch.randn(B, H, Lq, D), torch.tensor([7, 0])
    kw = dict(dropout_p=0.4, dropout_seed=seed, need_weights=True)
    _, w8 = tf.masked_attention(q, kq, vq, k_scale=ks, v_scale=vs, **kw)
    _, w32 = tf.masked_attention(q, deq(kq, ks, torch.float32), deq(vq, vs, torch.float32), **kw)
    assert torch.equal(w8 == 0, w32 == 0)
    torch.testing.assert_close(w8, w32, atol=1e-5, rtol=1e-4)


# ---- varlen: packed and paged caches -----------------------------------------------


def _varlen_case(page, lens_q, lens_k, H=4, Hkv=2, D=64):
    """Packed int8 (T_k, Hkv, D) rows and the same rows in pages (page > 0) through
    write_kv_cache's quantizing write; queries; the per-sequence float64 references
    (bottom-right causal) and, beside them, the bound of the decode rows' integer P V."""
    N = len(lens_q)
    k = [torch.randn(n, Hkv, D) for n in lens_k]
    v = [torch.randn(n, Hkv, D) for n in lens_k]
    q = torch.randn(sum(lens_q), H, D)
    kq, ks = tf.quantize_kv(torch.cat(k))
    vq, vs = tf.quantize_kv(torch.cat(v))
    cu_q = torch.tensor([0] + lens_q).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k).cumsum(0).to(torch.int32)
    refs, pv = [], []  # pv: the integer P V's rounding (p_int16_bound) where the decode kernel runs
    for b in range(N):
        qb = q[cu_q[b] : cu_q[b + 1]].transpose(0, 1)[None]
        kv = slice(int(cu_k[b]), int(cu_k[b + 1]))
        kb, vb = (deq(x[kv], xs[kv]).transpose(0, 1)[None] for x, xs in ((kq, ks), (vq, vs)))
        ref, w = attention64(qb, kb, vb, is_causal=True, diagonal=lens_k[b] - lens_q[b], return_weights=True)
        refs.append(ref[0].transpose(0, 1))
        bound = p_int16_bound(w, vq[kv].transpose(0, 1)[None], vs[kv].transpose(0, 1)[None])[0].transpose(0, 1)
        pv.append(bound if lens_q[b] <= 16 else torch.zeros_like(bound))
    refs = (refs, torch.cat(pv))
    paged = None
    if page:
        per = [-(-n // page) for n in lens_k]
        pages = sum(per) + 3
        table = torch.full((N, max(per)), 0, dtype=torch.int32)
        order = torch.randperm(pages)
        kc = torch.zeros(pages, page, Hkv, D, dtype=torch.int8)
        vc = torch.zeros_like(kc)
        kcs = torch.zeros(pages, page, Hkv)
        vcs = torch.zeros_like(kcs)
        used = 0
        for b, n in enumerate(lens_k):
            table[b, : per[b]] = order[used : used + per[b]].to(torch.int32)
            used += per[b]
            slots = table[b, torch.arange(n) // page].long() * page + torch.arange(n) % page
            tf.write_kv_cache(k[b], v[b], kc, vc, slots, kcs, vcs)
        paged = (kc, vc, kcs, vcs, table)
    return q, (kq, ks, vq, vs), cu_q, cu_k, refs, paged


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("page", [0, 64, 16])
def test_varlen_packed_and_paged(isa, page):
    """Packed (T_k, H_kv, D) and paged (pages, page_size, H_kv, D) int8 caches through
    varlen_attn, mixed decodes and prefill chunks, against float64 references per sequence;
    pages of 16 rows are gathered first (scales with them)."""
    _need(isa)
    lens_q, lens_k = [1, 1, 9, 70, 1], [130, 64, 77, 190, 1]
    q, (kq, ks, vq, vs), cu_q, cu_k, (refs, pv), paged = _varlen_case(page, lens_q, lens_k)
    if not page:
        out = run_isa(
            isa,
            lambda: tf.varlen_attn(
                q, kq, vq, cu_q, cu_k, 70, 190, window_size=(-1, 0), enable_gqa=True, k_scale=ks, v_scale=vs
            ),
        )
    else:
        kc, vc, kcs, vcs, table = paged
        # the quantizing write stored what quantize_kv gives for the same rows
        rows = table.long()[:, :, None] * page + torch.arange(page)
        flat = kc.view(-1, *kc.shape[2:])
        assert torch.equal(flat[rows[0].flatten()[: lens_k[0]]], kq[: lens_k[0]])
        assert torch.equal(kcs.view(-1, kcs.size(-1))[rows[3].flatten()[: lens_k[3]]], ks[cu_k[3] : cu_k[4]])
        used = torch.tensor(lens_k, dtype=torch.int32)
        out = run_isa(
            isa,
            lambda: tf.varlen_attn(
                q,
                kc,
                vc,
                cu_q,
                None,
                70,
                190,
                window_size=(-1, 0),
                enable_gqa=True,
                seqused_k=used,
                block_table=table,
                k_scale=kcs,
                v_scale=vcs,
            ),
        )
    ref = torch.cat(refs)
    assert_close_ref(out, ref.float(), ref, name=f"{isa} page {page}", slack=2e-5, extra=pv)
    if page:  # K^T pages (continuous batching's pool): the prefill chunk's bits (the tiles); the
        # decodes' scores in the tiles' order there, dot_rows' from rows (docs/design.md, "Decoding")
        kt = kc.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
        args = (cu_q, None, 70, 190)
        kw = dict(window_size=(-1, 0), enable_gqa=True, seqused_k=used, block_table=table, k_scale=kcs, v_scale=vcs)
        out_t = run_isa(isa, lambda: tf.varlen_attn(q, kt, vc, *args, **kw))
        long = slice(int(cu_q[3]), int(cu_q[4]))
        assert torch.equal(out_t[long], out[long])
        assert_close_ref(out_t, ref.float(), ref, name=f"{isa} K^T page {page}", slack=2e-5, extra=pv)


@pytest.mark.parametrize("isa", ISAS)
def test_decode_row_batch_invariant(isa):
    """A decode row alone gives the bits it gets among other sequences, from int8 pages."""
    _need(isa)
    lens_q, lens_k = [1, 5, 1, 40], [200, 77, 64, 100]
    q, _, cu_q, _, _, (kc, vc, kcs, vcs, table) = _varlen_case(64, lens_q, lens_k)
    used = torch.tensor(lens_k, dtype=torch.int32)
    kw = dict(window_size=(-1, 0), enable_gqa=True, k_scale=kcs, v_scale=vcs)
    full = run_isa(isa, lambda: tf.varlen_attn(q, kc, vc, cu_q, None, 40, 200, seqused_k=used, block_table=table, **kw))
    for b in (0, 2):
        alone = run_isa(
            isa,
            lambda: tf.varlen_attn(
                q[cu_q[b] : cu_q[b + 1]],
                kc,
                vc,
                cu_q[:2],
                None,
                1,
                200,
                seqused_k=used[b : b + 1],
                block_table=table[b : b + 1],
                **kw,
            ),
        )
        assert torch.equal(alone, full[cu_q[b] : cu_q[b + 1]])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", LOW)
def test_quantizing_write_is_quantize_kv(isa, dtype):
    """write_kv_cache into an int8 cache stores quantize_kv's bits and scales at each slot
    (from strided rows; negative slots skipped; flat caches too)."""
    _need(isa)
    T, Hkv, D = 9, 3, 40
    key = torch.randn(T, D, Hkv).to(dtype).transpose(1, 2)  # strided rows
    value = torch.randn(T, Hkv, D).to(dtype)
    kc, vc = torch.zeros(4, 16, Hkv, D, dtype=torch.int8), torch.zeros(4, 16, Hkv, D, dtype=torch.int8)
    kcs, vcs = torch.full((4, 16, Hkv), -1.0), torch.full((4, 16, Hkv), -1.0)
    slots = torch.tensor([5, 17, -1, 63, 0, 33, 34, 2, 48])
    run_isa(isa, lambda: tf.write_kv_cache(key, value, kc, vc, slots, kcs, vcs))
    keep = slots >= 0
    for cache, scales, x in ((kc, kcs, key), (vc, vcs, value)):
        xq, xs = quant_ref(x[keep])
        assert torch.equal(cache.view(-1, Hkv, D)[slots[keep]], xq)
        assert torch.equal(scales.view(-1, Hkv)[slots[keep]], xs)
        untouched = torch.ones(64, dtype=torch.bool)
        untouched[slots[keep]] = False
        assert bool((scales.view(-1, Hkv)[untouched] == -1).all())
    flat_k, flat_s = torch.zeros(10, Hkv, D, dtype=torch.int8), torch.zeros(10, Hkv)
    tf.write_kv_cache(key[:2], value[:2], flat_k, flat_k.clone(), torch.tensor([3, 9]), flat_s, flat_s.clone())
    assert torch.equal(flat_k[[3, 9]], quant_ref(key[:2])[0])
    # K^T pages (per head a (D, page) block, keys side by side: the continuous-batching pool's
    # layout): the same bits, each element a page row apart; they read back as the row pages do
    kt = torch.zeros(4, Hkv, D, 16, dtype=torch.int8).permute(0, 3, 1, 2)
    kts = torch.zeros(4, 16, Hkv)
    run_isa(isa, lambda: tf.write_kv_cache(key, value, kt, vc.clone(), slots, kts, vcs.clone()))
    assert torch.equal(kt.reshape(-1, Hkv, D)[slots[keep]], kc.view(-1, Hkv, D)[slots[keep]])
    assert torch.equal(kts, torch.where(kcs < 0, 0.0, kcs))
    q, cu = torch.randn(2, 2 * Hkv, D).to(dtype), torch.tensor([0, 2], dtype=torch.int32)
    used, table = torch.tensor([50], dtype=torch.int32), torch.tensor([[0, 1, 2, 3]], dtype=torch.int32)

    def read(k, ks):
        return tf.varlen_attn(
            q,
            k,
            vc,
            cu,
            None,
            2,
            50,
            seqused_k=used,
            block_table=table,
            window_size=(-1, 0),
            enable_gqa=True,
            k_scale=ks,
            v_scale=vcs.clamp(min=0),
        )

    assert torch.equal(run_isa(isa, lambda: read(kt, kts)), run_isa(isa, lambda: read(kc, kcs.clamp(min=0))))
    with pytest.raises(RuntimeError, match="at most 1024 elements"):
        wide = torch.zeros(1, 1, 1025, 16, dtype=torch.int8).permute(0, 3, 1, 2)
        tf.write_kv_cache(
            torch.randn(1, 1, 1025),
            torch.randn(1, 1, 1025),
            wide,
            torch.zeros(1, 16, 1, 1025, dtype=torch.int8),
            torch.tensor([0]),
            torch.zeros(1, 16, 1),
            torch.zeros(1, 16, 1),
        )


# ---- scales: documented results, bad input ------------------------------------------


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("D", [64, 128, 256])
def test_integer_scores_keep_the_caches_error(isa, D):
    """Against float64 attention over the float cache the int8 cache was made from (keys with
    rows of very different sizes, sharp softmaxes), the decode's integer products (q rounded to
    int16 for the scores, P to int16 steps of its run's largest for P V) err as the float path
    over the same int8 values does: root-mean-square errors within 3% of each other (0.2% here,
    where the int8 values err by 0.6-1% of the output's, and the integer products by 1-2.5e-5
    against float64 over the int8 values, 300-500x less; q rounded to 8 bits would be up to 48%
    off)."""
    _need(isa)
    gen = torch.Generator().manual_seed(D)
    for G in (1, 4, 8):
        B, Hkv, Lq, Lk = 2, 2, 3, 1024
        k = torch.randn(B, Hkv, Lk, D, generator=gen) * torch.exp(torch.randn(B, Hkv, Lk, 1, generator=gen))
        v = torch.randn(B, Hkv, Lk, D, generator=gen)
        q = 2 * torch.randn(B, G * Hkv, Lq, D, generator=gen)
        (kq, ks), (vq, vs) = tf.quantize_kv(k), tf.quantize_kv(v)
        truth = attention64(q, k, v, is_causal=True)
        ours = run_isa(isa, lambda: tf.masked_attention(q, kq, vq, k_scale=ks, v_scale=vs, is_causal=True))
        flt = run_isa(
            isa, lambda: tf.masked_attention(q, deq(kq, ks, torch.float32), deq(vq, vs, torch.float32), is_causal=True)
        )
        rms = [float((x.double() - truth).pow(2).mean().sqrt()) for x in (ours, flt)]
        assert rms[0] <= 1.03 * rms[1], f"D={D} G={G}: rms error {rms[0]:.3e} against the float path's {rms[1]:.3e}"


def test_zero_and_nan_scales():
    """A zero scale makes a key score 0 and add 0 (a zero row's quantization); a NaN scale
    (a row that held inf or NaN) gives NaN in the rows that read that key, as a float cache
    holding the inf would, and nowhere else."""
    B, H, Lq, Lk, D = 1, 2, 6, 10, 8
    kq, ks, vq, vs = _cache(B, H, Lk, D, "bhld")
    ks[0, 0, 3] = 0
    vs[0, 1, 4] = 0
    ks[0, 1, 5] = math.nan
    q = torch.randn(B, H, Lq, D)
    out = tf.masked_attention(q, kq, vq, k_scale=ks, v_scale=vs, is_causal=True)
    ref, w = attention64(q_int16(q), deq(kq, ks), deq(vq, vs), is_causal=True, return_weights=True)
    assert torch.equal(out.isnan(), ref.isnan()) and bool(out[0, 1, 5:].isnan().all())
    assert not bool(out[0, 0].isnan().any()) and not bool(out[0, 1, :5].isnan().any())
    err = (out.double() - ref).nan_to_num().abs() - p_int16_bound(w, vq, vs.nan_to_num()).nan_to_num()
    assert float(err.max()) <= 1e-5 * (1 + float(ref.nan_to_num().abs().max()))


def _bad(**over):
    q, k = torch.randn(1, 2, 3, 8), torch.randint(-127, 128, (1, 2, 5, 8), dtype=torch.int8)
    a = dict(q=q, k=k, v=k.clone(), k_scale=torch.rand(1, 2, 5), v_scale=torch.rand(1, 2, 5))
    a.update(over)
    q, k, v = a.pop("q"), a.pop("k"), a.pop("v")
    return lambda: tf.masked_attention(q, k, v, **a)


@pytest.mark.parametrize(
    "over,exc,match",
    [
        (dict(k_scale=None, v_scale=None), TypeError, "need k_scale and v_scale"),
        (dict(v_scale=None), TypeError, "v_scale must be a float32 Tensor"),
        (dict(k=torch.randn(1, 2, 5, 8)), TypeError, "key and value must be int8"),
        (dict(q=torch.randn(1, 2, 3, 8, dtype=torch.float64)), TypeError, "float32, bfloat16 or float16"),
        (dict(k_scale=torch.rand(1, 2, 4)), RuntimeError, r"k_scale must be a float32 CPU tensor of k.shape\[:-1\]"),
        (dict(v_scale=torch.rand(1, 2, 5, dtype=torch.float64)), RuntimeError, "v_scale must be a float32"),
        (dict(q=torch.randn(1, 2, 3, 8, requires_grad=True)), RuntimeError, "inference only"),
    ],
)
def test_bad_input(over, exc, match):
    with pytest.raises(exc, match=match):
        _bad(**over)()


def test_bad_input_raw_ops():
    """The ops refuse what the Python functions do (their own messages), and no gradient."""
    q, k = torch.randn(1, 2, 3, 8), torch.randint(-127, 128, (1, 2, 5, 8), dtype=torch.int8)
    s = torch.rand(1, 2, 5)
    fwd = torch.ops.masked_attn.forward
    with pytest.raises(RuntimeError, match="need both k_scale and v_scale"):
        fwd(q, k, k, k_scale=s)
    with pytest.raises(RuntimeError, match="they need int8 k and v"):
        fwd(q, q, q, k_scale=s[..., :3], v_scale=s[..., :3])
    with pytest.raises(RuntimeError, match="same dtype"):
        torch.ops.masked_attn.backward(q, None, q, k, k, q, torch.zeros(1, 2, 3))
    with pytest.raises(RuntimeError, match="inference only"):
        fwd(q.requires_grad_(), k, k, k_scale=s, v_scale=s)
    with pytest.raises(RuntimeError, match="quantize_kv: x must be float32"):
        torch.ops.masked_attn.quantize_kv(torch.ones(3, 4, dtype=torch.float64))
    kc, ks = torch.zeros(2, 4, 2, 8, dtype=torch.int8), torch.zeros(2, 4, 2)
    with pytest.raises(RuntimeError, match="quantized and need its scales, key_scale"):
        tf.write_kv_cache(torch.randn(1, 2, 8), torch.randn(1, 2, 8), kc, kc.clone(), torch.tensor([0]))
    with pytest.raises(RuntimeError, match="key_scale must be a float32 CPU tensor"):
        tf.write_kv_cache(torch.randn(1, 2, 8), torch.randn(1, 2, 8), kc, kc.clone(), torch.tensor([0]), ks[:1], ks)


def test_opcheck():
    """quantize_kv and the forward ops with scales pass torch.library.opcheck."""
    x = torch.randn(2, 3, 5, 16)
    torch.library.opcheck(torch.ops.masked_attn.quantize_kv.default, (x,))
    (kq, ks), (vq, vs) = tf.quantize_kv(x), tf.quantize_kv(torch.randn(2, 3, 5, 16))
    q = torch.randn(2, 3, 4, 16)
    utils = ("test_schema", "test_faketensor")
    torch.library.opcheck(
        torch.ops.masked_attn.forward.default, (q, kq, vq), {"k_scale": ks, "v_scale": vs}, test_utils=utils
    )
    pk, pks = tf.quantize_kv(torch.randn(10, 3, 16))
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    torch.library.opcheck(
        torch.ops.masked_attn.varlen_forward.default,
        (torch.randn(10, 3, 16), pk, pk, cu, cu, 6, 6),
        {"k_scale": pks, "v_scale": pks},
        test_utils=utils,
    )
    kc, kcs = torch.zeros(2, 4, 3, 16, dtype=torch.int8), torch.zeros(2, 4, 3)
    torch.library.opcheck(
        torch.ops.masked_attn.cache_write.default,
        (torch.randn(2, 3, 16), torch.randn(2, 3, 16), kc, kc.clone(), torch.tensor([1, 6]), kcs, kcs.clone()),
        test_utils=utils,
    )


# ---- Hugging Face: Int8Cache ----------------------------------------------------------


def _hf_model():
    transformers = require("transformers")
    import torch_masked_attn.hf  # noqa: F401  (registers "masked_attn")

    cfg = transformers.LlamaConfig(
        vocab_size=500,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
    )
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="masked_attn").eval()


def test_int8_cache_generate_reads_the_quantized_cache():
    """generate with Int8Cache: the cache holds int8 rows and scales, and every step's
    scores equal those of a float cache holding the same values dequantized (the prompt's to
    float32 rounding, the decode steps' to their integer products'); so the kernels read
    exactly what quantize_kv stored. Left padding."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    from torch_masked_attn.hf import Int8Cache

    class DequantizedLayer(DynamicLayer):  # the reference: quantized, dequantized, kept in float32
        def update(self, k, v, *args, **kwargs):
            (kq, ks), (vq, vs) = tf.quantize_kv(k), tf.quantize_kv(v)
            return super().update(deq(kq, ks, k.dtype), deq(vq, vs, v.dtype))

    model = _hf_model()
    ids = torch.randint(1, 500, (3, 24))
    mask = (torch.arange(24) >= torch.tensor([[0], [6], [11]])).long()
    kw = dict(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=10,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
    )
    cache = Int8Cache()
    with torch.no_grad():
        a = model.generate(**kw, past_key_values=cache)
        ref = DynamicCache()
        ref.layer_class_to_replicate = DequantizedLayer
        b = model.generate(**kw, past_key_values=ref)
        c = model.generate(**kw)  # a float cache
    layer = cache.layers[0]
    assert layer.keys.dtype == torch.int8 and layer.keys.shape[2] == 24 + 9 == cache.get_seq_length()
    assert torch.equal(a.sequences, b.sequences)
    # the prompt's step (the tile path: float products) to float32 rounding; the decode steps to
    # their integer products' (P V's rounding: up to 1e-4 of the logits here), 1/40 of the float
    # cache's distance (4e-3)
    torch.testing.assert_close(a.scores[0], b.scores[0], atol=2e-5, rtol=1e-4)
    for sa, sb, sc in zip(a.scores, b.scores, c.scores):
        assert (sa - sb).abs().max() < 1e-3 * sb.abs().max()
        assert (sa - sc).abs().max() < 0.05 * sc.abs().max()  # and near the float cache's


def test_int8_cache_crop_and_beams():
    """crop, and beam search's reordering, keep the int8 rows and their scales together."""
    from torch_masked_attn.hf import Int8Cache

    model = _hf_model()
    ids = torch.randint(1, 500, (2, 12))
    with torch.no_grad():
        out = model.generate(input_ids=ids, max_new_tokens=6, num_beams=3, do_sample=False, past_key_values=Int8Cache())
    assert out.shape == (2, 18)
    cache = Int8Cache()
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache)
    k0 = cache.layers[1].keys.clone()
    cache.crop(-4)
    assert cache.get_seq_length() == 8 and torch.equal(cache.layers[1].keys, k0[:, :, :8])
    s = cache.layers[1].keys._masked_attn_scale
    assert s.shape == (2, 2, 8) and s.dtype == torch.float32


def test_int8_cache_buffers_advised_huge_pages():
    """The buffers Int8Cache grows (ops.empty_on_huge_pages) are marked for transparent huge
    pages (madvise MADV_HUGEPAGE: "hg" in the mapping's VmFlags) on their 2 MB-aligned part;
    a small one is left alone."""
    import os

    from torch_masked_attn.ops import empty_on_huge_pages

    if not os.path.exists("/proc/self/smaps"):
        pytest.skip("no /proc/self/smaps (not Linux)")
    t = empty_on_huge_pages(8 << 20, dtype=torch.int8)
    addr = (t.data_ptr() + (2 << 20) - 1) // (2 << 20) * (2 << 20)  # inside the advised part
    flags = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif line.startswith("VmFlags:") and inside:
                flags = line.split()[1:]
                break
    assert flags is not None and "hg" in flags, flags
    assert empty_on_huge_pages(0, dtype=torch.float32).numel() == 0
    assert empty_on_huge_pages(3, 5, dtype=torch.float32).shape == (3, 5)
