"""Kernels on the rows ``rows[t]`` (dim 1) of ``[B, N, H, D]`` tensors, reading a part ``[B, T, H, D]``
computed on those rows gathered (:mod:`dilated.indexed_rows` launches them): merge the part into
them by log-sum-exp, place it there, or add it (in float32, rounded once; atomically where rows
repeat). One
program takes ``BLOCK`` of the ``B * T * H`` (batch, row, head) triples, head_dim on the lanes.
Needs Triton."""
import triton
import triton.language as tl

from .online_merge import merge_step, store_merged


@triton.jit
def _triples(T, H, R, rows_ptr, BLOCK: tl.constexpr):
    """This program's (batch, part row, head) triples, the row each lands on and which are real."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    pmask = i < R
    h = i % H
    t = (i // H) % T
    b = (i // (H * T)).to(tl.int64)
    r = tl.load(rows_ptr + t, mask=pmask, other=0).to(tl.int64)
    return b, t.to(tl.int64), h.to(tl.int64), r, pmask


@triton.jit
def merge_rows_kernel(out_ptr, lse_ptr, part_ptr, part_lse_ptr, rows_ptr, R, T, H, D,
                      s_ob, s_on, s_oh, s_lb, s_lh, s_ln, s_pb, s_pt, s_ph, s_qb, s_qh, s_qt,
                      BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """``out[b, rows[t], h]`` and ``lse[b, h, rows[t]]`` merged with ``part[b, t, h]`` and
    ``part_lse[b, h, t]`` in place (rows distinct)."""
    b, t, h, r, pmask = _triples(T, H, R, rows_ptr, BLOCK)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    both = pmask[:, None] & dmask[None, :]
    out_at = b * s_ob + r * s_on + h * s_oh
    lse_at = lse_ptr + b * s_lb + h * s_lh + r * s_ln
    a = tl.load(out_ptr + out_at[:, None] + d[None, :], mask=both, other=0.0).to(tl.float32)
    la = tl.load(lse_at, mask=pmask, other=float("-inf")).to(tl.float32)
    o = tl.load(part_ptr + (b * s_pb + t * s_pt + h * s_ph)[:, None] + d[None, :], mask=both,
                other=0.0).to(tl.float32)
    lo = tl.load(part_lse_ptr + b * s_qb + h * s_qh + t * s_qt, mask=pmask, other=float("-inf")).to(tl.float32)
    m_i = tl.full([BLOCK], float("-inf"), tl.float32)
    s_i = tl.zeros([BLOCK], tl.float32)
    acc = tl.zeros([BLOCK, BLOCK_D], tl.float32)
    m_i, s_i, acc = merge_step(m_i, s_i, acc, a, la)
    m_i, s_i, acc = merge_step(m_i, s_i, acc, o, lo)
    store_merged(out_ptr, out_at, lse_at, acc, m_i, s_i, pmask, d, dmask, True, True)


@triton.jit
def rows_kernel(dst_ptr, src_ptr, rows_ptr, src_rows_ptr, R, T, H, D, L, C, s_db, s_dn, s_dh, s_s0, s_s1, s_s2,
                OP: tl.constexpr, SRC_ROWS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """``dst[b, rows[t], h]`` from row ``s`` (``src_rows[t]`` with ``SRC_ROWS``, else ``t``) of batch
    row ``b`` of ``src``, ``[B * C, L, H, D]`` (a batched call's ``C`` calls of ``L`` rows per batch
    row, any strides: row ``s`` is ``src[b * C + s // L, s % L, h]``): ``OP`` 0 places it (cast to
    dst's dtype), 1 adds it in float32 rounded once to dst's dtype (rows distinct), 2 adds it by
    atomic adds (a float32 dst; rows may repeat)."""
    b, t, h, r, pmask = _triples(T, H, R, rows_ptr, BLOCK)
    d = tl.arange(0, BLOCK_D)
    both = pmask[:, None] & (d < D)[None, :]
    at = dst_ptr + (b * s_db + r * s_dn + h * s_dh)[:, None] + d[None, :]
    if SRC_ROWS:
        t = tl.load(src_rows_ptr + t, mask=pmask, other=0).to(tl.int64)
    src_at = (b * C + t // L) * s_s0 + (t % L) * s_s1 + h * s_s2
    x = tl.load(src_ptr + src_at[:, None] + d[None, :], mask=both, other=0.0)
    if OP == 0:
        tl.store(at, x.to(dst_ptr.dtype.element_ty), mask=both)
    elif OP == 1:
        y = tl.load(at, mask=both, other=0.0).to(tl.float32)
        tl.store(at, (y + x.to(tl.float32)).to(dst_ptr.dtype.element_ty), mask=both)
    else:
        tl.atomic_add(at, x.to(tl.float32), mask=both)
