"""torch_masked_attn.functional.varlen_attn (masked_attn::varlen_forward /
varlen_backward): packed variable-length sequences, against a per-sequence
reference built from plain torch ops (float64, and the same ops in the test
dtype for PyTorch's own error), values, lse and every gradient."""

import math

import pytest
import torch
from torch.autograd import gradcheck

from conftest import SIMD_ISAS, TILE_ISAS, assert_close_ref, isa_available, run_isa
from reference import attention64
from torch_masked_attn.functional import AuxRequest, masked_attention, varlen_attn
from torch_masked_attn.ops import bwd_cpus, bwd_key_group

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def cu(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()), dtype=torch.int32)


def ref_varlen(q, k, v, cq, ck, window=(-1, -1), scale=None, dtype=torch.float64, softcap=None, sinks=None):
    """Per sequence, the reference (tests/reference.py) in `dtype`, the window about each
    sequence's bottom-right diagonal (flash-attn's): out (T_q, H, Dv), lse (H, T_q) in float64.
    Rows that see no key give 0 and lse -inf (the sink's logit with sinks)."""
    outs, lses = [], []
    for b in range(len(cq) - 1):
        qs, ks, vs = (t[c[b] : c[b + 1]].transpose(0, 1) for t, c in ((q, cq), (k, ck), (v, ck)))
        out, lse = attention64(
            qs,
            ks,
            vs,
            scale=scale,
            window=window,
            diagonal=ks.shape[1] - qs.shape[1],
            softcap=softcap,
            sinks=sinks,
            dtype=dtype,
            return_lse=True,
        )
        outs.append(out.transpose(0, 1))
        lses.append(lse.double())
    return torch.cat(outs), torch.cat(lses, -1)


def make(lq, lk, H, Hkv, D, Dv, dtype, requires_grad=True):
    cq, ck = cu(lq), cu(lk)
    q = torch.randn(int(cq[-1]), H, D, dtype=dtype)
    k = torch.randn(int(ck[-1]), Hkv, D, dtype=dtype)
    v = torch.randn(int(ck[-1]), Hkv, Dv, dtype=dtype)
    for t in (q, k, v):
        t.requires_grad_(requires_grad)
    return q, k, v, cq, ck


# (query lengths, key lengths or None = the same, H, Hkv, D, Dv, window)
CASES = [
    ([1, 63, 64, 65, 0, 130], None, 2, 2, 16, 16, (-1, -1)),
    ([1, 63, 64, 65, 0, 130], None, 4, 2, 32, 16, (-1, 0)),  # causal, GQA
    ([3, 70, 1, 0], [10, 40, 0, 5], 2, 1, 16, 24, (-1, 0)),  # Lq != Lk both ways, empty keys
    ([100, 7, 129], [30, 90, 129], 2, 2, 16, 16, (17, 0)),  # causal sliding window
    ([100, 7, 129], [30, 90, 129], 3, 1, 8, 8, (5, 3)),  # two-sided window, GQA
    ([200], [200], 2, 2, 32, 32, (64, 0)),  # window = a block
    ([65, 66], None, 2, 2, 16, 16, (0, 0)),  # the diagonal only
    ([9, 0, 0, 140], [0, 3, 0, 140], 2, 2, 16, 16, (-1, -1)),  # empty queries, empty keys
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_values_and_grads(case, dtype):
    lq, lk, H, Hkv, D, Dv, window = case
    lk = lk or lq
    q, k, v, cq, ck = make(lq, lk, H, Hkv, D, Dv, dtype)
    out, lse = varlen_attn(
        q, k, v, cq, ck, max(lq), max(lk), return_aux=AuxRequest(lse=True), window_size=window, enable_gqa=True
    )
    assert out.shape == (q.shape[0], H, Dv) and out.dtype == dtype
    assert lse.shape == (H, q.shape[0]) and lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = ref_varlen(qd, kd, vd, cq.tolist(), ck.tolist(), window)
    qt, kt, vt = (t.detach().clone().requires_grad_() for t in (q, k, v))
    pt_out, _ = ref_varlen(qt, kt, vt, cq.tolist(), ck.tolist(), window, dtype=dtype)
    assert_close_ref(out, pt_out, ref_out, name="out")
    # lse: -inf exactly where the reference has it, close elsewhere
    assert torch.equal(lse.isneginf(), ref_lse.isneginf())
    fin = ~ref_lse.isneginf()
    tol = 1e-9 if dtype == torch.float64 else 2e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-5
    assert (lse.double()[fin] - ref_lse[fin]).abs().max().item() <= tol * 10 if fin.any() else True

    go = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), go)
    ref_grads = torch.autograd.grad(ref_out, (qd, kd, vd), go.double())
    pt_grads = torch.autograd.grad(pt_out, (qt, kt, vt), go, allow_unused=True)
    for name, g, p, r in zip(("dq", "dk", "dv"), grads, pt_grads, ref_grads):
        assert g.shape == r.shape and g.dtype == dtype
        assert_close_ref(g, p if p is not None else torch.zeros_like(g), r, name=name)


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (2, 0), (1, 2)], ids=str)
def test_gradcheck(window):
    q, k, v, cq, ck = make([3, 0, 5, 1], [4, 2, 5, 0], 4, 2, 3, 2, torch.float64)
    assert gradcheck(lambda q, k, v: varlen_attn(q, k, v, cq, ck, 5, 5, window_size=window, enable_gqa=True), (q, k, v))


