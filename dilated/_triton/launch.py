"""Launch sizes shared by the kernels' ops (:mod:`dilated.longnet.rows`, :mod:`dilated.longnet.branch_combine`,
:mod:`dilated.indexed_rows`; the program sizes tried: docs/performance-log.md, the branch combine, "tried, all
slower"), and whether the ops launch Triton kernels at all (:func:`triton_enabled`)."""
from __future__ import annotations

import importlib.util
import os

#: per program: rows x head_dim elements, and the warps that run them
LAUNCH = {"elements": 2048, "num_warps": 4}


def blocks(d: int) -> tuple[int, int]:
    """``(rows, head_dim padded to a power of two)`` per program for head_dim ``d``."""
    block_d = 1 << max(0, d - 1).bit_length()
    return max(1, LAUNCH["elements"] // block_d), block_d


def triton_enabled(device) -> bool:
    """Whether the ops launch their Triton kernels on ``device`` (a ``torch.device``): Triton
    installed, ``DILATED_TRITON`` not ``0``, and a CUDA device or Triton's interpreter
    (``TRITON_INTERPRET=1``)."""
    if os.environ.get("DILATED_TRITON", "1") == "0" or importlib.util.find_spec("triton") is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
