"""Cross-entropy options beyond F.cross_entropy and the kernel variants:
z-loss, logit soft-capping, the opt-in in-place backward, the chunk op of the
fused linear cross-entropy, and every SIMD variant against the scalar
reference (MASKED_ATTN_ISA) and PyTorch.

The reference is the composition of native ops:
    y = softcap * tanh(x / softcap)                       (soft-capping)
    loss_row = F.cross_entropy(y, ..., reduction='none') + z_loss * logsumexp(y)^2 * kept
reduced as F.cross_entropy reduces ('mean': over the summed weight of the
kept rows, or the number of rows with probability targets).
"""

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch.autograd import gradcheck

import torch_masked_attn as tma
from conftest import FMA_ISAS, assert_close64, assert_close_ref, isa_available, run_isa

tmaF = tma.functional
ops = torch.ops.masked_attn
REDUCTIONS = ("none", "mean", "sum")
VARIANTS = FMA_ISAS  # cross-entropy has no bfloat16-product variants


def ref_cross_entropy(
    x, t, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0, z_loss=0.0, softcap=None
):
    """The composition of native ops that our options mean."""
    cdim = 0 if x.dim() == 1 else 1
    y = softcap * torch.tanh(x / softcap) if softcap else x
    ce = F.cross_entropy(
        y, t, weight=weight, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing
    )
    prob = t.is_floating_point()
    kept = torch.ones_like(ce, dtype=torch.bool) if prob else t != ignore_index
    if z_loss:
        ce = ce + z_loss * torch.logsumexp(y, cdim) ** 2 * kept
    if reduction == "none":
        return ce
    if reduction == "sum":
        return ce.sum()
    if prob:
        divisor = ce.numel()
    elif weight is None:
        divisor = kept.sum()
    else:
        divisor = torch.where(kept, weight[t.clamp(0, x.shape[cdim] - 1)], 0).sum()
    return ce.sum() / divisor


def _grads(fn, x, t, upstream, dtype, **kw):
    x = x.detach().to(dtype).requires_grad_()
    prob = t.is_floating_point()
    t = t.detach().to(dtype).requires_grad_() if prob else t
    w = kw.pop("weight", None)
    w = None if w is None else w.to(dtype)
    loss = fn(x, t, weight=w, **kw)
    (loss * upstream.to(dtype)).sum().backward()
    return [loss.detach(), x.grad] + ([t.grad] if prob else [])


def _compare(x, t, name, **kw):
    """ours vs the composition in x's dtype, both against the composition in float64."""
    reduction = kw.get("reduction", "mean")
    rows = tuple(x.shape[:1]) + tuple(x.shape[2:]) if x.dim() > 1 else ()
    upstream = torch.rand(rows if reduction == "none" else (), dtype=torch.float64) + 0.5
    ours = _grads(tmaF.cross_entropy, x, t, upstream, x.dtype, **dict(kw))
    theirs = _grads(ref_cross_entropy, x, t, upstream, x.dtype, **dict(kw))
    if x.dtype == torch.float64:
        for o, p, lab in zip(ours, theirs, ("loss", "grad_input", "grad_target")):
            assert_close64(o, p, name=f"{name} {lab}")
        return ours
    ref = _grads(ref_cross_entropy, x, t, upstream, torch.float64, **dict(kw))
    for o, p, r, lab in zip(ours, theirs, ref, ("loss", "grad_input", "grad_target")):
        assert o.dtype == p.dtype and o.shape == p.shape
        assert_close_ref(o, p, r, name=f"{name} {lab}")
    return ours


def _inputs(shape, kind, dtype, C):
    x = (torch.randn(shape, dtype=torch.float64) * 3).to(dtype)
    if kind == "prob":
        return x, torch.rand(shape, dtype=torch.float64).softmax(1).to(dtype)
    rows = shape[:1] + shape[2:]
    t = torch.randint(0, C, rows)
    t.view(-1)[::3] = -100
    return x, t


