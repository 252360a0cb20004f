"""The log-sum-exp merge of partial attentions (dilated branches, ring steps, causal pieces).

Two attentions of one query row over disjoint key sets, ``(o1, l1)`` and ``(o2, l2)``, combine
exactly into ``o = (e1*o1 + e2*o2) / (e1 + e2)`` with ``ei = exp(li - m)``, ``m = max(l1, l2)``, and
``L = m + log(e1 + e2)``. The weights are normalised by their own sum rather than taken as
``exp(li - L)``: at large logits ``L`` rounds to ``m`` (``log 2`` is below one ulp of ``1e8`` in
float32) and ``exp(li - L)`` would then sum to 2.
Layouts: outputs ``[..., D]`` and their lse in *row layout*, ``out.shape[:-1]`` (for
``[B, N, H, D]`` outputs that is ``[B, N, H]``: pass ``lse.transpose(1, 2)`` for a kernel's
``[B, H, N]`` lse). Accumulators are float32 (float64 for float64 inputs).
"""
from __future__ import annotations

import torch


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
