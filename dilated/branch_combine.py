"""The combine of a whole schedule's plan, compiled once per schedule: no new kernel at a new length.

A plan built from a schedule (:func:`dilated.plan.build_plan`) covers, for each branch ``(w, r)``,
the rows ``(p, h)`` with ``(p mod w) mod r == h mod r``: which rows a branch covers depends on
``w`` and ``r`` only, never on the sequence length N. What N changes is how the branch's rows
were cut into kernel calls: the full segments ``[0, (N // w) w)`` as one *run* and the clipped
last segment as another, each run read in one of four forms:

* ``VIEW`` (r = 1): one call, kernel batch ``b * count + segment``;
* ``DIAG``: one call with all r offsets, batch ``(b * count + segment) * r + h mod r``;
* ``PER_SEGMENT``: one call per segment (in place, one batch), batch ``h mod r``;
* ``PER_OFFSET``: one call per head offset ``h mod r``, batch ``b * count + segment``.

The kernel here is specialized on the schedule only (each branch's ``w`` and ``r``: divisions by
constants, and which branches a program runs); each run's form, count and up to r entries
(output and lse tensors with their strides) are runtime arguments, a fixed number per schedule.
So one kernel serves every length, and every plan of the schedule (gathered or in place, any
form). It computes what :func:`dilated.rows.combine` defines; plans it cannot describe (calls
not from one schedule, pieces) take the per-call kernel of :mod:`dilated.rows`.
"""
from __future__ import annotations

import math

import torch


try:  # Triton ships with CUDA builds of PyTorch; it is optional here.
    import triton
    import triton.language as tl
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
                described.append((-1, 0, []))
                continue
            form = _run_form(plan, part, start, count, length, h) if part else None
            if form is None:
                return None
            described.append((form[0], 1 if form[0] == PER_SEGMENT else count, form[1]))
        branches.append((w, r))
        runs.append(tuple(described))
    return tuple(branches), runs


def period_of(branches) -> int:
    """Positions ``t, t + R, ...`` share every aligned branch's membership; R = lcm of the
    dilations when small, else 1."""
    period = math.lcm(*(r for _, r in branches))
    return period if period <= MAX_PERIOD else 1


_DESCRIPTORS: dict = {}  # (device, integers) -> the same integers on the device
_MAX_DESCRIPTORS = 256