# ---------------------------------------------------------------------------
# z-loss and soft-capping: parity with the composition of native ops
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", (torch.float64, torch.float32, torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("shape", [(9, 37), (3, 11, 4), (4, 200)], ids=str)
@pytest.mark.parametrize("kind", ["index", "prob"])
def test_z_loss_and_softcap_parity(kind, shape, dtype):
    C = shape[1]
    x, t = _inputs(shape, kind, dtype, C)
    w = torch.rand(C, dtype=torch.float64) + 0.25
    for z, cap, ls, weight, reduction in itertools.product((0.0, 1e-2), (None, 4.0), (0.0, 0.2), (None, w), REDUCTIONS):
        if z == 0.0 and cap is None:
            continue  # plain F.cross_entropy: test_cross_entropy.py
        _compare(
            x,
            t,
            f"z={z} cap={cap} ls={ls} w={weight is not None} {reduction}",
            weight=weight,
            z_loss=z,
            softcap=cap,
            label_smoothing=ls,
            reduction=reduction,
        )


def test_softcap_extremes():
    """A cap far above the logits changes nothing; infinite logits are capped
    to +-cap (finite loss, zero gradient there); NaN propagates."""
    x = torch.randn(6, 50, dtype=torch.float64)
    t = torch.randint(0, 50, (6,))
    assert_close64(tmaF.cross_entropy(x, t, softcap=1e6), F.cross_entropy(x, t), rtol=1e-9, atol=1e-9)
    xi = x.clone()
    xi[0, 3], xi[1, 7], xi[2, 0] = float("inf"), float("-inf"), float("nan")
    xr = xi.clone().requires_grad_()
    loss = tmaF.cross_entropy(xr, t, softcap=5.0, reduction="none")
    loss.sum().backward()
    assert torch.isfinite(loss[:2]).all() and loss[2].isnan() and torch.isfinite(loss[3:]).all()
    assert xr.grad[0, 3] == 0 and xr.grad[1, 7] == 0
    _compare(xi[[0, 1, 3, 4]], t[[0, 1, 3, 4]], "inf", softcap=5.0, z_loss=1e-3, reduction="none")


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("kind", ["index", "prob"])
def test_gradcheck_options(kind, reduction):
    x, t = _inputs((4, 7), kind, torch.float64, 7)
    w = torch.rand(7, dtype=torch.float64) + 0.5
    for z, cap, ls, weight in ((1e-1, None, 0.0, None), (0.0, 2.0, 0.1, w), (5e-2, 3.0, 0.3, None)):
        if kind == "prob":

            def fn(x, p):
                return tmaF.cross_entropy(
                    x,
                    p,
                    weight=weight,
                    reduction=reduction,
                    label_smoothing=ls,
                    z_loss=z,
                    softcap=cap,
                )

            inputs = (x.clone().requires_grad_(), t.clone().requires_grad_())
        else:

            def fn(x):
                return tmaF.cross_entropy(
                    x,
                    t,
                    weight=weight,
                    reduction=reduction,
                    label_smoothing=ls,
                    z_loss=z,
                    softcap=cap,
                )

            inputs = (x.clone().requires_grad_(),)
        assert gradcheck(fn, inputs), f"z={z} cap={cap} ls={ls}"


def test_option_errors():
    x, t = torch.randn(3, 5), torch.tensor([0, 1, 2])
    for bad in (-1.0, float("nan"), float("inf"), "0.1", True):
        with pytest.raises(ValueError, match="z_loss"):
            tmaF.cross_entropy(x, t, z_loss=bad)
    for bad in (0.0, -2.0, float("inf"), "3"):
        with pytest.raises(ValueError, match="softcap"):
            tmaF.cross_entropy(x, t, softcap=bad)
    with pytest.raises(ValueError, match="softcap"):
        tma.CrossEntropyLoss(softcap=0)
    with pytest.raises(RuntimeError, match="z_loss"):
        ops.cross_entropy(x, t, None, "mean", -100, 0.0, -1.0)
    with pytest.raises(RuntimeError, match="softcap"):
        ops.cross_entropy(x, t, None, "mean", -100, 0.0, 0.0, -1.0)


def test_module_options():
    m = tma.CrossEntropyLoss(label_smoothing=0.1, z_loss=1e-3, softcap=10.0)
    assert (m.z_loss, m.softcap, m.inplace_backward) == (1e-3, 10.0, False)
    assert list(m.state_dict()) == list(torch.nn.CrossEntropyLoss().state_dict())
    x, t = torch.randn(5, 9, dtype=torch.float64), torch.randint(0, 9, (5,))
    assert_close64(m(x, t), ref_cross_entropy(x, t, label_smoothing=0.1, z_loss=1e-3, softcap=10.0))


