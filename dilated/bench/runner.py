"""Run one case of one implementation, carefully; run sweeps of them, writing each row as it ends."""
from __future__ import annotations

import contextlib
import math
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass

import torch
from tqdm import tqdm

from . import env as envmod
from .flops import peak_tflops
from .rank_failures import FailedOnRanks, OverBudget, RankFailures, outcome
from .memory import PeakMemory, free_memory, large_allocations_tracked
from dilated.backends import record_kernels
from dilated.backends.graph_shapes import build_after_from_env

from .problems import device_generator
from .registry import Case, Implementation
from .results import ResultWriter
from .timing import measure_side_by_side, summarize
from .warmup import warm_up

#: relative tolerance (max |err| / max |ref|) on outputs; gradients get twice this.
TOLERANCE = {torch.float64: 1e-6, torch.float32: 2e-3, torch.bfloat16: 3e-2, torch.float16: 5e-3}
#: beyond this many score entries (B*H*Nq*Nk) the float64 reference is replaced by sampled rows.
DENSE_REFERENCE_LIMIT = 1 << 26
SAMPLED_ROWS = 64


def warmup_calls(device: torch.device, asked: int, warmed: int) -> int:
    """Warm-up calls still to make before timing a step that has already run ``warmed`` calls: up
    to ``asked`` calls in all, and on a GPU at least up to the call at which a shape's cuDNN graph
    is built (:mod:`dilated.backends.graph_shapes`), so that no timed call builds one."""
    least = build_after_from_env() if device.type == "cuda" else 0
    return max(0, max(asked, least) - warmed)


@dataclass
class RunOptions:
    warmup: int = 3
    reps: int = 10
    budget_s: float | None = None
    check: bool = True
    cuda_graph: bool = False
    flush_l2: bool = True
    memory_budget_mib: float | None = None  # rows over this are recorded as oom (tests, --find-max)
    floor: bool = False  # also time the kernel floor of dilated rows (dilated.bench.floor)
    seed: int = 0
    device: str | None = None
    settle_s: float = 0.0  # idle this long before each row's timed calls (clocks recover after a heavy row)
    # warm up / time calls for at least this long besides ``warmup`` / ``reps`` calls; None: 1 s on a
    # GPU (it reaches its power cap's steady clocks within that, so repeats agree), 0 on CPU
    warmup_s: float | None = None
    rep_s: float | None = None
    check_determinism: bool = False  # run the step twice more on the same inputs: bit-identical results?
    profile_dir: str | None = None  # one more call per row under torch.profiler, its trace written here


def _rel(x, ref):
    x, ref = x.double(), ref.double()
    err = (x - ref).abs().max().item()
    return err, err / max(ref.abs().max().item(), 1e-6)


def _nonfinite(x: torch.Tensor, chunk: int = 1 << 26) -> int:
    """Non-finite entries of ``x``, counted a chunk at a time (a count over a whole tensor at the
    longest lengths makes copies as large as it)."""
    flat = x.detach().reshape(-1)
    return sum(int((~torch.isfinite(part)).sum()) for part in flat.split(chunk))


