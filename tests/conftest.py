"""Shared fixtures and helpers for the torch_masked_attn tests.

Helpers are imported by the test modules with ``from conftest import ...``
(pytest puts this directory on sys.path because tests/ has no __init__.py; the
topic folders have none either, so their test files' names must differ).

Yardsticks (docs/design/10-testing.md):
  * ``reference.attention64`` (tests/reference.py), and ``ref_mha`` on it:
    attention in float64 with plain PyTorch ops, the ground truth;
  * ``assert_close_ref``: flash-attention's rule, our error against the float64
    reference is at most 2x PyTorch's own error against it, plus a small slack.
"""

import importlib
import importlib.util
import os
import zlib

import pytest
import torch
import torch.nn.functional as F
import torch.utils._python_dispatch

from reference import attention64

# Keep the suite fast and deterministic on a 2-core machine.
torch.set_num_threads(min(2, os.cpu_count() or 1))


_SEED_SALT = os.environ.get("TMA_TEST_SEED", "")


# Optional groups: tests that need a package beyond torch, pytest and numpy. make setup installs
# the hf and emulate groups' packages, so a plain run (make test) requires them: a missing one is
# an error naming it, never a skip. A run that cannot have them says so with --without GROUP
# (make test-compat, make test-wheel where pip cannot install transformers beside an old torch):
# then that group's tests skip, naming the option. The vLLM tests (tests/decode/test_vllm*.py:
# engines in their own processes, minutes) are collected only with --vllm (make test-vllm), which
# then requires vLLM.
OPTIONAL_GROUPS = {
    "hf": ("transformers", "tokenizers", "accelerate"),
    "emulate": ("bochscpu",),
    "vllm": ("vllm", "openai"),
}
_without: set = set()


def pytest_addoption(parser):
    parser.addoption(
        "--vllm", action="store_true", help="run the vLLM tests, tests/decode/test_vllm*.py (make test-vllm)"
    )
    parser.addoption(
        "--without",
        action="append",
        default=[],
        choices=[g for g in OPTIONAL_GROUPS if g != "vllm"],
        help="leave out a group whose packages this environment cannot have (its tests skip, naming this option)",
    )


def _missing(group):
    return [m for m in OPTIONAL_GROUPS[group] if importlib.util.find_spec(m) is None]


def pytest_configure(config):
    _without.update(config.getoption("--without"))
    wanted = [g for g in OPTIONAL_GROUPS if g not in _without and (g != "vllm" or config.getoption("--vllm"))]
    missing = {g: _missing(g) for g in wanted}
    missing = {g: m for g, m in missing.items() if m}
    if missing:
        setup = {"vllm": "make vllm-setup"}
        raise pytest.UsageError(
            "; ".join(
                f"the {g} tests need {', '.join(m)}, not installed here ({setup.get(g, 'make setup')} installs "
                + ("them" if len(m) > 1 else "it")
                + ("" if g == "vllm" else f"; --without {g} leaves the group out")
                + ")"
                for g, m in missing.items()
            )
        )


def require(module, import_it=True):
    """The optional group's module, imported (pytest_configure has checked it is installed), or
    this test (module) skipped where the run was started with --without its group."""
    group = next(g for g, mods in OPTIONAL_GROUPS.items() if module in mods)
    if group in _without:
        pytest.skip(f"--without {group}", allow_module_level=True)
    return importlib.import_module(module) if import_it else None


def pytest_ignore_collect(collection_path, config):
    if collection_path.name.startswith("test_vllm") and not config.getoption("--vllm"):
        return True
    return None


def _seed_id(nodeid):
    """The test's id without its topic folder (tests/attention/test_x.py::t -> tests/test_x.py::t):
    the seeds, and so the data every test draws, do not depend on the folder it sits in."""
    path, sep, rest = nodeid.partition("::")
    return "tests/" + path.rsplit("/", 1)[-1] + sep + rest


@pytest.fixture(autouse=True)
def _seed(request):
    """A different but reproducible seed for every test (derived from its id;
    set TMA_TEST_SEED=<anything> to draw other data, e.g. to hunt flakiness)."""
    torch.manual_seed(zlib.crc32((_SEED_SALT + _seed_id(request.node.nodeid)).encode()))
    yield


# --------------------------------------------------------------------------
# dtype helpers
# --------------------------------------------------------------------------

FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)

# Slack added to "2 x PyTorch's error", relative to max |reference| (>= 1).
_REL_SLACK = {
    torch.float64: 1e-11,
    torch.float32: 5e-6,
    torch.float16: 1e-3,
    torch.bfloat16: 8e-3,
}


def rel_slack(dtype):
    return _REL_SLACK[dtype]


# --------------------------------------------------------------------------
# masks
# --------------------------------------------------------------------------


def blocked_to_additive(mask, dtype=torch.float64):
    """nn.MultiheadAttention convention: bool True = blocked -> -inf; float as is."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype).masked_fill(mask, float("-inf"))
    return mask.to(dtype)


def allowed_to_additive(mask, dtype=torch.float64):
    """F.scaled_dot_product_attention convention: bool True = takes part."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, float("-inf"))
    return mask.to(dtype)


