"""What one GPU type measured, as :mod:`dilated.bench.planner` reads it: local attention kernel times
per call shape and on packed documents, communication times per pattern and size, and decode steps.

A calibration is written by ``dilated-bench calibrate`` (:mod:`dilated.bench.planner.measure`) on
the GPUs at hand and saved as JSON; ``dilated-bench plan`` reads it. Nothing in it is a constant of
the code: every number is a measurement, kept with the device and software that made it.
"""
from __future__ import annotations

import bisect
import dataclasses
import json
import math
import statistics
from dataclasses import dataclass, field

FORMAT = 1

#: communication patterns of a calibration, by what each rank moves (see :class:`Curve`)
PATTERNS = {
    "p2p": "each rank sends a buffer to the next rank and receives one from the previous (batched send/recv)",
    "copy_engine": "each rank pulls a buffer from the previous rank's memory by the copy engine",
    "all_to_all": "all_to_all_single: (P-1)/P of each rank's buffer leaves it",
    "all_gather": "all_gather_into_tensor: each rank receives the P-1 other ranks' buffers",
    "reduce_scatter": "reduce_scatter_tensor: each rank sends (P-1)/P of its buffer",
}


@dataclass
class Curve:
    """Time of one pattern by the bytes each rank moves over its link (``moved``): measured points,
    interpolated linearly between them and extended by the latency and bandwidth fitted to them
    (:meth:`fit`) beyond."""

    moved: list[float]
    ms: list[float]
    ranks: int = 2

    def __post_init__(self):
        if len(self.moved) != len(self.ms) or not self.moved:
            raise ValueError("a curve needs one time per size, and at least one")
        order = sorted(range(len(self.moved)), key=self.moved.__getitem__)
        self.moved = [float(self.moved[i]) for i in order]
        self.ms = [float(self.ms[i]) for i in order]

    def fit(self) -> tuple[float, float]:
        """``(latency_ms, bytes per ms)``: the smallest size's time as latency, the bandwidth of the
        largest sizes (the slope between the two largest, or the largest alone)."""
        lat = self.ms[0]
        if len(self.moved) == 1:
            return lat, self.moved[0] / max(self.ms[0], 1e-9)
        dx, dy = self.moved[-1] - self.moved[-2], self.ms[-1] - self.ms[-2]
        slope = dy / dx if dx > 0 and dy > 0 else self.ms[-1] / self.moved[-1]
        return lat, 1.0 / slope

    @property
    def latency_us(self) -> float:
        return self.fit()[0] * 1e3

    @property
    def bandwidth_gbs(self) -> float:
        return self.fit()[1] * 1e3 / 1e9

    def time_ms(self, moved: float) -> float:
        """Milliseconds to move ``moved`` bytes per rank (0: nothing to wait for)."""
        if moved <= 0:
            return 0.0
        xs, ys = self.moved, self.ms
        if moved <= xs[0]:
            return ys[0]
        if moved >= xs[-1]:
            lat, bw = self.fit()
            return ys[-1] + (moved - xs[-1]) / bw
        i = bisect.bisect_right(xs, moved)
        t = (moved - xs[i - 1]) / (xs[i] - xs[i - 1])
        return ys[i - 1] + t * (ys[i] - ys[i - 1])


@dataclass(frozen=True)
class KernelPoint:
    """One timed local attention call: ``batch`` sequences of ``length`` rows (q and k/v), heads,
    causal or not, ``mode`` ``"fwd"`` or ``"fwd_bwd"``; median milliseconds."""

    heads: int
    kv_heads: int
    head_dim: int
    causal: bool
    mode: str
    length: int
    batch: int
    ms: float
    kernel: str = ""
    slowest_ms: float | None = None  # the slowest rank's median where several ranks timed it at once


@dataclass(frozen=True)
class StrategyPoint:
    """One timed call of a sequence-parallel strategy (a benchmark name of
    :data:`dilated.bench.strategies.RING_IMPLEMENTATIONS`) on all ``ranks`` at once, as the distributed
    benchmark times it (the ranks start together; the slowest rank's median): where it took longer
    than the model's kernels and bytes (the host's pace), a floor under the predictions of larger
    calls of its kind (:meth:`~dilated.bench.planner.schedules.Model.floor_ms`)."""

    strategy: str
    ranks: int
    mode: str
    seq_len: int
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool
    documents: str | None
    ms: float


@dataclass(frozen=True)
class DocumentPoint:
    """One timed ``dilated.attention`` call on packed documents ``cu`` (cumulative lengths): what the
    documents path costs beyond its kernels (gathers into batched calls, launches) is read off it."""

    heads: int
    kv_heads: int
    head_dim: int
    causal: bool
    mode: str
    cu: tuple
    ms: float


