"""Any device: on a device other than the CPU every drop-in computes with
PyTorch's native ops (functional.native_attention, losses.native_cross_entropy)
with our semantics. Here, on a CPU-only machine: the dispatch decision, and
the fallback forced onto CPU tensors compared value for value (and gradient
for gradient) with the kernels; the CUDA test runs where CUDA is."""

import pytest
import torch
import torch.nn as nn

import torch_masked_attn as tma
from conftest import OpCounter
from torch_masked_attn import devices
from torch_masked_attn import functional as tF
from torch_masked_attn import losses as tL


@pytest.fixture
def native_on_cpu(monkeypatch):
    """CPU tensors take the path every non-CPU device takes."""
    monkeypatch.setattr(devices, "KERNEL_DEVICE_TYPES", frozenset({"meta"}))


def test_dispatch_decision():
    assert tF.uses_kernels("cpu") and tF.uses_kernels(torch.device("meta"))
    for dev in ("cuda", "cuda:1", "xpu", "mps"):
        assert not tF.uses_kernels(dev)
    # meta tensors go to the ops (their fake kernels): our shapes and (B, L, H, D) storage
    q = torch.empty(2, 4, 5, 8, device="meta")
    out = tF.masked_attention(q, q, q, is_causal=True)
    assert out.device.type == "meta" and out.shape == (2, 4, 5, 8) and out.transpose(1, 2).is_contiguous()
    mha = tma.MultiheadAttention(32, 4, batch_first=True, device="meta")
    y, w = mha(
        torch.empty(2, 5, 32, device="meta"), torch.empty(2, 5, 32, device="meta"), torch.empty(2, 5, 32, device="meta")
    )
    assert y.shape == (2, 5, 32) and w.shape == (2, 5, 5)
    loss = tma.functional.cross_entropy(
        torch.empty(6, 10, device="meta"), torch.empty(6, dtype=torch.long, device="meta"), z_loss=1e-4
    )
    assert loss.shape == () and loss.device.type == "meta"


def _grads(outs, inputs):
    g = torch.Generator().manual_seed(1)
    loss = sum(
        (o.nan_to_num(neginf=0.0) * torch.randn(o.shape, dtype=o.dtype, generator=g)).sum()
        for o in outs
        if o.requires_grad
    )
    return torch.autograd.grad(loss, inputs, allow_unused=True)


@pytest.mark.parametrize(
    "case", ["bool", "bool+kpm+causal", "float+head+weights+lse", "causal", "kpm+weights", "gqa+dead"]
)
def test_native_attention_matches_kernels(case):
    """The fallback, called on CPU tensors, against the kernels: values,
    weights, lse (-inf on fully masked rows) and every gradient, float64."""
    B, H, L, S, D = 2, 4, 7, 9, 8
    Hkv = 2 if "gqa" in case else H
    f64 = dict(dtype=torch.float64)
    q = torch.randn(B, H, L, D, **f64, requires_grad=True)
    k = torch.randn(B, Hkv, S, D, **f64, requires_grad=True)
    v = torch.randn(B, Hkv, S, D + 3, **f64, requires_grad=True)
    am = torch.rand(L, S) < 0.3
    am[2] = True  # a fully masked row
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[1, 5:] = True
    hm = torch.rand(H, **f64, requires_grad=True)
    fm = torch.randn(B, 1, L, S, **f64)
    fm[0, 0, 3] = float("-inf")  # a fully masked row, float form
    fm.requires_grad_(True)
    kw = {
        "bool": dict(attn_mask=am),
        "bool+kpm+causal": dict(attn_mask=am, key_padding_mask=kpm, is_causal=True),
        "float+head+weights+lse": dict(attn_mask=fm, head_mask=hm, need_weights=True, return_lse=True),
        "causal": dict(is_causal=True),
        "kpm+weights": dict(key_padding_mask=kpm, need_weights=True),
        "gqa+dead": dict(attn_mask=am, key_padding_mask=kpm, return_lse=True),
    }[case]
    leaves = (q, k, v, hm, fm)
    ours = tF.masked_attention(q, k, v, **kw)
    ours = ours if isinstance(ours, tuple) else (ours,)
    g_ours = _grads(ours, leaves)
    nat_out, nat_lse, nat_w = tF.native_attention(
        q,
        k,
        v,
        kw.get("attn_mask"),
        kw.get("key_padding_mask"),
        kw.get("head_mask"),
        kw.get("is_causal", False),
        None,
        kw.get("need_weights", False),
        kw.get("return_lse", False),
    )
    nat = (nat_out,) + ((nat_w,) if kw.get("need_weights") else ()) + ((nat_lse,) if kw.get("return_lse") else ())
    g_nat = _grads(nat, leaves)
    assert len(ours) == len(nat)
    for a, b in zip(ours, nat):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    assert not nat_out.isnan().any()
    for a, b in zip(g_ours, g_nat):
        assert (a is None) == (b is None)
        if a is not None:
            assert not b.isnan().any()
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_attention_low_precision(dtype):
    q, k, v = (torch.randn(2, 4, 33, 16, dtype=dtype) for _ in range(3))
    kpm = torch.zeros(2, 33, dtype=torch.bool)
    kpm[0, 20:] = True
    ours = tF.masked_attention(q, k, v, key_padding_mask=kpm, is_causal=True)
    nat = tF.native_attention(q, k, v, None, kpm, None, True)[0]
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(nat, ours, **tol)


