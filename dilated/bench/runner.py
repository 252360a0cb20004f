"""Run one case of one implementation, carefully; run sweeps of them, writing each row as it ends."""
from __future__ import annotations

import math
import os
import sys
import time
import traceback
from dataclasses import dataclass

import torch
from tqdm import tqdm

from dilated.backends import BackendUnavailableError

from . import env as envmod
from .flops import peak_tflops
from .memory import PeakMemory, free_memory, is_oom, large_allocations_tracked
from .registry import Case, Implementation, device_generator
from .results import ResultWriter
from .timing import measure_side_by_side, summarize

#: relative tolerance (max |err| / max |ref|) on outputs; gradients get twice this.
TOLERANCE = {torch.float64: 1e-6, torch.float32: 2e-3, torch.bfloat16: 3e-2, torch.float16: 5e-3}
#: beyond this many score entries (B*H*Nq*Nk) the float64 reference is replaced by sampled rows.
DENSE_REFERENCE_LIMIT = 1 << 26
SAMPLED_ROWS = 64


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


class OverBudget(RuntimeError):
    pass


def _outcome(e: BaseException) -> tuple[str, str]:
    """(status, reason) of a row that raised ``e``."""
    first = str(e).splitlines()[0][:300] if str(e) else ""
    if isinstance(e, BackendUnavailableError):
        return "unsupported", str(e)
    if isinstance(e, OverBudget) or is_oom(e):
        return "oom", first
    if isinstance(e, NotImplementedError):
        return "unsupported", f"{type(e).__name__}: {first}"
    return "error", f"{type(e).__name__}: {first}"


class FailedOnRanks(RuntimeError):
    """Some ranks of a collective row failed: ``failures`` is ``[(rank, status, reason)]``."""

    def __init__(self, failures, local: BaseException | None):
        self.failures, self.local = failures, local
        by_reason = {}  # the same cause on several ranks is said once
        for r, _, why in failures:
            by_reason.setdefault(why, []).append(r)
        super().__init__("; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {why}"
                                   for why, rs in by_reason.items()))

    @property
    def status(self) -> str:
        statuses = {s for _, s, _ in self.failures}
        return next(s for s in ("error", "oom", "unsupported") if s in statuses)


class _RankFailures:
    """A row timed across ranks: a rank that fails records its first failure and goes on taking
    part in the row's collectives without doing the work; at agreed points (before any collective
    that could wait on it forever) every rank learns every rank's failure, by one small all-gather,
    and all end the row together with the same status, naming the failing ranks and causes."""

    def __init__(self, impl: Implementation, collective: bool, label: str = ""):
        self.impl, self.collective, self.error = impl, collective, None
        self.label = label

    def guard(self, fn):
        if not self.collective or fn is None:
            return fn

        def run(*args):
            if self.error is None:
                try:
                    fn(*args)
                except Exception as e:  # noqa: BLE001 - recorded; every rank learns it at the next settle()
                    self.error = e
        return run

    def record(self, e: Exception) -> None:
        """A failure outside a guarded call (raised at once on a row of one rank)."""
        if not self.collective:
            raise e
        self.error = self.error or e

    def settle(self, done: str) -> None:
        """All ranks agree on the row's outcome so far; ``done``: what the row has done by now."""
        if not self.collective:
            return
        from .distributed import checkpoint

        checkpoint(f"{self.label}: {done}")
        mine = "|".join(_outcome(self.error)) if self.error is not None else ""
        texts = self.impl.all_ranks_text(mine)
        failed = [(r, *t.split("|", 1)) for r, t in enumerate(texts) if t]
        if failed:
            raise FailedOnRanks(failed, self.error)


def _rel(x, ref):
    x, ref = x.double(), ref.double()
    err = (x - ref).abs().max().item()
    return err, err / max(ref.abs().max().item(), 1e-6)


def _check(impl, case, inputs, model, out, mode, grads, dout):
    tol = TOLERANCE[case.torch_dtype]
    b = case.batch
    pairs = b * case.num_heads * case.nq * case.seq_len
    res = {"tolerance": tol}
    if pairs <= DENSE_REFERENCE_LIMIT:
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
        ref = impl.sampled_reference(case, inputs, model, rows)
        res["reference"] = f"float32 streaming, {len(rows)} sampled rows"
        res["max_abs_err"], res["rel_err"] = _rel(out[:, rows], ref)
        if mode != "fwd":
            res["grad_check"] = "skipped: gradients are checked only where the float64 reference fits"
    res["nonfinite_outputs"] = int((~torch.isfinite(out)).sum()) if isinstance(out, torch.Tensor) else None
    if grads is not None:
        res["nonfinite_grads"] = sum(int((~torch.isfinite(g)).sum()) for g in grads if isinstance(g, torch.Tensor))
    res["passed"] = res["rel_err"] <= tol and res.get("grad_rel_err", 0.0) <= 2 * tol and math.isfinite(res["rel_err"])
    return res


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8).clone()


