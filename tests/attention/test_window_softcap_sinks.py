"""Sliding windows, logit soft-capping and attention sinks in masked_attention.

* values and every gradient (q, k, v, sinks, float attn_mask and
  key_padding_mask, head_mask) against a float64 reference built from plain
  torch ops, with flash-attention's rule (PyTorch's own float32 error on the
  same reference as the yardstick): lengths 1, 63, 64, 65, Lq != Lk, GQA,
  every window shape, softcap, sinks, combined with causal + key padding +
  attn_mask + head_mask; the backward with and without a gradient on the weights;
* gradcheck in float64, opcheck on the ops with these arguments;
* every ISA against scalar;
* structural identities, bit for bit: a window reaching every key is no
  window, (None, 0) is is_causal, a window equals the same mask given as a
  bool attn_mask;
* block skipping really skips: NaN in k, v of key blocks outside the
  window of a query block never reaches it, and keys outside every window
  are never read;
* bad input raises clear errors.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.autograd import gradcheck

import torch_masked_attn as tma
from conftest import ISAS, SIMD_ISAS, assert_close_ref, isa_available, run_isa
from reference import attention64, band_blocked

tmaF = tma.functional
NEG = float("-inf")


def _rand(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, dtype=torch.float64) * scale).to(dtype)


def ref(q, k, v, *, causal=False, dtype=torch.float64, need_weights=False, **opts):
    """The reference (tests/reference.py) in ``dtype`` with this file's names: (out, lse[, weights]);
    a row with nothing allowed gives 0 (lse = the sink or -inf)."""
    out, w, lse = attention64(q, k, v, is_causal=causal, dtype=dtype, return_weights=True, return_lse=True, **opts)
    return (out, lse, w) if need_weights else (out, lse)


def _inputs(B, H, Hkv, Lq, Lk, D, *, causal, window, softcap, sinks, am, kpm, hm, dtype=torch.float32, diagonal=0):
    """Random inputs and masks; the float ones require grad."""
    q = _rand(B, H, Lq, D, dtype=dtype).requires_grad_()
    k = _rand(B, Hkv, Lk, D, dtype=dtype).requires_grad_()
    v = _rand(B, Hkv, Lk, D, dtype=dtype).requires_grad_()
    kw = dict(causal=causal, window=window, softcap=softcap, diagonal=diagonal)
    kw["sinks"] = _rand(H, dtype=dtype).requires_grad_() if sinks else None
    if am == "float":
        m = _rand(B, 1, Lq, Lk, dtype=dtype)
        m = m.masked_fill(torch.rand(B, 1, Lq, Lk) < 0.2, NEG)
        kw["attn_mask"] = m.requires_grad_()
    elif am == "bool":
        kw["attn_mask"] = torch.rand(B, H, Lq, Lk) < 0.2
    if kpm == "bool":
        m = torch.zeros(B, Lk, dtype=torch.bool)
        m[:, Lk - Lk // 4 :] = True  # trailing padding
        m[:, 1] = Lk > 2
        kw["key_padding_mask"] = m
    elif kpm == "float":
        kw["key_padding_mask"] = _rand(B, Lk, dtype=dtype).requires_grad_()
    if hm:
        kw["head_mask"] = torch.rand(H, dtype=torch.float64).to(dtype).requires_grad_()
    return q, k, v, kw


def _ours(q, k, v, kw, need_weights=False):
    res = tmaF.masked_attention(
        q,
        k,
        v,
        attn_mask=kw.get("attn_mask"),
        key_padding_mask=kw.get("key_padding_mask"),
        head_mask=kw.get("head_mask"),
        is_causal=kw["causal"],
        window=kw["window"],
        softcap=kw["softcap"],
        sinks=kw["sinks"],
        diagonal=kw["diagonal"],
        need_weights=need_weights,
        return_lse=True,
    )
    return res


def _leaves(q, k, v, kw):
    named = [("q", q), ("k", k), ("v", v)]
    for name in ("sinks", "attn_mask", "key_padding_mask", "head_mask"):
        t = kw.get(name)
        if isinstance(t, torch.Tensor) and t.requires_grad:
            named.append((name, t))
    return named


def _grads(outs, gouts, leaves):
    gs = torch.autograd.grad(outs, [t for _, t in leaves], gouts, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for g, (_, t) in zip(gs, leaves)]


def check_against_ref(B, H, Hkv, Lq, Lk, D, *, need_weights=False, dtype=torch.float32, **opts):
    q, k, v, kw = _inputs(B, H, Hkv, Lq, Lk, D, dtype=dtype, **opts)
    leaves = _leaves(q, k, v, kw)
    names = ("attn_mask", "key_padding_mask", "head_mask", "causal", "window", "softcap", "sinks", "diagonal")
    rkw = {n: kw.get(n) for n in names}
    ours = _ours(q, k, v, kw, need_weights)
    ref64 = ref(q, k, v, **rkw, need_weights=need_weights)
    pt = ref(q, k, v, **rkw, dtype=dtype, need_weights=need_weights)  # PyTorch's own error, in dtype
    out, lse = ours[0], ours[-1]
    assert_close_ref(out, pt[0].to(dtype), ref64[0], name="out")
    assert_close_ref(lse, pt[1].float() if dtype != torch.float64 else pt[1], ref64[1], name="lse", dtype=dtype)
    g = _rand(*out.shape, dtype=dtype)
    outs_o, outs_r, outs_p, gouts = [out], [ref64[0]], [pt[0]], [g]
    if need_weights:
        assert_close_ref(ours[1], pt[2].to(dtype), ref64[2], name="weights")
        gw = _rand(*ours[1].shape, dtype=dtype)
        outs_o.append(ours[1]), outs_r.append(ref64[2]), outs_p.append(pt[2]), gouts.append(gw)
    go = _grads(outs_o, gouts, leaves)
    gr = _grads(outs_r, [x.double() for x in gouts], leaves)
    gp = _grads(outs_p, gouts, leaves)
    for (name, _), a, r, p in zip(leaves, go, gr, gp):
        assert_close_ref(a, p.to(a.dtype), r, name=f"d{name}", dtype=dtype)


# ---- values and gradients against the float64 reference ------------------------

SHAPES = [  # B, H, Hkv, Lq, Lk, D
    (1, 1, 1, 1, 1, 8),
    (2, 2, 2, 63, 63, 16),
    (1, 2, 1, 64, 64, 16),
    (2, 2, 2, 65, 65, 8),
    (1, 4, 2, 70, 150, 16),  # Lq < Lk, GQA
    (1, 2, 2, 150, 70, 16),  # Lq > Lk
    (1, 2, 1, 200, 200, 32),  # several key blocks outside the windows
]
WINDOWS = [(5, None), (None, 3), (7, 2), (0, 0), (0, None), (None, 0), (64, 0), (70, 65), (1000, 1000)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("window", WINDOWS, ids=str)
def test_window_values_and_grads(shape, window):
    check_against_ref(*shape, causal=False, window=window, softcap=None, sinks=False, am=None, kpm=None, hm=False)


# the diagonal (query i's is key i + d): bottom-right (Lk - Lq), a cache's offset, one below
# the top-left; causal or a window about it, and rows whose band holds no key
DIAGONALS = ["bottom-right", 5, -7]


# the last two: the decode kernel (at most 16 query rows), over several key chunks
DIAGONAL_SHAPES = [(1, 4, 2, 70, 150, 16), (1, 2, 2, 150, 70, 16), (2, 2, 1, 65, 65, 8), (1, 8, 2, 3, 1100, 32)]


@pytest.mark.parametrize("shape", DIAGONAL_SHAPES, ids=str)
@pytest.mark.parametrize("diagonal", DIAGONALS, ids=str)
@pytest.mark.parametrize("causal,window", [(True, None), (True, (20, None)), (False, (9, 3)), (False, (None, 0))])
def test_diagonal_values_and_grads(shape, diagonal, causal, window):
    d = shape[4] - shape[3] if diagonal == "bottom-right" else diagonal
    check_against_ref(
        *shape, causal=causal, window=window, softcap=None, sinks=False, am=None, kpm="bool", hm=False, diagonal=d
    )


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("what", ["softcap", "sinks", "softcap+sinks"])
def test_softcap_sinks_values_and_grads(shape, what):
    check_against_ref(
        *shape,
        causal=False,
        window=None,
        softcap=1.5 if "softcap" in what else None,
        sinks="sinks" in what,
        am=None,
        kpm=None,
        hm=False,
    )


COMBINED = [  # window, causal, softcap, sinks, attn_mask, key_padding_mask, head_mask
    ((20, None), True, 2.0, True, "float", "bool", True),
    ((None, 9), False, 0.7, True, "bool", "float", True),
    ((3, 5), False, 4.0, True, "float", "float", True),
    ((100, 0), True, None, True, "bool", "bool", False),
    ((0, 0), True, 1.0, True, "float", "bool", True),
    (None, True, 3.0, True, "float", "bool", True),
]


@pytest.mark.parametrize(
    "shape",
    [(2, 2, 1, 65, 65, 16), (1, 4, 2, 130, 200, 16), (2, 2, 2, 200, 130, 8)],
    ids=lambda s: "x".join(map(str, s)),
)
@pytest.mark.parametrize("combo", COMBINED, ids=str)
@pytest.mark.parametrize("need_weights", [False, True], ids=["plain", "grad_weights"])
def test_combined(shape, combo, need_weights):
    window, causal, softcap, sinks, am, kpm, hm = combo
    check_against_ref(
        *shape,
        causal=causal,
        window=window,
        softcap=softcap,
        sinks=sinks,
        am=am,
        kpm=kpm,
        hm=hm,
        need_weights=need_weights,
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_dtypes(dtype):
    check_against_ref(
        2,
        2,
        1,
        130,
        130,
        16,
        dtype=dtype,
        causal=True,
        window=(40, None),
        softcap=2.0,
        sinks=True,
        am=None,
        kpm="bool",
        hm=True,
    )


def test_fully_masked_row_with_sink():
    """A row that sees no key: out 0, lse = the sink, gradients 0 and finite."""
    q, k, v = (_rand(1, 2, 70, 8).requires_grad_() for _ in range(3))
    sinks = torch.tensor([0.5, -1.0], requires_grad=True)
    am = torch.zeros(70, 70, dtype=torch.bool)
    am[3] = True  # row 3 sees nothing
    am[66] = True  # row 66 too (second query block)
    out, lse = tmaF.masked_attention(q, k, v, attn_mask=am, sinks=sinks, window=(10, 10), return_lse=True)
    for r in (3, 66):
        assert torch.equal(out[:, :, r], torch.zeros_like(out[:, :, r]))
        assert torch.equal(lse[0, :, r], sinks.detach())
    (out * _rand(*out.shape)).sum().backward()
    for t in (q, k, v, sinks):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[:, :, 3], torch.zeros_like(q.grad[:, :, 3]))
    # no key at all (Lk = 0): lse is the sink in every row
    out, lse = tmaF.masked_attention(
        q.detach(), k.detach()[:, :, :0], v.detach()[:, :, :0], sinks=sinks.detach(), return_lse=True
    )
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(lse, sinks.detach()[None, :, None].expand_as(lse))


# ---- gradcheck, opcheck ------------------------------------------------------------


@pytest.mark.parametrize(
    "case",
    [
        dict(L=(9, 11), window=(2, 1), causal=False),
        dict(L=(11, 9), window=(3, None), causal=True),
        dict(L=(150, 150), window=(20, 0), causal=False),
    ],
    ids=["small", "small_causal", "skipping"],
)
def test_gradcheck(case):
    Lq, Lk = case["L"]
    D, H = (2, 2) if Lq > 64 else (4, 2)
    d = torch.float64
    q = _rand(1, H, Lq, D, dtype=d).requires_grad_()
    k = _rand(1, 1, Lk, D, dtype=d).requires_grad_()
    v = _rand(1, 1, Lk, D, dtype=d).requires_grad_()
    sinks = _rand(H, dtype=d).requires_grad_()
    am = _rand(1, 1, Lq, Lk, dtype=d).requires_grad_()
    hm = torch.rand(H, dtype=d).requires_grad_()

    def f(q, k, v, sinks, am, hm):
        out, lse = tmaF.masked_attention(
            q,
            k,
            v,
            attn_mask=am,
            head_mask=hm,
            is_causal=case["causal"],
            window=case["window"],
            softcap=1.3,
            sinks=sinks,
            return_lse=True,
        )
        return out

    assert gradcheck(f, (q, k, v, sinks, am, hm), fast_mode=Lq > 64)

    def fw(q, k, v, sinks):  # the weights receive a gradient
        out, w = tmaF.masked_attention(
            q, k, v, window=case["window"], is_causal=case["causal"], softcap=1.3, sinks=sinks, need_weights=True
        )
        return out, w

    assert gradcheck(fw, (q, k, v, sinks), fast_mode=True)


def test_opcheck():
    q, k, v = _rand(1, 2, 70, 8), _rand(1, 1, 70, 8), _rand(1, 1, 70, 8)
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    sinks = _rand(2).requires_grad_()
    am = _rand(1, 1, 70, 70)
    fwd = torch.ops.masked_attn.forward.default
    opts = dict(window_left=5, window_right=7, softcap=2.0, sinks=sinks)
    torch.library.opcheck(fwd, (q, k, v, am, None, None, True, None, False), dict(opts, window_left=30))
    torch.library.opcheck(fwd, (q, k, v, None, None, None, False, 0.3, True), dict(opts, softcap=None))
    out, lse, _, _ = fwd(q, k, v, am, None, None, False, None, False, **opts)
    opts["sinks"] = sinks.detach()
    g = _rand(*out.shape)
    bwd = torch.ops.masked_attn.backward.default
    torch.library.opcheck(
        bwd,
        (
            g,
            None,
            q.detach(),
            k.detach(),
            v.detach(),
            out.detach(),
            lse,
            am,
            None,
            None,
            False,
            None,
            False,
            False,
        ),
        opts,
    )
    into = torch.ops.masked_attn.backward_into.default
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    torch.library.opcheck(
        into,
        (
            g,
            None,
            q.detach(),
            k.detach(),
            v.detach(),
            out.detach(),
            lse,
            am,
            None,
            None,
            False,
            None,
            False,
            False,
            dq,
            dk,
            dv,
        ),
        opts,
    )


# ---- every ISA against scalar ------------------------------------------------------


@pytest.mark.parametrize("isa", SIMD_ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("need_weights", [False, True], ids=["plain", "grad_weights"])
@pytest.mark.parametrize("diagonal", [0, 64], ids=["top_left", "bottom_right"])
def test_isa_against_scalar(isa, dtype, need_weights, diagonal):
    if not isa_available(isa):
        pytest.skip(f"this CPU has no {isa}")
    q, k, v, kw = _inputs(
        2,
        4,
        2,
        133,
        197,
        24,
        dtype=dtype,
        causal=False,
        window=(50, 17),
        softcap=2.5,
        sinks=True,
        am="float",
        kpm="bool",
        hm=True,
        diagonal=diagonal,
    )
    leaves = _leaves(q, k, v, kw)
    res = {}
    for name in ("scalar", isa):

        def run():
            outs = _ours(q, k, v, kw, need_weights)
            gouts = [torch.ones_like(outs[0]) * 0.1 + torch.arange(outs[0].shape[-1]) * 0.01]
            if need_weights:
                gouts.append(torch.full_like(outs[1], 0.05))
            return [outs[0], outs[-1]] + _grads(list(outs[: len(gouts)]), gouts, leaves)

        res[name] = [t.detach().double() for t in run_isa(name, run)]
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    for i, (a, b) in enumerate(zip(res["scalar"], res[isa])):
        torch.testing.assert_close(b, a, atol=tol, rtol=tol, msg=f"output {i}")


# ---- bitwise identities ---------------------------------------------------------------


@pytest.mark.parametrize("isa", ["scalar", "avx2"])
def test_identities_bitwise(isa):
    if not isa_available(isa):
        pytest.skip(f"this CPU has no {isa}")
    L = 200
    q, k, v = _rand(1, 2, L, 16), _rand(1, 2, L, 16), _rand(1, 2, L, 16)

    def run(**kw):
        return run_isa(isa, lambda: tmaF.masked_attention(q, k, v, return_lse=True, **kw))

    # a window that reaches every key is no window
    assert all(torch.equal(a, b) for a, b in zip(run(window=(L, L)), run()))
    assert all(torch.equal(a, b) for a, b in zip(run(window=(None, 0)), run(is_causal=True)))
    # a window is the same mask given as a bool attn_mask, bit for bit
    for window, causal in [((40, 0), False), ((30, 70), False), ((None, 5), False), ((70, None), True)]:
        blocked = band_blocked(L, L, is_causal=causal, window=window)
        a = run(window=window, is_causal=causal)
        b = run(attn_mask=blocked)
        assert all(torch.equal(x, y) for x, y in zip(a, b)), (window, causal)
    # so is a band about another diagonal (rows whose band is empty: 0, lse -inf, in both)
    for window, causal, d in [(None, True, -20), ((30, 5), False, 37), ((12, None), True, 90), ((None, 0), False, -3)]:
        blocked = band_blocked(L, L, is_causal=causal, window=window, diagonal=d)
        a = run(window=window, is_causal=causal, diagonal=d)
        b = run(attn_mask=blocked)
        assert all(torch.equal(x, y) for x, y in zip(a, b)), (window, causal, d)


def test_sdpa_keywords():
    q, k, v = _rand(2, 4, 70, 8), _rand(2, 4, 70, 8), _rand(2, 4, 70, 8)
    sinks = _rand(4)
    a = tmaF.scaled_dot_product_attention(q, k, v, is_causal=True, window=(10, 0), softcap=3.0, sinks=sinks)
    b = tmaF.masked_attention(q, k, v, is_causal=True, window=(10, 0), softcap=3.0, sinks=sinks)
    assert torch.equal(a, b)
    # without the extensions it still matches PyTorch's F.sdpa with the window as a bool mask
    allowed = ~band_blocked(70, 70, window=(10, 3))
    torch.testing.assert_close(
        tmaF.scaled_dot_product_attention(q, k, v, window=(10, 3)),
        F.scaled_dot_product_attention(q, k, v, attn_mask=allowed),
        atol=2e-6,
        rtol=2e-6,
    )


# ---- block skipping really skips ----------------------------------------------------------


@pytest.mark.parametrize("isa", ISAS)
def test_skipped_blocks_are_not_read(isa):
    """Causal window of 64 at L = 256: the query blocks from 128 on see key
    blocks 1.. only, so NaN in block 0's k and v must not reach them (if that
    tile were computed, P = 0 times NaN in v would). Keys after the last
    query's window (Lk > Lq) are never read at all: NaN there reaches
    nothing and their dk, dv are 0."""
    if not isa_available(isa):
        pytest.skip(f"this CPU has no {isa}")
    L = 256
    q, k, v = _rand(1, 2, L, 16), _rand(1, 2, L, 16), _rand(1, 2, L, 16)
    k[:, :, :64] = float("nan")
    v[:, :, :64] = float("nan")
    for need_weights in (False, True):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))

        def run():
            res = tmaF.masked_attention(qq, kk, vv, window=(64, 0), need_weights=need_weights)
            out = res[0] if need_weights else res
            loss = out[:, :, 128:].sum() + (res[1][:, :, 128:].sum() if need_weights else 0)
            loss.backward()
            return out

        out = run_isa(isa, run)
        assert torch.isfinite(out[:, :, 128:]).all()
        assert out[:, :, :128].isnan().any()  # the poison is really there for the rows that see it
        assert torch.isfinite(qq.grad[:, :, 128:]).all()
        assert torch.isfinite(kk.grad[:, :, 128:]).all() and torch.isfinite(vv.grad[:, :, 128:]).all()

    # keys after every window: Lq = 64, right = 10 -> keys from 74 on are seen by no query
    q2 = _rand(1, 2, 64, 16).requires_grad_()
    k2, v2 = _rand(1, 2, 200, 16), _rand(1, 2, 200, 16)
    k2[:, :, 74:] = float("inf")
    v2[:, :, 74:] = float("nan")
    k2.requires_grad_(), v2.requires_grad_()

    def run2():
        out = tmaF.masked_attention(q2, k2, v2, window=(None, 10), sinks=torch.zeros(2))
        out.sum().backward()
        return out

    out = run_isa(isa, run2)
    assert torch.isfinite(out).all() and torch.isfinite(q2.grad).all()
    assert torch.equal(k2.grad[:, :, 74:], torch.zeros_like(k2.grad[:, :, 74:]))
    assert torch.equal(v2.grad[:, :, 74:], torch.zeros_like(v2.grad[:, :, 74:]))
    assert torch.isfinite(k2.grad).all() and torch.isfinite(v2.grad).all()


# ---- bad input --------------------------------------------------------------------------------


def test_bad_input():
    q, k, v = _rand(1, 2, 8, 4), _rand(1, 2, 8, 4), _rand(1, 2, 8, 4)
    f = tmaF.masked_attention
    with pytest.raises(ValueError, match="window left must be >= 0"):
        f(q, k, v, window=(-2, 0))
    with pytest.raises(ValueError, match="window right"):
        f(q, k, v, window=(0, -5))
    with pytest.raises(TypeError, match="window must be None or a pair"):
        f(q, k, v, window=3)
    with pytest.raises(TypeError, match="window must be None or a pair"):
        f(q, k, v, window=(1, 2, 3))
    with pytest.raises(TypeError, match="window left must be an int"):
        f(q, k, v, window=(1.5, 2))
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="softcap must be None or a finite number > 0"):
            f(q, k, v, softcap=bad)
    with pytest.raises(TypeError, match="softcap"):
        f(q, k, v, softcap="1")
    with pytest.raises(ValueError, match=r"sinks must have shape \(H,\) = \(2,\)"):
        f(q, k, v, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="sinks must have shape"):
        f(q, k, v, sinks=torch.zeros(1, 2))
    with pytest.raises(TypeError, match="sinks must be floating point"):
        f(q, k, v, sinks=torch.zeros(2, dtype=torch.long))
    with pytest.raises(TypeError, match="sinks must be None or a Tensor"):
        f(q, k, v, sinks=[0.0, 0.0])
    with pytest.raises(ValueError, match="sinks must be on q's device"):
        f(q, k, v, sinks=torch.zeros(2, device="meta"))
    with pytest.raises(ValueError, match="window left"):
        tmaF.scaled_dot_product_attention(q, k, v, window=(-3, 0))
    # the raw op checks too, naming the argument
    fwd = torch.ops.masked_attn.forward
    with pytest.raises(RuntimeError, match="window_left must be -1"):
        fwd(q, k, v, None, None, None, False, None, False, window_left=-4, window_right=0)
    with pytest.raises(RuntimeError, match="window_right must be -1"):
        fwd(q, k, v, None, None, None, False, None, False, window_left=0, window_right=-4)
    with pytest.raises(RuntimeError, match="softcap must be None or a finite number > 0"):
        fwd(q, k, v, None, None, None, False, None, False, softcap=-2.0)
    with pytest.raises(RuntimeError, match=r"sinks must have shape \(H,\)"):
        fwd(q, k, v, None, None, None, False, None, False, sinks=torch.zeros(5))
    with pytest.raises(RuntimeError, match="sinks must be floating point"):
        fwd(q, k, v, None, None, None, False, None, False, sinks=torch.zeros(2, dtype=torch.int32))