@pytest.mark.parametrize(
    "case", ["plain", "weight+ls+ignore", "zloss+softcap", "zloss+weight+ignore", "probs+zloss", "spatial+zloss"]
)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_native_cross_entropy_matches_kernels(case, reduction):
    f64 = dict(dtype=torch.float64)
    N, C = 12, 10
    x = torch.randn(N, C, **f64) * 3
    t = torch.randint(0, C, (N,))
    kw = {}
    if case == "weight+ls+ignore":
        t[[1, 5]] = -100
        kw = dict(weight=torch.rand(C, **f64), label_smoothing=0.1)
    elif case == "zloss+softcap":
        kw = dict(z_loss=1e-2, softcap=2.0)
    elif case == "zloss+weight+ignore":
        t[[0, 7]] = 3
        kw = dict(weight=torch.rand(C, **f64), ignore_index=3, z_loss=1e-2, label_smoothing=0.05)
    elif case == "probs+zloss":
        t = torch.softmax(torch.randn(N, C, **f64), 1)
        kw = dict(z_loss=1e-2)
    elif case == "spatial+zloss":
        x = torch.randn(3, C, 4, **f64)
        t = torch.randint(0, C, (3, 4))
        t[0, 1] = -100
        kw = dict(z_loss=1e-2, softcap=5.0)
    x.requires_grad_(True)
    ours = tma.functional.cross_entropy(x, t, reduction=reduction, **kw)
    nat = tL.native_cross_entropy(x, t, reduction=reduction, **kw)
    torch.testing.assert_close(nat, ours, rtol=1e-9, atol=1e-12)
    gr = torch.randn(ours.shape, **f64)
    (g_ours,) = torch.autograd.grad(ours, x, gr)
    (g_nat,) = torch.autograd.grad(nat, x, gr)
    torch.testing.assert_close(g_nat, g_ours, rtol=1e-9, atol=1e-12)


class TinyLM(nn.Module):
    """Embedding, one self-attention block of ours, an LM head; a loss of ours."""

    def __init__(self, V=40, E=32, H=4):
        super().__init__()
        self.emb = nn.Embedding(V, E)
        self.attn = tma.MultiheadAttention(E, H, batch_first=True)
        self.cross = tma.MultiheadAttention(E, H, batch_first=True, kdim=24, vdim=20)
        self.norm = nn.LayerNorm(E)
        self.head = nn.Linear(E, V)

    def forward(self, idx, mem, target, kpm):
        x = self.emb(idx)
        L = idx.size(1)
        causal = torch.ones(L, L, dtype=torch.bool, device=idx.device).triu(1)
        a, _ = self.attn(x, x, x, attn_mask=causal, is_causal=True, key_padding_mask=kpm, need_weights=False)
        c, w = self.cross(x, mem[..., :24], mem[..., :20], need_weights=True)
        h = self.norm(x + a + c)
        q = torch.randn(2, 4, L, 8, generator=torch.Generator().manual_seed(3)).to(h.device)
        s = tma.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum()
        loss = tma.CrossEntropyLoss(z_loss=1e-3)(self.head(h).transpose(1, 2), target)
        loss2 = tma.functional.linear_cross_entropy(h, self.head.weight, target, self.head.bias, softcap=10.0)
        return loss + loss2 + 1e-3 * s + w.square().mean()


