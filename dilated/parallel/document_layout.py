"""Which positions of a packed sequence each rank holds, so that every rank's attention work is equal.

Packed documents attend within themselves, so work per position varies: causal, a position at
offset ``i`` of its document attends ``i + 1`` keys; without a mask, the document's length. The
contiguous and zigzag layouts balance one sequence, not many documents. A :class:`DocumentLayout`
balances the documents given as cumulative lengths ``cu_seqlens`` over ``P`` ranks, each rank
holding exactly ``N / P`` positions. Causal, the work it balances can weigh each pair by the call
that attends it (``pair_costs``): a piece's own keys in a causal call, on some kernels dearer per pair
than the rectangle of its document's keys before it (the modules take the weights of the varlen kernel
their documents go to: :func:`dilated.backends.varlen.documents_pair_costs`); so a rank of whole
documents holds a few fewer pairs than one of pieces.

* documents whose work no whole-document assignment can balance are cut head-tail, as
  TransformerEngine's THD format and PyTorch's per-document balancer cut every document: into
  ``2P`` pieces, rank ``r`` taking pieces ``r`` and ``2P-1-r``, which gives every rank the same
  share of the document's work (causal) and of its positions;
* the other documents stay whole (no communication at all), assigned largest work first to the
  rank with the least work that has room for them (longest-processing-time scheduling);
* a whole document that no rank has room for is cut at the ranks' remaining room, in order.

Causal, the first document cut head-tail is then split again: each rank keeps its share of that
document's positions, but the boundary between its head and its tail piece moves. A rank whose head
grows by ``x`` starts every later rank's pieces ``x`` positions later in the document, so each of their
queries sees ``x`` more keys: work moves between ranks, and no position does. The split goes as far as it
takes to even out the ranks' work, so that one long document cut can balance what would otherwise take
cutting the next ones too (every document cut is a crossing one, whose rows travel between ranks).

The layout tries cutting the ``k`` documents of most work head-tail for ``k = 0, 1, 2, 4, ...``
and keeps the first whose slowest rank is within :data:`TARGET_IMBALANCE` of the mean (else the
most balanced it found; a ``k`` that surely misses, its longest whole document alone lifting a
rank above the target, or a rank above it while the documents are assigned, is given up at once);
documents shorter than ``2P`` x :data:`MIN_PIECE` are cut head-tail only where no layout without
them comes within :data:`ACCEPTABLE_IMBALANCE` of the mean (pieces that small waste a kernel's
tiles; halving the smallest piece allowed until one does).

Each rank holds its pieces in sequence order. :meth:`DocumentLayout.positions` is a rank's
global positions (what :func:`dilated.shard` takes); a document with pieces on several ranks is
*crossing*, and only its rows travel between ranks (:class:`dilated.DocumentParallelAttention`).
Computed on the host from the lengths alone; a layout pickles, so a data loader's worker can build
it beside its batch.
"""
from __future__ import annotations

import bisect
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
#: what a causal layout balances by default: (query, key) pairs weighted ``(triangle, rectangle)`` = (1, 1),
#: the pairs as they are. A piece's queries attend their own keys in a causal call (a triangle, its
#: diagonal tiles masked) and the keys of their document before the piece as a rectangle (every tile
#: full); where a kernel's causal pairs cost more, a rank of whole documents finishes last on equal pairs
EQUAL_COSTS = (1, 1)


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
        return piece_work(self.length, self.start - self.doc_start, self.doc_end - self.doc_start, causal)


def piece_work(length: int, offset: int, doc_length: int, causal: bool) -> int:
    """(query, key) pairs attended by ``length`` positions from ``offset`` of a document of ``doc_length``:
    causal, each position its document's keys up to it; else all of them."""
    return piece_cost(length, offset, doc_length, causal)


def document_work(length: int, causal: bool) -> int:
    """(query, key) pairs a whole document of ``length`` positions attends."""
    return piece_work(length, 0, length, causal)


