"""Block skipping for materialised masks (attention_tmpl.h, FN(mask_tile_state)):
an attn_mask tile (64 queries x 64 keys) whose entries all block is never
computed, in the forward (tiles and short query blocks by rows), in the
backward and in its pre-pass for the weights' gradient; a tile
whose entries are all 0 adds nothing. Found by reading the mask, so it holds
for Hugging Face's 4-D causal + padding mask and for packed documents.

  * results equal PyTorch's F.sdpa (flash-attention's rule) and, where the mask
    is one the op can also be given structurally (is_causal + key_padding_mask),
    are bit for bit the structural results;
  * NaN in the k, v of keys whose tiles are all blocked reaches nothing
    (without the skip it reaches every row of those tiles as NaN + -inf);
  * gradcheck in float64 with whole blocked tiles.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.autograd import gradcheck

import torch_masked_attn as tma
from conftest import FMA_ISAS, ISAS, allowed_to_additive, assert_close_ref, isa_available, run_isa
from reference import attention64

tmaF = tma.functional

VARIANTS = ISAS
BITWISE = FMA_ISAS  # AMX tiles round differently: rounding-level agreement only


def _need(isa):
    if not isa_available(isa):
        pytest.skip(f"this CPU has no {isa}")


def _rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=torch.float64).to(dtype)


def hf_allowed(lengths, L, left=False):
    """Hugging Face's 4-D mask (B, 1, L, L), True = take part: causal and key
    padding (right padding, or left padding as in generation), materialised."""
    pos = torch.arange(L)
    lengths = torch.as_tensor(lengths)
    pad = (pos[None] < (L - lengths)[:, None]) if left else (pos[None] >= lengths[:, None])  # (B, L) True = padding
    causal = pos[None, :] <= pos[:, None]
    return causal[None, None] & ~pad[:, None, None, :], pad


def packed_allowed(doc_lengths, causal=True):
    """Block-diagonal (1, 1, L, L) mask of packed documents, as built from
    position_ids, True = take part (causal inside each document)."""
    doc = torch.repeat_interleave(torch.arange(len(doc_lengths)), torch.tensor(doc_lengths))
    m = doc[:, None] == doc[None, :]
    if causal:
        m &= torch.ones(len(doc), len(doc), dtype=torch.bool).tril()
    return m[None, None]


def fwd_bwd(fn, q, k, v, g, gw=None):
    """fn(q, k, v) -> out (or (out, weights)); returns the outputs and d(q, k, v)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    res = fn(q, k, v)
    outs = res if isinstance(res, tuple) else (res,)
    loss = (outs[0] * g).sum()
    if gw is not None:
        loss = loss + (outs[1] * gw).sum()
    loss.backward()
    return tuple(o.detach() for o in outs) + (q.grad, k.grad, v.grad)


_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t):
    return t.contiguous().view(-1).view(_INT[t.element_size()])


def assert_bitwise(got, want, names):
    """Bit for bit, signed zeros and NaN payloads included."""
    for n, a, b in zip(names, got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, n
        assert torch.equal(_bits(a), _bits(b)), (
            f"{n}: not bit for bit ({(a.double() - b.double()).abs().max().item():.3e})"
        )


def sdpa_parity(allowed, q, k, v, g, name):
    """Ours through the F.sdpa drop-in vs F.sdpa, both against float64."""
    ours = fwd_bwd(lambda q, k, v: tmaF.scaled_dot_product_attention(q, k, v, attn_mask=allowed), q, k, v, g)
    theirs = fwd_bwd(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=allowed), q, k, v, g)
    ref = fwd_bwd(
        lambda q, k, v: attention64(q, k, v, attn_mask=allowed_to_additive(allowed)),
        q.double(),
        k.double(),
        v.double(),
        g.double(),
    )
    for n, a, b, r in zip(("out", "dq", "dk", "dv"), ours, theirs, ref):
        assert_close_ref(a, b, r, name=f"{name} {n}")
    return ours


# (B, H, L, D): L off the tiles (the last query block of 2 rows runs by rows)
SHAPES = [(2, 2, 130, 32), (3, 2, 194, 16)]