def causal_blocked(Lq, Lk):
    """Bool (Lq, Lk), True where key j is after query i (top-left aligned)."""
    return torch.ones(Lq, Lk, dtype=torch.bool).triu(1)


def random_blocked(shape, p=0.35, keep_col0=True):
    """Random bool mask, True = blocked; column 0 kept open so no row is empty."""
    m = torch.rand(shape) < p
    if keep_col0:
        m[..., 0] = False
    return m


def random_additive(shape, p=0.3, keep_col0=True, dtype=torch.float32):
    """Random float mask with finite values and some -inf (column 0 finite)."""
    m = torch.randn(shape, dtype=dtype)
    m = m.masked_fill(random_blocked(shape, p, keep_col0), float("-inf"))
    return m


# --------------------------------------------------------------------------
# nn.MultiheadAttention reference (plain ops; adds head_mask support)
# --------------------------------------------------------------------------


def ref_mha(
    mod,
    query,
    key,
    value,
    key_padding_mask=None,
    need_weights=True,
    attn_mask=None,
    average_attn_weights=True,
    is_causal=False,
    head_mask=None,
):
    """Re-implementation of nn.MultiheadAttention.forward (dropout 0) that
    reads ``mod``'s parameters, computes in the parameters' dtype, gives 0 for
    fully masked rows, and supports a head_mask (H,) or (N, H) applied to the
    probabilities after softmax (weights returned after the head mask)."""
    H = mod.num_heads
    E = mod.embed_dim
    hd = E // H
    batched = query.dim() == 3
    if not batched:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
    elif mod.batch_first:
        query, key, value = (x.transpose(0, 1) for x in (query, key, value))
    L, N, _ = query.shape
    dt = query.dtype

    if mod._qkv_same_embed_dim:
        wq, wk, wv = mod.in_proj_weight.chunk(3)
    else:
        wq, wk, wv = mod.q_proj_weight, mod.k_proj_weight, mod.v_proj_weight
    bq = bk = bv = None
    if mod.in_proj_bias is not None:
        bq, bk, bv = mod.in_proj_bias.chunk(3)
    q = F.linear(query, wq, bq)  # (L, N, E)
    k = F.linear(key, wk, bk)  # (S, N, E)
    v = F.linear(value, wv, bv)

    am = blocked_to_additive(attn_mask, dt)
    kpm = blocked_to_additive(key_padding_mask, dt)
    if am is not None:
        am = am.unsqueeze(0) if am.dim() == 2 else am  # (1 or N*H, L, S)
    if mod.bias_k is not None:
        k = torch.cat([k, mod.bias_k.repeat(1, N, 1)])
        v = torch.cat([v, mod.bias_v.repeat(1, N, 1)])
        if am is not None:
            am = F.pad(am, (0, 1))
        if kpm is not None:
            kpm = F.pad(kpm, (0, 1))
    q = q.reshape(L, N * H, hd).transpose(0, 1)  # (N*H, L, hd)
    k = k.reshape(k.shape[0], N * H, hd).transpose(0, 1)  # (N*H, S, hd)
    v = v.reshape(v.shape[0], N * H, hd).transpose(0, 1)
    if mod.add_zero_attn:
        k = torch.cat([k, k.new_zeros(N * H, 1, hd)], dim=1)
        v = torch.cat([v, v.new_zeros(N * H, 1, hd)], dim=1)
        if am is not None:
            am = F.pad(am, (0, 1))
        if kpm is not None:
            kpm = F.pad(kpm, (0, 1))
    S = k.shape[1]
    bias = torch.zeros(N, H, L, S, dtype=dt)
    if am is not None:
        bias = bias + (am.view(1, 1, L, S) if am.shape[0] == 1 else am.view(N, H, L, S))
    if kpm is not None:
        bias = bias + kpm.view(N, 1, 1, S)
    if is_causal and attn_mask is None:
        bias = bias.masked_fill(causal_blocked(L, S), float("-inf"))
    out, w = attention64(
        q.view(N, H, L, hd),
        k.view(N, H, S, hd),
        v.view(N, H, S, hd),
        attn_mask=bias,
        head_mask=head_mask,
        dtype=dt,
        return_weights=True,
    )
    out = out.permute(2, 0, 1, 3).reshape(L, N, E)
    out = F.linear(out, mod.out_proj.weight, mod.out_proj.bias)
    if average_attn_weights:
        w = w.mean(dim=1)
    if not batched:
        out = out.squeeze(1)
        w = w.squeeze(0)
    elif mod.batch_first:
        out = out.transpose(0, 1)
    return out, (w if need_weights else None)


# --------------------------------------------------------------------------
# tolerance: flash-attention's rule
# --------------------------------------------------------------------------


