"""The log-sum-exp merge of partial attentions (dilated branches, ring steps, causal pieces).

Two attentions of one query row over disjoint key sets, ``(o1, l1)`` and ``(o2, l2)``, combine
exactly into ``o = (e1*o1 + e2*o2) / (e1 + e2)`` with ``ei = exp(li - m)``, ``m = max(l1, l2)``, and
``L = m + log(e1 + e2)``. The weights are normalised by their own sum rather than taken as
``exp(li - L)``: at large logits ``L`` rounds to ``m`` (``log 2`` is below one ulp of ``1e8`` in
float32) and ``exp(li - L)`` would then sum to 2.

The same rule in two forms: :func:`merge_` merges one result into torch accumulators in place
(ring steps, causal pieces, the combine of a plan off the GPU fast path); :func:`merge_step` and
:func:`merge_finish` are its streaming form inside a Triton kernel (a running maximum and weight
sum over the calls of a plan, as flash attention's online softmax; :mod:`dilated.rows`).
Two computations stay apart on purpose, to check these: ``mix_branches`` of the readable
:class:`~dilated.DilatedAttention` (LongNet's eq. 9-10 over all branches at once, the spec) and
:func:`dilated.reference.sampled_reference` (softmax over every selected key of a row at once).

Layouts: outputs ``[..., D]`` and their lse in *row layout*, ``out.shape[:-1]`` (for
``[B, N, H, D]`` outputs that is ``[B, N, H]``: pass ``lse.transpose(1, 2)`` for a kernel's
``[B, H, N]`` lse). Accumulators are float32 (float64 for float64 inputs).
"""
from __future__ import annotations

import torch

try:  # Triton ships with CUDA builds of PyTorch; it is optional here.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def _rows(lse: torch.Tensor) -> torch.Tensor:
    return lse.unsqueeze(-1)


def merge_(acc: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Merge ``(out, lse)`` into the float32 accumulators ``(acc, acc_lse)`` in place.

    ``acc_lse`` starts at ``-inf`` and ``acc`` at 0. Both may be strided views into larger
    buffers (a dilated branch's rows), which is how branches merge without a full-size copy.
    """
    lse = lse.to(acc_lse.dtype)
    m = torch.maximum(acc_lse, lse)  # NaN propagates
    ref = torch.where(m == float("-inf"), 0.0, m)  # -inf only where both are
    a, e = torch.exp(acc_lse - ref), torch.exp(lse - ref)
    total = a + e
    inv = torch.where(total == 0, 0.0, 1.0 / total)  # rows neither covers stay 0 (NaN stays NaN)
    acc.mul_(_rows(a * inv))
    acc.addcmul_(out, _rows(e * inv))  # reads out in its own dtype: no float32 copy of it
    acc_lse.copy_(ref + torch.log(total))  # log(0) = -inf where neither covers the row


def empty_accumulators(b: int, n: int, h: int, d: int, device, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``acc`` ``[B, N, H, D]`` zeros and ``acc_lse`` ``[B, N, H]`` at ``-inf``, both ``dtype``."""
    acc = torch.zeros(b, n, h, d, device=device, dtype=dtype)
    acc_lse = torch.full((b, n, h), float("-inf"), device=device, dtype=dtype)
    return acc, acc_lse


if triton is not None:

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
