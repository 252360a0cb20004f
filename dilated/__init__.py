"""dilated: long-sequence attention for PyTorch on pluggable local kernels.

Tensors are ``[batch, seq, heads, head_dim]`` throughout. The package: :mod:`dilated.functional`
(``attention``) and the dense pieces at the top, :mod:`dilated.backends` (the local kernels),
:mod:`dilated.longnet` (dilated attention on one device), :mod:`dilated.parallel` (context
parallelism), :mod:`dilated.bench` (the benchmark harness, not imported here).
"""
from . import ops  # noqa: F401  (registers the custom ops torch.compile traces)
from ._checks import UncoveredRowsWarning
from .backends import BackendUnavailableError, available_backends, register_backend
from .functional import attention
from .longnet.dilated_attention import DilatedAttention, dilated_attention
from .longnet.improved_dilated_attention import ImprovedDilatedAttention, improved_dilated_attention
from .longnet.memory_pool import MemoryPool
from .longnet.multihead import MultiheadDilatedAttention
from .longnet.pattern_cache import PatternCache
from .longnet.residue_major import (from_residue_major, residue_major_fast_path_reason, residue_major_positions,
                                    to_residue_major)
from .parallel.agreement import RankMismatchError
from .parallel.decode_attention import decode_attention
from .parallel.distributed_dilated_attention import DistributedDilatedAttention
from .parallel.document_attention import DocumentParallelAttention
from .parallel.document_layout import DocumentLayout
from .parallel.hybrid_attention import HybridAttention
from .parallel.ring_attention import RingAttention, ring_attention
from .parallel.sharding import init_distributed, shard, unshard
from .parallel.ulysses_attention import UlyssesAttention

__version__ = "0.1.0"

__all__ = [
    "attention", "available_backends", "register_backend", "BackendUnavailableError",
    "dilated_attention", "DilatedAttention", "improved_dilated_attention", "ImprovedDilatedAttention",
    "MultiheadDilatedAttention", "MemoryPool", "PatternCache", "decode_attention",
    "to_residue_major", "from_residue_major", "residue_major_positions", "residue_major_fast_path_reason",
    "RingAttention", "ring_attention", "UlyssesAttention", "HybridAttention", "DistributedDilatedAttention",
    "DocumentLayout", "DocumentParallelAttention", "shard", "unshard", "init_distributed",
    "UncoveredRowsWarning", "RankMismatchError",
]
