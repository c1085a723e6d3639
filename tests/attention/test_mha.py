"""Parity of torch_masked_attn.MultiheadAttention with torch.nn.MultiheadAttention
(docs/design.md, "Attention semantics" and "Testing"): same constructor, same
state_dict keys, same outputs, attention weights and gradients (inputs and every
parameter)."""

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import torch_masked_attn as tma
from conftest import (
    assert_close64,
    assert_close_ref,
    causal_blocked,
    random_additive,
    random_blocked,
    ref_mha,
)

E, H, N, L, S = 16, 4, 3, 5, 7
KDIM, VDIM = 10, 12


def make_pair(dtype=torch.float64, E=E, H=H, **ctor):
    """torch's module with random parameters (non-zero biases) and ours loaded
    from its state_dict."""
    theirs = nn.MultiheadAttention(E, H, dtype=dtype, **ctor)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn(p.shape, dtype=torch.float64).to(dtype) * 0.3)
    ours = tma.MultiheadAttention(E, H, dtype=dtype, **ctor)
    assert isinstance(ours, nn.Module)
    ours.load_state_dict(theirs.state_dict())
    return ours, theirs


def _conv(x, dtype):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.detach().to(dtype)
    return x


def _inputs(dt, query, key, value, self_attn, grad):
    qx = query.detach().to(dt).requires_grad_(grad)
    if self_attn:
        return qx, qx, qx
    return (qx, key.detach().to(dt).requires_grad_(grad), value.detach().to(dt).requires_grad_(grad))


def _call(fn, mod, qkv, kw, head_mask):
    if head_mask is not None:
        kw = dict(kw, head_mask=head_mask)
    out, w = fn(mod, *qkv, **kw)
    return out, w


