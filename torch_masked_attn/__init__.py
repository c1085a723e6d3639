"""torch_masked_attn: masked multi-head attention and cross-entropy for PyTorch
on CPUs, computed by C11 kernels, offered as drop-in replacements for
nn.MultiheadAttention, F.scaled_dot_product_attention, F.cross_entropy and
nn.CrossEntropyLoss.
"""
from . import ops  # noqa: F401  (loads the library, registers the ops)
from . import functional
from .modules import MultiheadAttention
from .losses import CrossEntropyLoss, LinearCrossEntropyLoss, perplexity

__all__ = ["functional", "MultiheadAttention", "CrossEntropyLoss", "LinearCrossEntropyLoss", "perplexity"]
__version__ = "0.1.0"
