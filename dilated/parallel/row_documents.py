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
"""
from __future__ import annotations

import itertools

from .document_layout import DocumentLayout, Piece


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
    crossing = sorted(layout.crossing())
    cu = layout.cu_seqlens
    index = {d: i for i, d in enumerate(crossing)}
    packed = list(itertools.accumulate((cu[d + 1] - cu[d] for d in crossing), initial=0))

    def moved(x: Piece) -> Piece:
        i = index[x.doc]
        return Piece(i, packed[i] + x.start - x.doc_start, x.length, packed[i], packed[i + 1])

    cut = tuple(tuple(moved(x) for x in sorted(mine, key=lambda x: x.start) if x.doc in index)
                for mine in layout.cut)
    return DocumentLayout(tuple(packed), layout.world_size, layout.causal, ((),) * layout.world_size, cut)
