"""LongNet's sequence-parallel dilated attention.

Each rank holds a contiguous shard of ``n = N/P`` positions. For a branch ``(w, r)`` with
``w' = min(w, N)``:

* if ``n % w' == 0`` its segments lie inside shards: the branch runs locally, no communication,
  through the same kernel calls as :class:`dilated.ImprovedDilatedAttention`;
* if ``w' % n == 0`` (and ``N % w' == 0``) a segment spans ``w'/n`` ranks: each rank selects its *dilated* rows of K/V
  for every head offset (``n/r`` rows per offset) and the ranks of the segment exchange them in
  one all-gather per branch (backward: one reduce-scatter of their gradients; on gloo, which has
  no reduce-scatter, an all-reduce and a slice). Communication per rank is ``(w'/n) * n/r`` rows
  per offset and branch, bounded by the schedule, not by N. Causal: a rank's queries see the
  gathered keys of earlier ranks and its own keys causally, which is bottom-right causal
  attention over ``[earlier ranks, own]``;
* otherwise (segments cross shard boundaries at any offset, or a clipped last segment spans
  ranks: any schedule, any world size) every rank sends its dilated K/V rows of the branch to
  every other (one all-gather over the group; backward one reduce-scatter) and computes its
  queries of each segment it touches against that segment's rows: ``N/r`` rows per offset moved
  per rank, more than the aligned cases, so schedules that line up with the shards are faster.

All branches, local and spanning, are mixed by log-sum-exp (LongNet eq. 9-10) in one
:func:`dilated.longnet.rows.combine`, straight into the output dtype;
backward is a custom autograd Function in which every kernel backward gets the *merged* output
and lse, which is the exact gradient of the mixture. The result equals ``DilatedAttention`` on
the gathered sequence, forward and backward. A rank whose computation fails runs the call's
remaining collectives before it raises, so the other ranks finish the call instead of waiting.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .._checks import acc_dtype, check_causal, check_qkv, check_scale, check_schedule, dense_rows
from ..backends import get_backend
from ..backends.graph_shapes import one_operation
from .agreement import AgreedSignatures, signature, validate_on_all_ranks
from .sharding import CommStats, nccl_group
from ..dense import AttentionSpec, attention_backward, attention_forward, default_scale
from ..longnet.dilated_calls import backward_calls, forward_calls
from ..longnet.pattern_cache import PatternCache
from ..longnet.plan import KernelCall, plan_for
from .crossing_segments import CrossingSegments, Saved as _Saved, crossing_backward, crossing_forward


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
        # the kernel calls, each a batch of offsets with rows here: all in one call where they are
        # alike (rows per member, heads), else one call per offset
        here = [j for j, (_, _, sizes, _) in enumerate(self.offsets) if sizes[self.me]]
        alike = len({(tuple(sizes), len(kvidx)) for _, _, sizes, kvidx in self.offsets}) == 1
        self.batched = alike and len(here) == len(self.offsets)
        self.groups = [here] if self.batched else [[j] for j in here]

    def member_len(self, m, d, b=1):
        """Elements member ``m`` contributes: K and V rows of every offset."""
        return sum(2 * sizes[m] * len(kvidx) * d for _, _, sizes, kvidx in self.offsets) * b

    def stacked(self, x, group):
        """``x``'s (``[B, n, H, ...]``) rows of the offsets in ``group`` as one kernel batch,
        ``[B * len(group), rows, h', ...]`` (a view for one offset, else one copy)."""
        rows = [x[:, self.offsets[j][1], self.offsets[j][0]::self.r] for j in group]
        return (rows[0].unsqueeze(1) if len(rows) == 1 else torch.stack(rows, 1)).flatten(0, 1)

    def upto(self, group, causal):
        """Gathered keys a call of ``group`` sees: causal, those of earlier members and its own."""
        sizes = self.offsets[group[0]][2]
        return sum(sizes[:self.me + 1]) if causal else sum(sizes)


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
        if nccl_group(group):
            mine = torch.empty_like(padded[0])
            dist.reduce_scatter(mine, padded, group=group)
        else:  # gloo has no reduce_scatter
            full = torch.stack(padded)
            dist.all_reduce(full, group=group)
            mine = full[me]
    stats.sent(mine.numel() * mine.element_size() * (len(lens) - 1), collective=True)
    return mine[:, :lens[me]]


def _gather_span(sp: _Span, k, v, stats):
    """The gathered K and V of each of ``sp.groups``, ``[B, len(group), rows, h', D]``: the rows of
    every member of the segment. A member sends its K rows of every offset, then its V rows."""
    b, d = k.shape[0], k.shape[3]
    mine = [t[:, rows].index_select(2, kvidx).reshape(b, -1) for t in (k, v) for _, rows, _, kvidx in sp.offsets]
    lens = [sp.member_len(m, d) for m in range(sp.span)]
    parts = _all_gather_flat(torch.cat(mine, 1), sp.group, lens, stats)
    if sp.batched:
        sizes, h_off = sp.offsets[0][2], len(sp.offsets[0][3])
        kv = [part.view(b, 2, len(sp.offsets), sizes[m], h_off, d) for m, part in enumerate(parts)]
        return [tuple(torch.cat([x[:, t] for x in kv], 2) for t in range(2))]
    per = [[[] for _ in sp.offsets] for _ in range(2)]
    for m, part in enumerate(parts):
        i = 0
        for t in range(2):
            for j, (_, _, sizes, kvidx) in enumerate(sp.offsets):
                cnt = sizes[m] * len(kvidx) * d
                per[t][j].append(part[:, i:i + cnt].view(b, sizes[m], len(kvidx), d))
                i += cnt
    return [tuple(torch.cat(per[t][j], 1).unsqueeze(1) for t in range(2)) for (j,) in sp.groups]


def _span_forward(sp: _Span, q, kv, spec: AttentionSpec):
    """The span's kernel calls: ``(calls, outputs, lses)``, one per offset with rows here (views of
    the outputs of its group's call)."""
    b, n = q.shape[:2]
    calls, outs, lses = [], [], []
    for group, (ks, vs) in zip(sp.groups, kv):
        upto = sp.upto(group, spec.causal)
        o, lse = attention_forward(spec.backend, sp.stacked(q, group), ks.flatten(0, 1)[:, :upto],
                                   vs.flatten(0, 1)[:, :upto], spec.causal, spec.scale)
        calls += [KernelCall(0, 1, n, sp.r, "offset", sp.offsets[j][0], row_offset=sp.offsets[j][1].start)
                  for j in group]
        outs += o.unflatten(0, (b, -1)).unbind(1)
        lses += lse.unflatten(0, (b, -1)).unbind(1)
    return calls, outs, lses


def _span_backward(sp: _Span, spec: AttentionSpec, saved: _Saved, kv, dq):
    """Add the span's dq into ``dq``; return its dK, dV per offset (dq's dtype, all gathered rows)."""
    q, out, lse_rows, dout = saved
    b, d = q.shape[0], q.shape[3]
    dks = [q.new_zeros(b, sum(sizes), len(kvidx), d, dtype=dq.dtype) for _, _, sizes, kvidx in sp.offsets]
    dvs = [torch.zeros_like(x) for x in dks]
    for group, (ks, vs) in zip(sp.groups, kv):
        upto = sp.upto(group, spec.causal)
        lse = sp.stacked(lse_rows, group).transpose(1, 2).contiguous()  # [B', h', rows]
        g = attention_backward(spec.backend, sp.stacked(dout, group), sp.stacked(q, group),
                               ks.flatten(0, 1)[:, :upto], vs.flatten(0, 1)[:, :upto], sp.stacked(out, group), lse,
                               spec.causal, spec.scale)
        dqs, dkg, dvg = (x.unflatten(0, (b, -1)) for x in g)
        for i, j in enumerate(group):
            off, rows = sp.offsets[j][:2]
            dq[:, rows, off::sp.r] += dqs[:, i]
            dks[j][:, :upto] += dkg[:, i]
            dvs[j][:, :upto] += dvg[:, i]
    return dks, dvs


def _span_parts(sp: _Span, spec: AttentionSpec, saved: _Saved, kv, dq):
    """The span's dK/dV, one flat ``[B, L_m]`` part per member in the layout it sent (K rows of
    every offset, then V rows); adds the span's dq into ``dq``."""
    b = saved.q.shape[0]
    dks, dvs = (_span_backward if isinstance(sp, _Span) else crossing_backward)(sp, spec, saved, kv, dq)
    to_member = [[] for _ in range(sp.span)]
    for grads in (dks, dvs):
        for (_, _, sizes, _), g in zip(sp.offsets, grads):
            i = 0
            for m in range(sp.span):
                to_member[m].append(g[:, i:i + sizes[m]].reshape(b, -1))
                i += sizes[m]
    return [torch.cat(t, 1) for t in to_member]


class _DistributedDilatedFunction(torch.autograd.Function):
    @staticmethod
    @one_operation()
    def forward(ctx, q, k, v, plan, spans, spec, stats):
        calls, parts, lses, gathered = [], [], [], []
        failure = None  # a failed computation here: the remaining collectives still run first
        for sp in spans:
            kv = _gather_span(sp, k, v, stats)
            gathered.append(kv)
            if failure is None:
                try:
                    c, o, lse = (_span_forward if isinstance(sp, _Span) else crossing_forward)(sp, q, kv, spec)
                    calls += c
                    parts += o
                    lses += lse
                except Exception as e:  # noqa: BLE001 - raised once every span's all-gather has run
                    failure = e
        if failure is not None:
            raise failure
        # spanning and local branches mixed by one combine, straight into the output dtype
        out, lse_rows = forward_calls((q, k, v), plan, spec, extra=(calls, parts, lses))
        del calls, parts, lses
        ctx.save_for_backward(q, k, v, out, lse_rows)
        ctx.gathered, ctx.plan, ctx.spans, ctx.spec, ctx.stats = gathered, plan, spans, spec, stats
        return out

    @staticmethod
    @one_operation()
    def backward(ctx, dout):
        q, k, v, out, lse_rows = ctx.saved_tensors
        plan, spans, spec, stats = ctx.plan, ctx.spans, ctx.spec, ctx.stats
        dout = dout.contiguous()
        failure = None  # a failed computation here: every span's reduce-scatter still runs, with zeros
        try:
            dq, dk, dv = backward_calls((q, k, v), plan, spec, out, lse_rows, dout, dtype=acc_dtype(q.dtype))
        except Exception as e:  # noqa: BLE001 - raised once every collective has run
            failure = e
        b, d = q.shape[0], q.shape[3]
        for sp, kv in zip(spans, ctx.gathered):
            lens = [sp.member_len(m, d) for m in range(sp.span)]
            parts = None
            if failure is None:
                try:
                    parts = _span_parts(sp, spec, _Saved(q, out, lse_rows, dout), kv, dq)
                except Exception as e:  # noqa: BLE001 - raised once every collective has run
                    failure = e
            if parts is None:
                parts = [q.new_zeros(b, n, dtype=acc_dtype(q.dtype)) for n in lens]
            mine = _reduce_scatter_flat(parts, sp.group, lens, sp.me, stats)
            if failure is not None:
                continue
            i = 0
            for acc_t in (dk, dv):
                for off, rows, sizes, kvidx in sp.offsets:
                    cnt = sizes[sp.me] * len(kvidx) * d
                    grad = mine[:, i:i + cnt].view(b, sizes[sp.me], len(kvidx), d)
                    if isinstance(rows, slice):  # a view: added in place
                        acc_t[:, rows].index_add_(2, kvidx, grad)
                    else:  # an index of rows (an irregular branch)
                        acc_t.index_add_(1, rows, grad.new_zeros(b, len(rows), acc_t.shape[2], d).index_add_(
                            2, kvidx, grad))
                    i += cnt
        if failure is not None:
            ctx.gathered = None
            raise failure
        ctx.gathered = None
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None


class DistributedDilatedAttention(nn.Module):
    """Sequence-parallel dilated attention; ``forward(q, k, v)`` on contiguous shards ``[B, N/P, H, D]``
    returns this rank's part ``[B, N/P, H, D]`` of :func:`dilated.dilated_attention` over the global
    sequence, differentiable.

    Args:
        segment_lengths, dilation_rates, causal, scale, backend: as :func:`dilated.dilated_attention`
            (any schedule; segments may span ranks).
        group: the process group (default: the world); any world size.
        measure_comm: also time the compute stream's waits on the collectives.

    ``self.stats`` (a :class:`dilated.parallel.sharding.CommStats`) counts collectives and bytes sent;
    ``measure_comm=True`` also times the compute stream's waits on them.
    """

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous part ``[B, N/P, ...]`` of a global ``[B, N, ...]`` tensor."""
        from .sharding import shard

        return shard(x, group=self.group, layout="contiguous")

    def unshard(self, x_local: torch.Tensor) -> torch.Tensor:
        """The global tensor from every rank's part (an all-gather)."""
        from .sharding import unshard

        return unshard(x_local, group=self.group, layout="contiguous")

    def __init__(self, segment_lengths, dilation_rates, *, causal=False, scale=None, backend="auto", group=None,
                 measure_comm: bool = False):
        super().__init__()
        self.segment_lengths, self.dilation_rates = check_schedule(segment_lengths, dilation_rates)
        check_causal(causal)
        check_scale(scale)
        self.causal, self.scale, self.backend, self.group = causal, scale, backend, group
        self._agreed = AgreedSignatures()  # input signatures all ranks agreed on
        self._groups: dict[int, list] = {}
        self._layouts = PatternCache()  # per input shape: the local plan and the segments across shards
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

        def make():
            big_n = n * p
            local, spans = [], []
            for w, r in zip(self.segment_lengths, self.dilation_rates):
                w = min(w, big_n)
                if n % w == 0:
                    local.append((w, r))
                elif w % n == 0 and big_n % w == 0:
                    spans.append(_Span(w, r, rank, n, h, h // k.shape[2], self._segment_group(w // n, rank, p),
                                       q.device))
                else:  # segments across shard boundaries at any offset: every rank's rows to every rank
                    spans.append(CrossingSegments(w, r, (rank, n, p), (h, h // k.shape[2]), self.group, q.device))
            return plan_for(q, k, [w for w, _ in local], [r for _, r in local], in_place), spans

        return self._layouts.get(key, make)

    def _validate(self, q, k, v):
        check_qkv(q, k, v)
        if k.shape[1] != q.shape[1]:
            raise ValueError(f"q and k/v shards must have one length, got {q.shape[1]} and {k.shape[1]}")
        if v.shape[3] != q.shape[3]:
            raise ValueError(f"dilated attention needs v's head_dim ({v.shape[3]}) equal to q's ({q.shape[3]})")
        scale = default_scale(q.shape[-1], self.scale)
        impl = get_backend(self.backend, q, k, self.causal)
        fields = signature(q, k, v, causal=self.causal, scale=scale, segment_lengths=list(self.segment_lengths),
                           dilation_rates=list(self.dilation_rates))
        return AttentionSpec(impl, self.causal, scale), fields

    def forward(self, q, k, v):
        if not dist.is_initialized():
            raise RuntimeError("DistributedDilatedAttention needs torch.distributed initialised")
        spec = validate_on_all_ranks(self.group, self._agreed, "DistributedDilatedAttention",
                                            lambda: self._validate(q, k, v))
        q, k, v = dense_rows(q), dense_rows(k), dense_rows(v)
        rank, p = dist.get_rank(self.group), dist.get_world_size(self.group)
        plan, spans = self._layout(q, k, rank, p, spec.backend.reads_strided_rows(q, k, self.causal))
        return _DistributedDilatedFunction.apply(q, k, v, plan, spans, spec, self.stats)
