"""The one seam between torch_masked_attn.hf and Hugging Face transformers.

Every transformers name the backend uses comes from here: the importable ones
through :data:`BORROWED` (resolved on first use, ``_compat.sdpa_mask``), the
private attributes, closures and module globals through the functions below.
tests/hf/test_hf_compat.py checks each entry of the table against the installed
transformers (its parameters, attributes, closure variables, the globals its
code reads), so an upgrade that renames one fails one named test.

At import the installed version is compared with the tested range
(:data:`TESTED`): outside it a :class:`TransformersVersionWarning` names the
range, and the backend goes on. A borrowed name transformers no longer has
raises :class:`TransformersCompatError` where it is first needed (importing
``torch_masked_attn.hf`` for registration, masks, attention and Int8Cache;
``hf.apply``; building a continuous-batching manager), naming the name, the
installed version and the tested range (docs/design/13-hugging-face.md).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

try:
    import transformers
except ImportError as e:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "torch_masked_attn.hf needs Hugging Face transformers: pip install 'torch_masked_attn[hf]'"
    ) from e
from packaging.specifiers import SpecifierSet
from packaging.version import Version

if TYPE_CHECKING:  # the real types for pyright; at run time the names resolve through __getattr__
    from transformers import AttentionInterface, ContinuousBatchingManager  # noqa: F401
    from transformers.cache_utils import Cache, DynamicLayer  # noqa: F401
    from transformers.generation.continuous_batching.cache import PagedAttentionCache, PagedAttentionMemoryHandler  # noqa: F401
    from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: F401
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss  # noqa: F401
    from transformers.masking_utils import (  # noqa: F401
        AttentionMaskInterface,
        and_masks,
        bidirectional_mask_function,
        causal_mask_function,
        packed_sequence_mask_function,
        prepare_padding_mask,
        sdpa_mask,
        sliding_window_overlay,
    )
    from transformers.utils.output_capturing import _active_collector  # noqa: F401

# The transformers releases the Hugging Face tests pass on: the oldest (make test-hf-oldest) and
# the newest (make test); pyproject.toml's [hf] extra and the Makefile's pin say the same.
TESTED = SpecifierSet(">=5.18.0,<5.24")
OLDEST = "5.18.0"
TESTED_TEXT = "transformers 5.18.0 to 5.23.x"
VERSION = transformers.__version__


class TransformersVersionWarning(UserWarning):
    """The installed transformers is outside the range torch_masked_attn.hf is tested with."""


class TransformersCompatError(ImportError):
    """transformers lacks a name torch_masked_attn.hf borrows (or has it in another shape)."""


def _versions() -> str:
    return f"transformers {VERSION} is installed; torch_masked_attn.hf is tested with {TESTED_TEXT}"


def missing(what: str) -> TransformersCompatError:
    """The error for a borrowed name (or attribute) the installed transformers does not have."""
    return TransformersCompatError(
        f"torch_masked_attn.hf: transformers has no {what}; {_versions()} "
        "(pip install 'torch_masked_attn[hf]' installs a tested version)"
    )


def check_version(version: str = VERSION) -> bool:
    """True when ``version`` is in the tested range; else warns (TransformersVersionWarning) and returns False."""
    if TESTED.contains(Version(version), prereleases=True):
        return True
    warnings.warn(
        f"torch_masked_attn.hf is tested with {TESTED_TEXT}; transformers {version} is "
        "installed. It may work; a name it no longer has raises TransformersCompatError where it is used.",
        TransformersVersionWarning,
        stacklevel=2,
    )
    return False


check_version()


# ---------------------------------------------------------------------------------------------
# The table of borrowed names
# ---------------------------------------------------------------------------------------------

_CB = "transformers.generation.continuous_batching"


@dataclass(frozen=True)
class Borrowed:
    """A name of transformers that torch_masked_attn.hf relies on, and what it relies on.

    public: importable from ``transformers`` itself or shown in its attention-interface docs;
    else an internal name that may change in any release. params: parameters passed by name (a
    class: its ``__init__``'s); attrs: class attributes and methods read, called or overridden;
    instance: attributes of an instance; keys: keys of a mapping (a TypedDict: its fields);
    freevars: closure variables read from the function it returns; reads: (function, name): the
    transformers function whose code reads that global or attribute (a swap below takes effect
    through it); swap_in: the module whose global ``name`` :func:`swapped` replaces; since: the
    first release that has it (older tested releases lack it: :func:`optional` gives None); when:
    where a missing name raises (:func:`require`): "import" (registration, masks, attention,
    Int8Cache), "apply" (hf.apply) or "serving" (a continuous-batching manager being built)."""

    name: str
    module: str
    public: bool
    params: tuple[str, ...] = ()
    attrs: tuple[str, ...] = ()
    instance: tuple[str, ...] = ()
    keys: tuple[str, ...] = ()
    freevars: tuple[str, ...] = ()
    reads: tuple[tuple[str, str], ...] = ()
    swap_in: str | None = None
    since: str | None = None
    imported: bool = True  # hf takes the object itself (else it only relies on its shape)
    when: str = "import"


_MASK_FN = ("batch_idx", "head_idx", "q_idx", "kv_idx")
_ALLOCATOR = ("_kv_page_views", "index", "tokens_per_page", "bytes_per_block")
# continuous batching's keyword arguments to the attention function (PagedAttentionArgs)
CB_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "read_index", "write_index")
_MAX_Q = ("max_length_q", "max_seqlen_q")  # the step's longest query run: 5.23's name, the name before

BORROWED: tuple[Borrowed, ...] = (
    # registration, masks, attention
    Borrowed("AttentionInterface", "transformers", True, attrs=("register",)),
    Borrowed("AttentionMaskInterface", "transformers.masking_utils", True, attrs=("register",)),
    Borrowed(
        "sdpa_attention_forward",
        "transformers.integrations.sdpa_attention",
        True,
        params=("module", "query", "key", "value", "attention_mask", "dropout", "scaling", "is_causal"),
    ),
    Borrowed(
        "sdpa_mask",
        "transformers.masking_utils",
        True,
        params=(
            *("batch_size", "q_length", "kv_length", "q_offset", "kv_offset", "mask_function", "attention_mask"),
            *("local_size", "allow_is_causal_skip", "allow_is_bidirectional_skip", "use_vmap", "device"),
        ),
    ),
    Borrowed(
        "prepare_padding_mask", "transformers.masking_utils", False, params=("attention_mask", "kv_length", "kv_offset")
    ),
    Borrowed("causal_mask_function", "transformers.masking_utils", False, params=_MASK_FN),
    Borrowed("bidirectional_mask_function", "transformers.masking_utils", False, params=_MASK_FN),
    Borrowed("and_masks", "transformers.masking_utils", False, freevars=("mask_functions",)),
    Borrowed("sliding_window_overlay", "transformers.masking_utils", False, freevars=("sliding_window",)),
    # and_masks(sliding_window_overlay(w), causal_mask_function): recognised by mask_pattern
    Borrowed("sliding_window_causal_mask_function", "transformers.masking_utils", False, imported=False),
    Borrowed("packed_sequence_mask_function", "transformers.masking_utils", False, freevars=("packed_sequence_mask",)),
    Borrowed(
        "remap_positions_for_packed_sequence",
        "transformers.masking_utils",
        False,
        freevars=("mask_function",),
        since="5.23.0",
    ),
    Borrowed("_active_collector", "transformers.utils.output_capturing", False, attrs=("get",)),
    # Int8Cache
    Borrowed("Cache", "transformers.cache_utils", True, params=("layer_class_to_replicate",)),
    Borrowed(
        "DynamicLayer",
        "transformers.cache_utils",
        True,
        attrs=(
            *("lazy_initialization", "update", "get_seq_length", "crop", "reorder_cache"),
            *("batch_select_indices", "batch_repeat_interleave", "reset"),
        ),
        instance=("keys", "values", "is_initialized"),
    ),
    # apply(): the causal-LM loss
    Borrowed("LOSS_MAPPING", "transformers.loss.loss_utils", False, keys=("ForCausalLM",), when="apply"),
    Borrowed("ForCausalLMLoss", "transformers.loss.loss_utils", False, when="apply"),
    Borrowed(
        "PreTrainedModel",
        "transformers",
        True,
        attrs=("loss_function", "get_output_embeddings", "can_generate"),
        reads=(("PreTrainedModel.loss_function", "_loss_function"),),  # a custom loss, read without the property
        imported=False,
        when="apply",
    ),
    Borrowed(
        "PreTrainedConfig", "transformers", True, attrs=("_attn_implementation", "get_text_config"), imported=False
    ),
    # continuous batching
    Borrowed(
        "ContinuousBatchingConfig",
        "transformers",
        True,
        instance=("cpu_offload_space",),
        imported=False,
        when="serving",
    ),
    Borrowed(
        "ContinuousBatchingManager",
        f"{_CB}.continuous_api",
        True,
        params=("model", "generation_config", "continuous_batching_config", "workload_hints"),
        attrs=("switch_to_cb_friendly_attn", "_create_batch_processor"),
        reads=(("ContinuousMixin.init_continuous_batching", "ContinuousBatchingManager"),),
        swap_in=f"{_CB}.continuous_api",
        when="serving",
    ),
    Borrowed(
        "ContinuousMixin",
        f"{_CB}.continuous_api",
        True,
        attrs=("init_continuous_batching",),
        reads=(("ContinuousMixin.init_continuous_batching", "_cached_continuous_batching_manager"),),
        imported=False,
        when="serving",
    ),
    Borrowed(
        "PagedAttentionCache",
        f"{_CB}.cache",
        False,
        params=("config", "continuous_batching_config", "dtype"),
        attrs=("perform_cache_copy",),
        instance=("cache_allocators", "cache_tensor", "layer_to_allocator"),
        reads=(("ContinuousBatchingManager._create_batch_processor", "PagedAttentionCache"),),
        swap_in=f"{_CB}.continuous_api",
        when="serving",
    ),
    Borrowed(
        "PagedAttentionMemoryHandler",
        f"{_CB}.cache",
        False,
        reads=(
            ("PagedAttentionCache.__init__", "PagedAttentionMemoryHandler"),
            ("PagedAttentionMemoryHandler.__init__", "activation_dtype"),
        ),
        swap_in=f"{_CB}.cache",
        when="serving",
    ),
    Borrowed(
        "FullAttentionCacheAllocator",
        f"{_CB}.cache_allocators.full_attention",
        False,
        instance=_ALLOCATOR,
        imported=False,
        when="serving",
    ),
    Borrowed(
        "SlidingAttentionCacheAllocator",
        f"{_CB}.cache_allocators.sliding_attention",
        False,
        instance=(*_ALLOCATOR, "sliding_window"),
        imported=False,
        when="serving",
    ),
    # the keyword arguments continuous batching hands the attention function
    Borrowed(
        "PagedAttentionArgs",
        f"{_CB}.input_outputs",
        False,
        keys=("cache", *CB_KWARGS),
        imported=False,
        when="serving",
    ),
)
TABLE = {b.name: b for b in BORROWED}


def resolve(b: Borrowed) -> Any:
    """The object ``b`` names in the installed transformers; TransformersCompatError if there is none."""
    try:
        return getattr(importlib.import_module(b.module), b.name)
    except (ImportError, AttributeError) as e:
        raise missing(f"{b.module}.{b.name}") from e


def optional(name: str) -> Any:
    """The borrowed ``name``, or None where the installed transformers lacks it."""
    try:
        return resolve(TABLE[name])
    except TransformersCompatError:
        return None


def require(when: str) -> None:
    """Raises TransformersCompatError for the first borrowed name needed ``when`` ("import",
    "apply", "serving") that the installed transformers lacks."""
    for b in BORROWED:
        if b.when == when and b.imported and b.since is None:
            resolve(b)


def __getattr__(name: str) -> Any:  # _compat.sdpa_mask: resolved on first use, then a plain attribute
    b = TABLE.get(name)
    if b is None or not b.imported:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = resolve(b)
    return value


def get(name: str) -> Any:
    """The borrowed ``name`` (this module's functions read them through here: a global lookup
    does not reach __getattr__)."""
    return globals()[name] if name in globals() else __getattr__(name)


@contextlib.contextmanager
def swapped(name: str, replacement: Any):
    """Within the block, transformers' code that reads the global ``name`` (the entry's ``reads``)
    gets ``replacement``: how a subclass of ours is built where transformers constructs its own
    class. Global to the process: not for two threads at once."""
    module = importlib.import_module(TABLE[name].swap_in or TABLE[name].module)
    base = vars(module).get(name)
    if base is None:
        raise missing(f"{module.__name__}.{name}")
    setattr(module, name, replacement)
    try:
        yield base
    finally:
        setattr(module, name, base)


@contextlib.contextmanager
def activations_in(dtype):
    """transformers' PagedAttentionMemoryHandler sizing activations of ``dtype`` under a cache of
    another dtype (it takes one dtype for both), for the PagedAttentionCache built in the block."""
    base = get("PagedAttentionMemoryHandler")

    class Handler(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.activation_dtype = dtype

    with swapped("PagedAttentionMemoryHandler", Handler):
        yield


# ---------------------------------------------------------------------------------------------
# Mask functions: which pattern transformers' closure stands for
# ---------------------------------------------------------------------------------------------


def closure(fn) -> dict:
    """A closure's variables by name ({} for a plain function or anything else)."""
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    return {} if code is None else {name: cell.cell_contents for name, cell in zip(code.co_freevars, cells)}


