"""LongNet dilated attention, the fast implementation (same contract as :mod:`dilated_attention`).

* r = 1 branches read a free segment view (no copy); r > 1 branches take one gather per branch
  (a diagonal view over (position mod r, head mod r) made contiguous once) or, where w, the last
  segment or the heads are not multiples of r, one strided slice per head offset. No index tensor
  is data-sized (GQA with r > 1 uses an ``H/r``-entry kv-head index).
* Each branch's kernel output is merged in place into one float32 accumulator through the same
  strided view (the online-softmax merge of ring attention), so the k branch outputs are never
  materialised at full size.
* Backward is a custom autograd Function: each branch's kernel backward gets the *merged* output
  and lse gathered to its rows, which yields the exact gradient of the mixed attention, mixing
  weights included; gradients are scattered back through the same views.
* A :class:`~dilated.pattern_cache.PatternCache` keeps per-shape plans; an optional
  :class:`~dilated.memory_pool.MemoryPool` reuses the accumulator and gather buffers.
"""
from __future__ import annotations

import torch
from torch import nn

from ._checks import check_schedule
from .backends import get_backend
from .dilated_attention import check_dilated_inputs
from .functional import attention_backward, attention_forward, default_scale
from .memory_pool import MemoryPool
from .merge import merge_
from .pattern_cache import BranchCall, PatternCache


