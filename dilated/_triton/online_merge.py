"""The log-sum-exp merge of :mod:`dilated.merge` in streaming form, inside a Triton kernel: a
running maximum, weight sum and weighted sum over the results a program reads (flash attention's
online softmax), used by the combine kernels (:mod:`dilated._triton.combine`,
:mod:`dilated._triton.branch_combine`). Needs Triton."""
import triton
import triton.language as tl

@triton.jit
def merge_step(m_i, s_i, acc, o, lse):
    """Merge rows ``o`` ``[BLOCK, D]`` (float32) with their ``lse`` ``[BLOCK]`` into the running
    maximum ``m_i``, weight sum ``s_i`` (relative to ``m_i``) and weighted sum ``acc``; start
    from ``-inf``, 0, 0. Returns the new ``(m_i, s_i, acc)``."""
    m_new = tl.maximum(m_i, lse)  # NaN propagates
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # -inf only while no result covers the row
    alpha = tl.exp(m_i - m_safe)
    w = tl.exp(lse - m_safe)
    return m_new, s_i * alpha + w, acc * alpha[:, None] + o * w[:, None]

@triton.jit
def merge_finish(m_i, s_i, acc):
    """The merged rows ``acc / s_i`` and their lse ``m_i + log(s_i)``; rows no result covered
    get 0 and ``-inf`` (a NaN lse made ``acc`` NaN through its weight: it stays NaN)."""
    seen = s_i > 0
    out = acc * tl.where(seen, 1.0 / tl.where(seen, s_i, 1.0), 0.0)[:, None]
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, s_i, 1.0)), float("-inf"))
    return out, lse

@triton.jit
def store_merged(out_ptr, out_at, lse_at, acc, m_i, s_i, pmask, d, dmask, HAS_LSE: tl.constexpr,
                 STORE_LSE: tl.constexpr):
    """Store rows ``acc`` at ``out_ptr + out_at`` (row offsets) in the output dtype: the merged
    rows and, with ``STORE_LSE``, their lse at ``lse_at`` where ``HAS_LSE`` (a log-sum-exp
    mixture), else the plain sum as it is."""
    if HAS_LSE:
        acc, lse = merge_finish(m_i, s_i, acc)
        if STORE_LSE:
            tl.store(lse_at, lse, mask=pmask)
    tl.store(out_ptr + out_at[:, None] + d[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=pmask[:, None] & dmask[None, :])