def _check(impl, case, inputs, model, out, mode, grads, dout):
    tol = TOLERANCE[case.torch_dtype]
    b = case.batch
    pairs = b * case.num_heads * case.nq * case.seq_len
    res = {"tolerance": tol}
    if pairs <= DENSE_REFERENCE_LIMIT and isinstance(out, torch.Tensor):  # not shards left in place
        ref_in = tuple(t.detach().double().requires_grad_(mode != "fwd") for t in inputs)
        ref = impl.reference(case, ref_in, model)
        res["reference"] = "float64 dense"
        res["max_abs_err"], res["rel_err"] = _rel(out, ref)
        if mode != "fwd":
            ref_grads = torch.autograd.grad(ref, ref_in, dout.double())
            errs = [_rel(g, rg)[1] for g, rg in zip(grads, ref_grads)]
            res["grad_rel_err"] = max(errs)
    else:
        gen = torch.Generator().manual_seed(1)
        rows = torch.randperm(case.nq, generator=gen)[:SAMPLED_ROWS].sort().values.to(out.device)
        with_dq = mode != "fwd" and grads is not None
        ref = impl.sampled_reference(case, inputs, model, rows, dout if with_dq else None)
        ref, ref_dq = ref if with_dq else (ref, None)
        res["reference"] = f"float64 streaming, {len(rows)} sampled rows"
        res["max_abs_err"], res["rel_err"] = _rel(out[:, rows], ref)
        if ref_dq is not None:  # a query's gradient depends on its own row only
            res["grad_rel_err"] = _rel(grads[0][:, rows], ref_dq)[1]
            res["grad_check"] = "dq of the sampled rows; dk, dv are checked only where the float64 reference fits"
        elif mode != "fwd":
            res["grad_check"] = "skipped: gradients are checked only where the float64 reference fits"
    res["nonfinite_outputs"] = _nonfinite(out) if isinstance(out, torch.Tensor) else None
    if grads is not None:
        res["nonfinite_grads"] = sum(_nonfinite(g) for g in grads if isinstance(g, torch.Tensor))
    res["passed"] = res["rel_err"] <= tol and res.get("grad_rel_err", 0.0) <= 2 * tol and math.isfinite(res["rel_err"])
    return res


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8).clone()