@pytest.mark.parametrize("isa", VARIANTS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("left", [False, True], ids=["right-pad", "left-pad"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_hf_mask_matches_sdpa_and_structural(isa, shape, left, dtype):
    _need(isa)
    B, H, L, D = shape
    lengths = [L, L // 2 - 7, 20][:B]  # whole padded key blocks in the shorter sequences
    allowed, pad = hf_allowed(lengths, L, left=left)
    q, k, v, g = (_rand(B, H, L, D, dtype=dtype) for _ in range(4))
    got = run_isa(isa, lambda: sdpa_parity(allowed, q, k, v, g, f"{isa} hf"))
    # the same mask given structurally: is_causal + key_padding_mask
    want = run_isa(
        isa,
        lambda: fwd_bwd(
            lambda q, k, v: tmaF.masked_attention(q, k, v, is_causal=True, key_padding_mask=pad), q, k, v, g
        ),
    )
    if isa in BITWISE:
        assert_bitwise(got, want, ("out", "dq", "dk", "dv"))
    else:
        for n, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2, msg=f"{isa} {n}")


@pytest.mark.parametrize("isa", VARIANTS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal-docs", "full-docs"])
def test_packed_documents_match_sdpa(isa, causal):
    _need(isa)
    H, D = 2, 32
    docs = [50, 80, 3, 97]  # boundaries inside tiles, a 3-token document
    L = sum(docs)
    allowed = packed_allowed(docs, causal)
    q, k, v, g = (_rand(1, H, L, D) for _ in range(4))
    run_isa(isa, lambda: sdpa_parity(allowed, q, k, v, g, f"{isa} packed"))


@pytest.mark.parametrize("isa", BITWISE)
def test_packed_documents_on_tile_edges_are_each_document_alone(isa):
    """Documents that start on a tile edge: the packed call gives, bit for bit,
    what each document gives alone under is_causal (every tile of another
    document is skipped; the rest are the same tiles in the same order)."""
    _need(isa)
    H, D = 3, 16
    docs = [64, 128, 70]
    L = sum(docs)
    allowed = packed_allowed(docs)
    q, k, v, g = (_rand(1, H, L, D) for _ in range(4))
    packed = run_isa(
        isa, lambda: fwd_bwd(lambda q, k, v: tmaF.scaled_dot_product_attention(q, k, v, attn_mask=allowed), q, k, v, g)
    )
    s = 0
    for n in docs:
        sl = slice(s, s + n)
        alone = run_isa(
            isa,
            lambda: fwd_bwd(
                lambda q, k, v: tmaF.scaled_dot_product_attention(q, k, v, is_causal=True),
                q[:, :, sl],
                k[:, :, sl],
                v[:, :, sl],
                g[:, :, sl],
            ),
        )
        assert_bitwise([t[:, :, sl] for t in packed], alone, (f"doc@{s} out", "dq", "dk", "dv"))
        s += n


def test_broadcast_and_flattened_masks_skip_alike():
    """The same blocked tiles seen through every mask layout the shim takes:
    (L, L) broadcast, (B, 1, L, L), expanded (B, H, L, L) with stride-0 heads,
    contiguous (B, H, L, L), (B*H, L, L), a transposed view, float -inf."""
    B, H, L, D = 2, 2, 150, 16
    allowed, _ = hf_allowed([L, 60], L)
    q, k, v, g = (_rand(B, H, L, D) for _ in range(4))
    blocked = ~allowed
    call = lambda m: fwd_bwd(lambda q, k, v: tmaF.masked_attention(q, k, v, attn_mask=m), q, k, v, g)  # noqa: E731
    want = call(blocked)
    layouts = {
        "expand": blocked.expand(B, H, L, L),
        "contiguous": blocked.expand(B, H, L, L).contiguous(),
        "flat B*H": blocked.expand(B, H, L, L).reshape(B * H, L, L),
        "transposed view": blocked.transpose(-1, -2).contiguous().transpose(-1, -2),
        "float": torch.zeros(B, 1, L, L).masked_fill(blocked, float("-inf")),
        "float64": torch.zeros(B, 1, L, L, dtype=torch.float64).masked_fill(blocked, float("-inf")),
    }
    for name, m in layouts.items():
        assert_bitwise(call(m), want, (f"{name} out", "dq", "dk", "dv"))
    # (L, L): the causal part alone, broadcast over batch and heads by zero strides
    causal_only = ~hf_allowed([L, L], L)[0][0, 0]
    assert_bitwise(
        call(causal_only),
        fwd_bwd(lambda q, k, v: tmaF.masked_attention(q, k, v, is_causal=True), q, k, v, g),
        ("(L, L) out", "dq", "dk", "dv"),
    )


# ---- NaN in keys whose tiles are all blocked --------------------------------


def _nan_case(L=194, B=2, H=2, D=16, dtype=torch.float32):
    """Batch 1 has 100 real tokens: its keys 128.. (two key blocks) are blocked
    for every query, by the 4-D mask alone. NaN goes into their k and v."""
    allowed, pad = hf_allowed([L, 100], L)
    q, k, v, g = (_rand(B, H, L, D, dtype=dtype) for _ in range(4))
    k_nan, v_nan = k.clone(), v.clone()
    k_nan[1, :, 128:] = float("nan")
    v_nan[1, :, 128:] = float("nan")
    return allowed, q, k, v, k_nan, v_nan, g


@pytest.mark.parametrize("isa", VARIANTS)
@pytest.mark.parametrize("form", ["bool", "float"])
@pytest.mark.parametrize("grad_weights", [False, True], ids=["plain", "grad-weights"])
def test_nan_in_blocked_tiles_reaches_nothing(isa, form, grad_weights):
    """Forward (tiles, and the last 2 rows by rows), the backward, and with a
    loss on the weights the backward's pre-pass and the weights: all finite, and equal to the same call with those keys
    finite (their dk, dv are 0). Without the skip, NaN + -inf = NaN enters
    every row of batch 1."""
    _need(isa)
    allowed, q, k, v, k_nan, v_nan, g = _nan_case()
    m = ~allowed if form == "bool" else torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    gw = torch.randn(2, 2, 194, 194) if grad_weights else None

    def call(k, v):
        fn = lambda q, k, v: tmaF.masked_attention(q, k, v, attn_mask=m, need_weights=grad_weights)  # noqa: E731
        return run_isa(isa, lambda: fwd_bwd(fn, q, k, v, g, gw))

    got = call(k_nan, v_nan)
    names = ("out", "weights", "dq", "dk", "dv") if grad_weights else ("out", "dq", "dk", "dv")
    for n, t in zip(names, got):
        assert torch.isfinite(t).all(), f"{isa} {form}: NaN in the blocked keys reached {n}"
    dk, dv = got[-2], got[-1]
    assert (dk[1, :, 128:] == 0).all() and (dv[1, :, 128:] == 0).all()
    assert_bitwise(got, call(k, v), names)


@pytest.mark.parametrize("isa", VARIANTS)
def test_nan_in_other_document_reaches_nothing(isa):
    """Packed documents: NaN in every k, v of the second document reaches
    neither the first document's outputs and gradients (its tiles against the
    second document are all blocked) nor the first's keys' dk, dv."""
    _need(isa)
    H, D, L = 2, 16, 200
    allowed = packed_allowed([64, 136], causal=False)
    q, k, v, g = (_rand(1, H, L, D) for _ in range(4))
    k[:, :, 64:] = float("nan")
    v[:, :, 64:] = float("nan")
    out, dq, dk, dv = run_isa(
        isa, lambda: fwd_bwd(lambda q, k, v: tmaF.scaled_dot_product_attention(q, k, v, attn_mask=allowed), q, k, v, g)
    )
    for n, t in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.isfinite(t[:, :, :64]).all(), f"{isa}: the second document's NaN reached the first's {n}"


# ---- gradcheck --------------------------------------------------------------


@pytest.fixture
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("mask", ["hf", "packed", "float"])
def test_gradcheck_with_blocked_tiles(mask, _one_thread):
    """L = 130 with 64 x 64 tiles: whole tiles blocked (the causal upper
    triangle, the padded keys of batch 1, other documents), diagonal tiles
    mixed, tiles below all allowed; the last 2 query rows run by rows."""
    L, D = 130, 3
    if mask == "hf":
        allowed, _ = hf_allowed([L, 60], L)
        am = ~allowed
    elif mask == "packed":
        am = ~packed_allowed([40, 24, 66]).expand(2, 1, L, L)
    else:  # float: finite values in allowed places, -inf tiles
        allowed, _ = hf_allowed([L, 60], L)
        am = torch.randn(2, 1, L, L, dtype=torch.float64).masked_fill(~allowed, float("-inf"))
    q, k, v = (torch.randn(2, 1, L, D, dtype=torch.float64, requires_grad=True) for _ in range(3))
    assert gradcheck(lambda q, k, v: tmaF.masked_attention(q, k, v, attn_mask=am), (q, k, v), fast_mode=True)
    # the weights receive a gradient (the backward's pre-pass)
    assert gradcheck(
        lambda q, k, v: tmaF.masked_attention(q, k, v, attn_mask=am, need_weights=True), (q, k, v), fast_mode=True
    )