@functools.cache
def _codes() -> dict[str, Any]:
    """The code objects of the closures the factories return (None for the tensors: the code is all
    that is kept); remap_positions_for_packed_sequence's only where transformers has it."""
    causal, remap = get("causal_mask_function"), optional("remap_positions_for_packed_sequence")
    return {
        "and": get("and_masks")(causal).__code__,
        "sliding": get("sliding_window_overlay")(1).__code__,
        "packed": get("packed_sequence_mask_function")(None).__code__,
        "remap": remap(causal, None).__code__ if remap is not None else None,
    }


def _is(fn, kind: str) -> bool:
    code = _codes()[kind]
    return code is not None and getattr(fn, "__code__", None) is code


def _and_parts(fn) -> tuple | None:
    """The mask functions of an ``and_masks(...)`` closure, else None."""
    parts = closure(fn).get("mask_functions") if _is(fn, "and") else None
    return parts if isinstance(parts, tuple) else None


def mask_pattern(fn) -> tuple[str | None, int | None]:
    """The pattern of one of transformers' mask functions: ('causal', None), ('bidirectional',
    None), ('sliding', window) (sliding_window_causal_mask_function(window)), or (None, None)
    for anything else (overlays, chunks, packed sequences, user functions)."""
    causal = get("causal_mask_function")
    if fn is causal:
        return "causal", None
    if fn is get("bidirectional_mask_function"):
        return "bidirectional", None
    parts = _and_parts(fn)
    if parts is not None and len(parts) == 2 and parts[1] is causal and _is(parts[0], "sliding"):
        window = closure(parts[0]).get("sliding_window")
        if isinstance(window, int) and window > 0:
            return "sliding", window
    return None, None


