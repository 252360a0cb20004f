"""Ring attention: exact dense attention over a sequence sharded across ranks.

Each rank keeps its query shard; K/V blocks travel around the ring by batched point-to-point
send/recv (``dist.batch_isend_irecv``), double-buffered: the next block is in flight while the
current one is computed. Partial outputs merge by log-sum-exp into a float32 accumulator.

Causal: with ``layout="contiguous"`` rank r computes only blocks from ranks <= r (its own block
square-causal); with ``layout="zigzag"`` (rank r holds chunks r and 2P-1-r of 2P) every step does
the same amount of work: its own block square-causal, an earlier rank's block as all local queries
against that block's first half, a later rank's block as the second half of the local queries
against the whole block.

Backward is a custom autograd Function: K/V travel the ring again, each rank computes its
contribution with the kernel backward given the *merged* output and lse, and the float32 dK/dV
accumulators travel with their block back to its owner (one extra hop at the end).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ._checks import check_qkv
from .backends import get_backend
from .distributed import CommStats
from .functional import attention_backward, attention_forward, default_scale
from .merge import merge_


class _Ring:
    """Batched send to the next rank and receive from the previous one."""

    def __init__(self, group, stats: CommStats):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size) if group else (self.rank + 1) % self.size
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size) if group else (self.rank - 1) % self.size
        self.stats = stats

    def start(self, send: torch.Tensor, tag: int = 0):
        """Send to next, receive from prev. K/V and dK/dV are in flight together in backward:
        distinct tags keep gloo from matching one for the other (NCCL matches in issue order)."""
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, self.next, self.group, tag),
               dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)]
        reqs = dist.batch_isend_irecv(ops)
        self.stats.sent(send.numel() * send.element_size())
        return reqs, recv

    def wait(self, pending):
        reqs, recv = pending
        with self.stats.waiting(recv.device):
            for r in reqs:
                r.wait()
        return recv


def _pack(*ts):
    return torch.cat([t.reshape(-1) for t in ts])


def _unpack(buf, like):
    out, i = [], 0
    for t in like:
        out.append(buf[i:i + t.numel()].view(t.shape))
        i += t.numel()
    return out


def _plan(step_src: int, rank: int, n: int, causal: bool, layout: str):
    """(q slice, kv slice, causal) for the block from ``step_src``, or None to skip it."""
    full = slice(0, n)
    if not causal:
        return full, full, False
    if step_src == rank:
        return full, full, True
    if layout == "contiguous":
        return (full, full, False) if step_src < rank else None
    half = n // 2
    if step_src < rank:
        return full, slice(0, half), False
    return slice(half, n), full, False


def _ring_blocks(ring: _Ring, k, v, n: int, causal: bool, layout: str, overlap: bool):
    """Yield ``(k_block, v_block, plan)`` for each ring step; the next block is in flight meanwhile
    (or, with ``overlap=False``, received before the current one is computed)."""
    rank, p = ring.rank, ring.size
    kv = _pack(k, v)
    for step in range(p):
        pending = ring.start(kv) if step < p - 1 else None
        if pending is not None and not overlap:
            kv_next, pending = ring.wait(pending), None
        kb, vb = _unpack(kv, (k, v))
        yield kb, vb, _plan((rank - step) % p, rank, n, causal, layout)
        if pending is not None:
            kv_next = ring.wait(pending)
        if step < p - 1:
            kv = kv_next
        ring.stats.steps += 1


class _RingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, backend, causal, scale, layout, group, stats, overlap):
        ring = _Ring(group, stats)
        n = q.shape[1]
        acc = torch.zeros(q.shape[:3] + (v.shape[3],), device=q.device, dtype=torch.float32)
        acc_lse = torch.full(q.shape[:3], float("-inf"), device=q.device, dtype=torch.float32)
        for kb, vb, plan in _ring_blocks(ring, k, v, n, causal, layout, overlap):
            if plan is not None:
                qs, ks, c = plan
                o, lse = attention_forward(backend, q[:, qs], kb[:, ks], vb[:, ks], c, scale)
                merge_(acc[:, qs], acc_lse[:, qs], o, lse.transpose(1, 2))
        out = acc.to(q.dtype)
        lse = acc_lse.transpose(1, 2).contiguous()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg = (backend, causal, scale, layout, group, stats, overlap)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        backend, causal, scale, layout, group, stats, overlap = ctx.cfg
        ring = _Ring(group, stats)
        p, n = ring.size, q.shape[1]
        dout = dout.contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        dkv = torch.zeros(k.numel() + v.numel(), device=k.device, dtype=torch.float32)
        pending_d = None
        for kb, vb, plan in _ring_blocks(ring, k, v, n, causal, layout, overlap):
            local = torch.zeros_like(dkv)
            if plan is not None:
                qs, ks, c = plan
                g = attention_backward(backend, dout[:, qs], q[:, qs], kb[:, ks], vb[:, ks], out[:, qs],
                                       lse[:, :, qs].contiguous(), c, scale)
                dq[:, qs] += g[0]
                dk_l, dv_l = _unpack(local, (k, v))
                dk_l[:, ks] += g[1]
                dv_l[:, ks] += g[2]
            if pending_d is not None:
                local += ring.wait(pending_d)  # the accumulator of this block from the previous ranks
            if p > 1:  # pass this block's dK/dV on (after the last step: to its owner)
                pending_d = ring.start(local, tag=1)
        dkv = ring.wait(pending_d) if p > 1 else local
        dk, dv = _unpack(dkv, (k, v))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None, None


class RingAttention(nn.Module):
    """Exact dense attention over the global sequence; ``forward(q, k, v)`` on this rank's shards
    ``[B, N/P, H, D]`` in ``layout`` (see :func:`dilated.shard`). GQA allowed.

    ``overlap=False`` waits for each K/V block before computing (for measuring what overlap buys);
    ``measure_comm=True`` records the time the compute stream stalls on communication in
    ``self.stats`` (a :class:`dilated.distributed.CommStats`; CUDA events, read lazily).
    """

    def __init__(self, *, causal=False, scale=None, backend="auto", layout="contiguous", group=None,
                 overlap: bool = True, measure_comm: bool = False):
        super().__init__()
        from .distributed import LAYOUTS

        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        self.causal, self.scale, self.backend, self.layout, self.group = causal, scale, backend, layout, group
        self.overlap = overlap
        self.stats = CommStats(measure_comm)

    def forward(self, q, k, v):
        check_qkv(q, k, v)
        if k.shape[1] != q.shape[1]:
            raise ValueError(f"q and k/v shards must have one length, got {q.shape[1]} and {k.shape[1]}")
        if not dist.is_initialized():
            raise RuntimeError("RingAttention needs torch.distributed initialised (see dilated.init_distributed)")
        if self.layout == "zigzag" and q.shape[1] % 2:
            raise ValueError(f"zigzag shards hold two chunks: the local length {q.shape[1]} must be even "
                             "(global N divisible by 2 x world size)")
        scale = default_scale(q.shape[-1], self.scale)
        impl = get_backend(self.backend, q, k, self.causal)
        return _RingFunction.apply(q, k, v, impl, self.causal, scale, self.layout, self.group, self.stats,
                                   self.overlap)