class _RowRun:
    """One row being measured: its state, and its steps as :func:`run_case` runs them."""

    def __init__(self, impl: Implementation, case: Case, backend: str, opts: RunOptions, device, row: dict):
        self.impl, self.case, self.backend, self.opts, self.device, self.row = impl, case, backend, opts, device, row
        self.collective = type(impl).reduce_max is not Implementation.reduce_max  # ranks time together
        self.spread = type(impl).before_call is not Implementation.before_call  # ranks start calls together
        self.ranks = RankFailures(impl, self.collective, f"{impl.name}/{backend} N={case.seq_len} {case.mode}")
        self.needs_grad = case.mode != "fwd"
        self.inputs = self.model = None
        self.out = self.dout = None
        self.step = self.setup = None

    # -- the model and the call that is timed ---------------------------------------------------
    def prepare(self, captured=None) -> None:
        """Inputs, model, the timed step (and its untimed setup: the forward of a ``bwd`` row) and
        the incoming gradient."""
        gen = torch.Generator().manual_seed(self.opts.seed)
        try:
            self.inputs = self.impl.inputs(self.case, self.device, gen, self.needs_grad,
                                           captured.tensors if captured is not None else None)
            self.model = self.impl.build(self.case, self.backend)
            if isinstance(self.model, torch.nn.Module):
                self.model = self.model.to(device=self.device, dtype=self.case.torch_dtype)
        except Exception as e:  # noqa: BLE001 - a collective row agrees on it first (settle below)
            self.ranks.record(e)
        if self.case.mode == "fwd":
            self.step = self.forward_only
        elif self.case.mode == "fwd_bwd":
            self.step = self.forward_backward
        else:
            self.setup, self.step = self.forward_fresh, self.backward
        if self.needs_grad and self.ranks.error is None:
            self.ranks.guard(lambda: self.make_dout(gen))()
        self.ranks.settle("inputs built")

    def forward_only(self) -> None:
        with torch.no_grad(), self.step_context():
            self.forward()

    def forward(self) -> None:
        self.out = None  # the previous call's output is not this call's memory (at long lengths, as large as q)
        self.out = self.model(*self.inputs)

    def zero_grads(self) -> None:
        params = list(self.model.parameters()) if isinstance(self.model, torch.nn.Module) else []
        for t in list(self.inputs) + params:
            t.grad = None

    def step_context(self):
        """The context each call of the model runs in, its backward included: a model's own
        ``step_context()`` (a peer that patches attention for the span of a training step, as
        PyTorch's ``context_parallel`` does, and computes wrong gradients when its backward runs
        outside it), else none."""
        enter = getattr(self.model, "step_context", None)
        return enter() if callable(enter) else contextlib.nullcontext()

    def forward_fresh(self) -> None:
        with self.step_context():
            self.zero_grads()
            self.forward()

    def backward(self) -> None:
        with self.step_context():
            self.out.backward(self.dout)

    def forward_backward(self) -> None:
        with self.step_context():  # one span for the whole step, as a training loop holds it
            self.zero_grads()
            self.forward()
            self.out.backward(self.dout)

    def make_dout(self, gen) -> None:
        """A random incoming gradient of the output's shape and dtype."""
        with torch.enable_grad(), self.step_context():
            probe = self.model(*self.inputs)
        self.dout = torch.randn(probe.shape, generator=device_generator(gen, self.device), device=self.device,
                                dtype=probe.dtype)

    def call(self) -> None:
        """The setup (if any) and the step once, on every rank (a failure recorded, not raised)."""
        if self.setup:
            self.ranks.guard(self.setup)()
        self.ranks.guard(self.step)()

    # -- the steps of a row ---------------------------------------------------------------------
    def first_call(self) -> float:
        """The first call, under peak-memory tracking: records ``memory``; returns its time (ms),
        the same on every rank."""
        case, device = self.case, self.device
        with PeakMemory(device) as mem, record_kernels() as ran:
            first_ms = self._timed_call("first call done")
        # the kernels that ran (what "auto" resolved to); None: not through dilated's backends
        self.row["kernels"] = sorted(ran) or None
        self.row["first_call_ms"] = first_ms  # compilation, plans and probes included
        if mem.peak_total_mib is not None:
            mem.peak_above_mib, mem.peak_total_mib = self.impl.reduce_max([mem.peak_above_mib, mem.peak_total_mib])
        score_bytes = self.impl.problem.score_matrix_bytes(case)
        self.row["memory"] = {
            "peak_above_inputs_mib": mem.peak_above_mib, "peak_total_mib": mem.peak_total_mib,
            # dense: what materialising the scores would take (how much a fused kernel avoids)
            "score_matrix_mib": (None if score_bytes is None else score_bytes / (1 << 20)),
            "min_theoretical_mib": self.impl.min_bytes(case, case.mode) / (1 << 20),
            "measure": "cuda allocator and symmetric buffers" if device.type == "cuda" else
            "process peak RSS" + ("" if large_allocations_tracked() else
                                  " (glibc's mmap threshold not pinned: freed heap memory reused by a call does not "
                                  "show; see memory.track_large_allocations)")}
        budget = self.opts.memory_budget_mib
        if budget is not None and (mem.peak_above_mib or 0) > budget:
            raise OverBudget(f"peak {mem.peak_above_mib:.1f} MiB exceeds the memory budget of {budget} MiB")
        return first_ms

    def _timed_call(self, done: str) -> float:
        """One call of the step (its setup untimed) to its end on the device: the slowest rank's ms."""
        if self.setup:
            self.ranks.guard(self.setup)()
        t0 = time.perf_counter()
        self.ranks.guard(self.step)()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.ranks.settle(done)
        return self.impl.reduce_max([(time.perf_counter() - t0) * 1e3])[0]

    def second_call(self, first_ms: float) -> tuple[int, float]:
        """The second call, timed alone as the first was (``second_call_ms``): where a kernel builds
        what a shape needs when the shape comes back (cuDNN's graphs, :mod:`dilated.backends.graph_shapes`),
        this is the call that pays. It is the second warm-up call; taken where there are two or more
        (:func:`warmup_calls`). While a call exceeds the time budget, the next warm-up call is made
        too (up to the row's warm-up calls): a first call that compiles, or a second that builds a
        graph, over the budget is then not the row's only sample. Returns ``(calls made, the last
        one's ms)``, the same on every rank."""
        opts, made, last = self.opts, 1, first_ms
        if not warmup_calls(self.device, opts.warmup, made):
            return made, last
        with record_kernels() as ran:
            last = self.row["second_call_ms"] = self._timed_call("second call done")
        self.row["second_call_kernels"] = sorted(ran) or None
        made += 1
        while opts.budget_s is not None and last > 1e3 * opts.budget_s and warmup_calls(self.device, opts.warmup, made):
            last = self._timed_call("warm-up call done")
            made += 1
        return made, last

    def time_calls(self, last_ms: float, warmed: int = 1) -> tuple[list[list[float]], bool]:
        """The timed calls (with ``--floor``, in turns with each floor) after ``warmed`` calls, the
        last of which took ``last_ms``. Returns the samples of each timed step and whether the
        output and gradients the last call left are the step's own (then the check reads them: the
        result checked is the one timed)."""
        opts, device, impl, ranks = self.opts, self.device, self.impl, self.ranks
        timed_setup = ranks.guard(self.setup)
        if self.spread:  # ranks start each call together (a rank that failed still joins the barrier)
            timed_setup = (lambda: (ranks.guard(self.setup)(), impl.before_call())) if self.setup else impl.before_call
        # the first ``warmed`` calls were warm-up calls; with --floor each floor is timed in turns with
        # the step (dilated.bench.floor), so that its ratio is not the machine's drift; the two floors
        # take turns with the step one after the other, each freed before the next is built (at long
        # lengths the step and both floors' tensors do not fit together)
        timed = [(ranks.guard(self.step), timed_setup)]
        floor_backend = self.floor_backend() if opts.floor and not self.spread else None
        floor = None if floor_backend is None else impl.problem.kernel_floor(self.inputs, self.case, floor_backend)
        if opts.settle_s > 0:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            time.sleep(opts.settle_s)
        state_before = envmod.gpu_state(device)
        steady = 1.0 if device.type == "cuda" else 0.0

        def agree(more):  # go on only while some rank wants more calls and no rank has failed
            wants, failed = impl.reduce_max([float(more), float(ranks.error is not None)])
            return wants > 0 and failed == 0

        not_graphed = self._graph_reason(timed_setup) if opts.cuda_graph else None
        graphed = opts.cuda_graph and not_graphed is None
        if not_graphed:
            self.row["time_note"] = f"--cuda-graph: {not_graphed}; timed as eager calls"
        self.row["cuda_graph"] = graphed

        def in_turns(steps):  # floors timed in turns with the step have run no call yet
            warmup = warmup_calls(device, opts.warmup, warmed if len(steps) == 1 else 0)
            return measure_side_by_side(steps, device, warmup=warmup, reps=opts.reps,
                                        budget_s=opts.budget_s, flush_l2=opts.flush_l2,
                                        warmup_s=steady if opts.warmup_s is None else opts.warmup_s,
                                        rep_s=steady if opts.rep_s is None else opts.rep_s,
                                        agree=agree if self.collective else None, cuda_graph=graphed)

        self.row["first_call_only"] = False
        if opts.budget_s is not None and last_ms > 1e3 * opts.budget_s and floor is None and not graphed:
            runs = [[last_ms]]  # the last warm-up call took longer than the row's budget: the row's one sample
            if warmed == 1:  # no steady figure: left out of every derived number
                self.row["first_call_only"] = True
                self.row["time_note"] = (f"one call ({last_ms / 1e3:.1f} s, its first) exceeded --time-budget "
                                         f"{opts.budget_s:g} s: the only sample, not warmed up")
            else:
                self.row["time_note"] = (f"call {warmed} ({last_ms / 1e3:.1f} s) still exceeded --time-budget "
                                         f"{opts.budget_s:g} s: the only sample, after {warmed - 1} warm-up calls")
        elif floor_backend is None:
            runs = in_turns(timed)
        else:  # [step, kernel floor (None where the problem has none), step, one-call floor]
            runs = in_turns(timed + [(floor, None)]) if floor is not None else [in_turns(timed)[0], None]
            floor = None  # its tensors are freed before the one-call floor's are made
            one_call = impl.problem.one_call_floor(self.inputs, self.case, floor_backend)
            if one_call is not None:
                runs += in_turns(timed + [(one_call[0], None)])
                self.row["one_call_floor_calls"] = len(one_call[1])
                one_call = None
            elif runs[1] is None:  # the problem has neither floor: the step's calls alone, as without --floor
                runs = runs[:1]
        ranks.settle("timed calls done")
        if state_before is not None:  # the GPU's clocks and temperature before and after the timed calls
            self.row["gpu_state"] = {"before": state_before, "after": envmod.gpu_state(device),
                                     "settle_s": opts.settle_s}
        return runs, len(runs) == 1 and not graphed

    def _graph_reason(self, timed_setup) -> str | None:
        """Why this row's calls cannot be timed as CUDA-graph replays, or None."""
        if self.device.type != "cuda":
            return f"CUDA graphs need a CUDA device (this is {self.device.type})"
        if self.case.mode == "bwd":
            return "a bwd row's forward is an untimed setup before each call, which a replay cannot leave out"
        if timed_setup is not None:
            return "the ranks start each call together (a host-side barrier a replay cannot hold)"
        return None

    def floor_backend(self) -> str:
        """The kernel the floors run: the one the step ran (``auto`` resolves by shape class, and the
        floors' calls have other shapes than the step's inputs, so they would not resolve alike);
        recorded in the row as ``floor_kernel``."""
        from dilated.backends import backend_names

        ran = self.row.get("kernels") or []
        name = ran[0] if self.backend == "auto" and len(ran) == 1 and ran[0] in backend_names() else self.backend
        self.row["floor_kernel"] = name
        return name

    def record_speed(self, runs) -> float:
        """Time, FLOP/s, throughput, bandwidth and the floor ratio; returns seconds per call."""
        row, case, impl = self.row, self.case, self.impl
        if self.spread:  # each rank's own median (from the common start of a call to its own end)
            mine = statistics.median(runs[0])
            row["rank_median_ms"] = [float(t) for t in impl.all_ranks_text(repr(mine))]
            row["time_imbalance"] = max(row["rank_median_ms"]) / statistics.fmean(row["rank_median_ms"])
        samples = impl.reduce_max(runs[0])  # a distributed call lasts as long as its slowest rank
        t = summarize(samples)
        row["time_ms"], row["samples_ms"] = t, samples
        sec = t["median"] / 1e3
        fl, by = impl.flops(case, case.mode), impl.min_bytes(case, case.mode)
        peak = peak_tflops(torch.cuda.get_device_name(self.device)) if self.device.type == "cuda" else None
        ranks = impl.ranks()
        # tflops: the whole problem's useful FLOPs per second over all ranks; per GPU: over one
        row.update(flops=fl, tflops=fl / sec / 1e12, tokens_per_s=case.batch * case.nq / sec, bytes_min=by,
                   bandwidth_gbs=by / sec / 1e9, arith_intensity=fl / by, ranks=ranks)
        row["per_rank_tflops"] = row["tflops"] / ranks
        row["pct_peak"] = 100 * row["per_rank_tflops"] / peak if peak else None  # of one GPU's peak
        if len(runs) > 1 and runs[1] is not None:
            floor = summarize(runs[1])
            row["kernel_floor_ms"], row["floor_ratio"] = floor, t["median"] / floor["median"]
        if len(runs) > 2:  # the step timed again, in turns with the one-call floor
            again, one = summarize(runs[2]), summarize(runs[3])
            row["one_call_floor_ms"], row["one_call_floor_ratio"] = one, again["median"] / one["median"]
            row["one_call_floor_step_ms"] = again
        return sec

    def record_comm(self, seconds_per_call: float) -> None:
        step = (lambda: (self.setup(), self.step())) if self.setup else self.step
        comm = self.impl.comm_metrics(self.model, self.ranks.guard(step), seconds_per_call)
        self.ranks.settle("communication measured")
        if comm is not None:
            self.row["comm"] = comm

    def check(self, reuse: bool) -> None:
        """The result (of the last timed call where ``reuse``) against the float64 reference."""
        impl, ranks = self.impl, self.ranks
        with torch.enable_grad() if self.needs_grad else torch.no_grad():
            if not reuse:
                ranks.guard(self.forward_fresh)()
                if self.needs_grad:
                    ranks.guard(self.backward)()
                ranks.settle("check call done")
            grads = [impl.gather(t.grad) for t in self.inputs] if self.needs_grad else None
            full = tuple(impl.gather(t.detach()) for t in self.inputs)
            try:
                self.row["check"] = _check(impl, self.case, full, self.model, impl.gather(self.out.detach()),
                                           self.case.mode, grads, impl.gather(self.dout) if self.needs_grad else None)
            except Exception as e:  # noqa: BLE001 - a collective row agrees on it first
                ranks.record(e)
            ranks.settle("checked")

    def check_determinism(self) -> None:
        """The step twice on the same inputs: are the output and the gradients bit-identical (on
        every rank, for a distributed row)?"""
        runs = []

        def once():
            self.zero_grads()
            self.call_unguarded()
            runs.append((_bits(self.out), [_bits(t.grad) for t in self.inputs] if self.needs_grad else []))

        for _ in range(2):
            self.ranks.guard(once)()
        self.ranks.settle("determinism runs done")
        (out1, grads1), (out2, grads2) = runs
        differs = self.impl.reduce_max([float(not torch.equal(out1, out2))]
                                       + [float(not torch.equal(a, b)) for a, b in zip(grads1, grads2)])
        self.row["determinism"] = {"output_bit_identical": differs[0] == 0,
                                   "grads_bit_identical": [d == 0 for d in differs[1:]] if self.needs_grad else None,
                                   "runs": 2}

    def call_unguarded(self) -> None:
        if self.setup:
            self.setup()
        self.step()

    def profile(self) -> None:
        """One more call under torch.profiler; its Chrome/Perfetto trace, named after the row (and
        the rank, in a distributed run), goes to ``--profile``'s directory."""
        import re

        import torch.distributed as dist

        cfg, row, device = self.row["config"], self.row, self.device
        name = f"{row['implementation']}-{row['backend']}-N{cfg['seq_len']}-{cfg['mode']}"
        name += "-causal" if cfg["causal"] else ""
        name += f"-B{cfg['batch']}-H{cfg['num_heads']}-D{cfg['head_dim']}-{cfg['dtype']}"
        if cfg.get("q_len"):
            name += f"-Nq{cfg['q_len']}"
        if cfg.get("documents"):  # each document mix a trace of its own
            name += f"-docs-{cfg['documents']}"
        if cfg.get("input_scale", 1.0) != 1.0:
            name += f"-x{cfg['input_scale']:g}"
        if dist.is_available() and dist.is_initialized():
            name += f"-rank{dist.get_rank()}"
        path = os.path.join(self.opts.profile_dir, re.sub(r"[^A-Za-z0-9._-]", "_", name) + ".json")
        os.makedirs(self.opts.profile_dir, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)

        def once():
            with torch.profiler.profile(activities=activities) as prof:
                self.call_unguarded()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
            prof.export_chrome_trace(path)

        self.ranks.guard(once)()
        self.ranks.settle("profiled")
        row["profile"] = path

    def release(self) -> None:
        """Drops the row's tensors, and its recorded failure: the failure's traceback holds the frames it
        went through (the check's gathered tensors, say), and those frames hold this run, a cycle that
        only a later garbage collection would free, after the next row has allocated."""
        self.inputs = self.model = self.out = self.dout = self.step = self.setup = None
        self.ranks.error = None


