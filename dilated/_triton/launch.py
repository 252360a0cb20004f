"""Launch sizes shared by the gather and combine kernels (:mod:`dilated.longnet.rows`,
:mod:`dilated.longnet.branch_combine`); the program sizes tried: docs/performance-log.md (the branch combine,
"tried, all slower")."""
from __future__ import annotations

#: per program: rows x head_dim elements, and the warps that run them
LAUNCH = {"elements": 2048, "num_warps": 4}


def blocks(d: int) -> tuple[int, int]:
    """``(rows, head_dim padded to a power of two)`` per program for head_dim ``d``."""
    block_d = 1 << max(0, d - 1).bit_length()
    return max(1, LAUNCH["elements"] // block_d), block_d
