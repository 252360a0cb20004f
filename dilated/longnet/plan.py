"""Which kernel calls compute one dilated attention: the plan, in one place.

A plan is the list of kernel calls one forward makes (:class:`KernelCall`): for each branch
``(w, r)`` and block of segments, how the branch's rows are reached: a free segment view for
r = 1, one diagonal gather for r > 1 (position and head agree mod r), or one call per head offset
in the general case. For GQA with r > 1 an offset call carries the small index of its kv heads
(``H/r`` entries, never data-sized). Kernels that read strided rows (``reads_strided_rows``: cuDNN,
flash and flash-attn 4 on CUDA) get strided views instead of gathers (``in_place``): one call per head offset,
or per segment for all offsets at once (a diagonal is a fixed stride), where each such call still
fills the device. :func:`plan_for` decides it for given inputs; :class:`AttentionSpec` is what all
the calls share. The rows of a call are cut and mixed by :mod:`dilated.longnet.rows`; plans are cached per
input signature by :class:`dilated.longnet.pattern_cache.PatternCache`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .._transfer import made_for_a_cache


@dataclass(frozen=True)
class KernelCall:
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
    #: (index, w) of the schedule's branch the call reads, for calls of a whole schedule's plan
    #: (:func:`build_plan`): the combine then needs no kernel per length (:mod:`dilated.longnet.branch_combine`)
    branch: tuple | None = field(default=None, compare=False)

    @property
    def first_row(self) -> int:
        return self.offset if self.row_offset is None else self.row_offset

    @property
    def clipped(self) -> bool:
        """A schedule's segment cut short by the sequence's end: its shape belongs to this length."""
        return self.branch is not None and self.length < self.branch[1]


def segment_blocks(n: int, w: int):
    """``(start, count, length)``: the full segments of length w, then the clipped last one."""
    full = n // w
    blocks = [(0, full, w)] if full else []
    if n % w:
        blocks.append((full * w, 1, n % w))
    return blocks


QUERY_TILE = 128  # rows per query tile of the flash-type kernels (for the device-filling estimate)


def in_place_min_tiles(device) -> int:
    """Query tiles an in-place call needs to fill ``device``: one wave of its multiprocessors (one
    wave against two and half a wave: docs/performance-log.md)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).multi_processor_count


def build_plan(n: int, h: int, hkv: int, segment_lengths, dilation_rates, device, *, batch: int = 1,
               in_place_tiles: int | None = None) -> list[KernelCall]:
    """The calls of one forward. ``in_place_tiles``: the kernel reads strided rows; r > 1 branches
    are then read in place (no gather) where each call has at least this many query tiles (or
    where a diagonal gather is impossible anyway), as one call per head offset or, with one batch,
    one call per segment holding all r offsets (the diagonal over position and head mod r is a
    fixed stride, ``(H + 1) * D``), whichever makes fewer calls; None: gather them."""
    groups = h // hkv
    calls = []
    for branch, (w, r) in enumerate(zip(segment_lengths, dilation_rates)):
        tag = (branch, w)
        for start, count, length in segment_blocks(n, min(w, n)):
            if r == 1:
                calls.append(KernelCall(start, count, length, 1, "view", branch=tag))
                continue
            diag = length % r == 0 and h % r == 0 and groups == 1
            form = None
            if in_place_tiles is not None and groups == 1:
                form = _in_place_form(n, count, length, h, r, diag, batch, in_place_tiles)
            if form == "per_segment":
                calls += [KernelCall(start + s * length, 1, length, r, "diag", in_place=True, branch=tag)
                          for s in range(count)]
            elif form is None and diag:
                calls.append(KernelCall(start, count, length, r, "diag", branch=tag))
            else:  # one call per head offset, in place or each gathered
                for off in range(min(r, length, h)):
                    kvh = None
                    if groups > 1:
                        kvh = made_for_a_cache(  # kept by the plan: not in a graph's pool
                            lambda: torch.arange(off, h, r, device=device) // groups, device)
                    calls.append(KernelCall(start, count, length, r, "offset", off, kvh, in_place=form == "per_offset",
                                            branch=tag))
    return calls


def _in_place_form(n, count, length, h, r, diag, batch, min_tiles) -> str | None:
    """How a dilated block is read in place: "per_offset" (one call per head offset),
    "per_segment" (one call per segment, all offsets) or None (gathered). Each call needs
    ``min_tiles`` query tiles, unless it is the one call a diagonal gather would make anyway
    (one segment) or no diagonal gather exists; of two such forms, the one with fewer calls."""
    row_tiles = -(-length // (r * QUERY_TILE))
    options = []  # (calls, form, query tiles per call)
    # kernel shape [B * count, ...] must stay a view: one batch, one segment or all rows
    viewable = batch == 1 or count == 1 or count * length == n
    if viewable:
        options.append((r, "per_offset", batch * count * (h // r) * row_tiles))
    if diag and batch == 1:  # [count, r] does not fold into one batch stride: one call per segment
        options.append((count, "per_segment", h * row_tiles if count > 1 else min_tiles))
    filled = [o for o in options if o[2] >= min_tiles]
    if filled:
        return min(filled, key=lambda o: o[0])[1]  # ties: per offset
    return "per_offset" if viewable and not diag else None


def largest_call_inputs(q: torch.Tensor, k: torch.Tensor, segment_lengths, dilation_rates):
    """``(q, k)`` as views shaped like the largest kernel call of the plan (``[B * segments, rows,
    heads, head_dim]``), for choosing a kernel by the calls that will run, not by the whole
    sequence. Their rows are not the call's (only the shape, dtype, device and need of gradients
    are read); inputs that are not contiguous are returned as they are (a view would be a copy)."""
    b, n = q.shape[:2]
    count, rows = max(((count, -(-length // r)) for w, r in zip(segment_lengths, dilation_rates)
                       for _, count, length in segment_blocks(n, min(w, n))), key=lambda c: c[0] * c[1])
    if not (q.is_contiguous() and k.is_contiguous()):
        return q, k
    return tuple(x[:, :count * rows].reshape(b * count, rows, *x.shape[2:]) for x in (q, k))


def plan_for(q: torch.Tensor, k: torch.Tensor, segment_lengths, dilation_rates, in_place: bool = False):
    """:func:`build_plan` for these inputs (``in_place``: the kernel reads strided rows)."""
    return build_plan(q.shape[1], q.shape[2], k.shape[2], segment_lengths, dilation_rates, q.device,
                      batch=q.shape[0], in_place_tiles=in_place_min_tiles(q.device) if in_place else None)
