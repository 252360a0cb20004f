"""Passing tensors around a ring of ranks: batched send to the next rank, receive from the previous;
and the two collectives relayed round the ring (all-gather, reduce-scatter), their hops issued on a
side stream so that the current stream computes meanwhile."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from .sharding import CommStats


class RingExchange:
    """Batched send to the next rank and receive from the previous one."""

    def __init__(self, group, stats: CommStats):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size) if group else (self.rank + 1) % self.size
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size) if group else (self.rank - 1) % self.size
        self.stats = stats

    def start(self, sends: tuple[torch.Tensor, ...], tag: int = 0, into: tuple[torch.Tensor, ...] | None = None):
        """Send each tensor to next, receive one like it from prev (into ``into`` if given; one
        batch of messages: no copy into one buffer). K/V and dK/dV are in flight together in
        backward: distinct tags (``tag`` plus twice the tensor's index) keep gloo from matching one
        for the other (NCCL matches in issue order)."""
        recvs = into if into is not None else tuple(torch.empty_like(t) for t in sends)
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

    def all_gather(self, mine: torch.Tensor) -> "Relayed":
        """Every rank's ``mine`` (one shape on every rank) relayed round the ring in ``P - 1`` hops:
        :meth:`Relayed.wait` gives ``[P, *mine.shape]`` in rank order."""
        p, r = self.size, self.rank
        out = mine.new_empty(p, *mine.shape)
        out[r].copy_(mine)
        with _side(mine.device) as side:
            for s in range(1, p):
                self._hop(out[(r - s + 1) % p], out[(r - s) % p], 0)
        return Relayed(out, side, self.stats)

    def reduce_scatter(self, blocks: torch.Tensor) -> "Relayed":
        """The sum over ranks of block ``rank`` of ``blocks [P, ...]``, relayed round the ring in
        ``P - 1`` hops (at hop s a rank passes on the partial sum of block ``rank - s``, to which it
        has added its own): :meth:`Relayed.wait` gives ``blocks.shape[1:]``."""
        p, r = self.size, self.rank
        with _side(blocks.device) as side:
            partial = blocks[(r - 1) % p]
            for s in range(1, p):
                got = torch.empty_like(partial)
                self._hop(partial, got, 1)
                partial = got + blocks[(r - 1 - s) % p]
        return Relayed(partial if p > 1 else blocks[0], side, self.stats)

    def _hop(self, send: torch.Tensor, recv: torch.Tensor, tag: int):
        reqs, _ = self.start((send,), tag, into=(recv,))
        for req in reqs:
            req.wait()  # on CUDA the side stream waits; gloo blocks the host
        self.stats.steps += 1


class Relayed:
    """The result of a collective relayed round the ring; :meth:`wait` makes the current stream
    wait for its hops (counted as exposed communication) and returns it."""

    def __init__(self, result: torch.Tensor, side, stats: CommStats):
        self.result, self.side, self.stats = result, side, stats

    def wait(self) -> torch.Tensor:
        if self.side is not None:
            with self.stats.waiting(self.result.device):
                torch.cuda.current_stream(self.result.device).wait_stream(self.side)
        return self.result


_SIDE: dict = {}  # device index -> the stream relayed hops are issued on


@contextlib.contextmanager
def _side(device: torch.device):
    """On CUDA: a side stream, after the work already on the current stream; else no stream."""
    if device.type != "cuda":
        yield None
        return
    if device.index not in _SIDE:
        _SIDE[device.index] = torch.cuda.Stream(device, priority=-1)
    side = _SIDE[device.index]
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        yield side
