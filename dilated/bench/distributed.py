"""Distributed rows: ring and sequence-parallel dilated attention measured across ranks.

A :class:`DistributedImplementation` is benchmarked by the same :func:`~dilated.bench.run_case`
as everything else; its hooks make each row honest across ranks:

* inputs are this rank's shards of the global problem (``case.seq_len`` is the global N),
  generated on the device from a per-rank seed;
* each timed call starts after a barrier, and a call's time is the maximum over the ranks;
* peak memory is the maximum over the ranks;
* the correctness check gathers the shards and compares the global result with the reference;
  past :data:`GATHER_LIMIT_BYTES` per tensor (where the check samples rows) the shards stay where
  they are, in any layout (:class:`ShardedSequence`), and the reference reads rows and key blocks
  from their owners;
* communication per call (bytes sent, messages, collectives) and the exposed communication time
  (CUDA events around each wait on the compute stream) come from the module's ``stats``.

:func:`run_scaling_sweep` runs strong or weak scaling over sub-groups of the launched world
(ranks ``0..P-1`` for each ``P``) with the single-device run of the same problem as the baseline,
and adds scaling efficiency to each row. Only rank 0 writes.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

import dilated
from dilated.backends.varlen import documents_pair_costs
from dilated.parallel.agreement import all_gather_text, group_device, host_and_device_backend

from .registry import Case, Implementation
from .results import trusted, untrusted_reason
from .workload import (WithDocuments, document_layout_work, grid_work_per_rank, imbalance, kept_local,
                       row_local_work, ulysses_size_for, work_per_rank)
from .runner import RunOptions, run_sweep

#: above this size of a gathered tensor the check reads the shards in place (1M tokens, H=32, D=128
#: bf16 is 8 GiB per tensor: q, k, v, out, dout and the gradients gathered on every rank take about
#: 40 GiB beside the run's own tensors).
GATHER_LIMIT_BYTES = 2 << 30


class ShardedSequence:
    """A ``[B, N, H, D]`` tensor left in its shards, for the sampled check.

    ``owners`` (``[N]`` int64 on the shards' device; default the contiguous layout's) names where
    each global position lies: ``rank * N/P + its row in that rank's shard``. Supports what
    :func:`dilated.reference.sampled_reference` and the check read: ``x[:, rows]`` (an index
    tensor) and ``x[:, a:b]`` (a block of keys or of a document): each rank fills the rows it
    holds and one all-reduce adds them (every row is nonzero on its owner only: exact). Every rank
    makes the same reads in the same order, as the check does, so the collectives match.
    """

    def __init__(self, local: torch.Tensor, group=None, owners: torch.Tensor | None = None):
        self.local, self.group = local.detach(), group
        self.rank, self.p = dist.get_rank(group), dist.get_world_size(group)
        self.n = local.shape[1]
        self.shape = torch.Size((local.shape[0], self.n * self.p, *local.shape[2:]))
        self.device, self.dtype = local.device, local.dtype
        self.owners = torch.arange(self.shape[1], device=self.device) if owners is None else owners

    def __getitem__(self, idx):
        whole, sel = idx
        if whole != slice(None):
            raise IndexError("ShardedSequence reads [:, rows] or [:, a:b]")
        if isinstance(sel, slice):
            start, stop, step = sel.indices(self.shape[1])
            if step != 1:
                raise IndexError("ShardedSequence reads contiguous blocks only")
            sel = torch.arange(start, stop, device=self.device)
        rows = torch.as_tensor(sel, device=self.device)
        where = self.owners[rows]
        mine = torch.div(where, self.n, rounding_mode="floor") == self.rank
        out = torch.zeros((self.shape[0], len(rows), *self.shape[2:]), device=self.device, dtype=self.dtype)
        out[:, mine] = self.local[:, where[mine] - self.rank * self.n]
        dist.all_reduce(out, group=self.group)
        return out


#: a schedule whose largest segment spans all ranks (LongNet's sequence-parallel setting).
DISTRIBUTED_SEGMENTS = (4096, 16384, 65536, 262144)
DISTRIBUTED_DILATIONS = (1, 2, 4, 16)


def distributed_schedule(n: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Segments 4K, 16K, 64K, 256K (dilations 1, 2, 4, 16) below N, then N itself with dilation
    N/16K, so the last branch spans every rank; for N < 16K a scaled one (N/8, N/2, N; 1, 2, 4)."""
    if n < 16384:
        return (n // 8, n // 2, n), (1, 2, 4)
    keep = [(w, r) for w, r in zip(DISTRIBUTED_SEGMENTS, DISTRIBUTED_DILATIONS) if w < n]
    keep.append((n, max(keep[-1][1], n // 16384)))
    return tuple(w for w, _ in keep), tuple(r for _, r in keep)


def _max_over_ranks(values, group):
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


@dataclass
class OnEveryRank(Implementation):
    """A single-device implementation run by every rank at once on its own device (the baseline
    of a distributed run); a call's time and memory are the slowest rank's."""

    def reduce_max(self, values):
        return _max_over_ranks(values, None)

    def all_ranks_text(self, text):
        return all_gather_text(None, text, group_device(None))

    @classmethod
    def of(cls, impl: Implementation) -> "OnEveryRank":
        return cls(**{f.name: getattr(impl, f.name) for f in dataclasses.fields(Implementation)})


@dataclass
class DistributedImplementation(Implementation):
    """An implementation whose inputs and outputs are shards over ``group`` in ``layout``."""

    layout: str = "contiguous"
    group: object = None
    runs_on_ranks = True
    factory: object = None  # factory(case, backend, group) -> module
    takes_documents: bool = False  # forward(q, k, v, cu_seqlens=...)
    splits_heads: bool = False  # each rank computes every query for a share of the heads (Ulysses)
    local_documents: object = False  # the module's local_documents (dilated.parallel.local_documents)

    def __post_init__(self):
        super().__post_init__()
        self.build = self._build
        self._model = None

    def _build(self, case, backend):
        if case.documents and not self.takes_documents:
            raise NotImplementedError(f"{self.name} does not take packed documents (cu_seqlens)")
        model = self.factory(case, backend, self.group)
        if case.documents:
            model = WithDocuments(model, case.documents, case.seq_len, head_tail=self.layout == "documents_head_tail")
        self._model = model  # gathers results through its own unshard (its layout)
        return model

    def on(self, group) -> "DistributedImplementation":
        """This implementation on ``group`` (None: the default group)."""
        return dataclasses.replace(self, group=group)

    def inputs(self, case: Case, device, gen, requires_grad, captured=None):
        if captured is not None:
            raise NotImplementedError("captured inputs are not sharded by the distributed benchmark")
        if not dist.is_initialized():
            raise NotImplementedError(f"{self.name} needs torch.distributed: launch with torchrun")
        rank, p = dist.get_rank(self.group), dist.get_world_size(self.group)
        parts = 2 * p if self.layout in ("zigzag", "hybrid") else p
        if case.seq_len % parts:
            raise ValueError(f"--seq-lengths: N={case.seq_len} must be divisible by {parts} for {self.name} on "
                             f"{p} ranks")
        seed = int(torch.randint(0, 2 ** 31, (1,), generator=gen)) + 7919 * rank  # a different shard per rank
        g = torch.Generator(device=device).manual_seed(seed)
        n = case.seq_len // p

        def r(h, scale=1.0):
            return (torch.randn(case.batch, n, h, case.head_dim, generator=g, device=device, dtype=case.torch_dtype)
                    * scale).requires_grad_(requires_grad)

        return r(case.num_heads, case.input_scale), r(case.kv_heads, case.input_scale), r(case.kv_heads)

    def gather(self, t):
        full_bytes = t.numel() * t.element_size() * dist.get_world_size(self.group)
        if full_bytes > GATHER_LIMIT_BYTES:
            return ShardedSequence(t, self.group, self._owners(t))
        return self._unshard(t)

    def _unshard(self, t):
        if hasattr(self._model, "unshard"):  # the module knows its layout (a hybrid grid, say)
            return self._model.unshard(t.contiguous())
        return dilated.unshard(t.contiguous(), group=self.group, layout=self.layout)

    def _owners(self, t) -> torch.Tensor:
        """Where each global position of ``t``'s layout lies (:class:`ShardedSequence`): this rank's rows
        numbered ``rank * N/P + row`` and put in sequence order as :meth:`gather` puts them (one
        all-gather of ``N`` integers)."""
        n, rank = t.shape[1], dist.get_rank(self.group)
        mine = torch.arange(rank * n, (rank + 1) * n, device=t.device).view(1, n, 1, 1)
        return self._unshard(mine).flatten()

    def work_per_rank(self, case, p: int, backend: str = "auto") -> list[float] | None:
        """Attended (query, key) pairs each rank computes (its queries, or its heads of every
        query), or None where not known; document layouts as the modules make them on ``backend``
        (their pair costs: :func:`dilated.backends.varlen.documents_pair_costs`)."""
        if self.problem.name != "dense":
            return None
        costs = documents_pair_costs(backend, group_device(self.group), case.torch_dtype)
        kept = kept_local(case, p, self.layout, self.local_documents, costs)
        if kept is None and self.layout == "hybrid_documents":  # documents kept within each row, or none
            row_local = row_local_work(case, p, self.local_documents, costs)
            if row_local is not None:
                return row_local
        if kept is not None:  # documents attended where they lie, the others by heads
            return list(kept.work)
        if self.splits_heads:  # every rank: all queries, H/P heads
            return [work_per_rank(case, 1, "contiguous")[0] / p] * p
        if self.layout in ("documents", "documents_head_tail"):  # the queries DocumentLayout gives each rank
            return document_layout_work(case, p, head_tail=self.layout == "documents_head_tail", pair_costs=costs)
        if self.layout in ("hybrid", "hybrid_documents"):  # a ring over the rows, heads split within a row
            return grid_work_per_rank(case, p, ulysses_size_for(p, case.num_heads) or 1,
                                      "zigzag" if self.layout == "hybrid" else "documents", costs)
        return work_per_rank(case, p, self.layout)

    def reduce_max(self, values):
        return _max_over_ranks(values, self.group)

    def ranks(self) -> int:
        return dist.get_world_size(self.group)

    def all_ranks_text(self, text):
        return all_gather_text(self.group, text, group_device(self.group))

    def before_call(self):
        dist.barrier(group=self.group)

    def comm_metrics(self, model, step, seconds_per_call: float = 0.0):
        stats = getattr(model, "stats", None)
        if stats is None:
            return {"note": "not instrumented (a third-party implementation)"}
        calls = 1 if seconds_per_call > 1.0 else 3
        stats.reset()
        stats.measure = True
        try:
            for _ in range(calls):
                self.before_call()
                step()
            exposed = stats.exposed_ms / calls
        finally:
            stats.measure = False
        mine = {"bytes_sent_per_rank": stats.bytes_sent / calls, "p2p_messages": stats.messages / calls,
                "collectives": stats.collectives / calls, "exposed_comm_ms": exposed,
                "transport": getattr(model, "transport_used", None)}
        worst = self.reduce_max([mine["bytes_sent_per_rank"], exposed])
        mine["bytes_sent_per_rank_max"], mine["exposed_comm_ms_max"] = worst
        return mine


@dataclass
class ScalingSweep:
    """What a scaling run compares: ``impls`` at each of ``world_sizes`` on ``backends``.

    ``cases_for(P, impl)`` gives the global cases (strong scaling: the same N for every P; weak:
    N = P x tokens per rank); ``baseline_case(case, P)`` the single-device case it is compared with
    (strong: the same; weak: the tokens of one rank); ``baseline_impls`` maps an implementation's
    problem name to its single-device baseline.
    """

    impls: list
    baseline_impls: dict
    cases_for: object
    baseline_case: object
    world_sizes: list
    backends: list
    scaling: str


def baseline_backends(backends: list[str]) -> list[str]:
    """The backends a single-device baseline runs on: the run's, and ``auto`` (the kernel measured
    fastest here for the shape) where the run does not name it, so that efficiency is against the
    fastest single-device run, not against a slow kernel the strategies happen to share."""
    return list(backends) + ([] if "auto" in backends else ["auto"])


def same_kernels_as(earlier: dict):
    """For a baseline on ``auto`` that the run did not name: the ``same_as`` test of
    :func:`~dilated.bench.runner.run_case` against ``earlier`` (backend -> (first-call kernels,
    second-call kernels) of the baseline rows of the problem that ran warm): where ``auto`` ran the
    very kernels of one of them, its row ends after two calls instead of timing them again."""
    def same_as(row):
        mine = (row.get("kernels"), row.get("second_call_kernels"))
        for backend, theirs in earlier.items():
            if mine[0] and theirs == mine:
                return (f"its first calls ran the kernels of the {backend} baseline ({'+'.join(mine[0])}): "
                        "the same run, not timed twice")
        return None
    return same_as


def run_scaling_sweep(sweep: ScalingSweep, opts: RunOptions, writer, script: str, progress: bool = True) -> list[dict]:
    """For each world size P: the single-device baseline of the same problem, run on every rank at
    once (the slowest recorded), then each distributed implementation on ranks ``0..P-1``. Rows go
    to ``writer`` on rank 0, each with ``world_size``, ``per_rank_tflops``, ``efficiency``,
    ``work_imbalance`` and ``comm``."""
    impls, baseline_impls, cases_for, baseline_case = (sweep.impls, sweep.baseline_impls, sweep.cases_for,
                                                       sweep.baseline_case)
    world_sizes, backends, scaling = sweep.world_sizes, sweep.backends, sweep.scaling
    rank, world = dist.get_rank(), dist.get_world_size()
    rows, baseline_ms = [], {}
    ran = {}  # on every rank: problem -> backend -> the kernels of its baseline rows that ran warm
    # the largest group first: then every rank has joined the same groups (in the same order) when
    # a subgroup sets up symmetric memory (see dilated.parallel.peer_copy.prepare)
    for p in sorted(world_sizes, reverse=True):
        # collective: every rank calls it; with a gloo backend beside NCCL's, so that the modules'
        # per-call agreement runs on the host (see dilated.parallel.agreement.host_group)
        group = dist.new_group(list(range(p)), backend=host_and_device_backend()) if p < world else None
        jobs = []
        for impl in impls:
            for case in cases_for(p, impl):
                bcase = baseline_case(case, p)
                bkey = (impl.problem.name, repr(bcase))
                if bkey not in baseline_ms:
                    baseline_ms[bkey] = {}
                    jobs += [(OnEveryRank.of(baseline_impls[impl.problem.name]), bcase, b, "baseline", bkey)
                             for b in baseline_backends(backends)]
                jobs += [(impl.on(group), case, b, "distributed", bkey) for b in backends]
        for impl, case, backend, role, bkey in jobs:
            row = None
            if role == "baseline" or rank < p:
                extra = {"world_size": 1 if role == "baseline" else p, "role": role, "scaling": scaling,
                         "tokens_per_rank": case.seq_len if role == "baseline" else case.seq_len // p}
                same_as = None
                if role == "baseline" and backend == "auto" and "auto" not in backends:
                    same_as = same_kernels_as(ran.get(bkey, {}))
                row = run_sweep([(impl, case, backend)], opts, None, script, False, lambda _: extra, same_as)[0]
                if role == "baseline" and trusted(row):
                    ran.setdefault(bkey, {})[backend] = (row.get("kernels"), row.get("second_call_kernels"))
            dist.barrier()
            if rank != 0:
                continue
            work = impl.work_per_rank(case, p, backend) if role != "baseline" else None
            _add_scaling(row, role, bkey, backend, baseline_ms, p, scaling, imbalance(work))
            rows.append(row)
            if writer is not None:
                writer.append(row)
            if progress:
                t = (row.get("time_ms") or {}).get("median")
                eff = row.get("efficiency")
                print(f"[P={row['world_size']}] {row['implementation']}/{backend} N={case.seq_len} {case.mode}"
                      f"{' causal' if case.causal else ''}: {row['status']}" + (f" {t:.3f} ms" if t is not None else "")
                      + (f", efficiency {eff:.2f}" if eff is not None else "")
                      + (f", first call {row['first_call_ms']:.0f} ms" if row.get("first_call_ms") else "")
                      + (f" ({row['reason'][:100]})" if row.get("reason") else ""), flush=True)
    return rows


def _add_scaling(row, role, bkey, backend, baseline_ms, p, scaling, work_imbalance=None):
    """A baseline row is kept (where it ran warm and passed) as a candidate; a distributed row gets
    its efficiencies against the fastest candidate of the same problem over every backend of the
    run, named in ``baseline_backend`` and ``baseline_kernels``, or ``efficiency: None`` and
    ``efficiency_note`` saying why not."""
    if role == "baseline":
        if trusted(row):
            baseline_ms[bkey][backend] = row
        return
    row["work_imbalance"] = work_imbalance
    row["efficiency"] = row["work_efficiency"] = None
    why = untrusted_reason(row)
    candidates = list(baseline_ms.get(bkey, {}).values())
    if row["status"] != "ok":  # its status says why
        return
    if why or not candidates:
        row["efficiency_note"] = (f"this row: {why}" if why else
                                  "no single-device baseline of this problem ran warm and passed its check")
        return
    base = min(candidates, key=lambda r: r["time_ms"]["median"])
    t, tb = row["time_ms"]["median"], base["time_ms"]["median"]
    row["baseline_ms"], row["baseline_backend"] = tb, base["backend"]
    row["baseline_kernels"] = base.get("kernels")
    # strong: T_1 / (P T_P); weak: T_1(n) / T_P(P n); "work" efficiency: per-rank TFLOP/s over one GPU's
    row["efficiency"] = tb / (p * t) if scaling == "strong" else tb / t
    row["work_efficiency"] = row["per_rank_tflops"] / base["tflops"] if base.get("tflops") else None
    if row["work_efficiency"] is not None and row["work_efficiency"] > 1.02:
        row["efficiency_note"] = (
            f"per-rank kernels outrun the single-device baseline ({base['backend']}: "
            f"{'+'.join(base.get('kernels') or []) or '?'} on N={base['config']['seq_len']}): this row's calls are "
            f"{'+'.join(row.get('kernels') or []) or '?'} on shorter or fewer-head pieces, which these kernels run at a "
            "higher rate than the one long call")
    comm = row.get("comm") or {}
    if comm.get("exposed_comm_ms_max") is not None:
        row["exposed_comm_fraction"] = comm["exposed_comm_ms_max"] / t
