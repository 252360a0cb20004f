"""LongNet's sequence-parallel dilated attention.

Each rank holds a contiguous shard of ``n = N/P`` positions. For a branch ``(w, r)`` with
``w' = min(w, N)``:

* if ``n % w' == 0`` its segments lie inside shards: the branch runs locally, no communication,
  through the same kernel calls as :class:`dilated.ImprovedDilatedAttention`;
* if ``w' % n == 0`` a segment spans ``w'/n`` ranks: each rank selects its *dilated* rows of K/V
  for every head offset (``n/r`` rows per offset) and the ranks of the segment exchange them in
  one all-gather per branch (backward: one reduce-scatter of their gradients; on gloo, which has
  no reduce-scatter, an all-reduce and a slice). Communication per rank is ``(w'/n) * n/r`` rows
  per offset and branch, bounded by the schedule, not by N. Causal: a rank's queries see the
  gathered keys of earlier ranks and its own keys causally, which is bottom-right causal
  attention over ``[earlier ranks, own]``.

All branches, local and spanning, are mixed by log-sum-exp (LongNet eq. 9-10) in one
:func:`dilated.layout.combine`, straight into the output dtype;
backward is a custom autograd Function in which every kernel backward gets the *merged* output
and lse, which is the exact gradient of the mixture. The result equals ``DilatedAttention`` on
the gathered sequence, forward and backward.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ._checks import check_qkv, check_schedule
from .backends import get_backend
from .distributed import CommStats
from .functional import attention_backward, attention_forward, default_scale
from .improved_dilated_attention import backward_calls, forward_calls
from .pattern_cache import BranchCall, plan_for


def _selected(start_t: int, n: int, r: int, off: int) -> slice:
    """Local rows i in [0, n) whose segment position start_t + i is = off (mod r)."""
    return slice((off - start_t) % r, n, r)


def _count(sl: slice, n: int) -> int:
    return len(range(*sl.indices(n)))


class _Span:
    """A branch whose segment spans ``span`` ranks: who is in it and which rows each one holds."""

    def __init__(self, w, r, rank, n, h, groups, group, device):
        self.r, self.span = r, w // n
        self.first = (rank // self.span) * self.span
        self.me = rank - self.first
        self.group = group
        self.offsets = []  # (off, my rows, rows per member, kv-head index of heads off::r)
        for off in range(min(r, h)):
            rows = _selected(self.me * n, n, r, off)
            sizes = [_count(_selected(m * n, n, r, off), n) for m in range(self.span)]
            kvidx = torch.arange(off, h, r, device=device) // groups
            self.offsets.append((off, rows, sizes, kvidx))
        # every offset alike (rows per member, heads): the offsets are one kernel call, a batch
        self.batched = len({(tuple(sizes), len(kvidx)) for _, _, sizes, kvidx in self.offsets}) == 1 \
            and self.offsets[0][2][self.me] > 0

    def member_len(self, m, d, b=1):
        """Elements member ``m`` contributes: K and V rows of every offset."""
        return sum(2 * sizes[m] * len(kvidx) * d for _, _, sizes, kvidx in self.offsets) * b

    def stacked(self, x, rows=True):
        """``x``'s rows of every offset, ``[B * offsets, rows, h', ...]`` (one copy); ``rows=False``:
        ``x`` is ``[B, offsets, ...]`` already."""
        if rows:
            x = torch.stack([x[:, r, off::self.r] for off, r, _, _ in self.offsets], 1)
        return x.flatten(0, 1)


def _all_gather_flat(x, group, lens, stats):
    """All-gather ``x`` ``[B, L_me]`` from members contributing ``lens``; returns one tensor per member."""
    m = max(lens)
    pad = x.new_zeros(x.shape[0], m)
    pad[:, :x.shape[1]] = x
    parts = [torch.empty_like(pad) for _ in lens]
    with stats.waiting(x.device):
        dist.all_gather(parts, pad, group=group)
    stats.sent(pad.numel() * pad.element_size() * (len(lens) - 1), collective=True)
    return [t[:, :n] for t, n in zip(parts, lens)]


def _reduce_scatter_flat(parts, group, lens, me, stats):
    """Sum each member's ``[B, L_m]`` part over the group; return this rank's sum."""
    m = max(lens)
    padded = [p.new_zeros(p.shape[0], m) for p in parts]
    for dst, src in zip(padded, parts):
        dst[:, :src.shape[1]] = src
    with stats.waiting(parts[0].device):
        if dist.get_backend(group) == "nccl":
            mine = torch.empty_like(padded[0])
            dist.reduce_scatter(mine, padded, group=group)
        else:  # gloo has no reduce_scatter
            full = torch.stack(padded)
            dist.all_reduce(full, group=group)
            mine = full[me]
    stats.sent(mine.numel() * mine.element_size() * (len(lens) - 1), collective=True)
    return mine[:, :lens[me]]


def _gather_span(sp: _Span, k, v, stats):
    """The K and V rows of every member of the segment, per offset ``[B, rows, h', D]`` (views of
    ``[B, offsets, rows, h', D]`` tensors when ``sp.batched``). A member sends its K rows of every
    offset, then its V rows."""
    b, d = k.shape[0], k.shape[3]
    mine = [t[:, rows].index_select(2, kvidx).reshape(b, -1) for t in (k, v) for _, rows, _, kvidx in sp.offsets]
    lens = [sp.member_len(m, d) for m in range(sp.span)]
    parts = _all_gather_flat(torch.cat(mine, 1), sp.group, lens, stats)
    if sp.batched:
        sizes, h_off = sp.offsets[0][2], len(sp.offsets[0][3])
        kv = [part.view(b, 2, len(sp.offsets), sizes[m], h_off, d) for m, part in enumerate(parts)]
        ks, vs = (torch.cat([x[:, t] for x in kv], 2) for t in range(2))
        return list(ks.unbind(1)), list(vs.unbind(1)), (ks, vs)
    per = [[[] for _ in sp.offsets] for _ in range(2)]
    for m, part in enumerate(parts):
        i = 0
        for t in range(2):
            for j, (_, _, sizes, kvidx) in enumerate(sp.offsets):
                cnt = sizes[m] * len(kvidx) * d
                per[t][j].append(part[:, i:i + cnt].view(b, sizes[m], len(kvidx), d))
                i += cnt
    return [torch.cat(x, 1) for x in per[0]], [torch.cat(x, 1) for x in per[1]], None


def _span_forward(sp: _Span, q, ks, vs, stacked, backend, causal, scale):
    """The span's kernel calls: ``(calls, outputs, lses)``, one per offset with rows here (the
    outputs of a batched span are views of its one call's output)."""
    n = q.shape[1]
    calls = [BranchCall(0, 1, n, sp.r, "offset", off, row_offset=rows.start)
             for off, rows, sizes, _ in sp.offsets if sizes[sp.me]]
    upto = lambda sizes: sum(sizes[:sp.me + 1]) if causal else None  # noqa: E731 (earlier ranks' keys, then own)
    if sp.batched:
        kb, vb = (sp.stacked(x, rows=False)[:, :upto(sp.offsets[0][2])] for x in stacked)
        o, lse = attention_forward(backend, sp.stacked(q), kb, vb, causal, scale)
        return calls, list(o.unflatten(0, (q.shape[0], -1)).unbind(1)), list(lse.unflatten(0, (q.shape[0], -1)).unbind(1))
    outs, lses = [], []
    for (off, rows, sizes, _), kj, vj in zip(sp.offsets, ks, vs):
        if sizes[sp.me]:
            o, lse = attention_forward(backend, q[:, rows, off::sp.r], kj[:, :upto(sizes)], vj[:, :upto(sizes)],
                                       causal, scale)
            outs.append(o)
            lses.append(lse)
    return calls, outs, lses


def _span_backward(sp: _Span, q, out, lse_rows, dout, ks, vs, stacked, dq, backend, causal, scale):
    """Add the span's dq into ``dq``; return its dK, dV per offset (float32, all gathered rows)."""
    b = q.shape[0]
    dks = [torch.zeros(kj.shape, device=q.device, dtype=torch.float32) for kj in ks]
    dvs = [torch.zeros_like(x) for x in dks]
    sels = [(slice(None), rows, slice(off, None, sp.r)) for off, rows, _, _ in sp.offsets]
    lse_t = lse_rows.transpose(1, 2)  # [B, H, n]: an offset's lse rows as [B, h', rows]
    if sp.batched:
        upto = sum(sp.offsets[0][2][:sp.me + 1]) if causal else ks[0].shape[1]
        kb, vb = (sp.stacked(x, rows=False)[:, :upto] for x in stacked)
        lse_b = torch.stack([lse_t[:, sl[2], sl[1]] for sl in sels], 1).flatten(0, 1).contiguous()
        g = attention_backward(backend, sp.stacked(dout), sp.stacked(q), kb, vb, sp.stacked(out), lse_b, causal, scale)
        g = [x.unflatten(0, (b, -1)) for x in g]
        for j, sl in enumerate(sels):
            dq[sl] += g[0][:, j]
            dks[j][:, :upto] += g[1][:, j]
            dvs[j][:, :upto] += g[2][:, j]
        return dks, dvs
    for j, ((off, rows, sizes, _), sl) in enumerate(zip(sp.offsets, sels)):
        if sizes[sp.me]:
            upto = sum(sizes[:sp.me + 1]) if causal else ks[j].shape[1]
            g = attention_backward(backend, dout[sl], q[sl], ks[j][:, :upto], vs[j][:, :upto], out[sl],
                                   lse_t[:, sl[2], sl[1]].contiguous(), causal, scale)
            dq[sl] += g[0]
            dks[j][:, :upto] += g[1]
            dvs[j][:, :upto] += g[2]
    return dks, dvs


class _DistributedDilatedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan, spans, backend, causal, scale, stats):
        calls, parts, lses, gathered = [], [], [], []
        for sp in spans:
            ks, vs, stacked = _gather_span(sp, k, v, stats)
            gathered.append((ks, vs, stacked))
            c, o, lse = _span_forward(sp, q, ks, vs, stacked, backend, causal, scale)
            calls += c
            parts += o
            lses += lse
        # spanning and local branches mixed by one combine, straight into the output dtype
        out, lse_rows = forward_calls(q, k, v, plan, backend, causal, scale, None, extra=(calls, parts, lses))
        del calls, parts, lses
        ctx.save_for_backward(q, k, v, out, lse_rows)
        ctx.gathered, ctx.cfg = gathered, (plan, spans, backend, causal, scale, stats)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse_rows = ctx.saved_tensors
        plan, spans, backend, causal, scale, stats = ctx.cfg
        dout = dout.contiguous()
        dq, dk, dv = backward_calls(plan, backend, causal, scale, q, k, v, out, lse_rows, dout, torch.float32)
        b, d = q.shape[0], q.shape[3]
        for sp, (ks, vs, stacked) in zip(spans, ctx.gathered):
            dks, dvs = _span_backward(sp, q, out, lse_rows, dout, ks, vs, stacked, dq, backend, causal, scale)
            to_member = [[] for _ in range(sp.span)]
            for grads in (dks, dvs):  # the layout each member sent: K rows of every offset, then V rows
                for (_, _, sizes, _), g in zip(sp.offsets, grads):
                    i = 0
                    for m in range(sp.span):
                        to_member[m].append(g[:, i:i + sizes[m]].reshape(b, -1))
                        i += sizes[m]
            lens = [sp.member_len(m, d) for m in range(sp.span)]
            mine = _reduce_scatter_flat([torch.cat(t, 1) for t in to_member], sp.group, lens, sp.me, stats)
            i = 0
            for acc_t in (dk, dv):
                for off, rows, sizes, kvidx in sp.offsets:
                    cnt = sizes[sp.me] * len(kvidx) * d
                    acc_t[:, rows].index_add_(2, kvidx, mine[:, i:i + cnt].view(b, sizes[sp.me], len(kvidx), d))
                    i += cnt
        ctx.gathered = None
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None


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
        self._layouts: dict = {}
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

    def _layout(self, q, k, rank, p, in_place):
        b, n, h, d = q.shape
        key = (b, n, h, k.shape[2], str(q.device), in_place)
        if key not in self._layouts:
            big_n = n * p
            local, spans = [], []
            for w, r in zip(self.segment_lengths, self.dilation_rates):
                w = min(w, big_n)
                if n % w == 0:
                    local.append((w, r))
                elif w % n == 0:
                    spans.append(_Span(w, r, rank, n, h, h // k.shape[2], self._segment_group(w // n, rank, p),
                                       q.device))
                else:
                    raise ValueError(
                        f"segment length {w} and the per-rank shard length {n} (N={big_n} over {p} ranks) must "
                        "divide one another: choose segment_lengths that are multiples or divisors of N / world_size")
            plan = plan_for(q, k, [w for w, _ in local], [r for _, r in local], in_place)
            self._layouts[key] = (plan, spans)
        return self._layouts[key]

    def forward(self, q, k, v):
        check_qkv(q, k, v)
        if not dist.is_initialized():
            raise RuntimeError("DistributedDilatedAttention needs torch.distributed initialised")
        rank, p = dist.get_rank(self.group), dist.get_world_size(self.group)
        impl = get_backend(self.backend, q, k, self.causal)
        plan, spans = self._layout(q, k, rank, p, impl.reads_strided_rows(q, k, self.causal))
        scale = default_scale(q.shape[-1], self.scale)
        return _DistributedDilatedFunction.apply(q, k, v, plan, spans, impl, self.causal, scale, self.stats)