CAP_SINK_CASES = [  # (query lengths, key lengths, window, softcap, sinks)
    ([1, 63, 64, 65, 0, 130], [1, 63, 64, 65, 0, 130], (-1, 0), 3.0, True),
    ([3, 70, 1, 0], [10, 40, 0, 5], (-1, -1), None, True),  # empty keys: lse = the sink
    ([100, 7, 129], [30, 90, 129], (17, 0), 2.0, False),
    ([100, 7, 129], [30, 90, 129], (5, 3), 1.5, True),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CAP_SINK_CASES, ids=str)
def test_softcap_and_sinks(case, dtype):
    """The keyword extensions: values, lse and the gradients of q, k, v and
    sinks against the per-sequence float64 reference (PyTorch's own error in
    the test dtype as the yardstick)."""
    lq, lk, window, cap, with_sinks = case
    H, Hkv, D, Dv = 4, 2, 16, 24
    q, k, v, cq, ck = make(lq, lk, H, Hkv, D, Dv, dtype)
    sinks = (torch.randn(H, dtype=dtype) * 2).requires_grad_() if with_sinks else None
    out, lse = varlen_attn(
        q,
        k,
        v,
        cq,
        ck,
        max(lq),
        max(lk),
        return_aux=AuxRequest(lse=True),
        window_size=window,
        enable_gqa=True,
        softcap=cap,
        sinks=sinks,
    )
    leaves = (q, k, v) + ((sinks,) if with_sinks else ())
    ld = tuple(t.detach().double().requires_grad_() for t in leaves)
    lt = tuple(t.detach().clone().requires_grad_() for t in leaves)
    ref_out, ref_lse = ref_varlen(
        *ld[:3], cq.tolist(), ck.tolist(), window, softcap=cap, sinks=ld[3] if with_sinks else None
    )
    pt_out, _ = ref_varlen(
        *lt[:3], cq.tolist(), ck.tolist(), window, dtype=dtype, softcap=cap, sinks=lt[3] if with_sinks else None
    )
    assert_close_ref(out, pt_out, ref_out, name="out")
    assert torch.equal(lse.isneginf(), ref_lse.isneginf())
    fin = ~ref_lse.isneginf()
    tol = 1e-9 if dtype == torch.float64 else 2e-1 if dtype in (torch.bfloat16, torch.float16) else 1e-4
    assert (lse.double()[fin] - ref_lse[fin]).abs().max().item() <= tol
    go = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, go)
    ref_grads = torch.autograd.grad(ref_out, ld, go.double())
    pt_grads = torch.autograd.grad(pt_out, lt, go, allow_unused=True)
    for name, g, p, r in zip(("dq", "dk", "dv", "dsinks"), grads, pt_grads, ref_grads):
        assert g.shape == r.shape and g.dtype == dtype
        assert_close_ref(g, p if p is not None else torch.zeros_like(g), r, name=name)


@pytest.mark.parametrize("window", [(-1, 0), (1, 2)], ids=str)
def test_gradcheck_softcap_sinks(window):
    q, k, v, cq, ck = make([3, 0, 5, 1], [4, 2, 5, 0], 4, 2, 3, 2, torch.float64)
    sinks = torch.randn(4, dtype=torch.float64, requires_grad=True)
    assert gradcheck(
        lambda q, k, v, s: varlen_attn(
            q, k, v, cq, ck, 5, 5, window_size=window, enable_gqa=True, softcap=1.5, sinks=s
        ),
        (q, k, v, sinks),
    )


OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("window", [(-1, -1), (3, 0)], ids=str)
@pytest.mark.parametrize("cap_sinks", [False, True], ids=["plain", "softcap-sinks"])
def test_opcheck(window, cap_sinks):
    q, k, v, cq, ck = make([5, 0, 70], [6, 2, 70], 2, 1, 8, 8, torch.float32)
    extra = dict(softcap=2.5, sinks=torch.randn(2, requires_grad=True)) if cap_sinks else {}
    opts = dict(window_left=window[0], window_right=window[1], **extra)
    args = (q, k, v, cq, ck, 70, 70, None, None, None)
    torch.library.opcheck(torch.ops.masked_attn.varlen_forward.default, args, opts, test_utils=OPCHECK_UTILS)
    out, lse, _ = torch.ops.masked_attn.varlen_forward(*args, **opts)
    bargs = (
        torch.randn_like(out),
        q.detach(),
        k.detach(),
        v.detach(),
        out.detach(),
        lse,
        cq,
        ck,
        70,
        70,
        0.5,
    )
    bopts = {name: x.detach() if isinstance(x, torch.Tensor) else x for name, x in opts.items()}
    torch.library.opcheck(
        torch.ops.masked_attn.varlen_backward.default, bargs, bopts, test_utils=("test_schema", "test_faketensor")
    )


@pytest.mark.parametrize("isa", SIMD_ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_isa_against_scalar(isa, dtype):
    if not isa_available(isa):
        pytest.skip(f"this CPU has no {isa}")
    lq, lk = [1, 63, 64, 65, 0, 150], [1, 63, 70, 65, 3, 150]
    q, k, v, cq, ck = make(lq, lk, 4, 2, 40, 24, dtype)
    go = torch.randn(q.shape[0], 4, 24, dtype=dtype)

    sinks = torch.randn(4, dtype=dtype)

    def run(window, cap):
        out = varlen_attn(
            q, k, v, cq, ck, 150, 150, window_size=window, enable_gqa=True, softcap=cap, sinks=sinks if cap else None
        )
        return (out,) + torch.autograd.grad(out, (q, k, v), go)

    for window, cap in [((-1, -1), None), ((-1, 0), None), ((20, 0), None), ((-1, 0), 2.0)]:
        ours = run_isa(isa, lambda: run(window, cap))
        scalar = run_isa("scalar", lambda: run(window, cap))
        qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref_out, _ = ref_varlen(qd, kd, vd, cq.tolist(), ck.tolist(), window, softcap=cap, sinks=sinks if cap else None)
        refs = (ref_out,) + torch.autograd.grad(ref_out, (qd, kd, vd), go.double())
        for name, a, s, r in zip(("out", "dq", "dk", "dv"), ours, scalar, refs):
            # as close to float64 as the scalar reference is (plus the dtype's slack)
            assert_close_ref(a, s, r, name=f"{isa} {window} {name}")


def to_pages(k, v, ck, page, seed=0):
    """The packed (T, H_kv, D) k, v of sequences ck as a shuffled page pool (pages, page, H_kv, D) with a
    spare page of NaN (never read), and its block table."""
    n_pages = [math.ceil((ck[b + 1] - ck[b]) / page) for b in range(len(ck) - 1)]
    total = sum(n_pages) + 1
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(seed))
    kp = torch.full((total, page) + tuple(k.shape[1:]), float("nan"), dtype=k.dtype)
    vp = torch.full((total, page) + tuple(v.shape[1:]), float("nan"), dtype=v.dtype)
    table = torch.zeros(len(n_pages), max(max(n_pages), 1), dtype=torch.int32)
    at = 0
    for b, n in enumerate(n_pages):
        for i in range(n):
            pg = int(perm[at])
            rows = slice(ck[b] + i * page, min(ck[b] + (i + 1) * page, ck[b + 1]))
            m = rows.stop - rows.start
            kp[pg, :m], vp[pg, :m] = k[rows], v[rows]
            table[b, i] = pg
            at += 1
    used = torch.tensor([ck[b + 1] - ck[b] for b in range(len(ck) - 1)], dtype=torch.int32)
    return kp, vp, table, used


# (query lengths, key lengths): empty queries, a decoding row, chunks with Lq < Lk (one past a page of
# 128), a whole prefill, empty keys, more queries than keys, a tail of short blocks (70 = 64 + 6)
TILE_LQ, TILE_LK = [0, 1, 70, 130, 9, 64, 40, 100], [5, 200, 200, 130, 0, 300, 10, 257]