# ---------------------------------------------------------------------------
# inplace_backward: the gradient overwrites the logits
# ---------------------------------------------------------------------------


def _lm_head(dtype=torch.float32, N=12, d=8, V=300):
    h = torch.randn(N, d, dtype=dtype, requires_grad=True)
    W = torch.randn(V, d, dtype=dtype, requires_grad=True)
    t = torch.randint(0, V, (N,))
    t[::4] = -100
    return h, W, t


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_inplace_backward_same_gradients_no_new_buffer(reduction):
    h, W, t = _lm_head()
    kw = dict(reduction=reduction, label_smoothing=0.1, z_loss=1e-3, softcap=20.0)
    logits = h @ W.T
    seen = []
    logits.register_hook(lambda g: seen.append(g))
    loss = tmaF.cross_entropy(logits, t, inplace_backward=True, **kw)
    g = torch.rand_like(loss)
    gh, gw = torch.autograd.grad((loss * g).sum(), (h, W))
    # the gradient reaching the logits is the logits' own storage
    assert seen[0].data_ptr() == logits.data_ptr()
    want = torch.autograd.grad((tmaF.cross_entropy(h @ W.T, t, **kw) * g).sum(), (h, W))
    assert torch.equal(gh, want[0]) and torch.equal(gw, want[1])
    assert logits._version > 0