def _torch_fn(mod, q, k, v, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # mixed mask dtypes: deprecation warning
        return mod(q, k, v, **kw)


def _ours_fn(mod, q, k, v, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mod(q, k, v, **kw)


def _ref_fn(mod, q, k, v, **kw):
    return ref_mha(mod, q, k, v, **kw)


def _cmp(name, ours, theirs, ref, dtype):
    if dtype == torch.float64:
        assert_close64(ours, theirs, name=name)
    else:
        assert_close_ref(ours, theirs, ref, name=name)


def run_mha(ours, theirs, query, key, value, *, self_attn=False, grad=True, head_mask=None, theirs_fn=_torch_fn, **kw):
    """Run both modules on the same inputs, compare output, weights, input
    gradients and the gradient of every named parameter.  For float32 a
    float64 copy of torch's module is the reference (flash-attention rule)."""
    dtype = query.dtype
    need_weights = kw.get("need_weights", True)
    hm_o = hm_t = hm_r = None
    if head_mask is not None:
        hm_o = head_mask.detach().clone().requires_grad_(grad and head_mask.requires_grad)
        hm_t = head_mask.detach().clone().requires_grad_(grad and head_mask.requires_grad)
        hm_r = head_mask.detach().double().requires_grad_(grad and head_mask.requires_grad)

    qkv_o = _inputs(dtype, query, key, value, self_attn, grad)
    qkv_t = _inputs(dtype, query, key, value, self_attn, grad)
    out_o, w_o = _call(_ours_fn, ours, qkv_o, kw, hm_o)
    out_t, w_t = _call(theirs_fn, theirs, qkv_t, kw, hm_t)

    if dtype == torch.float64:
        ref_mod, qkv_r, out_r, w_r = theirs, qkv_t, out_t, w_t
    else:
        ref_mod = copy.deepcopy(theirs).double()
        qkv_r = _inputs(torch.float64, query, key, value, self_attn, grad)
        kw_r = {a: _conv(b, torch.float64) for a, b in kw.items()}
        out_r, w_r = _call(theirs_fn, ref_mod, qkv_r, kw_r, hm_r)

    assert out_o.shape == out_t.shape and out_o.dtype == dtype
    _cmp("attn_output", out_o, out_t, out_r, dtype)
    if need_weights:
        assert w_o is not None, "need_weights=True must return weights"
        assert w_o.shape == w_t.shape, (w_o.shape, w_t.shape)
        _cmp("attn_weights", w_o, w_t, w_r, dtype)
    else:
        assert w_o is None
    if not grad:
        return out_o, w_o

    g = torch.randn(out_o.shape, dtype=torch.float64)
    gw = torch.randn(w_o.shape, dtype=torch.float64) if need_weights else None

    def loss(out, w):
        val = (out * g.to(out.dtype)).sum()
        if need_weights:
            val = val + (w * gw.to(w.dtype)).sum()
        return val

    loss(out_o, w_o).backward()
    loss(out_t, w_t).backward()
    if dtype != torch.float64:
        loss(out_r, w_r).backward()

    names = ("query", "key", "value")
    seen = set()
    for nm, a, b, r in zip(names, qkv_o, qkv_t, qkv_r):
        if id(a) in seen:
            continue
        seen.add(id(a))
        assert a.grad is not None, f"no gradient for {nm}"
        _cmp("grad " + nm, a.grad, b.grad, r.grad, dtype)
    if hm_o is not None and hm_o.requires_grad:
        assert hm_o.grad is not None, "no gradient for head_mask"
        _cmp("grad head_mask", hm_o.grad, hm_t.grad, hm_r.grad, dtype)

    po = dict(ours.named_parameters())
    pt = dict(theirs.named_parameters())
    pr = dict(ref_mod.named_parameters())
    assert po.keys() == pt.keys()
    for nm in pt:
        if pt[nm].grad is None:
            assert po[nm].grad is None or torch.all(po[nm].grad == 0), nm
            continue
        assert po[nm].grad is not None, f"no gradient for parameter {nm}"
        _cmp("grad " + nm, po[nm].grad, pt[nm].grad, pr[nm].grad, dtype)
    return out_o, w_o


# ---------------------------------------------------------------------------
# masks
# ---------------------------------------------------------------------------


def make_masks(case, n, l, s, h, dtype, batched=True):
    """Masks in nn.MultiheadAttention's conventions (bool True = blocked).
    Every query row keeps key 0 open so no row is fully masked."""
    kw = {}
    for part in case.split("+"):
        if part == "none":
            continue
        if part in ("causal_bool", "causal_float"):
            m = causal_blocked(l, s)
            if part == "causal_float":
                m = torch.zeros(l, s, dtype=dtype).masked_fill(m, float("-inf"))
            kw["attn_mask"] = m
            kw["is_causal"] = True
        elif part.startswith("am_"):
            _, kind, rank = part.split("_")
            shape = (l, s) if rank == "2d" else (n * h, l, s)
            kw["attn_mask"] = (
                random_blocked(shape) if kind == "bool" else random_additive(shape, dtype=torch.float64).to(dtype)
            )
        elif part.startswith("kpm_"):
            shape = (n, s) if batched else (s,)
            kw["key_padding_mask"] = (
                random_blocked(shape) if part == "kpm_bool" else random_additive(shape, dtype=torch.float64).to(dtype)
            )
        else:
            raise AssertionError(part)
    return kw


MASKS = [
    "none",
    "am_bool_2d",
    "am_bool_3d",
    "am_float_2d",
    "am_float_3d",
    "kpm_bool",
    "kpm_float",
    "causal_bool",
    "causal_float",
    "causal_bool+kpm_bool",
    "causal_float+kpm_float",
    "am_bool_2d+kpm_bool",
    "am_float_3d+kpm_float",
    "am_bool_3d+kpm_float",
    "am_float_2d+kpm_bool",
]

WEIGHTS = [
    dict(need_weights=False),
    dict(need_weights=True, average_attn_weights=True),
    dict(need_weights=True, average_attn_weights=False),
]
WEIGHT_IDS = ["noweights", "weights_avg", "weights_perhead"]


def _qkv(dtype, batch_first, n=N, l=L, s=S, e=E, kdim=None, vdim=None):
    def shp(length, dim):
        return (n, length, dim) if batch_first else (length, n, dim)

    q = torch.randn(shp(l, e), dtype=torch.float64).to(dtype)
    k = torch.randn(shp(s, kdim or e), dtype=torch.float64).to(dtype)
    v = torch.randn(shp(s, vdim or e), dtype=torch.float64).to(dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("weights", WEIGHTS, ids=WEIGHT_IDS)
@pytest.mark.parametrize("batch_first", [False, True], ids=["seqfirst", "batchfirst"])
@pytest.mark.parametrize("case", MASKS)
def test_mha_masks(case, batch_first, weights, dtype):
    ours, theirs = make_pair(dtype, batch_first=batch_first)
    self_attn = case.startswith("causal")
    s = L if self_attn else S
    q, k, v = _qkv(dtype, batch_first, s=s)
    kw = make_masks(case, N, L, s, H, dtype)
    run_mha(ours, theirs, q, k, v, self_attn=self_attn, **kw, **weights)


@pytest.mark.parametrize("mode", ["train", "eval", "eval_nograd"])
@pytest.mark.parametrize("batch_first", [False, True], ids=["seqfirst", "batchfirst"])
@pytest.mark.parametrize("case", ["none", "kpm_bool", "am_float_3d+kpm_bool", "causal_bool"])
@pytest.mark.parametrize("need_weights", [False, True])
def test_mha_train_eval_self_attention(case, batch_first, mode, need_weights):
    """Self attention (query is key is value); eval without grad is where
    nn.MultiheadAttention takes its fast path."""
    dtype = torch.float32
    ours, theirs = make_pair(dtype, batch_first=batch_first)
    if mode == "train":
        ours.train(), theirs.train()
    else:
        ours.eval(), theirs.eval()
    assert ours.training == theirs.training
    q, _, _ = _qkv(dtype, batch_first, s=L)
    kw = make_masks(case, N, L, L, H, dtype)
    if mode == "eval_nograd":
        with torch.no_grad():
            run_mha(ours, theirs, q, q, q, self_attn=True, grad=False, need_weights=need_weights, **kw)
    else:
        run_mha(ours, theirs, q, q, q, self_attn=True, need_weights=need_weights, **kw)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("batch_first", [False, True], ids=["seqfirst", "batchfirst"])
@pytest.mark.parametrize(
    "ctor",
    [
        dict(kdim=KDIM, vdim=VDIM),
        dict(bias=False),
        dict(add_bias_kv=True),
        dict(add_zero_attn=True),
        dict(add_bias_kv=True, add_zero_attn=True),
        dict(add_bias_kv=True, add_zero_attn=True, bias=False, kdim=KDIM, vdim=VDIM),
    ],
    ids=["kvdim", "nobias", "bias_kv", "zero_attn", "bias_kv+zero_attn", "all"],
)
@pytest.mark.parametrize("case", ["none", "am_bool_3d+kpm_bool", "am_float_2d+kpm_float"])
@pytest.mark.parametrize("need_weights", [False, True])
def test_mha_constructor_options(ctor, case, batch_first, dtype, need_weights):
    ours, theirs = make_pair(dtype, batch_first=batch_first, **ctor)
    q, k, v = _qkv(dtype, batch_first, kdim=ctor.get("kdim"), vdim=ctor.get("vdim"))
    kw = make_masks(case, N, L, S, H, dtype)
    run_mha(ours, theirs, q, k, v, need_weights=need_weights, average_attn_weights=False, **kw)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize(
    "case", ["none", "am_bool_2d", "am_float_3d", "kpm_bool", "kpm_float+am_bool_2d", "causal_bool"]
)
@pytest.mark.parametrize("weights", WEIGHTS, ids=WEIGHT_IDS)
@pytest.mark.parametrize("batch_first", [False, True], ids=["seqfirst", "batchfirst"])
def test_mha_unbatched(case, weights, dtype, batch_first):
    """(L, E) inputs: key_padding_mask (S,), 3-D attn_mask (H, L, S)."""
    ours, theirs = make_pair(dtype, batch_first=batch_first, add_zero_attn=(case == "kpm_bool"))
    self_attn = case.startswith("causal")
    s = L if self_attn else S
    q = torch.randn(L, E, dtype=torch.float64).to(dtype)
    k = torch.randn(s, E, dtype=torch.float64).to(dtype)
    v = torch.randn(s, E, dtype=torch.float64).to(dtype)
    kw = make_masks(case, 1, L, s, H, dtype, batched=False)
    run_mha(ours, theirs, q, k, v, self_attn=self_attn, **kw, **weights)


@pytest.mark.parametrize("batch_first", [False, True], ids=["seqfirst", "batchfirst"])
def test_mha_kdim_vdim_cross_lengths(batch_first):
    """Cross attention with a longer and a shorter memory than the query."""
    for s in (2, 11):
        ours, theirs = make_pair(torch.float64, batch_first=batch_first, kdim=KDIM, vdim=VDIM)
        q, k, v = _qkv(torch.float64, batch_first, s=s, kdim=KDIM, vdim=VDIM)
        kw = make_masks("kpm_bool", N, L, s, H, torch.float64)
        run_mha(ours, theirs, q, k, v, **kw)


# ---------------------------------------------------------------------------
# state_dict
# ---------------------------------------------------------------------------

CTORS = [
    dict(),
    dict(bias=False),
    dict(add_bias_kv=True),
    dict(add_zero_attn=True),
    dict(kdim=KDIM, vdim=VDIM),
    dict(kdim=E, vdim=E),
    dict(batch_first=True),
    dict(add_bias_kv=True, kdim=KDIM, vdim=VDIM, bias=False),
]


@pytest.mark.parametrize("ctor", CTORS, ids=lambda c: ",".join(f"{a}={b}" for a, b in c.items()) or "default")
def test_state_dict_keys_identical(ctor):
    ours = tma.MultiheadAttention(E, H, **ctor)
    theirs = nn.MultiheadAttention(E, H, **ctor)
    so, st = ours.state_dict(), theirs.state_dict()
    assert list(so.keys()) == list(st.keys())
    for key in st:
        assert so[key].shape == st[key].shape, key
        assert so[key].dtype == st[key].dtype, key
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    for attr in ("embed_dim", "num_heads", "head_dim", "batch_first", "dropout", "kdim", "vdim", "_qkv_same_embed_dim"):
        if hasattr(theirs, attr):
            assert getattr(ours, attr) == getattr(theirs, attr), attr


@pytest.mark.parametrize("ctor", CTORS, ids=lambda c: ",".join(f"{a}={b}" for a, b in c.items()) or "default")
def test_state_dict_reverse_direction(ctor):
    """Ours (random parameters) -> torch's module: same results."""
    ours = tma.MultiheadAttention(E, H, dtype=torch.float64, **ctor)
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    theirs = nn.MultiheadAttention(E, H, dtype=torch.float64, **ctor)
    theirs.load_state_dict(ours.state_dict())
    bf = ctor.get("batch_first", False)
    q, k, v = _qkv(torch.float64, bf, kdim=ctor.get("kdim"), vdim=ctor.get("vdim"))
    run_mha(ours, theirs, q, k, v, **make_masks("am_bool_2d+kpm_bool", N, L, S, H, torch.float64))


def test_state_dict_roundtrip_and_init():
    """Ours' own initialisation gives the same kinds of parameters as torch's
    (biases zero, weights random) and state_dict -> load_state_dict is exact."""
    ours = tma.MultiheadAttention(E, H, add_bias_kv=True)
    theirs = nn.MultiheadAttention(E, H, add_bias_kv=True)
    for key, t in theirs.state_dict().items():
        o = ours.state_dict()[key]
        if torch.all(t == 0):
            assert torch.all(o == 0), f"{key}: torch initialises to 0"
        else:
            assert o.std() > 0, f"{key}: not initialised"
    other = tma.MultiheadAttention(E, H, add_bias_kv=True)
    other.load_state_dict(ours.state_dict())
    for key, t in ours.state_dict().items():
        assert torch.equal(t, other.state_dict()[key])


# ---------------------------------------------------------------------------
# dropout
# ---------------------------------------------------------------------------


def test_dropout_train_runs():
    # dropout in training mode runs inside the kernels (tests/attention/test_dropout.py checks its statistics)
    ours = tma.MultiheadAttention(E, H, dropout=0.1)
    ours.train()
    x = torch.randn(L, N, E, requires_grad=True)
    y, w = ours(x, x, x, average_attn_weights=False)
    assert (w == 0).any()
    y.sum().backward()
    assert x.grad is not None


@pytest.mark.parametrize("need_weights", [False, True])
def test_dropout_eval_matches(need_weights):
    ours, theirs = make_pair(torch.float64, dropout=0.3)
    ours.eval(), theirs.eval()
    q, k, v = _qkv(torch.float64, False)
    run_mha(ours, theirs, q, k, v, need_weights=need_weights, **make_masks("kpm_bool", N, L, S, H, torch.float64))


# ---------------------------------------------------------------------------
# fully masked rows: ours gives 0 attention (output = out_proj.bias), no NaN
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("need_weights", [False, True])
def test_fully_masked_rows(dtype, need_weights):
    ours, theirs = make_pair(dtype)
    q, k, v = _qkv(dtype, False)
    am = random_blocked((N * H, L, S))
    am[1, 2] = True  # batch 0, head 1, query 2: no key
    kpm = random_blocked((N, S))
    kpm[2] = True  # batch 2: every key is padding
    for t in (q, k, v):
        t.requires_grad_()
    out, w = ours(q, k, v, key_padding_mask=kpm, attn_mask=am, need_weights=need_weights, average_attn_weights=False)
    assert not out.isnan().any()
    # batch 2: attention output 0 -> the projection gives out_proj.bias
    torch.testing.assert_close(out[:, 2], theirs.out_proj.bias.detach().expand(L, E), atol=1e-6, rtol=1e-6)
    if need_weights:
        assert not w.isnan().any()
        assert torch.all(w[2] == 0) and torch.all(w[0, 1, 2] == 0)
    loss = out.sum() + (w.sum() if need_weights else 0)
    loss.backward()
    for t in (q, k, v):
        assert not t.grad.isnan().any()
    assert torch.all(k.grad[:, 2] == 0) and torch.all(v.grad[:, 2] == 0)
    for nm, p in ours.named_parameters():
        assert p.grad is None or not p.grad.isnan().any(), nm
    # against the float64 reference (0 attention on empty rows)
    ref_mod = copy.deepcopy(theirs).double()
    ref, ref_w = ref_mha(
        ref_mod,
        q.detach().double(),
        k.detach().double(),
        v.detach().double(),
        key_padding_mask=kpm,
        attn_mask=am,
        average_attn_weights=False,
    )
    tol = dict(atol=1e-10, rtol=1e-9) if dtype == torch.float64 else dict(atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out.detach().double(), ref, **tol)
    if need_weights:
        torch.testing.assert_close(w.detach().double(), ref_w, **tol)


# ---------------------------------------------------------------------------
# head_mask (keyword only): probabilities of each head multiplied after softmax
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("batch_first", [False, True], ids=["seqfirst", "batchfirst"])
@pytest.mark.parametrize("case", ["none", "am_bool_3d+kpm_bool", "causal_bool"])
@pytest.mark.parametrize("weights", WEIGHTS, ids=WEIGHT_IDS)
def test_ref_mha_matches_torch(case, weights, batch_first):
    """The plain reference used for head_mask is itself nn.MHA's semantics."""
    self_attn = case.startswith("causal")
    # (nn.MHA's is_causal hint with add_bias_kv is inconsistent between its
    # need_weights paths, so bias_kv is only used without the hint)
    ours, theirs = make_pair(
        torch.float64, batch_first=batch_first, add_bias_kv=not self_attn, add_zero_attn=(case == "none")
    )
    s = L if self_attn else S
    q, k, v = _qkv(torch.float64, batch_first, s=s)
    kw = make_masks(case, N, L, s, H, torch.float64)
    # theirs_fn = ref on "ours" slot is not possible; compare ref (as ours) to torch
    qkv = _inputs(torch.float64, q, k, v, self_attn, False)
    a, wa = ref_mha(theirs, *qkv, **kw, **weights)
    b, wb = theirs(*qkv, **kw, **weights)
    assert_close64(a, b, name="ref out")
    if weights["need_weights"]:
        assert_close64(wa, wb, name="ref weights")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("hm_shape", ["H", "NH"])
@pytest.mark.parametrize("weights", WEIGHTS, ids=WEIGHT_IDS)
@pytest.mark.parametrize("case", ["none", "am_float_3d+kpm_bool", "causal_bool+kpm_bool"])
@pytest.mark.parametrize("hm_grad", [False, True], ids=["hm_nograd", "hm_grad"])
def test_head_mask(case, weights, hm_shape, dtype, hm_grad):
    ours, theirs = make_pair(dtype, batch_first=True)
    self_attn = case.startswith("causal")
    s = L if self_attn else S
    q, k, v = _qkv(dtype, True, s=s)
    kw = make_masks(case, N, L, s, H, dtype)
    hm = torch.rand((H,) if hm_shape == "H" else (N, H), dtype=torch.float64).to(dtype)
    hm[..., 1] = 0.0  # one head switched off entirely
    hm.requires_grad_(hm_grad)
    run_mha(ours, theirs, q, k, v, self_attn=self_attn, head_mask=hm, theirs_fn=_ref_fn, **kw, **weights)


@pytest.mark.parametrize("need_weights", [False, True])
def test_head_mask_unbatched_and_options(need_weights):
    ours, theirs = make_pair(torch.float64, add_bias_kv=True, add_zero_attn=True, kdim=KDIM, vdim=VDIM)
    q = torch.randn(L, E, dtype=torch.float64)
    k = torch.randn(S, KDIM, dtype=torch.float64)
    v = torch.randn(S, VDIM, dtype=torch.float64)
    hm = torch.rand(H, dtype=torch.float64).requires_grad_()
    kw = make_masks("kpm_bool+am_bool_2d", 1, L, S, H, torch.float64, batched=False)
    run_mha(
        ours,
        theirs,
        q,
        k,
        v,
        head_mask=hm,
        theirs_fn=_ref_fn,
        need_weights=need_weights,
        average_attn_weights=True,
        **kw,
    )


def test_head_mask_ones_is_identity():
    ours, theirs = make_pair(torch.float64)
    q, k, v = _qkv(torch.float64, False)
    a, wa = ours(q, k, v)
    b, wb = ours(q, k, v, head_mask=torch.ones(H, dtype=torch.float64))
    assert_close64(a, b, name="out", atol=1e-13)
    assert_close64(wa, wb, name="weights", atol=1e-13)


def test_head_mask_is_keyword_only():
    ours, _ = make_pair(torch.float64)
    q, k, v = _qkv(torch.float64, False)
    with pytest.raises(TypeError):
        ours(q, k, v, None, True, None, True, False, torch.ones(H, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize(
    "case,l,s", [("causal_bool+kpm_bool", 130, 130), ("am_float_2d+kpm_bool", 70, 150), ("kpm_float", 150, 66)]
)
@pytest.mark.parametrize("need_weights", [False, True])
def test_mha_long(case, l, s, need_weights, dtype):
    """Lengths spanning several kernel tiles."""
    ours, theirs = make_pair(dtype, E=32, H=4, batch_first=True)
    self_attn = case.startswith("causal")
    n = 2
    q = torch.randn(n, l, 32, dtype=torch.float64).to(dtype)
    kv = torch.randn(n, s, 32, dtype=torch.float64).to(dtype)
    kw = make_masks(case, n, l, s, 4, dtype)
    if "key_padding_mask" in kw:
        kw["key_padding_mask"][1, 3:] = True if kw["key_padding_mask"].dtype == torch.bool else float("-inf")
    run_mha(
        ours,
        theirs,
        q,
        kv,
        kv.clone(),
        self_attn=self_attn,
        need_weights=need_weights,
        average_attn_weights=False,
        **kw,
    )


# ---------------------------------------------------------------------------
# the in-projection recomputed in the backward (long sequences)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("batch_first", [False, True], ids=["seqfirst", "batchfirst"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize(
    "case", ["none", "causal_bool+kpm_bool", "am_float_3d+kpm_float", "causal_float", "am_bool_2d"]
)
def test_mha_recompute_projection(case, bias, batch_first, dtype):
    """recompute_projection=True: the same outputs and gradients (inputs and
    every parameter) as nn.MultiheadAttention."""
    ours, theirs = make_pair(dtype, batch_first=batch_first, bias=bias)
    ours.recompute_projection = True
    q, _, _ = _qkv(dtype, batch_first, s=L)
    kw = make_masks(case, N, L, L, H, dtype)
    run_mha(ours, theirs, q, q, q, self_attn=True, need_weights=False, **kw)


def test_mha_recompute_projection_large_streamed():
    """The recompute path writes dq, dk, dv over the recomputed projection;
    at this size (4 MB per gradient) with non-temporal stores (masked_attn.h,
    stream_stores). Still nn.MultiheadAttention's outputs and gradients."""
    torch.manual_seed(0)
    e, h, n, l = 512, 8, 1, 2048
    ours, theirs = make_pair(torch.float32, E=e, H=h, batch_first=True)
    ours.recompute_projection = True
    x = torch.randn(n, l, e)
    run_mha(
        ours,
        theirs,
        x,
        x,
        x,
        self_attn=True,
        need_weights=False,
        **make_masks("causal_bool+kpm_bool", n, l, l, h, torch.float32),
    )


@pytest.mark.parametrize("hm_shape", [(H,), (N, H)], ids=["H", "NH"])
def test_mha_recompute_projection_head_mask_and_unbatched(hm_shape):
    ours, theirs = make_pair(torch.float64, batch_first=True)
    ours.recompute_projection = True
    q, _, _ = _qkv(torch.float64, True, s=L)
    hm = torch.rand(hm_shape, dtype=torch.float64, requires_grad=True)
    run_mha(
        ours,
        theirs,
        q,
        q,
        q,
        self_attn=True,
        need_weights=False,
        head_mask=hm,
        theirs_fn=_ref_fn,
        **make_masks("causal_bool", N, L, L, H, torch.float64),
    )
    qu = torch.randn(L, E, dtype=torch.float64)
    run_mha(
        ours,
        theirs,
        qu,
        qu,
        qu,
        self_attn=True,
        need_weights=False,
        **make_masks("kpm_bool", 1, L, L, H, torch.float64, batched=False),
    )


def _saved_numels(mod, x, **kw):
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = mod(x, x, x, need_weights=False, **kw)[0]
    return out, sizes


def test_mha_recompute_projection_automatic():
    """Automatic: long sequences (7 L >= 96 E) keep no (N, L, 3E) projection
    for the backward, short ones do; both match nn.MultiheadAttention, and a
    retained graph can be run backward twice."""
    e, h, n = 8, 2, 2
    for l, recomputes in ((110, True), (40, False)):
        ours, theirs = make_pair(torch.float64, E=e, H=h, batch_first=True)
        x = torch.randn(n, l, e, dtype=torch.float64, requires_grad=True)
        out, sizes = _saved_numels(ours, x)
        assert (max(sizes) < 3 * n * l * e) == recomputes, (l, sorted(sizes)[-3:])
        ref, _ = theirs(x, x, x, need_weights=False)
        assert_close64(out, ref, name="attn_output")
        g = torch.randn_like(out)
        (gx,) = torch.autograd.grad(out, x, g, retain_graph=True)
        (gx2,) = torch.autograd.grad(out, x, g)  # the graph was retained: same again
        (rx,) = torch.autograd.grad(ref, x, g)
        assert_close64(gx, rx, name="grad x")
        assert torch.equal(gx, gx2)


def test_mha_recompute_projection_frozen_input_and_no_grad():
    """Gradients only for the parameters (input without requires_grad), and no
    recompute path at all under no_grad."""
    ours, theirs = make_pair(torch.float32, batch_first=True)
    ours.recompute_projection = True
    q, _, _ = _qkv(torch.float32, True, s=L)
    run_mha(ours, theirs, q, q, q, self_attn=True, grad=False, need_weights=False)
    out, _ = ours(q, q, q, need_weights=False)
    ref, _ = theirs(q, q, q, need_weights=False)
    out.sum().backward()
    ref.sum().backward()
    for (nm, a), b in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5, msg=nm)
    with torch.no_grad():
        _, sizes = _saved_numels(ours, q)
    assert sizes == []


def test_mha_long_sequence_under_autocast():
    """Under torch.autocast a long self-attention call (where the automatic
    choice would recompute the projection) takes the saved-projection path:
    the same result and gradients as with recompute_projection=False."""
    torch.manual_seed(8)
    e, h, l = 16, 2, 224  # 7 L >= 96 E
    ours, _ = make_pair(torch.float32, E=e, H=h, batch_first=True)
    x = torch.randn(1, l, e)
    results = []
    for setting in (None, False):
        ours.recompute_projection = setting
        ours.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y, _ = ours(xi, xi, xi, need_weights=False)
        y.float().sum().backward()
        results.append((y, xi.grad, ours.in_proj_weight.grad, ours.out_proj.weight.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)