@pytest.mark.parametrize("isa", TILE_ISAS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (50, 0), (20, 10)], ids=str)
@pytest.mark.parametrize("cap_sinks", [False, True], ids=["plain", "softcap-sinks"])
def test_tile_products_forward(isa, dtype, window, cap_sinks):
    """The forward on the bfloat16 pair products (the tile hooks: amx; avx512bf16 and svebf16 for bfloat16),
    packed and from page pools of 64 and 128 rows, GQA, inference (P in one part for bfloat16) and
    before a backward, against the per-sequence float64 reference with PyTorch's own error in the
    test dtype as the yardstick (the dense rule); paged gives the packed call's bits."""
    if not isa_available(isa):
        pytest.skip(f"this CPU has no {isa}")
    H, Hkv, D, Dv = 8, 2, 64, 48
    q, k, v, cq, ck = make(TILE_LQ, TILE_LK, H, Hkv, D, Dv, dtype, requires_grad=False)
    cap, sinks = (5.0, torch.randn(H, dtype=dtype)) if cap_sinks else (None, None)
    kw = dict(window_size=window, enable_gqa=True, softcap=cap, sinks=sinks)
    cql, ckl = cq.tolist(), ck.tolist()
    ref_out, ref_lse = ref_varlen(
        q.double(),
        k.double(),
        v.double(),
        cql,
        ckl,
        window,
        softcap=cap,
        sinks=None if sinks is None else sinks.double(),
    )
    pt_out, _ = ref_varlen(q, k, v, cql, ckl, window, dtype=dtype, softcap=cap, sinks=sinks)
    mq, mk = max(TILE_LQ), max(TILE_LK)
    for for_backward in (False, True):

        def call(kk, vv, ckk, **extra):
            return torch.ops.masked_attn.varlen_forward(
                q,
                kk,
                vv,
                cq,
                ckk,
                mq,
                mk,
                None,
                extra.get("used"),
                extra.get("table"),
                for_backward,
                window_left=window[0],
                window_right=window[1],
                softcap=cap,
                sinks=sinks,
            )[:2]

        out, lse = run_isa(isa, lambda: call(k, v, ck))
        assert_close_ref(out, pt_out, ref_out, name=f"{isa} out for_backward={for_backward}")
        assert torch.equal(lse.isneginf(), ref_lse.isneginf())
        fin = ~ref_lse.isneginf()
        assert (lse.double()[fin] - ref_lse[fin]).abs().max().item() <= (2e-1 if dtype != torch.float32 else 1e-4)
        for page in (64, 128):
            kp, vp, table, used = to_pages(k, v, ckl, page)
            out_p, lse_p = run_isa(isa, lambda: call(kp, vp, None, used=used, table=table))
            assert torch.equal(out_p, out), f"page {page}: {(out_p - out).abs().max()}"
            assert torch.equal(lse_p, lse)
        if not for_backward:  # the public function: the same call
            with torch.no_grad():
                assert torch.equal(run_isa(isa, lambda: varlen_attn(q, k, v, cq, ck, mq, mk, **kw)), out)


@pytest.mark.parametrize(
    "isa,dtype",
    [
        (None, torch.float32),
        (None, torch.bfloat16),
        ("amx", torch.bfloat16),
        ("amx", torch.float16),
        ("amx", torch.float32),
    ]
    + [(isa, torch.bfloat16) for isa in TILE_ISAS if isa != "amx"],
    ids=str,
)
def test_thread_count_and_batch_invariance(isa, dtype):
    """Bitwise the same for any thread count, and a sequence's results do not
    depend on the other sequences of the batch (num_splits=1's promise), under
    each variant (amx, avx512bf16, svebf16: the tile products, in the forward before
    a backward and in inference, whose bfloat16 P is in one part)."""
    if isa is not None and not isa_available(isa):
        pytest.skip(f"this CPU has no {isa}")
    lq = [300, 5, 64, 1, 190]
    q, k, v, cq, ck = make(lq, lq, 4, 2, 32, 32, dtype)
    go = torch.randn(q.shape[0], 4, 32, dtype=dtype)

    def run():
        out = varlen_attn(q, k, v, cq, ck, 300, 300, window_size=(-1, 0), enable_gqa=True)
        with torch.no_grad():
            out_inf = varlen_attn(q, k, v, cq, ck, 300, 300, window_size=(-1, 0), enable_gqa=True)
        return (out, out_inf) + torch.autograd.grad(out, (q, k, v), go)

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run_isa(isa, run)
        torch.set_num_threads(max(2, threads))
        many = run_isa(isa, run)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, many):
        assert torch.equal(a, b)
    # sequence 4 alone
    s = slice(int(cq[4]), int(cq[5]))
    q4, k4, v4 = (t.detach()[s].clone().requires_grad_() for t in (q, k, v))
    c4 = cu([190])

    def alone():
        out4 = varlen_attn(q4, k4, v4, c4, c4, 190, 190, window_size=(-1, 0), enable_gqa=True)
        with torch.no_grad():
            out4_inf = varlen_attn(q4, k4, v4, c4, c4, 190, 190, window_size=(-1, 0), enable_gqa=True)
        return (out4, out4_inf) + torch.autograd.grad(out4, (q4, k4, v4), go[s])

    four = run_isa(isa, alone)
    for a, b in zip(four, one):
        assert torch.equal(a, b[s])


