"""torch_masked_attn.functional.linear_cross_entropy and LinearCrossEntropyLoss:
the chunked fused linear cross-entropy.

Reference: the composition of native ops,
    logits = F.linear(input, weight, bias); y = softcap * tanh(logits / softcap)
    loss_row = F.cross_entropy(y, target, reduction='none', ...) + z_loss * logsumexp(y)^2 * kept
reduced over the kept rows. Values and the gradients of input, weight and
bias, for every option, every reduction, several chunk sizes; float64 tight
(and gradcheck), float32 / bfloat16 by flash-attention's 2x rule.
"""

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch.autograd import gradcheck

import torch_masked_attn as tma
from conftest import FMA_ISAS, assert_close64, assert_close_ref, isa_available, run_isa

lce = tma.functional.linear_cross_entropy
REDUCTIONS = ("mean", "sum", "none")


def ref_lce(h, W, t, b=None, ignore_index=-100, reduction="mean", label_smoothing=0.0, z_loss=0.0, softcap=None):
    logits = F.linear(h, W, b)
    y = softcap * torch.tanh(logits / softcap) if softcap else logits
    y2, t2 = y.reshape(-1, y.shape[-1]), t.reshape(-1)
    ce = F.cross_entropy(y2, t2, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing)
    kept = t2 != ignore_index
    if z_loss:
        ce = ce + z_loss * torch.logsumexp(y2, -1) ** 2 * kept
    if reduction == "none":
        return ce.reshape(t.shape)
    return ce.sum() / kept.sum() if reduction == "mean" else ce.sum()


def _make(N, d, V, dtype, bias, ignore_every=4, ignore_index=-100):
    h = torch.randn(N, d, dtype=torch.float64).to(dtype)
    W = (torch.randn(V, d, dtype=torch.float64) / d**0.5).to(dtype)
    b = (torch.randn(V, dtype=torch.float64) * 0.1).to(dtype) if bias else None
    t = torch.randint(0, V, (N,))
    if ignore_every:
        t[::ignore_every] = ignore_index
    return h, W, b, t


def _run(fn, h, W, b, t, upstream, dtype, **kw):
    """loss and the gradients of sum(loss * upstream) w.r.t. input, weight (and bias)."""
    leaves = [h.detach().to(dtype).requires_grad_(), W.detach().to(dtype).requires_grad_()]
    if b is not None:
        leaves.append(b.detach().to(dtype).requires_grad_())
    loss = fn(leaves[0], leaves[1], t, leaves[2] if b is not None else None, **kw)
    grads = torch.autograd.grad((loss * upstream.to(dtype)).sum(), leaves)
    return [loss.detach(), *grads]


LABELS = ("loss", "grad_input", "grad_weight", "grad_bias")


