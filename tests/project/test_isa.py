"""Every instruction-set variant the machine has, forced with MASKED_ATTN_ISA,
against the scalar reference kernel and against PyTorch, on shapes that hit
every tile edge; and bitwise determinism across thread counts."""

import pytest
import torch
import torch.nn.functional as F

import torch_masked_attn as tma
from conftest import FMA_ISAS, ISAS, SIMD_ISAS, TILE_ISAS, assert_close_ref, isa_available, run_isa
from reference import attention64
from torch_masked_attn.ops import bwd_cpus, bwd_key_group, use_isa

VARIANTS = ISAS


def fwd_bwd(q, k, v, g, **kw):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse = tma.functional.masked_attention(q, k, v, return_lse=True, **kw)
    grads = torch.autograd.grad(out, (q, k, v), g)
    return (out, lse) + grads


# (B, H, Hkv, Lq, Lk, D, Dv): L and D off the block sizes (64) and vector widths (8, 16, 32)
SHAPES = [
    (1, 1, 1, 1, 1, 1, 1),
    (2, 2, 1, 1, 70, 3, 5),
    (1, 2, 2, 65, 65, 17, 33),
    (2, 4, 2, 130, 97, 64, 64),
    (1, 1, 1, 200, 200, 31, 1),
    (4, 8, 4, 70, 97, 16, 24),  # B * Hkv >= 8: the single-pass backward
]


def torch_reference(q, k, v, masks, kw):
    """The float64 reference with the masks of `masks` ("none", "causal+kpm", "float+head"; their
    tensors and flags in kw, masked_attention's keywords)."""
    return attention64(q, k, v, **kw)


