"""The two properties a causal language model relies on, on every path a call can take:
no look-ahead (changing the tokens after position t leaves every output up to t bitwise
unchanged) and padding invariance (more padded keys leave the real rows bitwise unchanged).

The paths (docs/design/05-attention-algorithm.md): the tiles (more than MA_DECODE_QROWS = 16
query rows), the decode kernel (at most 16 query rows, also a few rows at the end of a long
cache, whose keys are split into 512-key chunks and folded), the weights path
(need_weights=True), packed sequences (varlen_attn: long entries on the tiles, short ones on the
decode kernel, in one call) and a paged KV cache (varlen_attn with a block table). Each call is
compared with the same call on the changed inputs: a row's bits are its path's (the paths round
differently, so comparing across paths would test nothing about leaks)."""

import math

import pytest
import torch

import torch_masked_attn as tma
from torch_masked_attn.functional import varlen_attn

tmaF = tma.functional
H, HKV, D = 4, 2, 16
DTYPES = [torch.float32, torch.bfloat16]


def randn(*shape, dtype):
    return torch.randn(*shape, dtype=torch.float64).to(dtype)


def changed_after(x, first, dim):
    """x with every position >= first along dim replaced by fresh noise."""
    y = x.clone()
    idx = [slice(None)] * x.dim()
    idx[dim] = slice(first, None)
    y[tuple(idx)] = randn(*y[tuple(idx)].shape, dtype=x.dtype) * 3
    return y


# ------------------------------------------------------------------------------------------
# dense calls: (B, H, L, D), the query rows the last Lq positions of Lk (bottom-right causal)
# ------------------------------------------------------------------------------------------

# path: (Lq, Lk, need_weights, positions t of the query rows' sequence at which to cut)
DENSE = {
    "tiles": (80, 80, False, [0, 15, 16, 63, 64, 78]),
    "decode": (12, 12, False, [0, 5, 10]),
    "decode-long-cache": (8, 1100, False, [1092, 1095, 1098]),  # 3 chunks of 512 keys, split and folded
    "weights": (40, 40, True, [0, 17, 38]),
}


def dense_call(q, k, v, kpm, need_weights):
    Lq, Lk = q.shape[2], k.shape[2]
    kw = dict(key_padding_mask=kpm, is_causal=True, diagonal=Lk - Lq)
    if need_weights:
        out, w = tmaF.masked_attention(q, k, v, need_weights=True, **kw)
        return out, w
    return tmaF.masked_attention(q, k, v, **kw), None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", list(DENSE))