def test_matches_dense_forward_bitwise():
    """One sequence is the dense kernel on a (1, H, L, D) view: the same tiles, bit for bit."""
    L = 150
    q, k, v, c, _ = make([L], [L], 4, 4, 32, 32, torch.float32, requires_grad=False)
    for window, causal in [((-1, -1), False), ((-1, 0), True)]:
        out = varlen_attn(q, k, v, c, c, L, L, window_size=window)
        dense = masked_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=causal
        )
        assert torch.equal(out, dense[0].transpose(0, 1))


@pytest.mark.parametrize("isa", [None, *TILE_ISAS], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "for-backward"])
def test_entries_match_dense_forward_bitwise(isa, dtype, grad):
    """Every entry of a packed or paged call gives the bits of the dense kernel on that sequence alone,
    under the same variant: varlen takes the products dense takes (on the tile variants the tile
    hooks, whose bits differ from the FMAs'), whatever the other sequences. A chunk of Lq < Lk queries
    causal at the bottom right is dense's window (-1, Lk - Lq); softcap and sinks as dense's."""
    if isa is not None and not isa_available(isa):
        pytest.skip(f"this CPU has no {isa}")
    H, Hkv, D = 8, 2, 64
    lq, lk = [70, 1, 130, 9, 200], [200, 300, 130, 40, 257]
    q, k, v, cq, ck = make(lq, lk, H, Hkv, D, D, dtype, requires_grad=False)
    sinks = torch.randn(H, dtype=dtype)
    kp, vp, table, used = to_pages(k, v, ck.tolist(), 128)
    for causal, cap in [(False, None), (True, None), (True, 4.0)]:
        kw = dict(
            window_size=(-1, 0) if causal else (-1, -1), enable_gqa=True, softcap=cap, sinks=sinks if cap else None
        )

        def calls():
            with torch.set_grad_enabled(grad):
                qg = q.clone().requires_grad_(grad)
                packed = varlen_attn(qg, k, v, cq, ck, max(lq), max(lk), **kw)
                with torch.no_grad():  # paged is inference-only: the raw op, out_lo as packed's
                    paged = torch.ops.masked_attn.varlen_forward(
                        q,
                        kp,
                        vp,
                        cq,
                        None,
                        max(lq),
                        max(lk),
                        None,
                        used,
                        table,
                        grad,
                        window_right=0 if causal else -1,
                        softcap=cap,
                        sinks=kw["sinks"],
                    )[0]
                dense = []
                for b in range(len(lq)):
                    qs, ks, vs = (t[c[b] : c[b + 1]].transpose(0, 1)[None] for t, c in ((qg, cq), (k, ck), (v, ck)))
                    dense.append(
                        masked_attention(
                            qs, ks, vs, window=(-1, lk[b] - lq[b]) if causal else None, softcap=cap, sinks=kw["sinks"]
                        )[0].transpose(0, 1)
                    )
                return packed.detach(), paged, torch.cat(dense).detach()

        packed, paged, dense = calls() if isa is None else run_isa(isa, calls)
        assert torch.equal(packed, dense), f"causal={causal} cap={cap}: {(packed - dense).abs().max()}"
        assert torch.equal(paged, dense)


