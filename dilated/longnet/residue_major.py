"""LongNet's dilated attention in a residue-major order: one block-sparse kernel call, no combine.

On a *geometric* schedule (every branch ``w_i = L * r_i`` for one ``L``, every rate dividing the
largest rate ``R``; LongNet's standard ``[2048 .. 32768]`` over ``[1 .. 16]`` is one), reorder each
segment of the largest length ``W = L * R`` by residue: position ``R * a + b`` of a segment goes to
row ``b * (W / R) + a``. In that order:

* a query block of ``block`` rows holds one residue ``b``, so all its queries take part in the same
  branches (branch i, head h: ``b = h mod r_i``);
* branch i's keys of such a block are whole blocks: the residues ``b' = h mod r_i``, at the block
  positions ``j`` whose ``j // g_i`` equals the query block's (``g_i = w_i / (R * block)``).

So the whole computation is one block-sparse attention over ``block x block`` tiles, where a query
block lists each key block once per branch that has it (:func:`block_lists`). The softmax over
those lists *is* LongNet's mixture of the branches by their softmax denominators, so there is no
combine; the lists are symmetric (the dilated relation is), so the same lists give the backward.

Inputs and output of ``layout="residue_major"`` are in this order along the sequence; a model
puts its tokens (and their positions, for rotary embeddings) in it once, with
:func:`to_residue_major` / :func:`residue_major_positions`, and every token-wise layer is
indifferent to it (like the ring's zigzag order). The fast path needs a kernel that takes
block-sparse lists (:meth:`dilated.backends.base.Backend.block_sparse_reason`; flash-attn 4 on
Hopper) and a non-causal schedule whose ``w_i / R`` are multiples of the kernel's block; elsewhere
the same function runs as the natural-order computation between two permutes
(:func:`residue_major_fast_path_reason` says why).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from .._checks import acc_dtype, check_scale, check_schedule, dense_rows
from ..backends import backend_reason, get_backend
from ..backends.kernel_log import note_kernel, recording
from ..dense import default_scale
from .dilated_attention import check_dilated_inputs
from .dilated_calls import backward_calls, forward_calls, resolve_dilated
from ..handles import handle_or_zero, object_of
from .ops import grad_by, save_inputs_and_outputs

#: the largest tile of the block lists (a kernel that takes smaller ones gets them where the
#: schedule's ``w_i / R`` are not multiples of it)
BLOCK = 128


def geometric_schedule_reason(segment_lengths, dilation_rates) -> str | None:
    """Why the schedule has no residue-major order, or None: every ``w_i / r_i`` must be one length
    and every rate must divide the largest."""
    segs, rates = check_schedule(segment_lengths, dilation_rates, warn=False)
    ratios = {w / r for w, r in zip(segs, rates)}
    if any(w % r for w, r in zip(segs, rates)) or len(ratios) != 1:
        return (f"layout='residue_major' needs segment_lengths[i] / dilation_rates[i] to be one whole length for "
                f"every branch (a geometric schedule such as [2048, 4096, 8192] over [1, 2, 4]); got "
                f"{list(segs)} over {list(rates)}: use layout='natural'")
    largest = max(rates)
    if any(largest % r for r in rates):
        return (f"layout='residue_major' needs every dilation rate to divide the largest ({largest}); got "
                f"{list(rates)}: use layout='natural'")
    return None


def _shape(segment_lengths, dilation_rates) -> tuple[int, int]:
    """``(W, R)``: the largest segment and the largest rate; raises where the schedule has no order."""
    reason = geometric_schedule_reason(segment_lengths, dilation_rates)
    if reason:
        raise ValueError(reason)
    return max(segment_lengths), max(dilation_rates)


def _check_length(n: int, segment_lengths, dilation_rates, what: str = "the sequence") -> tuple[int, int]:
    w, r = _shape(segment_lengths, dilation_rates)
    if n % w:
        raise ValueError(f"layout='residue_major' needs {what} length to be a multiple of the largest segment "
                         f"({w}); got {n}: pad the sequence to {-(-n // w) * w} or use layout='natural'")
    return w, r


def _check_sequence(x, what: str = "x") -> None:
    """``x`` must be a tensor ``[B, N, ...]`` (the layout permutes its dimension 1)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor [batch, seq, ...], got {type(x).__name__}")
    if x.dim() < 2:
        raise ValueError(f"{what} must be [batch, seq, ...] (at least 2 dimensions: the layout permutes dimension 1), "
                         f"got shape {tuple(x.shape)}")


