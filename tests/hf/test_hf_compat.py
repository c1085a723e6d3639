"""The seam to transformers (torch_masked_attn/hf/_compat.py): one test per borrowed name of its
table against the installed transformers -- the name exists, with the parameters, attributes,
closure variables and globals the backend relies on -- so that an upgrade which renames one fails
here, by name. Then the seam's own rules: the patterns it reads out of transformers' mask
closures are the masks transformers builds from them; no other module imports transformers; the
methods hf's subclasses override are the table's; the version check and its messages; the tested
range written alike in pyproject.toml, the Makefile and the seam."""

import ast
import importlib
import inspect
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch
from packaging.version import Version

from conftest import require

transformers = require("transformers")

from transformers import ContinuousBatchingConfig, Gemma2Config  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, create_causal_mask, sdpa_mask  # noqa: E402
from transformers.masking_utils import create_sliding_window_causal_mask as create_sliding_mask  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load_compat():
    """The seam, also where importing torch_masked_attn.hf fails on a name transformers no longer
    has: the package's __init__ imported _compat before it failed (the other HF tests then fail to
    import, with the seam's message; the test below names the name)."""
    try:
        from torch_masked_attn.hf import _compat
    except ImportError:
        _compat = sys.modules.get("torch_masked_attn.hf._compat")
        if _compat is None:
            raise
    return _compat


_compat = _load_compat()
BORROWED = _compat.BORROWED
INSTALLED = transformers.__version__


# ---------------------------------------------------------------------------------------------
# One test per borrowed name
# ---------------------------------------------------------------------------------------------


def _causal(b, h, q, kv):
    return kv <= q


# how each closure factory of the table is called, and what its closure variables must then hold
def _probes():
    ids, pos = torch.tensor([[0, 0, 1, 1]]), torch.tensor([[0, 1, 0, 1]])
    return {
        "and_masks": ((_causal,), {"mask_functions": (_causal,)}),
        "sliding_window_overlay": ((3,), {"sliding_window": 3}),
        "packed_sequence_mask_function": ((ids,), {"packed_sequence_mask": ids}),
        "remap_positions_for_packed_sequence": ((_causal, pos), {"mask_function": _causal}),
    }


def _tiny_config():
    """A two-layer Gemma 2 config: one sliding-window layer and one full-attention layer."""
    return Gemma2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=4,
        max_position_embeddings=64,
        pad_token_id=0,
    )


def _pool():
    from transformers.generation.continuous_batching.distributed import DistributedHelper

    cache_cls = _compat.resolve(_compat.TABLE["PagedAttentionCache"])
    cb = ContinuousBatchingConfig(page_size=64, num_blocks=8, max_batch_tokens=64, max_memory_percent=0.05)
    return cache_cls(_tiny_config(), cb, "cpu", DistributedHelper(None, None), dtype=torch.float32)


def _allocator(kind):
    return next(a for a in _pool().cache_allocators.values() if (getattr(a, "sliding_window", None) is None) == kind)


# an instance of each entry with instance attributes
INSTANCES = {
    "DynamicLayer": lambda cls: cls(),
    "ContinuousBatchingConfig": lambda cls: cls(),
    "PagedAttentionCache": lambda cls: _pool(),
    "FullAttentionCacheAllocator": lambda cls: _allocator(True),
    "SlidingAttentionCacheAllocator": lambda cls: _allocator(False),
}


def _function(module: str, qualname: str):
    """module:qualname as a plain function (a property's getter, a decorated function unwrapped)."""
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = inspect.getattr_static(obj, part) if isinstance(obj, type) else getattr(obj, part)
    obj = obj.fget if isinstance(obj, property) else obj
    return inspect.unwrap(getattr(obj, "__func__", obj))


def _check_shape(b, obj):
    """What the backend relies on of ``obj`` (the table's params, attrs, keys, freevars, instance)."""
    if b.params:
        sig = inspect.signature(obj.__init__ if inspect.isclass(obj) else obj)
        missing = [p for p in b.params if p not in sig.parameters]
        assert not missing, f"{b.name}{sig} lacks the parameters {missing}"
    missing = [a for a in b.attrs if not hasattr(obj, a)]
    assert not missing, f"{b.name} lacks the attributes {missing}"
    keys = obj.__annotations__ if inspect.isclass(obj) else obj
    missing = [k for k in b.keys if k not in keys]
    assert not missing, f"{b.name} lacks the keys {missing}"
    if b.freevars:
        args, held = _probes()[b.name]
        made = obj(*args)
        assert _compat.closure(made).keys() >= set(b.freevars), f"{b.name}(...) closes over {made.__code__.co_freevars}"
        for var, value in held.items():
            assert _compat.closure(made)[var] is value or _compat.closure(made)[var] == value, var
    if b.instance:
        inst = INSTANCES[b.name](obj)
        assert isinstance(inst, obj)
        missing = [a for a in b.instance if not hasattr(inst, a)]
        assert not missing, f"a {b.name} lacks the attributes {missing}"


