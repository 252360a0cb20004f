"""Passing tensors around a ring of ranks: batched send to the next rank, receive from the previous."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .distributed import CommStats


class RingExchange:
    """Batched send to the next rank and receive from the previous one."""

    def __init__(self, group, stats: CommStats):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size) if group else (self.rank + 1) % self.size
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size) if group else (self.rank - 1) % self.size
        self.stats = stats

    def start(self, sends: tuple[torch.Tensor, ...], tag: int = 0):
        """Send each tensor to next, receive one like it from prev (one batch of messages: no copy
        into one buffer). K/V and dK/dV are in flight together in backward: distinct tags (``tag``
        plus twice the tensor's index) keep gloo from matching one for the other (NCCL matches in
        issue order)."""
        recvs = tuple(torch.empty_like(t) for t in sends)
        ops = []
        for i, (send, recv) in enumerate(zip(sends, recvs)):
            ops += [dist.P2POp(dist.isend, send, self.next, self.group, tag + 2 * i),
                    dist.P2POp(dist.irecv, recv, self.prev, self.group, tag + 2 * i)]
            self.stats.sent(send.numel() * send.element_size())
        return dist.batch_isend_irecv(ops), recvs

    def wait(self, pending) -> tuple[torch.Tensor, ...]:
        reqs, recvs = pending
        with self.stats.waiting(recvs[0].device):
            for r in reqs:
                r.wait()
        return recvs
