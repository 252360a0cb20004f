"""The hybrid's row exchange pipelined by documents: a row's pieces of documents that cross rows
apart from its documents whole within it.

:class:`~dilated.HybridAttention` on the documents' layout trades, within a grid row, the sequence
split for a head split (all-to-all), then passes the crossing documents' rows round the column of
rows. Only the documents with pieces on other rows need that ring; a row's documents whole within
it need neither the ring nor the row's other documents. With ``document_groups="always"`` the row
exchanges its shard in two groups (:func:`~dilated.parallel.document_groups.attend_by_document_groups`
over the row's sequence of pieces, :func:`row_groups`): first its pieces of crossing documents,
attended by a ring over :func:`crossing_layout` (the layout of those documents alone), then its
whole documents, attended where they lie on the row's heads. The second group's exchange runs
behind the first group's ring, and its attention behind the first group's output going back.

With ``local_documents`` (:func:`row_plans`), a rank's documents whole within its part of the row
are not exchanged at all: it attends them on all its heads while the groups' exchanges run
(:mod:`dilated.parallel.local_documents`, within the row), and the second group holds only the
row's other whole documents; with one exchange (``document_groups=1``), the row's other pieces
move at once and one ring over their own layout (:func:`exchanged_layout`) attends them.

``document_groups="auto"`` (:func:`plans_for`) takes the one exchange where every row keeps
documents of its own (they attend beside it); where none does, the two groups where every row holds
both kinds and the ring is two rows on one host (:func:`two_exchanges_pay`: the whole documents'
exchange hidden behind the crossing pieces' one ring step), else one exchange of the whole shard.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from .document_layout import DocumentLayout, Piece
from .local_documents import LocalDocuments, contiguous_ranges, local_documents


def pipelines(layout: DocumentLayout) -> bool:
    """Whether every row of ``layout`` holds pieces of crossing documents and documents whole within
    it, and nothing else (a document in part on one row only would be neither): the two groups
    exist on every row, so every rank of a column meets the ring."""
    crossing = layout.crossing()
    return bool(crossing) and all(
        whole and any(x.doc in crossing for x in cut) and all(x.doc in crossing for x in cut)
        for whole, cut in zip(layout.whole, layout.cut))


def row_groups(layout: DocumentLayout, row: int) -> tuple[list[int], list[list[int]]]:
    """``(cu, groups)``: row ``row``'s pieces in its order as the documents of its shard (cumulative
    lengths), and the groups: the indices of its pieces of crossing documents, then of its whole
    documents."""
    mine, crossing = layout.pieces_of(row), layout.crossing()
    cu = list(itertools.accumulate((x.length for x in mine), initial=0))
    return cu, [[i for i, x in enumerate(mine) if x.doc in crossing],
                [i for i, x in enumerate(mine) if x.doc not in crossing]]


def crossing_layout(layout: DocumentLayout) -> DocumentLayout:
    """The layout of ``layout``'s crossing documents alone, packed in sequence order: each row holds
    its pieces of them (rows of different lengths: a layout for the ring inside a module, not for
    :func:`dilated.shard`)."""
    return exchanged_layout(layout, [row_groups(layout, j)[1][0] for j in range(layout.world_size)])


@dataclass(frozen=True)
class RowPlan:
    """What a grid row exchanges and attends: ``cu`` its pieces in its order as the documents of its
    shard (cumulative lengths); ``groups`` the pieces (indices) each exchange carries, in order;
    ``rings[g]`` whether group ``g`` is attended by the ring over ``ring_layout`` (the layout of the
    pieces the rings carry), else on the row's heads; ``local`` the documents (pieces) the row's
    ranks attend where they lie (:class:`~dilated.parallel.local_documents.LocalDocuments` over the
    row's ``ulysses_size`` contiguous parts), or None."""

    cu: tuple
    groups: tuple
    rings: tuple
    ring_layout: DocumentLayout | None
    local: LocalDocuments | None


def exchanged_layout(layout: DocumentLayout, exchanged: list) -> DocumentLayout:
    """The layout of the pieces the rows exchange (``exchanged[j]``: indices into row ``j``'s pieces),
    packed in sequence order: the crossing documents cut over the rows as in ``layout``, each other
    document (whole within its row) whole on its row."""
    crossing, cu = layout.crossing(), layout.cu_seqlens
    rows = [[layout.pieces_of(j)[i] for i in mine] for j, mine in enumerate(exchanged)]
    docs = sorted({x.doc for mine in rows for x in mine})
    index = {d: i for i, d in enumerate(docs)}
    packed = list(itertools.accumulate((cu[d + 1] - cu[d] for d in docs), initial=0))

    def moved(x: Piece) -> Piece:
        i = index[x.doc]
        return Piece(i, packed[i] + x.start - x.doc_start, x.length, packed[i], packed[i + 1])

    whole = tuple(tuple(index[x.doc] for x in mine if x.doc not in crossing) for mine in rows)
    cut = tuple(tuple(moved(x) for x in mine if x.doc in crossing) for mine in rows)
    return DocumentLayout(tuple(packed), layout.world_size, layout.causal, whole, cut)


def row_plans(layout: DocumentLayout, ulysses_size: int, local_setting, by_documents: bool = True) -> tuple | None:
    """Every row's :class:`RowPlan` with ``local_documents=local_setting`` kept within its ranks'
    parts (:func:`~dilated.parallel.local_documents.local_documents` within each row, the crossing
    documents' pieces always exchanged), or None where a row keeps none or the rows cannot all take
    part in one ring (a row without a piece of a crossing document while some cross, or a document
    in parts on one row only). ``by_documents``: the crossing pieces in an exchange of their own
    and ring over :func:`crossing_layout`, the row's other documents in a second; else every
    exchanged piece in one exchange and one ring over :func:`exchanged_layout` (no ring where no
    document crosses rows)."""
    def make():
        crossing = layout.crossing()
        if any(x.doc not in crossing for cut in layout.cut for x in cut):
            return None
        if crossing and not all(cut for cut in layout.cut):
            return None
        rows = []
        for j in range(layout.world_size):
            cu, (ring, _) = row_groups(layout, j)
            local = local_documents(local_setting, cu, contiguous_ranges(cu[-1], ulysses_size), layout.causal,
                                    exchanged=ring)
            if local is None:
                return None
            rows.append((tuple(cu), ring, local))
        if not by_documents:
            moved = exchanged_layout(layout, [local.exchanged for _, _, local in rows]) if crossing else None
            return tuple(RowPlan(cu, (local.exchanged,) if local.exchanged else (),
                                 (bool(crossing),) if local.exchanged else (), moved, local) for cu, _, local in rows)
        ring_layout = crossing_layout(layout) if crossing else None
        out = []
        for cu, ring, local in rows:
            rest = sorted(set(local.exchanged) - set(ring))
            groups = [(g, on_ring) for g, on_ring in ((ring, True), (rest, False)) if g]
            out.append(RowPlan(cu, tuple(tuple(g) for g, _ in groups), tuple(r for _, r in groups), ring_layout,
                               local))
        return tuple(out)
    return layout.derived(("row_plans", ulysses_size, local_setting, by_documents), make)


def by_documents_plans(layout: DocumentLayout) -> tuple | None:
    """Every row's :class:`RowPlan` keeping nothing: its pieces of crossing documents exchanged and
    ringed over :func:`crossing_layout`, then its whole documents; None where not every row holds
    both (:func:`pipelines`)."""
    def make():
        if not pipelines(layout):
            return None
        ring = crossing_layout(layout)
        return tuple(RowPlan(tuple(cu), tuple(map(tuple, groups)), (True, False), ring, None)
                     for cu, groups in (row_groups(layout, j) for j in range(layout.world_size)))
    return layout.derived("by_documents_plans", make)


#: ``document_groups`` of :class:`~dilated.HybridAttention`: one exchange, :func:`plans_for`'s choice, two groups
DOCUMENT_GROUPS = (1, "auto", "always")


def check_row_document_groups(document_groups) -> None:
    """``document_groups`` is one of :data:`DOCUMENT_GROUPS`."""
    if isinstance(document_groups, bool) or document_groups not in DOCUMENT_GROUPS:
        raise ValueError(f"document_groups must be 1 (a row's shard exchanged at once), 'always' (its pieces of "
                         f"documents across rows first, its whole documents behind their ring) or 'auto' (the "
                         f"first where every row keeps documents of its own; where none does, the second on a "
                         f"ring of two rows of one host), got {document_groups!r}")


def two_exchanges_pay(ring_size: int, ring_on_one_host: bool) -> bool:
    """Whether ``document_groups="auto"``, where no rank keeps documents of its own, exchanges a row
    by documents: for a ring of two rows on one host. There the crossing pieces' one ring step moves
    over the host's links beside their attention, and the whole documents' exchange hides behind it
    (docs/performance/packed-documents.md). With more rows, or rows on other hosts, the ring's steps
    keep the whole documents' attention beside them only in one exchange; the planner predicts the
    two exchanges slower there (docs/performance-log.md), and they are not taken."""
    return ring_size == 2 and ring_on_one_host


def plans_for(layout: DocumentLayout, ulysses_size: int, local_setting, document_groups,
              ring_on_one_host: bool = True) -> tuple | None:
    """Every row's :class:`RowPlan` as :class:`~dilated.HybridAttention` with ``local_documents=
    local_setting`` and ``document_groups`` runs it, or None for one exchange of each row's whole
    shard: the documents each rank keeps (:func:`row_plans`; by documents for ``"always"``); else the
    crossing pieces and the whole documents in two exchanges (:func:`by_documents_plans`) for
    ``"always"``, and for ``"auto"`` where :func:`two_exchanges_pay` (``layout`` is over the ring's
    rows; ``ring_on_one_host``: whether every column of the grid lies on one host)."""
    check_row_document_groups(document_groups)
    plans = row_plans(layout, ulysses_size, local_setting, document_groups == "always") if local_setting else None
    if plans is None and (document_groups == "always" or document_groups == "auto" and two_exchanges_pay(
            layout.world_size, ring_on_one_host)):
        plans = by_documents_plans(layout)
    return plans
