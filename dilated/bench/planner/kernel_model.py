"""Local attention time per call shape, from a calibration's timed calls.

A call's time is its FLOPs over the rate measured for calls like it: the calibration times, per head
dim, GQA ratio, causal and mode, calls of lengths 128 .. 64K rows, each as one sequence and as
batches that fill the GPU. The rate of a call is read off those points by its length and by how
much work it gives the GPU at once (batch x length x heads), each linearly in the logarithm;
constant beyond the lengths measured and past the most work measured (the GPU is full), and
falling on below the least work measured at a length (fewer heads), never so far that a call with
less work takes longer. Documents are timed in the calls the library makes for them
(:func:`dilated.packed.document_calls`: one batched call per length or causal bucket, the small
ones together in one varlen call), so the model's calls are the code's, with what the documents path
costs beyond its kernels read off the calibration's timed document mixes (their time less their
kernels'): per call (launches) and per element of q, k, v and out in batched calls (gathered into
them, scattered back), where the mixes part the two (many calls, and one call of many rows); per
call alone from a calibration of one mix. Where the
documents path runs a varlen kernel (flash-attn 4's, with ``auto``), a block's documents are one
call of it (:meth:`KernelModel.varlen_ms`).
"""
from __future__ import annotations

import math
import statistics
from collections import defaultdict

from ...packed import document_calls, small_rectangles, split_small_calls
from .calibration import Calibration, log_interp


def call_flops(batch: int, lq: int, lk: int, heads: int, head_dim: int, causal: bool) -> float:
    """Forward FLOPs of one call (two matmuls; causal: the visible pairs of bottom-right aligned
    rows, about half a square)."""
    pairs = lq * lk - (lq * (lq - 1) / 2 if lq <= lk else lq * lk / 2) if causal else lq * lk
    return 4.0 * batch * pairs * heads * head_dim


ELEM = 2  # bytes of a bf16 / fp16 element


def _elements(rows: int, heads: int, kv_heads: int, head_dim: int) -> int:
    """Elements of q, k, v and out in ``rows`` rows."""
    return rows * (2 * heads + 2 * kv_heads) * head_dim


def _per_call_and_element(mixes) -> tuple[float, float]:
    """``(ms per call, ms per element)`` from ``(documents, calls, elements, ms beyond the kernels)`` of
    timed mixes: least squares where there are mixes of other documents to part the two, else all of
    it per call."""
    if len({cu for cu, _, _, _ in mixes}) < 2:
        return sum(ms / c for _, c, _, ms in mixes if c) / max(1, sum(1 for _, c, _, _ in mixes if c)), 0.0
    mixes = [(c, e, ms) for _, c, e, ms in mixes]
    scale = max(c for c, _, _ in mixes) / max(e for _, e, _ in mixes)  # elements to calls' magnitude
    rows = [(float(c), e * scale, ms) for c, e, ms in mixes]
    saa = sum(a * a for a, _, _ in rows)
    sab = sum(a * b for a, b, _ in rows)
    sbb = sum(b * b for _, b, _ in rows)
    say = sum(a * y for a, _, y in rows)
    sby = sum(b * y for _, b, y in rows)
    det = saa * sbb - sab * sab
    per_call, per_element = (say * sbb - sby * sab) / det, (saa * sby - sab * say) / det * scale
    if per_call < 0:  # the rows alone explain it (least squares of that term alone)
        return 0.0, max(0.0, sby / sbb) * scale
    if per_element < 0:  # the calls alone
        return max(0.0, say / saa), 0.0
    return per_call, per_element


