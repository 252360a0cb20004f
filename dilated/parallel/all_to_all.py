"""One all-to-all in flight, shared by the pipelined Ulysses exchanges (head groups, document groups)."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .sharding import CommStats


class AllToAll:
    """``send`` exchanged over ``group`` without waiting: in ``P`` equal blocks along dim 0 (block ``i``
    to rank ``i``), or in blocks of ``send_counts[i]`` rows to rank ``i`` and of ``recv_counts[j]``
    rows from rank ``j``. The compute stream waits on it only at :meth:`wait`, which returns what
    came (block ``j`` from rank ``j``). The bytes that leave this rank are counted in ``stats``."""

    def __init__(self, send: torch.Tensor, group, stats: CommStats, send_counts=None, recv_counts=None):
        self.send, self.stats = send, stats
        row_bytes = math.prod(send.shape[1:]) * send.element_size()
        if send_counts is None:
            self.recv = torch.empty_like(send)
            self.work = dist.all_to_all_single(self.recv, send, group=group, async_op=True)
            kept = 1
        else:
            self.recv = send.new_empty(sum(recv_counts), *send.shape[1:])
            self.work = dist.all_to_all_single(self.recv, send, list(recv_counts), list(send_counts), group=group,
                                               async_op=True)
            kept = send_counts[dist.get_rank(group)]
        stats.sent((send.shape[0] - kept) * row_bytes, collective=True)

    def wait(self) -> torch.Tensor:
        with self.stats.waiting(self.recv.device):
            self.work.wait()
        self.send = None  # the exchange is done with it
        return self.recv