def test_inplace_backward_guards():
    h, W, t = _lm_head()
    # a leaf would be overwritten with its own gradient: refused
    x = torch.randn(4, 300, requires_grad=True)
    with pytest.raises(ValueError, match="leaf"):
        tmaF.cross_entropy(x, t[:4].clamp(min=0), inplace_backward=True)
    # ... but fine without grad
    with torch.no_grad():
        tmaF.cross_entropy(x, t[:4].clamp(min=0), inplace_backward=True)
    # a second backward through the same graph sees the overwritten logits: it fails loudly
    logits = h @ W.T
    loss = tmaF.cross_entropy(logits, t, inplace_backward=True)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    # another node that saved the logits and runs after ours fails loudly too
    logits = h @ W.T
    loss = (logits * logits).sum() * 0 + tmaF.cross_entropy(logits, t, inplace_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    # expanded logits cannot be written in place
    with pytest.raises(RuntimeError, match="in place"):
        ops.cross_entropy(
            torch.randn(1, 300).expand(4, 300), t[:4].clamp(min=0), None, "mean", -100, 0.0, 0.0, None, True
        )


def test_inplace_backward_module_and_probabilities():
    h, W, t = _lm_head(torch.float64)
    m = tma.CrossEntropyLoss(inplace_backward=True, label_smoothing=0.2)
    (gh,) = torch.autograd.grad(m(h @ W.T, t), h)
    (want,) = torch.autograd.grad(F.cross_entropy(h @ W.T, t, label_smoothing=0.2), h)
    assert_close64(gh, want)
    p = torch.rand(12, 300, dtype=torch.float64, requires_grad=True)  # target grad wanted: out of place
    logits = h @ W.T
    loss = tmaF.cross_entropy(logits, p, inplace_backward=True)
    got = torch.autograd.grad(loss, (h, p))
    want = torch.autograd.grad(F.cross_entropy(h @ W.T, p), (h, p))
    assert_close64(got[0], want[0])
    assert_close64(got[1], want[1])


# ---------------------------------------------------------------------------
# the raw ops: opcheck, backward_ and chunk_ against forward + backward
# ---------------------------------------------------------------------------

OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("dtype", (torch.float64, torch.float32), ids=str)
def test_opcheck_options(dtype):
    x, t = _inputs((6, 21), "index", dtype, 21)
    w = (torch.rand(21) + 0.5).to(dtype)
    x.requires_grad_()
    for reduction, (z, cap) in itertools.product(REDUCTIONS, ((1e-2, None), (0.0, 3.0), (1e-3, 7.0))):
        args = (x, t, w, reduction, -100, 0.1, z, cap)
        torch.library.opcheck(ops.cross_entropy.default, args, test_utils=OPCHECK_UTILS)
        loss, lse = ops.cross_entropy(*(a.detach() if isinstance(a, torch.Tensor) else a for a in args))
        g = torch.rand_like(loss)
        torch.library.opcheck(
            ops.cross_entropy_backward.default,
            (g, x.detach(), t, w, lse, reduction, -100, 0.1, False, z, cap),
            test_utils=OPCHECK_UTILS,
        )
        torch.library.opcheck(
            ops.cross_entropy_backward_.default,
            (g, x.detach().clone(), t, w, lse, reduction, -100, 0.1, z, cap),
            test_utils=("test_schema", "test_faketensor"),
        )
    for scale in (None, 0.25):
        torch.library.opcheck(
            ops.cross_entropy_chunk_.default,
            (x.detach().clone(), t, w, scale, -100, 0.1, 1e-3, 5.0),
            test_utils=("test_schema", "test_faketensor"),
        )


@pytest.mark.parametrize("isa", VARIANTS)
@pytest.mark.parametrize("dtype", (torch.float64, torch.float32, torch.bfloat16), ids=str)
def test_backward_inplace_and_chunk_match_the_ops(dtype, isa):
    if not isa_available(isa):
        pytest.skip(f"this CPU has no {isa}")
    C = 1000
    x, t = _inputs((40, C), "index", dtype, C)
    w = (torch.rand(C) + 0.5).to(dtype)
    for weight, ls, z, cap in ((None, 0.0, 0.0, None), (w, 0.1, 1e-3, 15.0), (None, 0.3, 0.0, 2.0)):

        def go():
            loss, lse = ops.cross_entropy(x, t, weight, "none", -100, ls, z, cap)
            g = torch.rand_like(loss)
            gx, _ = ops.cross_entropy_backward(g, x, t, weight, lse, "none", -100, ls, False, z, cap)
            y = x.clone()
            ops.cross_entropy_backward_(g, y, t, weight, lse, "none", -100, ls, z, cap)
            chunk = x.clone()
            l2, lse2 = ops.cross_entropy_chunk_(chunk, t, weight, 0.5, -100, ls, z, cap)
            l3, lse3 = ops.cross_entropy_chunk_(x, t, weight, None, -100, ls, z, cap)  # forward only: x untouched
            gs, _ = ops.cross_entropy_backward(
                torch.full_like(loss, 0.5), x, t, weight, lse, "none", -100, ls, False, z, cap
            )
            return loss, lse, gx, y, l2, lse2, chunk, l3, lse3, gs

        loss, lse, gx, y, l2, lse2, chunk, l3, lse3, gs = run_isa(isa, go)
        assert torch.equal(y, gx)  # in place: the same bits as a new buffer
        assert torch.equal(lse2, lse) and torch.equal(lse3, lse)
        torch.testing.assert_close(
            l2, loss.to(l2.dtype), rtol=0, atol=0
        ) if dtype != torch.bfloat16 else torch.testing.assert_close(l2.to(dtype), loss)
        assert torch.equal(chunk, gs)  # the fused gradient = the backward's, same bits
        assert torch.equal(l3, l2)


# ---------------------------------------------------------------------------
# every SIMD variant against the scalar reference and PyTorch
# ---------------------------------------------------------------------------

SIMD_CASES = [  # (N, C): C around the vector widths (8, 16) and the blocks (32, 64, 128)
    (5, 1),
    (7, 15),
    (3, 16),
    (9, 17),
    (4, 127),
    (6, 128),
    (5, 129),
    (3, 1000),
    (2, 32000),
]


@pytest.mark.parametrize("isa", VARIANTS[1:])
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("NC", SIMD_CASES, ids=str)
def test_variant_matches_scalar_and_torch(NC, dtype, isa):
    if not isa_available(isa):
        pytest.skip(f"this CPU has no {isa}")
    N, C = NC
    x = (torch.randn(N, C, dtype=torch.float64) * 4).to(dtype)
    t = torch.randint(0, C, (N,))
    t[1::3] = -100
    w = torch.rand(C, dtype=torch.float64) + 0.5
    tol = {torch.float32: 3e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    for weight, ls, z, cap, reduction in (
        (None, 0.0, 0.0, None, "mean"),
        (w, 0.2, 0.0, None, "none"),
        (None, 0.1, 1e-2, 6.0, "sum"),
        (w, 0.0, 1e-3, 30.0, "none"),
    ):
        kw = dict(weight=weight, label_smoothing=ls, z_loss=z, softcap=cap, reduction=reduction)
        upstream = torch.rand(N if reduction == "none" else (), dtype=torch.float64) + 0.5
        ref = run_isa("scalar", lambda: _grads(tmaF.cross_entropy, x, t, upstream, dtype, **dict(kw)))
        got = run_isa(isa, lambda: _grads(tmaF.cross_entropy, x, t, upstream, dtype, **dict(kw)))
        name = f"{isa} N={N} C={C} {dtype} w={weight is not None} ls={ls} z={z} cap={cap}"
        for a, b, lab in zip(got, ref, ("loss", "grad")):
            torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol, msg=lambda m: f"{name} {lab}: {m}")
        run_isa(isa, lambda: _compare(x, t, name, **dict(kw)))


@pytest.mark.parametrize("isa", VARIANTS)
def test_variant_special_values(isa):
    """-inf logits, a fully -inf row, NaN and +inf: the same NaN pattern and
    values as PyTorch, and ignored rows with NaN never leak."""
    if not isa_available(isa):
        pytest.skip(f"this CPU has no {isa}")
    C = 70
    x = torch.randn(6, C, dtype=torch.float64) * 3
    x[0, ::3] = float("-inf")
    x[1] = float("-inf")
    x[2, 33] = float("nan")
    x[3, 40] = float("inf")
    x[4] = float("nan")  # ignored: must not leak
    t = torch.tensor([1, 2, 3, 4, -100, 6])
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        for ls, reduction in itertools.product((0.0, 0.1), ("none", "sum")):
            got = run_isa(
                isa,
                lambda: _grads(
                    tmaF.cross_entropy,
                    x,
                    t,
                    torch.ones(6 if reduction == "none" else ()),
                    dtype,
                    reduction=reduction,
                    label_smoothing=ls,
                ),
            )
            want = _grads(
                F.cross_entropy,
                x.to(dtype).double()[[0, 1, 2, 3, 5]],
                t[[0, 1, 2, 3, 5]],
                torch.ones(5 if reduction == "none" else ()),
                torch.float64,
                reduction=reduction,
                label_smoothing=ls,
            )
            if reduction == "none":
                keep = [0, 1, 2, 3, 5]
                assert torch.equal(got[0][keep].double().isnan(), want[0].isnan())
                assert got[0][4] == 0
            assert torch.equal(got[1][4], torch.zeros(C, dtype=dtype))
            assert torch.equal(got[1][[0, 1, 2, 3, 5]].double().isnan(), want[1].isnan())
            fin = torch.isfinite(want[1])
            torch.testing.assert_close(
                got[1][[0, 1, 2, 3, 5]].double()[fin],
                want[1][fin],
                rtol=2e-2 if dtype == torch.bfloat16 else 1e-5,
                atol=1e-5,
            )


@pytest.mark.parametrize("isa", VARIANTS[1:])
def test_variant_large_vocabulary_accuracy(isa):
    """128k classes and logits offset by 1e3: the float32 lanes carried in
    double keep the loss as accurate as PyTorch's."""
    if not isa_available(isa):
        pytest.skip(f"this CPU has no {isa}")
    x = torch.randn(4, 128256, dtype=torch.float64) * 2 + 1000
    t = torch.randint(0, 128256, (4,))
    run_isa(isa, lambda: _compare(x.float(), t, f"{isa} 128k", label_smoothing=0.1, reduction="none"))


@pytest.mark.parametrize("isa", VARIANTS)
def test_variant_deterministic_across_thread_counts(isa):
    if not isa_available(isa):
        pytest.skip(f"this CPU has no {isa}")
    x = torch.randn(300, 2000)
    t = torch.randint(0, 2000, (300,))
    t[::7] = -100
    before = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(
                run_isa(
                    isa,
                    lambda: _grads(
                        tmaF.cross_entropy,
                        x,
                        t,
                        torch.ones(()),
                        torch.float32,
                        label_smoothing=0.1,
                        z_loss=1e-3,
                        softcap=9.0,
                    ),
                )
            )
    finally:
        torch.set_num_threads(before)
    for r in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r, results[0]))
