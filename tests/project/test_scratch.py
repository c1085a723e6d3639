"""The kernels' scratch pool (csrc/shim/common.hpp and pool.cpp, ScratchPool): blocks kept between
calls must never carry one call's data into another's results, must serve
Python threads at once, and release_memory() must return their pages."""

import threading

import pytest
import torch

import torch_masked_attn as tma


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _case(B, H, L, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v, go = (torch.randn(B, H, L, D, generator=g).to(dtype) for _ in range(4))
    kpm = torch.arange(L)[None] >= torch.randint(1, L + 1, (B,), generator=g)[:, None]
    return q, k, v, go, kpm


def _run(case, causal=True):
    q, k, v, go, kpm = case
    q, k, v = (x.clone().requires_grad_(True) for x in (q, k, v))
    out = tma.functional.masked_attention(q, k, v, key_padding_mask=kpm, is_causal=causal)
    out.backward(go)
    return [out.detach(), q.grad, k.grad, v.grad]


# (1, 1, 600, ...): one head, so the single-pass backward splits the keys in chunks whose dq
# partial sums also come from the pool (attn_backward_impl)
CASES = [
    (2, 4, 300, 64, torch.float32),
    (1, 2, 70, 24, torch.bfloat16),
    (3, 1, 129, 80, torch.float16),
    (1, 8, 520, 32, torch.float32),
    (2, 2, 33, 128, torch.float64),
    (1, 1, 600, 64, torch.float32),
]


def test_reused_blocks_never_change_results():
    """Each case computed on fresh blocks, then again after the pool has served larger and
    other-dtype calls (stale data in every block): bit for bit the same."""
    fresh = []
    for i, c in enumerate(CASES):
        tma.release_memory()
        fresh.append(_run(_case(*c, seed=i)))
    for _ in range(2):
        for i, c in reversed(list(enumerate(CASES))):
            got = _run(_case(*c, seed=i))
            assert all(torch.equal(a, b) for a, b in zip(got, fresh[i])), c


def test_python_threads_share_the_pool():
    want = [_run(_case(*c, seed=i)) for i, c in enumerate(CASES)]
    errors = []

    def work(t):
        try:
            for r in range(6):
                i = (t + r) % len(CASES)
                got = _run(_case(*CASES[i], seed=i))
                assert all(torch.equal(a, b) for a, b in zip(got, want[i])), CASES[i]
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_key_chunk_partial_sums_are_pooled():
    """The key-chunked backward's dq / d head_mask partial sums (8 chunks x Lq x D here) are
    scratch from the pool: kept after the call, and stale partial sums from an earlier call never
    reach the next one's gradients (head mask gradient included)."""
    g = torch.Generator().manual_seed(5)
    q, k, v, go = (torch.randn(1, 1, 600, 64, generator=g) for _ in range(4))
    hm = torch.tensor([1.3])

    def grads():
        x = [t.clone().requires_grad_(True) for t in (q, k, v, hm)]
        out = tma.functional.masked_attention(*x[:3], head_mask=x[3], is_causal=True)
        return torch.autograd.grad(out, x, go)

    tma.release_memory()
    first = grads()
    assert tma.ops.scratch_stats()["idle_bytes"] >= 8 * 600 * 64 * 4
    other = torch.randn(1, 1, 600, 64, generator=g, requires_grad=True)  # fills the blocks with other sums
    tma.functional.masked_attention(other, other, other, head_mask=hm.clone().requires_grad_(True)).sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(grads(), first))


def test_release_memory_returns_the_pages():
    old = torch.get_num_threads()
    torch.set_num_threads(16)  # 16 slices of scratch even on a small machine
    try:
        q = torch.randn(1, 16, 16384, 64, dtype=torch.bfloat16)  # bf16 K, V converted per slice: ~8 MB each
        # a variant without tile products (AMX's would pack K, V instead and leave the conversion
        # caches, sized but never touched, out of the resident set)
        isa = next(i for i in ("avx512", "avx2", "scalar") if tma.ops.isa_available(i))
        with tma.ops.use_isa(isa):
            tma.functional.masked_attention(q[:, :, :64], q, q)
        held = tma.ops.scratch_stats()["idle_bytes"]
        assert held >= 64 << 20
        rss = _rss_bytes()
        freed = tma.release_memory()
        assert freed == held and tma.ops.scratch_stats()["idle_bytes"] == 0
        assert rss - _rss_bytes() > held // 2
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("threads", [1, 3, 16])
def test_scratch_is_sized_by_the_work(threads):
    """A call with fewer work chunks than threads takes scratch for its chunks only."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q = torch.randn(1, 1, 64, 32)  # one query block: one work item
        tma.functional.masked_attention(q, q, q)
        one = tma.ops.scratch_stats()["last_call_bytes"]
        q = torch.randn(1, 16, 64, 32)  # 16 work items
        tma.functional.masked_attention(q, q, q)
        many = tma.ops.scratch_stats()["last_call_bytes"]
    finally:
        torch.set_num_threads(old)
    assert many == one * min(threads, 16)
