"""The log-sum-exp merge of partial attentions (dilated branches, ring steps, causal pieces).

Two attentions of one query row over disjoint key sets, ``(o1, l1)`` and ``(o2, l2)``, combine
exactly into ``o = w1*o1 + w2*o2`` with ``wi = exp(li - L)`` and ``L = logaddexp(l1, l2)``.
Layouts: outputs ``[..., D]`` and their lse in *row layout*, ``out.shape[:-1]`` (for
``[B, N, H, D]`` outputs that is ``[B, N, H]``: pass ``lse.transpose(1, 2)`` for a kernel's
``[B, H, N]`` lse). Accumulators are float32.
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
    new = torch.logaddexp(acc_lse, lse)
    ref = torch.where(torch.isinf(new), 0.0, new)  # -inf only where both are
    acc.mul_(_rows(torch.exp(acc_lse - ref)))
    acc.addcmul_(out, _rows(torch.exp(lse - ref)))  # reads out in its own dtype: no float32 copy of it
    acc_lse.copy_(new)


def empty_accumulators(b: int, n: int, h: int, d: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``acc`` float32 ``[B, N, H, D]`` zeros and ``acc_lse`` float32 ``[B, N, H]`` at ``-inf``."""
    acc = torch.zeros(b, n, h, d, device=device, dtype=torch.float32)
    acc_lse = torch.full((b, n, h), float("-inf"), device=device, dtype=torch.float32)
    return acc, acc_lse