def test_no_look_ahead_dense(path, dtype):
    Lq, Lk, need_weights, cuts = DENSE[path]
    B = 3
    q, k, v = randn(B, H, Lq, D, dtype=dtype), randn(B, HKV, Lk, D, dtype=dtype), randn(B, HKV, Lk, D, dtype=dtype)
    kpm = torch.rand(B, Lk) < 0.2
    kpm[:, 0] = False
    out, w = dense_call(q, k, v, kpm, need_weights)
    first_q = Lk - Lq  # the sequence position of query row 0
    for t in cuts:
        r = t - first_q  # the last query row at or before t
        q2, k2, v2 = changed_after(q, r + 1, 2), changed_after(k, t + 1, 2), changed_after(v, t + 1, 2)
        out2, w2 = dense_call(q2, k2, v2, kpm, need_weights)
        assert torch.equal(out[:, :, : r + 1], out2[:, :, : r + 1]), f"{path}: rows up to {t} changed"
        assert not torch.equal(out[:, :, r + 1 :], out2[:, :, r + 1 :]), f"{path}: the change after {t} is real"
        if need_weights:
            assert torch.equal(w[:, :, : r + 1], w2[:, :, : r + 1])
            assert torch.all(w[:, :, : r + 1, t + 1 :] == 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", list(DENSE))
def test_padding_invariance_dense(path, dtype):
    """Keys appended as padding (random content, masked by key_padding_mask) leave every row of
    the shorter call bitwise unchanged; the query rows stay the same rows."""
    Lq, Lk, need_weights, _ = DENSE[path]
    B, extra = 3, 7
    lengths = torch.tensor([Lk, max(1, Lk - 5), max(1, Lk // 2)])
    q = randn(B, H, Lq, D, dtype=dtype)
    k, v = randn(B, HKV, Lk + extra, D, dtype=dtype), randn(B, HKV, Lk + extra, D, dtype=dtype)
    kpm = torch.arange(Lk + extra)[None] >= lengths[:, None]
    # not causal: the appended keys sit after every query row, so only the padding mask hides them
    kw = dict(need_weights=True) if need_weights else {}
    short = tmaF.masked_attention(q, k[:, :, :Lk], v[:, :, :Lk], key_padding_mask=kpm[:, :Lk], **kw)
    long = tmaF.masked_attention(q, k, v, key_padding_mask=kpm, **kw)
    if need_weights:
        (short, ws), (long, wl) = short, long
        assert torch.equal(ws, wl[..., :Lk]) and torch.all(wl[..., Lk:] == 0)
    assert torch.equal(short, long), path


# ------------------------------------------------------------------------------------------
# packed sequences (varlen_attn) and a paged cache
# ------------------------------------------------------------------------------------------


def cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


# per entry: (query rows, keys); the query rows are the last ones of the entry's keys. Long
# entries take the tiles, entries of at most 16 query rows the decode kernel, in one call.
ENTRIES = [(70, 70), (5, 5), (2, 300), (40, 40), (9, 600), (16, 16)]


def entry_cuts(lq, lk):
    first = lk - lq
    return sorted({first, first + lq // 2, lk - 2} & set(range(first, lk - 1)))


def varlen_packed(dtype):
    lq, lk = zip(*ENTRIES)
    cq, ck = cu(lq), cu(lk)
    q, k, v = randn(int(cq[-1]), H, D, dtype=dtype), randn(int(ck[-1]), HKV, D, dtype=dtype), None
    v = randn(int(ck[-1]), HKV, D, dtype=dtype)
    return q, k, v, cq, ck


def run_varlen(q, k, v, cq, ck):
    lq, lk = zip(*ENTRIES)
    return varlen_attn(q, k, v, cq, ck, max(lq), max(lk), window_size=(-1, 0), enable_gqa=True)


def change_entry_after(q, k, v, cq, ck, e, t):
    """Entry e's tokens after its sequence position t changed (queries and keys alike)."""
    lq, lk = ENTRIES[e]
    r = t - (lk - lq)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    q2[int(cq[e]) + r + 1 : int(cq[e + 1])] = randn(lq - r - 1, H, D, dtype=q.dtype) * 3
    for x in (k2, v2):
        x[int(ck[e]) + t + 1 : int(ck[e + 1])] = randn(lk - t - 1, HKV, D, dtype=x.dtype) * 3
    return q2, k2, v2, r


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_no_look_ahead_varlen(dtype):
    q, k, v, cq, ck = varlen_packed(dtype)
    out = run_varlen(q, k, v, cq, ck)
    for e, (lq, lk) in enumerate(ENTRIES):
        for t in entry_cuts(lq, lk):
            q2, k2, v2, r = change_entry_after(q, k, v, cq, ck, e, t)
            out2 = run_varlen(q2, k2, v2, cq, ck)
            a, b = int(cq[e]), int(cq[e + 1])
            assert torch.equal(out[a : a + r + 1], out2[a : a + r + 1]), f"entry {e} ({lq}, {lk}), t {t}"
            assert not torch.equal(out[a + r + 1 : b], out2[a + r + 1 : b]), f"entry {e}: the change is real"
            assert torch.equal(out[:a], out2[:a]) and torch.equal(out[b:], out2[b:]), f"entry {e}: others"


@pytest.mark.parametrize("dtype", [torch.float32], ids=str)
def test_no_look_ahead_varlen_gradients(dtype):
    """The backward: dq of an entry's rows up to t depends on nothing after t."""
    q, k, v, cq, ck = varlen_packed(dtype)
    dout = randn(*q.shape, dtype=dtype)

    def dq(q, k, v):
        qq = q.clone().requires_grad_()
        run_varlen(qq, k, v, cq, ck).backward(dout)
        return qq.grad

    g = dq(q, k, v)
    for e, (lq, lk) in enumerate(ENTRIES):
        t = entry_cuts(lq, lk)[-1]
        _, k2, v2, r = change_entry_after(q, k, v, cq, ck, e, t)
        a = int(cq[e])
        assert torch.equal(g[a : a + r + 1], dq(q, k2, v2)[a : a + r + 1]), f"entry {e}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_padding_invariance_varlen(dtype):
    """Each entry's keys followed by junk in a larger cache slot, read up to seqused_k: the rows
    of the call over the packed keys alone, bitwise."""
    q, k, v, cq, ck = varlen_packed(dtype)
    lq, lk = zip(*ENTRIES)
    slots = [n + 13 for n in lk]
    cs = cu(slots)
    ks, vs = randn(int(cs[-1]), HKV, D, dtype=dtype), randn(int(cs[-1]), HKV, D, dtype=dtype)
    for e, n in enumerate(lk):
        ks[int(cs[e]) : int(cs[e]) + n], vs[int(cs[e]) : int(cs[e]) + n] = (
            k[int(ck[e]) : int(ck[e + 1])],
            v[int(ck[e]) : int(ck[e + 1])],
        )
    used = torch.tensor(lk, dtype=torch.int32)
    out = run_varlen(q, k, v, cq, ck)
    out_slots = varlen_attn(
        q, ks, vs, cq, cs, max(lq), max(slots), window_size=(-1, 0), enable_gqa=True, seqused_k=used
    )
    assert torch.equal(out, out_slots)


def paged(k, v, ck, page, fill):
    """The packed keys of entries ck in a shuffled pool of pages (the tails of last pages and a
    spare page hold `fill`; the same pool order for every fill), its block table and the
    entries' lengths."""
    n_pages = [math.ceil((int(ck[b + 1]) - int(ck[b])) / page) for b in range(len(ck) - 1)]
    perm = torch.randperm(sum(n_pages) + 1, generator=torch.Generator().manual_seed(page))
    kp = torch.full((len(perm), page, HKV, D), fill, dtype=k.dtype)
    vp = torch.full((len(perm), page, HKV, D), fill, dtype=v.dtype)
    table = torch.zeros(len(n_pages), max(n_pages), dtype=torch.int32)
    at = 0
    for b, n in enumerate(n_pages):
        for i in range(n):
            lo, hi = int(ck[b]) + i * page, min(int(ck[b]) + (i + 1) * page, int(ck[b + 1]))
            kp[perm[at], : hi - lo], vp[perm[at], : hi - lo] = k[lo:hi], v[lo:hi]
            table[b, i] = perm[at]
            at += 1
    return kp, vp, table, (ck[1:] - ck[:-1]).to(torch.int32)


def run_paged(q, kp, vp, cq, table, used):
    lq, lk = zip(*ENTRIES)
    return varlen_attn(
        q, kp, vp, cq, None, max(lq), max(lk), window_size=(-1, 0), enable_gqa=True, seqused_k=used, block_table=table
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("page", [64, 32])  # read in place, gathered
def test_no_look_ahead_and_padding_paged(page, dtype):
    q, k, v, cq, ck = varlen_packed(dtype)
    kp, vp, table, used = paged(k, v, ck, page, 0.0)
    out = run_paged(q, kp, vp, cq, table, used)
    # padding: the unused slots of the pool hold other junk
    kj, vj, table_j, _ = paged(k, v, ck, page, 7.0)
    assert torch.equal(table, table_j)
    assert torch.equal(out, run_paged(q, kj, vj, cq, table, used))
    for e, (lq, lk) in enumerate(ENTRIES):
        t = entry_cuts(lq, lk)[0]
        q2, k2, v2, r = change_entry_after(q, k, v, cq, ck, e, t)
        kp2, vp2 = _refill(kp, vp, table, k2, v2, ck, page)
        out2 = run_paged(q2, kp2, vp2, cq, table, used)
        a, b = int(cq[e]), int(cq[e + 1])
        assert torch.equal(out[a : a + r + 1], out2[a : a + r + 1]), f"entry {e} ({lq}, {lk}), t {t}"
        assert not torch.equal(out[a + r + 1 : b], out2[a + r + 1 : b]), f"entry {e}: the change is real"


def _refill(kp, vp, table, k, v, ck, page):
    """The pool of `table` holding other packed keys k, v (same lengths)."""
    kp2, vp2 = kp.clone(), vp.clone()
    for b in range(len(ck) - 1):
        n = int(ck[b + 1]) - int(ck[b])
        for i in range(math.ceil(n / page)):
            lo, hi = int(ck[b]) + i * page, min(int(ck[b]) + (i + 1) * page, int(ck[b + 1]))
            pg = int(table[b, i])
            kp2[pg, : hi - lo], vp2[pg, : hi - lo] = k[lo:hi], v[lo:hi]
    return kp2, vp2
