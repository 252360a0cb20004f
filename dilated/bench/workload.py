"""How a sequence-parallel problem's work falls on the ranks: packed documents passed to a module,
each rank's attended (query, key) pairs for a layout, and the imbalance (slowest over mean)."""
from __future__ import annotations

import torch


class WithDocuments(torch.nn.Module):
    """A sequence-parallel module called with the case's packed documents (``cu_seqlens``); with
    ``head_tail``, a module on a document layout called with their
    :meth:`~dilated.DocumentLayout.head_tail` layout instead (every document cut over the ranks)."""

    def __init__(self, module, spec: str, n: int, head_tail: bool = False):
        super().__init__()
        self.module, self.spec, self.n, self.head_tail = module, spec, n, head_tail

    def forward(self, q, k, v):
        from .documents import cu_seqlens_of, cu_tensor

        if self.head_tail:
            from dilated import DocumentLayout

            layout = DocumentLayout.head_tail(cu_seqlens_of(self.spec, self.n),
                                              torch.distributed.get_world_size(self.module.group), self.module.causal)
            return self.module(q, k, v, layout=layout)
        return self.module(q, k, v, cu_seqlens=cu_tensor(self.spec, self.n))

    def __getattr__(self, name):  # stats, transport_used, shard/unshard: the module's
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)


def work_per_rank(case, p: int, layout: str) -> list[float]:
    """Attended pairs of each rank's query positions (contiguous or zigzag shards), within documents."""
    from .documents import cu_seqlens_of

    cu = cu_seqlens_of(case.documents, case.seq_len) if case.documents else (0, case.seq_len)
    return documents_work_per_rank(cu, case.causal, p, layout)


def documents_work_per_rank(cu, causal: bool, p: int, layout: str) -> list[float]:
    """Attended pairs of each rank's query positions for documents ``cu`` (cumulative lengths) in
    ``layout``: contiguous, zigzag or PyTorch's per-document head-tail order."""
    n = cu[-1]
    pos = torch.arange(n, dtype=torch.float64)
    doc = torch.bucketize(pos, torch.tensor(cu[1:], dtype=torch.float64), right=True)
    start = torch.tensor(cu, dtype=torch.float64)[doc]
    length = torch.tensor(cu, dtype=torch.float64)[doc + 1] - start
    keys = pos - start + 1 if causal else length  # keys each query attends
    if layout == "per_document":  # PyTorch's per-document head-tail order, cut into P contiguous shards
        return [float(c.sum()) for c in keys[per_document_order(cu, p)].chunk(p)]
    chunks = keys.chunk(2 * p if layout == "zigzag" else p)
    if layout == "zigzag":
        return [float(chunks[r].sum() + chunks[2 * p - 1 - r].sum()) for r in range(p)]
    return [float(c.sum()) for c in chunks]


def per_document_order(cu, p: int) -> torch.Tensor:
    """The sequence positions in PyTorch's per-document head-tail order (``_PerDocumentHeadTailLoadBalancer``):
    each document cut into 2P chunks, taken document by document as (chunk r, chunk 2P-1-r) for
    r = 0..P-1; the P shards are then contiguous pieces of this order."""
    order = []
    for a, b in zip(cu, cu[1:]):
        c = (b - a) // (2 * p)
        for r in range(p):
            order += [*range(a + r * c, a + (r + 1) * c), *range(a + (2 * p - 1 - r) * c, a + (2 * p - r) * c)]
    return torch.tensor(order, dtype=torch.long)


def document_layout_work(case, p: int, head_tail: bool = False, pair_costs: tuple = (1, 1)) -> list[float]:
    """Attended pairs of each rank's query positions in the :class:`~dilated.DocumentLayout` of the
    case's documents (one document without ``--doc-lengths``): balanced (weighing causal pairs by
    ``pair_costs``), or ``head_tail``."""
    from dilated import DocumentLayout

    from .documents import cu_seqlens_of

    cu = cu_seqlens_of(case.documents, case.seq_len) if case.documents else (0, case.seq_len)
    layout = (DocumentLayout.head_tail(cu, p, case.causal) if head_tail
              else DocumentLayout.balance(cu, p, case.causal, pair_costs=pair_costs))
    return [float(w) for w in layout.work_per_rank()]


def grid_work_per_rank(case, p: int, ulysses: int, ring_layout: str, pair_costs: tuple = (1, 1)) -> list[float]:
    """Attended pairs of each rank of a Ulysses x ring grid: rings of ``p / ulysses`` over the rows
    in ``ring_layout`` (``"documents"``: balancing ``pair_costs``), each ring position's heads split
    among ``ulysses`` consecutive ranks."""
    ring = (document_layout_work(case, p // ulysses, pair_costs=pair_costs) if ring_layout == "documents"
            else work_per_rank(case, p // ulysses, ring_layout))
    return [ring[r // ulysses] / ulysses for r in range(p)]


def kept_local(case, p: int, layout: str, setting, pair_costs: tuple = (1, 1)):
    """The :class:`~dilated.parallel.local_documents.LocalDocuments` a Ulysses (``layout``
    ``"contiguous"``) or hybrid-on-documents (``"hybrid_documents"``) module of ``local_documents=setting``
    runs the case's documents with on ``p`` ranks, or None where it exchanges every document."""
    from dilated.parallel.local_documents import contiguous_ranges, grid_local_documents, local_documents

    from .documents import cu_seqlens_of

    if not case.documents or not setting or layout not in ("contiguous", "hybrid_documents"):
        return None
    cu = cu_seqlens_of(case.documents, case.seq_len)
    if layout == "contiguous":
        return local_documents(setting, cu, contiguous_ranges(case.seq_len, p), case.causal)
    u = ulysses_size_for(p, case.num_heads)
    return None if u is None else grid_local_documents(setting, cu, p // u, u, case.causal, pair_costs=pair_costs)


def row_local_work(case, p: int, setting, pair_costs: tuple = (1, 1)) -> list[float] | None:
    """Attended pairs of each rank of the hybrid on documents keeping documents within its part of
    its row with ``local_documents=setting`` (:func:`dilated.parallel.row_documents.row_plans`): a
    rank's own documents, and a ``1/U`` share of the rest of its row's work; None where the rows keep
    none."""
    from dilated.parallel.document_layout import DocumentLayout, document_work
    from dilated.parallel.row_documents import row_plans

    from .documents import cu_seqlens_of

    u = ulysses_size_for(p, case.num_heads)
    if not case.documents or not setting or u is None:
        return None
    layout = DocumentLayout.balance(cu_seqlens_of(case.documents, case.seq_len), p // u, case.causal,
                                    pair_costs=pair_costs)
    plans = row_plans(layout, u, setting)
    if plans is None:
        return None
    rows = document_layout_work(case, p // u, pair_costs=pair_costs)
    out = []
    for row, plan in zip(rows, plans):
        own = [sum(document_work(m, case.causal) for _, m in spans) for spans in plan.local.spans]
        out += [w + (row - sum(own)) / u for w in own]
    return out


def imbalance(work: list[float] | None) -> float | None:
    """Slowest rank's work over the mean (1.0: balanced)."""
    if not work or sum(work) == 0:
        return None
    return max(work) / (sum(work) / len(work))


def ulysses_size_for(p: int, heads: int) -> int | None:
    """The hybrid's Ulysses size on ``p`` ranks: the largest divisor of ``p`` below ``p`` that
    divides ``heads`` (Ulysses inside, a ring of at least 2 across), or None."""
    sizes = [u for u in range(2, p) if p % u == 0 and heads % u == 0]
    return max(sizes) if sizes else None