# The single-pass backward's key chunks of a varlen entry: one per 32 key blocks of 64
# (dispatch.c, varlen_chunks), on the entry's own key length. (query lengths, key lengths,
# H, Hkv, D, Dv, window): entries of 2, 3 and 16 chunks (2100, 4200 and 66000 keys: the cap)
# beside entries of one.
CHUNK_CASES = [
    ([70, 130, 40], [70, 4200, 40], 4, 2, 32, 16, (-1, 0)),  # 3 chunks, causal at the bottom right
    ([70, 130, 40], [70, 4200, 40], 4, 2, 32, 16, (-1, -1)),
    ([70, 130, 40], [70, 4200, 40], 4, 2, 32, 16, (1000, 0)),  # the window leaves most chunks' first blocks out
    ([9, 2100], None, 2, 1, 16, 16, (-1, 0)),  # 2 chunks, a causal prefill: interleaved blocks on the diagonal
    ([3, 1], [66000, 64], 2, 2, 8, 8, (-1, -1)),  # 16 chunks (the cap), 3 query rows
]


@pytest.mark.parametrize("case", CHUNK_CASES, ids=str)
def test_key_chunks(case):
    """An entry of several key chunks (its dq from partial sums, reduced in chunk order) against
    float64, and bitwise the same alone as packed, for any thread count and key group."""
    lq, lk, H, Hkv, D, Dv, window = case
    lk = lk or lq
    q, k, v, cq, ck = make(lq, lk, H, Hkv, D, Dv, torch.float32)
    go = torch.randn(q.shape[0], H, Dv)

    def run(q, k, v, cq, ck, go):
        out = varlen_attn(
            q,
            k,
            v,
            cq,
            ck,
            int((cq[1:] - cq[:-1]).max()),
            int((ck[1:] - ck[:-1]).max()),
            window_size=window,
            enable_gqa=True,
        )
        return (out.detach(),) + torch.autograd.grad(out, (q, k, v), go)

    ours = run(q, k, v, cq, ck, go)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_out, _ = ref_varlen(qd, kd, vd, cq.tolist(), ck.tolist(), window)
    refs = (ref_out,) + torch.autograd.grad(ref_out, (qd, kd, vd), go.double())
    qt, kt, vt = (t.detach().clone().requires_grad_() for t in (q, k, v))
    pt_out, _ = ref_varlen(qt, kt, vt, cq.tolist(), ck.tolist(), window, dtype=torch.float32)
    pts = (pt_out,) + torch.autograd.grad(pt_out, (qt, kt, vt), go, allow_unused=True)
    for name, a, p, r in zip(("out", "dq", "dk", "dv"), ours, pts, refs):
        assert_close_ref(a, p if p is not None else torch.zeros_like(a), r, name=name)

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with bwd_key_group(1):
            one = run(q, k, v, cq, ck, go)
    finally:
        torch.set_num_threads(threads)
    with bwd_key_group(4):
        grouped = run(q, k, v, cq, ck, go)
    for a, b, c in zip(ours, one, grouped):
        assert torch.equal(a, b) and torch.equal(a, c)
    b = max(range(len(lk)), key=lambda i: lk[i])  # the entry of the most chunks, alone
    sq, sk = slice(int(cq[b]), int(cq[b + 1])), slice(int(ck[b]), int(ck[b + 1]))
    alone = run(
        *(t.detach()[s].clone().requires_grad_() for t, s in ((q, sq), (k, sk), (v, sk))),
        cu([lq[b]]),
        cu([lk[b]]),
        go[sq],
    )
    for a, x, s in zip(alone, ours, (sq, sq, sk, sk)):
        assert torch.equal(a, x[s])