class RanTheSameKernels(Exception):
    """A row whose first calls ran the kernels of a row already timed (``auto`` resolving to the
    kernel of a backend the run names): timing it again would measure the same thing twice."""


def _same_as_earlier(run: "_RowRun", same_as) -> None:
    """Raises :class:`RanTheSameKernels` where ``same_as(row)`` names an earlier row these first calls
    match, on every rank alike (each rank's kernels asked; all must match)."""
    why = same_as(run.row) if same_as is not None else None
    if run.impl.reduce_max([float(why is None)])[0] == 0:
        raise RanTheSameKernels(why)


def run_case(impl: Implementation, case: Case, backend: str, opts: RunOptions, extra: dict | None = None,
             captured=None, same_as=None) -> dict:
    """Measure one (implementation, case, backend); never raises except on Ctrl-C.

    ``captured``: a :class:`~dilated.bench.captured.Captured` whose tensors replace the random inputs.
    ``same_as``: called with the row after its first two calls (``kernels``, ``second_call_kernels``);
    a string it returns (which earlier row ran the same kernels) ends the row there as ``duplicate``.
    """
    device = torch.device(opts.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    row = {"implementation": impl.name, "backend": backend, "mode": case.mode, "config": case.config(),
           "device": str(device), "cuda_graph": False, "status": "ok", "reason": None}
    if extra:
        row.update(extra)
    if captured is not None:
        row["inputs"] = captured.path
    run = _RowRun(impl, case, backend, opts, device, row)
    try:
        run.prepare(captured)
        first_ms = run.first_call()
        warmed, last_ms = run.second_call(first_ms)
        if same_as is not None:
            _same_as_earlier(run, same_as)
        runs, reuse = run.time_calls(last_ms, warmed)
        run.record_comm(run.record_speed(runs))
        if opts.check:
            run.check(reuse)
        if opts.check_determinism:
            run.check_determinism()
        if opts.profile_dir:
            run.profile()
    except KeyboardInterrupt:
        raise
    except RanTheSameKernels as e:
        row.update(status="duplicate", reason=str(e))
    except FailedOnRanks as e:  # the same status on every rank, naming the ranks that failed and why
        row.update(status=e.status, reason=str(e)[:600], failed_ranks=[r for r, _, _ in e.failures])
        if e.local is not None and e.status == "error":
            row["traceback"] = "".join(traceback.format_exception(e.local, limit=4))
    except Exception as e:  # every failure becomes a recorded row; the sweep goes on
        status, reason = outcome(e)
        row.update(status=status, reason=reason)
        if status == "error":
            row["traceback"] = traceback.format_exc(limit=4)
    finally:
        run.release()
        free_memory(device)
    return row


def run_sweep(jobs, opts: RunOptions, writer: ResultWriter | None, script: str, progress: bool = True,
              extra_row=None, same_as=None) -> list[dict]:
    """``jobs``: iterable of ``(Implementation, Case, backend)`` or ``(..., captured)``. Rows are
    written as they finish; ``same_as`` as :func:`run_case` takes it. Progress is a tqdm bar on a
    terminal and one line per row otherwise (logs of batch jobs stay readable)."""
    jobs = list(jobs)
    rows = []
    env = envmod.environment()
    stamp = envmod.timestamp()
    cmd = envmod.command_line()
    tty = sys.stderr.isatty()
    # before the first timed row: every backend these rows use, on tiny inputs (each once a process)
    warmed = warm_up(jobs, opts.device or ("cuda" if torch.cuda.is_available() else "cpu")) if jobs else None
    bar = tqdm(jobs, desc=script, unit="run", disable=not (progress and tty), dynamic_ncols=True)
    for i, (impl, case, backend, *cap) in enumerate(bar):
        label = f"{impl.name}/{backend} N={case.seq_len} {case.mode}"
        bar.set_postfix_str(label)
        row = run_case(impl, case, backend, opts, captured=cap[0] if cap else None, same_as=same_as)
        row.update(script=script, env=env, run_timestamp=stamp, command=cmd)
        if warmed is not None and i == 0:
            row["process_warmup"] = warmed  # what ran before this row, so that its first call is its own
        if extra_row:
            row.update(extra_row(row))
        rows.append(row)
        if writer is not None:
            writer.append(row)
        if progress and not tty:
            t = row.get("time_ms", {}).get("median")
            print(f"[{i + 1}/{len(jobs)}] {label}: {row['status']}" + (f" {t:.3f} ms" if t is not None else "")
                  + (" first call only" if row.get("first_call_only") else "")
                  + (f" ({row['reason'][:100]})" if row.get("reason") else ""), file=sys.stderr, flush=True)
    return rows
