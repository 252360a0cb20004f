"""LongNet's sequence-parallel dilated attention.

Each rank holds a contiguous shard of ``n = N/P`` positions. For a branch ``(w, r)`` with
``w' = min(w, N)``:

* if ``n % w' == 0`` its segments lie inside shards: the branch runs locally, no communication;
* if ``w' % n == 0`` a segment spans ``w'/n`` ranks: for each head offset, each rank selects its
  *dilated* rows of K/V (``n/r`` of them) and all-gathers them within the ranks of its segment
  (backward: a reduce-scatter of their gradients; on gloo, which has no reduce-scatter, an
  all-reduce and a slice). Communication per rank is ``(w'/n) * n/r`` rows per branch, bounded by
  the schedule, not by N. Causal: a rank's queries see the gathered keys of earlier ranks and its
  own keys causally, which is bottom-right causal attention over ``[earlier ranks, own]``.

Branch outputs mix by their softmax denominators exactly as in :func:`dilated.dilated_attention`;
the result equals ``DilatedAttention`` on the gathered sequence, forward and backward.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ._checks import check_qkv, check_schedule
from .dilated_attention import branch_attention, mix_branches
from .distributed import CommStats
from .functional import attention, default_scale


def _selected(start_t: int, n: int, r: int, off: int) -> slice:
    """Local rows i in [0, n) whose segment position start_t + i is = off (mod r)."""
    return slice((off - start_t) % r, n, r)


class _GatherRows(torch.autograd.Function):
    """All-gather a rank's rows (sizes may differ per rank) along dim 1; backward reduce-scatters."""

    @staticmethod
    def forward(ctx, x, group, sizes, my_index, stats):
        m = max(sizes)
        pad = torch.zeros((x.shape[0], m) + x.shape[2:], device=x.device, dtype=x.dtype)
        pad[:, :x.shape[1]] = x
        parts = [torch.empty_like(pad) for _ in sizes]
        with stats.waiting(x.device):
            dist.all_gather(parts, pad, group=group)
        stats.sent(pad.numel() * pad.element_size() * (len(sizes) - 1), collective=True)
        ctx.group, ctx.sizes, ctx.my_index, ctx.m, ctx.stats = group, sizes, my_index, m, stats
        return torch.cat([t[:, :s] for t, s in zip(parts, sizes)], 1)

    @staticmethod
    def backward(ctx, grad):
        parts, i = [], 0
        for s in ctx.sizes:
            g = torch.zeros((grad.shape[0], ctx.m) + grad.shape[2:], device=grad.device, dtype=grad.dtype)
            g[:, :s] = grad[:, i:i + s]
            parts.append(g)
            i += s
        with ctx.stats.waiting(grad.device):
            if dist.get_backend(ctx.group) == "nccl":
                mine = torch.empty_like(parts[0])
                dist.reduce_scatter(mine, parts, group=ctx.group)
            else:  # gloo has no reduce_scatter
                full = torch.stack(parts)
                dist.all_reduce(full, group=ctx.group)
                mine = full[ctx.my_index]
        ctx.stats.sent(mine.numel() * mine.element_size() * (len(ctx.sizes) - 1), collective=True)
        return mine[:, :ctx.sizes[ctx.my_index]], None, None, None, None


class DistributedDilatedAttention(nn.Module):
    """Sequence-parallel dilated attention; ``forward(q, k, v)`` on contiguous shards ``[B, N/P, H, D]``.

    ``self.stats`` (a :class:`dilated.distributed.CommStats`) counts collectives and bytes sent;
    ``measure_comm=True`` also times the compute stream's waits on them.
    """

    def __init__(self, segment_lengths, dilation_rates, *, causal=False, scale=None, backend="auto", group=None,
                 measure_comm: bool = False):
        super().__init__()
        self.segment_lengths, self.dilation_rates = check_schedule(segment_lengths, dilation_rates)
        self.causal, self.scale, self.backend, self.group = causal, scale, backend, group
        self._groups: dict[int, list] = {}
        self.stats = CommStats(measure_comm)

    def _segment_group(self, span: int, rank: int, p: int):
        """The process group of the ``span`` consecutive ranks that share this rank's segment."""
        if span not in self._groups:
            ranks = list(range(p))
            glob = [dist.get_global_rank(self.group, i) if self.group else i for i in ranks]
            # every rank creates every group, in the same order (new_group is collective)
            self._groups[span] = [dist.new_group(glob[s:s + span]) if span < p else self.group
                                  for s in range(0, p, span)]
        return self._groups[span][rank // span]

    def forward(self, q, k, v):
        check_qkv(q, k, v)
        if not dist.is_initialized():
            raise RuntimeError("DistributedDilatedAttention needs torch.distributed initialised")
        rank, p = dist.get_rank(self.group), dist.get_world_size(self.group)
        b, n, h, d = q.shape
        big_n = n * p
        scale = default_scale(d, self.scale)
        groups = h // k.shape[2]
        k, v = k.repeat_interleave(groups, 2), v.repeat_interleave(groups, 2)
        outs, lses = [], []
        for w, r in zip(self.segment_lengths, self.dilation_rates):
            w = min(w, big_n)
            if n % w == 0:
                o_i, lse_i = branch_attention(q, k, v, w, r, causal=self.causal, scale=scale, backend=self.backend)
            elif w % n == 0:
                o_i, lse_i = self._spanning_branch(q, k, v, w, r, rank, p, scale)
            else:
                raise ValueError(
                    f"segment length {w} and the per-rank shard length {n} (N={big_n} over {p} ranks) must divide "
                    "one another: choose segment_lengths that are multiples or divisors of N / world_size")
            outs.append(o_i)
            lses.append(lse_i)
        return mix_branches(outs, lses, q.dtype)

    def _spanning_branch(self, q, k, v, w, r, rank, p, scale):
        b, n, h, d = q.shape
        span = w // n
        first = (rank // span) * span
        members = range(first, min(first + span, p))
        group = self._segment_group(span, rank, p)
        o_i = q.new_zeros(b, n, h, d)
        lse_i = q.new_full((b, n, h), float("-inf"), dtype=torch.float32)
        for off in range(min(r, h)):
            rows = _selected((rank - first) * n, n, r, off)
            sizes = [len(range(*_selected((m - first) * n, n, r, off).indices(n))) for m in members]
            qs = q[:, rows, off::r]
            if qs.shape[1] == 0 and sum(sizes) == 0:
                continue
            ks = _GatherRows.apply(k[:, rows, off::r].contiguous(), group, sizes, rank - first, self.stats)
            vs = _GatherRows.apply(v[:, rows, off::r].contiguous(), group, sizes, rank - first, self.stats)
            if qs.shape[1] == 0:
                # nothing to compute here, but keep the gathered rows in the graph so that the
                # collective in backward runs on every rank of the group
                o_i = o_i + 0 * (ks.sum() + vs.sum())
                continue
            if self.causal:  # keys of earlier ranks, then own keys: bottom-right causal
                upto = sum(sizes[:rank - first + 1])
                ks, vs = ks[:, :upto], vs[:, :upto]
            o, lse = attention(qs, ks, vs, causal=self.causal, scale=scale, backend=self.backend, return_lse=True)
            o_i[:, rows, off::r] = o
            lse_i[:, rows, off::r] = lse.transpose(1, 2)
        return o_i, lse_i
