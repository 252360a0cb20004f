"""Timing: CUDA events around each call after warm-up, L2 flushed between calls; perf_counter on CPU."""
from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from ..parallel.agreement import group_device


def _l2_flusher(device):
    if device.type != "cuda":
        return lambda: None
    size = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20) or (50 << 20)
    buf = torch.empty(2 * size // 4, dtype=torch.int32, device=device)
    return lambda: buf.zero_()


def summarize(samples_ms: list[float]) -> dict:
    xs = sorted(samples_ms)
    n = len(xs)
    if n == 0:
        return {"n": 0}

    def pct(p):
        i = (n - 1) * p / 100
        lo, hi = math.floor(i), math.ceil(i)
        return xs[lo] + (xs[hi] - xs[lo]) * (i - lo)

    mean = sum(xs) / n
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1)) if n > 1 else 0.0
    return {"median": pct(50), "mean": mean, "std": std, "min": xs[0], "max": xs[-1],
            "p10": pct(10), "p50": pct(50), "p90": pct(90), "p95": pct(95), "p99": pct(99), "n": n}


def measure(step, device, *, warmup: int = 3, reps: int = 10, budget_s: float | None = None,
            setup=None, flush_l2: bool = True, cuda_graph: bool = False, warmup_s: float = 0.0,
            rep_s: float = 0.0, agree=None) -> list[float]:
    """Per-call times (ms) of ``step()``; ``setup()`` runs untimed before each call.

    Warm-up: ``warmup`` calls, and on until ``warmup_s`` seconds of them have run (time-based,
    as triton's ``do_bench``: a GPU at its power cap lowers its clocks within a row's calls).
    Timed calls: ``reps``, and on until ``rep_s`` seconds of them have run, so that the median
    spans the swings of a power-capped GPU's clocks rather than one phase of them.
    With ``budget_s``, warm-up (a quarter of it) and repetitions also stop once that much wall time
    is spent, after at least one timed call: long calls get fewer samples, short ones ``reps``.
    ``cuda_graph`` captures ``step`` once and times replays (``setup`` runs before each, outside the graph).
    ``agree(more) -> bool``: where several ranks time together, makes each go-on-or-stop decision
    the same on all of them (a rank that stopped alone would leave the others waiting).
    """
    return measure_side_by_side([(step, setup)], device, warmup=warmup, reps=reps, budget_s=budget_s,
                                flush_l2=flush_l2, cuda_graph=cuda_graph, warmup_s=warmup_s, rep_s=rep_s,
                                agree=agree)[0]


def measure_together(step, device, group=None, **kwargs) -> tuple[list[float], list[float]]:
    """:func:`measure` of a ``step`` that the ranks of ``group`` make together (a collective inside it),
    as the distributed rows time theirs: each call starts after a barrier (untimed), so that no rank's
    call includes waiting for another to arrive. Returns ``(each call's time on the slowest rank, on
    this rank)``; on one rank, or without a process group, both are :func:`measure`'s."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        samples = measure(step, device, **kwargs)
        return samples, samples
    own = measure(step, device, setup=lambda: dist.barrier(group=group), **kwargs)
    slowest = torch.tensor(own, dtype=torch.float64, device=group_device(group))
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return slowest.tolist(), own


def measure_side_by_side(steps, device, *, warmup: int = 3, reps: int = 10, budget_s: float | None = None,
                         flush_l2: bool = True, cuda_graph: bool = False, warmup_s: float = 0.0,
                         rep_s: float = 0.0, agree=None) -> list[list[float]]:
    """:func:`measure` for several ``(step, setup)`` pairs timed in turns (a, b, a, b, ...), so
    that a drift of the machine (clocks, temperature) during the run falls on each alike: what
    a ratio of their times needs. Returns one list of samples per pair."""
    device = torch.device(device)
    flush = _l2_flusher(device) if flush_l2 else (lambda: None)
    cuda = device.type == "cuda"
    agree = agree or bool
    if cuda_graph:  # a setup (a barrier, say) runs before each replay, outside the graph
        if not cuda:
            raise ValueError("cuda_graph timing needs a CUDA device")
        steps = [(_graphed(step, warmup), setup) for step, setup in steps]

    def more(done, least, least_s, t0, budget, min_done):
        spent = time.perf_counter() - t0
        over = budget is not None and done >= min_done and spent > budget
        return agree((done < least or spent < least_s) and not over)

    t0 = time.perf_counter()
    done = 0
    while more(done, warmup, warmup_s, t0, None if budget_s is None else budget_s / 4, 0):
        for step, setup in steps:
            if setup:
                setup()
            step()
        done += 1
        if warmup_s and cuda:  # the seconds that count are the device's
            torch.cuda.synchronize(device)
    if cuda:
        torch.cuda.synchronize(device)
    samples = [[] for _ in steps]
    t0 = time.perf_counter()
    while more(len(samples[0]), reps, rep_s, t0, budget_s, 1):
        for (step, setup), out in zip(steps, samples):
            if setup:
                setup()
            flush()
            out.append(_time_once(step, cuda))
    return samples


def _graphed(step, warmup: int):
    """``step`` captured once in a CUDA graph (after warm-up on a side stream): its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(max(1, warmup)):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def _time_once(step, cuda: bool) -> float:
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    s = time.perf_counter()
    step()
    return (time.perf_counter() - s) * 1e3