@pytest.mark.parametrize("isa", [None, *TILE_ISAS], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_entries_match_dense_backward_bitwise(isa, dtype):
    """Every entry of one key chunk gives the gradients of the dense single pass on that sequence
    alone where it too takes one chunk (bwd_cpus(1): 8 items from B * Hkv = 8): the same items, the
    same bits, on the tile variants' hooks too (which move to each item's entry)."""
    if isa is not None and not isa_available(isa):
        pytest.skip(f"this CPU has no {isa}")
    H, Hkv, D = 8, 8, 32
    lq = lk = [70, 1, 130, 9, 200]
    q, k, v, cq, ck = make(lq, lk, H, Hkv, D, D, dtype)
    go = torch.randn(q.shape[0], H, D, dtype=dtype)
    for causal in (False, True):
        window = (-1, 0) if causal else (-1, -1)

        def calls():
            out = varlen_attn(q, k, v, cq, ck, max(lq), max(lk), window_size=window)
            packed = torch.autograd.grad(out, (q, k, v), go)
            dense = []
            for b in range(len(lq)):
                s = slice(int(cq[b]), int(cq[b + 1]))
                qs, ks, vs = (t.detach()[s].transpose(0, 1)[None].requires_grad_() for t in (q, k, v))
                o = masked_attention(qs, ks, vs, is_causal=causal)
                dense.append(
                    [g[0].transpose(0, 1) for g in torch.autograd.grad(o, (qs, ks, vs), go[s].transpose(0, 1)[None])]
                )
            return packed, [torch.cat([d[i] for d in dense]) for i in range(3)]

        with bwd_cpus(1):
            packed, dense = calls() if isa is None else run_isa(isa, calls)
        for name, a, d in zip(("dq", "dk", "dv"), packed, dense):
            assert torch.equal(a, d), f"causal={causal} {name}: {(a - d).abs().max()}"


def test_no_work_for_other_sequences():
    """NaN in one sequence's q, k, v reaches none of the others."""
    lq = [70, 40, 130]
    q, k, v, cq, ck = make(lq, lq, 2, 2, 16, 16, torch.float32)
    out = varlen_attn(q, k, v, cq, ck, 130, 130)
    q2, k2, v2 = (t.detach().clone() for t in (q, k, v))
    for t in (q2, k2, v2):
        t[70:110] = float("nan")
    out2 = varlen_attn(q2, k2, v2, cq, ck, 130, 130)
    keep = torch.ones(q.shape[0], dtype=torch.bool)
    keep[70:110] = False
    assert torch.equal(out2[keep], out[keep])


def test_large_window_is_unbounded():
    q, k, v, cq, ck = make([70, 5], [80, 5], 2, 2, 16, 16, torch.float32, requires_grad=False)
    a = varlen_attn(q, k, v, cq, ck, 70, 80, window_size=(-1, 0))
    b = varlen_attn(q, k, v, cq, ck, 70, 80, window_size=(10**6, 0))
    c = varlen_attn(q, k, v, cq, ck, 70, 80, window_size=(10**6, 10**6))
    d = varlen_attn(q, k, v, cq, ck, 70, 80)
    assert torch.equal(a, b) and torch.equal(c, d)


@pytest.mark.parametrize("page", [64, 128, 32])  # in place (multiples of 64), gathered (32)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("lq", [[1, 1, 3, 1, 1], [1, 1, 40, 1, 70]], ids=["decode", "prefill-chunks"])
def test_seqused_k_and_block_table(page, dtype, lq):
    torch.manual_seed(1)
    H, D = 2, 16
    used = [100, 1, 64, 0, 200]
    slot = [128, 64, 128, 64, 256]  # cache slots larger than the sequences
    cq = cu(lq)
    q = torch.randn(int(cq[-1]), H, D, dtype=dtype)
    ck_slot = cu(slot)
    k = torch.randn(int(ck_slot[-1]), H, D, dtype=dtype)
    v = torch.randn(int(ck_slot[-1]), H, D, dtype=dtype)
    seqused = torch.tensor(used, dtype=torch.int32)
    mq = max(lq)
    out = varlen_attn(q, k, v, cq, ck_slot, mq, 256, seqused_k=seqused, window_size=(-1, 0))
    # the same keys packed without the unused tail
    idx = torch.cat([torch.arange(int(ck_slot[b]), int(ck_slot[b]) + used[b]) for b in range(5)])
    ref = varlen_attn(q, k[idx], v[idx], cq, cu(used), mq, 200, window_size=(-1, 0))
    assert torch.equal(out, ref)
    # paged: pages of 64 tokens in a shuffled pool
    n_pages = [math.ceil(u / page) for u in used]
    pool_pages = sum(n_pages) + 3
    perm = torch.randperm(pool_pages)
    kp = torch.randn(pool_pages, page, H, D, dtype=dtype)
    vp = torch.randn(pool_pages, page, H, D, dtype=dtype)
    table = torch.zeros(5, 8, dtype=torch.int32)
    kk, vv, at = [], [], 0
    for b in range(5):
        for p in range(n_pages[b]):
            table[b, p] = int(perm[at])
            kk.append(kp[perm[at]])
            vv.append(vp[perm[at]])
            at += 1
    kk = torch.cat(kk)
    vv = torch.cat(vv)
    out_p = varlen_attn(q, kp, vp, cq, None, mq, 256, seqused_k=seqused, block_table=table, window_size=(-1, 0))
    ref_p = varlen_attn(q, kk, vv, cq, cu([n * page for n in n_pages]), mq, 256, seqused_k=seqused, window_size=(-1, 0))
    assert torch.equal(out_p, ref_p)
    if page % 64 == 0:  # the raw op reads the pool in place; a page outside the pool is refused
        # for_backward=False as varlen_attn's no-grad call: a bfloat16 call on the tile products (amx,
        # avx512bf16) otherwise keeps P in two parts for a backward (docs/design.md, section 6)
        raw = torch.ops.masked_attn.varlen_forward(
            q, kp, vp, cq, None, mq, 256, None, seqused, table, False, window_right=0
        )[0]
        assert torch.equal(raw, ref_p)
        bad = table.clone()
        bad[0, 0] = pool_pages
        with pytest.raises(RuntimeError, match=r"block_table\[0, 0\] = .* is not a page of key"):
            torch.ops.masked_attn.varlen_forward(q, kp, vp, cq, None, mq, 256, None, seqused, bad, window_right=0)
    # inference only
    qg = q.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="inference-only"):
        varlen_attn(qg, k, v, cq, ck_slot, mq, 256, seqused_k=seqused)
    with pytest.raises(RuntimeError, match="inference-only"):
        varlen_attn(qg, kp, vp, cq, None, mq, 256, seqused_k=seqused, block_table=table)


