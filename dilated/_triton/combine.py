"""The per-call kernels of :mod:`dilated.longnet.rows`: the gather of a call's rows into a dense
buffer, and the combine of a plan's outputs by their lse (the plan's structure compile-time, its
places, tensors and strides arguments). Needs Triton."""
import triton
import triton.language as tl

from .online_merge import merge_step, store_merged


@triton.jit
def _call_rows(p, pmask, hh, b, start, span, segment: tl.constexpr, r: tl.constexpr, diag: tl.constexpr,
               off: tl.constexpr, first: tl.constexpr, aligned: tl.constexpr, PERIOD: tl.constexpr):
    """Rows ``(p, hh)`` of batch ``b`` that a call (its constants from :mod:`dilated.longnet.rows`,
    place ``start, span``) covers, and their place in its output (batch index, row, head)."""
    q = p - start
    member = pmask & (q >= 0) & (q < span)
    q = tl.where(member, q, 0)
    if segment > 0:
        seg = q // segment
        i = q - seg * segment
        count = span // segment
    else:  # one segment
        seg = q * 0
        i = q
        count = 1
    mh = hh % r
    if not aligned or PERIOD % r != 0:  # else the program's position period decided (_runs)
        if off >= 0:  # one head offset; its rows start at ``first``
            member = member & (i % r == first)
        else:  # view (r = 1) or diagonal: position and head agree mod r
            member = member & (i % r == mh)
    bi = b * count + seg
    if diag:
        bi = bi * r + mh
    return member, bi.to(tl.int64), (i // r).to(tl.int64), (hh // r).to(tl.int64)

@triton.jit
def _lse_rows(lse_ptr, lse_strides, k: tl.constexpr, member, bi, ni, hi):
    """A call's lse at its rows (``-inf`` off them); its strides are entries ``3k..3k+2``."""
    return tl.load(lse_ptr + bi * lse_strides[3 * k] + hi * lse_strides[3 * k + 1] + ni * lse_strides[3 * k + 2],
                   mask=member, other=float("-inf"))

@triton.jit
def _runs(hh, t, r: tl.constexpr, off: tl.constexpr, first: tl.constexpr, aligned: tl.constexpr,
          PERIOD: tl.constexpr):
    """Whether a call can hold rows of head ``hh`` at positions ``t`` mod ``PERIOD``."""
    if aligned and PERIOD % r == 0:
        if off >= 0:
            return (hh % r == off) & (t % r == first)
        return t % r == hh % r
    if off >= 0:
        return hh % r == off
    return hh >= 0

@triton.jit(do_not_specialize=["lse_strides", "places", "N", "s_lb", "s_ln", "s_lh"])
def combine_kernel(out_ptr, out_lse_ptr, parts, strides, lses, lse_strides, places, N, D,
                    s_ob, s_on, s_oh, s_lb, s_ln, s_lh,
                    CALLS: tl.constexpr, N_CALLS: tl.constexpr, H: tl.constexpr, PERIOD: tl.constexpr,
                    HAS_LSE: tl.constexpr, STORE_LSE: tl.constexpr, ALIAS: tl.constexpr,
                    BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    # program (block of positions t, t + PERIOD, ...; head hh; batch b). Over such positions
    # a head is in an aligned call for all of them or none: calls are skipped whole, and the
    # calls a program runs are the ones with work for it (``_mix``). Without STORE_LSE, L is
    # not written (a forward nothing differentiates).
    # (t, hh) vary fastest: programs running together cover one range of positions, all heads
    th = tl.program_id(0) % (PERIOD * H)
    blk = tl.program_id(0) // (PERIOD * H)
    hh = th % H
    t = th // H
    b = tl.program_id(1)
    p = (blk * BLOCK_P + tl.arange(0, BLOCK_P)) * PERIOD + t
    pmask = p < N
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    others = 1
    if ALIAS >= 0:  # out is call ALIAS's part: nothing to mix where no other call runs
        others = 0
        for c in tl.static_range(N_CALLS):
            if c != ALIAS:
                others += _runs(hh, t, CALLS[c][1], CALLS[c][3], CALLS[c][4], CALLS[c][5], PERIOD).to(tl.int32)
    lse_at = out_lse_ptr + b.to(tl.int64) * s_lb + p.to(tl.int64) * s_ln + hh.to(tl.int64) * s_lh
    if others > 0:
        _mix(out_ptr, lse_at, parts, strides, lses, lse_strides, places, p, pmask, hh, t, b, d, dmask, s_ob, s_on,
             s_oh,
             CALLS, N_CALLS, PERIOD, HAS_LSE, STORE_LSE, BLOCK_P, BLOCK_D)
    else:
        if STORE_LSE:  # only the aliased call covers these rows: they hold their result, L is its lse
            member, bi, ni, hi = _call_rows(p, pmask, hh, b, places[2 * ALIAS], places[2 * ALIAS + 1],
                                            CALLS[ALIAS][0], CALLS[ALIAS][1], CALLS[ALIAS][2], CALLS[ALIAS][3],
                                            CALLS[ALIAS][4], CALLS[ALIAS][5], PERIOD)
            k: tl.constexpr = CALLS[ALIAS][6]
            tl.store(lse_at, _lse_rows(lses[k], lse_strides, k, member, bi, ni, hi), mask=pmask)

@triton.jit
def _mix(out_ptr, lse_at, parts, strides, lses, lse_strides, places, p, pmask, hh, t, b, d, dmask, s_ob, s_on, s_oh,
         CALLS: tl.constexpr, N_CALLS: tl.constexpr, PERIOD: tl.constexpr, HAS_LSE: tl.constexpr,
         STORE_LSE: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    """out = sum over the calls of exp(lse_c - L) o_c, L = logsumexp_c lse_c (or the sum of the
    o_c), and L at ``lse_at`` (``STORE_LSE``), in one pass over the calls (the streaming merge of
    :mod:`dilated.merge`): each call's rows and lse are loaded together, once."""
    acc = tl.zeros([BLOCK_P, BLOCK_D], tl.float32)
    m_i = tl.full([BLOCK_P], float("-inf"), tl.float32)
    s_i = tl.zeros([BLOCK_P], tl.float32)
    for c in tl.static_range(N_CALLS):
        if _runs(hh, t, CALLS[c][1], CALLS[c][3], CALLS[c][4], CALLS[c][5], PERIOD):
            member, bi, ni, hi = _call_rows(p, pmask, hh, b, places[2 * c], places[2 * c + 1], CALLS[c][0],
                                            CALLS[c][1], CALLS[c][2], CALLS[c][3], CALLS[c][4], CALLS[c][5], PERIOD)
            k: tl.constexpr = CALLS[c][6]
            size: tl.constexpr = CALLS[c][7]
            part = parts[k]
            lse_ptr = lses[k]
            for j in tl.static_range(1, size):  # a group: the part of this head's offset
                part = tl.where(hh % CALLS[c][1] == j, parts[k + j], part)
                lse_ptr = tl.where(hh % CALLS[c][1] == j, lses[k + j], lse_ptr)
            o = tl.load(part + (bi * strides[3 * k] + ni * strides[3 * k + 1] + hi * strides[3 * k + 2])[:, None]
                        + d[None, :], mask=member[:, None] & dmask[None, :], other=0.0).to(tl.float32)
            if HAS_LSE:
                m_i, s_i, acc = merge_step(m_i, s_i, acc, o, _lse_rows(lse_ptr, lse_strides, k, member, bi, ni, hi))
            else:
                acc += o
    store_merged(out_ptr, b.to(tl.int64) * s_ob + p.to(tl.int64) * s_on + hh.to(tl.int64) * s_oh, lse_at, acc,
                 m_i, s_i, pmask, d, dmask, HAS_LSE, STORE_LSE)

@triton.jit(do_not_specialize=["NC", "start", "count", "length", "r", "off", "first"])
def gather_kernel(sources, strides, dests, NC, D, start, count, length, r, off, first, DIAG: tl.constexpr,
                   N_T: tl.constexpr, HC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # program (row block, kernel batch index bi): rows (ni, hi) of bi, from every source. Only
    # the form (diagonal or one head offset) is compile-time: any call of it, any length.
    bi = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < NC * HC
    ni = rows // HC
    hi = rows % HC
    if DIAG:
        m = bi % r
        bs = bi // r
        p = start + (bs % count) * length + ni * r + m
        hh = hi * r + m
    else:
        bs = bi
        p = start + (bs % count) * length + ni * r + first
        hh = hi * r + off
    b = bs // count
    d = tl.arange(0, BLOCK_D)
    mask = rmask[:, None] & (d < D)[None, :]
    dst = (bi.to(tl.int64) * NC * HC + rows.to(tl.int64)) * D
    for t in tl.static_range(N_T):
        src = (b.to(tl.int64) * strides[3 * t] + p.to(tl.int64) * strides[3 * t + 1]
               + hh.to(tl.int64) * strides[3 * t + 2])
        x = tl.load(sources[t] + src[:, None] + d[None, :], mask=mask)
        tl.store(dests[t] + dst[:, None] + d[None, :], x, mask=mask)
