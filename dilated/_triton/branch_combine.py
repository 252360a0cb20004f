"""The kernel of :mod:`dilated.longnet.branch_combine`: the combine of a whole schedule's plan,
specialized on the schedule only, finding each program's rows in the plan's descriptor table.
Needs Triton."""
import triton
import triton.language as tl

from .online_merge import merge_step, store_merged


@triton.jit
def _runs(hh, t, w: tl.constexpr, r: tl.constexpr, PERIOD: tl.constexpr):
    """Whether a branch covers rows of head ``hh`` at positions ``t`` mod ``PERIOD``."""
    if w % r == 0 and PERIOD % r == 0:
        return t % r == hh % r
    return hh >= 0

@triton.jit
def _place(desc, base: tl.constexpr, H: tl.constexpr, r: tl.constexpr, last, hh, b, s, i,
           HAS_LSE: tl.constexpr):
    """The entry of a branch's tensors holding rows ``i`` of segment ``s`` (of the run of the
    clipped last segment where ``last``), head ``hh``, batch ``b``, and the rows' offsets in it
    and in its lse (the table of :mod:`dilated.longnet.branch_combine`; scalars or one per row)."""
    at = desc + base + ((last * H + hh) * r + tl.minimum(s, r - 1)) * 9  # 9: ENTRY
    row = b * tl.load(at) + s * tl.load(at + 1) + tl.load(at + 2) + i * tl.load(at + 3)
    lse_row = row
    if HAS_LSE:
        lse_row = b * tl.load(at + 5) + s * tl.load(at + 6) + tl.load(at + 7) + i * tl.load(at + 8)
    return tl.load(at + 4), row, lse_row

@triton.jit
def _branch_rows(p, pmask, hh, b, N, desc, base: tl.constexpr, w: tl.constexpr, r: tl.constexpr,
                 PERIOD: tl.constexpr, H: tl.constexpr, HAS_LSE: tl.constexpr):
    """Rows ``(p, hh)`` of batch ``b`` that a branch covers and where they are in its runs'
    outputs: (member, entry 0..2r-1, offset of the row in the entry's output, and in its lse)."""
    seg = p // w
    j = p - seg * w
    last = (seg >= N // w).to(tl.int32)  # in the run of the clipped last segment
    member = pmask
    if not (w % r == 0 and PERIOD % r == 0):
        member = member & (j % r == hh % r)
    e, row, lse_row = _place(desc, base, H, r, last, hh, b, seg * (1 - last), (j // r).to(tl.int64), HAS_LSE)
    return member, e, row, lse_row

@triton.jit
def _block_rows(p0, p, hh, b, N, desc, base: tl.constexpr, w: tl.constexpr, r: tl.constexpr,
                H: tl.constexpr, HAS_LSE: tl.constexpr):
    """:func:`_branch_rows` for a program whose positions ``p`` lie in one segment (the one of
    ``p0``) and are all members: its entry is found once (scalars)."""
    seg = p0 // w
    last = (seg >= N // w).to(tl.int32)  # the run of the clipped last segment
    return _place(desc, base, H, r, last, hh, b, seg * (1 - last), ((p - seg * w) // r).to(tl.int64), HAS_LSE)

@triton.jit
def _entry(ptrs, first: tl.constexpr, r: tl.constexpr, e):
    """``ptrs[first + e]`` per row."""
    ptr = ptrs[first]
    for k in tl.static_range(1, 2 * r):
        ptr = tl.where(e == k, ptrs[first + k], ptr)
    return ptr

@triton.jit(do_not_specialize=["N", "s_ob", "s_on", "s_oh", "s_lb", "s_ln", "s_lh", "alias"])
def branch_combine_kernel(out_ptr, out_lse_ptr, parts, lses, desc, N, D, s_ob, s_on, s_oh, s_lb, s_ln, s_lh,
                           alias, BRANCHES: tl.constexpr,
                           H: tl.constexpr, PERIOD: tl.constexpr, ALIGN: tl.constexpr, HAS_LSE: tl.constexpr,
                           STORE_LSE: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    # program: positions t, t + PERIOD, ... of one block, head hh, batch b (as the per-call
    # kernel); BRANCHES: (w, r, first table entry, first tensor, uniform) per branch; desc: the
    # plan's descriptor table (built in :mod:`dilated.longnet.branch_combine`); s_o*, s_l*: the
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
    lse_at = out_lse_ptr + b * s_lb + p.to(tl.int64) * s_ln + hh * s_lh
    if (alias < 0) | (others > 0):
        acc = tl.zeros([BLOCK_P, BLOCK_D], tl.float32)
        m_i = tl.full([BLOCK_P], float("-inf"), tl.float32)
        s_i = tl.zeros([BLOCK_P], tl.float32)
        for i in tl.static_range(len(BRANCHES)):
            if _runs(hh, t, BRANCHES[i][0], BRANCHES[i][1], PERIOD):
                if BRANCHES[i][4]:
                    e, row, lse_row = _block_rows(blk * BLOCK_P * PERIOD, p, hh, b, N, desc, BRANCHES[i][2],
                                                  BRANCHES[i][0], BRANCHES[i][1], H, HAS_LSE)
                    member = pmask
                else:
                    member, e, row, lse_row = _branch_rows(p, pmask, hh, b, N, desc, BRANCHES[i][2],
                                                           BRANCHES[i][0], BRANCHES[i][1], PERIOD, H, HAS_LSE)
                part = _entry(parts, BRANCHES[i][3], BRANCHES[i][1], e)
                o = tl.load((part + tl.multiple_of(row, ALIGN))[:, None] + d[None, :],
                            mask=member[:, None] & dmask[None, :], other=0.0).to(tl.float32)
                if HAS_LSE:
                    lse = tl.load(_entry(lses, BRANCHES[i][3], BRANCHES[i][1], e) + lse_row, mask=member,
                                  other=float("-inf"))
                    m_i, s_i, acc = merge_step(m_i, s_i, acc, o, lse)
                else:
                    acc += o
        out_at = tl.multiple_of(b * s_ob + p.to(tl.int64) * s_on + hh * s_oh, ALIGN)
        store_merged(out_ptr, out_at, lse_at, acc, m_i, s_i, pmask, d, dmask, HAS_LSE, STORE_LSE)
    else:
        if STORE_LSE:  # only the aliased branch covers these rows: they hold their result, L is its lse
            for i in tl.static_range(len(BRANCHES)):
                if alias == i:
                    member, e, row, lse_row = _branch_rows(p, pmask, hh, b, N, desc, BRANCHES[i][2],
                                                           BRANCHES[i][0], BRANCHES[i][1], PERIOD, H, True)
                    lse = tl.load(_entry(lses, BRANCHES[i][3], BRANCHES[i][1], e) + lse_row, mask=member,
                                  other=float("-inf"))
                    tl.store(lse_at, lse, mask=pmask)
