"""write_kv_cache (masked_attn::cache_write): new key / value rows written into a paged or flat
KV cache in place, against a reference written row by row in Python; padding slots, slots
shared by several rows (the later row wins), strided inputs and caches, and every refusal."""

import pytest
import torch

import torch_masked_attn.functional as tma_F
from conftest import ISAS


def _reference(key, value, kc, vc, slots):
    kc, vc = kc.clone(), vc.clone()
    fk, fv = kc.view(-1, *kc.shape[-2:]), vc.view(-1, *vc.shape[-2:])
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            fk[s], fv[s] = key[t], value[t]
    return kc, vc


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int8])
@pytest.mark.parametrize("layout", ["paged", "flat", "strided"])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_against_reference(dtype, layout, slot_dtype):
    g = torch.Generator().manual_seed(0)
    T, H, D, Dv, pages, page = 37, 3, 16, 8, 12, 16

    def rand(*shape):
        x = torch.randn(*shape, generator=g) * 50
        return x.to(dtype)

    if layout == "paged":
        kc, vc = rand(pages, page, H, D), rand(pages, page, H, Dv)
    elif layout == "flat":
        kc, vc = rand(pages * page, H, D), rand(pages * page, H, Dv)
    else:  # heads outermost (a (H, pages, page, D) buffer seen as pages): nothing contiguous per row
        kc, vc = rand(H, pages, page, D).permute(1, 2, 0, 3), rand(H, pages, page, Dv).permute(1, 2, 0, 3)
    key = rand(H, T, D).transpose(0, 1)  # strided new rows
    value = rand(T, H, Dv)
    slots = torch.randperm(pages * page, generator=g)[:T]
    slots[3] = -1  # padding rows are skipped
    slots[10] = slots[20]  # a shared slot: the later row (20) wins
    slots = slots.to(slot_dtype)
    want_k, want_v = _reference(key, value, kc, vc, slots)
    tma_F.write_kv_cache(key, value, kc, vc, slots)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


def test_one_buffer_for_keys_and_values():
    """transformers' paged cache: keys and values of a layer are views of one buffer, pages interleaved."""
    buf = torch.zeros(8, 2, 4, 2, 8)  # (blocks, k/v, page, H, D)
    kc, vc = buf[:, 0], buf[:, 1]
    key, value = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    slots = torch.tensor([0, 5, 31, 12, 7])
    want_k, want_v = _reference(key, value, kc, vc, slots)
    tma_F.write_kv_cache(key, value, kc, vc, slots)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


def test_many_rows_in_parallel():
    torch.manual_seed(1)
    kc, vc = torch.zeros(64, 64, 4, 32), torch.zeros(64, 64, 4, 32)
    key, value = torch.randn(3000, 4, 32), torch.randn(3000, 4, 32)
    slots = torch.randperm(64 * 64)[:3000]
    want_k, want_v = _reference(key, value, kc, vc, slots)
    tma_F.write_kv_cache(key, value, kc, vc, slots)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


def _args(**over):
    a = dict(
        key=torch.randn(4, 2, 8),
        value=torch.randn(4, 2, 8),
        key_cache=torch.zeros(3, 4, 2, 8),
        value_cache=torch.zeros(3, 4, 2, 8),
        slots=torch.tensor([0, 1, 2, 3]),
    )
    a.update(over)
    return a


@pytest.mark.parametrize(
    "over,match",
    [
        (dict(slots=torch.tensor([0, 1, 2, 12])), "slots"),
        (dict(slots=torch.tensor([0.0, 1, 2, 3])), "slots"),
        (dict(slots=torch.tensor([[0, 1, 2, 3]])), "slots"),
        (dict(slots=torch.tensor([0, 1, 2])), "key"),
        (dict(key=torch.randn(4, 3, 8)), "key"),
        (dict(key=torch.randn(4, 2, 4)), "key"),
        (dict(value=torch.randn(4, 2, 8, dtype=torch.float64)), "value"),
        (dict(key_cache=torch.zeros(3, 4, 2, 8, dtype=torch.bfloat16)), "key"),
        (dict(value_cache=torch.zeros(3, 2, 2, 8)), "key_cache and value_cache"),
        (dict(value_cache=torch.zeros(12, 2, 8)), "key_cache and value_cache"),
        (dict(value_cache=torch.zeros(1, 4, 2, 8), slots=torch.tensor([0, 1, 2, 5])), "slots"),  # 5: key_cache only
        (dict(key_cache=torch.zeros(3, 4, 1, 8).expand(3, 4, 2, 8)), "key_cache"),
        (dict(key_cache=torch.zeros(2, 3, 4, 2, 8)), "key_cache"),
    ],
)
def test_refusals(over, match):
    with pytest.raises((RuntimeError, ValueError, TypeError, IndexError), match=match):
        tma_F.write_kv_cache(**_args(**over))


