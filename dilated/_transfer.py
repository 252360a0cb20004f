"""Small tensors made on the host (index lists, offsets) put on the device without waiting.

``torch.tensor(values, device="cuda")`` copies from pageable memory and synchronizes the stream:
the host waits for every kernel queued before it, so the next launches leave the GPU idle until
the host catches up. A copy from pinned memory with ``non_blocking=True`` is ordered on the stream
like a kernel and returns at once; torch's pinned-memory allocator reuses the block only after the
copy has run.
"""
from __future__ import annotations

import torch


def host_values_on(values, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``values`` as a ``dtype`` tensor on ``device`` and its pinned source (None off CUDA).

    Under CUDA-graph capture the copy becomes a node of the graph, which replays it from the
    pinned source: a caller whose tensor a graph reads must keep both."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device), None
    host = torch.tensor(values, dtype=dtype).pin_memory()
    return host.to(device, non_blocking=True), host
