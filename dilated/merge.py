"""The log-sum-exp merge of partial attentions (dilated branches, ring steps, causal pieces).

Two attentions of one query row over disjoint key sets, ``(o1, l1)`` and ``(o2, l2)``, combine
exactly into ``o = (e1*o1 + e2*o2) / (e1 + e2)`` with ``ei = exp(li - m)``, ``m = max(l1, l2)``, and
``L = m + log(e1 + e2)``. The weights are normalised by their own sum rather than taken as
``exp(li - L)``: at large logits ``L`` rounds to ``m`` (``log 2`` is below one ulp of ``1e8`` in
float32) and ``exp(li - L)`` would then sum to 2.

The same rule in two forms: :func:`merge_` merges one result into torch accumulators in place
(ring steps, causal pieces, the combine of a plan off the GPU fast path), and
:class:`RowAccumulator` applies it to pieces over ranges of rows as they come (ring attention's
pieces: the first piece on rows is copied, not merged); :mod:`dilated._triton.online_merge` holds its
streaming form inside a Triton kernel (a running maximum and weight sum over the calls of a plan,
as flash attention's online softmax).
Two computations stay apart on purpose, to check these: ``mix_branches`` of the readable
:class:`~dilated.DilatedAttention` (LongNet's eq. 9-10 over all branches at once, the spec) and
:func:`dilated.reference.sampled_reference` (softmax over every selected key of a row at once).

Layouts: outputs ``[..., D]`` and their lse in *row layout*, ``out.shape[:-1]`` (for
``[B, N, H, D]`` outputs that is ``[B, N, H]``: pass ``lse.transpose(1, 2)`` for a kernel's
``[B, H, N]`` lse). Accumulators are float32 (float64 for float64 inputs).
"""
from __future__ import annotations

import torch


def _rows(lse: torch.Tensor) -> torch.Tensor:
    return lse.unsqueeze(-1)