def _compare(h, W, b, t, name, chunk_size=None, **kw):
    dtype = h.dtype
    upstream = torch.rand(t.shape if kw.get("reduction") == "none" else (), dtype=torch.float64) + 0.5
    ours = _run(lambda *a, **k: lce(*a, chunk_size=chunk_size, **k), h, W, b, t, upstream, dtype, **kw)
    theirs = _run(ref_lce, h, W, b, t, upstream, dtype, **kw)
    if dtype == torch.float64:
        for o, p, lab in zip(ours, theirs, LABELS):
            assert o.dtype == p.dtype and o.shape == p.shape, f"{name} {lab}"
            assert_close64(o, p, name=f"{name} {lab}", rtol=1e-9, atol=1e-10)
        return
    ref = _run(ref_lce, h, W, b, t, upstream, torch.float64, **kw)
    for o, p, r, lab in zip(ours, theirs, ref, LABELS):
        assert o.dtype == p.dtype and o.shape == p.shape, f"{name} {lab}"
        assert_close_ref(o, p, r, name=f"{name} {lab}")


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("bias", [False, True])
def test_parity_every_option_float64(bias, reduction):
    h, W, b, t = _make(29, 12, 97, torch.float64, bias)
    for ls, z, cap, chunk in itertools.product((0.0, 0.15), (0.0, 1e-2), (None, 3.0), (None, 1, 7)):
        _compare(
            h,
            W,
            b,
            t,
            f"ls={ls} z={z} cap={cap} chunk={chunk}",
            chunk_size=chunk,
            reduction=reduction,
            label_smoothing=ls,
            z_loss=z,
            softcap=cap,
        )


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_parity_low_precision(reduction, dtype):
    h, W, b, t = _make(300, 64, 1000, dtype, True)
    for ls, z, cap, chunk in ((0.0, 0.0, None, None), (0.1, 1e-3, 30.0, 64), (0.0, 0.0, None, 37)):
        _compare(
            h,
            W,
            b,
            t,
            f"{dtype} ls={ls} z={z} cap={cap} chunk={chunk}",
            chunk_size=chunk,
            reduction=reduction,
            label_smoothing=ls,
            z_loss=z,
            softcap=cap,
        )


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_gradcheck(reduction):
    h, W, b, t = _make(7, 4, 11, torch.float64, True, ignore_every=3)
    for ls, z, cap, chunk in ((0.0, 0.0, None, None), (0.2, 5e-2, 2.0, 2), (0.0, 1e-1, None, 3)):

        def fn(h, W, b):
            return lce(
                h,
                W,
                t,
                b,
                reduction=reduction,
                label_smoothing=ls,
                z_loss=z,
                softcap=cap,
                chunk_size=chunk,
            )

        assert gradcheck(fn, (h.clone().requires_grad_(), W.clone().requires_grad_(), b.clone().requires_grad_()))


def test_batched_input_and_other_ignore_index():
    """(B, L, d) hidden states with (B, L) targets; ignore_index a valid class."""
    h = torch.randn(3, 10, 8, dtype=torch.float64)
    W = torch.randn(50, 8, dtype=torch.float64)
    t = torch.randint(0, 50, (3, 10))
    t[:, 7:] = 5
    for reduction in REDUCTIONS:
        _compare(h, W, None, t, reduction, reduction=reduction, ignore_index=5, chunk_size=4)
    assert lce(h, W, t, reduction="none", ignore_index=5).shape == (3, 10)


def test_only_some_grads_and_no_grad():
    h, W, b, t = _make(20, 6, 40, torch.float64, True)
    hr = h.clone().requires_grad_()
    (gh,) = torch.autograd.grad(lce(hr, W, t, b), hr)  # weight, bias constant
    assert_close64(gh, torch.autograd.grad(ref_lce(hr, W, t, b), hr)[0])
    Wr = W.clone().requires_grad_()
    (gw,) = torch.autograd.grad(lce(h, Wr, t), Wr)  # input constant
    assert_close64(gw, torch.autograd.grad(ref_lce(h, Wr, t), Wr)[0])
    with torch.no_grad():
        loss = lce(hr, Wr, t, b)
    assert not loss.requires_grad
    assert_close64(loss, ref_lce(h, W, t, b))
    assert not lce(h, W, t, b).requires_grad


def test_upstream_gradient_scales_eager_gradients():
    h, W, b, t = _make(20, 6, 40, torch.float64, True)
    for reduction in ("mean", "sum"):
        leaves = [x.clone().requires_grad_() for x in (h, W, b)]
        (3.5 * lce(leaves[0], leaves[1], t, leaves[2], reduction=reduction)).backward()
        refs = [x.clone().requires_grad_() for x in (h, W, b)]
        (3.5 * ref_lce(refs[0], refs[1], t, refs[2], reduction=reduction)).backward()
        for a, r in zip(leaves, refs):
            assert_close64(a.grad, r.grad)


def test_all_ignored_and_empty():
    h, W, b, t = _make(6, 4, 9, torch.float64, True)
    t[:] = -100
    for reduction in REDUCTIONS:
        leaves = [x.clone().requires_grad_() for x in (h, W, b)]
        loss = lce(*leaves[:2], t, leaves[2], reduction=reduction)
        want = ref_lce(h, W, t, b, reduction=reduction)
        assert torch.equal(loss.isnan(), want.isnan())
        assert torch.equal(loss.nan_to_num(), want.nan_to_num().abs())
        loss.sum().backward()
        for x in leaves:
            assert torch.equal(x.grad, torch.zeros_like(x))
    e = lce(torch.randn(0, 4, dtype=torch.float64), W, torch.zeros(0, dtype=torch.long), reduction="sum")
    assert e.item() == 0


