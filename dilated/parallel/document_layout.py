"""Which positions of a packed sequence each rank holds, so that every rank's attention work is equal.

Packed documents attend within themselves, so work per position varies: causal, a position at
offset ``i`` of its document attends ``i + 1`` keys; without a mask, the document's length. The
contiguous and zigzag layouts balance one sequence, not many documents. A :class:`DocumentLayout`
balances the documents given as cumulative lengths ``cu_seqlens`` over ``P`` ranks, each rank
holding exactly ``N / P`` positions:

* documents whose work no whole-document assignment can balance are cut head-tail, as
  TransformerEngine's THD format and PyTorch's per-document balancer cut every document: into
  ``2P`` pieces, rank ``r`` taking pieces ``r`` and ``2P-1-r``, which gives every rank the same
  share of the document's work (causal) and of its positions;
* the other documents stay whole (no communication at all), assigned largest work first to the
  rank with the least work that has room for them (longest-processing-time scheduling);
* a whole document that no rank has room for is cut at the ranks' remaining room, in order.

The layout tries cutting the ``k`` documents of most work head-tail for ``k = 0, 1, 2, 4, ...``
and keeps the first whose slowest rank is within :data:`TARGET_IMBALANCE` of the mean (else the
most balanced it found); documents shorter than ``2P`` x :data:`MIN_PIECE` are cut head-tail
only where no layout without them comes within :data:`ACCEPTABLE_IMBALANCE` of the mean (pieces
that small waste a kernel's tiles; halving the smallest piece allowed until one does).

Each rank holds its pieces in sequence order. :meth:`DocumentLayout.positions` is a rank's
global positions (what :func:`dilated.shard` takes); a document with pieces on several ranks is
*crossing*, and only its rows travel between ranks (:class:`dilated.DocumentParallelAttention`).
Computed on the host from the lengths alone; a layout pickles, so a data loader's worker can build
it beside its batch.
"""
from __future__ import annotations

import functools
import heapq
import itertools
import operator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .._transfer import host_values_on

#: the slowest rank's work over the mean that a layout stops at
TARGET_IMBALANCE = 1.01
#: documents are cut head-tail only into pieces of at least this many positions ...
MIN_PIECE = 128
#: ... unless no layout with such pieces comes within this of the mean: then smaller pieces are tried
ACCEPTABLE_IMBALANCE = 1.05


class Piece(NamedTuple):
    """Positions ``start .. start + length - 1`` of document ``doc``, which spans ``doc_start ..
    doc_end - 1``."""

    doc: int
    start: int
    length: int
    doc_start: int
    doc_end: int

    def work(self, causal: bool) -> int:
        """(query, key) pairs its queries attend: the keys of its document up to each (causal) or all."""
        m = self.length
        if causal:
            return m * (self.start - self.doc_start) + m * (m + 1) // 2
        return m * (self.doc_end - self.doc_start)


def _work(length: int, causal: bool) -> int:
    return length * (length + 1) // 2 if causal else length * length


