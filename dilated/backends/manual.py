"""``manual``: plain matmul -> softmax -> matmul, the readable reference kernel.

Computes in float32 (float64 for float64 inputs), streaming over query blocks so that memory is
``block * seq_k`` per head rather than ``seq_q * seq_k``. The log-sum-exp is exact (it is what the
softmax computes). Backward is written out (recompute ``P = exp(S - lse)`` per block), so it takes
merged ``out``/``lse`` like a fused kernel does.
"""
from __future__ import annotations

import torch

from .base import Backend

_BLOCK_ELEMS = 1 << 24  # scores per block: bounded working memory


def _acc_dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _blocks(q, k):
    b, nq, h, _ = q.shape
    nk = k.shape[1]
    step = max(1, _BLOCK_ELEMS // max(1, b * h * nk))
    return [(s, min(nq, s + step)) for s in range(0, nq, step)]


def _scores(qb, k, s0, causal, scale, bias=None):
    # qb [B, n, H, D] (acc dtype), k [B, Nk, H, D] -> [B, H, n, Nk]; bias(s0, s1) -> [H, n, Nk] or None
    s = torch.einsum("bnhd,bmhd->bhnm", qb, k) * scale
    if bias is not None:
        b = bias(s0, s0 + qb.shape[1]).to(s.dtype).unsqueeze(0)
        s = torch.where(b == float("-inf"), b, s + b)
    if causal:
        n, nk = qb.shape[1], k.shape[1]
        rows = torch.arange(s0, s0 + n, device=s.device).unsqueeze(1)
        cols = torch.arange(nk, device=s.device).unsqueeze(0)
        s = s.masked_fill(cols > rows, float("-inf"))
    return s


def _probs(s, lse):
    lse = lse.unsqueeze(-1)
    p = torch.exp(s - lse)
    return torch.where(lse == float("-inf"), 0.0, p)  # rows with no visible key; NaN stays NaN


def _pv(p, v, s):
    """``P V`` where masked keys (score ``-inf``) contribute nothing, even a non-finite value
    (``0 * NaN`` would put NaN in every row of the product): the finite values by one matmul,
    each non-finite value added to the rows that see its key."""
    finite = torch.isfinite(v)
    if bool(finite.all()):
        return torch.einsum("bhnm,bmhd->bnhd", p, v)
    out = torch.einsum("bhnm,bmhd->bnhd", p, torch.where(finite, v, torch.zeros_like(v)))
    for b, j, h, d in (~finite).nonzero().tolist():
        seen = s[b, h, :, j] != float("-inf")
        out[b, :, h, d] += torch.where(seen, p[b, h, :, j] * v[b, j, h, d], 0.0)
    return out


class ManualBackend(Backend):
    name = "manual"
    native_gqa = False
    materializes_scores = True

    def value_head_dim_reason(self, q, v):
        return None  # any value head_dim

    def forward(self, q, k, v, causal, scale, bias=None):
        acc = _acc_dtype(q)
        kf, vf = k.to(acc), v.to(acc)
        out = q.new_empty(*q.shape[:3], v.shape[3])
        lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device=q.device, dtype=acc)
        for s0, s1 in _blocks(q, k):
            s = _scores(q[:, s0:s1].to(acc), kf, s0, causal, scale, bias)
            l = torch.logsumexp(s, dim=-1)
            p = _probs(s, l)
            out[:, s0:s1] = _pv(p, vf, s).to(q.dtype)
            lse[:, :, s0:s1] = l
        return out, lse

    def forward_autograd(self, q, k, v, causal, scale):
        acc = _acc_dtype(q)
        s = _scores(q.to(acc), k.to(acc), 0, causal, scale)
        lse = torch.logsumexp(s, dim=-1)
        out = _pv(_probs(s, lse), v.to(acc), s)
        return out.to(q.dtype), lse

    def backward(self, dout, q, k, v, out, lse, causal, scale, bias=None):
        acc = _acc_dtype(q)
        kf, vf = k.to(acc), v.to(acc)
        dq = torch.empty_like(q)
        dk = torch.zeros_like(kf)
        dv = torch.zeros_like(vf)
        for s0, s1 in _blocks(q, k):
            qb = q[:, s0:s1].to(acc)
            dob = dout[:, s0:s1].to(acc)
            p = _probs(_scores(qb, kf, s0, causal, scale, bias), lse[:, :, s0:s1].to(acc))
            dv += torch.einsum("bhnm,bnhd->bmhd", p, dob)
            dp = torch.einsum("bnhd,bmhd->bhnm", dob, vf)
            delta = (dob * out[:, s0:s1].to(acc)).sum(-1).transpose(1, 2)  # [B, H, n]
            ds = p * (dp - delta.unsqueeze(-1))
            dq[:, s0:s1] = (torch.einsum("bhnm,bmhd->bnhd", ds, kf) * scale).to(q.dtype)
            dk += torch.einsum("bhnm,bnhd->bmhd", ds, qb) * scale
        return dq, dk.to(k.dtype), dv.to(v.dtype)

    # -- block-sparse lists (dilated.longnet.residue_major): the scores of a listed block get log(times
    # listed), the others -inf; the scores are materialised, so for checks at small lengths
    def block_sparse_reason(self, q, k, block):
        return None

    def block_sparse_forward(self, q, k, v, lists, scale):
        groups = q.shape[2] // k.shape[2]
        k, v = (t.repeat_interleave(groups, 2) for t in (k, v))
        return self.forward(q, k, v, False, scale, _lists_bias(lists, k.shape[1]))

    def block_sparse_backward(self, dout, q, k, v, out, lse, lists, scale):
        groups = q.shape[2] // k.shape[2]
        kx, vx = (t.repeat_interleave(groups, 2) for t in (k, v))
        dq, dk, dv = self.backward(dout, q, kx, vx, out, lse, False, scale, _lists_bias(lists, k.shape[1]))
        if groups > 1:  # each kv head's gradient is its query heads' sum
            dk, dv = (g.unflatten(2, (k.shape[2], groups)).sum(3) for g in (dk, dv))
        return dq, dk, dv


def _lists_bias(lists, nk: int):
    """``bias(s0, s1)``: ``[H, s1 - s0, nk]`` log of how often each key's block is listed for
    each query's block (``-inf`` where never)."""
    counts, indices, block = lists.counts[0], lists.indices[0], lists.block
    listed = torch.arange(indices.shape[-1], device=indices.device) < counts.unsqueeze(-1)
    times = torch.zeros(*counts.shape, nk // block, dtype=torch.float64, device=indices.device)
    times.scatter_add_(2, indices.long(), listed.to(times.dtype))

    def bias(s0, s1):
        rows = torch.arange(s0, s1, device=times.device) // block
        cols = torch.arange(nk, device=times.device) // block
        return torch.log(times[:, rows][:, :, cols])

    return bias
