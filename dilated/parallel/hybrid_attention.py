"""Ulysses x ring (USP): exact dense attention over ranks arranged as a ``ring_size x ulysses_size``
grid. Within a row of the grid (``ulysses_size`` consecutive ranks: the GPUs of one node, by
default) an all-to-all trades the sequence split for a head split, as in
:class:`~dilated.UlyssesAttention`; across rows, :class:`~dilated.RingAttention` passes K/V
blocks around for those heads. The all-to-all traffic stays on the fast intra-node links and the
ring's steps are ``ring_size``, not the world size; heads need only be divisible by
``ulysses_size``.

Layout (:meth:`HybridAttention.shard`): the global sequence is cut into ``ring_size`` ring shards
in ``layout`` (``zigzag`` balances causal work over the ring), and each ring shard into
``ulysses_size`` contiguous parts, one per rank of its grid row; ``layout="documents"``: the ring
shards are those of the :class:`~dilated.DocumentLayout` of each call's documents over the
``ring_size`` rows, and the ring relays only crossing documents' rows (:mod:`dilated.parallel.document_attention`);
where every document then lies whole within one rank's part (and the ranks' work stays balanced:
``local_documents``), each rank attends its own documents on all its heads and nothing moves
(:mod:`dilated.parallel.local_documents`); elsewhere each rank keeps its documents within its part
of the row where they lie and the row exchanges the rest, at once and round one ring, or (where no
rank keeps any on a ring of two rows of one host, or with ``document_groups="always"``) its pieces
of documents that cross rows first and its other documents behind their ring
(:mod:`dilated.parallel.row_documents`).
Construct it on every rank of the default process group (it creates the row and column groups, a
collective).
"""
from __future__ import annotations

import socket

import torch
import torch.distributed as dist
from torch import nn

from .._checks import check_causal, check_qkv, check_scale
from .agreement import (AgreedSignatures, group_device, host_and_device_backend, host_group, signature,
                        validate_on_all_ranks)
from .head_groups import attend_by_head_groups, check_head_groups, head_groups_for
from .sharding import CommStats, shard, unshard
from .document_attention import DocumentParts, balanced_layout, document_attention
from .document_groups import attend_by_document_groups, check_groups_of_one_kind
from .document_layout import DocumentLayout
from .local_documents import check_local_documents, grid_local_documents
from .row_documents import RowPlan, check_row_document_groups, plans_for
from ..functional import attention
from ..dense import default_scale
from ..packed import check_cu_seqlens
from .ring_attention import RING_LAYOUTS, RingAttention
from .ulysses_attention import kv_heads_for


