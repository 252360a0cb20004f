"""Packed documents that lie whole within one rank's positions, attended there without an exchange.

Ulysses trades the sequence split for a head split so that every rank sees whole documents; a
document that already lies whole within one rank's positions needs no trade: that rank can attend
it on all of its heads, where it is, and only the other documents go through the all-to-alls,
their attention split over the ranks by heads. On documents of one length whose boundaries meet the
shards' (``fixed:8k`` packed into shards of a multiple of 8K), nothing moves.

What it costs is balance: a rank's work becomes its own documents' work plus a ``1/P`` share of the
exchanged documents' (the exchange balances by heads; the local documents by where they lie).
:func:`local_documents` with ``"auto"`` therefore exchanges, besides the documents that cross ranks,
the heaviest documents of the slowest rank, one at a time, until the slowest rank's work is within
:data:`LOCAL_IMBALANCE` of the mean: the few long documents that unbalance a mix move, the many
short ones stay; where that leaves more than :data:`MOST_EXCHANGED` of the rows to exchange, it
keeps none local (the exchange of every document, pipelined by document groups where they pay,
hides more). ``"always"`` keeps every document that lies whole within a rank where it is; ``False``
exchanges them all.

A rank attends its own documents in two parts of about equal work (:meth:`LocalDocuments.parts`):
the first while the exchanged documents' inputs arrive, the second while their output goes back
(backward: while the output gradient arrives, and while the q, k, v gradients go back), so that
neither exchange leaves the compute stream waiting where a rank has its own documents to attend.
"""
from __future__ import annotations

import bisect
import functools
import itertools
from dataclasses import dataclass, field

from .document_layout import DocumentLayout, document_work, ranges_to_positions

#: ``"auto"`` exchanges the slowest rank's heaviest documents until its work is at most this over the mean
LOCAL_IMBALANCE = 1.02

#: ``"auto"`` keeps documents local only where at most this share of the rows is exchanged
MOST_EXCHANGED = 0.5

SETTINGS = (False, "auto", "always")


def check_local_documents(setting) -> None:
    """``setting`` is False, ``"auto"`` or ``"always"``."""
    if setting is True or setting not in SETTINGS:
        raise ValueError(f"local_documents must be False (every document exchanged), 'auto' (documents that lie "
                         f"whole within one rank attend there, but for the longest where the ranks' work would be "
                         f"more than {LOCAL_IMBALANCE} x the mean) or 'always', got {setting!r}")


@dataclass(frozen=True)
class LocalDocuments:
    """Which documents stay where they lie. ``exchanged``: the other documents (indices, in order).
    ``spans[r]``: rank ``r``'s local documents as ``(local start, length)`` in its local order (rows
    of its positions), ``()`` where it keeps none. ``work[r]``: the (query, key) pairs rank ``r``
    attends, over all heads (its local documents', and ``1/P`` of the exchanged documents');
    ``causal``: whether a document's queries see only the keys before them."""

    exchanged: tuple
    spans: tuple
    work: tuple
    causal: bool = True
    _rows: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # (rank, device) -> rows

    @property
    def imbalance(self) -> float:
        """The slowest rank's work over the mean (1.0: balanced)."""
        mean = sum(self.work) / len(self.work)
        return max(self.work) / mean if mean else 1.0

    def local_cu(self, rank: int) -> tuple:
        """Cumulative lengths ``(0, ...)`` of rank ``rank``'s local documents packed in its local order."""
        return spans_cu(self.spans[rank])

    def local_rows(self, rank: int):
        """Rank ``rank``'s rows of local documents: a ``slice`` where they are one run, else the
        ``(starts, lengths)`` of their runs."""
        return spans_rows(self.spans[rank])

    def part_spans(self, rank: int) -> tuple:
        """Rank ``rank``'s local documents (its :attr:`spans`) cut in local order into two parts of
        about equal work (one part where it keeps one document, none where it keeps none)."""
        mine = self.spans[rank]
        if len(mine) < 2:
            return (mine,) if mine else ()
        work = list(itertools.accumulate(document_work(m, self.causal) for _, m in mine))
        cut = min(range(1, len(mine)), key=lambda i: abs(2 * work[i - 1] - work[-1]))
        return mine[:cut], mine[cut:]

    def parts(self, rank: int, device) -> tuple:
        """``(rows, cumulative lengths)`` of each of :meth:`part_spans` as
        :func:`~dilated.parallel.document_groups.attend_by_document_groups` takes them (``local``): the
        rows a ``slice`` where they are one run, else their positions on ``device`` (made once per rank
        and device and kept with these documents)."""
        key = (rank, str(device))
        if key not in self._rows:
            made = []
            for spans in self.part_spans(rank):
                rows = spans_rows(spans)
                made.append((rows if isinstance(rows, slice) else ranges_to_positions(*rows, device), spans_cu(spans)))
            self._rows[key] = tuple(made)
        return self._rows[key]


def spans_cu(spans) -> tuple:
    """Cumulative lengths ``(0, ...)`` of the documents ``spans`` (``(local start, length)``) packed in order."""
    return tuple(itertools.accumulate((m for _, m in spans), initial=0))


def spans_rows(spans):
    """The rows of ``spans`` (``(local start, length)``, ascending): a ``slice`` where they are one
    run, else the ``(starts, lengths)`` of their runs."""
    lo, hi = spans[0][0], spans[-1][0] + spans[-1][1]
    if sum(m for _, m in spans) == hi - lo:
        return slice(lo, hi)
    return [a for a, _ in spans], [m for _, m in spans]


