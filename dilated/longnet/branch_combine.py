"""The combine of a whole schedule's plan, compiled once per schedule: no new kernel at a new length.

A plan built from a schedule (:func:`dilated.longnet.plan.build_plan`) covers, for each branch ``(w, r)``,
the rows ``(p, h)`` with ``(p mod w) mod r == h mod r``: which rows a branch covers depends on
``w`` and ``r`` only, never on the sequence length N. What N changes is how the branch's rows
were cut into kernel calls: the full segments ``[0, (N // w) w)`` as one *run* and the clipped
last segment as another, each run read in one of four forms:

* ``VIEW`` (r = 1): one call, kernel batch ``b * count + segment``;
* ``DIAG``: one call with all r offsets, batch ``(b * count + segment) * r + h mod r``;
* ``PER_SEGMENT``: one call per segment (in place, one batch), batch ``h mod r``;
* ``PER_OFFSET``: one call per head offset ``h mod r``, batch ``b * count + segment``.

The kernel here is specialized on the schedule only (each branch's ``w`` and ``r``: divisions by
constants, and which branches a program runs); the runs' output and lse tensors (r entries per
run, a fixed number per schedule) are runtime arguments, and where a program finds its rows in
them is a table in device memory (:func:`_table`: forms, counts and strides resolved on the
host, one entry per branch, run, head and segment index below r). So one kernel serves every
length, and every plan of the schedule (gathered or in place, any form). It computes what
:func:`dilated.longnet.rows.combine` defines; plans it cannot describe (calls not from one schedule,
pieces) take the per-call kernel of :mod:`dilated.longnet.rows`.
"""
from __future__ import annotations

import math

import torch

from .._transfer import host_values_on, made_for_a_cache
from .._triton.launch import LAUNCH, blocks

try:  # Triton ships with CUDA builds of PyTorch; it is optional here.
    import triton
    from .._triton.branch_combine import branch_combine_kernel
except ImportError:  # pragma: no cover - depends on the install
    triton = None

VIEW, DIAG, PER_SEGMENT, PER_OFFSET = range(4)
MAX_PERIOD = 64  # largest position period of the combine programs (lcm of the dilations)


def _run_form(plan, idx: list[int], start: int, count: int, length: int, h: int):
    """``(form, entries)`` of the calls ``idx`` of ``plan`` reading one run (``count`` segments
    of ``length`` rows from ``start``), entries the calls' indices in the order the kernel reads
    them (by segment or head offset); None if they are not one of the four forms."""
    calls = [plan[i] for i in idx]
    block = (start, count, length)
    first, r = calls[0], calls[0].r
    if len(calls) == 1 and (first.start, first.count, first.length) == block:
        if first.mode == "view" and r == 1:
            return VIEW, idx
        if first.mode == "diag":
            return DIAG, idx
    if count <= r and all(c.mode == "diag" and c.count == 1 and c.length == length for c in calls) \
            and [c.start for c in calls] == [start + s * length for s in range(count)]:
        return PER_SEGMENT, idx
    if all(c.mode == "offset" and c.row_offset is None and (c.start, c.count, c.length) == block for c in calls) \
            and sorted(c.offset for c in calls) == list(range(min(r, length, h))):
        return PER_OFFSET, [i for _, i in sorted(zip((c.offset for c in calls), idx))]
    return None


def branch_layout(plan, n: int, h: int):
    """The plan as runs of a schedule's branches (:attr:`KernelCall.branch`), or None where it is not one.

    Returns ``(branches, runs)``: ``branches`` the constants ``(w, r)`` per branch in the
    schedule's order; ``runs`` per branch two ``(form, count, entries)`` (the full segments,
    then the clipped last one; form -1 where a run has no rows)."""
    if not plan or any(c.branch is None for c in plan):
        return None
    members: dict = {}
    for i, c in enumerate(plan):
        members.setdefault(c.branch, []).append(i)
    branches, runs = [], []
    for (_, w), idx in sorted(members.items()):
        r = plan[idx[0]].r
        if any(plan[i].r != r for i in idx):
            return None
        full = n // w
        blocks = ((0, full, w), (full * w, 1, n - full * w))
        split = ([i for i in idx if plan[i].start < full * w], [i for i in idx if plan[i].start >= full * w])
        described = []
        for (start, count, length), part in zip(blocks, split):
            if count == 0 or length == 0:
                if part:
                    return None
                described.append((-1, 0, ()))
                continue
            form = _run_form(plan, part, start, count, length, h) if part else None
            if form is None:
                return None
            described.append((form[0], 1 if form[0] == PER_SEGMENT else count, tuple(form[1])))
        branches.append((w, r))
        runs.append(tuple(described))
    return tuple(branches), tuple(runs)