class HybridAttention(nn.Module):
    """Exact dense attention over the global sequence on a ``ring_size x ulysses_size`` grid of
    ranks; ``forward(q, k, v, cu_seqlens=None, layout=None)`` on this rank's part ``[B, N/P, H, D]``
    (see :meth:`shard`) returns this rank's output ``[B, N/P, H, D]``, differentiable.

    Args:
        ulysses_size: ranks of a grid row (consecutive ranks: one node's GPUs), which split the heads.
        ring_size: rows of the grid, which pass K/V round a ring; ``ulysses_size x ring_size`` must
            be the group's size.
        causal, scale, backend, transport, measure_comm: as :class:`~dilated.RingAttention`.
        layout: the ring's shards over the rows: ``"zigzag"``, ``"contiguous"`` or ``"documents"``.
        group: the process group (default: the world); construct on every rank of it.
        head_groups: a row's all-to-alls pipelined with the ring by head groups
            (:mod:`dilated.parallel.head_groups`); ``"auto"``: one (a ring call per group costs more
            than the exchanges it hides).
        local_documents: ``layout="documents"``: where every document lies whole within one rank's
            part, each rank attends its own on all its heads, without the row's exchange or the ring;
            else, where every row keeps some documents within its ranks' parts
            (:func:`~dilated.parallel.row_documents.row_plans`), those stay and the row exchanges the
            rest; ``"auto"`` (default): where the slowest rank's work also stays within
            :data:`~dilated.parallel.local_documents.LOCAL_IMBALANCE` of the mean (and, within a row,
            at most :data:`~dilated.parallel.local_documents.MOST_EXCHANGED` of its rows move);
            ``"always"``: wherever documents lie whole within a rank; ``False``: never.
        document_groups: ``layout="documents"``, where not every document is kept local: ``1``, a row
            exchanges what it does not keep at once, then the ring; ``"always"``: first its pieces of
            documents that cross rows, attended by the ring, then its documents whole within it,
            attended where they lie, their exchange behind the ring (where every row holds both;
            :mod:`dilated.parallel.row_documents`), the documents kept by ``local_documents`` attended
            on all of a rank's heads beside the exchanges; ``"auto"`` (default): the first where every
            row keeps documents (they attend beside its one exchange); where none does, the second for
            a ring of two rows on one host whose rows hold both kinds
            (:func:`~dilated.parallel.row_documents.two_exchanges_pay`), else one exchange. Not
            combined with ``head_groups`` above 1.

    ``self.stats`` counts the all-to-alls (bytes, collectives) and the ring's messages together.
    """

    def __init__(self, ulysses_size: int, ring_size: int, *, causal=False, scale=None, layout="zigzag", group=None,
                 backend="auto", transport: str = "auto", measure_comm: bool = False,
                 head_groups: int | str = "auto", local_documents: bool | str = "auto",
                 document_groups: int | str = "auto"):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("HybridAttention needs torch.distributed initialised (see dilated.init_distributed)")
        for name, size in (("ulysses_size", ulysses_size), ("ring_size", ring_size)):
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"{name} must be a positive integer, got {size!r}")
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        if ulysses_size * ring_size != len(ranks):
            raise ValueError(f"ulysses_size x ring_size = {ulysses_size} x {ring_size} = {ulysses_size * ring_size} "
                             f"must equal the group's size {len(ranks)}")
        if layout not in RING_LAYOUTS:
            raise ValueError(f"layout must be one of {RING_LAYOUTS}, got {layout!r}")
        check_causal(causal)
        check_scale(scale)
        check_head_groups(head_groups)
        check_local_documents(local_documents)
        check_row_document_groups(document_groups)
        check_groups_of_one_kind(document_groups, head_groups)
        self.head_groups, self.local_documents, self.document_groups = head_groups, local_documents, document_groups
        self.ulysses_size, self.ring_size, self.layout, self.group = ulysses_size, ring_size, layout, group
        self.causal, self.scale, self.backend = causal, scale, backend
        me = ranks.index(dist.get_rank())
        self.ring_rank, self.ulysses_rank = divmod(me, ulysses_size)
        # whether every column's ring stays on one host (document_groups="auto"), asked on the host where it can be
        hosts = [None] * len(ranks)
        dist.all_gather_object(hosts, socket.gethostname(), group=host_group(group) or group)
        self.ring_on_one_host = all(len({hosts[r * ulysses_size + u] for r in range(ring_size)}) == 1
                                    for u in range(ulysses_size))
        self.ulysses_group = self.ring_group = None
        # every rank creates every group, in one order (dist.new_group); with a host backend beside NCCL,
        # so that the inner ring's per-call check stays on the host
        host_backend = host_and_device_backend()
        for r in range(ring_size):
            g = dist.new_group([ranks[r * ulysses_size + u] for u in range(ulysses_size)], backend=host_backend)
            if r == self.ring_rank:
                self.ulysses_group = g
        for u in range(ulysses_size):
            g = dist.new_group([ranks[r * ulysses_size + u] for r in range(ring_size)], backend=host_backend)
            if u == self.ulysses_rank:
                self.ring_group = g
        self.ring = RingAttention(causal=causal, scale=scale, backend=backend, layout=layout, group=self.ring_group,
                                  transport=transport, measure_comm=measure_comm)
        self.stats = self.ring.stats = CommStats(measure_comm)  # the all-to-alls and the ring's steps together
        self._agreed = AgreedSignatures()  # input signatures all ranks agreed on

    def document_layout(self, cu_seqlens) -> DocumentLayout:
        """The :class:`~dilated.DocumentLayout` of the documents ``cu_seqlens`` over the ring
        (``layout="documents"``)."""
        return balanced_layout(cu_seqlens, self.ring_size, self.causal, self.backend, group_device(self.group))

    def _validate(self, q, k, v, cu_seqlens, layout):
        check_qkv(q, k, v)
        if k.shape[1] != q.shape[1]:
            raise ValueError(f"q and k/v parts must have one length, got {q.shape[1]} and {k.shape[1]}")
        if q.shape[2] % self.ulysses_size:
            raise ValueError(f"HybridAttention splits heads over ulysses_size={self.ulysses_size} ranks: num_heads "
                             f"{q.shape[2]} must be divisible by it; choose a ulysses_size that divides the heads")
        if self.layout == "zigzag" and (q.shape[1] * self.ulysses_size) % 2:
            raise ValueError(f"zigzag ring shards hold two chunks: the part length {q.shape[1]} x ulysses_size "
                             f"{self.ulysses_size} must be even (global N divisible by 2 x world size)")
        hkv = kv_heads_for(q.shape[2], k.shape[2], self.ulysses_size)
        # the ring per head group costs more than the exchanges it hides, whatever its kernel: "auto" is one
        groups = head_groups_for(self.head_groups, q.shape[2] // self.ulysses_size, hkv // self.ulysses_size, False)
        scale = default_scale(q.shape[-1], self.scale)
        if layout is not None and self.layout != "documents":
            raise ValueError(f"layout: a DocumentLayout is taken by HybridAttention(layout='documents'); this "
                             f"module's ring shards are {self.layout}")
        if layout is not None and cu_seqlens is not None:
            raise ValueError("pass cu_seqlens or layout, not both (a layout holds its documents)")
        if layout is not None:
            cu_seqlens = layout.cu_seqlens
        docs = None if cu_seqlens is None else check_cu_seqlens(
            cu_seqlens, q.shape[1] * self.ulysses_size * self.ring_size)
        own = by_docs = None
        if docs is not None and self.layout == "documents":
            layout = layout or balanced_layout(docs, self.ring_size, self.causal, self.backend, q.device, q.dtype)
            own = grid_local_documents(self.local_documents, docs, self.ring_size, self.ulysses_size, self.causal,
                                       layout)
            own = None if own is None else (own.local_cu(self.ring_rank * self.ulysses_size + self.ulysses_rank),
                                            layout)
            if own is None and groups == 1:
                by_docs = self._row_plan(layout)
        return (hkv, groups, own, by_docs), signature(
            q, k, v, causal=self.causal, scale=scale, layout=self.layout, algorithm="hybrid",
            grid=[self.ring_size, self.ulysses_size], documents=docs, head_groups=groups,
            local_documents=own is not None or (by_docs is not None and by_docs[1].local is not None),
            row_exchange=by_docs is not None)

    def forward(self, q, k, v, cu_seqlens: torch.Tensor | None = None, layout: DocumentLayout | None = None):
        """``cu_seqlens``: packed documents of the *global* sequence (int32 cumulative lengths,
        the same on every rank); attention stays within each document. ``layout="documents"``:
        or ``layout``, their :class:`~dilated.DocumentLayout` over the ring (:meth:`document_layout`)."""
        # every rank of the grid agrees before any row or column communicates (a row that stopped
        # alone would leave the ring of the others waiting)
        hkv, groups, own, by_docs = validate_on_all_ranks(self.group, self._agreed, "HybridAttention",
                                                          lambda: self._validate(q, k, v, cu_seqlens, layout))
        if own is not None:  # every document whole within its rank's part: nothing to exchange
            self.ring.last_layout = own[1]  # what shard and unshard take by default
            return attention(q, k, v, causal=self.causal, scale=self.scale, backend=self.backend,
                             cu_seqlens=torch.tensor(own[0], dtype=torch.int32))
        if hkv != k.shape[2]:
            k, v = (x.repeat_interleave(hkv // k.shape[2], dim=2) for x in (k, v))
        if by_docs is not None:
            return self._by_row_documents(q, k, v, *by_docs)

        def attend(qh, kh, vh):
            if self.ring_size == 1 and self.layout != "documents":  # the whole sequence on this row's heads
                return attention(qh, kh, vh, causal=self.causal, scale=self.scale, backend=self.backend,
                                 cu_seqlens=cu_seqlens)
            return self.ring(qh, kh, vh, cu_seqlens=cu_seqlens, layout=layout)  # ring shards in self.layout

        return attend_by_head_groups(q, k, v, attend, groups=groups, group=self.ulysses_group, stats=self.stats)

    def _row_plan(self, layout: DocumentLayout) -> tuple | None:
        """``(layout, this row's RowPlan)`` (:func:`~dilated.parallel.row_documents.plans_for`), or
        None: the whole shard exchanged at once."""
        plans = plans_for(layout, self.ulysses_size, self.local_documents, self.document_groups, self.ring_on_one_host)
        return None if plans is None else (layout, plans[self.ring_rank])

    def _by_row_documents(self, q, k, v, layout: DocumentLayout, plan: RowPlan):
        """The row's pieces of crossing documents exchanged and ringed first, its other documents
        exchanged behind them and attended where they lie, each rank's own documents (``plan.local``)
        attended on all its heads beside the exchanges (:mod:`dilated.parallel.row_documents`)."""
        self.ring.last_layout, self.ring.transport_used = layout, "p2p"  # what shard and unshard take by default

        def across_rows(qg, kg, vg, cu_g):  # the crossing documents' pieces of every row, round the column
            parts = DocumentParts.on(qg, kg, vg, causal=self.causal, scale=self.scale, backend=self.backend,
                                     layout=plan.ring_layout)
            call = parts.call(self.ring_rank, self.ring_group, self.stats, transport="ring")
            return document_attention(qg.contiguous(), kg.contiguous(), vg.contiguous(), call)

        def within_row(qg, kg, vg, cu_g):
            return attention(qg, kg, vg, causal=self.causal, scale=self.scale, backend=self.backend,
                             cu_seqlens=torch.tensor(cu_g, dtype=torch.int32))

        mine = () if plan.local is None else plan.local.parts(self.ulysses_rank, q.device)
        return attend_by_document_groups(q, k, v, [across_rows if ring else within_row for ring in plan.rings],
                                         cu=list(plan.cu), groups=[list(g) for g in plan.groups],
                                         group=self.ulysses_group, stats=self.stats, local=mine,
                                         local_attend=within_row)

    def shard(self, x: torch.Tensor, layout: DocumentLayout | None = None) -> torch.Tensor:
        """This rank's part ``[B, N/P, ...]`` of a global ``[B, N, ...]`` tensor: its ring shard
        (in ``layout`` over ``ring_size``; ``layout="documents"``: ``layout``, default the last
        call's), then its contiguous part of that (over ``ulysses_size``)."""
        ring_part = self.ring.shard(x, layout)
        return shard(ring_part, group=self.ulysses_group, layout="contiguous")

    def unshard(self, x_local: torch.Tensor, layout: DocumentLayout | None = None) -> torch.Tensor:
        """The global tensor from every rank's part (all-gathers along the row, then the column)."""
        ring_part = unshard(x_local, group=self.ulysses_group, layout="contiguous")
        return self.ring.unshard(ring_part, layout)

