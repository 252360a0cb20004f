"""Small tensors made on the host (index lists, offsets) put on the device without waiting, and
device tensors that caches keep beyond the call that made them.

``torch.tensor(values, device="cuda")`` copies from pageable memory and synchronizes the stream:
the host waits for every kernel queued before it, so the next launches leave the GPU idle until
the host catches up. A copy from pinned memory with ``non_blocking=True`` is ordered on the stream
like a kernel and returns at once; torch's pinned-memory allocator reuses the block only after the
copy has run.
"""
from __future__ import annotations

import concurrent.futures
import os

import torch

_CACHE_STREAMS: dict = {}  # device index -> the stream on which what caches keep is made


def host_values_on(values, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``values`` as a ``dtype`` tensor on ``device`` and its pinned source (None off CUDA): :func:`host_tensor_on`."""
    return host_tensor_on(torch.tensor(values, dtype=dtype), device)


def host_tensor_on(t: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A host tensor on ``device`` and its pinned source (None off CUDA): on CUDA copied from pinned memory
    without waiting.

    Under CUDA-graph capture the copy becomes a node of the graph, which replays it from the
    pinned source: a caller whose tensor a graph reads must keep both."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device), None
    host = t.pin_memory()
    return host.to(device, non_blocking=True), host


def made_for_a_cache(make, device):
    """``make()``, with the device memory it allocates taken from the device's ordinary pool: for
    tensors a cache keeps beyond the call (a combine's table, a plan's kv-head index).

    ``torch.compile(mode="reduce-overhead")`` runs its first calls with the calling thread's
    allocations routed to the private pool of its CUDA graphs, and refuses to go on ("tensor(s) in
    the cudagraph pool not tracked as outputs") when one of them outlives the call. So ``make``
    runs on a thread of its own and on a stream of its own (routing by stream, as older torch
    does, misses it too). The stream waits for the current one first (a block freed by the cache
    is handed out again only after everything queued before has read it), and the current stream
    waits for it after. While a CUDA graph is being captured ``make`` runs here: its tensors
    belong to the graph's pool, and whoever keeps them keeps them for the graph."""
    device = torch.device(device)
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return make()
    index = device.index if device.index is not None else torch.cuda.current_device()
    current = torch.cuda.current_stream(index)
    side = _CACHE_STREAMS.get(index)
    if side is None:
        side = _CACHE_STREAMS[index] = torch.cuda.Stream(device=index)
    side.wait_stream(current)

    def run():
        with torch.cuda.device(index), torch.cuda.stream(side):
            return make()

    try:
        return _cache_thread().submit(run).result()
    finally:
        current.wait_stream(side)


_THREAD: list = []  # the one thread that makes what caches keep (started at first use)
if hasattr(os, "register_at_fork"):  # a forked child has no such thread: it starts its own
    os.register_at_fork(after_in_child=_THREAD.clear)


def _cache_thread() -> concurrent.futures.ThreadPoolExecutor:
    if not _THREAD:
        _THREAD.append(concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dilated-cache"))
    return _THREAD[0]
