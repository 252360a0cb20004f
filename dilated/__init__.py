"""dilated: long-sequence attention for PyTorch on pluggable local kernels.

Tensors are ``[batch, seq, heads, head_dim]`` throughout.
"""
from .backends import BackendUnavailableError, available_backends, register_backend
from .functional import attention
from . import ops  # noqa: F401,E402  (registers the custom ops torch.compile traces)

__version__ = "0.1.0"

__all__ = ["attention", "available_backends", "register_backend", "BackendUnavailableError"]

from .dilated_attention import DilatedAttention, dilated_attention  # noqa: E402
from .improved_dilated_attention import ImprovedDilatedAttention, improved_dilated_attention  # noqa: E402
from .memory_pool import MemoryPool  # noqa: E402
from .pattern_cache import PatternCache  # noqa: E402
from .residue_major import (from_residue_major, residue_major_fast_path_reason, residue_major_positions,  # noqa: E402
                            to_residue_major)

__all__ += ["dilated_attention", "DilatedAttention", "improved_dilated_attention", "ImprovedDilatedAttention",
            "MemoryPool", "PatternCache", "to_residue_major", "from_residue_major", "residue_major_positions",
            "residue_major_fast_path_reason"]
from .multihead import MultiheadDilatedAttention  # noqa: E402

__all__ += ["MultiheadDilatedAttention"]
from .distributed import init_distributed, shard, unshard  # noqa: E402
from .distributed_dilated_attention import DistributedDilatedAttention  # noqa: E402
from .ring_attention import RingAttention, ring_attention  # noqa: E402
from .ulysses_attention import UlyssesAttention  # noqa: E402
from .hybrid_attention import HybridAttention  # noqa: E402
from .document_layout import DocumentLayout  # noqa: E402
from .document_attention import DocumentParallelAttention  # noqa: E402

__all__ += ["RingAttention", "ring_attention", "UlyssesAttention", "HybridAttention", "DistributedDilatedAttention", "shard", "unshard", "init_distributed",
            "DocumentLayout", "DocumentParallelAttention"]
from ._checks import UncoveredRowsWarning  # noqa: E402
from .agreement import RankMismatchError  # noqa: E402

__all__ += ["UncoveredRowsWarning", "RankMismatchError"]