def _check_reads(b, obj):
    """transformers' code reads the names the entry says it reads (a swap takes effect through it)."""
    module = b.swap_in or b.module
    for qualname, name in b.reads:
        fn = _function(module, qualname)
        code = fn.__code__
        assert name in code.co_names or name in code.co_consts, f"{module}:{qualname} no longer reads {name!r}"
        if name == b.name:  # a swapped global: read from the module the seam swaps it in
            assert fn.__globals__ is vars(importlib.import_module(module)), f"{qualname} reads another module's {name}"
            assert getattr(importlib.import_module(module), name) is obj


@pytest.mark.parametrize("b", BORROWED, ids=[b.name for b in BORROWED])
def test_borrowed_name(b):
    """The borrowed name exists in the installed transformers in the shape the backend relies on
    (an entry marked ``since`` is absent before that release, and the backend takes the older path)."""
    if b.since is not None and Version(INSTALLED) < Version(b.since):
        assert _compat.optional(b.name) is None, f"{b.name} exists before {b.since}: the entry's since is wrong"
        return
    obj = _compat.resolve(b)
    _check_shape(b, obj)
    _check_reads(b, obj)


def test_every_instance_and_probe_is_used():
    assert set(INSTANCES) == {b.name for b in BORROWED if b.instance}
    assert set(_probes()) == {b.name for b in BORROWED if b.freevars}


# ---------------------------------------------------------------------------------------------
# The patterns the seam reads out of transformers' mask functions
# ---------------------------------------------------------------------------------------------


def test_mask_patterns_of_transformers_functions():
    mu = importlib.import_module("transformers.masking_utils")
    assert _compat.mask_pattern(mu.causal_mask_function) == ("causal", None)
    assert _compat.mask_pattern(mu.bidirectional_mask_function) == ("bidirectional", None)
    assert _compat.mask_pattern(mu.sliding_window_causal_mask_function(5)) == ("sliding", 5)
    assert _compat.mask_pattern(mu.and_masks(mu.causal_mask_function, _causal)) == (None, None)
    assert _compat.mask_pattern(mu.chunked_causal_mask_function(4, torch.zeros(1, dtype=torch.long))) == (None, None)
    assert _compat.mask_pattern(_causal) == (None, None)


def _spy_mask(config, create, pos):
    """The mask function transformers' create(...) hands the mask interface for packed positions."""
    seen = []
    AttentionMaskInterface.register("tma_spy", lambda *a, **k: seen.append(k["mask_function"]))
    config._attn_implementation = "tma_spy"
    B, L = pos.shape
    create(config, torch.zeros(B, L, config.hidden_size), None, None, position_ids=pos)
    assert len(seen) == 1
    return seen[0]


@pytest.mark.parametrize("window", [None, 3])
def test_packed_pattern_is_transformers_packed_mask(window):
    """transformers' own mask for packed positions (position_ids restarting, no attention_mask):
    the seam reads causal or sliding with the sequence ids, and the mask that reading stands for
    is the one transformers' sdpa_mask builds from the same function."""
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8]])
    cfg = _tiny_config()
    cfg.layer_types = ["full_attention" if window is None else "sliding_attention"] * 2
    cfg.sliding_window = window
    fn = _spy_mask(cfg, create_causal_mask if window is None else create_sliding_mask, pos)
    kind, w, ids = _compat.packed_pattern(fn)
    assert (kind, w) == (("causal", None) if window is None else ("sliding", window))
    B, L = pos.shape
    want = sdpa_mask(B, L, L, mask_function=fn, allow_is_causal_skip=False)[:, 0]
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    ours = (ids[:, :, None] == ids[:, None, :]) & (j <= i)
    if w is not None:
        ours &= j > i - w
    assert torch.equal(ours, want)


# ---------------------------------------------------------------------------------------------
# The seam's rules
# ---------------------------------------------------------------------------------------------


def _package_files():
    pkg = os.path.join(ROOT, "torch_masked_attn")
    for dirpath, _, files in os.walk(pkg):
        for name in files:
            if name.endswith(".py"):
                yield os.path.relpath(os.path.join(dirpath, name), ROOT)