@dataclass(frozen=True)
class DecodePoint:
    """One timed decode step (:func:`dilated.decode_attention`, one query token) on ``ranks`` ranks
    (1: one GPU alone, no collective), each holding ``tokens`` cached rows of ``batch`` sequences;
    ``cuda_graph``: replays of the step captured in a CUDA graph (the host's launches left out, as
    serving engines run decode), else the step called from Python."""

    ranks: int
    batch: int
    tokens: int
    heads: int
    kv_heads: int
    head_dim: int
    ms: float
    cuda_graph: bool = False


@dataclass
class Calibration:
    """A GPU type's measurements. ``links``: pattern -> :class:`Curve` among the GPUs of one node;
    ``nodes``: the hosts the ranks ran on (links measured across nodes where more than one);
    ``memory_gib``: one GPU's memory; ``varlen_kernel``: the varlen entry point the backend runs packed
    documents' rectangles on (None: each rectangle is its own dense call); ``documents``: calls on
    packed documents; ``decode``: decode steps; ``strategies``: calls of the sequence-parallel
    strategies on the calibration's ranks; ``document_halves``: whether the backend ran non-causal
    packed documents padded to bucket lengths, in causal halves (:func:`dilated.packed.halves_backend`;
    False: a call per document length, as calibrations that do not say ran them)."""

    device: str
    gpus: int
    memory_gib: float
    software: dict
    kernels: list[KernelPoint] = field(default_factory=list)
    links: dict[str, Curve] = field(default_factory=dict)
    documents: list[DocumentPoint] = field(default_factory=list)
    decode: list[DecodePoint] = field(default_factory=list)
    strategies: list[StrategyPoint] = field(default_factory=list)
    backend: str = "auto"
    varlen_kernel: str | None = None
    document_halves: bool = False
    nodes: int = 1
    command: str = ""
    created: str = ""

    def save(self, path: str) -> None:
        data = dataclasses.asdict(self)
        data["format"] = FORMAT
        with open(path, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")

    @classmethod
    def load(cls, path: str) -> "Calibration":
        """Read ``path``; ValueError naming the file where it is not a calibration of this format."""
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"--calibration {path}: cannot read it ({e}); write one with dilated-bench calibrate")
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"--calibration {path}: not a calibration of format {FORMAT} "
                             "(write one with dilated-bench calibrate)")
        try:
            data.pop("format")
            data["kernels"] = [KernelPoint(**k) for k in data.get("kernels", [])]
            data["links"] = {name: Curve(**c) for name, c in data.get("links", {}).items()}
            data["documents"] = [DocumentPoint(**{**d, "cu": tuple(d["cu"])}) for d in data.get("documents", [])]
            data["decode"] = [DecodePoint(**d) for d in data.get("decode", [])]
            data["strategies"] = [StrategyPoint(**d) for d in data.get("strategies", [])]
            cal = cls(**data)
        except (TypeError, ValueError) as e:
            raise ValueError(f"--calibration {path}: malformed ({e})") from None
        if not cal.kernels:
            raise ValueError(f"--calibration {path}: holds no kernel times")
        return cal

    def slowest_rank_pace(self) -> float:
        """How much longer the slowest rank's kernels take than the ranks' mean when all of them run at
        once (GPUs of one type differ in clocks under their power caps): the median over the kernel
        points of at least 1 ms that several ranks timed; 1.0 where none did."""
        ratios = [p.slowest_ms / p.ms for p in self.kernels if p.slowest_ms and p.ms >= 1.0]
        return statistics.median(ratios) if ratios else 1.0

    def describe(self) -> str:
        """One paragraph: the device, the software, the links' fitted latency and bandwidth."""
        links = "; ".join(f"{name} {c.latency_us:.0f} us + {c.bandwidth_gbs:.0f} GB/s" for name, c in self.links.items())
        cache = f"; {len(self.decode)} decode steps" if self.decode else ""
        pace = self.slowest_rank_pace()
        slowest = f"; the slowest rank's kernels {pace:.3f}x the mean" if pace != 1.0 else ""
        strategies = f"; {len(self.strategies)} strategy calls" if self.strategies else ""
        sw = ", ".join(f"{k} {v}" for k, v in self.software.items() if v)
        where = f" on {self.nodes} nodes" if self.nodes > 1 else ""
        return (f"{self.device} x{self.gpus}{where} ({self.memory_gib:.0f} GiB each; {sw}); kernels: {len(self.kernels)} "
                f"timed call shapes and {len(self.documents)} document mixes on backend {self.backend}; "
                f"links {'between nodes' if self.nodes > 1 else 'within a node'}: {links or 'none measured'}{cache}"
                f"{slowest}{strategies}")


def log_interp(x: float, xs: list[float], ys: list[float]) -> float:
    """``ys`` at ``x``, linear in ``log x`` between the points (sorted ``xs``), constant beyond them."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_right(xs, x)
    t = (math.log(x) - math.log(xs[i - 1])) / (math.log(xs[i]) - math.log(xs[i - 1]))
    return ys[i - 1] + t * (ys[i] - ys[i - 1])
