"""dilated: long-sequence attention for PyTorch on pluggable local kernels.

Tensors are ``[batch, seq, heads, head_dim]`` throughout.
"""
from .backends import BackendUnavailableError, available_backends, register_backend
from .functional import attention

__version__ = "0.1.0"

__all__ = ["attention", "available_backends", "register_backend", "BackendUnavailableError"]
