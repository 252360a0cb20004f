"""Packed documents: several documents in one sequence, ``cu_seqlens`` their cumulative lengths
(int32 ``[0, l_0, l_0 + l_1, ..., N]``, the flash-attn varlen convention). Attention never crosses
a document boundary; causal applies within each document.

Documents run in batched kernel calls, not one call per document: non-causal documents of one
length share a call (their batch is the number of such documents); causal ones are padded at
their end to a bucket length (four buckets per octave, so at most a quarter of a call is padding)
and share the bucket's call. Padding at the end is exact under causality: a real query sees only
keys at or before it, never a padded one, and the padded rows' outputs are dropped (their
gradients are zero). So the calls are at most one per distinct length (non-causal) or about four
per octave of lengths (causal).
"""
from __future__ import annotations

from collections import defaultdict

import torch


def check_cu_seqlens(cu_seqlens, n: int) -> list[int]:
    """Validate ``cu_seqlens`` for a packed sequence of ``n`` positions; return it as a list."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor (int32 cumulative document lengths), got "
                        f"{type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"cu_seqlens must be int32 (the flash-attn varlen convention), got {cu_seqlens.dtype}: "
                        "convert it with cu_seqlens.to(torch.int32)")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-d with at least 2 entries [0, ..., N], got shape "
                         f"{tuple(cu_seqlens.shape)}")
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != n:
        raise ValueError(f"cu_seqlens must start at 0 and end at the sequence length {n}, got {cu[0]} ... {cu[-1]}: "
                         "the documents' lengths must sum to N")
    if any(b <= a for a, b in zip(cu, cu[1:])):
        raise ValueError("cu_seqlens must be strictly increasing (every document at least one position long), got "
                         f"{cu[:12]}{' ...' if len(cu) > 12 else ''}")
    return cu


def _bucket(length: int) -> int:
    """The smallest of ``2^e, 1.25 * 2^e, 1.5 * 2^e, 1.75 * 2^e`` at or above ``length``."""
    if length <= 4:
        return length
    e = (length - 1).bit_length() - 1  # 2^e < length <= 2^(e+1)
    step = 1 << (e - 2)
    return -(-length // step) * step


def document_calls(cu: list[int], causal: bool) -> list[tuple[int, list[tuple[int, int]]]]:
    """``(call length, [(start, length), ...])`` per kernel call: documents of one length, or
    (causal) of one bucket length, together."""
    groups = defaultdict(list)
    for start, end in zip(cu, cu[1:]):
        length = end - start
        groups[_bucket(length) if causal else length].append((start, length))
    return sorted(groups.items())


def packed_attention(q, k, v, cu_seqlens, attend, causal: bool):
    """``attend(q, k, v) -> (out, lse)`` (a plain attention, causal as given) over each document of
    the packed ``[B, N, H, D]`` q, k, v separately; returns ``(out, lse)`` for the whole sequence,
    lse ``[B, H, N]``. Differentiable (gathers and one inverse permutation)."""
    b, n = q.shape[:2]
    cu = check_cu_seqlens(cu_seqlens, n)
    if len(cu) == 2:
        return attend(q, k, v)
    device = q.device
    pad = n  # padded positions read one zero row appended at position n
    ext = [torch.cat([x, x.new_zeros(b, 1, *x.shape[2:])], 1) for x in (q, k, v)]
    outs, lses, order = [], [], []
    for length, docs in document_calls(cu, causal):
        starts, lengths = torch.tensor(docs, device=device).unbind(1)
        offsets = torch.arange(length, device=device)
        pos = torch.where(offsets < lengths[:, None], starts[:, None] + offsets, pad)  # [docs, length]
        real = pos.flatten() != pad
        qg, kg, vg = (x[:, pos.flatten()].reshape(b * len(docs), length, *x.shape[2:]) for x in ext)
        o, lse = attend(qg, kg, vg)
        outs.append(o.reshape(b, len(docs) * length, *o.shape[2:])[:, real])
        lses.append(lse.reshape(b, len(docs), lse.shape[1], length).transpose(1, 2)
                    .reshape(b, lse.shape[1], len(docs) * length)[:, :, real])
        order.append(pos.flatten()[real])
    inverse = torch.empty(n, dtype=torch.long, device=device)
    inverse[torch.cat(order)] = torch.arange(n, device=device)
    return torch.cat(outs, 1)[:, inverse], torch.cat(lses, 2)[:, :, inverse]