def test_no_grad_into_cache():
    key = torch.randn(2, 1, 4, requires_grad=True)
    kc = torch.zeros(4, 1, 4)
    tma_F.write_kv_cache(key, key.detach(), kc, torch.zeros(4, 1, 4), torch.tensor([1, 3]))
    assert not kc.requires_grad and torch.equal(kc[1], key[0].detach())


def test_opcheck():
    a = _args()
    torch.library.opcheck(
        torch.ops.masked_attn.cache_write.default, (a["key"], a["value"], a["key_cache"], a["value_cache"], a["slots"])
    )


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_transposed_key_pages_same_bits(isa, dtype):
    """K^T pages (per head a (D, page_size) block, what the continuous-batching path writes) give
    varlen_attn the same bits as row pages for a prefill chunk (the tiles), the same values to
    float rounding for decodes and short chunks (the decode kernel: the tiles' order of the scores
    from K^T pages, dot_rows' from rows), and the pages of the two layouts hold the same written
    values."""
    from conftest import isa_available, run_isa

    if not isa_available(isa):
        pytest.skip(f"this CPU has no {isa}")
    g = torch.Generator().manual_seed(3)
    H, Hkv, D, page, pages = 8, 2, 64, 64, 24
    rows_k = torch.zeros(pages, page, Hkv, D, dtype=dtype)
    rows_v = torch.zeros_like(rows_k)
    t_k = torch.zeros(pages, Hkv, D, page, dtype=dtype).permute(0, 3, 1, 2)  # K^T pages, as (pages, page, H_kv, D)
    t_v = torch.zeros_like(rows_v)
    lens_q, lens_k = [1, 1, 5, 70, 1, 9], [130, 64, 77, 190, 1, 9]
    table = torch.randperm(pages, generator=g)[:24].view(6, 4).to(torch.int32)
    for b, n in enumerate(lens_k):  # each sequence's keys written through the cache op, into both layouts
        k, v = torch.randn(n, Hkv, D, generator=g).to(dtype), torch.randn(n, Hkv, D, generator=g).to(dtype)
        slots = table[b, torch.arange(n) // page].long() * page + torch.arange(n) % page
        tma_F.write_kv_cache(k, v, rows_k, rows_v, slots)
        tma_F.write_kv_cache(k, v, t_k, t_v, slots)
    assert torch.equal(rows_k, t_k) and t_k.stride(1) == 1
    cu_q = torch.tensor([0] + lens_q).cumsum(0).to(torch.int32)
    q = torch.randn(int(cu_q[-1]), H, D, generator=g).to(dtype)
    args = dict(
        seqused_k=torch.tensor(lens_k, dtype=torch.int32), block_table=table, window_size=(-1, 0), enable_gqa=True
    )
    a = run_isa(isa, lambda: tma_F.varlen_attn(q, rows_k, rows_v, cu_q, None, max(lens_q), max(lens_k), **args))
    b = run_isa(isa, lambda: tma_F.varlen_attn(q, t_k, t_v, cu_q, None, max(lens_q), max(lens_k), **args))
    long = slice(int(cu_q[3]), int(cu_q[4]))  # the 70-row chunk
    assert torch.equal(a[long], b[long])
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    # a decode row alone gives the bits it gets in the batch (batch invariance) from K^T pages too
    one = run_isa(
        isa,
        lambda: tma_F.varlen_attn(
            q[:1],
            t_k,
            t_v,
            cu_q[:2],
            None,
            1,
            lens_k[0],
            seqused_k=args["seqused_k"][:1],
            block_table=table[:1],
            window_size=(-1, 0),
            enable_gqa=True,
        ),
    )
    assert torch.equal(one, b[:1])