def max_err(a, b, less=None):
    a = a.detach().double()
    b = b.detach().double()
    d = (a - b).abs() if less is None else ((a - b).abs() - less.double()).clamp(min=0)
    fin = torch.isfinite(a) & torch.isfinite(b)
    # equal infinities count as no error
    same = a == b
    d = torch.where(same, torch.zeros((), dtype=d.dtype), d)
    d = torch.where(fin | same, d, torch.full((), float("inf"), dtype=d.dtype))
    return d.max().item() if d.numel() else 0.0


def assert_close_ref(ours, theirs, ref, *, name="", factor=2.0, slack=None, dtype=None, extra=None):
    """flash-attention's rule:
        max|ours - ref| <= factor * max|theirs - ref| + slack * max(1, max|ref|)
    extra (a tensor broadcasting to ref's shape): a rounding of ours that PyTorch does not do,
    bounded element by element (reference.p_int16_bound), subtracted from |ours - ref| first.
    ``theirs`` is PyTorch's result on the same inputs and dtype (or a list of
    PyTorch results computed in different ways, e.g. its SDPA kernel and plain
    ops; the largest of their errors counts), ``ref`` the float64 reference.
    NaN must appear exactly where PyTorch (the first of the list) has NaN."""
    assert ours is not None, f"{name}: got None"
    assert tuple(ours.shape) == tuple(ref.shape), f"{name}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    if theirs is None:
        theirs = []
    elif isinstance(theirs, torch.Tensor):
        theirs = [theirs]
    theirs = [t for t in theirs if t is not None]
    for t in theirs:
        assert tuple(t.shape) == tuple(ref.shape)
    theirs_nan = theirs[0].detach().isnan() if theirs else ref.detach().isnan()
    ours_nan = ours.detach().isnan()
    assert torch.equal(ours_nan, theirs_nan), (
        f"{name}: NaN pattern differs: ours has {int(ours_nan.sum())} NaN, PyTorch {int(theirs_nan.sum())}"
    )
    keep = ~ours_nan
    o, r = ours.detach()[keep], ref.detach()[keep]
    if dtype is None:
        dtype = ours.dtype
    if slack is None:
        slack = rel_slack(dtype)
    scale = max(1.0, r.double().abs().masked_fill(~torch.isfinite(r.double()), 0).max().item() if r.numel() else 1.0)
    err_ours = max_err(o, r) if extra is None else max_err(o, r, extra.expand_as(ref)[keep])
    err_pt = max([max_err(t.detach()[keep], r) for t in theirs], default=0.0)
    bound = factor * err_pt + slack * scale
    assert err_ours <= bound, (
        f"{name}: max err vs float64 ref {err_ours:.3e} > {factor} * PyTorch err "
        f"{err_pt:.3e} + {slack:.1e} * {scale:.3g} (bound {bound:.3e})"
    )


def assert_close64(ours, theirs, *, name="", atol=1e-10, rtol=1e-9):
    """float64: tight agreement with PyTorch (same NaN pattern)."""
    assert ours is not None, f"{name}: got None"
    torch.testing.assert_close(
        ours.detach(), theirs.detach(), atol=atol, rtol=rtol, equal_nan=True, msg=lambda m: f"{name}: {m}"
    )


# ---- instruction-set variants ------------------------------------------------


def run_isa(isa, fn):
    """fn() with the kernels' variant forced to isa (ops.use_isa)."""
    from torch_masked_attn.ops import use_isa

    with use_isa(isa):
        return fn()


# The kernel variants built for this machine's architecture (ops.built_isas: the C library
# names them), in ma_isa's order: the tests run each against the scalar reference and PyTorch,
# skipping those this CPU lacks. FMA_ISAS: those whose products are float32 FMAs in the scalar
# kernels' order (the same bits); AMX tiles and VDPBF16PS take bfloat16 products and round
# differently.
def _built_isas():
    from torch_masked_attn.ops import built_isas

    return built_isas()


ISAS = _built_isas()
SIMD_ISAS = ISAS[1:]
TILE_ISAS = tuple(i for i in ISAS if i in ("amx", "avx512bf16", "svebf16"))  # the bfloat16 pair products
FMA_ISAS = tuple(i for i in ISAS if i not in TILE_ISAS)


def isa_available(isa):
    """Does this CPU run the isa variant?"""
    from torch_masked_attn.ops import isa_available as available

    return available(isa)


class OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the ops that reach the dispatcher (below autograd), by name:
    ``ops`` the masked_attn::* ones (e.g. "forward", "backward_into"), ``aten``
    the others."""

    def __init__(self):
        super().__init__()
        self.ops, self.aten = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        (self.ops if func.namespace == "masked_attn" else self.aten).append(name)
        return func(*args, **(kwargs or {}))


# The emulated AVX-512 run (tests/project/test_emulated_isa.py) starts as collection ends, beside
# the rest of the suite, where that test is among those selected; it is stopped with the session.
_emulated = []  # its test module, once started


def pytest_collection_finish(session):
    for item in session.items:
        if item.nodeid.endswith("test_emulated_isa.py::test_avx512_and_avx512bf16_on_an_emulated_cpu"):
            item.module.start_in_background()
            _emulated.append(item.module)


def pytest_sessionfinish(session):
    for mod in _emulated:
        mod.stop_background()