def packed_pattern(fn) -> tuple[str | None, int | None, Any]:
    """transformers' packed-sequence mask over a causal or sliding pattern: (kind, window, (B, L)
    sequence ids), else (None, None, None). Two layouts: ``and_masks(packed_sequence_mask_function
    (ids), remap_positions_for_packed_sequence(pattern, positions))`` (5.23) and
    ``and_masks(pattern, packed_sequence_mask_function(ids))`` (before: the pattern over the
    packed positions, the same mask inside each sequence)."""
    parts = _and_parts(fn)
    if parts is None or len(parts) != 2:
        return None, None, None
    if _is(parts[0], "packed") and _is(parts[1], "remap"):
        pattern, packed = closure(parts[1]).get("mask_function"), parts[0]
    elif _is(parts[1], "packed"):
        pattern, packed = parts[0], parts[1]
    else:
        return None, None, None
    kind, window = mask_pattern(pattern)
    if kind not in ("causal", "sliding"):
        return None, None, None
    return kind, window, closure(packed).get("packed_sequence_mask")


# ---------------------------------------------------------------------------------------------
# Private attributes of transformers' objects
# ---------------------------------------------------------------------------------------------


def _attr(obj, name: str) -> Any:
    try:
        return getattr(obj, name)
    except AttributeError as e:
        raise missing(f"attribute {name!r} on {type(obj).__module__}.{type(obj).__qualname__}") from e