def _determinism(impl, ranks, inputs, holder, zero_grads, setup, step, needs_grad) -> dict:
    """Run the step twice on the same inputs: are the output and the gradients bit-identical?
    (on every rank, for a distributed row)."""
    runs = []
    for _ in range(2):
        def once():
            zero_grads()
            if setup:
                setup()
            step()
            runs.append((_bits(holder["out"]), [_bits(t.grad) for t in inputs] if needs_grad else []))
        ranks.guard(once)()
    ranks.settle("determinism runs done")
    (out1, grads1), (out2, grads2) = runs
    differs = impl.reduce_max([float(not torch.equal(out1, out2))]
                              + [float(not torch.equal(a, b)) for a, b in zip(grads1, grads2)])
    return {"output_bit_identical": differs[0] == 0,
            "grads_bit_identical": [d == 0 for d in differs[1:]] if needs_grad else None,
            "runs": 2}


def _profile(directory: str, row: dict, device, ranks, setup, step) -> str:
    """One more call of the step under torch.profiler; its Chrome/Perfetto trace, named after the
    row (and the rank, in a distributed run), goes to ``directory``. Returns the path."""
    import re

    import torch.distributed as dist

    cfg = row["config"]
    name = f"{row['implementation']}-{row['backend']}-N{cfg['seq_len']}-{cfg['mode']}"
    name += "-causal" if cfg["causal"] else ""
    name += f"-B{cfg['batch']}-H{cfg['num_heads']}-D{cfg['head_dim']}-{cfg['dtype']}"
    if cfg.get("q_len"):
        name += f"-Nq{cfg['q_len']}"
    if cfg.get("input_scale", 1.0) != 1.0:
        name += f"-x{cfg['input_scale']:g}"
    if dist.is_available() and dist.is_initialized():
        name += f"-rank{dist.get_rank()}"
    path = os.path.join(directory, re.sub(r"[^A-Za-z0-9._-]", "_", name) + ".json")
    os.makedirs(directory, exist_ok=True)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)

    def once():
        with torch.profiler.profile(activities=activities) as prof:
            if setup:
                setup()
            step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        prof.export_chrome_trace(path)

    ranks.guard(once)()
    ranks.settle("profiled")
    return path


