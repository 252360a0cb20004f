"""The pattern cache: per-shape plans of the fast dilated path, bounded, with hit/miss counts.

A plan is the list of kernel calls one forward makes: for each branch and segment block, how the
branch's rows are reached (a free segment view for r = 1, one diagonal gather for r > 1, or one
slice per head offset in the general case) and, for GQA with r > 1, the small index of kv heads
(``H/r`` entries, never data-sized). Kernels that read strided rows (``reads_strided_rows``) get
strided views instead of gathers (``in_place``): one call per head offset, or per segment for all
offsets at once (a diagonal is a fixed stride), where each such call still fills the device.
Keyed by shape, schedule, causality, device, dtype and that choice.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class BranchCall:
    """One kernel call: rows ``[start, start + count*length)`` cut into ``count`` segments."""

    start: int
    count: int
    length: int
    r: int
    mode: str  # "view" (r == 1), "diag" (all offsets in one gather), "offset" (one offset)
    offset: int = 0
    kv_heads: torch.Tensor | None = field(default=None, compare=False)
    row_offset: int | None = None  # "offset" calls: first row of each segment, when not ``offset``
    in_place: bool = False  # the kernel reads the strided rows (no gather): "offset" or one-segment "diag"

    @property
    def first_row(self) -> int:
        return self.offset if self.row_offset is None else self.row_offset


QUERY_TILE = 128  # rows per query tile of the flash-type kernels (for the device-filling estimate)


def in_place_min_tiles(device) -> int:
    """Query tiles an in-place call needs to fill ``device``: one wave of its multiprocessors.
    (H200, 32K-128K tokens, LongNet schedule: one wave beat two by 3% at 32K; half a wave was no
    better.)"""
    device = torch.device(device)
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).multi_processor_count


def build_plan(n: int, h: int, hkv: int, segment_lengths, dilation_rates, device, *, batch: int = 1,
               in_place_tiles: int | None = None) -> list[BranchCall]:
    """The calls of one forward. ``in_place_tiles``: the kernel reads strided rows; r > 1 branches
    are then read in place (no gather) where each call has at least this many query tiles (or
    where a diagonal gather is impossible anyway), as one call per head offset or, with one batch,
    one call per segment holding all r offsets (the diagonal over position and head mod r is a
    fixed stride, ``(H + 1) * D``), whichever makes fewer calls; None: gather them."""
    from .dilated_attention import segment_blocks

    groups = h // hkv
    calls = []
    for w, r in zip(segment_lengths, dilation_rates):
        w = min(w, n)
        for start, count, length in segment_blocks(n, w):
            if r == 1:
                calls.append(BranchCall(start, count, length, 1, "view"))
                continue
            diag = length % r == 0 and h % r == 0 and groups == 1
            form = None
            if in_place_tiles is not None and groups == 1:
                form = _in_place_form(n, count, length, h, r, diag, batch, in_place_tiles)
            if form == "per_segment":
                calls += [BranchCall(start + s * length, 1, length, r, "diag", in_place=True) for s in range(count)]
            elif form is None and diag:
                calls.append(BranchCall(start, count, length, r, "diag"))
            else:  # one call per head offset, in place or each gathered
                for off in range(min(r, length, h)):
                    kvh = None
                    if groups > 1:
                        kvh = torch.arange(off, h, r, device=device) // groups
                    calls.append(BranchCall(start, count, length, r, "offset", off, kvh, in_place=form == "per_offset"))
    return calls


def _in_place_form(n, count, length, h, r, diag, batch, min_tiles) -> str | None:
    """How a dilated block is read in place: "per_offset" (one call per head offset),
    "per_segment" (one call per segment, all offsets) or None (gathered). Each call needs
    ``min_tiles`` query tiles, unless it is the one call a diagonal gather would make anyway
    (one segment) or no diagonal gather exists; of two such forms, the one with fewer calls."""
    row_tiles = -(-length // (r * QUERY_TILE))
    options = []  # (calls, form, query tiles per call)
    # kernel layout [B * count, ...] must stay a view: one batch, one segment or all rows
    viewable = batch == 1 or count == 1 or count * length == n
    if viewable:
        options.append((r, "per_offset", batch * count * (h // r) * row_tiles))
    if diag and batch == 1:  # [count, r] does not fold into one batch stride: one call per segment
        options.append((count, "per_segment", h * row_tiles if count > 1 else min_tiles))
    filled = [o for o in options if o[2] >= min_tiles]
    if filled:
        return min(filled, key=lambda o: o[0])[1]  # ties: per offset
    return "per_offset" if viewable and not diag else None


def plan_for(q: torch.Tensor, k: torch.Tensor, segment_lengths, dilation_rates, in_place: bool = False):
    """:func:`build_plan` for these inputs (``in_place``: the kernel reads strided rows)."""
    return build_plan(q.shape[1], q.shape[2], k.shape[2], segment_lengths, dilation_rates, q.device,
                      batch=q.shape[0], in_place_tiles=in_place_min_tiles(q.device) if in_place else None)


class PatternCache:
    """LRU of what a call's input signature determines (its plan, or all an entry point resolves
    from it), at most ``max_entries``; ``stats()`` gives hits, misses and size."""

    def __init__(self, max_entries: int = 32):
        self.max_entries = max_entries
        self._plans: OrderedDict = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key, build):
        """The entry for ``key`` (hashable), made by ``build()`` on a miss."""
        if key in self._plans:
            self.hits += 1
            self._plans.move_to_end(key)
            return self._plans[key]
        self.misses += 1
        value = self._plans[key] = build()
        while len(self._plans) > self.max_entries:
            self._plans.popitem(last=False)
        return value

    def stats(self) -> dict:
        return {"hits": self.hits, "misses": self.misses, "size": len(self._plans), "max_entries": self.max_entries}

    def clear(self) -> None:
        self._plans.clear()
        self.hits = self.misses = 0