@pytest.mark.parametrize("isa", SIMD_ISAS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("masks", ["none", "causal+kpm", "float+head"])
def test_variant_matches_scalar_and_torch(isa, shape, masks):
    if not isa_available(isa):
        pytest.skip(f"this CPU has no {isa}")
    torch.manual_seed(0)
    B, H, Hkv, Lq, Lk, D, Dv = shape
    q, k, v = torch.randn(B, H, Lq, D), torch.randn(B, Hkv, Lk, D), torch.randn(B, Hkv, Lk, Dv)
    g = torch.randn(B, H, Lq, Dv)
    kw = {}
    if masks == "causal+kpm":
        kpm = torch.zeros(B, Lk, dtype=torch.bool)
        kpm[:, Lk - Lk // 3 :] = True
        kw = dict(is_causal=True, key_padding_mask=kpm)
    elif masks == "float+head":
        kw = dict(attn_mask=torch.randn(Lq, Lk), head_mask=torch.rand(H))
    ref = run_isa("scalar", lambda: fwd_bwd(q, k, v, g, **kw))
    got = run_isa(isa, lambda: fwd_bwd(q, k, v, g, **kw))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5, msg=f"{isa} vs scalar: {name}")
    # and against PyTorch's own attention, in float64
    torch.testing.assert_close(got[0].double(), torch_reference(q, k, v, masks, kw), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("isa", VARIANTS)
def test_exp_edges(isa):
    """-inf scores give exactly 0 probability, NaN propagates, huge logits stay finite."""
    if not isa_available(isa):
        pytest.skip(f"this CPU has no {isa}")
    q = torch.randn(1, 1, 40, 8) * 100.0  # logits ~ 1e4
    k, v = torch.randn(1, 1, 40, 8) * 100.0, torch.randn(1, 1, 40, 8)
    mask = torch.zeros(40, 40)
    mask[:, 20:] = float("-inf")
    out = run_isa(isa, lambda: tma.functional.masked_attention(q, k, v, attn_mask=mask))
    ref = attention64(q, k, v, attn_mask=mask)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)
    # changing masked keys' values changes nothing, bitwise
    v2 = v.clone()
    v2[:, :, 20:] = 1e30
    out2 = run_isa(isa, lambda: tma.functional.masked_attention(q, k, v2, attn_mask=mask))
    assert torch.equal(out, out2)
    qn = q.clone()
    qn[0, 0, 3, 0] = float("nan")
    outn = run_isa(isa, lambda: tma.functional.masked_attention(qn, k, v, attn_mask=mask))
    assert torch.isnan(outn[0, 0, 3]).all() and not torch.isnan(outn[0, 0, 4]).any()


@pytest.mark.parametrize("isa", VARIANTS)
@pytest.mark.parametrize(
    "shape", [(1, 1, 1, 300, 300, 64, 64), (3, 4, 2, 130, 70, 32, 16), (4, 8, 4, 100, 130, 32, 16)], ids=str
)
def test_deterministic_across_thread_counts(isa, shape):
    if not isa_available(isa):
        pytest.skip(f"this CPU has no {isa}")
    torch.manual_seed(1)
    B, H, Hkv, Lq, Lk, D, Dv = shape
    q, k, v = torch.randn(B, H, Lq, D), torch.randn(B, Hkv, Lk, D), torch.randn(B, Hkv, Lk, Dv)
    g = torch.randn(B, H, Lq, Dv)
    kpm = torch.zeros(B, Lk, dtype=torch.bool)
    kpm[0, Lk // 2 :] = True
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append(run_isa(isa, lambda: fwd_bwd(q, k, v, g, is_causal=True, key_padding_mask=kpm)))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("masks", ["none", "causal+kpm+head"])
def test_single_pass_backward_gradcheck(masks):
    """float64 gradcheck on a shape that takes the single-pass backward
    (B * Hkv >= 16), head_mask gradient included."""
    torch.manual_seed(3)
    B, H, Hkv, Lq, Lk, D = 4, 8, 4, 5, 6, 3
    q = torch.randn(B, H, Lq, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, Hkv, Lk, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, Hkv, Lk, 2, dtype=torch.float64, requires_grad=True)
    hm = torch.rand(B, H, dtype=torch.float64, requires_grad=True)
    kw = {}
    if masks != "none":
        kpm = torch.zeros(B, Lk, dtype=torch.bool)
        kpm[1, 3:] = True
        kw = dict(is_causal=True, key_padding_mask=kpm)
    assert torch.autograd.gradcheck(
        lambda q, k, v, hm: tma.functional.masked_attention(q, k, v, head_mask=hm, **kw), (q, k, v, hm)
    )


@pytest.mark.parametrize("isa", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(2, 4, 2, 150, 130, 16), (4, 8, 2, 70, 90, 24)], ids=str)
def test_converted_inputs(isa, dtype, shape):
    """Inputs the kernels cannot read in place (reduced precision, last-dim
    stride 2) go through the per-thread head caches; both backward paths."""
    if not isa_available(isa):
        pytest.skip(f"this CPU has no {isa}")
    torch.manual_seed(4)
    B, H, Hkv, Lq, Lk, D = shape
    q = torch.randn(B, H, Lq, 2 * D)[..., ::2].to(dtype)
    k = torch.randn(B, Hkv, Lk, 2 * D)[..., ::2].to(dtype)
    v = torch.randn(B, Hkv, Lk, 2 * D)[..., ::2].to(dtype)
    if dtype == torch.float32:
        assert q.stride(-1) == 2
    g = torch.randn(B, H, Lq, D).to(dtype)
    kpm = torch.zeros(B, Lk, dtype=torch.bool)
    kpm[0, Lk // 3 :] = True
    got = run_isa(isa, lambda: fwd_bwd(q, k, v, g, is_causal=True, key_padding_mask=kpm))
    ref = fwd_bwd(
        q.float().contiguous(),
        k.float().contiguous(),
        v.float().contiguous(),
        g.float(),
        is_causal=True,
        key_padding_mask=kpm,
    )
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
        torch.testing.assert_close(a.float(), b, rtol=tol, atol=tol, msg=name)


def test_key_chunked_backward_gradcheck():
    """B * Hkv = 1 with several key blocks: the single pass splits the keys into
    chunks and adds the chunks' dq (and head-mask) partial sums in order."""
    torch.manual_seed(5)
    q = torch.randn(1, 2, 70, 3, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 140, 3, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 1, 140, 2, dtype=torch.float64, requires_grad=True)
    hm = torch.rand(2, dtype=torch.float64, requires_grad=True)
    kpm = torch.zeros(1, 140, dtype=torch.bool)
    kpm[0, 100:] = True
    assert torch.autograd.gradcheck(
        lambda q, k, v, hm: tma.functional.masked_attention(
            q, k, v, head_mask=hm, key_padding_mask=kpm, attn_mask=torch.zeros(70, 140, dtype=torch.float64)
        ),
        (q, k, v, hm),
        atol=1e-6,
    )


@pytest.mark.parametrize("isa", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fully_masked_row_is_zero_next_to_inf_values(isa, dtype):
    """A query row that sees no key gives exactly 0 even when a value other
    rows of its block see is inf (0 * inf must not reach it)."""
    if not isa_available(isa):
        pytest.skip(f"this CPU has no {isa}")
    torch.manual_seed(6)
    q, k, v = (torch.randn(1, 1, 40, 16).to(dtype) for _ in range(3))
    v[0, 0, 3, 0] = float("inf")
    blocked = torch.zeros(40, 40, dtype=torch.bool)
    blocked[5] = True
    out = run_isa(isa, lambda: tma.functional.masked_attention(q, k, v, attn_mask=blocked))
    assert torch.equal(out[0, 0, 5], torch.zeros(16, dtype=dtype))


@pytest.mark.parametrize("isa", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_trailing_padding_and_unseen_keys_are_never_read(isa, dtype):
    """NaN in k, v of trailing padded keys (inside a partly padded key block),
    and of keys after the last query under is_causal (Lk > Lq), reaches no
    output, weight or gradient: those keys are never read."""
    if not isa_available(isa):
        pytest.skip(f"this CPU has no {isa}")
    torch.manual_seed(7)
    B, H, Lq, Lk, D = 2, 2, 37, 100, 16
    q, k, v = torch.randn(B, H, Lq, D), torch.randn(B, H, Lk, D), torch.randn(B, H, Lk, D)
    g = torch.randn(B, H, Lq, D)
    kpm = torch.zeros(B, Lk, dtype=torch.bool)
    kpm[0, 37:] = True  # batch 0: keys 37.. are padding (block 0 partly, block 1 whole)
    k[0, :, 37:], v[0, :, 37:] = float("nan"), float("nan")
    k[1, :, 37:], v[1, :, 37:] = float("nan"), float("nan")  # batch 1: after the last query (causal)
    q, k, v, g = (t.to(dtype) for t in (q, k, v, g))

    def run():
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        out, w = tma.functional.masked_attention(qq, kk, vv, key_padding_mask=kpm, is_causal=True, need_weights=True)
        grads = torch.autograd.grad(out, (qq, kk, vv), g)
        out2 = tma.functional.masked_attention(qq, kk, vv, key_padding_mask=kpm, is_causal=True)
        grads2 = torch.autograd.grad(out2, (qq, kk, vv), g)  # the single-pass backward
        return (out, w, out2) + grads + grads2

    got = run_isa(isa, run)
    names = ("out", "weights", "out (no weights)", "dq", "dk", "dv", "dq 1-pass", "dk 1-pass", "dv 1-pass")
    for name, t in zip(names, got):
        t = t[..., :37, :] if name.startswith(("dk", "dv")) else t  # dk, dv of NaN keys are theirs
        assert not torch.isnan(t).any(), name


# ---------------------------------------------------------------------------
# large outputs, written with non-temporal stores (masked_attn.h, stream_stores)
# ---------------------------------------------------------------------------


def _op_fwd(q, k, v, kpm=None, causal=True):
    return torch.ops.masked_attn.forward(q, k, v, None, kpm, None, causal, None, False)


def _op_bwd(g, q, k, v, out, lse, kpm=None, causal=True, into=None):
    args = (g, None, q, k, v, out, lse, None, kpm, None, causal, None, False, False)
    if into is None:
        return torch.ops.masked_attn.backward(*args)[:3]
    torch.ops.masked_attn.backward_into(*args, *into)
    return into


@pytest.mark.parametrize("isa", SIMD_ISAS)
@pytest.mark.parametrize("D", [64, 48, 80])
@pytest.mark.parametrize("masks", ["causal+kpm", "none"])
def test_large_outputs_streamed_same_values(isa, D, masks):
    """16 heads at once (outputs of 4 MB or more: streamed) must give bitwise
    the values of two calls on 8 heads each (under 4 MB: plain stores),
    forward and backward, with rows in the (B, L, H, D) layout the op writes;
    D = 48 and 80 make rows of 3 and 5 cache lines. The backward's key chunks
    are pinned to one for both (bwd_cpus(1): 8 items or more), as on a
    machine of up to 8 CPUs: on more, 8 and 16 heads get different chunk
    counts, which sum dq in another order."""
    if not isa_available(isa):
        pytest.skip(f"this CPU has no {isa}")
    with bwd_cpus(1):
        _large_outputs_streamed(isa, D, masks)


def _large_outputs_streamed(isa, D, masks):
    torch.manual_seed(0)
    B, H = 1, 16
    L = (4 << 20) // (H * D * 4) + 8
    q, k, v, g = (torch.randn(B, H, L, D) for _ in range(4))
    kpm, causal = None, False
    if masks == "causal+kpm":
        kpm = torch.zeros(B, L, dtype=torch.bool)
        kpm[:, L - 100 :] = True
        causal = True
    whole = run_isa(isa, lambda: _op_fwd(q, k, v, kpm, causal))
    assert whole[0].numel() * 4 >= 4 << 20
    grads = run_isa(isa, lambda: _op_bwd(g, q, k, v, whole[0], whole[1], kpm, causal))
    for s in (slice(0, H // 2), slice(H // 2, H)):
        part = [x[:, s].contiguous() for x in (q, k, v, g)]
        half = run_isa(isa, lambda: _op_fwd(*part[:3], kpm, causal))
        assert half[0].numel() * 4 < 4 << 20
        assert torch.equal(whole[0][:, s], half[0]) and torch.equal(whole[1][:, s], half[1]), f"{isa} D={D}: out"
        hgrads = run_isa(isa, lambda: _op_bwd(part[3], *part[:3], half[0], half[1], kpm, causal))
        for name, a, b in zip(("dq", "dk", "dv"), grads, hgrads):
            assert torch.equal(a[:, s], b), f"{isa} D={D}: {name}"


@pytest.mark.parametrize("isa", SIMD_ISAS)
@pytest.mark.parametrize("off", [0, 4, 8])
def test_streamed_gradients_into_misaligned_views(isa, off):
    """backward_into views whose rows start 0, 16 or 32 bytes off a cache
    line, and H * (D + 8) floats apart (alignment alternating from row to
    row): only whole aligned lines are streamed, values are bitwise those of
    fresh outputs."""
    if not isa_available(isa):
        pytest.skip(f"this CPU has no {isa}")
    torch.manual_seed(0)
    B, H, L, D = 1, 8, 2048, 64
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
    out, lse, _, _ = _op_fwd(q, k, v)
    g = torch.randn_like(out)
    ref = run_isa(isa, lambda: _op_bwd(g, q, k, v, out, lse))
    n = B * L * H * (D + 8)
    buf = torch.zeros(3 * n + off + 64)
    views = [buf[off + i * n : off + (i + 1) * n].view(B, L, H, D + 8)[..., :D].transpose(1, 2) for i in range(3)]
    run_isa(isa, lambda: _op_bwd(g, q, k, v, out, lse, into=views))
    for name, a, b in zip(("dq", "dk", "dv"), ref, views):
        assert torch.equal(a, b), f"{isa} off={off}: {name}"


@pytest.mark.parametrize("isa", SIMD_ISAS)
def test_streamed_gradients_over_their_inputs_with_key_chunks(isa):
    """dq, dk, dv written over q, k, v themselves (MultiheadAttention's
    recompute path) with 4 MB gradients, streamed, and B * Hkv = 4 (key
    chunks, dq through the reduce task): bitwise the fresh outputs."""
    if not isa_available(isa):
        pytest.skip(f"this CPU has no {isa}")
    torch.manual_seed(0)
    N, L, H, hd = 1, 4096, 4, 64
    qkv = torch.randn(N, L, 3, H, hd)
    q, k, v = (qkv.select(2, i).permute(0, 2, 1, 3) for i in range(3))
    out, lse, _, _ = _op_fwd(q, k, v)
    g = torch.randn_like(out)
    ref = run_isa(isa, lambda: [t.clone() for t in _op_bwd(g, q, k, v, out, lse)])
    run_isa(isa, lambda: _op_bwd(g, q, k, v, out, lse, into=(q, k, v)))
    for name, a, b in zip(("dq", "dk", "dv"), ref, (q, k, v)):
        assert torch.equal(a, b), f"{isa}: {name}"


# ---------------------------------------------------------------------------
# the causal diagonal split
# ---------------------------------------------------------------------------


def _fwd_bwd_all(q, k, v, g, hm=None, am=None, need_weights=False, **kw):
    """out, lse, and the gradients of q, k, v, head mask and float mask (and
    the weights) of one call."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    leaves = [q, k, v]
    if hm is not None:
        hm = hm.detach().requires_grad_()
        leaves.append(hm)
    if am is not None and am.dtype.is_floating_point:
        am = am.detach().requires_grad_()
        leaves.append(am)
    res = tma.functional.masked_attention(
        q, k, v, head_mask=hm, attn_mask=am, need_weights=need_weights, return_lse=True, **kw
    )
    grads = torch.autograd.grad(res[0], leaves, g)
    return (res[0], res[-1]) + tuple(grads) + ((res[1],) if need_weights else ())


@pytest.fixture
def eight_cpus():
    """The backward's key chunks as on a machine of 8 CPUs (ops.bwd_cpus), so
    that a test's cases meant for one chunk (8 items) and for several keep
    them on a machine with more."""
    with bwd_cpus(8):
        yield


SPLIT_CASES = {  # (B, H, Hkv, Lq, Lk, D, Dv)
    "gqa": (2, 4, 2, 130, 130, 32, 48),  # B * Hkv = 4: key chunks
    "lq<lk": (1, 2, 1, 100, 190, 48, 16),
    "lq>lk": (1, 2, 2, 190, 100, 48, 16),
    "one-chunk": (4, 2, 2, 128, 128, 16, 16),  # B * Hkv = 8: kv_chunks 1 (eight_cpus)
    "short-strip": (1, 2, 1, 84, 190, 48, 16),  # last diagonal tile: 20 queries (strips of 16 and 4), 64 keys
}


@pytest.mark.parametrize(
    "isa,dtype",
    [(isa, torch.float32) for isa in VARIANTS] + [("scalar", torch.float64)],
    ids=[f"{isa}-float32" for isa in VARIANTS] + ["float64"],
)  # float64 runs the scalar instance
@pytest.mark.parametrize("case", list(SPLIT_CASES))
@pytest.mark.parametrize("extra", ["plain", "head", "floatmask", "weights"])
def test_causal_diagonal_split_is_exact(isa, dtype, case, extra, eight_cpus):
    """Under is_causal a diagonal tile is computed in strips of 16 and skips
    what the causal mask hides above them (a strip's queries see no key after
    the strip, its keys are seen by no query before it). The same mask
    given as a bool attn_mask (or folded into a float one) is computed whole,
    tile by tile: for finite inputs every output and gradient must be
    identical, bit for bit. need_weights also takes the AMX instance through
    the split (its tile kernels do not split)."""
    if not isa_available(isa):
        pytest.skip(f"this CPU has no {isa}")
    B, H, Hkv, Lq, Lk, D, Dv = SPLIT_CASES[case]
    torch.manual_seed(1)
    q, k = torch.randn(B, H, Lq, D, dtype=dtype), torch.randn(B, Hkv, Lk, D, dtype=dtype)
    v, g = torch.randn(B, Hkv, Lk, Dv, dtype=dtype), torch.randn(B, H, Lq, Dv, dtype=dtype)
    causal = torch.ones(Lq, Lk, dtype=torch.bool).triu(1)
    kpm = torch.zeros(B, Lk, dtype=torch.bool)
    kpm[-1, Lk - 9 :] = True
    hm = torch.rand(H, dtype=dtype) + 0.5 if extra == "head" else None
    nw = extra == "weights"
    if extra == "floatmask":
        fm = torch.randn(Lq, Lk, dtype=dtype)
        split = run_isa(isa, lambda: _fwd_bwd_all(q, k, v, g, hm, fm, nw, is_causal=True, key_padding_mask=kpm))
        whole = run_isa(
            isa, lambda: _fwd_bwd_all(q, k, v, g, hm, fm.masked_fill(causal, float("-inf")), nw, key_padding_mask=kpm)
        )
    else:
        split = run_isa(isa, lambda: _fwd_bwd_all(q, k, v, g, hm, None, nw, is_causal=True, key_padding_mask=kpm))
        whole = run_isa(isa, lambda: _fwd_bwd_all(q, k, v, g, hm, causal, nw, key_padding_mask=kpm))
    for i, (a, b) in enumerate(zip(split, whole)):
        if extra == "floatmask" and i == len(split) - 1:  # the mask's gradient: compare where not masked
            a, b = a.masked_fill(causal, 0), b.masked_fill(causal, 0)
        assert torch.equal(a, b), f"{isa} {case} {extra}: output {i}, max diff {(a - b).abs().max()}"


# (B, H, Hkv, Lk, D, Dv) for the short query blocks (decoding and the last rows of a prefill)
ROWS_CASES = {
    "decode": (2, 4, 4, 200, 64, 64),
    "gqa-tails": (1, 4, 2, 97, 13, 80),
    "long-D": (1, 2, 1, 70, 128, 16),
}


@pytest.mark.parametrize(
    "isa,dtype",
    [(isa, torch.float32) for isa in VARIANTS]
    + [(isa, dt) for isa in FMA_ISAS for dt in (torch.bfloat16, torch.float16)]
    + [(isa, torch.bfloat16) for isa in TILE_ISAS]
    + [("scalar", torch.float64)],
    ids=str,
)
@pytest.mark.parametrize("case", list(ROWS_CASES))
@pytest.mark.parametrize("masks", ["none", "causal+kpm", "float+head"])
def test_short_query_blocks_match_the_tiles(isa, dtype, case, masks):
    """A call of at most 16 query rows (Lq = 1 when decoding) runs the decode
    kernel (K and V rows read in place, dot_rows' order); a longer one goes
    through the tiles, its last short block too. A prefill's rows are the
    same bits whatever its length (more query rows, e.g. padding, change no
    row's output); a decode call's rows match them to float rounding (on
    AMX, bfloat16 scores from key rows are the tiles' in both: the same lse);
    and both match PyTorch in float64."""
    if not isa_available(isa):
        pytest.skip(f"this CPU has no {isa}")
    B, H, Hkv, Lk, D, Dv = ROWS_CASES[case]
    torch.manual_seed(2)
    Lq = 72  # 64 + 8: the last block is short too
    q = torch.randn(B, H, Lq, D, dtype=torch.float64).to(dtype)
    k = torch.randn(B, Hkv, Lk, D, dtype=torch.float64).to(dtype)
    v = torch.randn(B, Hkv, Lk, Dv, dtype=torch.float64).to(dtype)
    kw = {}
    if masks == "causal+kpm":
        kpm = torch.zeros(B, Lk, dtype=torch.bool)
        kpm[-1, 5:9] = True
        kpm[0, Lk - 20 :] = True
        kw = dict(is_causal=True, key_padding_mask=kpm)
    elif masks == "float+head":
        kw = dict(attn_mask=torch.randn(Lq, Lk, dtype=torch.float64).to(dtype), head_mask=torch.rand(H).to(dtype))

    def call(n):  # the first n query rows
        kk = dict(kw)
        if "attn_mask" in kk:
            kk["attn_mask"] = kk["attn_mask"][:n]
        with torch.no_grad():
            return tma.functional.masked_attention(q[:, :, :n], k, v, return_lse=True, **kk)

    full_out, full_lse = run_isa(isa, lambda: call(Lq))
    for n in (65, 70):  # prefills whose last block is short: the tiles, bit for bit
        out, lse = run_isa(isa, lambda: call(n))
        assert torch.equal(out, full_out[:, :, :n]) and torch.equal(lse, full_lse[:, :, :n]), f"{isa} {dtype} n={n}"
    for n in (1, 3, 8, 16):
        out, lse = run_isa(isa, lambda: call(n))
        if isa not in TILE_ISAS:  # the decode kernel: to float rounding
            tol = {torch.float32: 2e-6, torch.float64: 1e-14}.get(dtype, 1e-2)
            torch.testing.assert_close(out, full_out[:, :, :n], rtol=tol, atol=tol)
            torch.testing.assert_close(lse, full_lse[:, :, :n], rtol=tol, atol=tol)
        else:  # the tiles' bfloat16 products round differently
            tol = 2e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(out, full_out[:, :, :n], rtol=tol, atol=tol)
            if isa == "amx" and dtype == torch.bfloat16 and D % 32 == 0:
                # the scores from key rows on the tiles (FN(tiles_rows_scores)): the tile path's, so the
                # same lse bit for bit (P V stays on the FMAs: the output to rounding)
                assert torch.equal(lse, full_lse[:, :, :n]), f"n={n}: {(lse - full_lse[:, :, :n]).abs().max()}"
    # the short path against PyTorch in float64 (its last rows 64..71 are a short block as well)
    ref = torch_reference(q, k, v, masks, kw)
    tol = {torch.float32: 2e-5, torch.float64: 1e-12}.get(dtype, 3e-2)
    torch.testing.assert_close(full_out.double(), ref, rtol=tol, atol=tol)
    out1, _ = run_isa(isa, lambda: call(1))
    torch.testing.assert_close(out1.double(), ref[:, :, :1], rtol=tol, atol=tol)


# (name, B, H, Hkv, L, D, dtype, options): more than 1 MB of Q, dO, dq rows per
# (b, kv head), so the shape rule takes 4 key blocks at a time; L off the blocks
KEY_GROUP_CASES = [
    ("causal+kpm D=128", 1, 1, 1, 1100, 128, torch.float32, dict(is_causal=True, kpm=True)),
    ("gqa causal+kpm", 1, 4, 2, 1500, 64, torch.float32, dict(is_causal=True, kpm=True)),
    ("8 items, no key chunks", 4, 4, 2, 1500, 64, torch.float32, dict(is_causal=True)),
    ("window", 1, 2, 2, 1300, 128, torch.float32, dict(window=(200, 0))),
    ("window both sides", 1, 2, 2, 1300, 128, torch.float32, dict(window=(150, 90))),
    ("full + head mask grad + softcap", 1, 2, 2, 1100, 128, torch.float32, dict(head_mask=True, softcap=20.0)),
    ("dropout", 1, 2, 1, 1100, 128, torch.float32, dict(is_causal=True, dropout_p=0.2)),
    ("bfloat16", 1, 2, 2, 1100, 128, torch.bfloat16, dict(is_causal=True)),
]


def _key_group_grads(isas):
    torch.manual_seed(0)
    out = {}
    for isa in isas:
        for name, B, H, Hkv, L, D, dt, o in KEY_GROUP_CASES:
            q = torch.randn(B, H, L, D).to(dt).requires_grad_()
            k, v = (torch.randn(B, Hkv, L, D).to(dt).requires_grad_() for _ in range(2))
            g = torch.randn(B, H, L, D).to(dt)
            kw = dict(
                is_causal=o.get("is_causal", False),
                window=o.get("window"),
                softcap=o.get("softcap"),
                dropout_p=o.get("dropout_p", 0.0),
            )
            if o.get("kpm"):
                kpm = torch.zeros(B, L, dtype=torch.bool)
                kpm[:, L - 130 :] = True
                kw["key_padding_mask"] = kpm
            hm = None
            if o.get("head_mask"):
                hm = torch.rand(H).requires_grad_()
                kw["head_mask"] = hm
            if kw["dropout_p"]:
                kw["dropout_seed"] = torch.tensor([7, 11], dtype=torch.int64)
            with use_isa(isa):
                y = tma.functional.masked_attention(q, k, v, **kw)
                inputs = (q, k, v) + ((hm,) if hm is not None else ())
                out[isa + " " + name] = torch.autograd.grad(y, inputs, g)
    return out


def test_key_groups_same_bits(eight_cpus):
    """The single-pass backward takes a chunk's key blocks several at a time
    where the query rows of an item outgrow L2 (ma_attn_bwd_key_group); each
    dq row still sums its key blocks in key order and each dk, dv row its
    query blocks in order, so the gradients must be bitwise those of one key
    block at a time (ops.bwd_key_group(1)) and of groups of 3 (a group left
    over at the end), in every variant this CPU has."""
    isas = [isa for isa in VARIANTS if isa_available(isa)]
    results = {}
    for n in (None, 1, 3):
        with bwd_key_group(n):
            results[n] = _key_group_grads(isas)
    assert len(results[None]) == len(KEY_GROUP_CASES) * len(isas)
    for n in (1, 3):
        for case, grads in results[None].items():
            for i, (a, b) in enumerate(zip(grads, results[n][case])):
                assert torch.equal(a, b), f"{case}: gradient {i} differs with bwd_key_group({n})"


@pytest.mark.parametrize("isa", VARIANTS)
def test_key_chunks_follow_the_cpu_count(isa):
    """The single-pass backward splits a head's keys into chunks so that there
    is a work item per CPU the process may run on, at least 8
    (ma_attn_bwd_kv_chunks), a count that never changes with the thread count.
    B * Hkv = 8 here and 5 key blocks: one chunk for 1 and 4 CPUs, 2 chunks
    for 16, 5 (one per key block) for 64 (ops.bwd_cpus forces the count).
    Whatever the count: any thread count gives the same bits; out, dk and dv
    are the same bits (one item writes each key block), dq the same bits
    where the chunk count is, and within the 2x rule of PyTorch's float32
    error against float64 where it is not."""
    if not isa_available(isa):
        pytest.skip(f"this CPU has no {isa}")
    torch.manual_seed(3)
    B, H, Hkv, L, D = 2, 8, 4, 300, 32
    q, k, v = torch.randn(B, H, L, D), torch.randn(B, Hkv, L, D), torch.randn(B, Hkv, L, D)
    g = torch.randn(B, H, L, D)
    threads = torch.get_num_threads()
    res = {}
    try:
        for cpus in (1, 4, 16, 64):
            for n in (1, 2):
                torch.set_num_threads(n)
                with bwd_cpus(cpus):
                    res[cpus, n] = run_isa(isa, lambda: fwd_bwd(q, k, v, g, is_causal=True))
    finally:
        torch.set_num_threads(threads)

    def torch_dq(dtype):
        qt, kt, vt = (t.to(dtype).requires_grad_() for t in (q, k, v))
        kt, vt = (t.repeat_interleave(H // Hkv, dim=1) for t in (kt, vt))
        return torch.autograd.grad(F.scaled_dot_product_attention(qt, kt, vt, is_causal=True), qt, g.to(dtype))[0]

    dq_ref, dq_torch = torch_dq(torch.float64), torch_dq(torch.float32)
    for cpus in (1, 4, 16, 64):
        for a, b in zip(res[cpus, 1], res[cpus, 2]):
            assert torch.equal(a, b), f"{cpus} CPUs: the thread count changed the bits"
        out, lse, dq, dk, dv = res[cpus, 1]
        for i in (0, 1, 3, 4):
            assert torch.equal(res[cpus, 1][i], res[1, 1][i]), f"{cpus} CPUs: output {i} changed"
        assert_close_ref(dq, dq_torch, dq_ref, name=f"dq, {cpus} CPUs", dtype=torch.float32)
    assert torch.equal(res[4, 1][2], res[1, 1][2])
    # the knob reaches the rule: another chunk count sums dq's key blocks in another order
    assert not torch.equal(res[16, 1][2], res[1, 1][2]) and not torch.equal(res[64, 1][2], res[16, 1][2])


# (B, H, Hkv, Lk, D, Dv, options) for runs of heads: H = 12 so that the takes
# (up to 16 items) end inside a batch entry and at its edge
RUN_CASES = {
    "mha": (3, 12, 12, 150, 64, 64, {}),
    "gqa Dv!=D": (2, 12, 4, 200, 64, 48, {}),
    "causal+kpm": (3, 12, 6, 150, 64, 64, dict(is_causal=True, kpm=True)),
    "head masks blocked": (2, 12, 12, 200, 32, 32, dict(bool_mask=True, head_mask=True)),
    "window+softcap+sinks": (2, 12, 4, 180, 64, 64, dict(window=(70, 0), softcap=15.0, sinks=True)),
    "dropout": (2, 12, 12, 130, 64, 64, dict(dropout_p=0.3)),
}


@pytest.mark.parametrize(
    "isa,dtype",
    [(isa, torch.float32) for isa in VARIANTS]
    + [(isa, torch.bfloat16) for isa in FMA_ISAS]
    + [("avx2", torch.float16), ("scalar", torch.float64)],
    ids=str,
)
@pytest.mark.parametrize("case", list(RUN_CASES))
@pytest.mark.parametrize("Lq", [1, 3, 8])
@pytest.mark.parametrize("threads", [1, 2])
def test_runs_of_heads_same_bits(isa, dtype, case, Lq, threads):
    """Decoding from a cache whose heads lie side by side in each row ((B, L,
    H, D) here, as (T, H, D) packed or paged) takes consecutive heads of a
    query block together, key block by key block; from a head-major (B, H, L,
    D) cache one head at a time. The same values either way, bit for bit,
    with every mask, GQA, dropout, and takes that end inside an entry."""
    if not isa_available(isa):
        pytest.skip(f"this CPU has no {isa}")
    B, H, Hkv, Lk, D, Dv, o = RUN_CASES[case]
    torch.manual_seed(5)
    q = torch.randn(B, H, Lq, D, dtype=torch.float64).to(dtype)
    k_rows = torch.randn(B, Lk, Hkv, D, dtype=torch.float64).to(dtype)  # heads side by side in a row
    v_rows = torch.randn(B, Lk, Hkv, Dv, dtype=torch.float64).to(dtype)
    k_side, v_side = k_rows.transpose(1, 2), v_rows.transpose(1, 2)
    k_major, v_major = k_side.contiguous(), v_side.contiguous()
    kw = {}
    if o.get("kpm"):
        kpm = torch.zeros(B, Lk, dtype=torch.bool)
        kpm[0, Lk - 40 :] = True
        kpm[-1, 3:70] = True  # a whole key block of entry B - 1 unread
        kw["key_padding_mask"] = kpm
    if o.get("is_causal"):
        kw["is_causal"] = True
    if o.get("bool_mask"):  # some heads' key blocks all blocked, others not
        am = torch.rand(B, H, Lq, Lk) > 0.3
        am[:, 0::2, :, :64] = False  # takes start at even heads
        am[0, 5, :, 64:128] = False
        am[:, :, :, -1] = True  # no row fully masked
        kw["attn_mask"] = am
    if o.get("head_mask"):
        kw["head_mask"] = torch.rand(H, dtype=torch.float64).to(dtype)
    if "window" in o:
        kw.update(window=o["window"], softcap=o["softcap"])
    if o.get("sinks"):
        kw["sinks"] = torch.randn(H, dtype=torch.float64).to(dtype)
    if "dropout_p" in o:
        kw.update(dropout_p=o["dropout_p"], dropout_seed=torch.tensor([1234, 7], dtype=torch.int64))

    def call(k, v):
        with torch.no_grad():
            return tma.functional.masked_attention(q, k, v, return_lse=True, **kw)

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out_side, lse_side = run_isa(isa, lambda: call(k_side, v_side))
        out_major, lse_major = run_isa(isa, lambda: call(k_major, v_major))
    finally:
        torch.set_num_threads(old)
    assert torch.isfinite(out_side).all()
    assert torch.equal(out_side, out_major), f"{(out_side - out_major).abs().max()}"
    assert torch.equal(lse_side, lse_major)


@pytest.mark.parametrize(
    "isa,dtype",
    [(isa, torch.float32) for isa in VARIANTS] + [(isa, torch.bfloat16) for isa in ISAS] + [("amx", torch.float16)],
    ids=str,
)
@pytest.mark.parametrize("Hkv", [8, 2])
def test_paged_decoding_runs_same_bits(isa, dtype, Hkv):
    """varlen_attn from a paged pool (pages, page_size, H_kv, D), the layout
    paged caches use (heads side by side in a row: runs of heads), against the
    same pages stored head-major within each page (one head at a time): the
    same bits, for one query per sequence, for 4 (speculative decoding) and
    for a prefill chunk of 70 (query blocks of 64 on the tile path: amx and
    avx512bf16 pack each page's rows for their products, then 6 rows)."""
    if not isa_available(isa):
        pytest.skip(f"this CPU has no {isa}")
    torch.manual_seed(6)
    N, H, D, page = 5, 8, 64, 64
    used = torch.tensor([200, 64, 1, 130, 256], dtype=torch.int32)
    n_pages = 4 * N
    table = torch.randperm(n_pages).view(N, 4).to(torch.int32)
    kp = torch.randn(n_pages, page, Hkv, D, dtype=torch.float64).to(dtype)
    vp = torch.randn(n_pages, page, Hkv, D, dtype=torch.float64).to(dtype)
    kp_major, vp_major = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (kp, vp))
    for lq in (1, 4, 70):
        q = torch.randn(N * lq, H, D, dtype=torch.float64).to(dtype)
        cu = torch.arange(0, N * lq + 1, lq, dtype=torch.int32)

        def call(k, v):
            with torch.no_grad():
                return tma.functional.varlen_attn(
                    q, k, v, cu, None, lq, 256, seqused_k=used, block_table=table, enable_gqa=Hkv != H
                )

        side = run_isa(isa, lambda: call(kp, vp))
        major = run_isa(isa, lambda: call(kp_major, vp_major))
        assert torch.isfinite(side).all()
        assert torch.equal(side, major), f"lq={lq}: {(side - major).abs().max()}"


@pytest.mark.parametrize("isa", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("D, Lk", [(64, 300), (40, 77), (128, 33), (64, 64)])
def test_decoding_rows_same_bits_as_prefill(isa, dtype, D, Lk):
    """A query attended alone (Lq = 1: the decoding path, one row against
    groups of keys) against the same query among 8 (the tiled path): within one
    key block (Lk <= 64) the same bits, every score being one FMA per d, in
    order, on both; past it the decode kernel's softmax steps are longer than
    the tiles' 64-key blocks (docs/design/05-attention-algorithm.md, "Bits"), so
    O is rescaled at other keys: within 2 ulps of the output's dtype. With GQA
    and key padding; D = 40 ends a cache line mid-block."""
    if not isa_available(isa):
        pytest.skip(f"this CPU has no {isa}")
    torch.manual_seed(11)
    q = torch.randn(2, 4, 8, D, dtype=torch.float64).to(dtype)
    k, v = (torch.randn(2, 2, Lk, D, dtype=torch.float64).to(dtype) for _ in range(2))
    kpm = torch.zeros(2, Lk, dtype=torch.bool)
    kpm[1, Lk // 3 :] = True

    def attend(qs):
        with torch.no_grad():
            return tma.functional.masked_attention(qs, k, v, key_padding_mask=kpm, return_lse=True)

    out, lse = run_isa(isa, lambda: attend(q))
    eps = torch.finfo(dtype).eps
    for i in range(q.size(2)):
        out_i, lse_i = run_isa(isa, lambda: attend(q[:, :, i : i + 1]))
        ref, ref_lse = out[:, :, i : i + 1], lse[:, :, i : i + 1]
        if Lk <= 64:
            assert torch.equal(out_i, ref), f"row {i}: {(out_i - ref).abs().max()}"
            assert torch.equal(lse_i, ref_lse)
        else:
            torch.testing.assert_close(out_i, ref, rtol=2 * eps, atol=2 * eps, msg=f"row {i}")
            torch.testing.assert_close(lse_i, ref_lse, rtol=4e-7, atol=4e-7, msg=f"row {i}")


def test_enum_names_come_from_c_in_enum_order():
    """_library reads the variants' and dtypes' names from the C library (common/isa.c), which must
    name every value of masked_attn.h's enums in order; tools/fuzz.py and conftest take
    ops.built_isas()."""
    import pathlib
    import re

    from torch_masked_attn import _library, ops

    header = (pathlib.Path(__file__).resolve().parents[2] / "csrc" / "masked_attn.h").read_text()
    isas = {int(n): name.lower() for name, n in re.findall(r"\bMA_ISA_(\w+) = (\d+)", header)}
    assert _library._ISAS == tuple(isas[i] for i in range(len(isas)))
    short = {"BOOL": "bool", "F32": "float32", "F64": "float64", "BF16": "bfloat16", "F16": "float16", "I8": "int8"}
    dts = {int(n): short[name] for name, n in re.findall(r"\bMA_(BOOL|F32|F64|BF16|F16|I8) = (\d+)", header)}
    assert _library._DTYPES == tuple(dts[i] for i in range(len(dts)))
    assert all(getattr(torch, _library._DTYPES[v]) is k for k, v in _library._MA_DTYPE.items())
    built = ops.built_isas()
    assert built[0] == "scalar" and set(built) <= set(_library._ISAS)
    assert all(ops.isa_available(n) <= (n in built) for n in _library._ISAS)