def test_backward_twice_with_retain_graph():
    """Eager gradients ('mean', 'sum') are saved tensors: retain_graph keeps
    them; 'none' recomputes its chunks in every backward."""
    h, W, b, t = _make(10, 4, 9, torch.float64, False)
    for reduction in REDUCTIONS:
        hr = h.clone().requires_grad_()
        loss = lce(hr, W, t, reduction=reduction).sum()
        loss.backward(retain_graph=True)
        g1 = hr.grad.clone()
        (2 * loss).backward()
        assert_close64(hr.grad, 3 * g1)
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            loss.backward()


def test_errors():
    h, W, b, t = _make(6, 4, 9, torch.float32, True)
    bad = t.clone()
    bad[1] = 9
    with pytest.raises(IndexError, match=r"Target 9 is out of bounds\."):
        lce(h, W, bad)
    with pytest.raises(ValueError, match="reduction"):
        lce(h, W, t, reduction="avg")
    with pytest.raises(ValueError, match="do not match"):
        lce(h, W[:, :3], t)
    with pytest.raises(ValueError, match="target"):
        lce(h, W, t[:5])
    with pytest.raises(TypeError, match="int64"):
        lce(h, W, t.int())
    with pytest.raises(TypeError, match="dtype"):
        lce(h, W.double(), t)
    with pytest.raises(ValueError, match="chunk_size"):
        lce(h, W, t, chunk_size=0)
    with pytest.raises(ValueError, match="softcap"):
        lce(h, W, t, softcap=-1.0)
    with pytest.raises(ValueError, match="z_loss"):
        lce(h, W, t, z_loss=-1.0)


def test_module():
    h, W, b, t = _make(25, 8, 60, torch.float64, True)
    m = tma.LinearCrossEntropyLoss(reduction="sum", label_smoothing=0.1, z_loss=1e-3, softcap=5.0, chunk_size=8)
    assert "chunk_size=8" in repr(m) and list(m.state_dict()) == []
    leaves = [x.clone().requires_grad_() for x in (h, W, b)]
    loss = m(leaves[0], leaves[1], t, leaves[2])
    refs = [x.clone().requires_grad_() for x in (h, W, b)]
    want = ref_lce(refs[0], refs[1], t, refs[2], reduction="sum", label_smoothing=0.1, z_loss=1e-3, softcap=5.0)
    assert_close64(loss, want)
    loss.backward()
    want.backward()
    for a, r in zip(leaves, refs):
        assert_close64(a.grad, r.grad)
    # with an nn.Linear LM head
    head = torch.nn.Linear(8, 60, bias=False).double()
    x = torch.randn(4, 5, 8, dtype=torch.float64, requires_grad=True)
    tt = torch.randint(0, 60, (4, 5))
    got = tma.LinearCrossEntropyLoss()(x, head.weight, tt)
    assert_close64(got, F.cross_entropy(head(x).reshape(-1, 60), tt.reshape(-1)))


@pytest.mark.parametrize("isa", FMA_ISAS)
def test_every_variant(isa):
    if not isa_available(isa):
        pytest.skip(f"this CPU has no {isa}")
    h, W, b, t = _make(100, 32, 700, torch.float32, True)
    run_isa(isa, lambda: _compare(h, W, b, t, isa, chunk_size=33, label_smoothing=0.1, z_loss=1e-3, softcap=20.0))


def test_memory_is_one_chunk_not_n_by_v():
    """The largest tensor a call allocates is the chunk buffer or grad_weight,
    never the (N, V) logits: measured through the profiler's memory records."""
    N, d, V = 2048, 16, 8192  # N x V float32 = 64 MB; a chunk of 64 rows = 2 MB
    h, W, _, t = _make(N, d, V, torch.float32, False)
    h.requires_grad_(), W.requires_grad_()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        lce(h, W, t, chunk_size=64).backward()
    largest = max((e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0), default=0)
    assert largest <= max(64 * V, V * d) * 4 * 1.01, largest