def wants_attentions() -> bool:
    """True when transformers' output capturing collects attention weights (output_attentions
    through the hooks, not the keyword)."""
    collected = get("_active_collector").get()
    return collected is not None and "attentions" in collected


def attn_implementation(model) -> str:
    return _attr(model.config, "_attn_implementation")


def custom_loss_function(model) -> Any:
    """The loss function set on the model, or None (model.loss_function without the property,
    which warns for loss_type=None)."""
    return getattr(model, "_loss_function", None)


def cached_manager(model) -> Any:
    """The model's persistent continuous-batching manager, or None."""
    return getattr(model, "_cached_continuous_batching_manager", None)


class LayerPages(NamedTuple):
    """The paged cache of one layer as hf's attention reads it: its allocator's group index (the
    position of its read / write indices), page size, layer type and sliding window (None for full
    attention), and the key and value pages, contiguous (pages, page_size, H_kv, D) views of the pool."""

    index: int
    page_size: int
    layer_type: str
    sliding_window: int | None
    k_pages: Any
    v_pages: Any


def _layer_type(allocator) -> str:
    """The key of the allocator's layers in continuous batching's per-type arguments (cu_seq_lens_k):
    its layer_type (5.19 on); before, the type its sliding window implies (as 5.18's flash_paged)."""
    kind = getattr(allocator, "layer_type", None)
    if kind is None:
        kind = "full_attention" if getattr(allocator, "sliding_window", None) is None else "sliding_attention"
    return kind