def _descriptor(values: tuple, device) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device``, made once per distinct values (a plan's layout:
    a new length copies it once; later steps find it here)."""
    key = (device, values)
    t = _DESCRIPTORS.get(key)
    if t is None:
        if len(_DESCRIPTORS) >= _MAX_DESCRIPTORS:
            _DESCRIPTORS.clear()
        t = _DESCRIPTORS[key] = torch.tensor(values, dtype=torch.int64, device=device)
    return t


def combine_branches(layout, parts, lses, out: torch.Tensor, out_lse: torch.Tensor | None) -> None:
    """:func:`dilated.rows.combine` of a plan described by ``layout`` (:func:`branch_layout`).

    The kernel's arguments are the tensors (r entries per run, unused ones repeat the first), the
    length, and a small int64 tensor of the runs' forms, counts and strides and of the result's
    strides: Triton specializes integers (value 1, multiples of 16, 32 or 64 bits) and does so
    inside tuples, so the integers that follow the length travel in memory."""
    branches, runs = layout
    b, n, h, d = out.shape
    has_lse, store_lse = lses is not None, lses is not None and out_lse is not None
    lse_out, lse_out_strides = (out_lse, out_lse.stride()) if store_lse else (out, (0, 0, 0))  # not written
    ptrs, lptrs, constants = [], [], []
    values = [*out.stride()[:3], *lse_out_strides]
    for (w, r), described in zip(branches, runs):
        constants.append((w, r, len(values), len(ptrs)))  # where its integers and entries start
        for form, count, idx in described:
            values += (form, count)
            for e in range(r):
                k = idx[e] if e < len(idx) else None  # None: not read (a tensor of the same dtype)
                ptrs.append(parts[k or 0])
                lptrs.append(lses[k or 0] if has_lse else parts[0])
                values += (0,) * 6 if k is None else parts[k].stride()[:3] + (lses[k].stride() if has_lse else (0,) * 3)
    from .rows import _blocks, _LAUNCH

    period = period_of(branches)
    block_p, block_d = _blocks(d)
    # a branch whose segments are whole multiples of a program's positions (and aligned: r | w,
    # r | period) finds where a program's rows lie once per program, not per row
    span = block_p * period
    constants = [c + (int(c[0] % span == 0 and c[0] % c[1] == 0 and period % c[1] == 0),) for c in constants]
    # row offsets are multiples of this (in elements): loads and stores of whole rows are vectorized
    align = math.gcd(d, 16)
    strides = values[:3] + [s for p in ptrs for s in p.stride()[:3]]
    _branch_combine_kernel[(triton.cdiv(triton.cdiv(n, period), block_p) * period * h, b)](
        out, lse_out, tuple(ptrs), tuple(lptrs), _descriptor(tuple(values), out.device), n, d,
        _alias(branches, runs, parts, out), BRANCHES=tuple(constants), H=h, PERIOD=period,
        ALIGN=align if all(s % align == 0 for s in strides) else 1, HAS_LSE=has_lse, STORE_LSE=store_lse,
        BLOCK_P=block_p, BLOCK_D=block_d, num_warps=_LAUNCH["num_warps"])


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


if triton is not None:
    from .merge import merge_finish, merge_step

    @triton.jit
    def _runs(hh, t, w: tl.constexpr, r: tl.constexpr, PERIOD: tl.constexpr):
        """Whether a branch covers rows of head ``hh`` at positions ``t`` mod ``PERIOD``."""
        if w % r == 0 and PERIOD % r == 0:
            return t % r == hh % r
        return hh >= 0

    @triton.jit
    def _branch_rows(p, pmask, hh, b, N, desc, base: tl.constexpr, w: tl.constexpr, r: tl.constexpr,
                     PERIOD: tl.constexpr):
        """Rows ``(p, hh)`` of batch ``b`` that a branch covers and where they are in its runs'
        outputs: (member, entry 0..2r-1, offset of the row in the entry's output, and in its lse).
        The branch's integers start at ``desc + base``: per run (form, count) and r entries of
        six strides (the output's, then the lse's)."""
        seg = p // w
        j = p - seg * w
        last = seg >= N // w  # in the run of the clipped last segment
        m = hh % r
        member = pmask
        if not (w % r == 0 and PERIOD % r == 0):
            member = member & (j % r == m)
        second: tl.constexpr = base + 2 + 6 * r
        form = tl.where(last, tl.load(desc + second), tl.load(desc + base))
        count = tl.where(last, tl.load(desc + second + 1), tl.load(desc + base + 1))
        s = tl.where(last, 0, seg)
        # forms: 1 DIAG, 2 PER_SEGMENT (the r offsets are consecutive kernel batches), 3 PER_OFFSET
        folded = (form == 1) | (form == 2)
        bi = (b * count + tl.where(form == 2, 0, s)) * tl.where(folded, r, 1) + tl.where(folded, m, 0)
        e = tl.where(form == 3, m, tl.where(form == 2, s, 0)) + tl.where(last, r, 0)
        at = desc + base + 2 + e * 6 + tl.where(last, 2, 0)  # the entry's strides
        ni = (j // r).to(tl.int64)
        hi = hh // r
        row = bi * tl.load(at) + ni * tl.load(at + 1) + hi * tl.load(at + 2)
        lse_row = bi * tl.load(at + 3) + hi * tl.load(at + 4) + ni * tl.load(at + 5)
        return member, e, row, lse_row

    @triton.jit
    def _strides(at, form, m_at, s_at):
        """Stride ``at`` of the entry a program reads: entry 0 (one call), the one of its head
        offset (``m_at``) or of its segment (``s_at``), by form; all loaded at once."""
        return tl.where(form == 3, tl.load(m_at + at), tl.where(form == 2, tl.load(s_at + at), tl.load(at)))

    @triton.jit
    def _block_rows(p0, p, hh, b, N, desc, base: tl.constexpr, w: tl.constexpr, r: tl.constexpr):
        """:func:`_branch_rows` for a program whose positions ``p`` lie in one segment (the one of
        ``p0``) and are all members: the run, entry and strides are found once (scalars), every
        integer loaded at once (no load waits for another)."""
        seg = p0 // w
        last = (seg >= N // w).to(tl.int32)  # the run of the clipped last segment
        head = desc + base + last * (2 + 6 * r)
        s = seg * (1 - last)
        m = hh % r
        form = tl.load(head)
        count = tl.load(head + 1)
        first = head + 2
        m_at = m * 6  # the entry of head offset m, or of segment s (a run has at most r)
        s_at = tl.minimum(s, r - 1) * 6
        folded = (form == 1) | (form == 2)
        bi = (b * count + tl.where(form == 2, 0, s)) * tl.where(folded, r, 1) + tl.where(folded, m, 0)
        e = tl.where(form == 3, m, tl.where(form == 2, s, 0))
        ni = ((p - seg * w) // r).to(tl.int64)
        hi = hh // r
        row = (bi * _strides(first, form, m_at, s_at) + hi * _strides(first + 2, form, m_at, s_at)
               + ni * _strides(first + 1, form, m_at, s_at))
        lse_row = (bi * _strides(first + 3, form, m_at, s_at) + hi * _strides(first + 4, form, m_at, s_at)
                   + ni * _strides(first + 5, form, m_at, s_at))
        return e + last * r, row, lse_row

    @triton.jit
    def _entry(ptrs, first: tl.constexpr, r: tl.constexpr, e):
        """``ptrs[first + e]`` per row."""
        ptr = ptrs[first]
        for k in tl.static_range(1, 2 * r):
            ptr = tl.where(e == k, ptrs[first + k], ptr)
        return ptr

    @triton.jit(do_not_specialize=["N", "alias"])
    def _branch_combine_kernel(out_ptr, out_lse_ptr, parts, lses, desc, N, D, alias, BRANCHES: tl.constexpr,
                               H: tl.constexpr, PERIOD: tl.constexpr, ALIGN: tl.constexpr, HAS_LSE: tl.constexpr,
                               STORE_LSE: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
        # program: positions t, t + PERIOD, ... of one block, head hh, batch b (as the per-call
        # kernel); BRANCHES: (w, r, first integer, first entry, uniform) per branch; desc[0:6]: the
        # strides of out and of out_lse
        th = tl.program_id(0) % (PERIOD * H)
        blk = tl.program_id(0) // (PERIOD * H)
        hh = th % H
        t = th // H
        b = tl.program_id(1).to(tl.int64)
        p = (blk * BLOCK_P + tl.arange(0, BLOCK_P)) * PERIOD + t
        pmask = p < N
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        others = 0
        for i in tl.static_range(len(BRANCHES)):
            others += (_runs(hh, t, BRANCHES[i][0], BRANCHES[i][1], PERIOD) & (alias != i)).to(tl.int32)
        lse_at = out_lse_ptr + b * tl.load(desc + 3) + p.to(tl.int64) * tl.load(desc + 4) + hh * tl.load(desc + 5)
        if (alias < 0) | (others > 0):
            acc = tl.zeros([BLOCK_P, BLOCK_D], tl.float32)
            m_i = tl.full([BLOCK_P], float("-inf"), tl.float32)
            s_i = tl.zeros([BLOCK_P], tl.float32)
            for i in tl.static_range(len(BRANCHES)):
                if _runs(hh, t, BRANCHES[i][0], BRANCHES[i][1], PERIOD):
                    if BRANCHES[i][4]:
                        e, row, lse_row = _block_rows(blk * BLOCK_P * PERIOD, p, hh, b, N, desc, BRANCHES[i][2],
                                                      BRANCHES[i][0], BRANCHES[i][1])
                        member = pmask
                    else:
                        member, e, row, lse_row = _branch_rows(p, pmask, hh, b, N, desc, BRANCHES[i][2],
                                                               BRANCHES[i][0], BRANCHES[i][1], PERIOD)
                    part = _entry(parts, BRANCHES[i][3], BRANCHES[i][1], e)
                    o = tl.load((part + tl.multiple_of(row, ALIGN))[:, None] + d[None, :],
                                mask=member[:, None] & dmask[None, :], other=0.0).to(tl.float32)
                    if HAS_LSE:
                        lse = tl.load(_entry(lses, BRANCHES[i][3], BRANCHES[i][1], e) + lse_row, mask=member,
                                      other=float("-inf"))
                        m_i, s_i, acc = merge_step(m_i, s_i, acc, o, lse)
                    else:
                        acc += o
            if HAS_LSE:
                acc, lse = merge_finish(m_i, s_i, acc)
                if STORE_LSE:
                    tl.store(lse_at, lse, mask=pmask)
            out_at = tl.multiple_of(b * tl.load(desc) + p.to(tl.int64) * tl.load(desc + 1) + hh * tl.load(desc + 2), ALIGN)
            tl.store(out_ptr + out_at[:, None] + d[None, :], acc.to(out_ptr.dtype.element_ty),
                     mask=pmask[:, None] & dmask[None, :])
        else:
            if STORE_LSE:  # only the aliased branch covers these rows: they hold their result, L is its lse
                for i in tl.static_range(len(BRANCHES)):
                    if alias == i:
                        member, e, row, lse_row = _branch_rows(p, pmask, hh, b, N, desc, BRANCHES[i][2],
                                                               BRANCHES[i][0], BRANCHES[i][1], PERIOD)
                        lse = tl.load(_entry(lses, BRANCHES[i][3], BRANCHES[i][1], e) + lse_row, mask=member,
                                      other=float("-inf"))
                        tl.store(lse_at, lse, mask=pmask)
