"""Ring attention over a :class:`~dilated.DocumentLayout`: only crossing documents' rows travel.

Each rank holds the positions the layout gives it (most documents whole, a few cut head-tail over
every rank). The local pieces need no keys from elsewhere; the pieces of *crossing* documents need
the keys of their documents on the other ranks. Instead of whole K/V shards, each rank packs the
K/V rows of its crossing pieces into one buffer (padded to the largest such count over the ranks)
and the buffers pass around the ring by send/recv: at step s a rank holds rank ``rank - s``'s
buffer and computes its crossing queries against the keys in it (one varlen call of rectangles, or
one call per rectangle), merged by log-sum-exp into the local result; the local pieces are
computed during the first step's transfer. A layout without crossing documents makes no steps.

Backward passes the buffers again; each rank adds its rectangles' dK/dV for the buffer it holds
to a float32 accumulator that travels with it and reaches the buffer's owner one hop after the
last step (as :mod:`dilated.ring_attention` does with whole blocks).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from ._checks import acc_dtype
from .document_attention import DocumentCall, add_crossing_grads, crossing_rows, rank_plan, split_kv
from .document_layout import DocumentLayout
from .merge import merge_
from .ring_exchange import RingExchange


@dataclass(frozen=True, eq=False)
class RingStep:
    """The rectangles of one ring step: ``at``, the crossing query rows they take (indices into the
    plan's ``q_rows``); ``keys``, their key rows in the buffer held at that step; ``cu_q``/``cu_k``:
    their cumulative sizes (empty: nothing to compute at this step)."""

    at: torch.Tensor
    keys: torch.Tensor
    cu_q: tuple
    cu_k: tuple
    _on: dict = field(default_factory=dict, repr=False)

    def on(self, device) -> tuple:
        """``(at, keys)`` on ``device``."""
        key = str(device)
        if key not in self._on:
            self._on[key] = (self.at.to(device), self.keys.to(device))
        return self._on[key]


@functools.lru_cache(maxsize=128)
def ring_steps(layout: DocumentLayout, rank: int) -> tuple[RingStep, ...]:
    """The :class:`RingStep` of each of the ``P`` steps of ``rank`` (step s: the buffer of rank
    ``rank - s``), from the rectangles of :func:`~dilated.document_attention.rank_plan` split by the
    rank their keys live on."""
    plan, p = rank_plan(layout, rank), layout.world_size
    if not plan.rows:
        return ()
    owner = plan.k_slots // plan.rows
    steps = []
    for s in range(p):
        src = (rank - s) % p
        at, keys, cu_q, cu_k = [], [], [0], [0]
        for (qa, qb), (ka, kb) in zip(zip(plan.cu_q, plan.cu_q[1:]), zip(plan.cu_k, plan.cu_k[1:])):
            mine = plan.k_slots[ka:kb][owner[ka:kb] == src] - src * plan.rows
            if mine.numel():
                at.append(torch.arange(qa, qb))
                keys.append(mine)
                cu_q.append(cu_q[-1] + qb - qa)
                cu_k.append(cu_k[-1] + mine.numel())
        empty = torch.zeros(0, dtype=torch.int64)
        steps.append(RingStep(torch.cat(at) if at else empty, torch.cat(keys) if keys else empty, tuple(cu_q),
                              tuple(cu_k)))
    return tuple(steps)


def _crossing_step_forward(call: DocumentCall, step: RingStep, q_cross, buf, acc, acc_lse):
    """Merge the step's rectangles into the crossing rows' ``acc`` / ``acc_lse [B, T, H]``."""
    at, keys = step.on(q_cross.device)
    kr, vr = split_kv(buf.index_select(1, keys), q_cross.shape[3])
    o, lse = call.crossing_forward(q_cross[:, at], kr, vr, step.cu_q, step.cu_k)
    sub, sub_lse = acc[:, at], acc_lse[:, at]
    merge_(sub, sub_lse, o, lse.transpose(1, 2))
    acc[:, at] = sub
    acc_lse[:, at] = sub_lse


def _ring_forward(call: DocumentCall, steps, q, k, v):
    """``(out, lse)``: the local pieces during the first transfer, then each step's rectangles merged
    into the crossing rows."""
    send, q_rows, _ = call.plan.on(q.device)
    ring, buf = RingExchange(call.group, call.stats), crossing_rows(k, v, send, call.plan.rows)
    failure, out, lse = None, None, None
    for s, step in enumerate(steps):
        pending = ring.start((buf,)) if s < len(steps) - 1 else None
        try:
            if s == 0:
                out, lse = call.local_forward(q, k, v)
                acc = out[:, q_rows].to(acc_dtype(q.dtype))
                acc_lse = lse[:, :, q_rows].transpose(1, 2).contiguous()
                q_cross = q[:, q_rows]
            if len(step.cu_q) > 1 and failure is None:
                _crossing_step_forward(call, step, q_cross, buf, acc, acc_lse)
        except Exception as e:  # noqa: BLE001 - raised once the buffers have gone round the ring
            failure = failure or e
        if pending is not None:
            (buf,) = ring.wait(pending)
        call.stats.steps += 1
    if failure is not None:
        raise failure
    out[:, q_rows] = acc.to(out.dtype)
    lse[:, :, q_rows] = acc_lse.transpose(1, 2)
    return out, lse


class _DocumentRingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, call: DocumentCall):
        steps = ring_steps(call.layout, call.rank)
        out, lse = _ring_forward(call, steps, q, k, v) if steps else call.local_forward(q, k, v)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.call = call
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        call = ctx.call
        plan, steps = call.plan, ring_steps(call.layout, call.rank)
        send, q_rows, _ = plan.on(q.device)
        dout, acc = dout.contiguous(), acc_dtype(q.dtype)
        failure, dq, dk, dv = None, None, None, None
        if not steps:
            dq, dk, dv = call.local_backward((dout, q, k, v, out, lse))
            return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None
        ring = RingExchange(call.group, call.stats)
        buf = crossing_rows(k, v, send, plan.rows)
        cross = tuple(t[:, q_rows] for t in (dout, q, out)) + (lse[:, :, q_rows],)
        dq_cross = torch.zeros(cross[1].shape, dtype=acc, device=q.device)
        pending_d = None
        for s, step in enumerate(steps):
            pending = ring.start((buf,)) if s < len(steps) - 1 else None
            grads = None
            try:
                if s == 0:
                    dq, dk, dv = (g.to(acc) for g in call.local_backward((dout, q, k, v, out, lse)))
                if len(step.cu_q) > 1 and failure is None:
                    grads = _crossing_step_backward(call, step, cross, buf, dq_cross)
            except Exception as e:  # noqa: BLE001 - as in forward
                failure = failure or e
            # this buffer's dK/dV: from the previous rank (step 0: a fresh one), plus this rank's part
            d = torch.zeros(buf.shape, dtype=acc, device=q.device) if s == 0 else ring.wait(pending_d)[0]
            if grads is not None:
                d.index_add_(1, grads[0], grads[1])
            pending_d = ring.start((d,), tag=1)  # after the last step: back to its owner
            if pending is not None:
                (buf,) = ring.wait(pending)
            call.stats.steps += 1
        (mine,) = ring.wait(pending_d)
        if failure is not None:
            raise failure
        dq[:, q_rows] += dq_cross
        add_crossing_grads(dk, dv, mine, send)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def _crossing_step_backward(call: DocumentCall, step: RingStep, cross, buf, dq_cross):
    """Add the step's dq to ``dq_cross``; return ``(key rows, dK|dV rows)`` for the buffer held."""
    dout_c, q_c, out_c, lse_c = cross
    at, keys = step.on(q_c.device)
    kr, vr = split_kv(buf.index_select(1, keys), q_c.shape[3])
    dq, dk, dv = call.crossing_backward(dout_c[:, at], q_c[:, at], kr, vr, out_c[:, at],
                                        lse_c[:, :, at].contiguous(), step.cu_q, step.cu_k)
    dq_cross.index_add_(1, at, dq.to(dq_cross.dtype))
    return keys, torch.cat([dk, dv], -1).to(dq_cross.dtype)


def document_ring_attention(q, k, v, call: DocumentCall):
    """Exact attention within documents over the shards of ``call.layout`` (differentiable), the
    crossing documents' rows passed around the ring."""
    return _DocumentRingFunction.apply(q, k, v, call)