_LAYOUTS: dict = {}  # (ids of a plan's calls, n, h) -> (those calls, their branch_layout)


def layout_of(plan, n: int, h: int):
    """:func:`branch_layout`, worked out once per plan (its calls, the same objects every step of a
    cached plan), length and heads."""
    key = (tuple(map(id, plan)), n, h)
    found = _LAYOUTS.get(key)
    if found is not None and all(a is b for a, b in zip(found[0], plan)):
        return found[1]
    layout = branch_layout(plan, n, h)
    if len(_LAYOUTS) >= _MAX_TABLES:
        _LAYOUTS.clear()
    _LAYOUTS[key] = (tuple(plan), layout)  # holds the calls: their ids are not reused while here
    return layout


def period_of(branches) -> int:
    """Positions ``t, t + R, ...`` share every aligned branch's membership; R = lcm of the
    dilations when small, else 1."""
    period = math.lcm(*(r for _, r in branches))
    return period if period <= MAX_PERIOD else 1


ENTRY = 9  # integers per entry of a descriptor table (see :func:`_table`)
_TABLES: dict = {}  # (device, layout, strides) -> a launch's recipe (:func:`_recipe`), its table on the device
_MAX_TABLES = 256


def _table(branches, runs, parts, lses, h: int) -> tuple:
    """Where each program finds its rows, as integers: per branch ``(w, r)``, run ``u`` (full
    segments, clipped last), head ``hh`` and segment ``sc`` (the segment index up to r - 1: one
    call per segment has at most r) an entry ``BG, G, K, Sn, e, lBG, lG, lK, lSn``: rows
    ``(position, hh)`` of batch ``b`` in segment ``s`` lie in entry ``e`` of the branch's
    tensors at row ``b BG + s G + K + i Sn`` (``i`` the row within the segment's dilated rows),
    their lse at ``b lBG + s lG + lK + i lSn``.

    Forms and head offsets are resolved here, so a program loads one entry per branch and does
    no arithmetic on the plan's layout. Returns ``(values, bases)``: where each branch's entries
    start."""
    values, bases = [], []
    for (_, r), described in zip(branches, runs):
        bases.append(len(values))
        for u, (form, count, idx) in enumerate(described):
            folded = form in (DIAG, PER_SEGMENT)
            f = r if folded else 1  # batches per segment of the calls' kernel batch
            for hh in range(h):
                m, hi = hh % r, hh // r
                for sc in range(r):
                    e = m if form == PER_OFFSET else sc if form == PER_SEGMENT else 0
                    if form < 0 or e >= len(idx):  # no rows of this run, head and segment
                        values += (0,) * ENTRY
                        continue
                    sb, sn, sh = parts[idx[e]].stride()[:3]
                    lb, lh, ln = lses[idx[e]].stride() if lses is not None else (0, 0, 0)
                    by_s = int(form != PER_SEGMENT)  # one call per segment: s picks the entry
                    mf = m if folded else 0
                    values += (count * f * sb, by_s * f * sb, mf * sb + hi * sh, sn, e + u * r,
                               count * f * lb, by_s * f * lb, mf * lb + hi * lh, ln)
    return values, bases


