"""LongNet dilated attention, the fast implementation (same contract as :mod:`dilated_attention`).

* r = 1 branches read a free segment view (no copy). r > 1 branches: on kernels that read
  strided rows (cuDNN, flash, flash-attn 4), strided views, no copy at all (one call per head offset, or per
  segment with the r offsets as a batch of stride ``(H + 1) * D``), where each call still fills
  the device; otherwise one gather per branch (the rows of a diagonal over
  (position mod r, head mod r); q, k and v in one launch, :func:`dilated.longnet.rows.gather`) or,
  where w, the last segment or the heads are not multiples of r, one strided slice per head
  offset. No index tensor is data-sized (GQA with r > 1 uses an ``H/r``-entry kv-head index).
* The calls, forward and backward, are taken in turns by two CUDA streams
  (:mod:`dilated.longnet.call_streams`): one call's last wave runs beside the next call's start.
* The calls' outputs stay in kernel shape (together about twice one output: branch r covers
  1/r of the rows) and :func:`dilated.longnet.rows.combine` writes their log-sum-exp mixture in one
  pass, each result row once, in the output dtype (on CUDA one Triton kernel; no float32
  accumulator, no per-branch strided merge). The result overwrites the r = 1 branch's output.
  Where the calls' outputs would not fit together in the device's free memory, the calls are
  cut into pieces of 1/32 of the rows, each merged into the result as it finishes and freed (the
  same kernel over the rows it spans): longer sequences in the same memory, at some speed
  (:func:`merges_as_it_goes`).
* Backward is a custom autograd Function: each call's kernel backward gets the *merged* output
  and lse gathered to its rows, which yields the exact gradient of the mixed attention, mixing
  weights included; the calls' gradients are summed by the same combine (a plain sum), or added
  piece by piece where they would not fit together.
* A :class:`~dilated.longnet.pattern_cache.PatternCache` keeps per-shape plans; an optional
  :class:`~dilated.longnet.memory_pool.MemoryPool` reuses the gather buffers.
"""
from __future__ import annotations

import torch
from torch import nn

from .._checks import check_causal, check_scale, check_schedule, dense_rows
from .dilated_attention import check_dilated_inputs
from .dilated_calls import backward_calls, forward_calls, resolve_dilated
from ..handles import handle_or_zero
from .memory_pool import MemoryPool
from .ops import dilated_forward_op
from .pattern_cache import PatternCache
from .residue_major import from_residue_major, geometric_schedule_reason, residue_major_attention, to_residue_major


class _ImprovedDilatedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan, spec, pool):
        out, lse_rows = forward_calls((q, k, v), plan, spec, pool=pool)
        ctx.save_for_backward(q, k, v, out, lse_rows)
        ctx.plan, ctx.spec = plan, spec
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse_rows = ctx.saved_tensors
        dq, dk, dv = backward_calls((q, k, v), ctx.plan, ctx.spec, out, lse_rows, dout.contiguous())
        return dq, dk, dv, None, None, None


LAYOUTS = ("natural", "residue_major")