def test_only_the_seam_imports_transformers():
    importers = set()
    for path in _package_files():
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            if any(n == "transformers" or n.startswith("transformers.") for n in names):
                importers.add(path)
    assert importers == {os.path.join("torch_masked_attn", "hf", "_compat.py")}


def test_overridden_methods_are_in_the_table():
    """Each method a class of torch_masked_attn.hf overrides on a borrowed base is in that base's
    entry (attrs), so the per-name test checks it exists."""
    hf = importlib.import_module("torch_masked_attn.hf")
    bases = {id(_compat.optional(b.name)): b for b in BORROWED if inspect.isclass(_compat.optional(b.name))}
    seen = 0
    for cls in vars(hf).values():
        if not (inspect.isclass(cls) and cls.__module__ == hf.__name__):
            continue
        for base in cls.__mro__[1:]:
            b = bases.get(id(base))
            if b is None:
                continue
            seen += 1
            methods = {n for n, v in vars(cls).items() if inspect.isfunction(v) or isinstance(v, property)}
            overridden = {n for n in methods if not n.startswith("__") and hasattr(base, n)}
            assert overridden <= set(b.attrs), f"{cls.__name__} overrides {overridden - set(b.attrs)} of {b.name}"
    assert seen >= 4  # Int8Layer, Int8Cache, _Int8PagedCache, MaskedAttnBatchingManager


def test_layer_pages_of_a_pool():
    """The seam's view of a paged cache's layers: the allocator's group, page size, window and the
    layer type under which continuous batching passes the layer's cu_seq_lens_k."""
    cache = _pool()
    cfg = _tiny_config()
    for layer_idx, layer_type in enumerate(cfg.layer_types):
        layer = _compat.layer_pages(cache, layer_idx)
        assert layer.layer_type == layer_type
        assert (layer.sliding_window is None) == (layer_type == "full_attention")
        assert layer.k_pages.shape[1:] == (layer.page_size, cfg.num_key_value_heads, cfg.head_dim)
        assert layer.k_pages.dtype == torch.float32 and layer.v_pages.shape == layer.k_pages.shape


def test_missing_name_error_names_name_version_and_range():
    b = _compat.Borrowed("no_such_function", "transformers.masking_utils", False)
    with pytest.raises(_compat.TransformersCompatError) as e:
        _compat.resolve(b)
    for part in ("transformers.masking_utils.no_such_function", INSTALLED, _compat.TESTED_TEXT):
        assert part in str(e.value)
    with pytest.raises(_compat.TransformersCompatError, match="'layer_to_allocator' on builtins.object"):
        _compat.layer_pages(object(), 0)


def test_import_fails_clearly_without_a_core_name():
    """import torch_masked_attn.hf where transformers lacks a name registration needs: one error
    naming the name, the installed version and the tested range."""
    code = (
        "import transformers.masking_utils as m\n"
        "vars(m).pop('sliding_window_overlay', None)\n"  # as a release without it
        "import torch_masked_attn.hf"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode != 0
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("torch_masked_attn.hf._compat.TransformersCompatError")
    assert "transformers.masking_utils.sliding_window_overlay" in last and _compat.TESTED_TEXT in last


def test_version_check():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _compat.check_version("5.23.0") and _compat.check_version("5.23.9")
        assert _compat.check_version(_compat.OLDEST)
    for version in ("5.24.0", "5.24.0.dev0", "5.17.0", "4.57.6"):
        with pytest.warns(_compat.TransformersVersionWarning, match=re.escape(_compat.TESTED_TEXT)):
            assert not _compat.check_version(version)


def test_tested_range_written_alike():
    """pyproject.toml's [hf] extra admits the tested range; the Makefile pins a version in it and
    tests its lower bound (make test-hf-oldest)."""
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["hf"]
    req = next(Requirement(r) for r in extra if Requirement(r).name == "transformers")
    assert req.specifier == _compat.TESTED
    with open(os.path.join(ROOT, "Makefile"), encoding="utf-8") as f:
        makefile = f.read()
    pinned = re.search(r"transformers==(\S+)", makefile)
    oldest = re.search(r"^HF_OLDEST\s*:?=\s*(\S+)", makefile, re.M)
    assert pinned and oldest
    assert _compat.TESTED.contains(pinned.group(1)) and _compat.TESTED.contains(oldest.group(1))
    assert oldest.group(1) == _compat.OLDEST
