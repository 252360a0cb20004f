"""Ring attention: exact dense attention over a sequence sharded across ranks.

Each rank keeps its query shard and computes against one K/V block per step, double-buffered: the
next block is in flight while the current one is computed. Partial outputs merge by log-sum-exp
into a float32 accumulator. How blocks move (``transport``):

* ``"copy_engine"``: each rank publishes its K/V in symmetric memory and, at step s, pulls the
  block of rank ``rank - s`` straight from its owner (:mod:`dilated.peer_copy`): the GPU's copy
  engines move it, no SM is taken from the attention kernel, and only the rows a zigzag step
  needs (the first half of an earlier rank's block) are pulled. CUDA, NCCL, one host.
* ``"p2p"``: blocks are passed around the ring by batched send/recv (``dist.batch_isend_irecv``);
  any backend, any number of hosts.
* ``"auto"``: copy_engine where it is available, else p2p.

Causal: with ``layout="contiguous"`` rank r computes only blocks from ranks <= r (its own block
square-causal); with ``layout="zigzag"`` (rank r holds chunks r and 2P-1-r of 2P) every step does
the same amount of work: its own block square-causal, an earlier rank's block as all local queries
against that block's first half, a later rank's block as the second half of the local queries
against the whole block.

Backward is a custom autograd Function: K/V travel again (same transport), each rank computes its
contribution with the kernel backward given the *merged* output and lse, and the float32 dK/dV
accumulators travel around the ring by send/recv with their block back to its owner (one extra
hop at the end).

A rank whose computation fails (a kernel error, out of memory) keeps passing blocks on for the
rest of the call and raises only then: the other ranks finish the call instead of waiting for a
block that never comes, and a caller that agrees on the outcome across ranks (the benchmark
harness does) can stop them all together.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from . import peer_copy
from ._checks import acc_dtype, check_causal, check_qkv, check_scale, dense_rows
from .backends import get_backend
from .agreement import signature, validate_on_all_ranks
from .distributed import CommStats
from .functional import attention_backward, attention_forward, default_scale
from .merge import empty_accumulators, merge_


TRANSPORTS = ("auto", "copy_engine", "p2p")


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


def _pulled_blocks(ring: _Ring, k, v, n: int, causal: bool, layout: str, overlap: bool):
    """``_ring_blocks`` by copy-engine pulls from each block's owner: the pull of step s + 1 runs on
    a high-priority side stream while step s computes (``overlap=False``: right before it)."""
    rank, p = ring.rank, ring.size
    published = peer_copy.Published(ring.group, [k, v])
    cur, side = torch.cuda.current_stream(k.device), peer_copy.side_stream(k.device)
    plans = [_plan((rank - step) % p, rank, n, causal, layout) for step in range(p)]
    slots = [tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (k, v)) for _ in range(min(2, p - 1))]

    def pull(step):  # into the slot of step - 2, once the compute stream is done with it
        if step >= p or plans[step] is None:
            return None
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            dst = slots[(step - 1) % len(slots)]
            ring.stats.sent(published.pull((rank - step) % p, plans[step][1], dst))
            done = torch.cuda.Event()
            done.record(side)
        return dst, done

    pending = pull(1) if overlap else None
    yield k, v, plans[0]
    ring.stats.steps += 1
    for step in range(1, p):
        got = pending if overlap else pull(step)
        if got is not None:
            with ring.stats.waiting(k.device):
                cur.wait_event(got[1])
        if overlap:
            pending = pull(step + 1)  # its slot was last read by step - 1, already enqueued
        yield (*got[0], plans[step]) if got is not None else (None, None, None)
        ring.stats.steps += 1
    cur.wait_stream(side)


def _blocks(transport: str, ring: _Ring, k, v, n, causal, layout, overlap):
    fn = _pulled_blocks if transport == "copy_engine" and ring.size > 1 else _ring_blocks
    return fn(ring, k, v, n, causal, layout, overlap)


class _RingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, backend, causal, scale, layout, group, stats, overlap, transport):
        ring = _Ring(group, stats)
        n = q.shape[1]
        acc, acc_lse = empty_accumulators(*q.shape[:3], v.shape[3], q.device, acc_dtype(q.dtype))
        failure = None
        for kb, vb, plan in _blocks(transport, ring, k, v, n, causal, layout, overlap):
            if plan is not None and failure is None:
                qs, ks, c = plan
                try:
                    o, lse = attention_forward(backend, q[:, qs], kb[:, ks], vb[:, ks], c, scale)
                    merge_(acc[:, qs], acc_lse[:, qs], o, lse.transpose(1, 2))
                except Exception as e:  # noqa: BLE001 - raised below, after the ring has moved every block
                    failure = e
        if failure is not None:  # the other ranks got every block they wait for; now this one fails
            raise failure
        out = acc.to(q.dtype)
        lse = acc_lse.transpose(1, 2).contiguous()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg = (backend, causal, scale, layout, group, stats, overlap, transport)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        backend, causal, scale, layout, group, stats, overlap, transport = ctx.cfg
        ring = _Ring(group, stats)
        p, n = ring.size, q.shape[1]
        dout = dout.contiguous()
        dq = torch.zeros_like(q, dtype=acc_dtype(q.dtype))
        pending_d, failure = None, None
        for kb, vb, plan in _blocks(transport, ring, k, v, n, causal, layout, overlap):
            g = None
            if plan is not None and failure is None:
                qs, ks, c = plan
                try:
                    g = attention_backward(backend, dout[:, qs], q[:, qs], kb[:, ks], vb[:, ks], out[:, qs],
                                           lse[:, :, qs].contiguous(), c, scale)
                    dq[:, qs] += g[0]
                except Exception as e:  # noqa: BLE001 - raised below, after the ring has moved every block
                    failure, g = e, None
            # this block's accumulator from the previous ranks (received while the kernel ran), to
            # which this rank's part is added in place: one pass over it per step
            if pending_d is not None:
                local = ring.wait(pending_d)
            else:
                local = torch.zeros(k.numel() + v.numel(), device=k.device, dtype=dq.dtype)
            if g is not None:
                dk_l, dv_l = _unpack(local, (k, v))
                dk_l[:, ks] += g[1]
                dv_l[:, ks] += g[2]
                del g
            if p > 1:  # pass this block's dK/dV on (after the last step: to its owner)
                pending_d = ring.start(local, tag=1)
        dkv = ring.wait(pending_d) if p > 1 else local
        if failure is not None:
            raise failure
        dk, dv = _unpack(dkv, (k, v))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None, None, None


class RingAttention(nn.Module):
    """Exact dense attention over the global sequence; ``forward(q, k, v)`` on this rank's shards
    ``[B, N/P, H, D]`` in ``layout`` (see :func:`dilated.shard`). GQA allowed.

    ``transport`` is how K/V blocks move (see the module docstring: ``"auto"``, ``"copy_engine"``,
    ``"p2p"``); ``self.transport_used`` says which the last call took.
    ``overlap=False`` waits for each K/V block before computing (for measuring what overlap buys);
    ``measure_comm=True`` records the time the compute stream stalls on communication in
    ``self.stats`` (a :class:`dilated.distributed.CommStats`; CUDA events, read lazily).
    """

    def __init__(self, *, causal=False, scale=None, backend="auto", layout="contiguous", group=None,
                 overlap: bool = True, measure_comm: bool = False, transport: str = "auto"):
        super().__init__()
        from .distributed import LAYOUTS

        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        check_causal(causal)
        check_scale(scale)
        self.causal, self.scale, self.backend, self.layout, self.group = causal, scale, backend, layout, group
        self._agreed: set = set()  # input signatures all ranks agreed on
        self.overlap, self.transport, self.transport_used = overlap, transport, None
        self.stats = CommStats(measure_comm)

    def _resolve_transport(self, k, v) -> str:
        if self.transport == "p2p":
            return "p2p"
        why = peer_copy.prepare(self.group, k.device, (k.numel() + v.numel()) * k.element_size())
        if why is None:
            return "copy_engine"
        if self.transport == "copy_engine":
            raise ValueError(f"transport='copy_engine' is unavailable here: {why}; use transport='p2p' or 'auto'")
        return "p2p"

    def _validate(self, q, k, v):
        check_qkv(q, k, v)
        if k.shape[1] != q.shape[1]:
            raise ValueError(f"q and k/v shards must have one length, got {q.shape[1]} and {k.shape[1]}")
        if self.layout == "zigzag" and q.shape[1] % 2:
            raise ValueError(f"zigzag shards hold two chunks: the local length {q.shape[1]} must be even "
                             "(global N divisible by 2 x world size)")
        scale = default_scale(q.shape[-1], self.scale)
        impl = get_backend(self.backend, q, k, self.causal, v=v)
        fields = signature(q, k, v, causal=self.causal, scale=scale, layout=self.layout, transport=self.transport,
                           overlap=self.overlap)
        return (impl, scale), fields

    def forward(self, q, k, v):
        if not dist.is_initialized():
            raise RuntimeError("RingAttention needs torch.distributed initialised (see dilated.init_distributed)")
        impl, scale = validate_on_all_ranks(self.group, self._agreed, "RingAttention",
                                            lambda: self._validate(q, k, v))
        q, k, v = dense_rows(q), k.contiguous(), v.contiguous()
        self.transport_used = self._resolve_transport(k, v)
        return _RingFunction.apply(q, k, v, impl, self.causal, scale, self.layout, self.group, self.stats,
                                   self.overlap, self.transport_used)

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's part ``[B, N/P, ...]`` of a global ``[B, N, ...]`` tensor, in this module's layout."""
        from .distributed import shard

        return shard(x, group=self.group, layout=self.layout)

    def unshard(self, x_local: torch.Tensor) -> torch.Tensor:
        """The global tensor from every rank's part (an all-gather), in sequence order."""
        from .distributed import unshard

        return unshard(x_local, group=self.group, layout=self.layout)


_MODULES: dict = {}  # (group, settings) -> RingAttention: the agreed input signatures are kept per module


def ring_attention(q, k, v, *, causal: bool = False, scale: float | None = None, backend: str = "auto",
                   layout: str = "contiguous", group=None, transport: str = "auto"):
    """Functional form of :class:`RingAttention`: exact attention over the global sequence from
    this rank's shards ``[B, N/P, H, D]`` in ``layout`` (see :func:`dilated.shard`); differentiable.
    Calls with the same settings on the same group share one module, so the ranks compare their
    inputs once per signature, not per call."""
    key = (id(group) if group is not None else None, causal, scale, backend, layout, transport)
    module = _MODULES.get(key)
    if module is None:
        module = _MODULES[key] = RingAttention(causal=causal, scale=scale, backend=backend, layout=layout,
                                               group=group, transport=transport)
    return module(q, k, v)