def local_documents(setting, cu, ranges, causal: bool, exchanged=()) -> LocalDocuments | None:
    """The :class:`LocalDocuments` of the documents ``cu`` (global cumulative lengths) over ranks whose
    positions are ``ranges[r]`` (``(global start, length)`` runs in the rank's local order; together
    they cover ``0 .. N - 1`` once), or None where ``setting`` keeps none local: ``False``, or no
    document stays whole within a rank. ``"auto"``: the documents across ranks exchanged, and the
    heaviest local document of the slowest rank after them, one at a time, while that rank's work
    (its local documents' plus ``1/P`` of the exchanged ones') is more than :data:`LOCAL_IMBALANCE`
    over the mean, and None where that exchanges more than :data:`MOST_EXCHANGED` of the rows;
    ``"always"``: every document whole within a rank stays. ``exchanged``: documents exchanged
    wherever they lie (indices)."""
    check_local_documents(setting)
    if setting is False:
        return None
    cu = tuple(cu)
    found = _local(cu, tuple(tuple(map(tuple, mine)) for mine in ranges), bool(causal),
                   LOCAL_IMBALANCE if setting == "auto" else None, frozenset(exchanged))
    if setting == "auto" and found is not None and \
            sum(cu[d + 1] - cu[d] for d in found.exchanged) > MOST_EXCHANGED * cu[-1]:
        return None
    return found


def contiguous_ranges(n: int, p: int) -> list[list[tuple[int, int]]]:
    """The positions of ``p`` contiguous shards of ``n`` positions (Ulysses'), as :func:`local_documents` takes them."""
    return [[(r * (n // p), n // p)] for r in range(p)]


def grid_part_ranges(layout, ulysses_size: int) -> list[list[tuple[int, int]]]:
    """The positions of a Ulysses x ring grid's ranks (:class:`~dilated.HybridAttention` on a
    :class:`~dilated.DocumentLayout` ``layout`` over its rows), as :func:`local_documents` takes
    them: rank ``r * ulysses_size + u`` holds part ``u`` (contiguous, of ``ulysses_size``) of ring
    shard ``r``."""
    out = []
    for pieces in layout.pieces:
        n, at = sum(x.length for x in pieces) // ulysses_size, 0
        parts = [[] for _ in range(ulysses_size)]
        for x in pieces:  # cut the ring shard's runs at the parts' boundaries
            start, left = x.start, x.length
            while left:
                take = min(left, n - at % n)
                parts[at // n].append((start, take))
                start, left, at = start + take, left - take, at + take
        out.extend(parts)
    return out


def grid_local_documents(setting, cu, ring_size: int, ulysses_size: int, causal: bool,
                         layout: DocumentLayout | None = None, pair_costs: tuple = (1, 1)) -> LocalDocuments | None:
    """What :class:`~dilated.HybridAttention` on the documents' layout (``layout``, default the
    :class:`~dilated.DocumentLayout` of ``cu`` over ``ring_size`` rows balancing ``pair_costs``) keeps where it lies: every
    document (each rank its own, nothing moves) where :func:`local_documents` would exchange none,
    else None (the hybrid keeps all or none)."""
    layout = layout or DocumentLayout.balance(cu, ring_size, causal, pair_costs=pair_costs)
    kept = local_documents(setting, cu, grid_part_ranges(layout, ulysses_size), causal)
    return kept if kept is not None and not kept.exchanged else None


@functools.lru_cache(maxsize=16)
def _local(cu: tuple, ranges: tuple, causal: bool, target: float | None,
           forced: frozenset = frozenset()) -> LocalDocuments | None:
    runs = sorted((start, length, r, off) for r, mine in enumerate(ranges)
                  for start, length, off in _with_offsets(mine))
    starts = [x[0] for x in runs]
    p = len(ranges)
    mine = [[] for _ in ranges]  # per rank: (work, local start, length, document) of its whole documents
    exchanged, moved = [], 0
    for d, (a, b) in enumerate(zip(cu, cu[1:])):
        start, length, r, off = runs[bisect.bisect_right(starts, a) - 1]
        if b <= start + length and d not in forced:
            mine[r].append((document_work(b - a, causal), off + a - start, b - a, d))
        else:
            exchanged.append(d)
            moved += document_work(b - a, causal)
    own = [sum(x[0] for x in docs) for docs in mine]
    if target is not None:  # the slowest rank's heaviest documents go to the exchange while it is too slow
        for docs in mine:
            docs.sort()  # the heaviest last
        mean = (sum(own) + moved) / p
        while True:
            r = max(range(p), key=own.__getitem__)
            if not mine[r] or own[r] + moved / p <= target * mean:
                break
            w, _, _, d = mine[r].pop()
            own[r] -= w
            moved += w
            exchanged.append(d)
    if not any(mine):
        return None
    spans = tuple(tuple(sorted((off, m) for _, off, m, _ in docs)) for docs in mine)
    return LocalDocuments(tuple(sorted(exchanged)), spans, tuple(w + moved / p for w in own), causal)


def _with_offsets(mine):
    """``(global start, length, local offset)`` of a rank's runs, runs that continue each other merged."""
    run, off = None, 0
    for start, length in mine:
        if run and run[0] + run[1] == start:
            run = (run[0], run[1] + length, run[2])
        else:
            if run:
                yield run
            run = (start, length, off)
        off += length
    if run:
        yield run