class KernelModel:
    """Milliseconds of local attention calls on the calibrated GPU."""

    def __init__(self, calibration: Calibration):
        self.calibration = calibration
        # whether the documents path runs a block's documents in one call of the calibrated varlen
        # kernel: auto takes flash-attn 4's wherever it runs; torch's only where auto's dense pick for
        # the shard is torch's flash kernel, which calibrations before the probe at long rows recorded
        # from a 128-row probe, so an auto calibration naming it is read as batched calls
        self.varlen_documents = calibration.varlen_kernel is not None and (
            calibration.backend != "auto" or calibration.varlen_kernel == "flash_attn_4_varlen")
        # non-causal documents padded to bucket lengths, a call with padding in two causal halves
        self.halves = calibration.document_halves and not self.varlen_documents
        # kernel time predicted since the last reset, and the part of it below a length's least-work point
        self.extrapolated_ms = self.total_ms = 0.0
        # since the last reset: the head shapes (heads, kv heads, head dim) of those calls that no calibrated
        # call had (a Ulysses rank's share of the heads, say): calibrating them would time them
        self.uncalibrated_shapes = set()
        self._shapes = {(p.heads, p.kv_heads, p.head_dim) for p in calibration.kernels}
        # the most bytes a batched documents call held at once since the last reset (its gathered rows)
        self.peak_bytes = 0.0
        # every time multiplied by this: the calibration's slowest rank's pace where several ranks run at once
        self.pace = 1.0
        table = defaultdict(lambda: defaultdict(list))  # (d, ratio, causal, mode) -> length -> [(work, rate)]
        for p in calibration.kernels:
            rate = call_flops(p.batch, p.length, p.length, p.heads, p.head_dim, p.causal) / p.ms
            table[(p.head_dim, p.heads // p.kv_heads, p.causal, p.mode)][p.length].append(
                (p.batch * p.length * p.heads, rate))
        self._table = {key: {n: sorted(pts) for n, pts in by_len.items()} for key, by_len in table.items()}
        # (d, ratio, causal, mode) -> what a documents call costs beyond its kernel: (ms per call, ms
        # per element of q, k, v and out in batched calls: the gathers into them and the scatters back),
        # and what the one call of small documents takes over its modelled kernel time (a factor, read
        # off the mixes whose small call is most of their kernel time)
        self._extra, self._small_factor = {}, {}
        mixes, shorts = defaultdict(list), defaultdict(list)
        for p in calibration.documents:
            key = (p.head_dim, p.heads // p.kv_heads, p.causal, p.mode)
            big, small, calls, rows = self._documents_parts(p.cu, 1, p.heads, p.kv_heads, p.head_dim, p.causal,
                                                            p.mode)
            point = (tuple(p.cu), big, small, calls, _elements(rows, p.heads, p.kv_heads, p.head_dim), p.ms)
            (shorts if small > big else mixes)[key].append(point)
        for key in mixes:
            factor = 1.0
            for _ in range(100):  # the two depend on each other: alternate until they settle
                self._extra[key] = _per_call_and_element(
                    [(cu, c, e, max(0.0, ms - big - factor * small)) for cu, big, small, c, e, ms in mixes[key]])
                if not shorts.get(key):
                    break
                per_call, per_element = self._extra[key]
                last, factor = factor, statistics.median(max(0.0, ms - big - c * per_call - e * per_element) / small
                                                         for _, big, small, c, e, ms in shorts[key])
                if abs(factor - last) < 1e-9:
                    break
            self._small_factor[key] = factor

    def _points(self, head_dim: int, ratio: int, causal: bool, mode: str):
        key = (head_dim, ratio, causal, mode)
        if key in self._table:
            return self._table[key]
        near = [k for k in self._table if k[0] == head_dim and k[2] == causal and k[3] == mode]
        if not near:
            have = sorted({(k[0], k[1]) for k in self._table})
            raise ValueError(f"the calibration has no {'causal' if causal else 'non-causal'} {mode} calls of head dim "
                             f"{head_dim} (it has head dim, GQA ratio: {have}); calibrate with --head-shapes "
                             f"including this head dim")
        return self._table[min(near, key=lambda k: abs(math.log(k[1] / ratio)))]

    def _rate(self, length: float, work: float, head_dim: int, ratio: int, causal: bool, mode: str) -> float:
        by_len = self._points(head_dim, ratio, causal, mode)
        lengths = sorted(by_len)

        def at(n):
            pts = by_len[n]
            (w0, r0) = pts[0]
            if work >= w0:
                return log_interp(work, [w for w, _ in pts], [r for _, r in pts])
            # less work than any call measured at this length (fewer heads): the rate falls on, linearly
            # in the logarithm as between this length's two least-work points (or the nearest length's
            # that has two), but no call takes longer than the least-work one
            two = by_len[n] if len(pts) > 1 else by_len[min((m for m in lengths if len(by_len[m]) > 1),
                                                            key=lambda m: abs(math.log(m / n)), default=n)]
            (a0, b0) = two[0]
            more = [pt for pt in two[1:] if pt[0] > a0]  # calls of as little work tell no slope
            if not more:
                return r0
            (a1, b1) = more[0]
            slope = (b1 - b0) / math.log(a1 / a0)
            return max(r0 + slope * math.log(work / w0), r0 * work / w0)
        return log_interp(length, lengths, [at(n) for n in lengths])

    def call_ms(self, lq: int, lk: int, batch: int, heads: int, kv_heads: int, head_dim: int, causal: bool,
                mode: str) -> float:
        """One call of ``batch`` x ``lq`` query rows over ``lk`` key rows; ``mode``: ``"fwd"``,
        ``"fwd_bwd"`` or ``"bwd"`` (the backward alone: fwd_bwd less fwd)."""
        if lq <= 0 or lk <= 0 or batch <= 0:
            return 0.0
        if mode == "bwd":
            return max(0.0, self.call_ms(lq, lk, batch, heads, kv_heads, head_dim, causal, "fwd_bwd")
                       - self.call_ms(lq, lk, batch, heads, kv_heads, head_dim, causal, "fwd"))
        square = lq == lk
        length = lq if square else math.sqrt(lq * lk)
        work = batch * lq * heads
        rate = self._rate(length, work, head_dim, heads // kv_heads, causal and square, mode)
        ms = call_flops(batch, lq, lk, heads, head_dim, causal and square) / rate * self.pace
        self.total_ms += ms
        if work < self._least_work(length, head_dim, heads // kv_heads, causal and square, mode):
            self._extrapolated(ms, heads, kv_heads, head_dim)
        return ms

    def _extrapolated(self, ms: float, heads: int, kv_heads: int, head_dim: int) -> None:
        self.extrapolated_ms += ms
        if (heads, kv_heads, head_dim) not in self._shapes:
            self.uncalibrated_shapes.add((heads, kv_heads, head_dim))

    def _least_work(self, length, head_dim, ratio, causal, mode) -> float:
        """The least work measured at the calibrated lengths around ``length`` (the nearer ones on each side)."""
        by_len = self._points(head_dim, ratio, causal, mode)
        below = [n for n in by_len if n <= length]
        above = [n for n in by_len if n >= length]
        sides = ([max(below)] if below else []) + ([min(above)] if above else [])
        return min(by_len[n][0][0] for n in sides)

    def _extra_costs(self, head_dim: int, ratio: int, causal: bool, mode: str) -> tuple[float, float]:
        if mode == "bwd":
            (a1, b1), (a0, b0) = (self._extra_costs(head_dim, ratio, causal, m) for m in ("fwd_bwd", "fwd"))
            return max(0.0, a1 - a0), max(0.0, b1 - b0)
        keys = [k for k in self._extra if k[0] == head_dim and k[2] == causal and k[3] == mode]
        if not keys:
            return 0.0, 0.0
        per_call, per_element = self._extra[min(keys, key=lambda k: abs(math.log(k[1] / ratio)))]
        return per_call * self.pace, per_element * self.pace

    def per_call_ms(self, head_dim: int, ratio: int, causal: bool, mode: str) -> float:
        """What one call of the documents path costs beyond its kernel and its rows (launching), from the
        calibration's document mixes (0 where it has none)."""
        return self._extra_costs(head_dim, ratio, causal, mode)[0]

    def documents_extra_ms(self, calls: int, rows: int, heads: int, kv_heads: int, head_dim: int, causal: bool,
                           mode: str) -> float:
        """What the documents path costs beyond its kernels for ``calls`` calls with ``rows`` rows in
        batched calls (gathered into them, scattered back)."""
        per_call, per_element = self._extra_costs(head_dim, heads // kv_heads, causal, mode)
        return calls * per_call + _elements(rows, heads, kv_heads, head_dim) * per_element

    def varlen_ms(self, lengths, batch: int, heads: int, kv_heads: int, head_dim: int, causal: bool,
                  mode: str) -> float:
        """One varlen call over documents of ``lengths`` in each of ``batch`` rows: each document's
        FLOPs at the rate of a call of its length given the whole call's work (every document's rows
        go to the GPU at once, as a batch of such calls would)."""
        if mode == "bwd":
            return max(0.0, self.varlen_ms(lengths, batch, heads, kv_heads, head_dim, causal, "fwd_bwd")
                       - self.varlen_ms(lengths, batch, heads, kv_heads, head_dim, causal, "fwd"))
        counts = defaultdict(int)
        for m in lengths:
            if m > 0:
                counts[m] += 1
        work = batch * sum(m * c for m, c in counts.items()) * heads
        ratio = heads // kv_heads
        ms = 0.0
        for m, c in counts.items():
            rate = self._rate(m, work, head_dim, ratio, causal, mode)
            one = call_flops(batch * c, m, m, heads, head_dim, causal) / rate * self.pace
            ms += one
            if work < self._least_work(m, head_dim, ratio, causal, mode):
                self._extrapolated(one, heads, kv_heads, head_dim)
        self.total_ms += ms
        return ms

    def _documents(self, cu, batch, heads, kv_heads, head_dim, causal, mode) -> tuple[float, int, int]:
        """``(kernel ms, calls, rows in batched calls)`` of packed documents ``cu`` in the library's calls."""
        big, small, calls, rows = self._documents_parts(cu, batch, heads, kv_heads, head_dim, causal, mode)
        return big + small * self._factor(head_dim, heads // kv_heads, causal, mode), calls, rows

    def _factor(self, head_dim: int, ratio: int, causal: bool, mode: str) -> float:
        """What the call of small documents takes over its modelled kernel time (1 where not calibrated)."""
        keys = [k for k in self._small_factor if k[0] == head_dim and k[2] == causal
                and k[3] == ("fwd_bwd" if mode == "bwd" else mode)]
        return self._small_factor[min(keys, key=lambda k: abs(math.log(k[1] / ratio)))] if keys else 1.0

    def _documents_parts(self, cu, batch, heads, kv_heads, head_dim, causal, mode):
        """``(batched calls' kernel ms, the small documents' call's modelled kernel ms, calls, rows in
        batched calls)`` of packed documents ``cu`` in the library's calls."""
        cu = list(cu)
        if len(cu) <= 2:
            n = cu[-1] - cu[0] if cu else 0
            return self.call_ms(n, n, batch, heads, kv_heads, head_dim, causal, mode), 0.0, 0, 0
        if self.varlen_documents:  # one call of the varlen kernel (dilated.parallel.document_calls)
            return self.varlen_ms([b - a for a, b in zip(cu, cu[1:])], batch, heads, kv_heads, head_dim, causal,
                                  mode), 0.0, 1, 0
        big, small = split_small_calls(document_calls(cu, causal, self.halves), heads, head_dim, causal)
        ms = sum(self._batched_ms(length, docs, batch, heads, kv_heads, head_dim, causal, mode) for length, docs in big)
        if big:  # a batched call's rows gathered: q, k, v and its out; in backward also dout, dq, dk, dv (in
            # halves each twice: the documents reversed, and the second half's out and gradients)
            per_row = (2 if mode == "fwd" else 4) * (heads + kv_heads) * head_dim * ELEM
            held = max(length * len(docs) * (2 if self._in_halves(length, docs, causal) else 1) for length, docs in big)
            self.peak_bytes = max(self.peak_bytes, batch * held * per_row)
        small_ms = 0.0
        if small:  # one varlen call: its FLOPs at the rate of its documents' mean length, all rows at once
            rows = sum(m for _, m in small)
            flops = sum(call_flops(batch, m, m, heads, head_dim, causal) for _, m in small)
            mean = max(1, round(rows / len(small)))
            one = self.call_ms(mean, mean, batch * len(small), heads, kv_heads, head_dim, causal, mode)
            small_ms = flops * one / call_flops(batch * len(small), mean, mean, heads, head_dim, causal)
        return ms, small_ms, len(big) + (1 if small else 0), batch * sum(length * len(docs) for length, docs in big)

    def _in_halves(self, length: int, docs, causal: bool) -> bool:
        """Whether a batched call runs as two causal halves (non-causal, padded, on a calibration that says so)."""
        return self.halves and not causal and any(m < length for _, m in docs)

    def _batched_ms(self, length: int, docs, batch: int, heads: int, kv_heads: int, head_dim: int, causal: bool,
                    mode: str) -> float:
        """A batched call of ``docs`` padded to ``length`` rows: one call, or (non-causal with padding, in
        halves: :mod:`dilated.causal_halves`) two causal calls."""
        if self._in_halves(length, docs, causal):
            return 2 * self.call_ms(length, length, batch * len(docs), heads, kv_heads, head_dim, True, mode)
        return self.call_ms(length, length, batch * len(docs), heads, kv_heads, head_dim, causal, mode)

    def documents_ms(self, cu, batch: int, heads: int, kv_heads: int, head_dim: int, causal: bool,
                     mode: str) -> float:
        """Packed documents ``cu`` (cumulative lengths; q and k/v rows coincide) attended alone, in
        the library's calls (one per length, causal: bucket; the small ones in one varlen call), each
        with the documents path's calibrated cost beyond its kernel."""
        ms, calls, rows = self._documents(cu, batch, heads, kv_heads, head_dim, causal, mode)
        return ms + self.documents_extra_ms(calls, rows, heads, kv_heads, head_dim, causal, mode)

    def rectangles_ms(self, cu_q, cu_k, batch: int, heads: int, kv_heads: int, head_dim: int, mode: str) -> float:
        """Rectangles of query rows ``cu_q`` over all-visible key rows ``cu_k`` (crossing documents'
        queries over the keys other ranks hold): one varlen call where the calibrated backend has a
        varlen entry point (its FLOPs at the rate of rectangles of their mean size), or where they are
        too small for a call each (:func:`dilated.packed.small_rectangles`: torch's varlen kernel, at
        the calibrated factor of the small documents' call), else one dense call per rectangle
        (:meth:`dilated.parallel.document_attention.DocumentCall.rectangles_kernel`)."""
        sizes = [(b - a, d - c) for a, b, c, d in zip(cu_q, cu_q[1:], cu_k, cu_k[1:]) if b > a and d > c]
        if not sizes:
            return 0.0
        varlen = self.calibration.varlen_kernel is not None
        if not varlen and not small_rectangles(cu_q, cu_k, heads, head_dim):
            return sum(self.call_ms(m, n, batch, heads, kv_heads, head_dim, False, mode) for m, n in sizes)
        flops = sum(call_flops(batch, m, n, heads, head_dim, False) for m, n in sizes)
        lq = max(1, round(sum(m for m, _ in sizes) / len(sizes)))
        lk = max(1, round(sum(n for _, n in sizes) / len(sizes)))
        one = self.call_ms(lq, lk, batch * len(sizes), heads, kv_heads, head_dim, False, mode)
        ms = flops * one / call_flops(batch * len(sizes), lq, lk, heads, head_dim, False)
        if not varlen:  # torch's varlen kernel, as the documents of small calls run (its calibrated factor)
            return ms * self._factor(head_dim, heads // kv_heads, False, mode)
        return ms + self.per_call_ms(head_dim, heads // kv_heads, False, mode)