def layer_pages(cache, layer_idx: int) -> LayerPages:
    """What hf's attention reads of a PagedAttentionCache for one layer (its allocator's fields)."""
    allocator = _attr(cache, "layer_to_allocator")[layer_idx]
    k_pages, v_pages = _attr(allocator, "_kv_page_views")[layer_idx]
    return LayerPages(
        _attr(allocator, "index"),
        _attr(allocator, "tokens_per_page"),
        _layer_type(allocator),
        getattr(allocator, "sliding_window", None),
        k_pages,
        v_pages,
    )


def pool_geometry(cache) -> tuple[Any, dict[str, int], tuple[int, ...]]:
    """A paged cache's pool (one uint8 tensor), each allocator's bytes per block by name, and the
    shape (pages, page_size, H_kv, D) of its first layer's key pages."""
    allocators = _attr(cache, "cache_allocators")
    first = next(iter(allocators.values()))
    k_pages = next(iter(_attr(first, "_kv_page_views").values()))[0]
    blocks = {name: _attr(a, "bytes_per_block") for name, a in allocators.items()}
    return _attr(cache, "cache_tensor"), blocks, tuple(k_pages.shape)


def cb_max_q(kwargs: dict) -> int | None:
    """The step's longest query run, where transformers passes it (else None)."""
    for key in _MAX_Q:
        if kwargs.get(key):
            return int(kwargs[key])
    return None