def check_layout(layout, segment_lengths=None, dilation_rates=None) -> str:
    """``layout`` itself, or a ValueError naming the choices (or why the schedule has no such order)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")
    if layout == "residue_major" and segment_lengths is not None:
        reason = geometric_schedule_reason(segment_lengths, dilation_rates)
        if reason:
            raise ValueError(reason)
    return layout


def improved_dilated_attention(q, k, v, segment_lengths, dilation_rates, *, causal=False, scale=None,
                               backend="auto", pattern_cache: PatternCache | None = None,
                               memory_pool: MemoryPool | None = None, layout: str = "natural"):
    """Fast exact dilated attention; the same function as :func:`dilated.dilated_attention`.

    ``pattern_cache``: works out what the inputs' signature determines (validation, backend, plan)
    once per signature. Under ``torch.compile`` the computation is one custom op
    (:mod:`dilated.longnet.ops`).

    ``layout="residue_major"``: q, k, v and the output are in the residue-major order of the
    schedule along the sequence (:mod:`dilated.longnet.residue_major`), where the whole computation is one
    block-sparse kernel call without a combine (flash-attn 4 on Hopper, non-causal)."""
    if check_layout(layout) == "residue_major":
        return residue_major_attention(q, k, v, segment_lengths, dilation_rates, causal=causal, scale=scale,
                                       backend=backend, pattern_cache=pattern_cache, memory_pool=memory_pool)
    needs_grad = torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in (q, k, v))
    if torch.compiler.is_compiling():
        # errors at trace time; the op warns of uncovered rows when it runs (dynamo cannot trace a warning)
        segs, dils = check_dilated_inputs(q, k, v, segment_lengths, dilation_rates, causal, warn=False)
        check_scale(scale)
        return dilated_forward_op(q, k, v, list(segs), list(dils), causal, scale, backend, handle_or_zero(pattern_cache),
                                  handle_or_zero(memory_pool), needs_grad)[0]
    spec, plan = resolve_dilated(q, k, v, segment_lengths, dilation_rates, causal, scale, backend, pattern_cache)
    q, k, v = dense_rows(q), dense_rows(k), dense_rows(v)
    if needs_grad:
        return _ImprovedDilatedFunction.apply(q, k, v, plan, spec, memory_pool)
    return forward_calls((q, k, v), plan, spec, pool=memory_pool, with_lse=False)[0]


class ImprovedDilatedAttention(nn.Module):
    """Module form of :func:`improved_dilated_attention`; ``forward(q, k, v)`` on ``[B, N, H, D]``
    returns ``[B, N, H, D]``, the same result as :class:`~dilated.DilatedAttention`.

    Args:
        segment_lengths, dilation_rates, causal, scale, backend: as :func:`dilated.dilated_attention`.
        pattern_cache: keep each input signature's plan (True, the default; False; or an instance).
        memory_pool: reuse the gather buffers (False, the default: PyTorch's caching allocator
            already recycles memory; True; or an instance).
        layout: ``"natural"`` or ``"residue_major"`` (below).

    ``layout="residue_major"`` (a geometric schedule, N a multiple of the largest segment): the
    sequence is in the schedule's residue-major order (:mod:`dilated.longnet.residue_major`);
    :meth:`to_layout` / :meth:`from_layout` put a tensor in it and back, once per model.
    """

    def __init__(self, segment_lengths, dilation_rates, *, causal=False, scale=None, backend="auto",
                 pattern_cache: bool | PatternCache = True, memory_pool: bool | MemoryPool = False,
                 layout: str = "natural"):
        super().__init__()
        self.segment_lengths, self.dilation_rates = check_schedule(segment_lengths, dilation_rates)
        self.layout = check_layout(layout, self.segment_lengths, self.dilation_rates)
        check_causal(causal)
        check_scale(scale)
        self.causal, self.scale, self.backend = causal, scale, backend
        self.pattern_cache = PatternCache() if pattern_cache is True else (pattern_cache or None)
        self.memory_pool = MemoryPool() if memory_pool is True else (memory_pool or None)

    def forward(self, q, k, v):
        return improved_dilated_attention(
            q, k, v, self.segment_lengths, self.dilation_rates, causal=self.causal, scale=self.scale,
            backend=self.backend, pattern_cache=self.pattern_cache, memory_pool=self.memory_pool, layout=self.layout)

    def to_layout(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, N, ...]`` in the natural order put in this module's layout (a no-op for
        ``"natural"``): what a model does once to its tokens, and to their positions."""
        return to_residue_major(x, self.segment_lengths, self.dilation_rates) if self.layout == "residue_major" else x

    def from_layout(self, x: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`to_layout`."""
        return from_residue_major(x, self.segment_lengths, self.dilation_rates) if self.layout == "residue_major" else x

    def extra_repr(self):
        return (f"segment_lengths={list(self.segment_lengths)}, dilation_rates={list(self.dilation_rates)}, "
                f"causal={self.causal}, backend={self.backend!r}, pattern_cache={self.pattern_cache is not None}, "
                f"memory_pool={self.memory_pool is not None}"
                + (f", layout={self.layout!r}" if self.layout != "natural" else ""))
