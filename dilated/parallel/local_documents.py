"""Packed documents that lie whole within one rank's positions, attended there without an exchange.

Ulysses trades the sequence split for a head split so that every rank sees whole documents; a
document that already lies whole within one rank's positions needs no trade: that rank can attend
it on all of its heads, where it is, and only the other (*crossing*) documents go through the
all-to-alls, their attention split over the ranks by heads. On documents of one length whose
boundaries meet the shards' (``fixed:8k`` packed into shards of a multiple of 8K), nothing moves.

What it costs is balance: a rank's work becomes its own documents' work plus a ``1/P`` share of the
crossing documents' (the exchange balances by heads; the local documents by where they lie).
:func:`local_documents` with ``"auto"`` keeps documents local only where the slowest rank's work
stays within :data:`LOCAL_IMBALANCE` of the mean; ``"always"`` wherever a document lies whole within
one rank; ``False`` never.
"""
from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

#: ``"auto"`` keeps documents local only where the slowest rank's work is at most this over the mean
LOCAL_IMBALANCE = 1.05

SETTINGS = (False, "auto", "always")


def check_local_documents(setting) -> None:
    """``setting`` is False, ``"auto"`` or ``"always"``."""
    if setting is True or setting not in SETTINGS:
        raise ValueError(f"local_documents must be False (every document exchanged), 'auto' (documents that lie "
                         f"whole within one rank attend there where that keeps the ranks' work within "
                         f"{LOCAL_IMBALANCE} of the mean) or 'always', got {setting!r}")


@dataclass(frozen=True)
class LocalDocuments:
    """Which documents stay where they lie. ``crossing``: the other documents (indices, in order),
    exchanged. ``spans[r]``: rank ``r``'s local documents as ``(lo, hi, cu)``, the rows ``lo .. hi - 1``
    of its positions (in its local order) that hold them and their cumulative lengths ``(0, ..., hi -
    lo)``; None where it holds none whole. ``work[r]``: the (query, key) pairs rank ``r`` attends, over
    all heads (its local documents', and ``1/P`` of the crossing documents')."""

    crossing: tuple
    spans: tuple
    work: tuple

    @property
    def imbalance(self) -> float:
        """The slowest rank's work over the mean (1.0: balanced)."""
        mean = sum(self.work) / len(self.work)
        return max(self.work) / mean if mean else 1.0


def _work(m: int, causal: bool) -> int:
    return m * (m + 1) // 2 if causal else m * m


def local_documents(setting, cu, ranges, causal: bool) -> LocalDocuments | None:
    """The :class:`LocalDocuments` of the documents ``cu`` (global cumulative lengths) over ranks whose
    positions are ``ranges[r]`` (``(global start, length)`` runs in the rank's local order; together
    they cover ``0 .. N - 1`` once), or None where ``setting`` keeps none local: ``False``; no document
    lies whole within a rank, or a rank's whole documents are not one run of its rows; ``"auto"`` where
    the slowest rank's work (its local documents' plus ``1/P`` of the crossing ones') is more than
    :data:`LOCAL_IMBALANCE` over the mean."""
    check_local_documents(setting)
    if setting is False:
        return None
    found = _local(tuple(cu), tuple(tuple(map(tuple, mine)) for mine in ranges), bool(causal))
    if found is None or (setting == "auto" and found.imbalance > LOCAL_IMBALANCE):
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


@functools.lru_cache(maxsize=16)
def _local(cu: tuple, ranges: tuple, causal: bool) -> LocalDocuments | None:
    runs = sorted((start, length, r, off) for r, mine in enumerate(ranges)
                  for start, length, off in _with_offsets(mine))
    starts = [x[0] for x in runs]
    mine = [[] for _ in ranges]  # per rank: (local start, length) of its whole documents
    crossing, cross_work = [], 0
    for d, (a, b) in enumerate(zip(cu, cu[1:])):
        start, length, r, off = runs[bisect.bisect_right(starts, a) - 1]
        if b <= start + length:
            mine[r].append((off + a - start, b - a))
        else:
            crossing.append(d)
            cross_work += _work(b - a, causal)
    p = len(ranges)
    work = [sum(_work(m, causal) for _, m in docs) + cross_work / p for docs in mine]
    spans = []
    for docs in mine:
        docs.sort()
        if not docs:
            spans.append(None)
            continue
        lo, hi = docs[0][0], docs[-1][0] + docs[-1][1]
        if sum(m for _, m in docs) != hi - lo:  # a crossing document's rows between: not one run of rows
            return None
        cu_local = [0]
        for _, m in docs:
            cu_local.append(cu_local[-1] + m)
        spans.append((lo, hi, tuple(cu_local)))
    if all(s is None for s in spans):
        return None
    return LocalDocuments(tuple(crossing), tuple(spans), tuple(work))


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
