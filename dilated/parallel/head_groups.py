"""Ulysses' all-to-alls pipelined with attention by head groups.

Ulysses (and each row of the Ulysses x ring grid) trades the sequence split for a head split with
all-to-alls, attends over the whole sequence on ``H/P`` heads, and trades the output back. As one
exchange per tensor, nothing overlaps them: the compute stream waits for all of q, k and v before
it attends, and for the output's exchange after. :func:`attend_by_head_groups` cuts this rank's
``H/P`` heads into ``groups`` groups and issues every group's input exchange at once: group ``g``
attends while later groups' inputs arrive and group ``g - 1``'s output goes back, so only the first
group's inputs and the last group's output are waited for. Backward mirrors it: every group's
output-gradient exchange is issued at once, and group ``g``'s q, k, v gradients go back while group
``g + 1``'s backward runs.

Under GQA a group of q heads reads one group of kv heads (:func:`kv_group_of`): with fewer kv heads
per rank than groups, a kv head serves every q group that reads it and moves once, with the first
of them; its gradient goes back with the last. Each of these moves is one exchange of every tensor
it carries (a group's q with its k and v; its dq with their dk and dv:
:class:`~dilated.parallel.all_to_all.AllToAll`).

Rank ``r`` attends on heads ``r*H/P .. (r+1)*H/P - 1`` whatever ``groups`` is: the grouping changes
when bytes move, not which rank computes what. What it costs: each group is a call of its own of
every kernel the attention runs, on a fraction of the heads; it pays where a group's attention is
one call that still fills the GPU (packed documents in one varlen call), not where documents run
in batched calls per length, nor for a ring per group (:func:`head_groups_for`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from .all_to_all import AllToAll
from .sharding import CommStats


def kv_group_of(q_heads: int, kv_heads: int, groups: int) -> list[int]:
    """The kv group each of ``groups`` q-head groups reads, for ``q_heads`` q heads and ``kv_heads``
    kv heads on a rank (q head ``i`` reads kv head ``i // (q_heads // kv_heads)``); raises where a
    group would straddle kv groups or ``groups`` does not divide the q heads."""
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1 or q_heads % groups:
        raise ValueError(f"head_groups must be a positive integer dividing the {q_heads} q heads of a rank, "
                         f"got {groups!r}")
    if kv_heads % groups == 0:  # as many kv groups as q groups
        return list(range(groups))
    if groups % kv_heads == 0:  # one kv head per kv group, read by groups // kv_heads q groups
        return [g // (groups // kv_heads) for g in range(groups)]
    raise ValueError(f"head_groups={groups}: the {kv_heads} kv heads of a rank cannot be cut into groups that each "
                     f"serve whole q groups; use a head_groups that divides {kv_heads} or that {kv_heads} divides")


def check_head_groups(head_groups) -> None:
    """``head_groups`` is ``"auto"`` or a positive integer."""
    if head_groups != "auto" and (isinstance(head_groups, bool) or not isinstance(head_groups, int)
                                  or head_groups < 1):
        raise ValueError(f"head_groups must be 'auto' or a positive integer, got {head_groups!r}")


def head_groups_for(head_groups, q_heads: int, kv_heads: int, one_call: bool) -> int:
    """The count of head groups for ``q_heads`` q and ``kv_heads`` kv heads per rank: ``head_groups``
    (checked by :func:`kv_group_of`), or for ``"auto"`` two where the heads allow it and each group's
    attention is one kernel call (``one_call``: packed documents in one call of a varlen kernel),
    else one. A group costs a call of its own of every kernel the attention runs, on a fraction of
    the heads: where packed documents run in batched calls per document length (cuDNN), that costs
    more than the exchanges it hides (docs/performance/packed-documents.md)."""
    if head_groups != "auto":
        kv_group_of(q_heads, kv_heads, head_groups)
        return head_groups
    if one_call:
        try:
            kv_group_of(q_heads, kv_heads, 2)
            return 2
        except ValueError:  # the heads do not split in two
            pass
    return 1


def _to_heads_blocks(x: torch.Tensor, p: int, groups: int, g: int) -> torch.Tensor:
    """Head group ``g`` of each rank's heads of the sequence shard ``x`` ``[B, n, H, D]`` as blocks
    ``[P, B, n, H/(P*groups), D]``: block ``i`` for rank ``i`` (a copy)."""
    b, n, _, d = x.shape
    return x.view(b, n, p, groups, -1, d)[:, :, :, g].permute(2, 0, 1, 3, 4).contiguous()


def _whole_sequence(recv: torch.Tensor) -> torch.Tensor:
    """Received blocks ``[P, B, n, h, D]`` (rank ``j``'s positions in block ``j``) as the whole
    sequence ``[B, P*n, h, D]`` (a view for one batch row)."""
    p, b, n, h, d = recv.shape
    return recv.transpose(0, 1).reshape(b, p * n, h, d)


def _to_sequence_blocks(x: torch.Tensor, p: int) -> torch.Tensor:
    """A whole-sequence tensor ``x`` ``[B, N, h, D]`` as blocks ``[P, B, N/P, h, D]``: rank ``i``'s
    positions in block ``i`` (a view where that is contiguous, as for one batch row, else a copy)."""
    b, big_n, h, d = x.shape
    return x.reshape(b, p, big_n // p, h, d).transpose(0, 1).contiguous()


def _into_heads(dst: torch.Tensor, recv: torch.Tensor, g: int) -> None:
    """Put received blocks ``[P, B, n, h, D]`` (rank ``j``'s head group ``g`` in block ``j``) into
    ``dst`` ``[B, n, P, groups, h, D]``."""
    dst[:, :, :, g].copy_(recv.permute(1, 2, 0, 3, 4))


@dataclass
class HeadGroupCall:
    """One pipelined call: ``attend(q, k, v)`` on whole-sequence head groups, ``groups`` q-head
    groups per rank reading kv groups ``kv_of``, over ``group``, counted in ``stats``."""
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    groups: int
    kv_of: list[int]
    group: object
    stats: CommStats


class _AttendByHeadGroups(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, call: HeadGroupCall):
        p, groups, kv_groups = dist.get_world_size(call.group), call.groups, call.kv_of[-1] + 1

        q_in, kv_sent = [], set()
        for g, j in enumerate(call.kv_of):  # every input exchange at once, a kv group's with its first reader's q
            parts = [_to_heads_blocks(q, p, groups, g)]
            if j not in kv_sent:
                kv_sent.add(j)
                parts += [_to_heads_blocks(x, p, kv_groups, j) for x in (k, v)]
            q_in.append(AllToAll(parts, call.group, call.stats))
        grad = any(ctx.needs_input_grad[:3])
        kv, graphs, back = {}, [], []
        for g, j in enumerate(call.kv_of):
            came = q_in[g].wait()
            qg = _whole_sequence(came[0])
            if j not in kv:
                kv[j] = [_whole_sequence(x).detach().requires_grad_(grad) for x in came[1:]]
            if grad:
                with torch.enable_grad():
                    leaves = [qg.detach().requires_grad_(), *kv[j]]
                    og = call.attend(*leaves)
                graphs.append((leaves, og))
            else:
                og = call.attend(qg, *kv[j])
            back.append(AllToAll(_to_sequence_blocks(og.detach(), p), call.group, call.stats))
        b, n, h, _ = q.shape
        out = None
        for g, ex in enumerate(back):
            recv = ex.wait()
            if out is None:  # v's head_dim
                out = recv.new_empty(b, n, p, groups, h // (p * groups), recv.shape[-1])
            _into_heads(out, recv, g)
        ctx.call, ctx.graphs, ctx.shapes = call, graphs, (q.shape, k.shape, v.shape)
        return out.view(b, n, h, -1)

    @staticmethod
    def backward(ctx, dout):
        call, graphs = ctx.call, ctx.graphs
        ctx.graphs = None  # each group's graph is used once
        p, groups, kv_groups = dist.get_world_size(call.group), call.groups, call.kv_of[-1] + 1
        dout = dout.contiguous()
        d_in = [AllToAll(_to_heads_blocks(dout, p, groups, g), call.group, call.stats) for g in range(groups)]
        last_reader = {j: g for g, j in enumerate(call.kv_of)}
        dkv_sum, back = {}, []
        for g, j in enumerate(call.kv_of):
            leaves, og = graphs[g]
            grads = torch.autograd.grad(og, leaves, _whole_sequence(d_in[g].wait()))
            dkv_sum[j] = grads[1:] if j not in dkv_sum else [a + c for a, c in zip(dkv_sum[j], grads[1:])]
            parts = [grads[0]]
            if last_reader[j] == g:  # the kv group's gradients are whole: they go back with this group's dq
                parts += dkv_sum.pop(j)
            back.append(AllToAll([_to_sequence_blocks(x, p) for x in parts], call.group, call.stats))
        grads = [dout.new_empty(b, n, p, count, h // (p * count), d)
                 for (b, n, h, d), count in zip(ctx.shapes, (groups, kv_groups, kv_groups))]
        for g, ex in enumerate(back):
            came = ex.wait()
            _into_heads(grads[0], came[0], g)
            for dst, x in zip(grads[1:], came[1:]):
                _into_heads(dst, x, call.kv_of[g])
        return *(x.view(s) for x, s in zip(grads, ctx.shapes)), None


def attend_by_head_groups(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor], *,
                          groups: int, group, stats: CommStats) -> torch.Tensor:
    """``attend`` over the whole sequence on this rank's heads, from and to sequence shards,
    differentiable. ``q`` ``[B, N/P, H, D]`` and ``k``, ``v`` ``[B, N/P, H_kv, D]`` are this rank's
    positions (``H`` and ``H_kv`` divisible by ``P x groups`` and by ``P``, as
    :func:`kv_group_of` says); ``attend(q, k, v)`` takes ``[B, N, h, D]`` head groups of this rank
    and returns their output. Returns this rank's output ``[B, N/P, H, D]``."""
    p = dist.get_world_size(group)
    kv_of = kv_group_of(q.shape[2] // p, k.shape[2] // p, groups)
    call = HeadGroupCall(attend, groups, kv_of, group, stats)
    return _AttendByHeadGroups.apply(q.contiguous(), k.contiguous(), v.contiguous(), call)
