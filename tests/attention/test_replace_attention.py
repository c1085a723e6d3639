"""tma.replace_attention: every nn.MultiheadAttention of a model becomes ours,
in place, and nn.Transformer* layers then run through our kernels in training
and in inference (the native fast path and the encoder's nested-tensor path
included), with the native model's results."""

import copy

import pytest
import torch
import torch.nn as nn

import torch_masked_attn as tma
from conftest import OpCounter


def test_keeps_parameters_buffers_hooks_mode_dtype():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.TransformerDecoderLayer(16, 4, 32, dropout=0.0, batch_first=True))
    model = model.to(torch.float64).train()
    dec = model[1]
    dec.self_attn.eval()  # a mode of its own, kept
    dec.multihead_attn.register_buffer("extra", torch.arange(3.0))
    calls = []
    h1 = dec.self_attn.register_forward_pre_hook(lambda m, a: calls.append("pre"))
    dec.self_attn.register_forward_hook(lambda m, a, o: calls.append("post"))
    dec.self_attn._register_state_dict_hook(lambda m, sd, prefix, local: calls.append("sd"))
    params = {n: p for n, p in model.named_parameters()}
    sa, ca = dec.self_attn, dec.multihead_attn
    sd = copy.deepcopy(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    assert tma.replace_attention(model) is model
    assert dec.self_attn is sa and dec.multihead_attn is ca  # the same objects, converted
    assert isinstance(sa, tma.MultiheadAttention) and isinstance(ca, tma.MultiheadAttention)
    assert isinstance(sa, nn.MultiheadAttention)
    assert all(p is params[n] for n, p in model.named_parameters()) and len(params) == len(list(model.parameters()))
    assert torch.equal(ca.extra, torch.arange(3.0))
    assert not sa.training and ca.training and sa.in_proj_weight.dtype == torch.float64
    assert sd.keys() == model.state_dict().keys()
    assert all(torch.equal(sd[k], v) for k, v in model.state_dict().items())
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    mem = torch.randn(2, 3, 16, dtype=torch.float64)
    h = model[0](x)
    with OpCounter() as c:
        dec(h, mem).sum().backward()
    assert c.ops.count("forward") + c.ops.count("backward") >= 2 and "backward_into" in c.ops
    assert [x for x in calls if x != "sd"] == ["pre", "post"] and "sd" in calls
    h1.remove()  # the user's handle still removes the hook
    calls.clear()
    dec(h, mem)
    assert calls == ["post"]
    opt.step()  # the optimizer built before still holds the parameters
    assert tma.replace_attention(model) is model  # idempotent
    assert len(sa._forward_pre_hooks) == 1


def test_leaves_subclasses_and_converts_the_root():
    class Mine(nn.MultiheadAttention):
        pass

    m = Mine(8, 2)
    assert type(tma.replace_attention(m)) is Mine
    root = nn.MultiheadAttention(8, 2)
    assert type(tma.replace_attention(root)) is tma.MultiheadAttention
    with pytest.raises(TypeError):
        tma.replace_attention("not a module")


def _pair(make):
    torch.manual_seed(0)
    native = make()
    ours = tma.replace_attention(copy.deepcopy(native))
    return native, ours


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("padding", [False, True])
def test_encoder_inference_runs_our_kernel(batch_first, padding):
    """Eval + no_grad: native takes torch._transformer_encoder_layer_fwd (and,
    with a key padding mask, the nested-tensor path); ours must call our
    kernel instead, with the same results (padded positions included)."""
    native, ours = _pair(
        lambda: nn.TransformerEncoder(
            nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=batch_first), 2, enable_nested_tensor=True
        ).eval()
    )
    x = torch.randn(3, 6, 32) if batch_first else torch.randn(6, 3, 32)
    kpm = None
    if padding:
        kpm = torch.zeros(3, 6, dtype=torch.bool)
        kpm[1, 4:] = True
        kpm[2, 2:] = True
    with torch.no_grad():
        with OpCounter() as cn:
            ref = native(x, src_key_padding_mask=kpm)
        with OpCounter() as c:
            out = ours(x, src_key_padding_mask=kpm)
    if batch_first:  # the native model does take a fast path here (the check can fail)
        assert "_transformer_encoder_layer_fwd" in cn.aten or "_native_multi_head_attention" in cn.aten
    assert c.ops.count("forward") == 2
    assert "_transformer_encoder_layer_fwd" not in c.aten and "_native_multi_head_attention" not in c.aten
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_transformer_training_matches_native():
    """nn.Transformer (encoder, decoder with self and cross attention) in
    training with dropout 0: outputs and every gradient as native's, and
    every attention through our kernels."""
    native, ours = _pair(lambda: nn.Transformer(32, 4, 2, 2, 64, dropout=0.0, batch_first=True).train())
    src, tgt = torch.randn(2, 7, 32), torch.randn(2, 5, 32)
    tgt_mask = nn.Transformer.generate_square_subsequent_mask(5)
    kpm = torch.zeros(2, 7, dtype=torch.bool)
    kpm[1, 5:] = True
    kw = dict(tgt_mask=tgt_mask, tgt_is_causal=True, src_key_padding_mask=kpm, memory_key_padding_mask=kpm)
    ref = native(src, tgt, **kw)
    with OpCounter() as c:
        out = ours(src, tgt, **kw)
        out.square().sum().backward()
    ref.square().sum().backward()
    assert c.ops.count("forward") == 6  # 2 encoder + 2 x 2 decoder attentions
    assert c.ops.count("backward") + c.ops.count("backward_into") == 6
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for (n, p), q in zip(ours.named_parameters(), native.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=n)
    # inference too (the decoder has no fast path; the encoder's is kept off)
    ours.eval()
    native.eval()
    with torch.no_grad(), OpCounter() as c:
        out = ours(src, tgt, **kw)
    assert c.ops.count("forward") == 6
    with torch.no_grad():
        torch.testing.assert_close(out, native(src, tgt, **kw), rtol=1e-5, atol=1e-5)


def test_our_layer_built_directly_has_no_fast_path():
    """Not only replace_attention: a layer given our module as self_attn."""
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True).eval()
    native = copy.deepcopy(layer)
    ours_attn = tma.MultiheadAttention(16, 2, batch_first=True)
    ours_attn.load_state_dict(layer.self_attn.state_dict())
    layer.self_attn = ours_attn
    x = torch.randn(2, 4, 16)
    with torch.no_grad(), OpCounter() as c:
        out = layer(x)
    assert c.ops == ["forward"]
    with torch.no_grad():
        torch.testing.assert_close(out, native(x), rtol=1e-5, atol=1e-5)
