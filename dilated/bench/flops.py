"""FLOPs and bytes of useful work: one place, from the definitions.

* dense attention: ``4 * B * H * Nq * Nk_visible * D`` (two matmuls of 2 FLOPs per MAC), with the
  visible keys counted exactly (causal bottom-right aligned for Nq != Nk; GQA counted by q heads).
* dilated attention: per branch, per segment (the last one clipped), per head offset, the dense
  count over the selected rows (causal: ``n(n+1)/2`` pairs).
* backward is 2.5x forward (the recompute of S plus dQ, dK, dV: 5 matmuls against 2).
"""
from __future__ import annotations

MODE_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}

#: dense bf16/fp16 tensor-core peak (TFLOP/s) by GPU name fragment, datasheet (SXM) figures.
PEAK_TFLOPS = {"h200": 989.0, "h100": 989.0, "a100": 312.0, "b200": 2250.0, "l40s": 362.0}


def visible_pairs(nq: int, nk: int, causal: bool) -> int:
    """Number of (query, key) pairs a softmax sees; causal is bottom-right aligned."""
    if not causal:
        return nq * nk
    total = 0
    off = nk - nq
    # row i sees min(nk, max(0, i + off + 1)) keys
    first_full = max(0, nk - off)  # rows at or past this see all nk keys
    lo = max(0, -off)  # rows below this see nothing
    hi = min(nq, first_full)
    if hi > lo:  # arithmetic series of (i + off + 1) for i in [lo, hi)
        total += (hi - lo) * (lo + hi - 1 + 2 * (off + 1)) // 2
    total += max(0, nq - max(hi, lo)) * nk
    return total


def dense_flops(b: int, h: int, nq: int, nk: int, d: int, causal: bool = False, mode: str = "fwd",
                d_v: int | None = None) -> float:
    """``2 * pairs * d`` for ``QK^T`` and ``2 * pairs * d_v`` for ``PV`` (``d_v``: v's head_dim, default d)."""
    d_v = d if d_v is None else d_v
    return 2.0 * b * h * visible_pairs(nq, nk, causal) * (d + d_v) * MODE_FACTOR[mode]


def dilated_pairs(n: int, h: int, segment_lengths, dilation_rates, causal: bool = False) -> int:
    """Sum over heads, branches, segments of the (query, key) pairs the branch attends."""
    total = 0
    for w, r in zip(segment_lengths, dilation_rates):
        w = min(w, n)
        full, rem = divmod(n, w)
        for length, count in ((w, full), (rem, 1 if rem else 0)):
            if not count:
                continue
            for head in range(h):
                sel = len(range(head % r, length, r))
                total += count * visible_pairs(sel, sel, causal)
    return total


def dilated_flops(b: int, h: int, n: int, d: int, segment_lengths, dilation_rates, causal=False, mode="fwd") -> float:
    return 4.0 * b * dilated_pairs(n, h, segment_lengths, dilation_rates, causal) * d * MODE_FACTOR[mode]


def min_bytes(b: int, nq: int, nk: int, h: int, hkv: int, d: int, elem: int, mode: str = "fwd",
              d_v: int | None = None) -> float:
    """q, k, v read and out written once (fwd); bwd adds dout, out read and dq, dk, dv written."""
    d_v = d if d_v is None else d_v
    fwd = elem * b * (nq * h * (d + d_v) + nk * hkv * (d + d_v))
    if mode == "fwd":
        return float(fwd)
    bwd = elem * b * (nq * h * (2 * d + 2 * d_v) + nk * hkv * (2 * d + 2 * d_v))
    return float(bwd if mode == "bwd" else fwd + bwd)


def peak_tflops(gpu_name: str | None) -> float | None:
    if not gpu_name:
        return None
    name = gpu_name.lower()
    for key, val in PEAK_TFLOPS.items():
        if key in name:
            return val
    return None
