"""Each strategy's schedule, as the code runs it, turned into per-rank time, exposed communication
and memory on a calibrated GPU and network.

The model reads the schedule from the library where it can, so that a change to a strategy changes
its prediction: the ring's kernel calls per step (:func:`dilated.parallel.ring_attention.step_calls`),
the document layout and each rank's local documents, crossing rows and rectangles
(:class:`~dilated.DocumentLayout`, :func:`dilated.parallel.document_attention.rank_plan`), Ulysses'
kv heads (:func:`dilated.parallel.ulysses_attention.kv_heads_for`), the local documents' calls
(:mod:`dilated.bench.planner.kernel_model`). What it adds is timing:

* ring steps: a rank computes step ``s`` once it has step ``s``'s K/V block; with overlap the block
  for ``s + 1`` moves meanwhile (copy-engine pulls: issued at the start of step ``s``, independent of
  the owner's progress; send/recv: once the sender has started the step too); the backward passes
  each block's dK/dV (float32) on after its step, which the next rank waits for;
* document strategies: the crossing rows' all-gather (or relay) runs while the local documents
  compute; the rectangles of crossing documents follow; in backward the gradient rows' reduce-scatter
  runs while the local documents' backward computes;
* Ulysses: its all-to-alls pipelined with attention by head groups
  (:mod:`dilated.parallel.head_groups`): the first group's inputs and the last group's output are
  exposed, the rest overlaps the other groups' attention; packed documents that stay where they lie
  (:mod:`dilated.parallel.local_documents`, as the module decides) attend on all of their rank's
  heads in two parts, the first while the crossing documents' inputs move, the second while their
  output moves back;
* the hybrid: Ulysses inside each row of the grid, its ring across rows on each head group; on the
  documents' layout with every document whole within a rank's part, each rank's own documents only;
* decode: each rank's read of its cache shard, then one all-gather of ``B x Tq x H x (D + 1)``
  float32 numbers.

A collective or a ring makes the slowest rank everyone's time: a prediction is the slowest rank's,
its kernels at the pace of the calibration's slowest GPU where several ranks run at once
(:meth:`~dilated.bench.planner.calibration.Calibration.slowest_rank_pace`). The host is not
modelled: its work overlaps the GPU's, and a prediction is at least the calibration's timed call of
the strategy where that call was of the same kind, no larger, and slower than modelled
(:meth:`Model.floor_ms`: a small call at the host's pace).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ...backends.varlen import varlen_pair_costs
from ...parallel.document_attention import rank_plan
from ...parallel.document_groups import document_groups_for, group_spans, groups_to_use
from ...parallel.document_layout import DocumentLayout
from ...parallel.ring_attention import step_calls
from ...parallel.head_groups import head_groups_for, kv_group_of
from ...parallel.local_documents import (contiguous_ranges, grid_local_documents, local_documents, spans_cu,
                                         spans_rows)
from ...parallel.row_documents import plans_for
from ...parallel.ulysses_attention import kv_heads_for
from ..documents import attended_pairs, cu_seqlens_of
from ..flops import MODE_FACTOR
from ..strategies import HYBRID_HEAD_GROUPS, ROW_GROUPS, ULYSSES_HEAD_GROUPS, document_groups_of, local_documents_of
from ..workload import ulysses_size_for
from .calibration import Curve, log_interp
from .kernel_model import ELEM, KernelModel
from .network import Network

ACC = 4  # float32 accumulators and gradient messages


@dataclass(frozen=True)
class Problem:
    """What to run: ``mode`` ``"fwd"``, ``"fwd_bwd"`` or ``"decode"`` (``seq_len``: cached tokens,
    ``query_tokens`` per step; ``cuda_graph``: each step replayed from a CUDA graph, else called from
    Python); ``documents``: a ``--doc-lengths`` spec, or ``cu`` its cumulative lengths."""

    seq_len: int
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool = True
    mode: str = "fwd_bwd"
    batch: int = 1
    documents: str | None = None
    cu: tuple | None = None
    query_tokens: int = 1
    cuda_graph: bool = False

    @classmethod
    def timed(cls, point) -> "Problem":
        """The problem of a calibration's timed strategy call
        (:class:`~dilated.bench.planner.calibration.StrategyPoint`)."""
        return cls(point.seq_len, point.heads, point.kv_heads, point.head_dim, point.causal, point.mode,
                   documents=point.documents)

    def cu_seqlens(self) -> tuple:
        if self.cu is not None:
            return tuple(self.cu)
        if self.documents:
            return cu_seqlens_of(self.documents, self.seq_len)
        return (0, self.seq_len)

    @property
    def has_documents(self) -> bool:
        return len(self.cu_seqlens()) > 2

    def flops(self) -> float:
        """Useful FLOPs (within documents; backward 2.5x forward), as the harness counts them."""
        if self.mode == "decode":
            return 4.0 * self.batch * self.query_tokens * self.seq_len * self.heads * self.head_dim
        pairs = attended_pairs(self.cu_seqlens(), self.causal)
        return 4.0 * self.batch * pairs * self.heads * self.head_dim * MODE_FACTOR[self.mode]

    def describe(self) -> str:
        docs = f", documents {self.documents}" if self.documents else ""
        what = (f"decode over {self.seq_len} cached tokens, {self.query_tokens} query token(s)" if self.mode == "decode"
                else f"N={self.seq_len}, {'causal' if self.causal else 'non-causal'} {self.mode}{docs}")
        return f"{what}; batch {self.batch}, heads {self.heads}/{self.kv_heads}/{self.head_dim}"


@dataclass
class Prediction:
    """One strategy on one grid: per-rank time (the slowest rank's), its kernels' time, the part of
    its communication nothing hides, bytes each rank sends, peak memory per rank (an estimate of the
    tensors the schedule holds, not of the allocator), and why it cannot run, if it cannot."""

    strategy: str
    ranks: int
    grid: tuple = ()
    time_ms: float = math.nan
    compute_ms: float = math.nan
    exposed_ms: float = math.nan
    bytes_sent: float = 0.0
    memory_gib: float = math.nan
    flops: float = 0.0
    reason: str | None = None
    notes: list = field(default_factory=list)
    floor_ms: float = 0.0  # time_ms is at least this: the strategy's calibrated call where it bounds this one

    @property
    def supported(self) -> bool:
        return self.reason is None

    @property
    def tflops_per_gpu(self) -> float:
        if not self.supported or self.time_ms <= 0:
            return math.nan
        return self.flops / (self.time_ms * 1e-3) / self.ranks / 1e12

    @property
    def exposed_fraction(self) -> float:
        return self.exposed_ms / self.time_ms if self.supported and self.time_ms > 0 else math.nan


@dataclass
class _Timeline:
    time: float = 0.0  # slowest rank's wall time (ms)
    compute: float = 0.0  # the most kernel time of any rank (what no schedule can hide)
    sent: float = 0.0  # bytes a rank sends
    extra_mem: float = 0.0  # bytes the schedule holds beyond the shards (per rank)


def _pipeline(inputs: list[float], computes: list[float], outputs: list[float]) -> float:
    """The end of a head-group pipeline (ms): one communication stream runs every group's input
    exchange from time 0, then each group's output exchange once that group is done; one compute
    stream runs group ``g`` once its inputs have arrived and group ``g - 1`` is done."""
    comm, ready = 0.0, []
    for x in inputs:
        comm += x
        ready.append(comm)
    t = 0.0
    for r, c, o in zip(ready, computes, outputs):
        t = max(t, r) + c
        comm = max(comm, t) + o
    return comm


def _crossing_bytes(t: int, keys: int, b: int, h: int, hkv: int, d: int, mode: str) -> float:
    """What a rank's rectangles of crossing documents hold besides the gathered rows
    (:class:`dilated.parallel.document_attention.DocumentCall`): their ``t`` query rows taken out, the
    ``keys`` key and value rows taken from the gathered buffer, their output and float32 lse; backward
    the keys and values again, the rows of the output gradient, q and out taken out, their gradients
    and the kernel's float32 dq accumulator."""
    q_row, kv_row = b * h * d * ELEM, b * hkv * 2 * d * ELEM
    held = t * (2 * q_row + b * h * ACC) + keys * kv_row
    if mode == "fwd_bwd":
        held = t * (4 * q_row + q_row * ACC / ELEM + b * h * ACC) + 2 * keys * kv_row
    return float(held)


def _own_documents_ms(kernels: KernelModel, kept, rank: int, b: int, h: int, hkv: int, d: int, causal: bool,
                      mode: str, parts: bool = True) -> list[float]:
    """A rank's documents attended where they lie (``kept``, a
    :class:`~dilated.parallel.local_documents.LocalDocuments`, or None), per part of them as the
    pipeline runs them beside exchanges (:meth:`~dilated.parallel.local_documents.LocalDocuments.part_spans`,
    two parts at most: ``[]`` where none; ``parts=False``: all in one, where nothing is exchanged):
    its calls, and where its rows are not one run, those rows taken out of the shard and their
    results put back (the calibrated cost per element of the documents path's gathers and scatters)."""
    if kept is None or not kept.spans[rank]:
        return []
    out = []
    for spans in kept.part_spans(rank) if parts else (kept.spans[rank],):
        cu = spans_cu(spans)
        ms = kernels.documents_ms(cu, b, h, hkv, d, causal, mode)
        if not isinstance(spans_rows(spans), slice):
            ms += kernels.documents_extra_ms(0, b * cu[-1], h, hkv, d, causal, mode)
        out.append(ms)
    return out


def _beside(own: list[float], ins: list[float], attends: list[float], outs: list[float]) -> float:
    """The end of a pipeline of exchanged groups (:func:`_pipeline`: ``ins``, ``attends``, ``outs``)
    with a rank's own documents' parts (``own``, two at most) beside it: the first before the groups,
    beside their inputs, the second after them, beside the last group's output."""
    first, second = (own + [0.0, 0.0])[:2]
    return _pipeline([0.0, *ins, 0.0], [first, *attends, second], [0.0, *outs, 0.0])


def _local_bytes(kept, rank: int, b: int, h: int, hkv: int, d: int, mode: str) -> float:
    """What a rank's documents attended where they lie (``kept``, a
    :class:`~dilated.parallel.local_documents.LocalDocuments`) hold: their q, k, v rows taken out of
    the shard (copies unless one run) and their output; backward also their output gradient's rows
    and their q, k, v gradients, before they are put back."""
    if kept is None or not kept.spans[rank]:
        return 0.0
    rows = kept.local_rows(rank)
    run = isinstance(rows, slice)
    n = rows.stop - rows.start if run else sum(rows[1])
    qkv, out = (h + 2 * hkv) * d * ELEM, h * d * ELEM
    per_row = (0 if run else qkv) + out
    if mode != "fwd":
        per_row += (0 if run else out) + qkv
    return b * n * per_row


def _gib(nbytes: float) -> float:
    return nbytes / 2**30


class Model:
    """Predictions on one calibrated GPU type and network."""

    def __init__(self, kernels: KernelModel, network: Network):
        self.kernels, self.network = kernels, network
        self.pace = kernels.calibration.slowest_rank_pace()
        self._floors = {}  # (strategy timed, mode, causal, documents) -> its time where the model's is less

    def floor_ms(self, strategy: str, problem: Problem, world: int) -> float:
        """The least a call of ``strategy`` on ``problem`` over ``world`` ranks takes by the calibration's
        timed call of it (or of the strategy it varies: :func:`measured_as`), where that call was
        slower than the model's prediction of it and of the same kind (mode, causal, packed documents
        or not) on no more ranks with no more work per rank (rows x heads): its time; else 0.

        The model counts kernels, bytes and waits, not the host: a small call whose host work takes
        longer than its kernels runs at the host's pace, and the harness's calls overlap host work
        with the GPU's, so a larger call of the same kind hides it (and takes no less)."""
        name = measured_as(strategy)
        points = [x for x in self.kernels.calibration.strategies if x.strategy == name and x.mode == problem.mode
                  and x.causal == problem.causal and x.ranks <= world
                  and (x.documents is None) == (not problem.has_documents)
                  and x.seq_len * x.heads // x.ranks <= problem.seq_len * problem.heads // world]
        if not points:
            return 0.0
        x = points[0]
        if (name, x.mode, x.causal, x.documents) not in self._floors:
            calibrated = Problem.timed(x)
            grid = None
            if name.startswith("hybrid"):
                u = ulysses_size_for(x.ranks, x.heads)
                grid = (u, x.ranks // u) if u else None
            pace, self.kernels.pace = self.kernels.pace, self.pace
            try:
                modelled = self._timeline(name, calibrated, x.ranks, grid).time
            except (NotImplementedError, ValueError):
                modelled = math.inf
            finally:
                self.kernels.pace = pace
            self._floors[name, x.mode, x.causal, x.documents] = x.ms if x.ms > modelled else 0.0
        return self._floors[name, x.mode, x.causal, x.documents]

    # -- kernel time of one rank's calls --------------------------------------------------------
    def _calls_ms(self, calls, problem: Problem, heads: int, kv_heads: int, mode: str) -> float:
        km, b, d = self.kernels, problem.batch, problem.head_dim
        ms = 0.0
        for qs, ks, causal, docs in calls:
            lq, lk = qs.stop - qs.start, ks.stop - ks.start
            if docs is not None:
                ms += km.documents_ms(docs, b, heads, kv_heads, d, causal, mode)
            else:
                ms += km.call_ms(lq, lk, b, heads, kv_heads, d, causal, mode)
        return ms

    def single_device(self, problem: Problem) -> Prediction:
        """The whole problem on one GPU (the distributed rows' baseline)."""
        modes = ("fwd", "bwd") if problem.mode == "fwd_bwd" else ("fwd",)
        self.kernels.peak_bytes, self.kernels.pace = 0.0, 1.0
        ms = sum(self.kernels.documents_ms(problem.cu_seqlens(), problem.batch, problem.heads, problem.kv_heads,
                                           problem.head_dim, problem.causal, m) for m in modes)
        memory = self._memory(problem, 1, self.kernels.peak_bytes)
        return Prediction("single_device", 1, (), ms, ms, 0.0, 0.0, memory, problem.flops())

    # -- the ring ---------------------------------------------------------------------------------
    def _ring(self, problem: Problem, ranks: list[int], heads: int, kv_heads: int, layout: str, overlap: bool,
              transport: str) -> _Timeline:
        p, n_all = len(ranks), problem.seq_len
        n = n_all // p
        cu = problem.cu_seqlens() if problem.has_documents else None
        b, d = problem.batch, problem.head_dim
        row_bytes = b * kv_heads * d * 2 * ELEM  # one row of k and v
        calls = [[step_calls(s, r, p, n, problem.causal, layout, cu) for s in range(p)] for r in range(p)]

        def kv_rows(r, s):  # rows of the block a step needs moved to it
            if s == 0:
                return 0
            if transport == "p2p":
                return n
            cs = calls[r][s]
            return 0 if not cs else max(c[1].stop for c in cs) - min(c[1].start for c in cs)

        net = self.network
        move = {m: net.p2p_ms(m * row_bytes, ranks, transport) for m in {kv_rows(r, s) for r in range(p) for s in range(p)}}
        fwd = [[self._calls_ms(calls[r][s], problem, heads, kv_heads, "fwd") for s in range(p)] for r in range(p)]
        end_f, compute_f = self._run_steps(fwd, [[move[kv_rows(r, s)] for s in range(p)] for r in range(p)], overlap,
                                           coupled=transport == "p2p")
        sent = sum(kv_rows(0, s) for s in range(1, p)) * row_bytes
        # two K/V blocks in flight; pulled by the copy engines, the shard's K/V published in symmetric memory too
        published = n * row_bytes if transport == "copy_engine" and p > 1 else 0
        t = _Timeline(max(end_f), max(compute_f), sent, 2 * n * row_bytes + published)
        if problem.mode == "fwd_bwd":
            bwd = [[self._calls_ms(calls[r][s], problem, heads, kv_heads, "bwd") for s in range(p)] for r in range(p)]
            dkv = net.p2p_ms(n * row_bytes * ACC / ELEM, ranks) if p > 1 else 0.0
            end_b, compute_b = self._run_backward(bwd, [[move[kv_rows(r, s)] for s in range(p)] for r in range(p)], dkv)
            t.time += max(end_b)
            t.compute = max(f + b for f, b in zip(compute_f, compute_b))
            t.sent += sent + (p * n * row_bytes * ACC / ELEM if p > 1 else 0)
            t.extra_mem += 2 * n * row_bytes * ACC / ELEM + n * b * heads * d * ACC  # dK/dV in flight, dq accumulator
        return t

    @staticmethod
    def _run_steps(compute, move, overlap: bool, coupled: bool):
        """Per-rank end times of ring steps: step ``s`` starts when step ``s - 1`` ended and its block
        arrived. ``move[r][s]``: ms to bring rank ``r`` step ``s``'s block; with overlap it is issued at
        the start of step ``s - 1`` (``coupled``: once the previous rank started that step too, as
        send/recv needs), else right before step ``s``."""
        p = len(compute)
        steps = len(compute[0])
        start = [0.0] * p
        end = [compute[r][0] for r in range(p)]
        for s in range(1, steps):
            new_start = []
            for r in range(p):
                issued = max(start[r], start[(r - 1) % p]) if coupled else start[r]
                if overlap:
                    new_start.append(max(end[r], issued + move[r][s]))
                else:
                    ready = max(end[r], end[(r - 1) % p]) if coupled else end[r]
                    new_start.append(ready + move[r][s])
            start = new_start
            end = [start[r] + compute[r][s] for r in range(p)]
        return end, [sum(c) for c in compute]

    @staticmethod
    def _run_backward(compute, move, dkv: float):
        """The ring's backward: step ``s`` of rank ``r`` needs its K/V block (as forward) and, to finish,
        the previous rank's dK/dV of step ``s - 1`` (``dkv`` ms after that rank finished it); the last
        dK/dV goes to its owner."""
        p, steps = len(compute), len(compute[0])
        end = [compute[r][0] for r in range(p)]
        start = [0.0] * p
        for s in range(1, steps):
            arrive = [end[(r - 1) % p] + dkv for r in range(p)]
            new_start = [max(end[r], start[r] + move[r][s]) for r in range(p)]
            end = [max(new_start[r] + compute[r][s], arrive[r]) for r in range(p)]
            start = new_start
        finish = [max(end[r], end[(r - 1) % p] + dkv) if p > 1 else end[r] for r in range(p)]
        return finish, [sum(c) for c in compute]

    # -- documents: a layout, local documents, crossing rows -------------------------------------
    def _pair_costs(self, problem: Problem) -> tuple:
        """The pair costs the modules' document layouts balance on the calibrated kernels: the varlen
        kernel's where documents go to one (:func:`dilated.backends.varlen.documents_pair_costs`)."""
        return varlen_pair_costs(self.kernels.calibration.varlen_kernel) if self.kernels.varlen_documents else (1, 1)

    def _balanced(self, problem: Problem, p: int) -> DocumentLayout:
        """The problem's documents over ``p`` ranks as the modules lay them out (:meth:`_pair_costs`)."""
        return DocumentLayout.balance(problem.cu_seqlens(), p, problem.causal, pair_costs=self._pair_costs(problem))

    def _documents(self, problem: Problem, ranks: list[int], heads: int, kv_heads: int, transport: str,
                   layout: DocumentLayout | None = None) -> _Timeline:
        """The documents strategy on ``ranks`` (``layout``: default the problem's documents balanced over
        them): local pieces beside the crossing rows' gather, then the rectangles, then (backward) the
        scatter of their key gradients."""
        p = len(ranks)
        layout = layout or self._balanced(problem, p)
        km, b, d, net = self.kernels, problem.batch, problem.head_dim, self.network
        plans = [rank_plan(layout, r) for r in range(p)]
        rows = plans[0].rows
        row_bytes = b * kv_heads * 2 * d * ELEM
        if transport == "ring":
            gather = net.relayed_ms(rows * row_bytes, ranks)
            scatter = net.relayed_ms(rows * row_bytes * ACC / ELEM, ranks)
        else:
            gather = net.all_gather_ms(rows * row_bytes, ranks)
            scatter = net.reduce_scatter_ms(p * rows * row_bytes * ACC / ELEM, ranks)
        times, computes = [], []
        for plan in plans:
            local = km.documents_ms(plan.local_cu, b, heads, kv_heads, d, problem.causal, "fwd")
            rect = km.rectangles_ms(plan.cu_q, plan.cu_k, b, heads, kv_heads, d, "fwd")
            t, c = max(local, gather) + rect, local + rect
            if problem.mode == "fwd_bwd":
                local_b = km.documents_ms(plan.local_cu, b, heads, kv_heads, d, problem.causal, "bwd")
                rect_b = km.rectangles_ms(plan.cu_q, plan.cu_k, b, heads, kv_heads, d, "bwd")
                t += rect_b + max(local_b, scatter)
                c += local_b + rect_b
            times.append(t)
            computes.append(c)
        sent = rows * row_bytes * (p - 1 if transport == "ring" else 1)
        extra = p * rows * row_bytes
        if problem.mode == "fwd_bwd":
            sent += rows * row_bytes * ACC / ELEM * (p - 1)
            extra += p * rows * row_bytes * ACC / ELEM
        extra += max(_crossing_bytes(plan.cu_q[-1], plan.cu_k[-1], b, heads, kv_heads, d, problem.mode)
                     for plan in plans)
        return _Timeline(max(times), max(computes), sent, extra)

    # -- Ulysses ----------------------------------------------------------------------------------
    def _by_head_groups(self, problem: Problem, ranks: list[int], heads: int, kv_heads: int, attend,
                        head_groups: int | str, attend_is_one_call: bool, rings: int = 1) -> _Timeline:
        """Ulysses' all-to-alls over ``ranks`` pipelined with ``attend(q_heads, kv_heads, mode)`` (a
        :class:`_Timeline` of one head group's attention over the whole sequence of ``ranks`` (of
        ``rings`` ring shards); ``attend_is_one_call``: a kernel call, not a ring) by ``head_groups`` (:func:`dilated.parallel.head_groups.head_groups_for`),
        as :func:`dilated.parallel.head_groups.attend_by_head_groups` runs them: every group's input
        exchange issued at once, a kv group's k and v in its first reader's; a group attends once its
        inputs have arrived and the previous group is done; its output (in backward: its dq, with a kv
        group's dk and dv after its last reader) goes back once it is done, one exchange at a time."""
        p = len(ranks)
        hkv = kv_heads_for(heads, kv_heads, p)
        one_call = problem.has_documents and self.kernels.varlen_documents and attend_is_one_call
        groups = head_groups_for(head_groups, heads // p, hkv // p, one_call)
        kv_of = kv_group_of(heads // p, hkv // p, groups)
        kv_groups = kv_of[-1] + 1
        n, net = problem.seq_len // (p * rings), self.network  # a rank's positions
        qb = problem.batch * n * heads * problem.head_dim * ELEM / groups  # one group's q (or out) per rank
        kvb = problem.batch * n * hkv * problem.head_dim * ELEM / kv_groups  # one kv group's k (or v)
        # a group's q alone, or with its kv group's k and v (one exchange: AllToAll carries them together)
        q_ms, qkv_ms = net.all_to_all_ms(qb, ranks), net.all_to_all_ms(qb + 2 * kvb, ranks)
        first = {j: kv_of.index(j) for j in set(kv_of)}
        last = {j: len(kv_of) - 1 - kv_of[::-1].index(j) for j in set(kv_of)}
        time = compute = sent = extra = 0.0
        modes = ("fwd", "bwd") if problem.mode == "fwd_bwd" else ("fwd",)
        for mode in modes:
            one = attend(heads // (p * groups), hkv // (p * kv_groups), mode)
            if mode == "fwd":
                inputs = [qkv_ms if first[kv_of[g]] == g else q_ms for g in range(groups)]
                outputs = [q_ms] * groups
            else:
                inputs = [q_ms] * groups
                outputs = [qkv_ms if last[kv_of[g]] == g else q_ms for g in range(groups)]
            time += _pipeline(inputs, [one.time] * groups, outputs)
            compute += groups * one.compute
            sent += one.sent * groups + (2 * qb * groups + 2 * kvb * kv_groups) * (p - 1) / p
            extra = max(extra, one.extra_mem)
        # the exchanged q, k, v and out beside the shards: a rank's share of the heads of its ranks' positions
        extra += 2 * problem.batch * n * (heads + hkv) * problem.head_dim * ELEM
        return _Timeline(time, compute, sent, extra)

    def _ulysses(self, problem: Problem, ranks: list[int], head_groups: int | str = "auto",
                 local: bool | str = False) -> _Timeline:
        cu, b, d = problem.cu_seqlens(), problem.batch, problem.head_dim
        kept = local_documents(local, cu, contiguous_ranges(problem.seq_len, len(ranks)), problem.causal) \
            if problem.has_documents else None
        if kept is not None:
            return self._ulysses_local(problem, ranks, kept)
        if local and problem.has_documents and head_groups in ("auto", 1) and groups_to_use(
                "auto", list(cu), problem.heads // len(ranks), d, problem.causal, self.kernels.varlen_documents):
            return self._ulysses_by_documents(problem, ranks)  # the module's defaults take document groups here

        def attend(heads, kv_heads, mode):
            ms = self.kernels.documents_ms(cu, b, heads, kv_heads, d, problem.causal, mode)
            return _Timeline(ms, ms)

        return self._by_head_groups(problem, ranks, problem.heads, problem.kv_heads, attend, head_groups, True)

    def _ulysses_local(self, problem: Problem, ranks: list[int], kept) -> _Timeline:
        """Ulysses with documents that stay where they lie (``kept``, a
        :class:`~dilated.parallel.local_documents.LocalDocuments`): each rank attends its own on all
        its heads in two parts (:func:`_beside`): the first while the exchanged documents' q, k and v
        rows move (one exchange), then the exchanged documents on its share of the heads, then
        the second while their output goes back (backward: the output gradient in, the q, k, v
        gradients back); an exchange takes the time of the rank with the most exchanged rows. Without
        exchanged documents nothing moves."""
        p, cu = len(ranks), list(problem.cu_seqlens())
        b, d, h = problem.batch, problem.head_dim, problem.heads
        moved = kept.exchanged
        hkv = kv_heads_for(h, problem.kv_heads, p) if moved else problem.kv_heads
        q_ms = qkv_ms = most = 0.0
        if moved:
            spans, cu_x = group_spans(cu, moved, p)
            most = max(sum(m for _, m in mine) for mine in spans)
            q_ms = self.network.all_to_all_ms(b * most * h * d * ELEM, ranks)
            qkv_ms = self.network.all_to_all_ms(b * most * (h + 2 * hkv) * d * ELEM, ranks)
        time = compute = sent = 0.0
        for mode in (("fwd", "bwd") if problem.mode == "fwd_bwd" else ("fwd",)):
            cross = self.kernels.documents_ms(cu_x, b, h // p, hkv // p, d, problem.causal, mode) if moved else 0.0
            ins, outs = (qkv_ms, q_ms) if mode == "fwd" else (q_ms, qkv_ms)
            times, computes = [], []
            for r in range(p):
                own = _own_documents_ms(self.kernels, kept, r, b, h, hkv, d, problem.causal, mode, bool(moved))
                times.append(_beside(own, [ins], [cross], [outs]) if moved else sum(own))
                computes.append(sum(own) + cross)
            time, compute = time + max(times), compute + max(computes)
            sent += 2 * b * most * (h + hkv) * d * ELEM * (p - 1) / p
        held = max(_local_bytes(kept, r, b, h, hkv, d, problem.mode) for r in range(p))
        return _Timeline(time, compute, sent, 2 * b * most * (h + hkv) * d * ELEM + held)

    def _ulysses_by_documents(self, problem: Problem, ranks: list[int]) -> _Timeline:
        """Ulysses pipelined by groups of packed documents (:mod:`dilated.parallel.document_groups`):
        group ``g``'s q, k and v rows in one exchange issued at once with every other group's, its
        documents attended on all of a rank's heads once they arrived, its output back after it
        (backward: its output gradient in, its q, k, v gradients back); an exchange takes the time
        of the rank with the most of the group's rows."""
        p, cu = len(ranks), list(problem.cu_seqlens())
        groups = document_groups_for(cu)
        if len(groups) < 2:
            return self._ulysses(problem, ranks, 1)
        b, d, h = problem.batch, problem.head_dim, problem.heads
        hkv = kv_heads_for(h, problem.kv_heads, p)
        net, n = self.network, problem.seq_len // p
        time = compute = sent = 0.0
        per_group = []
        for docs in groups:
            spans, cu_g = group_spans(cu, docs, p)
            rows = [sum(m for _, m in mine) for mine in spans]
            most = max(rows)
            q_ms = net.all_to_all_ms(b * most * h * d * ELEM, ranks)
            qkv_ms = net.all_to_all_ms(b * most * (h + 2 * hkv) * d * ELEM, ranks)
            per_group.append((cu_g, q_ms, qkv_ms, sum(rows)))
        modes = ("fwd", "bwd") if problem.mode == "fwd_bwd" else ("fwd",)
        for mode in modes:
            computes = [self.kernels.documents_ms(cu_g, b, h // p, hkv // p, d, problem.causal, mode)
                        for cu_g, *_ in per_group]
            if mode == "fwd":
                inputs, outputs = [qkv for _, _, qkv, _ in per_group], [q for _, q, _, _ in per_group]
            else:
                inputs, outputs = [q for _, q, _, _ in per_group], [qkv for _, _, qkv, _ in per_group]
            time += _pipeline(inputs, computes, outputs)
            compute += sum(computes)
            sent += 2 * b * n * (h + hkv) * d * ELEM * (p - 1) / p
        extra = 2 * b * n * (h + hkv) * d * ELEM
        return _Timeline(time, compute, sent, extra)

    def _hybrid(self, problem: Problem, u: int, r: int, ring_layout: str, head_groups: int | str = "auto",
                local: bool | str = False, document_groups: int | str = 1) -> _Timeline:
        column = [i * u for i in range(r)]
        if ring_layout == "documents" and problem.has_documents:
            kept = grid_local_documents(local, problem.cu_seqlens(), r, u, problem.causal,
                                        pair_costs=self._pair_costs(problem)) if local else None
            if kept is not None:  # every rank its own documents, nothing moves
                return self._ulysses_local(problem, list(range(u * r)), kept)
            kv = kv_heads_for(problem.heads, problem.kv_heads, u)
            one_group = head_groups_for(head_groups, problem.heads // u, kv // u, False) == 1  # the module's
            if one_group and (local or document_groups != 1):
                return self._hybrid_row_documents(problem, u, r, local, document_groups)

        def ring(heads, kv_heads, mode):
            one = replace(problem, mode=mode)
            if ring_layout == "documents":
                return self._documents(one, column, heads, kv_heads, "ring")
            return self._ring(one, column, heads, kv_heads, ring_layout, True,
                              "copy_engine" if not self.network.spans_nodes(column) else "p2p")

        def attend(heads, kv_heads, mode):  # the ring's forward, or its backward: fwd_bwd less fwd
            fwd = ring(heads, kv_heads, "fwd")
            if mode == "fwd":
                return fwd
            both = ring(heads, kv_heads, "fwd_bwd")
            return _Timeline(both.time - fwd.time, both.compute - fwd.compute, both.sent - fwd.sent, both.extra_mem)

        return self._by_head_groups(problem, list(range(u)), problem.heads, problem.kv_heads, attend, head_groups,
                                    False, rings=r)

    def _hybrid_row_documents(self, problem: Problem, u: int, r: int, local=False,
                              document_groups: int | str = "always") -> _Timeline:
        """The hybrid on the documents' layout exchanging each row by its plan
        (:mod:`dilated.parallel.row_documents`): with ``local`` (the module's ``local_documents``)
        where every row keeps some (:func:`~dilated.parallel.row_documents.row_plans`), each rank's
        own documents on all its heads first, beside the exchanges. By documents (``document_groups``
        ``"always"``, or ``"auto"`` where no row keeps documents on a ring of two rows of one node: the
        module's :func:`~dilated.parallel.row_documents.plans_for`): the row's pieces of crossing documents
        exchanged (q, k, v in, output back), attended by a ring over the crossing documents' own
        layout (one ring for every row: the slowest column's), then its other documents exchanged
        behind it and attended on the row's heads; else the rest in one exchange and one ring over
        its own layout. A group's
        exchange takes the time of the row's rank with the most of its rows. Without a plan, one
        exchange of the whole shard."""
        layout = self._balanced(problem, r)
        one_host = not any(self.network.spans_nodes([i * u + c for i in range(r)]) for c in range(u))
        plans = plans_for(layout, u, local, document_groups, one_host)
        if plans is None:  # one exchange of the whole shard (document_groups=1: no plan asked again)
            return self._hybrid(problem, u, r, "documents", 1, False, 1)
        b, d, h = problem.batch, problem.head_dim, problem.heads
        hkv = kv_heads_for(h, problem.kv_heads, u)
        column, row = [i * u for i in range(r)], list(range(u))
        ring, whole_ring = {}, _Timeline(0.0, 0.0)
        if any(any(plan.rings) for plan in plans):
            crossing = plans[0].ring_layout  # the layout the rows' ring carries
            ring["fwd"] = whole_ring = self._documents(replace(problem, mode="fwd"), column, h // u, hkv // u, "ring",
                                                       crossing)
            if problem.mode == "fwd_bwd":
                whole_ring = self._documents(replace(problem, mode="fwd_bwd"), column, h // u, hkv // u, "ring",
                                             crossing)
                ring["bwd"] = _Timeline(whole_ring.time - ring["fwd"].time, whole_ring.compute - ring["fwd"].compute)
        rows, moved = [], 0
        for plan in plans:
            parts, most_rows = [], [0] * u
            for docs, on_ring in zip(plan.groups, plan.rings):
                spans, cu_g = group_spans(list(plan.cu), docs, u)
                counts = [sum(m for _, m in mine) for mine in spans]
                most_rows = [a + c for a, c in zip(most_rows, counts)]
                most = b * max(counts) * d * ELEM
                parts.append((None if on_ring else cu_g, self.network.all_to_all_ms(most * h, row),
                              self.network.all_to_all_ms(most * (h + 2 * hkv), row)))
            rows.append((plan, parts))
            moved = max(moved, *most_rows)
        time = compute = 0.0
        for mode in (("fwd", "bwd") if problem.mode == "fwd_bwd" else ("fwd",)):
            times, computes = [], []
            for plan, parts in rows:
                attends = [ring[mode].time if cu_g is None else
                           self.kernels.documents_ms(cu_g, b, h // u, hkv // u, d, problem.causal, mode)
                           for cu_g, _, _ in parts]
                ins = [qkv if mode == "fwd" else q for _, q, qkv in parts]
                outs = [q if mode == "fwd" else qkv for _, q, qkv in parts]
                for rank in range(u):
                    own = _own_documents_ms(self.kernels, plan.local, rank, b, h, hkv, d, problem.causal, mode)
                    times.append(_beside(own, ins, attends, outs))
                    computes.append(sum(own) + sum(attends))
            time, compute = time + max(times), compute + max(computes)
        sent = (2 if problem.mode == "fwd_bwd" else 1) * 2 * b * moved * (h + hkv) * d * ELEM * (u - 1) / u
        held = max(_local_bytes(plan.local, rank, b, h, hkv, d, problem.mode) for plan in plans for rank in range(u))
        return _Timeline(time, compute, sent + whole_ring.sent,
                         2 * b * moved * (h + hkv) * d * ELEM + whole_ring.extra_mem + held)

    # -- decode -----------------------------------------------------------------------------------
    def _decode(self, problem: Problem, ranks: list[int]) -> _Timeline:
        """The calibrated decode step of the same batch and rows per rank, timed as the problem runs it
        (called from Python, or replayed from a CUDA graph): on one GPU alone for P = 1, else on P ranks
        where the calibration timed P, else on the most ranks it timed below P, or the fewest above (its
        all-gather and merge included), the rows per rank and batch interpolated; for another P, the
        all-gather's difference added."""
        p = len(ranks)
        cal = self.network.calibration
        steps = [d for d in cal.decode if d.cuda_graph == problem.cuda_graph]
        counts = sorted({d.ranks for d in steps})
        if not counts:
            how = "replayed from CUDA graphs" if problem.cuda_graph else "called from Python"
            raise ValueError(f"the calibration has no decode steps {how}: calibrate again")
        several = [c for c in counts if c > 1]
        if p > 1 and not several:
            raise ValueError("the calibration has decode steps of one GPU only: calibrate under torchrun")
        measured_p = 1 if p == 1 else max([c for c in several if c <= p] or several[:1])
        per_rank = problem.seq_len / p
        shape = (problem.heads, problem.kv_heads, problem.head_dim)
        pts = [d for d in steps if d.ranks == measured_p and (d.heads, d.kv_heads, d.head_dim) == shape]
        pts = pts or [d for d in steps if d.ranks == measured_p]
        row_bytes = 2 * problem.kv_heads * problem.head_dim * ELEM  # k and v of one cached row, this problem's heads

        def at_batch(b):  # a curve by the bytes of cache each rank reads (other heads: read at their bytes)
            mine = [d for d in pts if d.batch == b]
            read = [x.tokens * b * 2 * x.kv_heads * x.head_dim * ELEM for x in mine]
            return Curve(read, [x.ms for x in mine], measured_p).time_ms(per_rank * b * row_bytes)
        batches = sorted({d.batch for d in pts})
        local = log_interp(problem.batch, batches, [at_batch(b) for b in batches])
        msg = problem.batch * problem.query_tokens * problem.heads * (problem.head_dim + 1) * ACC
        if p > 1 and p != measured_p:
            local += self.network.all_gather_ms(msg, ranks) - self.network.all_gather_ms(msg, ranks[:measured_p])
        return _Timeline(local, local, msg * (p - 1), p * msg)

    # -- one strategy -----------------------------------------------------------------------------
    def _memory(self, problem: Problem, p: int, extra: float) -> float:
        """Per-rank GiB: the shards of q, k, v and out (with gradients and dout for fwd_bwd, and the
        float32 output accumulator and lse), plus what the schedule holds (``extra``: its buffers, the
        rows of the largest batched documents call gathered at once, and what documents attended where
        they lie hold: :func:`_local_bytes`)."""
        if problem.mode == "decode":
            return _gib(problem.batch * problem.seq_len / p * problem.kv_heads * problem.head_dim * 2 * ELEM + extra)
        n = problem.seq_len / p
        q = problem.batch * n * problem.heads * problem.head_dim * ELEM
        kv = problem.batch * n * problem.kv_heads * problem.head_dim * ELEM
        base = 2 * q + 2 * kv + q * ACC / ELEM + problem.batch * n * problem.heads * ACC
        if problem.mode == "fwd_bwd":
            base += 2 * q + 2 * kv
        return _gib(base + extra)

    def predict(self, strategy: str, problem: Problem, world: int, grid: tuple | None = None) -> Prediction:
        """``strategy`` (a name of :data:`STRATEGIES`) on ``world`` ranks; ``grid``: the hybrid's
        ``(ulysses, ring)``."""
        out = Prediction(strategy, world, grid or (), flops=problem.flops())
        floor = 0.0
        if world > 1 and problem.mode != "decode" and strategy in STRATEGIES:
            floor = self.floor_ms(strategy, problem, world)
        self.kernels.extrapolated_ms = self.kernels.total_ms = self.kernels.peak_bytes = 0.0
        self.kernels.uncalibrated_shapes = set()
        self.kernels.pace = self.pace if world > 1 else 1.0  # a collective or a ring waits for the slowest GPU
        try:
            t = self._timeline(strategy, problem, world, grid)
        except (NotImplementedError, ValueError) as e:
            out.reason = str(e)
            return out
        out.time_ms, out.compute_ms, out.bytes_sent = max(t.time, floor), t.compute, t.sent
        out.floor_ms = floor
        share = self.kernels.extrapolated_ms / self.kernels.total_ms if self.kernels.total_ms else 0.0
        if share > 0.1:
            shapes = ",".join(f"{h}/{hkv}/{d}" for h, hkv, d in sorted(self.kernels.uncalibrated_shapes, reverse=True))
            out.notes.append(f"{100 * share:.0f}% of the kernel time is in calls with less work than any calibrated "
                             "call of their length (few query rows or heads): extrapolated"
                             + (f"; calibrate --head-shapes {shapes} too to time its calls of those heads" if shapes
                                else ""))
        out.exposed_ms = max(0.0, t.time - t.compute)  # the host's floor is not communication
        out.memory_gib = self._memory(problem, world, t.extra_mem + self.kernels.peak_bytes)
        return out

    def _timeline(self, strategy: str, problem: Problem, world: int, grid) -> _Timeline:
        if strategy not in STRATEGIES:
            raise NotImplementedError(f"{strategy}: {NOT_MODELLED.get(strategy, 'not a strategy the planner models')}")
        ranks = list(range(world))
        if problem.mode == "decode":
            if strategy != "decode":
                raise NotImplementedError("decode is planned as the 'decode' strategy (the cache split over the ranks)")
            return self._decode(problem, ranks)
        if strategy == "decode":
            raise NotImplementedError("the decode strategy plans --mode decode only")
        if problem.seq_len % (2 * world) and strategy != "documents":
            raise ValueError(f"N={problem.seq_len} is not divisible by 2 x {world} ranks (zigzag chunks)")
        if strategy in ("documents", "ring_documents"):
            return self._documents(problem, ranks, problem.heads, problem.kv_heads,
                                   "all_gather" if strategy == "documents" else "ring")
        if strategy == "ring_head_tail":
            return self._documents(problem, ranks, problem.heads, problem.kv_heads, "ring",
                                   DocumentLayout.head_tail(problem.cu_seqlens(), world, problem.causal))
        if strategy == "ulysses_document_groups":
            if problem.heads % world:
                raise ValueError(f"Ulysses splits {problem.heads} heads over {world} ranks: not divisible")
            return self._ulysses_by_documents(problem, ranks)
        if strategy in ULYSSES_HEAD_GROUPS:
            if problem.heads % world:
                raise ValueError(f"Ulysses splits {problem.heads} heads over {world} ranks: not divisible")
            # the benchmark's "ulysses" runs the module's defaults (documents kept local, document groups
            # where they pay: local_documents_of says "auto"); its other names, every document exchanged
            return self._ulysses(problem, ranks, ULYSSES_HEAD_GROUPS[strategy], local_documents_of(strategy))
        if strategy in HYBRID_HEAD_GROUPS or strategy in ROW_GROUPS:
            u, r = grid or (None, None)
            if not u or not r or u * r != world or u < 2 or r < 2:
                raise ValueError(f"the hybrid needs a grid of ulysses x ring = {world} ranks, both at least 2")
            if problem.heads % u:
                raise ValueError(f"the hybrid splits {problem.heads} heads over rows of {u}: not divisible")
            kv_heads_for(problem.heads, problem.kv_heads, u)
            if strategy in ROW_GROUPS:
                return self._hybrid_row_documents(problem, u, r, ROW_GROUPS[strategy]) if problem.has_documents \
                    else self._hybrid(problem, u, r, "documents", 1, False)
            ring_layout = "documents" if strategy.startswith("hybrid_documents") else "zigzag"
            return self._hybrid(problem, u, r, ring_layout, HYBRID_HEAD_GROUPS[strategy], local_documents_of(strategy),
                                document_groups_of(strategy))
        layout, overlap, transport = STRATEGIES[strategy]
        if transport == "copy_engine" and self.network.spans_nodes(ranks):
            transport = "p2p"  # copy-engine pulls reach the GPUs of one host only
        return self._ring(problem, ranks, problem.heads, problem.kv_heads, layout, overlap, transport)


#: strategies the model follows: ring variants as (layout, overlap, transport); the others by name
STRATEGIES = {
    "ring": ("contiguous", True, "copy_engine"),
    "ring_zigzag": ("zigzag", True, "copy_engine"),
    "ring_zigzag_p2p": ("zigzag", True, "p2p"),
    "ring_no_overlap": ("contiguous", False, "copy_engine"),
    "ring_zigzag_no_overlap": ("zigzag", False, "copy_engine"),
    **{name: None for name in ULYSSES_HEAD_GROUPS},
    "ulysses_document_groups": None,
    **{name: None for name in HYBRID_HEAD_GROUPS},
    **{name: None for name in ROW_GROUPS},
    "documents": None,
    "ring_documents": None,
    "ring_head_tail": None,
    "decode": None,
}

def measured_as(strategy: str) -> str:
    """The strategy of :data:`dilated.bench.planner.measure.STRATEGIES` whose calibrated call stands
    for ``strategy``'s (:meth:`Model.floor_ms`): itself, or the one it varies (head groups, overlap,
    transport, ring layout)."""
    if strategy in ULYSSES_HEAD_GROUPS or strategy == "ulysses_document_groups":
        return "ulysses"
    if strategy in HYBRID_HEAD_GROUPS or strategy in ROW_GROUPS:
        return "hybrid_documents" if strategy.startswith("hybrid_documents") else "hybrid"
    if strategy in ("documents", "ring_documents"):
        return strategy
    if strategy == "ring_head_tail":
        return "ring_documents"
    return "ring_zigzag"


#: benchmark implementations the model does not follow, and why
NOT_MODELLED = {
    "torch_cp": "PyTorch's context parallel: other people's schedule, not modelled",
    "ring_flash_attn": "ring-flash-attn: other people's schedule, not modelled",
    "ring_flash_attn_zigzag": "ring-flash-attn: other people's schedule, not modelled",
    "yunchang_usp": "yunchang: other people's schedule, not modelled",
    "yunchang_ulysses": "yunchang: other people's schedule, not modelled",
    "distributed_dilated": "dilated attention's sequence parallel: the planner models dense attention and documents",
}
