"""Float64 references that the tests and the harness hold every implementation to.

* :func:`dense_reference`: softmax attention with an optional additive bias, in float64 with
  autograd, bottom-right causal, GQA by repeating k/v heads.
* :func:`dilated_bias`: LongNet's dilated attention as a dense additive bias: key ``p'`` gets
  ``log(c)`` for query ``p`` where ``c`` counts the branches that select both in one segment
  (``-inf`` where ``c == 0``). Dense attention with this bias *is* the definition (mixing by
  softmax denominators included), so it is the reference for both dilated implementations.
* :func:`sampled_reference`: exact attention for a sample of query rows, streaming over key
  blocks in float64, so that a 1M-token result can still be checked.
"""
from __future__ import annotations

import math

import torch


def dense_reference(q, k, v, causal=False, scale=None, bias=None, dtype=torch.float64):
    """``(out, lse)`` in ``dtype``; ``bias`` is ``[H or 1, Nq, Nk]`` added to the scaled scores."""
    b, nq, h, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qf, kf, vf = (t.to(dtype) for t in (q, k, v))
    if hkv != h:
        kf, vf = kf.repeat_interleave(h // hkv, 2), vf.repeat_interleave(h // hkv, 2)
    s = torch.einsum("bnhd,bmhd->bhnm", qf, kf) * scale
    if bias is not None:  # a -inf bias removes the key, whatever its score (NaN included)
        bias = bias.to(dtype).unsqueeze(0)
        s = torch.where(bias == float("-inf"), bias, s + bias)
    if causal:
        rows = torch.arange(nq, device=q.device).unsqueeze(1) + (nk - nq)
        cols = torch.arange(nk, device=q.device).unsqueeze(0)
        s = s.masked_fill(cols > rows, float("-inf"))
    dead = (s == float("-inf")).all(-1, keepdim=True)  # rows that see no key: output 0, lse -inf
    s = torch.where(dead, torch.zeros_like(s), s)
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    p = torch.where(dead, torch.zeros_like(s), torch.exp(s - lse))
    out = _weighted_values(p, vf, s != float("-inf"))
    lse = torch.where(dead, torch.full_like(lse, float("-inf")), lse).squeeze(-1)
    return out, lse


def _weighted_values(p, v, visible):
    """``sum_j p_ij v_j`` over the keys row i sees (``visible`` ``[B, H, Nq, Nk]``): a non-finite
    value reaches only the rows that see it (``0 * NaN`` of a masked key would reach them all)."""
    finite = torch.isfinite(v)
    out = torch.einsum("bhnm,bmhd->bnhd", p, torch.where(finite, v, torch.zeros_like(v)))
    for b, j, h, d in (~finite).nonzero().tolist():
        out[b, :, h, d] += torch.where(visible[b, h, :, j], p[b, h, :, j] * v[b, j, h, d], 0.0)
    return out


def dilated_bias(n: int, num_heads: int, segment_lengths, dilation_rates, causal=False, device=None,
                 dtype=torch.float64) -> torch.Tensor:
    """``[H, N, N]`` additive bias ``log(c)`` that turns dense attention into dilated attention."""
    pos = torch.arange(n, device=device)
    count = torch.zeros(num_heads, n, n, device=device, dtype=dtype)
    for w, r in zip(segment_lengths, dilation_rates):
        w = min(w, n)
        seg = pos // w
        t = pos % w
        same = seg.unsqueeze(1) == seg.unsqueeze(0)
        for h in range(num_heads):
            sel = (t % r) == (h % r)
            count[h] += (same & sel.unsqueeze(1) & sel.unsqueeze(0)).to(dtype)
    if causal:
        count = count * torch.tril(torch.ones(n, n, device=device, dtype=dtype))
    return torch.log(count)  # log(0) = -inf


def dilated_reference(q, k, v, segment_lengths, dilation_rates, causal=False, scale=None, dtype=torch.float64):
    bias = dilated_bias(q.shape[1], q.shape[2], segment_lengths, dilation_rates, causal, q.device, dtype)
    return dense_reference(q, k, v, causal=False, scale=scale, bias=bias, dtype=dtype)[0]


def sampled_reference(q, k, v, rows: torch.Tensor, causal=False, scale=None, segment_lengths=None,
                      dilation_rates=None, block: int = 8192, dtype=torch.float64, dout=None):
    """Exact output for query ``rows`` only (``[R]`` indices), streaming over key blocks.

    With a schedule given, the keys are weighted by the branch counts of :func:`dilated_bias`
    for those rows (computed per block); otherwise plain dense attention (bottom-right causal).

    With ``dout`` (the output's gradient ``[B, Nq, H, Dv]``) it returns ``(out, dq)`` for those
    rows: a query's gradient depends on its own row only,
    ``dq_i = scale * sum_j P_ij (dout_i . v_j - dout_i . out_i) k_j``, one more pass over the keys.
    """
    b, nq, h, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    g = h // hkv
    qr = q[:, rows].to(dtype)  # [B, R, H, D]

    def key_blocks():  # (scores [B, H, R, M] with the mask and branch counts applied, keys, values)
        for k0 in range(0, nk, block):
            k1 = min(nk, k0 + block)
            kb = k[:, k0:k1].to(dtype).repeat_interleave(g, 2)
            vb = v[:, k0:k1].to(dtype).repeat_interleave(g, 2)
            s = torch.einsum("brhd,bmhd->bhrm", qr, kb) * scale
            cols = torch.arange(k0, k1, device=q.device)
            if segment_lengths is not None:
                bias = _row_counts(rows, cols, h, segment_lengths, dilation_rates, dtype, nk).log().unsqueeze(0)
                s = torch.where(bias == float("-inf"), bias, s + bias)
            if causal:
                s = s.masked_fill(cols.unsqueeze(0) > rows.unsqueeze(1) + (nk - nq), float("-inf"))
            yield s, kb, vb

    m = torch.full((b, h, len(rows)), float("-inf"), device=q.device, dtype=dtype)
    den = torch.zeros_like(m)
    acc = torch.zeros(b, len(rows), h, v.shape[3], device=q.device, dtype=dtype)
    for s, _, vb in key_blocks():
        bm = torch.maximum(m, s.amax(-1))
        ref = torch.where(torch.isinf(bm), torch.zeros_like(bm), bm)
        corr = torch.exp(m - ref)
        p = torch.exp(s - ref.unsqueeze(-1))
        den = den * corr + p.sum(-1)
        acc = acc * corr.transpose(1, 2).unsqueeze(-1) + torch.einsum("bhrm,bmhd->brhd", p, vb)
        m = bm
    seen = den > 0  # rows that see no key: output 0, gradient 0
    out = acc / torch.where(seen, den, torch.ones_like(den)).transpose(1, 2).unsqueeze(-1)
    if dout is None:
        return out
    lse = torch.where(seen, m + torch.log(torch.where(seen, den, torch.ones_like(den))), torch.zeros_like(m))
    do = dout[:, rows].to(dtype)  # [B, R, H, Dv]
    delta = (do * out).sum(-1).transpose(1, 2).unsqueeze(-1)  # [B, H, R, 1]
    dq = torch.zeros_like(qr)
    for s, kb, vb in key_blocks():
        p = torch.where(seen.unsqueeze(-1), torch.exp(s - lse.unsqueeze(-1)), torch.zeros_like(s))
        ds = p * (torch.einsum("brhd,bmhd->bhrm", do, vb) - delta)
        dq += torch.einsum("bhrm,bmhd->brhd", ds, kb) * scale
    return out, dq


def _row_counts(rows, cols, num_heads, segment_lengths, dilation_rates, dtype, n):
    """``[H, R, M]`` branch counts for query ``rows`` against key ``cols`` (see dilated_bias)."""
    count = torch.zeros(num_heads, len(rows), len(cols), device=rows.device, dtype=dtype)
    heads = torch.arange(num_heads, device=rows.device).view(-1, 1, 1)
    for w, r in zip(segment_lengths, dilation_rates):
        w = min(w, n)
        same = (rows.unsqueeze(1) // w) == (cols.unsqueeze(0) // w)
        sel_r = ((rows % w) % r).view(1, -1, 1) == heads % r
        sel_c = ((cols % w) % r).view(1, 1, -1) == heads % r
        count += (same.unsqueeze(0) & sel_r & sel_c).to(dtype)
    return count
