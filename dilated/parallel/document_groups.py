"""Ulysses' all-to-alls pipelined with attention by groups of packed documents.

On packed documents every document attends alone, so Ulysses can trade the sequence split for the
head split one group of documents at a time. :func:`attend_by_document_groups` issues every group's
input exchange at once (each rank sends the rows of its shard that belong to the group's documents,
to every rank its heads); group ``g`` attends while later groups' rows arrive and group ``g - 1``'s
output goes back, so only the first group's inputs and the last group's output are waited for.
Backward mirrors it. Documents a rank keeps where they lie (:mod:`dilated.parallel.local_documents`)
attend in the same call on all its heads and need no exchange: their first part after the input
exchanges are issued, so that it runs beside them, their second after the last group's output
exchange is issued, so that it runs beside that one (backward: beside the output gradient's
exchange, and beside the q, k, v gradients' exchanges back). Unlike head groups
(:mod:`dilated.parallel.head_groups`), a group's attention holds all of the rank's heads: the kernel
calls are about the ones of one exchange (a length's batched call split where a group boundary falls
inside it).

:func:`document_groups_for` picks the groups: the longest documents up to an eighth of the rows
first (few rows to wait for, the most attention per row to hide the others' exchanges behind), the
next longest as many last (their attention hides the middle group's output), the rest between.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ..indexed_rows import place_rows_
from ..packed import document_calls, split_small_calls
from .all_to_all import AllToAll
from .document_layout import ranges_to_positions
from .sharding import CommStats


def check_document_groups(document_groups) -> None:
    """``document_groups`` is 1, ``"auto"`` or ``"always"``."""
    if document_groups not in (1, "auto", "always") or isinstance(document_groups, bool):
        raise ValueError(f"document_groups must be 1 (one exchange), 'auto' (by groups of packed documents where "
                         f"that makes about the kernel calls of one exchange) or 'always', got {document_groups!r}")


def check_groups_of_one_kind(document_groups, head_groups) -> None:
    """``document_groups="always"`` (pipelined by documents) is not given with ``head_groups`` above 1
    (by heads)."""
    if document_groups == "always" and head_groups not in ("auto", 1):
        raise ValueError(f"document_groups={document_groups!r} pipelines by documents, head_groups={head_groups!r} "
                         f"by heads: give one of them (head_groups='auto' or 1 with document_groups="
                         f"{document_groups!r})")


#: the first and the last group each take the longest documents up to about this share of the rows
EDGE_SHARE = 1 / 8


def document_groups_for(cu: list[int]) -> list[list[int]]:
    """Documents (indices into ``cu``'s documents, each group in sequence order) in the order their
    groups attend: the longest documents up to :data:`EDGE_SHARE` of the rows (at least one) first,
    the next longest as many last, the rest between; fewer groups where there are fewer documents."""
    longest = sorted(range(len(cu) - 1), key=lambda d: cu[d] - cu[d + 1])  # longest first, ties in order
    edges, at = [], 0
    for _ in range(2):
        rows, group = 0, []
        while at < len(longest) - 1 and (not group or rows < EDGE_SHARE * cu[-1]):
            group.append(longest[at])
            rows += cu[longest[at] + 1] - cu[longest[at]]
            at += 1
        edges.append(sorted(group))
    return [g for g in (edges[0], sorted(longest[at:]), edges[1]) if g]


#: ``"auto"`` takes the groups where they make at most this many times one exchange's kernel calls
CALLS_SHARE = 1.25


def groups_to_use(setting, cu: list[int], heads: int, head_dim: int, causal: bool,
                  one_call: bool) -> list[list[int]] | None:
    """The groups a ``document_groups=setting`` call pipelines by (None: one exchange). ``"always"``:
    :func:`document_groups_for` wherever it makes two groups or more. ``"auto"``: only where they
    pay. A group's documents attend in calls of their own, so the groups pay where they make about
    the kernel calls of one exchange: not where the documents run in one varlen call (``one_call``:
    one call per group instead), nor where they make more than :data:`CALLS_SHARE` times the batched
    calls of one exchange (documents of one length: one batched call becomes one per group).
    ``heads``: this rank's query heads after the exchange."""
    if setting == 1:
        return None
    groups = document_groups_for(cu)
    if len(groups) < 2:
        return None
    if setting == "always":
        return groups
    if one_call:
        return None

    def calls(lengths):
        big, small = split_small_calls(document_calls([0, *itertools.accumulate(lengths)], causal), heads,
                                       head_dim, causal)
        return len(big) + bool(small)

    lengths = [b - a for a, b in zip(cu, cu[1:])]
    grouped = sum(calls([lengths[d] for d in g]) for g in groups)
    return groups if grouped <= CALLS_SHARE * calls(lengths) else None


@dataclass(frozen=True)
class RowGroup:
    """One group of documents on a rank of ``P``: ``rows`` the local rows of this rank's shard in it
    (ascending), ``counts[j]`` how many of rank ``j``'s rows are in it, ``cu`` the cumulative lengths
    of its documents packed in sequence order."""

    rows: torch.Tensor
    counts: tuple
    cu: tuple


def row_groups(cu: list[int], groups: list[list[int]], rank: int, p: int, device) -> tuple[RowGroup, ...]:
    """The :class:`RowGroup` of each group of documents (``groups``) for ``rank``'s contiguous shard of
    the ``cu[-1]`` positions over ``p`` ranks (the last few kept: a mix is met again every step)."""
    return _row_groups(tuple(cu), tuple(map(tuple, groups)), rank, p, str(torch.device(device)))


def group_spans(cu, docs, p: int) -> tuple[list[list[tuple[int, int]]], tuple]:
    """Where the documents ``docs`` of ``cu`` lie on ``p`` contiguous shards: per rank its ``(local
    start, length)`` ranges of them, and their cumulative lengths packed in sequence order."""
    n = cu[-1] // p
    spans, packed = [[] for _ in range(p)], [0]
    for d in sorted(docs):
        a, b = cu[d], cu[d + 1]
        for j in range(a // n, (b - 1) // n + 1):
            lo, hi = max(a, j * n), min(b, (j + 1) * n)
            spans[j].append((lo - j * n, hi - lo))
        packed.append(packed[-1] + b - a)
    return spans, tuple(packed)


@functools.lru_cache(maxsize=8)
def _row_groups(cu: tuple, groups: tuple, rank: int, p: int, device: str) -> tuple[RowGroup, ...]:
    out = []
    for docs in groups:
        spans, packed = group_spans(cu, docs, p)
        counts = tuple(sum(m for _, m in mine) for mine in spans)
        rows = ranges_to_positions([s for s, _ in spans[rank]], [m for _, m in spans[rank]], device)
        out.append(RowGroup(rows, counts, packed))
    return tuple(out)


def _to_heads(x: torch.Tensor, rows: torch.Tensor, p: int) -> torch.Tensor:
    """Rows ``rows`` of the shard ``x`` ``[B, n, H, D]`` as ``[P * B * r, H/P, D]``: block ``i`` (rank
    ``i``'s heads of those rows, batch-major) first to last (one copy)."""
    b, n, h, d = x.shape
    return x.view(b, n, p, h // p, d).permute(2, 0, 1, 3, 4).index_select(2, rows).view(-1, h // p, d)


def _whole_group(recv: torch.Tensor, counts, b: int) -> torch.Tensor:
    """Received blocks (rank ``j``'s ``counts[j]`` rows, batch-major) as the group's packed sequence
    ``[B, N_g, h, D]`` (a view for one batch row)."""
    if b == 1:
        return recv.unsqueeze(0)
    blocks = torch.split(recv, [b * c for c in counts])
    return torch.cat([x.view(b, c, *x.shape[1:]) for x, c in zip(blocks, counts)], 1)


def _to_ranks(x: torch.Tensor, counts) -> torch.Tensor:
    """A group's packed ``[B, N_g, h, D]`` as ``[B * N_g, h, D]`` in blocks of rank ``j``'s rows
    (batch-major; a view for one batch row)."""
    b = x.shape[0]
    if b == 1:
        return x[0]
    return torch.cat([y.reshape(-1, *x.shape[2:]) for y in torch.split(x, list(counts), 1)])


def _into_rows(dst: torch.Tensor, recv: torch.Tensor, rows: torch.Tensor, p: int) -> None:
    """Put received ``[P * B * r, h, D]`` (rank ``i``'s heads of this rank's ``rows`` in block ``i``)
    into ``dst`` ``[B, n, P * h, D]`` at ``rows``: block ``i`` into heads ``i * h .. (i + 1) * h - 1``
    (:func:`~dilated.indexed_rows.place_rows_`, one pass each)."""
    b, n, _, d = dst.shape
    h = recv.shape[1]
    heads, blocks = dst.view(b, n, p, h, d), recv.view(p, b, -1, h, d)
    for i in range(p):
        place_rows_(heads[:, :, i], rows, blocks[i])


@dataclass
class DocumentGroupCall:
    """One pipelined call: ``attend(q, k, v, cu)`` on a group's packed documents (all of this rank's
    heads; a list: one per group), the groups' :class:`RowGroup` s, over ``group``, counted in
    ``stats``; ``local``: the parts of the documents this rank attends where they lie
    (:meth:`~dilated.parallel.local_documents.LocalDocuments.parts`), each its rows (a slice, or an
    index tensor) and their cumulative lengths packed in that order: the first attends before the
    groups, the others after them; ``()`` where it keeps none; ``local_attend`` attends them (default
    ``attend``)."""
    attend: Callable
    groups: list
    group: object
    stats: CommStats
    local: tuple = ()
    local_attend: Callable | None = None


def _take_rows(x: torch.Tensor, rows) -> torch.Tensor:
    """Rows ``rows`` (a slice: a view; an index tensor: a copy) of ``x`` ``[B, n, ...]``."""
    return x[:, rows] if isinstance(rows, slice) else x.index_select(1, rows)


def _put_rows(dst: torch.Tensor, rows, x: torch.Tensor) -> None:
    """Write ``x`` into rows ``rows`` (a slice or an index tensor) of ``dst`` ``[B, n, H, D]``
    (:func:`~dilated.indexed_rows.place_rows_`: ``index_copy_`` writes such rows at a fraction of the
    memory's rate)."""
    if isinstance(rows, slice):
        dst[:, rows] = x
    else:
        place_rows_(dst, rows, x)


def _attend_graph(attend, qkv, cu, grad: bool):
    """``attend(*qkv, cu)``, and with ``grad`` the leaves and output whose graph the backward differentiates."""
    if not grad:
        return attend(*qkv, cu), None
    with torch.enable_grad():
        leaves = [x.detach().requires_grad_() for x in qkv]
        og = attend(*leaves, cu)
    return og.detach(), (leaves, og)


class _AttendByDocumentGroups(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, call: DocumentGroupCall):
        p, b = dist.get_world_size(call.group), q.shape[0]

        def send(rg):  # a group's q, k and v rows in one exchange
            mine = rg.counts[dist.get_rank(call.group)]
            return AllToAll([_to_heads(x, rg.rows, p) for x in (q, k, v)], call.group, call.stats, [b * mine] * p,
                            [b * c for c in rg.counts])

        inputs = [send(rg) for rg in call.groups]  # every input exchange at once
        grad = any(ctx.needs_input_grad[:3])

        def own(rows, cu):  # this rank's own documents, on all its heads, beside an exchange
            return _attend_graph(call.local_attend or call.attend, [_take_rows(x, rows) for x in (q, k, v)], cu, grad)

        local = [own(*part) for part in call.local[:1]]  # beside the input exchanges
        graphs, back = [], []
        attends = call.attend if isinstance(call.attend, list) else [call.attend] * len(call.groups)
        for rg, ex, attend in zip(call.groups, inputs, attends):
            og, graph = _attend_graph(attend, [_whole_group(x, rg.counts, b) for x in ex.wait()], rg.cu, grad)
            graphs.append(graph)
            back.append(_back([og], rg, call, b))
        local += [own(*part) for part in call.local[1:]]  # beside the last group's output exchange
        out = q.new_empty(*q.shape[:3], v.shape[3])
        for (rows, _), (og, _) in zip(call.local, local):
            _put_rows(out, rows, og)
        for rg, ex in zip(call.groups, back):
            _into_rows(out, ex.wait()[0], rg.rows, p)
        ctx.call, ctx.graphs, ctx.local_graphs = call, graphs, [graph for _, graph in local]
        ctx.shapes = (q.shape, k.shape, v.shape)
        return out

    @staticmethod
    def backward(ctx, dout):
        call, graphs, local_graphs = ctx.call, ctx.graphs, ctx.local_graphs
        ctx.graphs = ctx.local_graphs = None  # each graph is used once
        p, b = dist.get_world_size(call.group), dout.shape[0]
        me = dist.get_rank(call.group)
        dout = dout.contiguous()
        d_in = [AllToAll(_to_heads(dout, rg.rows, p), call.group, call.stats, [b * rg.counts[me]] * p,
                         [b * c for c in rg.counts]) for rg in call.groups]
        out = [dout.new_empty(s) for s in ctx.shapes]

        def own(part, graph):  # the gradients of this rank's own documents, beside an exchange
            rows, (leaves, og) = part[0], graph
            for dst, g in zip(out, torch.autograd.grad(og, leaves, _take_rows(dout, rows))):
                _put_rows(dst, rows, g)

        for part, graph in zip(call.local[:1], local_graphs[:1]):  # beside the output gradient's exchange
            own(part, graph)
        back = []
        for rg, ex, (leaves, og) in zip(call.groups, d_in, graphs):
            grads = torch.autograd.grad(og, leaves, _whole_group(ex.wait(), rg.counts, b))
            back.append(_back(list(grads), rg, call, b))  # dq, dk and dv in one exchange
        for part, graph in zip(call.local[1:], local_graphs[1:]):  # beside the gradients' exchanges back
            own(part, graph)
        for rg, ex in zip(call.groups, back):
            for dst, x in zip(out, ex.wait()):
                _into_rows(dst, x, rg.rows, p)
        return *out, None


def _back(xs: list, rg: RowGroup, call: DocumentGroupCall, b: int):
    """The exchange that sends a group's packed tensors ``xs`` (this rank's heads) back in one: rank
    ``j`` its rows."""
    p, me = dist.get_world_size(call.group), dist.get_rank(call.group)
    return AllToAll([_to_ranks(x, rg.counts) for x in xs], call.group, call.stats, [b * c for c in rg.counts],
                    [b * rg.counts[me]] * p)


def attend_by_document_groups(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attend: Callable, *,
                              cu: list[int], groups: list[list[int]], group, stats: CommStats,
                              local: tuple = (), local_attend: Callable | None = None) -> torch.Tensor:
    """``attend(q, k, v, cu)`` on the packed documents of each of ``groups`` (lists of document
    indices of the global cumulative lengths ``cu``), this rank's heads, from and to contiguous
    sequence shards, differentiable. ``q`` ``[B, N/P, H, D]``, ``k``, ``v`` ``[B, N/P, H_kv, D]`` with
    ``H`` and ``H_kv`` divisible by ``P``; ``attend`` takes ``[B, N_g, h, D]`` and the group's
    cumulative lengths (a list: group ``g``'s is ``attend[g]``). ``local``: parts ``(rows,
    cu_local)``, rows of this rank's shard (a slice or an index tensor) whose documents (cumulative
    lengths ``cu_local``, packed in that order) it attends where they lie on all its heads, the first
    part issued after the groups' input exchanges so that it runs beside them, the others after the
    last group's output exchange, by ``local_attend`` (default ``attend``; given where ``attend`` is a
    list). Every document is in exactly one group or in some rank's ``local``.
    Returns this rank's ``[B, N/P, H, D]``."""
    if local and local_attend is None and isinstance(attend, list):
        raise ValueError("local_attend: with one attend per group, give the one for the local documents")
    p, rank = dist.get_world_size(group), dist.get_rank(group)
    rgs = row_groups(cu, groups, rank, p, q.device)
    call = DocumentGroupCall(attend, rgs, group, stats, local, local_attend)
    return _AttendByDocumentGroups.apply(q.contiguous(), k.contiguous(), v.contiguous(), call)
