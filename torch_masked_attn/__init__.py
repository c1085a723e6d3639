"""torch_masked_attn: masked multi-head attention and cross-entropy for PyTorch
on CPUs, computed by C11 kernels, offered as drop-in replacements for
nn.MultiheadAttention, F.scaled_dot_product_attention, F.cross_entropy and
nn.CrossEntropyLoss.
"""

from . import functional, ops  # noqa: F401  (ops loads the library and registers the ops)
from .linear_ce import LinearCrossEntropyLoss
from .losses import CrossEntropyLoss, perplexity
from .modules import MultiheadAttention, replace_attention
from .ops import release_memory

__all__ = [
    "functional",
    "MultiheadAttention",
    "CrossEntropyLoss",
    "LinearCrossEntropyLoss",
    "perplexity",
    "release_memory",
    "replace_attention",
]


def _version() -> str:
    """The version, written once: in pyproject.toml's [project] table.

    In a checkout (editable install, or the package on sys.path) that file is
    read, so it is never stale; an installed wheel has no pyproject.toml, and
    its metadata, written from that file at build time, answers."""
    import importlib.metadata
    import os
    import re

    pyproject = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml")
    try:
        with open(pyproject, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        text = ""
    project = re.search(r"^\[project\][ \t]*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
    if project and re.search(r"""^name\s*=\s*["']torch[-_.]masked[-_.]attn["']""", project.group(1), re.M):
        version = re.search(r"""^version\s*=\s*["']([^"']+)["']""", project.group(1), re.M)
        if version:
            return version.group(1)
    try:
        return importlib.metadata.version("torch_masked_attn")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


__version__ = _version()