def test_bad_input():
    q, k, v, cq, ck = make([5, 7], [5, 7], 2, 2, 8, 8, torch.float32, requires_grad=False)

    def call(cq=cq, ck=ck, max_q=7, max_k=7, **kw):
        return varlen_attn(q if "q" not in kw else kw.pop("q"), k, v, cq, ck, max_q, max_k, **kw)

    with pytest.raises(RuntimeError, match="cu_seq_q must be nondecreasing"):
        call(cq=torch.tensor([0, 13, 12], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="cu_seq_k must be nondecreasing"):
        call(ck=torch.tensor([0, 7, 5], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="cu_seq_q must be int32"):
        call(cq=cq.long())
    with pytest.raises(RuntimeError, match=r"cu_seq_k must be 1-D \(N \+ 1,\)"):
        call(ck=torch.tensor([0, 12], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="must start at 0"):
        call(cq=torch.tensor([1, 5, 12], dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"cu_seq_q\[-1\] = 11 must equal the number of query tokens"):
        call(cq=torch.tensor([0, 5, 11], dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"cu_seq_k\[-1\] = 13 must equal the number of key tokens"):
        call(ck=torch.tensor([0, 5, 13], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="max_q = 6 is less than the longest query sequence"):
        call(max_q=6)
    with pytest.raises(RuntimeError, match="max_k = 3 is less than the longest key sequence"):
        call(max_k=3)
    with pytest.raises(ValueError, match="window_size entries"):
        call(window_size=(-2, 0))
    with pytest.raises(ValueError, match="window_size must have length 2"):
        call(window_size=(1, 2, 3))
    with pytest.raises(ValueError, match="enable_gqa=True"):
        varlen_attn(torch.randn(12, 4, 8), k, v, cq, ck, 7, 7)
    with pytest.raises(ValueError, match="multiple"):
        varlen_attn(torch.randn(12, 3, 8), k, v, cq, ck, 7, 7, enable_gqa=True)
    with pytest.raises(ValueError, match="query must be 3-D"):
        varlen_attn(q[None], k, v, cq, ck, 7, 7)
    with pytest.raises(RuntimeError, match="seqused_k\\[1\\] = 9 must be in"):
        call(seqused_k=torch.tensor([5, 9], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="same dtype"):
        varlen_attn(q.double(), k, v, cq, ck, 7, 7)
    with pytest.raises(RuntimeError, match="softcap must be None or a finite number > 0"):
        call(softcap=0.0)
    with pytest.raises(RuntimeError, match="softcap must be None or a finite number > 0"):
        call(softcap=float("nan"))
    with pytest.raises(RuntimeError, match=r"sinks must have shape \(H,\) = \(2,\)"):
        call(sinks=torch.zeros(3))
    with pytest.raises(RuntimeError, match="sinks must be floating point"):
        call(sinks=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="got query on cpu and sinks on meta"):
        call(sinks=torch.zeros(2, device="meta"))