def merge_(acc: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Merge ``(out, lse)`` into the float32 accumulators ``(acc, acc_lse)`` in place.

    ``acc_lse`` starts at ``-inf`` and ``acc`` at 0. Both may be strided views into larger
    buffers (a dilated branch's rows), which is how branches merge without a full-size copy.
    """
    lse = lse.to(acc_lse.dtype)
    m = torch.maximum(acc_lse, lse)  # NaN propagates
    ref = torch.where(m == float("-inf"), 0.0, m)  # -inf only where both are
    a, e = torch.exp(acc_lse - ref), torch.exp(lse - ref)
    total = a + e
    inv = torch.where(total == 0, 0.0, 1.0 / total)  # rows neither covers stay 0 (NaN stays NaN)
    acc.mul_(_rows(a * inv))
    acc.addcmul_(out, _rows(e * inv))  # reads out in its own dtype: no float32 copy of it
    acc_lse.copy_(ref + torch.log(total))  # log(0) = -inf where neither covers the row


def merge_stacked(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact merge of ``P`` partial results stacked on dim 0: ``outs`` ``[P, ..., D]`` and their
    ``lses`` ``[P, ...]`` give ``(out [..., D], lse [...])`` in ``lses``' dtype, in a few kernels
    whatever ``P`` (not one :func:`merge_` per part). A part with ``lse = -inf`` (it saw no keys)
    weighs nothing; rows no part covers are 0 with ``lse = -inf``."""
    top = lses.amax(0)
    ref = torch.where(top == float("-inf"), 0.0, top)
    w = torch.exp(lses - ref)  # [P, ...]
    total = w.sum(0)
    out = torch.einsum("p...,p...d->...d", w, outs.to(w.dtype))
    out = out * torch.where(total == 0, 0.0, 1.0 / total).unsqueeze(-1)
    return out, ref + torch.log(total)


def empty_accumulators(b: int, n: int, h: int, d: int, device, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``acc`` ``[B, N, H, D]`` zeros and ``acc_lse`` ``[B, N, H]`` at ``-inf``, both ``dtype``."""
    acc = torch.zeros(b, n, h, d, device=device, dtype=dtype)
    acc_lse = torch.full((b, n, h), float("-inf"), device=device, dtype=dtype)
    return acc, acc_lse


class RowAccumulator:
    """Partial results over the rows ``[0, n)`` (dim 1) of one or more tensors ``parts``, combined as
    they come by ``combine(accumulator views, parts)`` in place (a log-sum-exp merge, a sum) into
    accumulators of ``dtype`` (float32; float64 for float64 inputs). A piece on rows that hold no
    result yet is copied there instead: what combining gives on them, in one pass. A piece over
    every row while none holds a result is kept as it came, in its own dtype, until a second one
    comes: a ring of one rank, or a rank whose only piece is its own block, needs no accumulator."""

    def __init__(self, shapes, device, dtype: torch.dtype, combine, fill):
        self.shapes, self.device, self.dtype, self.combine, self.fill = shapes, device, dtype, combine, fill
        self.n = shapes[0][1]
        self.ranges: list[tuple[int, int]] = []  # disjoint row ranges that hold a result
        self.held = None  # a piece over every row, kept as it came
        self.acc = None

    @classmethod
    def merging(cls, shape, device, dtype: torch.dtype) -> "RowAccumulator":
        """Attention results ``(out [B, N, H, D], lse [B, N, H])`` (row layout) merged by :func:`merge_`;
        rows no piece covered are 0 with lse ``-inf``."""
        return cls([tuple(shape), tuple(shape[:-1])], device, dtype, _merge_into, (0.0, float("-inf")))

    @classmethod
    def summing(cls, shapes, device, dtype: torch.dtype) -> "RowAccumulator":
        """Tensors of ``shapes`` (gradients) summed; rows no piece covered are 0."""
        return cls([tuple(s) for s in shapes], device, dtype, _add_into, (0.0,) * len(shapes))

    def _runs(self, a: int, b: int):
        """``[a, b)`` as consecutive ``(start, stop, holds a result)`` runs."""
        runs, at = [], a
        for x, y in self.ranges:
            x, y = max(x, a), min(y, b)
            if x < y:
                if at < x:
                    runs.append((at, x, False))
                runs.append((x, y, True))
                at = y
        if at < b:
            runs.append((at, b, False))
        return runs

    def _record(self, a: int, b: int) -> None:
        apart = []
        for x, y in self.ranges:
            if y < a or b < x:
                apart.append((x, y))
            else:  # overlapping or adjacent: one range
                a, b = min(a, x), max(b, y)
        self.ranges = sorted([*apart, (a, b)])

    def _accumulators(self):
        if self.held is not None:  # the whole-rows piece becomes the accumulators
            acc = tuple(torch.empty(t.shape, dtype=self.dtype, device=self.device).copy_(t) for t in self.held)
            self.held = None
            return acc
        return tuple(torch.empty(shape, dtype=self.dtype, device=self.device) for shape in self.shapes)

    def add(self, rows: slice, parts: tuple) -> None:
        a, b = rows.start, rows.stop
        if self.acc is None and self.held is None and (a, b) == (0, self.n):
            self.held = parts
        else:
            if self.acc is None:
                self.acc = self._accumulators()
            for x, y, written in self._runs(a, b):
                views = tuple(t[:, x:y] for t in self.acc)
                piece = parts if (x, y) == (a, b) else tuple(t[:, x - a:y - a] for t in parts)
                if written:
                    self.combine(views, piece)
                else:
                    for view, part in zip(views, piece):
                        view.copy_(part)
        self._record(a, b)

    def result(self) -> tuple:
        """The combined tensors: the whole-rows piece itself where it was the only one, else the
        accumulators, rows no piece covered set to ``fill`` (one value per part)."""
        if self.acc is None and self.held is not None:
            return self.held
        if self.acc is None:
            self.acc = self._accumulators()
        start = 0
        for x, y in [*self.ranges, (self.n, self.n)]:
            if start < x:
                for t, value in zip(self.acc, self.fill):
                    t[:, start:x].fill_(value)
            start = y
        return self.acc


def _merge_into(acc, piece) -> None:
    merge_(*acc, *piece)


def _add_into(acc, piece) -> None:
    for a, p in zip(acc, piece):
        a.add_(p)
