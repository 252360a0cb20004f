"""Dilated branches whose segments cross shard boundaries at any offset (neither the segment nor
the shard length divides the other, or a clipped last segment spans ranks): the general case of
:class:`dilated.DistributedDilatedAttention`.

Every rank sends its dilated K/V rows of the branch (per head offset) to every other in one
all-gather over the whole group, then computes its queries of each segment it touches against
that segment's gathered rows (causal: bottom-right aligned, its queries being the last rows of
the segment's keys up to them); backward returns the K/V gradients to their owners by one
reduce-scatter. The gather and scatter are the aligned spans' (same member layout).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..dense import AttentionSpec, attention_backward, attention_forward
from ..longnet.plan import KernelCall


class Saved(NamedTuple):
    """What the backward of a call reads: its query rows, merged output and lse, incoming gradient."""

    q: torch.Tensor
    out: torch.Tensor
    lse_rows: torch.Tensor
    dout: torch.Tensor


class CrossingSegments:
    """A branch whose segments do not line up with the shards (neither length divides the other,
    or the last segment is clipped across shards). Every rank sends its dilated K/V rows of the
    branch (per head offset) to every other in one all-gather over the whole group, then computes
    its queries of each segment it touches against that segment's gathered rows; backward returns
    the K/V gradients to their owners by one reduce-scatter. Per rank that moves ``N/r`` rows per
    offset and branch (the aligned cases move only a segment's worth)."""

    def __init__(self, w, r, shards: tuple[int, int, int], heads: tuple[int, int], group, device):
        """``shards``: (this rank, shard length n, ranks p); ``heads``: (heads, q heads per kv head)."""
        rank, n, p = shards
        h, groups = heads
        self.r, self.w, self.span, self.me, self.group = r, w, p, rank, group
        big_n, lo = n * p, rank * n
        pos = torch.arange(big_n)
        self.offsets, self.pieces = [], []  # pieces: (offset index, local q rows, first gathered key, last)
        for off in range(min(r, h)):
            selected = (pos % w) % r == off
            rows = selected[lo:lo + n].nonzero().squeeze(1).to(device)
            sizes = selected.view(p, n).sum(1).tolist()
            self.offsets.append((off, rows, sizes, torch.arange(off, h, r, device=device) // groups))
            before = torch.cat([torch.zeros(1, dtype=torch.long), selected.long().cumsum(0)])  # selected < x
            for a in range(lo // w * w, min(lo + n, big_n), w):  # the segments touching this shard
                e = min(a + w, big_n)
                q0, q1 = max(a, lo), min(e, lo + n)
                first = (off - (q0 - a)) % r  # the first selected row of the segment at or after q0
                if q0 + first < q1:
                    self.pieces.append((len(self.offsets) - 1, slice(q0 - lo + first, q1 - lo, r),
                                        int(before[a]), int(before[e]), int(before[q1])))
        here = [j for j, (_, _, sizes, _) in enumerate(self.offsets) if sizes[self.me]]
        self.batched, self.groups = False, [[j] for j in here]

    def member_len(self, m, d, b=1):
        return sum(2 * sizes[m] * len(kvidx) * d for _, _, sizes, kvidx in self.offsets) * b

    def keys(self, piece, causal: bool) -> slice:
        """The gathered rows (of its offset) a piece's queries see: the segment's, causal up to them."""
        _, _, k0, k_end, k_upto = piece
        return slice(k0, k_upto if causal else k_end)


def _gathered_by_offset(sp: CrossingSegments, kv):
    """The gathered ``(K, V)`` per offset index, ``[B, rows, h', D]``."""
    by_offset = {}
    for (j,), (ks, vs) in zip(sp.groups, kv):
        by_offset[j] = (ks[:, 0], vs[:, 0])
    return by_offset


def crossing_forward(sp: CrossingSegments, q, kv, spec: AttentionSpec):
    """The branch's kernel calls here: ``(calls, outputs, lses)``, one per segment and head offset."""
    kv = _gathered_by_offset(sp, kv)
    calls, outs, lses = [], [], []
    for piece in sp.pieces:
        j, rows = piece[0], piece[1]
        off = sp.offsets[j][0]
        ks, vs = kv[j]
        keys = sp.keys(piece, spec.causal)
        o, lse = attention_forward(spec.backend, q[:, rows, off::sp.r], ks[:, keys], vs[:, keys], spec.causal,
                                   spec.scale)
        calls.append(KernelCall(rows.start, 1, rows.stop - rows.start, sp.r, "offset", off, row_offset=0))
        outs.append(o)
        lses.append(lse)
    return calls, outs, lses


def crossing_backward(sp: CrossingSegments, spec: AttentionSpec, saved: Saved, kv, dq):
    """Add the branch's dq into ``dq``; return its dK, dV per offset (all gathered rows)."""
    q, out, lse_rows, dout = saved
    b, d = q.shape[0], q.shape[3]
    kv = _gathered_by_offset(sp, kv)
    dks = [q.new_zeros(b, sum(sizes), len(kvidx), d, dtype=dq.dtype) for _, _, sizes, kvidx in sp.offsets]
    dvs = [torch.zeros_like(x) for x in dks]
    for piece in sp.pieces:
        j, rows = piece[0], piece[1]
        off = sp.offsets[j][0]
        ks, vs = kv[j]
        keys = sp.keys(piece, spec.causal)
        sel = (slice(None), rows, slice(off, None, sp.r))
        lse = lse_rows[sel].transpose(1, 2).contiguous()
        g = attention_backward(spec.backend, dout[sel], q[sel], ks[:, keys], vs[:, keys], out[sel], lse, spec.causal,
                               spec.scale)
        dq[sel] += g[0]
        dks[j][:, keys] += g[1]
        dvs[j][:, keys] += g[2]
    return dks, dvs
