"""A calibration made from known rules, for the planner's tests: a kernel rate linear in the
logarithms of the call's length and work (so the model's interpolation between its points is exact
and any other answer is a bug), links that take ``latency + bytes / bandwidth``, decode steps that
take ``latency + bytes / bandwidth``."""
import dataclasses
import math

from dilated.bench.flops import dense_flops
from dilated.bench.planner.calibration import Calibration, Curve, DecodePoint, KernelPoint
from dilated.bench.planner.measure import kernel_batches, kernel_lengths

SHAPES = [(32, 8, 128), (16, 16, 128)]
LINK_MS = 0.02  # latency of every link pattern
LINK_BYTES_PER_MS = 2e8  # 200 GB/s


def true_rate(length: float, work: float) -> float:
    """Forward FLOPs per ms of a call of ``length`` rows giving the GPU ``work`` = batch x rows x heads."""
    return 1e11 + 2e10 * math.log(length) + 1e10 * math.log(work)


def true_ms(batch, lq, lk, heads, head_dim, causal, mode) -> float:
    """What the model must predict for one call (square calls; rectangles use the geometric mean length)."""
    length = lq if lq == lk else math.sqrt(lq * lk)
    return dense_flops(batch, heads, lq, lk, head_dim, causal and lq == lk, mode) / true_rate(length, batch * lq * heads)


def link(latency=LINK_MS, per_ms=LINK_BYTES_PER_MS) -> Curve:
    sizes = [float(1 << e) for e in range(16, 31, 2)]
    return Curve(sizes, [latency + s / per_ms for s in sizes], 2)


def calibration(links=None, decode=True, longest=65536, **fields) -> Calibration:
    points = []
    for h, hkv, d in SHAPES:
        for mode in ("fwd", "fwd_bwd"):
            for causal in (True, False):
                for n in kernel_lengths(longest):
                    for b in kernel_batches(n):
                        points.append(KernelPoint(h, hkv, d, causal, mode, n, b, true_ms(b, n, n, h, d, causal, mode)))
    if links is None:
        links = {name: link() for name in ("p2p", "copy_engine", "all_to_all", "all_gather", "reduce_scatter")}
    steps = []
    if decode:
        for ranks in (1, 2):
            for b in (1, 8):
                for s in (1 << 14, 1 << 17, 1 << 19):
                    steps.append(DecodePoint(ranks, b, s, 32, 8, 128, decode_ms(ranks, b * s * 8 * 128 * 4)))
    return Calibration(device="Synthetic GPU", gpus=2, memory_gib=80.0, software={"torch": "test"}, kernels=points,
                       links=links, decode=steps, **fields)


def with_graph_decode(cal: Calibration, speedup: float = 4.0) -> Calibration:
    """``cal`` with each decode step also timed as CUDA-graph replays, ``speedup`` times faster."""
    cal.decode = cal.decode + [dataclasses.replace(d, ms=d.ms / speedup, cuda_graph=True) for d in cal.decode]
    return cal


def decode_ms(ranks: int, cache_bytes: float) -> float:
    """A decode step reading ``cache_bytes`` per rank: 0.05 ms, plus 0.1 ms of merge on several ranks, plus 2 TB/s."""
    return 0.05 + (0.1 if ranks > 1 else 0.0) + cache_bytes / 2e9
