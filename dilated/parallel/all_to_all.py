"""One all-to-all in flight, shared by the pipelined Ulysses exchanges (head groups, document groups).

An exchange may carry several tensors at once (a head group's q with its k and v, a group's dq with
its dk and dv): one batch of point-to-point messages, one communication kernel and one latency for
all of them, each tensor received into a contiguous tensor of its own.
"""
from __future__ import annotations

import itertools
import math

import torch.distributed as dist

from .sharding import CommStats


def _starts(counts) -> list[int]:
    return [0, *itertools.accumulate(counts)]


class AllToAll:
    """``send`` (a tensor, or a list of tensors with one count of rows) exchanged over ``group``
    without waiting: in ``P`` equal blocks along dim 0 (block ``i`` to rank ``i``), or in blocks of
    ``send_counts[i]`` rows to rank ``i`` and of ``recv_counts[j]`` rows from rank ``j``. The
    compute stream waits on it only at :meth:`wait`, which returns what came (block ``j`` from
    rank ``j``; a list where ``send`` is one). A list travels as one batch of messages (one kernel),
    each tensor into a contiguous tensor of its own. The bytes that leave this rank are counted in
    ``stats``, as one collective."""

    def __init__(self, send, group, stats: CommStats, send_counts=None, recv_counts=None):
        self.many = isinstance(send, (list, tuple))
        parts = [x.contiguous() for x in send] if self.many else [send]
        self.send, self.stats = parts, stats
        p, me = dist.get_world_size(group), dist.get_rank(group)
        rows = parts[0].shape[0]
        if any(x.shape[0] != rows for x in parts):
            raise ValueError(f"the tensors of one exchange must have one count of rows, got "
                             f"{[x.shape[0] for x in parts]}")
        equal = send_counts is None
        if equal:
            send_counts = recv_counts = [rows // p] * p
        row_bytes = sum(math.prod(x.shape[1:]) * x.element_size() for x in parts)
        stats.sent((rows - send_counts[me]) * row_bytes, collective=True)
        if len(parts) == 1:  # one tensor: one all-to-all
            self.recv = [parts[0].new_empty(sum(recv_counts), *parts[0].shape[1:])]
            splits = (None, None) if equal else (list(recv_counts), list(send_counts))
            self.works = [dist.all_to_all_single(self.recv[0], parts[0], *splits, group=group, async_op=True)]
            return
        self.recv = [x.new_empty(sum(recv_counts), *x.shape[1:]) for x in parts]
        s, r = _starts(send_counts), _starts(recv_counts)
        ops = []
        for j in range(p):
            peer = dist.get_global_rank(group, j) if group is not None else j
            for tag, (x, y) in enumerate(zip(parts, self.recv)):
                if j == me:  # this rank's own block, in stream order
                    y[r[j]:r[j + 1]].copy_(x[s[j]:s[j + 1]])
                    continue
                if send_counts[j]:
                    ops.append(dist.P2POp(dist.isend, x[s[j]:s[j + 1]], peer, group, tag))
                if recv_counts[j]:
                    ops.append(dist.P2POp(dist.irecv, y[r[j]:r[j + 1]], peer, group, tag))
        self.works = dist.batch_isend_irecv(ops) if ops else []

    def wait(self):
        with self.stats.waiting(self.recv[0].device):
            for work in self.works:
                work.wait()
        self.send = None  # the exchange is done with it
        return self.recv if self.many else self.recv[0]
