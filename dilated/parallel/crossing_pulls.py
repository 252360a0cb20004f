"""The crossing rows' exchange of document-parallel attention by copy-engine pulls.

:class:`~dilated.DocumentParallelAttention` gathers every rank's K/V rows of crossing documents while
its local pieces attend, and sums their key gradients onto their owners while the local pieces'
backward runs. As NCCL collectives those transfers are kernels that take SMs from the attention
they overlap and lengthen it by about their own time (the ring's transfers did the same:
docs/performance-log.md); pulled by a GPU's copy engines (:mod:`dilated.parallel.peer_copy`) they
take none. Each exchange runs on the high-priority side stream after the work the current stream
has queued, so the current stream goes on with the local pieces at once:

1. the rank writes its rows into its symmetric buffer between the publication's two barriers (the
   barriers wait for every peer, which is why they are not on the current stream);
2. it pulls what it needs of every peer's buffer: all of it (the K/V rows, forward), or the block
   of rows it owns (the key gradients, backward; summed with its own block in float32 there).

The current stream waits for the side stream only where it reads the result (counted as exposed
communication). Only for CUDA tensors of NCCL groups on one host (:func:`dilated.parallel.peer_copy.prepare`
says why not; the module falls back to the collectives).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import peer_copy
from .sharding import CommStats


def _read_on(side, cur, reads) -> None:
    """The side stream after the current one's queued work, and ``reads`` (made on the current stream)
    kept from reuse until the side stream is done with them."""
    side.wait_stream(cur)
    for t in reads:
        t.record_stream(side)


def publication_bytes(p: int, rows: int, b: int, kv_heads: int, width: int, dtype: torch.dtype,
                      acc: torch.dtype) -> int:
    """The bytes a call publishes at most: its K/V rows (``dtype``, forward) or every rank's block of
    key gradient rows (``acc``, backward), ``width`` channels (keys' and values') a row and head."""
    row = b * kv_heads * width
    return max(rows * row * dtype.itemsize, p * rows * row * acc.itemsize)


class Pulled:
    """Rows pulled on the side stream; :meth:`wait` makes the current stream wait for them (counted as
    exposed communication) and returns them."""

    def __init__(self, result: torch.Tensor, done: torch.cuda.Event, stats: CommStats):
        self.result, self.done, self.stats = result, done, stats

    def wait(self) -> torch.Tensor:
        with self.stats.waiting(self.result.device):
            torch.cuda.current_stream(self.result.device).wait_event(self.done)
        return self.result


def gather_rows(group, stats: CommStats, shape, dtype: torch.dtype, device: torch.device, write, reads=()) -> Pulled:
    """Every rank's rows ``shape = [B, rows, ...]`` (this rank's written by ``write(view)`` into its
    buffer, reading the tensors ``reads``) as ``[P, B, rows, ...]`` in rank order."""
    p, rank = dist.get_world_size(group), dist.get_rank(group)
    out = torch.empty(p, *shape, dtype=dtype, device=device)  # made on the current stream, which reads it
    cur, side = torch.cuda.current_stream(device), peer_copy.side_stream(device)
    _read_on(side, cur, reads)
    with torch.cuda.stream(side):
        published = peer_copy.Published.written(group, [shape], dtype, device, write)
        for owner in range(p):
            nbytes = published.pull(owner, slice(0, shape[1]), [out[owner]])
            if owner != rank:
                stats.sent(nbytes)
        done = torch.cuda.Event()
        done.record(side)
    return Pulled(out, done, stats)


def reduce_rows(group, stats: CommStats, shape, dtype: torch.dtype, device: torch.device, write, reads=()) -> Pulled:
    """This rank's block ``[B, rows, ...]`` of the sum over ranks of their ``shape = [B, P * rows, ...]``
    rows (block r: rank r's rows; this rank's written by ``write(view)`` into its buffer, reading the
    tensors ``reads``), summed in ``dtype``."""
    p, rank = dist.get_world_size(group), dist.get_rank(group)
    b, rows = shape[0], shape[1] // p
    mine = slice(rank * rows, (rank + 1) * rows)
    # made on the current stream, which reads the sum; the second only where more than one peer adds
    total = torch.empty(b, rows, *shape[2:], dtype=dtype, device=device)
    more = torch.empty_like(total) if p > 2 else None
    cur, side = torch.cuda.current_stream(device), peer_copy.side_stream(device)
    _read_on(side, cur, reads)
    with torch.cuda.stream(side):
        published = peer_copy.Published.written(group, [shape], dtype, device, write)
        peers = [owner for owner in range(p) if owner != rank]
        stats.sent(published.pull_rows(peers[0], mine, total))
        total.add_(published.views(rank)[0][:, mine])
        for owner in peers[1:]:
            stats.sent(published.pull_rows(owner, mine, more))
            total.add_(more)
        done = torch.cuda.Event()
        done.record(side)
    return Pulled(total, done, stats)