def to_residue_major(x: torch.Tensor, segment_lengths, dilation_rates) -> torch.Tensor:
    """``x`` ``[B, N, ...]`` in the residue-major order of the schedule (a copy)."""
    _check_sequence(x)
    w, r = _check_length(x.shape[1], segment_lengths, dilation_rates)
    b, n = x.shape[:2]
    return x.reshape(b, n // w, w // r, r, *x.shape[2:]).transpose(2, 3).reshape(x.shape)


def from_residue_major(x: torch.Tensor, segment_lengths, dilation_rates) -> torch.Tensor:
    """The inverse of :func:`to_residue_major`: ``x`` back in the natural order (a copy)."""
    _check_sequence(x)
    w, r = _check_length(x.shape[1], segment_lengths, dilation_rates)
    b, n = x.shape[:2]
    return x.reshape(b, n // w, r, w // r, *x.shape[2:]).transpose(2, 3).reshape(x.shape)


def residue_major_positions(n: int, segment_lengths, dilation_rates, device=None) -> torch.Tensor:
    """``[N]`` int64: the natural position of each row of the residue-major order (for positional
    embeddings: row ``j`` of :func:`to_residue_major` output is token ``positions[j]``)."""
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise ValueError(f"n must be a positive int (the sequence length), got {n!r}")
    return to_residue_major(torch.arange(n, device=device).view(1, n), segment_lengths, dilation_rates)[0]


@dataclass(frozen=True)
class BlockLists:
    """Per head and query block, the key blocks it sees, each as often as branches share it.

    ``counts`` ``[1, H, N / block]`` int32 and ``indices`` ``[1, H, N / block, K]`` int32 (entries
    past a row's count are never read); the lists are symmetric, so they also give, per key block,
    the query blocks that see it."""

    counts: torch.Tensor
    indices: torch.Tensor
    block: int


@functools.lru_cache(maxsize=64)
def _segment_lists(segs: tuple, rates: tuple, block: int, classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(counts [classes, W / block], indices [classes, W / block, K])`` of one largest segment,
    per head class; the same for every sequence length (a new length only adds segments)."""
    lists = [_lists_of_one_segment(c, segs, rates, block) for c in range(classes)]
    width = max(len(row) for per_class in lists for row in per_class)
    counts = torch.tensor([[len(row) for row in per_class] for per_class in lists], dtype=torch.int32)
    indices = torch.tensor([[row + [0] * (width - len(row)) for row in per_class] for per_class in lists],
                           dtype=torch.int32)
    return counts, indices


def _lists_of_one_segment(head_class: int, segs, rates, block: int) -> list[list[int]]:
    """For one head class (``h mod R``), each query block of one largest segment: its key blocks."""
    w_max, r_max = max(segs), max(rates)
    per_residue = w_max // r_max // block  # blocks of one residue in a largest segment
    lists = [[] for _ in range(r_max * per_residue)]
    for w, r in zip(segs, rates):
        g = w // r_max // block  # consecutive blocks of a residue in one of this branch's segments
        residues = [b for b in range(r_max) if b % r == head_class % r]
        for b in residues:
            for m in range(per_residue):
                first = m // g * g
                lists[b * per_residue + m] += [b2 * per_residue + j for b2 in residues for j in range(first, first + g)]
    return lists


def block_lists(n: int, num_heads: int, segment_lengths, dilation_rates, block: int = BLOCK,
                device=None) -> BlockLists:
    """The :class:`BlockLists` of dilated attention in the residue-major order over ``block``-row
    tiles (non-causal); each ``w_i / R`` must be a multiple of ``block``."""
    w_max, r_max = _check_length(n, segment_lengths, dilation_rates)
    segs, rates = check_schedule(segment_lengths, dilation_rates, warn=False)
    if any((w // r_max) % block for w in segs):
        raise ValueError(f"block lists over {block}-row tiles need every segment length / {r_max} to be a "
                         f"multiple of {block}; got segments {list(segs)}")
    counts, indices = (t.to(device) for t in _segment_lists(segs, rates, block, min(r_max, num_heads)))
    per_segment, width = counts.shape[1], indices.shape[2]
    head_class = torch.arange(num_heads, device=counts.device) % r_max
    segments = n // w_max
    offsets = (torch.arange(segments, dtype=torch.int32, device=counts.device) * per_segment).view(1, segments, 1, 1)
    indices = (indices[head_class].unsqueeze(1) + offsets).reshape(1, num_heads, segments * per_segment, width)
    counts = counts[head_class].repeat(1, segments).reshape(1, num_heads, segments * per_segment)
    return BlockLists(counts, indices, block)


def _tiles(segment_lengths, dilation_rates) -> list[int]:
    """The tile sizes (powers of two from :data:`BLOCK` down to 8) that divide every ``w_i / R``."""
    r_max = max(dilation_rates)
    return [b for b in (BLOCK, 64, 32, 16, 8) if all((w // r_max) % b == 0 for w in segment_lengths)]


def residue_major_fast_path_reason(q, k, segment_lengths, dilation_rates, causal=False,
                                   backend="auto") -> str | None:
    """Why ``layout="residue_major"`` runs as the natural-order computation between permutes for
    these inputs rather than as one block-sparse call, or None where it runs as one call."""
    return _block_sparse_kernel(q, k, segment_lengths, dilation_rates, causal, backend)[1]


def _block_sparse_kernel(q, k, segment_lengths, dilation_rates, causal, backend):
    """``((backend object, tile), None)`` that runs the lists, or ``(None, reason)``."""
    _, r_max = _shape(segment_lengths, dilation_rates)
    if causal:
        return None, ("the block-sparse path is non-causal: causal would make most listed blocks masked blocks on "
                      "the diagonal (about 1.7x the useful work on LongNet's schedule)")
    tiles = _tiles(segment_lengths, dilation_rates)
    if not tiles:
        return None, (f"the block-sparse path needs every segment length / {r_max} (the largest rate) to be a "
                      f"multiple of 8 at least; got segments {list(segment_lengths)}")
    if backend == "auto":  # the kernels that run the lists at a fused kernel's speed
        impls = [get_backend(n, device=q.device) for n in ("flash_attn_4",) if backend_reason(n, q.device) is None]
    else:
        impls = [get_backend(backend, q, k)]
    reasons = []
    for impl in impls:
        for tile in tiles:
            reason = impl.block_sparse_reason(q, k, tile)
            if reason is None:
                return (impl, tile), None
        reasons.append(reason)
    if not impls:
        return None, "no available backend takes block-sparse lists here (flash-attn 4 on Hopper does)"
    return None, "; ".join(reasons)


def resolve_residue_major(q, k, v, segment_lengths, dilation_rates, causal, scale, backend, pattern_cache=None):
    """``(segments, rates, kernel, lists)``: the inputs validated, and the block-sparse kernel with
    its :class:`BlockLists` (both None where the natural path runs); once per input signature
    with a ``pattern_cache``."""

    def resolve():
        segs, dils = check_dilated_inputs(q, k, v, segment_lengths, dilation_rates, causal, warn=False)
        check_scale(scale)
        _check_length(q.shape[1], segs, dils)
        kernel = _block_sparse_kernel(q, k, segs, dils, causal, backend)[0]
        if kernel is not None:
            check_schedule(segs, dils)  # warns of rows no branch covers, as the natural path does
        lists = None if kernel is None else block_lists(q.shape[1], q.shape[2], segs, dils, kernel[1], q.device)
        return segs, dils, kernel and kernel[0], lists

    try:
        key = ("residue_major", q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
               tuple(segment_lengths), tuple(dilation_rates), causal, scale, backend)
    except (AttributeError, TypeError):  # not tensors / not sequences: resolve() says what is wrong
        key = None
    return resolve() if pattern_cache is None or key is None else pattern_cache.get(key, resolve)


def residue_major_forward(q, k, v, segment_lengths, dilation_rates, causal, scale, backend, pattern_cache=None,
                          memory_pool=None, with_lse=True):
    """``(out, lse [B, H, N])`` in the residue-major order, without autograd (lse empty unless
    ``with_lse``): one block-sparse call, or the natural path's calls and combine between permutes.
    What the custom op ``dilated::residue_major_forward`` computes."""
    segs, dils, impl, lists = resolve_residue_major(q, k, v, segment_lengths, dilation_rates, causal, scale, backend,
                                                    pattern_cache)
    if impl is not None:
        if recording():
            note_kernel(impl.name)
        q, k, v = dense_rows(q), dense_rows(k), dense_rows(v)
        return impl.block_sparse_forward(q, k, v, lists, default_scale(q.shape[-1], scale))
    qkv = tuple(dense_rows(from_residue_major(t, segs, dils)) for t in (q, k, v))
    spec, plan = resolve_dilated(*qkv, segs, dils, causal, scale, backend, pattern_cache)
    out, lse_rows = forward_calls(qkv, plan, spec, pool=memory_pool, with_lse=with_lse)
    lse = to_residue_major(lse_rows, segs, dils).transpose(1, 2).contiguous() if with_lse else None
    return to_residue_major(out, segs, dils), lse


def residue_major_backward(dout, q, k, v, out, lse, segment_lengths, dilation_rates, causal, scale, backend,
                           pattern_cache=None):
    """``dq, dk, dv`` (residue-major order) of :func:`residue_major_forward` given its ``out`` and ``lse``."""
    segs, dils, impl, lists = resolve_residue_major(q, k, v, segment_lengths, dilation_rates, causal, scale, backend,
                                                    pattern_cache)
    if impl is not None:
        q, k, v = dense_rows(q), dense_rows(k), dense_rows(v)
        return impl.block_sparse_backward(dout.contiguous(), q, k, v, out, lse, lists, default_scale(q.shape[-1], scale))
    qkv = tuple(dense_rows(from_residue_major(t, segs, dils)) for t in (q, k, v))
    spec, plan = resolve_dilated(*qkv, segs, dils, causal, scale, backend, pattern_cache)
    out, dout = (from_residue_major(t, segs, dils) for t in (out, dout))
    lse_rows = from_residue_major(lse.transpose(1, 2), segs, dils)
    grads = backward_calls(qkv, plan, spec, out, lse_rows, dout.contiguous())
    return tuple(to_residue_major(g, segs, dils) for g in grads)


# -- the custom ops (dilated.longnet.ops): the computation above as one op each way under torch.compile --


@torch.library.custom_op("dilated::residue_major_forward", mutates_args=())
def residue_major_forward_op(q: Tensor, k: Tensor, v: Tensor, segment_lengths: list[int], dilation_rates: list[int],
                             causal: bool, scale: Optional[float], backend: str, cache: int, pool: int,
                             with_lse: bool) -> tuple[Tensor, Tensor]:
    """``(out [B, N, H, D], lse [B, H, N])`` of ``improved_dilated_attention(..., layout="residue_major")``
    (lse empty unless ``with_lse``): one block-sparse call, or the natural path between permutes."""
    out, lse = residue_major_forward(q, k, v, segment_lengths, dilation_rates, causal, scale, backend,
                                     object_of(cache), object_of(pool), with_lse)
    return out.contiguous(), (lse.contiguous() if with_lse else q.new_empty(0, dtype=acc_dtype(q.dtype)))


@residue_major_forward_op.register_fake
def _(q, k, v, segment_lengths, dilation_rates, causal, scale, backend, cache, pool, with_lse):
    lse_shape = (q.shape[0], q.shape[2], q.shape[1]) if with_lse else (0,)
    return q.new_empty(q.shape), q.new_empty(lse_shape, dtype=acc_dtype(q.dtype))


@torch.library.custom_op("dilated::residue_major_backward", mutates_args=())
def residue_major_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                              segment_lengths: list[int], dilation_rates: list[int], causal: bool,
                              scale: Optional[float], backend: str, cache: int) -> tuple[Tensor, Tensor, Tensor]:
    """``dq, dk, dv`` of :func:`residue_major_forward_op` given its ``out`` and ``lse``."""
    grads = residue_major_backward(dout, q, k, v, out, lse, segment_lengths, dilation_rates, causal, scale, backend,
                                   object_of(cache))
    return tuple(g.to(x.dtype).contiguous() for g, x in zip(grads, (q, k, v)))


@residue_major_backward_op.register_fake
def _(dout, q, k, v, out, lse, segment_lengths, dilation_rates, causal, scale, backend, cache):
    return tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))


residue_major_forward_op.register_autograd(grad_by(residue_major_backward_op, "residue_major_forward"),
                                           setup_context=save_inputs_and_outputs)


class _ResidueMajorFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, segs, dils, causal, scale, backend, pattern_cache, memory_pool):
        out, lse = residue_major_forward(q, k, v, segs, dils, causal, scale, backend, pattern_cache, memory_pool)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = segs, dils, causal, scale, backend, pattern_cache
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        return (*residue_major_backward(dout, q, k, v, out, lse, *ctx.args), *([None] * 7))


def residue_major_attention(q, k, v, segment_lengths, dilation_rates, *, causal=False, scale=None,
                            backend="auto", pattern_cache=None, memory_pool=None):
    """Dilated attention of q, k, v given in the residue-major order; the output in that order:
    :func:`residue_major_forward` and :func:`residue_major_backward` as an autograd Function, and
    under ``torch.compile`` as one custom op (:mod:`dilated.longnet.ops`)."""
    needs_grad = torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in (q, k, v))
    if torch.compiler.is_compiling():  # errors at trace time, the paths inside the op
        segs, dils = check_dilated_inputs(q, k, v, segment_lengths, dilation_rates, causal, warn=False)
        check_scale(scale)
        _check_length(q.shape[1], segs, dils)
        return residue_major_forward_op(q, k, v, list(segs), list(dils), causal, scale, backend,
                                        handle_or_zero(pattern_cache), handle_or_zero(memory_pool), needs_grad)[0]
    if needs_grad:
        return _ResidueMajorFunction.apply(q, k, v, segment_lengths, dilation_rates, causal, scale, backend,
                                           pattern_cache, memory_pool)
    return residue_major_forward(q, k, v, segment_lengths, dilation_rates, causal, scale, backend, pattern_cache,
                                 memory_pool, with_lse=False)[0]


__all__ = ["BLOCK", "BlockLists", "block_lists", "from_residue_major", "geometric_schedule_reason",
           "residue_major_fast_path_reason", "residue_major_positions", "to_residue_major"]