def piece_cost(length: int, offset: int, doc_length: int, causal: bool, costs: tuple = EQUAL_COSTS) -> int:
    """:func:`piece_work` with causal pairs weighted ``costs = (triangle, rectangle)``: the piece's own
    triangle of pairs and the rectangle of its document's keys before it."""
    if not causal:
        return length * doc_length
    triangle, rectangle = costs
    return rectangle * length * offset + triangle * (length * (length + 1) // 2)


def _shares(length: int, p: int, turn: int) -> list[int]:
    """Each rank's positions of a document of ``length`` cut head-tail: ``length / P``, the positions left
    over going one each to ranks ``turn, turn + 1, ...`` (mod P)."""
    base, extra = divmod(length, p)
    return [base + ((r - turn) % p < extra) for r in range(p)]


def _head_tail(a: int, length: int, p: int, turn: int, heads=None) -> list[tuple[int, int, int]]:
    """Document ``[a, a + length)`` cut into ``2P`` pieces, rank r taking pieces r and 2P-1-r, as
    ``(rank, start, length)`` in sequence order (empty pieces left out); rank r holds
    ``_shares(length, p, turn)[r]`` positions, ``heads[r]`` of them in its head piece (default half)."""
    share = _shares(length, p, turn)
    heads = [m // 2 for m in share] if heads is None else heads
    out, at = [], a
    for r in range(p):  # the heads
        if heads[r]:
            out.append((r, at, heads[r]))
            at += heads[r]
    for r in reversed(range(p)):  # the tails
        if share[r] - heads[r]:
            out.append((r, at, share[r] - heads[r]))
            at += share[r] - heads[r]
    return out


def _even_out(cu: tuple, p: int, causal: bool, d: int, load: list,
              costs: tuple = EQUAL_COSTS) -> tuple[tuple | None, list]:
    """``(heads, work)``: document ``d``, the first cut head-tail (``turn`` 0), split again between each
    rank's head and tail piece, every rank keeping its share of the document's positions, so that the
    ranks' work ``load`` (which counts the even split; pairs weighted by ``costs``, :func:`piece_cost`)
    comes as near the mean as the document allows. Moving ``x`` of rank r's positions from its tail to its
    head starts the pieces of every rank ``j > r`` ``x`` positions later in the document, moving about
    ``x * share[j]`` causal pairs (of a rectangle) from r to each of them: a step per rank r < P-1, from the
    first, each from the ranks' exact work; twice (the pairs moved are quadratic in ``x``). ``heads`` None
    where no split beats the even one."""
    a, length = cu[d], cu[d + 1] - cu[d]
    share = _shares(length, p, 0)

    def work_of(heads):
        w = [0] * p
        for r, start, m in _head_tail(a, length, p, 0, heads):
            w[r] += piece_cost(m, start - a, length, causal, costs)
        return w

    heads = [m // 2 for m in share]
    rest = list(map(operator.sub, load, work_of(heads)))
    mean = sum(load) / p
    for _ in range(2):
        for r in range(p - 1):
            now = rest[r] + work_of(heads)[r]
            later = sum(share[r + 1:]) * costs[1]
            if later:
                heads[r] += max(-heads[r], min(share[r] - heads[r], round((now - mean) / later)))
    work = list(map(operator.add, rest, work_of(heads)))
    return (tuple(heads), work) if max(work) < max(load) else (None, load)


def _least_loaded_with_room(load: list, room: list, length: int) -> int:
    """The rank of least work (the lowest such rank) with room for ``length`` positions, or -1."""
    return min((r for r, free in enumerate(room) if free >= length), key=load.__getitem__, default=-1)


class _Documents(NamedTuple):
    """What every pass of the search shares: the documents' work and the order in which they are
    assigned whole."""

    work: list
    #: ``(length, work, document)``, longest first, ties in document order
    in_order: list


def _documents(cu: tuple, causal: bool, costs: tuple = EQUAL_COSTS) -> _Documents:
    lengths = list(map(operator.sub, cu[1:], cu))
    # piece_cost of whole documents, written out: one list for a thousand documents
    triangle = costs[0]  # m (m + 1) is even: the halving is exact
    work = [triangle * m * (m + 1) // 2 for m in lengths] if causal else [m * m for m in lengths]
    # a stable sort keeps ties in document order, reversed too
    return _Documents(work, sorted(zip(lengths, work, range(len(lengths))), key=operator.itemgetter(0), reverse=True))


def _head_tail_cuts(cu: tuple, p: int, order, heads=None):
    """``(document, start, end, pieces)`` of each document of ``order`` cut head-tail
    (:func:`_head_tail`; the first with ``heads``), the positions left over by ``length / P`` going round
    the ranks in that order."""
    turn = 0
    for i, d in enumerate(order):
        a, b = cu[d], cu[d + 1]
        yield d, a, b, _head_tail(a, b - a, p, turn, heads if i == 0 else None)
        turn = (turn + (b - a) % p) % p


def _cut_head_tail(cu: tuple, p: int, order, heads=None) -> list:
    """Every rank's :class:`Piece` s of the documents ``order`` cut head-tail (:func:`_head_tail_cuts`)."""
    pieces = [[] for _ in range(p)]
    make = tuple.__new__
    for d, a, b, cuts in _head_tail_cuts(cu, p, order, heads):
        for r, start, m in cuts:
            pieces[r].append(make(Piece, (d, start, m, a, b)))
    return pieces


class _CutPrefix:
    """The ranks' room and work (pairs weighted by ``costs``: :func:`piece_cost`) with the first ``k``
    documents of ``order`` (the documents of most work first) cut head-tail, for every ``k`` asked, each
    document cut once: the passes of the search cut ever longer prefixes of one order."""

    def __init__(self, cu: tuple, p: int, causal: bool, order: list, costs: tuple = EQUAL_COSTS):
        self.cu, self.p, self.causal, self.order, self.costs = cu, p, causal, order, costs
        self.room, self.load = [[cu[-1] // p] * p], [[0] * p]
        self._cuts = _head_tail_cuts(cu, p, order)

    def at(self, k: int) -> tuple[list, list]:
        """Copies of ``(room, load)`` with ``order[:k]`` cut."""
        while len(self.room) <= k:
            _, a, b, cuts = next(self._cuts)
            room, load = list(self.room[-1]), list(self.load[-1])
            for r, start, m in cuts:
                room[r] -= m
                load[r] += piece_cost(m, start - a, b - a, self.causal, self.costs)
            self.room.append(room)
            self.load.append(load)
        return list(self.room[k]), list(self.load[k])

    def pieces(self, k: int, heads=None) -> list:
        """Every rank's pieces of ``order[:k]`` (the first split as ``heads`` gives: :func:`_even_out`)."""
        return _cut_head_tail(self.cu, self.p, self.order[:k], heads)


def _cannot_balance(cut: _CutPrefix, k: int, docs: _Documents, total: int, evened: bool = False) -> bool:
    """Whether cutting the first ``k`` documents of ``cut`` head-tail surely leaves a rank above
    :data:`TARGET_IMBALANCE`: the longest document left whole goes to a rank with room for it, whose
    work is then at least the least among those ranks' plus the document's; where the first cut
    document is split again (``evened``: :func:`_even_out` moves work between ranks), at least the
    document's own."""
    gone = set(cut.order[:k])
    longest = next((x for x in docs.in_order if x[2] not in gone), None)
    if longest is None:
        return False
    m, work, _ = longest
    room, load = cut.at(k)
    fits = [w for w, free in zip(load, room) if free >= m]
    return bool(fits) and ((0 if evened else min(fits)) + work) / (total / cut.p) > TARGET_IMBALANCE


def _assign(cu: tuple, p: int, causal: bool, cut: _CutPrefix, k: int, docs: _Documents,
            above: float | None = None, slack=None) -> tuple[tuple, list[int]] | None:
    """Every rank's documents and work: the first ``k`` documents of ``cut`` head-tail, the others
    whole by work (largest first, to the least-loaded rank with room), the rest cut at the ranks'
    remaining room. Returns ``((whole, pieces, k), work)``: the documents each rank holds whole
    (indices) and its pieces of the documents cut at its room (its head-tail pieces are
    ``cut.pieces(k)``); None as soon as a rank's work, less its ``slack`` (per rank; what a later step
    may take off it), over the mean is above ``above`` (work only grows)."""
    room, load = cut.at(k)
    gone = set(cut.order[:k])
    mean = sum(docs.work) / p
    limit = float("inf") if above is None else above * mean * (1 - 1e-12)  # checked exactly when passed
    left, mine = [], [[] for _ in range(p)]  # documents each rank takes whole
    ranks = [(load[r], r) for r in range(p) if room[r]]  # a heap of (work, rank) of the ranks with room
    heapq.heapify(ranks)
    # ranks of less work without room for the document at hand, by room (most first): documents come
    # longest first, so one comes back only once a document fits its room, not at every document
    parked = []
    heappop, heapreplace, heappush = heapq.heappop, heapq.heapreplace, heapq.heappush
    for m, work, d in docs.in_order if not gone else [x for x in docs.in_order if x[2] not in gone]:
        while parked and -parked[0][0] >= m:
            _, w, r = heappop(parked)
            heappush(ranks, (w, r))
        while ranks and room[ranks[0][1]] < m:
            w, r = heappop(ranks)
            heappush(parked, (-room[r], w, r))
        if ranks:  # the rank of least work (the lowest such rank) with room for it
            w, r = ranks[0]
            mine[r].append(d)
            room[r] -= m
            load[r] = w = w + work
            if w > limit and (slack is None or w - slack[r] > limit) and w / mean > above:
                return None
            if room[r]:
                heapreplace(ranks, (w, r))
            else:
                heappop(ranks)
        else:
            left.append(d)
    pieces = [[] for _ in range(p)]
    for d in sorted(left):
        a, b = cu[d], cu[d + 1]
        at = a
        while at < b:
            r = _least_loaded_with_room(load, room, 1)
            piece = Piece(d, at, min(room[r], b - at), a, b)
            pieces[r].append(piece)
            room[r] -= piece.length
            load[r] += piece_cost(piece.length, at - a, b - a, causal, cut.costs)
            at += piece.length
    return (mine, pieces, k), load


def _rank_pieces(cu: tuple, whole: tuple, cut: tuple) -> tuple:
    """A rank's :class:`Piece` s in sequence order: its documents held whole (indices in order) and its
    pieces of the others."""
    make = tuple.__new__  # a Piece without its keyword-checking constructor: hundreds per rank
    mine = [make(Piece, (d, cu[d], cu[d + 1] - cu[d], cu[d], cu[d + 1])) for d in whole]
    return tuple(sorted(mine + list(cut), key=operator.itemgetter(1)) if cut else mine)  # by start


def _imbalance(work: list[int]) -> float:
    return max(work) / (sum(work) / len(work)) if sum(work) else 1.0


def _check(cu_seqlens, world_size: int) -> tuple:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point:
            raise ValueError("cu_seqlens must be a 1-D integer tensor of cumulative lengths [0, ..., N]")
        cu = tuple(cu_seqlens.tolist())  # Python ints already
    else:
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
    :meth:`balance`. ``whole[r]``: the documents rank r holds whole (indices, in order); ``cut[r]``:
    its :class:`Piece` s of the documents it holds in part; ``pieces[r]`` (or :meth:`pieces_of`,
    one rank's, made when first asked): all its :class:`Piece` s in sequence order. What is derived
    from it (pieces, positions, crossing documents, a rank's plan) is kept with it (:meth:`derived`),
    so it lives and goes with the layout."""

    cu_seqlens: tuple
    world_size: int
    causal: bool
    whole: tuple
    cut: tuple
    #: the ``(triangle, rectangle)`` weights of causal pairs it balanced
    pair_costs: tuple = EQUAL_COSTS
    _derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __getstate__(self):  # a pickled layout carries no derived values (device tensors among them)
        return {**self.__dict__, "_derived": {}}

    @classmethod
    def balance(cls, cu_seqlens, world_size: int, causal: bool = True, min_piece: int = MIN_PIECE,
                pair_costs: tuple = EQUAL_COSTS) -> "DocumentLayout":
        """The layout of the documents ``cu_seqlens`` (int cumulative lengths ``[0, ..., N]``, a list or
        a tensor) over ``world_size`` ranks; documents are cut head-tail only into pieces of at
        least ``min_piece`` positions. Causal, what it balances is the ranks' pairs weighted
        ``pair_costs = (triangle, rectangle)`` (positive ints; the default ``(1, 1)``: the pairs themselves;
        a kernel's: :attr:`dilated.backends.varlen.VarlenKernel.pair_costs`). ValueError on lengths that
        are not cumulative or an N that ``world_size`` does not divide."""
        cu = _check(cu_seqlens, world_size)
        if isinstance(min_piece, bool) or not isinstance(min_piece, int) or min_piece < 1:
            raise ValueError(f"min_piece must be a positive int, got {min_piece!r}")
        if (not isinstance(pair_costs, tuple) or len(pair_costs) != 2
                or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in pair_costs)):
            raise ValueError(f"pair_costs must be a tuple of two positive ints (triangle, rectangle), got "
                             f"{pair_costs!r}: e.g. (12, 11), or (1, 1) to balance the pairs themselves")
        return _balanced(cu, world_size, bool(causal), min_piece, pair_costs if causal else EQUAL_COSTS)

    @classmethod
    def head_tail(cls, cu_seqlens, world_size: int, causal: bool = True) -> "DocumentLayout":
        """The layout that cuts every document of at least ``2P`` positions head-tail (rank ``r``
        its pieces ``r`` and ``2P-1-r``: TransformerEngine's THD layout, the zigzag of each
        document), the shorter ones as :meth:`balance` assigns them (whole where a rank has room):
        every rank holds an equal share of nearly every document, and nearly every document crosses
        every rank. What :meth:`balance` is measured against; the modules take it as their ``layout``."""
        return _head_tail_layout(_check(cu_seqlens, world_size), world_size, bool(causal))

    @property
    def seq_len(self) -> int:
        return self.cu_seqlens[-1]

    @property
    def pieces(self) -> tuple:
        """Every rank's :class:`Piece` s in sequence order."""
        return tuple(map(self.pieces_of, range(self.world_size)))

    def pieces_of(self, rank: int) -> tuple:
        """Rank ``rank``'s :class:`Piece` s in sequence order."""
        _check_rank(self, rank)
        return self.derived(("pieces", rank), lambda: _rank_pieces(self.cu_seqlens, self.whole[rank], self.cut[rank]))

    def work_per_rank(self) -> list[int]:
        """(query, key) pairs each rank's queries attend."""
        return self._weighted(EQUAL_COSTS)

    def imbalance(self) -> float:
        """The slowest rank's work (pairs) over the mean (1.0: balanced); a layout weighing causal pairs
        (:attr:`pair_costs`) balances :meth:`cost_per_rank` instead, its pairs a little apart."""
        return _imbalance(self.work_per_rank())

    def cost_per_rank(self) -> list[int]:
        """Each rank's pairs weighted by :attr:`pair_costs` (what :meth:`balance` balances)."""
        return self._weighted(self.pair_costs)

    def _weighted(self, costs: tuple) -> list[int]:
        cu, causal = self.cu_seqlens, self.causal
        return [sum(piece_cost(cu[d + 1] - cu[d], 0, cu[d + 1] - cu[d], causal, costs) for d in whole)
                + sum(piece_cost(x.length, x.start - x.doc_start, x.doc_end - x.doc_start, causal, costs) for x in cut)
                for whole, cut in zip(self.whole, self.cut)]

    def derived(self, key, make):
        """``make()``, computed once for this layout and ``key`` and kept with it."""
        if key not in self._derived:
            self._derived[key] = make()
        return self._derived[key]

    def crossing(self) -> frozenset:
        """The documents with pieces on more than one rank."""
        return self.derived("crossing", lambda: _crossing(self.cut))

    def crossing_pieces(self, rank: int) -> tuple:
        """``((piece, local offset), ...)``: rank ``rank``'s pieces of crossing documents in its local
        order, each with the row at which it starts in the rank's shard."""
        _check_rank(self, rank)
        return self.derived(("crossing_pieces", rank), lambda: _crossing_pieces(self.cu_seqlens, self.whole[rank],
                                                                                   self.cut[rank], self.crossing()))

    def positions(self, rank: int, device=None) -> torch.Tensor:
        """Rank ``rank``'s global positions in its local order (int64, ``N / P`` of them), on ``device``
        (default: the host), made there from the pieces' ranges without waiting for it."""
        _check_rank(self, rank)
        device = torch.device("cpu" if device is None else device)
        mine = self.pieces_of(rank)
        # the ranges' pinned source is kept too: a CUDA graph captured here replays the copy from it
        return self.derived(("positions", rank, str(device)), lambda: positions_of_ranges(
            [x.start for x in mine], [x.length for x in mine], device))[0]

    def order(self, device=None) -> torch.Tensor:
        """Every rank's positions, rank after rank: ``x[:, order()]`` is the ranks' shards concatenated."""
        return torch.cat([self.positions(r, device) for r in range(self.world_size)])


def _search(cu: tuple, p: int, causal: bool, min_piece: int, docs: _Documents, cut: _CutPrefix):
    """``(imbalance, assignment)``: cutting the k heaviest documents of at least 2P x ``min_piece``
    positions head-tail, k = 0, 1, 2, 4, ...: the first within :data:`TARGET_IMBALANCE`, else the best.
    A k that surely misses the target (:func:`_cannot_balance`, or a rank above it while assigning)
    is assigned in full only where none meets it. ``cut``: the head-tail cuts of the documents in
    ``docs``' order (those of at least 2P x ``min_piece`` positions are a prefix of it)."""
    total = sum(docs.work)
    shortest = 2 * p * min_piece  # the documents of most work are the longest: a prefix of the order
    # how many come first, longest first: a search, not a count
    cuttable = bisect.bisect_left(docs.in_order, -shortest, key=lambda x: -x[0]) if p > 1 else 0
    ks = [0]
    while ks[-1] < cuttable:
        ks.append(min(cuttable, max(1, 2 * ks[-1])))
    for k in ks:
        if k < ks[-1] and _cannot_balance(cut, k, docs, total, evened=causal and k > 0):
            continue
        found = _assign_evened(cu, p, causal, cut, k, docs, above=TARGET_IMBALANCE)  # None: above the target
        if found is not None and _imbalance(found[1]) <= TARGET_IMBALANCE:
            return _imbalance(found[1]), found[0]
    best = None  # none met the target: the most balanced of every k, the lowest k among equals
    for k in ks:
        pieces, work = _assign_evened(cu, p, causal, cut, k, docs)
        score = _imbalance(work)
        if best is None or score < best[0] - 1e-9:
            best = (score, pieces)
    return best


def _assign_evened(cu: tuple, p: int, causal: bool, cut: _CutPrefix, k: int, docs: _Documents,
                   above: float | None = None) -> tuple[tuple, list[int]] | None:
    """:func:`_assign`, then (causal, ``k >= 1``) the first document cut head-tail split again by
    :func:`_even_out`: ``((whole, pieces, k, heads), work)``, or None where a rank's work is surely above
    ``above`` while assigning (above it without its pieces of that document)."""
    evened = causal and k > 0
    # re-split, the first document's pieces can take at most their work off a rank
    found = _assign(cu, p, causal, cut, k, docs, above, cut.at(1)[1] if evened else None)
    if found is None:
        return None
    (whole, pieces, _), work = found
    heads, work = _even_out(cu, p, causal, cut.order[0], work, cut.costs) if evened else (None, work)
    return (whole, pieces, k, heads), work


@functools.lru_cache(maxsize=16)
def _balanced(cu: tuple, p: int, causal: bool, min_piece: int, costs: tuple) -> DocumentLayout:
    # a document too short for pieces of min_piece that still dominates a rank's work (the rest
    # of the batch is shorter still) is cut into smaller pieces: an uneven rank costs more than
    # a kernel's partly filled tiles
    docs = _documents(cu, causal, costs)
    cut = _CutPrefix(cu, p, causal, [d for _, _, d in docs.in_order], costs)
    best = _search(cu, p, causal, min_piece, docs, cut)
    while best[0] > ACCEPTABLE_IMBALANCE and min_piece > 1:
        min_piece //= 2
        found = _search(cu, p, causal, min_piece, docs, cut)
        if found[0] < best[0] - 1e-9:
            best = found
    return _layout(cu, p, causal, best[1], cut)


def _layout(cu: tuple, p: int, causal: bool, assignment, cut: _CutPrefix) -> DocumentLayout:
    """The layout of an assignment ``(whole, pieces, k, heads)`` of :func:`_assign_evened` on ``cut``."""
    whole, pieces, k, heads = assignment
    return DocumentLayout(cu, p, causal, tuple(tuple(sorted(docs)) for docs in whole),
                          tuple(tuple(ht + mine) for ht, mine in zip(cut.pieces(k, heads), pieces)), cut.costs)


@functools.lru_cache(maxsize=16)
def _head_tail_layout(cu: tuple, p: int, causal: bool) -> DocumentLayout:
    docs = _documents(cu, causal)
    cut = _CutPrefix(cu, p, causal, sorted(d for m, _, d in docs.in_order if m >= 2 * p) if p > 1 else [])
    return _layout(cu, p, causal, (*_assign(cu, p, causal, cut, len(cut.order), docs)[0], None), cut)


def given_or_last(layout: "DocumentLayout | None", last: "DocumentLayout | None") -> "DocumentLayout":
    """``layout``, else a module's last call's (``last``): what ``shard``/``unshard`` of a module on
    document layouts take; a ValueError naming the fix where neither is there."""
    layout = layout or last
    if layout is None:
        raise ValueError("no layout given and no call made yet: pass layout=module.document_layout(cu_seqlens)")
    return layout


def _crossing(pieces) -> frozenset:
    """The documents of ``pieces`` (every rank's pieces of documents not held whole) on more than one
    rank: only pieces short of their document can be."""
    seen, crossing = {}, set()
    for r, mine in enumerate(pieces):
        for x in mine:
            if x.length != x.doc_end - x.doc_start and seen.setdefault(x.doc, r) != r:
                crossing.add(x.doc)
    return frozenset(crossing)


def _crossing_pieces(cu: tuple, whole: tuple, cut: tuple, crossing: frozenset) -> tuple:
    """A rank's pieces of ``crossing`` documents, each with its offset in the rank's shard: the
    lengths of its documents held whole before it (by a search of their starts) and of its other
    pieces before it."""
    if not crossing or not any(x.doc in crossing for x in cut):
        return ()
    starts = [cu[d] for d in whole]
    before = list(itertools.accumulate((cu[d + 1] - cu[d] for d in whole), initial=0))
    out, at = [], 0  # at: the rows of its pieces (not whole documents) before the one at hand
    for x in sorted(cut, key=operator.itemgetter(1)):
        if x.doc in crossing:
            out.append((x, before[bisect.bisect_left(starts, x.start)] + at))
        at += x.length
    return tuple(out)


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
    # the positions rise by one inside a range and jump at each range's first row: the positions are
    # the running sum of those steps, made from the rows where a range begins and their steps
    firsts, steps, total, last = [], [], 0, 0  # the first step is its start
    for start, length in zip(starts, lengths):
        if length:
            if start - last != 1:  # a range that goes on from the one before needs no step of its own
                firsts.append(total)
                steps.append(start - last)
            total, last = total + length, start + length - 1
    if not total:
        return torch.zeros(0, dtype=torch.int64, device=device), None
    positions = torch.ones(total, dtype=torch.int64, device=device)
    if not firsts:  # every range goes on from the one before, the first from 1: the running sum of ones
        return positions.cumsum_(0), None
    (firsts, steps), source = host_values_on([firsts, steps], torch.int64, device)
    positions.index_put_((firsts,), steps)
    return positions.cumsum_(0), source
