"""LongNet dilated attention, the readable implementation: one page that mirrors the definition.

Inputs q ``[B, N, H, D]``, k/v ``[B, N, Hkv, D]`` (head h reads kv head h // (H/Hkv)); branches
``(w_i, r_i)``; ``w'_i = min(w_i, N)``.

* Branch i cuts the sequence into segments ``[s*w', (s+1)*w')`` clipped to N (the last may be
  shorter; it is never padded).
* Head h uses offset ``o = h mod r``; position p (``t = p mod w'``) is selected iff
  ``t mod r == o``.
* A selected query attends (softmax, scale) to the selected keys of its own segment (keys at
  positions <= p when causal): branch output ``O_i`` and log-sum-exp ``lse_i`` (``-inf`` where p
  is not selected).
* Branches mix by their softmax denominators (LongNet eq. 9-10):
  ``O = sum_i exp(lse_i - logsumexp_j lse_j) * O_i``, computed as ``sum_i e_i O_i / sum_i e_i`` with
  ``e_i = exp(lse_i - max_j lse_j)`` so that the weights sum to one at any logit scale; a position
  no branch selects outputs 0.

Gradients are autograd's through :func:`dilated.attention`, whose lse is differentiable, so the
mixing weights get their gradient. The fast implementation is
:class:`dilated.ImprovedDilatedAttention`; both are held to a float64 dense reference.
"""
from __future__ import annotations

import torch
from torch import nn

from .._checks import acc_dtype, check_causal, check_qkv, check_scale, check_schedule, dense_rows
from ..functional import attention
from ..dense import default_scale
from .plan import segment_blocks


def check_dilated_inputs(q, k, v, segment_lengths, dilation_rates, causal=False, warn=True):
    check_qkv(q, k, v)
    check_causal(causal)
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"dilated attention needs q and k/v of one length, got q {q.shape[1]} and k {k.shape[1]}")
    if v.shape[3] != q.shape[3]:
        raise ValueError(f"dilated attention needs v's head_dim ({v.shape[3]}) equal to q's ({q.shape[3]}); "
                         "dilated.attention takes another value head_dim on the manual and sdpa_math backends")
    return check_schedule(segment_lengths, dilation_rates, warn)


def branch_attention(q, k, v, w: int, r: int, *, causal: bool, scale: float, backend: str):
    """One branch: ``(O_i [B, N, H, D], lse_i [B, N, H])``, lse ``-inf`` where p is not selected.

    ``k``/``v`` carry one head per q head here (GQA expanded by the caller).
    """
    b, n, h, d = q.shape
    w = min(w, n)
    o_i = q.new_zeros(b, n, h, d)
    lse_i = q.new_full((b, n, h), float("-inf"), dtype=acc_dtype(q.dtype))
    for start, count, length in segment_blocks(n, w):
        seg = lambda x: x[:, start:start + count * length].unflatten(1, (count, length))  # noqa: E731
        for off in range(r):  # heads off::r read positions off::r of every segment
            qs, ks, vs = (seg(x)[:, :, off::r, off::r].flatten(0, 1) for x in (q, k, v))
            if qs.numel() == 0:
                continue
            o, lse = attention(qs, ks, vs, causal=causal, scale=scale, backend=backend, return_lse=True)
            seg(o_i)[:, :, off::r, off::r] = o.unflatten(0, (b, count))
            seg(lse_i)[:, :, off::r, off::r] = lse.transpose(1, 2).unflatten(0, (b, count))
    return o_i, lse_i


def mix_branches(outs, lses, dtype):
    """LongNet eq. 9-10: ``O = sum_i exp(lse_i - logsumexp_j lse_j) * O_i`` (0 where no branch selects p),
    with the weights normalised by their sum relative to the maximum lse (exact at any logit scale)."""
    lse_all = torch.stack(lses)                                   # [k, B, N, H]
    m = lse_all.amax(0)                                           # NaN propagates
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m)   # uncovered rows
    e = torch.exp(lse_all - m)                                    # 0 where a branch skips p
    total = e.sum(0)
    weights = (e * torch.where(total == 0, 0.0, 1.0 / total)).unsqueeze(-1)
    return (torch.stack(outs).to(lse_all.dtype) * weights).sum(0).to(dtype)


def dilated_attention(q, k, v, segment_lengths, dilation_rates, *, causal=False, scale=None, backend="auto"):
    """Exact LongNet dilated attention (see the module docstring).

    Args:
        q, k, v: ``[B, N, H, D]`` (k/v may have fewer heads: GQA, H divisible by their heads).
        segment_lengths: each branch's segment length w (a segment longer than N is cut at N).
        dilation_rates: each branch's dilation r: a segment keeps every r-th row, head h taking the
            rows offset by h mod r.
        causal: causal attention within each segment.
        scale: softmax scale (default ``head_dim ** -0.5``).
        backend: the local kernel (``"auto"``, ``"sdpa"``, ``"manual"``, ...).

    Returns:
        ``[B, N, H, D]`` in q's dtype: the branches mixed by their log-sum-exp (LongNet eq. 10).
    """
    # dynamo cannot trace a warning: under torch.compile only the module's constructor warns of uncovered rows
    segs, dils = check_dilated_inputs(q, k, v, segment_lengths, dilation_rates, causal,
                                      warn=not torch.compiler.is_compiling())
    q, k, v = dense_rows(q), dense_rows(k), dense_rows(v)
    scale = default_scale(q.shape[-1], scale)
    groups = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(groups, 2), v.repeat_interleave(groups, 2)  # head h reads kv h // groups
    branches = [branch_attention(q, k, v, w, r, causal=causal, scale=scale, backend=backend)
                for w, r in zip(segs, dils)]
    return mix_branches([o for o, _ in branches], [l for _, l in branches], q.dtype)


class DilatedAttention(nn.Module):
    """Module form of :func:`dilated_attention` (the same arguments): ``forward(q, k, v)`` on
    ``[B, N, H, D]`` returns ``[B, N, H, D]``."""

    def __init__(self, segment_lengths, dilation_rates, *, causal=False, scale=None, backend="auto"):
        super().__init__()
        self.segment_lengths, self.dilation_rates = check_schedule(segment_lengths, dilation_rates)
        check_causal(causal)
        check_scale(scale)
        self.causal, self.scale, self.backend = causal, scale, backend

    def forward(self, q, k, v):
        return dilated_attention(q, k, v, self.segment_lengths, self.dilation_rates,
                                 causal=self.causal, scale=self.scale, backend=self.backend)

    def extra_repr(self):
        return f"segment_lengths={list(self.segment_lengths)}, dilation_rates={list(self.dilation_rates)}, causal={self.causal}, backend={self.backend!r}"