def branch_view(x: torch.Tensor, c: BranchCall, heads: bool = True) -> torch.Tensor:
    """Strided view of ``x`` (``[B, N, H, *rest]``) holding the rows of call ``c``.

    Layout ``[B, count, r, n, h, *rest]`` for "diag", ``[B, count, n, h, *rest]`` otherwise.
    ``heads=False`` selects positions only (kv tensors under GQA).
    """
    s = x[:, c.start:c.start + c.count * c.length].unflatten(1, (c.count, c.length))
    if c.mode == "view":
        return s
    r = c.r
    if c.mode == "diag":
        s = s.unflatten(2, (c.length // r, r)).unflatten(4, (s.shape[3] // r, r))
        return s.diagonal(dim1=3, dim2=5).movedim(-1, 2)
    s = s[:, :, c.offset::r]
    return s[:, :, :, c.offset::r] if heads else s


def _kernel_layout(view: torch.Tensor, rest: int) -> torch.Tensor:
    """``[B, count, (r,) n, h, *rest]`` -> ``[B', n, h, *rest]`` (a copy unless already dense)."""
    lead = view.dim() - 2 - rest
    return view.reshape(-1, *view.shape[lead:])


def _gather(x, c: BranchCall, is_kv: bool, pool: MemoryPool | None):
    if is_kv and c.kv_heads is not None:
        view = branch_view(x, c, heads=False).index_select(3, c.kv_heads)
    else:
        view = branch_view(x, c)
    if pool is None or c.mode == "view":
        return _kernel_layout(view, 1), None
    buf = pool.acquire(view.shape, x.dtype, x.device)
    buf.copy_(view)
    return _kernel_layout(buf, 1), buf


def _merged_lse_for(lse_rows, c: BranchCall):
    """The merged lse (row layout ``[B, N, H]``) at the rows of ``c``, as a kernel's ``[B', h, n]``."""
    return _kernel_layout(branch_view(lse_rows, c), 0).transpose(1, 2).contiguous()


def _scatter_add(acc, grad, c: BranchCall, is_kv: bool):
    if is_kv and c.kv_heads is not None:
        view = branch_view(acc, c, heads=False)
        view.index_add_(3, c.kv_heads, grad.view(*view.shape[:3], -1, grad.shape[-1]).to(acc.dtype))
    else:
        view = branch_view(acc, c)
        view.add_(grad.view(view.shape))


def forward_calls(q, k, v, plan, backend, causal, scale, pool, acc, acc_lse) -> None:
    """Run the kernel calls of ``plan`` and merge them into ``(acc, acc_lse)`` in place.

    A first call that covers every row (r = 1, whole segments) initialises uninitialised
    accumulators; otherwise they must hold zeros and ``-inf``.
    """
    n = q.shape[1]
    first = plan[0] if plan else None
    init = first is not None and first.mode == "view" and first.start == 0 and first.count * first.length == n
    if not init:
        acc.zero_()
        acc_lse.fill_(float("-inf"))
    for i, c in enumerate(plan):
        (qb, bq), (kb, bk), (vb, bv) = (_gather(x, c, j > 0, pool) for j, x in enumerate((q, k, v)))
        o, lse = attention_forward(backend, qb, kb, vb, causal, scale)
        rows = branch_view(acc_lse, c)
        if init and i == 0:
            acc.view(o.shape).copy_(o)
            rows.copy_(lse.transpose(1, 2).reshape(rows.shape))
        else:
            merge_(branch_view(acc, c), rows, o.view(branch_view(acc, c).shape),
                   lse.transpose(1, 2).reshape(rows.shape))
        del o, lse, qb, kb, vb  # free this branch's tensors before the next branch allocates its own
        for buf in (bq, bk, bv):
            if buf is not None:
                pool.release(buf)


def backward_calls(plan, backend, causal, scale, q, k, v, out, lse_rows, dout, dq, dk, dv) -> None:
    """Add each call's kernel backward, given the *merged* out and lse, into float32 dq, dk, dv."""
    for c in plan:
        qb, kb, vb = (_gather(x, c, i > 0, None)[0] for i, x in enumerate((q, k, v)))
        ob, dob = _gather(out, c, False, None)[0], _gather(dout, c, False, None)[0]
        g = attention_backward(backend, dob, qb, kb, vb, ob, _merged_lse_for(lse_rows, c), causal, scale)
        _scatter_add(dq, g[0], c, False)
        _scatter_add(dk, g[1], c, True)
        _scatter_add(dv, g[2], c, True)
        del g


class _ImprovedDilatedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan, backend, causal, scale, pool):
        b, n, h, d = q.shape
        if pool is not None:
            acc = pool.acquire((b, n, h, d), torch.float32, q.device)
            acc_lse = pool.acquire((b, n, h), torch.float32, q.device)
        else:
            acc = torch.empty(b, n, h, d, device=q.device, dtype=torch.float32)
            acc_lse = torch.empty((b, n, h), device=q.device, dtype=torch.float32)
        forward_calls(q, k, v, plan, backend, causal, scale, pool, acc, acc_lse)
        out = acc.to(q.dtype)
        lse_rows = acc_lse.clone() if pool is not None else acc_lse
        if pool is not None:
            pool.release(acc)
            pool.release(acc_lse)
        ctx.save_for_backward(q, k, v, out, lse_rows)
        ctx.plan, ctx.backend, ctx.causal, ctx.scale = plan, backend, causal, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse_rows = ctx.saved_tensors
        dq = torch.zeros_like(q, dtype=torch.float32)
        dk = torch.zeros_like(k, dtype=torch.float32)
        dv = torch.zeros_like(v, dtype=torch.float32)
        backward_calls(ctx.plan, ctx.backend, ctx.causal, ctx.scale, q, k, v, out, lse_rows, dout.contiguous(),
                       dq, dk, dv)
        dq = dq.to(q.dtype)  # rebinding frees each float32 accumulator before the next cast
        dk = dk.to(k.dtype)
        dv = dv.to(v.dtype)
        return dq, dk, dv, None, None, None, None, None


def improved_dilated_attention(q, k, v, segment_lengths, dilation_rates, *, causal=False, scale=None,
                               backend="auto", pattern_cache: PatternCache | None = None,
                               memory_pool: MemoryPool | None = None):
    """Fast exact dilated attention; the same function as :func:`dilated.dilated_attention`."""
    segs, dils = check_dilated_inputs(q, k, v, segment_lengths, dilation_rates)
    scale = default_scale(q.shape[-1], scale)
    impl = get_backend(backend, q, k, causal)
    if pattern_cache is not None:
        plan = pattern_cache.plan(q, k, segs, dils, causal)
    else:
        from .pattern_cache import build_plan

        plan = build_plan(q.shape[1], q.shape[2], k.shape[2], segs, dils, q.device)
    return _ImprovedDilatedFunction.apply(q, k, v, plan, impl, causal, scale, memory_pool)


class ImprovedDilatedAttention(nn.Module):
    """Module form of :func:`improved_dilated_attention`; ``forward(q, k, v)`` on ``[B, N, H, D]``.

    ``pattern_cache`` (on by default) and ``memory_pool`` (off by default: PyTorch's caching
    allocator already recycles memory; see the benchmarks) may be True/False or an instance.
    """

    def __init__(self, segment_lengths, dilation_rates, *, causal=False, scale=None, backend="auto",
                 pattern_cache: bool | PatternCache = True, memory_pool: bool | MemoryPool = False):
        super().__init__()
        self.segment_lengths, self.dilation_rates = check_schedule(segment_lengths, dilation_rates)
        self.causal, self.scale, self.backend = causal, scale, backend
        self.pattern_cache = PatternCache() if pattern_cache is True else (pattern_cache or None)
        self.memory_pool = MemoryPool() if memory_pool is True else (memory_pool or None)

    def forward(self, q, k, v):
        return improved_dilated_attention(
            q, k, v, self.segment_lengths, self.dilation_rates, causal=self.causal, scale=self.scale,
            backend=self.backend, pattern_cache=self.pattern_cache, memory_pool=self.memory_pool)

    def extra_repr(self):
        return (f"segment_lengths={list(self.segment_lengths)}, dilation_rates={list(self.dilation_rates)}, "
                f"causal={self.causal}, backend={self.backend!r}, pattern_cache={self.pattern_cache is not None}, "
                f"memory_pool={self.memory_pool is not None}")