def run_case(impl: Implementation, case: Case, backend: str, opts: RunOptions, extra: dict | None = None,
             captured=None) -> dict:
    """Measure one (implementation, case, backend); never raises except on Ctrl-C.

    ``captured``: a :class:`~dilated.bench.captured.Captured` whose tensors replace the random inputs.
    """
    device = torch.device(opts.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    row = {"implementation": impl.name, "backend": backend, "mode": case.mode, "config": case.config(),
           "device": str(device), "cuda_graph": opts.cuda_graph, "status": "ok", "reason": None}
    if extra:
        row.update(extra)
    if captured is not None:
        row["inputs"] = captured.path
    inputs = model = out = grads = None
    collective = type(impl).reduce_max is not Implementation.reduce_max  # ranks time together
    ranks = _RankFailures(impl, collective, f"{impl.name}/{backend} N={case.seq_len} {case.mode}")
    try:
        gen = torch.Generator().manual_seed(opts.seed)
        needs_grad = case.mode != "fwd"
        holder = {}
        try:
            inputs = impl.inputs(case, device, gen, needs_grad, captured.tensors if captured is not None else None)
            model = impl.build(case, backend)
            if isinstance(model, torch.nn.Module):
                model = model.to(device=device, dtype=case.torch_dtype)
        except Exception as e:  # noqa: BLE001 - a collective row agrees on it first (settle below)
            ranks.record(e)

        def fwd():
            holder["out"] = model(*inputs)

        def zero_grads():
            for t in list(inputs) + (list(model.parameters()) if isinstance(model, torch.nn.Module) else []):
                t.grad = None

        if case.mode == "fwd":
            step, setup = (lambda: torch.no_grad()(fwd)()), None
        elif case.mode == "fwd_bwd":
            def step():
                zero_grads()
                fwd()
                holder["out"].backward(holder["dout"])
            setup = None
        else:  # bwd: forward untimed in setup, backward timed
            def setup():
                zero_grads()
                fwd()

            def step():
                holder["out"].backward(holder["dout"])
        holder["dout"] = None

        def make_dout():  # the output's shape and dtype for the incoming gradient
            with torch.enable_grad():
                out_probe = model(*inputs)
            holder["dout"] = torch.randn(out_probe.shape, generator=device_generator(gen, device), device=device,
                                         dtype=out_probe.dtype)

        if needs_grad and ranks.error is None:
            ranks.guard(make_dout)()
        ranks.settle("inputs built")
        with PeakMemory(device) as mem:
            if setup:
                ranks.guard(setup)()
            t_first = time.perf_counter()
            ranks.guard(step)()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            ranks.settle("first call done")
            first_ms = impl.reduce_max([(time.perf_counter() - t_first) * 1e3])[0]  # the same on every rank
        if mem.peak_total_mib is not None:
            mem.peak_above_mib, mem.peak_total_mib = impl.reduce_max([mem.peak_above_mib, mem.peak_total_mib])
        row["memory"] = {"peak_above_inputs_mib": mem.peak_above_mib, "peak_total_mib": mem.peak_total_mib,
                         # dense: what materialising the scores would take (how much a fused kernel avoids)
                         "score_matrix_mib": (case.batch * case.num_heads * case.nq * case.seq_len
                                              * torch.empty((), dtype=case.torch_dtype).element_size() / (1 << 20)
                                              if impl.kind == "dense" else None),
                         "min_theoretical_mib": impl.min_bytes(case, case.mode) / (1 << 20),
                         "measure": "cuda allocator" if device.type == "cuda" else
                         "process peak RSS" + ("" if large_allocations_tracked() else
                                               " (glibc's mmap threshold not pinned: freed heap memory reused by "
                                               "a call does not show; see memory.track_large_allocations)")}
        if opts.memory_budget_mib is not None and (mem.peak_above_mib or 0) > opts.memory_budget_mib:
            raise OverBudget(f"peak {mem.peak_above_mib:.1f} MiB exceeds the memory budget of {opts.memory_budget_mib} MiB")
        timed_setup = ranks.guard(setup)
        spread = type(impl).before_call is not Implementation.before_call  # runs across ranks
        if spread:  # ranks start each call together (a rank that failed still joins the barrier)
            timed_setup = (lambda: (ranks.guard(setup)(), impl.before_call())) if setup else impl.before_call
        # the memory call above was the first warm-up call; with --floor the kernel floor is timed
        # in turns with the step (dilated.bench.floor), so that the ratio is not the machine's drift
        timed = [(ranks.guard(step), timed_setup)]
        if opts.floor and impl.kind == "dilated" and not spread:
            from .floor import kernel_floor_step

            timed.append((kernel_floor_step(*inputs, case.segment_lengths, case.dilation_rates, case.causal,
                                            backend, case.mode), None))
        if opts.settle_s > 0:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            time.sleep(opts.settle_s)
        state_before = envmod.gpu_state(device)
        steady = 1.0 if device.type == "cuda" else 0.0

        def agree(more):  # go on only while some rank wants more calls and no rank has failed
            wants, failed = impl.reduce_max([float(more), float(ranks.error is not None)])
            return wants > 0 and failed == 0

        graphed = opts.cuda_graph and case.mode == "fwd" and timed_setup is None
        if opts.budget_s is not None and first_ms > 1e3 * opts.budget_s and len(timed) == 1 and not graphed:
            # one call already took longer than the row's budget: that call is the row's one sample
            runs = [[first_ms]]
            row["time_note"] = (f"one call ({first_ms / 1e3:.1f} s, its first) exceeded --time-budget "
                                f"{opts.budget_s:g} s: the only sample, not warmed up")
        else:
            runs = measure_side_by_side(timed, device, warmup=max(0, opts.warmup - 1), reps=opts.reps,
                                        budget_s=opts.budget_s, flush_l2=opts.flush_l2,
                                        warmup_s=steady if opts.warmup_s is None else opts.warmup_s,
                                        rep_s=steady if opts.rep_s is None else opts.rep_s,
                                        agree=agree if collective else None, cuda_graph=graphed)
        ranks.settle("timed calls done")
        # the last call of the step left its output (and gradients) in place: the check reads them,
        # so that the result checked is the one timed, and a long row does not run again
        reuse = len(timed) == 1 and not graphed
        del timed
        if state_before is not None:  # the GPU's clocks and temperature before and after the timed calls
            row["gpu_state"] = {"before": state_before, "after": envmod.gpu_state(device), "settle_s": opts.settle_s}
        samples = impl.reduce_max(runs[0])  # a distributed call lasts as long as its slowest rank
        t = summarize(samples)
        row["time_ms"] = t
        row["samples_ms"] = samples
        sec = t["median"] / 1e3
        fl = impl.flops(case, case.mode)
        by = impl.min_bytes(case, case.mode)
        row["flops"] = fl
        row["tflops"] = fl / sec / 1e12
        row["tokens_per_s"] = case.batch * case.nq / sec
        peak = peak_tflops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
        row["pct_peak"] = 100 * row["tflops"] / peak if peak else None
        row["bytes_min"] = by
        row["bandwidth_gbs"] = by / sec / 1e9
        row["arith_intensity"] = fl / by
        if len(runs) > 1:
            floor = summarize(runs[1])
            row["kernel_floor_ms"] = floor
            row["floor_ratio"] = t["median"] / floor["median"]
        comm = impl.comm_metrics(model, ranks.guard((lambda: (setup(), step())) if setup else step), sec)
        ranks.settle("communication measured")
        if comm is not None:
            row["comm"] = comm
        if opts.check:
            with torch.enable_grad() if needs_grad else torch.no_grad():
                if not reuse:
                    ranks.guard(zero_grads)()
                    ranks.guard(fwd)()
                    if needs_grad:
                        ranks.guard(lambda: holder["out"].backward(holder["dout"]))()
                    ranks.settle("check call done")
                out = holder["out"]
                grads = [impl.gather(t.grad) for t in inputs] if needs_grad else None
                full = tuple(impl.gather(t.detach()) for t in inputs)
                try:
                    row["check"] = _check(impl, case, full, model, impl.gather(out.detach()), case.mode, grads,
                                          impl.gather(holder["dout"]) if needs_grad else None)
                except Exception as e:  # noqa: BLE001 - a collective row agrees on it first
                    ranks.record(e)
                ranks.settle("checked")
            row["check_failed"] = not row["check"]["passed"]
        if opts.check_determinism:
            row["determinism"] = _determinism(impl, ranks, inputs, holder, zero_grads, setup, step, needs_grad)
        if opts.profile_dir:
            row["profile"] = _profile(opts.profile_dir, row, device, ranks, setup, step)
    except KeyboardInterrupt:
        raise
    except FailedOnRanks as e:  # the same status on every rank, naming the ranks that failed and why
        row.update(status=e.status, reason=str(e)[:600], failed_ranks=[r for r, _, _ in e.failures])
        if e.local is not None and e.status == "error":
            row["traceback"] = "".join(traceback.format_exception(e.local, limit=4))
    except Exception as e:  # every failure becomes a recorded row; the sweep goes on
        status, reason = _outcome(e)
        row.update(status=status, reason=reason)
        if status == "error":
            row["traceback"] = traceback.format_exc(limit=4)
    finally:
        inputs = model = out = grads = None
        free_memory(device)
    return row


def run_sweep(jobs, opts: RunOptions, writer: ResultWriter | None, script: str, progress: bool = True,
              extra_row=None) -> list[dict]:
    """``jobs``: iterable of ``(Implementation, Case, backend)`` or ``(..., captured)``. Rows are
    written as they finish. Progress is a tqdm bar on a terminal and one line per row otherwise
    (logs of batch jobs stay readable)."""
    jobs = list(jobs)
    rows = []
    env = envmod.environment()
    stamp = envmod.timestamp()
    cmd = envmod.command_line()
    tty = sys.stderr.isatty()
    bar = tqdm(jobs, desc=script, unit="run", disable=not (progress and tty), dynamic_ncols=True)
    for i, (impl, case, backend, *cap) in enumerate(bar):
        label = f"{impl.name}/{backend} N={case.seq_len} {case.mode}"
        bar.set_postfix_str(label)
        row = run_case(impl, case, backend, opts, captured=cap[0] if cap else None)
        row.update(script=script, env=env, run_timestamp=stamp, command=cmd)
        if extra_row:
            row.update(extra_row(row))
        rows.append(row)
        if writer is not None:
            writer.append(row)
        if progress and not tty:
            t = row.get("time_ms", {}).get("median")
            print(f"[{i + 1}/{len(jobs)}] {label}: {row['status']}" + (f" {t:.3f} ms" if t is not None else "")
                  + (f" ({row['reason'][:100]})" if row.get("reason") else ""), file=sys.stderr, flush=True)
    return rows