def _run_tiny(model, device):
    g = torch.Generator().manual_seed(5)
    idx = torch.randint(0, 40, (3, 6), generator=g).to(device)
    mem = torch.randn(3, 5, 24, generator=g).to(device)
    target = torch.randint(0, 40, (3, 6), generator=g)
    target[0, 2] = -100
    kpm = torch.zeros(3, 6, dtype=torch.bool)
    kpm[2, 4:] = True
    loss = model(idx, mem, target.to(device), kpm.to(device))
    model.zero_grad()
    loss.backward()
    return loss.detach().cpu(), {n: p.grad.detach().cpu() for n, p in model.named_parameters()}


def test_forced_fallback_whole_model(monkeypatch):
    """A model of our modules and functions on the native path (what a CUDA
    device runs) equals the kernels', loss and every parameter's gradient,
    and no masked_attn op runs on that path."""
    torch.manual_seed(0)
    model = TinyLM()
    with OpCounter() as c:
        ref_loss, ref_grads = _run_tiny(model, "cpu")
    assert "forward" in c.ops and "cross_entropy" in c.ops and any(op.startswith("backward") for op in c.ops)
    monkeypatch.setattr(devices, "KERNEL_DEVICE_TYPES", frozenset({"meta"}))
    with OpCounter() as c:
        loss, grads = _run_tiny(model, "cpu")
    assert c.ops == []
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-4, atol=1e-6, msg=n)


def test_fallback_dropout_runs(native_on_cpu):
    """Dropout on the native path: F.sdpa's (MultiheadAttention in training)."""
    mha = tma.MultiheadAttention(16, 2, dropout=0.5, batch_first=True)
    x = torch.randn(2, 5, 16)
    a = mha(x, x, x, need_weights=False)[0]
    b = mha(x, x, x, need_weights=False)[0]
    assert not torch.equal(a, b)
    out, w = tF.masked_attention(
        x.view(2, 5, 2, 8).transpose(1, 2),
        x.view(2, 5, 2, 8).transpose(1, 2),
        x.view(2, 5, 2, 8).transpose(1, 2),
        dropout_p=0.5,
        need_weights=True,
    )
    assert (w == 0).float().mean() > 0.2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_model_matches_cpu():
    """.to('cuda') of a model built with our modules: it runs, and equals the CPU kernels."""
    torch.manual_seed(0)
    model = TinyLM()
    ref_loss, ref_grads = _run_tiny(model, "cpu")
    model.cuda()
    torch.backends.cuda.matmul.allow_tf32 = False
    loss, grads = _run_tiny(model, "cuda")
    torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-5)
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-3, atol=1e-5, msg=n)
    q = torch.randn(2, 4, 9, 8, device="cuda")
    kpm = torch.zeros(2, 9, dtype=torch.bool, device="cuda")
    kpm[1] = True  # every key of batch 1 masked: 0, not NaN
    out = tF.masked_attention(q, q, q, key_padding_mask=kpm)
    assert out.device.type == "cuda" and not out.isnan().any() and (out[1] == 0).all()


def test_export_and_meta_after_dispatch():
    """torch.export traces the CPU kernels' ops through their fake kernels
    (fake tensors of CPU tensors take the kernel path), and runs them."""
    torch.manual_seed(0)
    layer = tma.replace_attention(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)).eval()
    x = torch.randn(2, 5, 16)
    ep = torch.export.export(layer, (x,))
    assert any("masked_attn" in str(n.target) for n in ep.graph.nodes)
    torch.testing.assert_close(ep.module()(x), layer(x))
