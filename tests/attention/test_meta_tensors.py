"""Meta tensors in the raw ops: mixed with CPU tensors they are refused
(naming "one device"); all on meta they give the outputs' shapes."""

import pytest
import torch


def _qkv(B=2, H=2, L=70, D=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, L, D, generator=g, dtype=dtype) for _ in range(4)]


@pytest.mark.parametrize("which", ["attn_mask", "key_padding_mask", "head_mask", "k"])
def test_meta_tensor_mixed_with_cpu_is_refused(which):
    q, k, v, _ = _qkv()
    kw = dict(
        attn_mask=torch.zeros(70, 70), key_padding_mask=torch.zeros(2, 70, dtype=torch.bool), head_mask=torch.ones(2)
    )
    if which == "k":
        k = k.to("meta")
    else:
        kw[which] = kw[which].to("meta")
    with pytest.raises(RuntimeError, match="one device"):
        torch.ops.masked_attn.forward(
            q, k, v, kw["attn_mask"], kw["key_padding_mask"], kw["head_mask"], False, None, False
        )


def test_cross_entropy_meta_weight_is_refused():
    x, t = torch.randn(4, 10), torch.tensor([1, 2, 3, 4])
    with pytest.raises(RuntimeError, match="one device"):
        torch.ops.masked_attn.cross_entropy(x, t, torch.ones(10, device="meta"), "mean", -100, 0.0, 0.0, None, False)


def test_all_meta_still_gives_shapes():
    q = torch.empty(2, 3, 5, 8, device="meta")
    out, lse, w, _ = torch.ops.masked_attn.forward(q, q, q, None, None, None, False, None, False)
    assert out.device.type == "meta" and out.shape == (2, 3, 5, 8) and lse.shape == (2, 3, 5)