def _recipe(layout, parts, lses, out: torch.Tensor) -> tuple:
    """What a launch of the combine takes besides the tensors, worked out once per layout and
    strides (a new length builds it once; later steps find it here): the descriptor table
    (:func:`_table`) as an int64 tensor on the device; which part each tensor argument is (r per
    run, unused entries repeat the first); the branches' constants; the period, block sizes and
    alignment."""
    branches, runs = layout
    _, _, h, d = out.shape
    key = (out.device, h, d, out.stride(), branches, runs, tuple(p.stride()[:3] for p in parts),
           tuple(l.stride() for l in lses) if lses is not None else None, LAUNCH["elements"])
    found = _TABLES.get(key)
    if found is not None:
        return found
    values, bases = _table(branches, runs, parts, lses, h)
    index, constants = [], []
    for (w, r), described, base in zip(branches, runs, bases):
        constants.append((w, r, base, len(index)))  # where its table entries and tensors start
        for _, _, idx in described:
            index += [idx[e] if e < len(idx) else 0 for e in range(r)]
    period = period_of(branches)
    block_p, block_d = blocks(d)
    # a branch whose segments are whole multiples of a program's positions (and aligned: r | w,
    # r | period) finds where a program's rows lie once per program, not per row
    span = block_p * period
    constants = tuple(c + (int(c[0] % span == 0 and c[0] % c[1] == 0 and period % c[1] == 0),) for c in constants)
    # row offsets are multiples of this (in elements): loads and stores of whole rows are vectorized
    align = math.gcd(d, 16)
    strides = list(out.stride()[:3]) + [s for k in index for s in parts[k].stride()[:3]]
    align = align if all(s % align == 0 for s in strides) else 1
    if len(_TABLES) >= _MAX_TABLES:
        _TABLES.clear()
    table, host = made_for_a_cache(lambda: host_values_on(values, torch.int64, out.device), out.device)
    found = _TABLES[key] = (table, tuple(index), constants, period, block_p, block_d, align, host)
    return found


_CAPTURED: dict = {}  # id -> a recipe whose table a CUDA graph reads at every replay: never freed


def _keep_if_captured(recipe) -> None:
    """A recipe whose table a CUDA graph being captured reads stays for the life of the process:
    dropped from the cache (which holds a bounded number) and freed, its memory could be handed
    out again while the graph still reads it at every replay."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        _CAPTURED[id(recipe)] = recipe  # once per recipe, however many captures use it


def combine_branches(layout, parts, lses, out: torch.Tensor, out_lse: torch.Tensor | None) -> None:
    """:func:`dilated.longnet.rows.combine` of a plan described by ``layout`` (:func:`branch_layout`).

    The kernel's arguments are the tensors (r entries per run, unused ones repeat the first), the
    length, and the plan's descriptor table (:func:`_table`), an int64 tensor: Triton specializes
    integers (value 1, multiples of 16, 32 or 64 bits) and does so inside tuples, so the integers
    that follow the length travel in memory."""
    branches, runs = layout
    b, n, h, d = out.shape
    has_lse, store_lse = lses is not None, lses is not None and out_lse is not None
    recipe = _recipe(layout, parts, lses if has_lse else None, out)
    _keep_if_captured(recipe)
    table, index, constants, period, block_p, block_d, align, _ = recipe
    lse_out, lse_out_strides = (out_lse, out_lse.stride()) if store_lse else (out, (0, 0, 0))  # not written
    ptrs = tuple(parts[k] for k in index)
    lptrs = tuple(lses[k] for k in index) if has_lse else (parts[0],) * len(index)
    branch_combine_kernel[(triton.cdiv(triton.cdiv(n, period), block_p) * period * h, b)](
        out, lse_out, ptrs, lptrs, table, n, d, *out.stride()[:3], *lse_out_strides,
        _alias(branches, runs, parts, out), BRANCHES=constants, H=h, PERIOD=period, ALIGN=align,
        HAS_LSE=has_lse, STORE_LSE=store_lse, BLOCK_P=block_p, BLOCK_D=block_d, num_warps=LAUNCH["num_warps"])


def _alias(branches, runs, parts, out) -> int:
    """The branch whose one part *is* ``out`` (r = 1, one view run over every row, overwritten in
    place), or -1: rows no other branch covers then already hold their result."""
    for i, ((w, r), described) in enumerate(zip(branches, runs)):
        (form, _, idx), (last, _, _) = described
        if form == VIEW and last == -1:
            part = parts[idx[0]]
            if part.data_ptr() == out.data_ptr() and part.numel() == out.numel() and part.is_contiguous() \
                    and out.is_contiguous():
                return i
    return -1