def _head_tail(a: int, length: int, p: int, turn: int) -> list[list[Piece]]:
    """Document ``[a, a + length)`` cut into ``2P`` pieces, rank r taking pieces r and 2P-1-r; the
    positions left over by ``length / P`` go one each to ranks ``turn, turn + 1, ...`` (mod P)."""
    share = [length // p + (1 if (r - turn) % p < length % p else 0) for r in range(p)]
    sizes = [share[r] // 2 for r in range(p)] + [share[r] - share[r] // 2 for r in reversed(range(p))]
    pieces, at = [[] for _ in range(p)], a
    for i, size in enumerate(sizes):
        if size:
            pieces[i if i < p else 2 * p - 1 - i].append(Piece(-1, at, size, a, a + length))
        at += size
    return pieces


def _least_loaded_with_room(load: list, room: list, length: int) -> int:
    """The rank of least work (the lowest such rank) with room for ``length`` positions, or -1."""
    best = -1
    for r, free in enumerate(room):
        if free >= length and (best < 0 or load[r] < load[best]):
            best = r
    return best


def _assign(cu: tuple, p: int, causal: bool, cut: set) -> tuple[tuple, list[int]]:
    """Every rank's documents and work: the documents in ``cut`` head-tail, the others whole by work
    (largest first, to the least-loaded rank with room), the rest cut at the ranks' remaining room.
    Returns ``((whole, pieces), work)``: the documents each rank holds whole (indices) and its other
    :class:`Piece` s; :func:`_pieces` makes them one list per rank (once, for the layout kept)."""
    room, load = [cu[-1] // p] * p, [0] * p
    pieces = [[] for _ in range(p)]
    turn = 0
    for d in sorted(cut):
        a, b = cu[d], cu[d + 1]
        for r, mine in enumerate(_head_tail(a, b - a, p, turn)):
            for piece in mine:
                pieces[r].append(Piece(d, piece.start, piece.length, a, b))
                room[r] -= piece.length
                load[r] += piece.work(causal)
        turn = (turn + (b - a) % p) % p
    lengths = list(map(operator.sub, cu[1:], cu))
    # longest first, ties in document order (a stable sort keeps it, reversed too)
    whole = sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True)
    left, mine = [], [[] for _ in range(p)]  # documents each rank takes whole
    ranks = [(load[r], r) for r in range(p) if room[r]]  # a heap of (work, rank) of the ranks with room
    heapq.heapify(ranks)
    heappop, heapreplace, heappush = heapq.heappop, heapq.heapreplace, heapq.heappush
    for d in whole if not cut else [d for d in whole if d not in cut]:
        m = lengths[d]
        skipped = None  # ranks of less work without room for this document (a shorter one may fit)
        while ranks and room[ranks[0][1]] < m:
            skipped = skipped or []
            skipped.append(heappop(ranks))
        if ranks:  # the rank of least work (the lowest such rank) with room for it
            w, r = ranks[0]
            mine[r].append(d)
            room[r] -= m
            load[r] = w + (m * (m + 1) // 2 if causal else m * m)
            if room[r]:
                heapreplace(ranks, (load[r], r))
            else:
                heappop(ranks)
        else:
            left.append(d)
        for entry in skipped or ():
            heappush(ranks, entry)
    for d in sorted(left):
        a, b = cu[d], cu[d + 1]
        at = a
        while at < b:
            r = _least_loaded_with_room(load, room, 1)
            piece = Piece(d, at, min(room[r], b - at), a, b)
            pieces[r].append(piece)
            room[r] -= piece.length
            load[r] += piece.work(causal)
            at += piece.length
    return (mine, pieces), load


def _pieces(cu: tuple, assigned: tuple) -> list[list[Piece]]:
    """Every rank's :class:`Piece` s in sequence order, from :func:`_assign`'s documents and pieces."""
    make = tuple.__new__  # a Piece without its keyword-checking constructor: thousands per layout
    out = []
    for docs, extra in zip(*assigned):
        docs.sort()  # document order is sequence order
        mine = [make(Piece, (d, cu[d], cu[d + 1] - cu[d], cu[d], cu[d + 1])) for d in docs]
        out.append(sorted(mine + extra, key=operator.itemgetter(1)) if extra else mine)  # by start
    return out


def _imbalance(work: list[int]) -> float:
    return max(work) / (sum(work) / len(work)) if sum(work) else 1.0


def _check(cu_seqlens, world_size: int) -> tuple:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point:
            raise ValueError("cu_seqlens must be a 1-D integer tensor of cumulative lengths [0, ..., N]")
        cu_seqlens = cu_seqlens.tolist()
    cu = tuple(map(int, cu_seqlens))
    if len(cu) < 2 or cu[0] != 0 or not all(map(operator.lt, cu, cu[1:])):
        raise ValueError(f"cu_seqlens must rise strictly from 0 (cumulative document lengths [0, ..., N]), got "
                         f"{list(cu[:8])}{' ...' if len(cu) > 8 else ''}")
    if cu[-1] % world_size:
        raise ValueError(f"the documents' total length {cu[-1]} must be divisible by world_size {world_size} "
                         "(every rank holds N / P positions): pad the batch")
    return cu


@dataclass(frozen=True, eq=False)
class DocumentLayout:
    """The positions of ``cu_seqlens``'s packed documents that each of ``world_size`` ranks holds,
    balancing their attention work (causal or not); see the module docstring. Build it with
    :meth:`balance`. ``pieces[r]``: rank r's :class:`Piece` s in sequence order. What is derived
    from it (positions, crossing documents, a rank's plan) is kept with it (:meth:`derived`), so
    it lives and goes with the layout."""

    cu_seqlens: tuple
    world_size: int
    causal: bool
    pieces: tuple
    _derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __getstate__(self):  # a pickled layout carries no derived values (device tensors among them)
        return {**self.__dict__, "_derived": {}}

    @classmethod
    def balance(cls, cu_seqlens, world_size: int, causal: bool = True, min_piece: int = MIN_PIECE) -> "DocumentLayout":
        """The layout of the documents ``cu_seqlens`` (int cumulative lengths ``[0, ..., N]``, a list or
        a tensor) over ``world_size`` ranks; documents are cut head-tail only into pieces of at
        least ``min_piece`` positions. ValueError on lengths that are not cumulative or an N that
        ``world_size`` does not divide."""
        cu = _check(cu_seqlens, world_size)
        if isinstance(min_piece, bool) or not isinstance(min_piece, int) or min_piece < 1:
            raise ValueError(f"min_piece must be a positive int, got {min_piece!r}")
        return _balanced(cu, world_size, bool(causal), min_piece)

    @property
    def seq_len(self) -> int:
        return self.cu_seqlens[-1]

    def work_per_rank(self) -> list[int]:
        """(query, key) pairs each rank's queries attend."""
        return [sum(x.work(self.causal) for x in mine) for mine in self.pieces]

    def imbalance(self) -> float:
        """The slowest rank's work over the mean (1.0: balanced)."""
        return _imbalance(self.work_per_rank())

    def derived(self, key, make):
        """``make()``, computed once for this layout and ``key`` and kept with it."""
        if key not in self._derived:
            self._derived[key] = make()
        return self._derived[key]

    def crossing(self) -> frozenset:
        """The documents with pieces on more than one rank."""
        return self.derived("crossing", lambda: _crossing(self.pieces))

    def crossing_pieces(self, rank: int) -> tuple:
        """``((piece, local offset), ...)``: rank ``rank``'s pieces of crossing documents in its local
        order, each with the row at which it starts in the rank's shard."""
        _check_rank(self, rank)
        return self.derived(("crossing_pieces", rank), lambda: _crossing_pieces(self.pieces[rank], self.crossing()))

    def positions(self, rank: int, device=None) -> torch.Tensor:
        """Rank ``rank``'s global positions in its local order (int64, ``N / P`` of them), on ``device``
        (default: the host), made there from the pieces' ranges without waiting for it."""
        _check_rank(self, rank)
        device = torch.device("cpu" if device is None else device)
        mine = self.pieces[rank]
        # the ranges' pinned source is kept too: a CUDA graph captured here replays the copy from it
        return self.derived(("positions", rank, str(device)), lambda: positions_of_ranges(
            [x.start for x in mine], [x.length for x in mine], device))[0]

    def order(self, device=None) -> torch.Tensor:
        """Every rank's positions, rank after rank: ``x[:, order()]`` is the ranks' shards concatenated."""
        return torch.cat([self.positions(r, device) for r in range(self.world_size)])


def _search(cu: tuple, p: int, causal: bool, min_piece: int):
    """``(imbalance, assignment)``: cutting the k heaviest documents of at least 2P x ``min_piece``
    positions head-tail, k = 0, 1, 2, 4, ...: the first within :data:`TARGET_IMBALANCE`, else the best."""
    best, k, cuttable = None, 0, None
    while True:
        pieces, work = _assign(cu, p, causal, set(cuttable[:k]) if k else set())
        score = _imbalance(work)
        if best is None or score < best[0] - 1e-9:
            best = (score, pieces)
        if score <= TARGET_IMBALANCE or p == 1:
            return best
        if cuttable is None:  # found only where whole documents do not balance
            cuttable = sorted((d for d in range(len(cu) - 1) if cu[d + 1] - cu[d] >= 2 * p * min_piece),
                              key=lambda d: (-(cu[d + 1] - cu[d]), d))
        if k >= len(cuttable):
            return best
        k = min(len(cuttable), max(1, 2 * k))


@functools.lru_cache(maxsize=16)
def _balanced(cu: tuple, p: int, causal: bool, min_piece: int) -> DocumentLayout:
    # a document too short for pieces of min_piece that still dominates a rank's work (the rest
    # of the batch is shorter still) is cut into smaller pieces: an uneven rank costs more than
    # a kernel's partly filled tiles
    best = _search(cu, p, causal, min_piece)
    while best[0] > ACCEPTABLE_IMBALANCE and min_piece > 1:
        min_piece //= 2
        found = _search(cu, p, causal, min_piece)
        if found[0] < best[0] - 1e-9:
            best = found
    return DocumentLayout(cu, p, causal, tuple(tuple(m) for m in _pieces(cu, best[1])))


def given_or_last(layout: "DocumentLayout | None", last: "DocumentLayout | None") -> "DocumentLayout":
    """``layout``, else a module's last call's (``last``): what ``shard``/``unshard`` of a module on
    document layouts take; a ValueError naming the fix where neither is there."""
    layout = layout or last
    if layout is None:
        raise ValueError("no layout given and no call made yet: pass layout=module.document_layout(cu_seqlens)")
    return layout


def _crossing(pieces) -> frozenset:
    """The documents of ``pieces`` (every rank's) on more than one rank: only pieces short of their
    document can be."""
    seen, crossing = {}, set()
    for r, mine in enumerate(pieces):
        for x in mine:
            if x.length != x.doc_end - x.doc_start and seen.setdefault(x.doc, r) != r:
                crossing.add(x.doc)
    return frozenset(crossing)


def _crossing_pieces(mine, crossing: frozenset) -> tuple:
    if not crossing:
        return ()
    offsets = itertools.accumulate(map(operator.itemgetter(2), mine), initial=0)
    return tuple((x, off) for x, off in zip(mine, offsets) if x.doc in crossing)


def _check_rank(layout: DocumentLayout, rank: int) -> None:
    if not 0 <= rank < layout.world_size:
        raise ValueError(f"rank must be in [0, {layout.world_size}), got {rank}")


def ranges_to_positions(starts, lengths, device=None) -> torch.Tensor:
    """The positions ``start .. start + length - 1`` of each range (lists of ints), concatenated (int64),
    on ``device`` (default: the host): only the ranges are copied there (from pinned memory, without
    waiting), the positions are made on it."""
    return positions_of_ranges(starts, lengths, device)[0]


def positions_of_ranges(starts, lengths, device=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(positions, the ranges' pinned source or None)``: :func:`ranges_to_positions`, and what a
    caller that keeps the positions for a CUDA graph must keep with them."""
    device = torch.device("cpu" if device is None else device)
    total = sum(lengths)
    if not total:
        return torch.zeros(0, dtype=torch.int64, device=device), None
    ranges, source = host_values_on([list(starts), list(lengths)], torch.int64, device)
    starts, lengths = ranges.unbind(0)
    offsets = torch.cumsum(lengths, 0) - lengths  # where each range begins in the output
    return torch.arange(total, dtype=torch.int64, device=device) + torch.repeat_interleave(
        starts - offsets, lengths, output_size=total), source
