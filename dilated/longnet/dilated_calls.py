"""The fast dilated computation's kernel calls (see :mod:`dilated.longnet.improved_dilated_attention`): the
plan resolved per input signature, every call's forward merged by one combine (or piece by piece
where the calls' outputs would not fit), and their backward given the merged output and lse.
What the public function, the custom ops (:mod:`dilated.longnet.ops`) and the residue-major and
distributed paths run."""
from __future__ import annotations

import math
from dataclasses import replace

import torch

from .._checks import acc_dtype
from ..backends import get_backend
from ..backends.graph_shapes import no_build, one_operation
from .call_streams import call_streams
from ..dense import AttentionSpec, attention_backward, attention_forward, default_scale
from .dilated_attention import check_dilated_inputs
from .pattern_cache import PatternCache
from .plan import KernelCall, largest_call_inputs, plan_for
from .rows import add_call, combine, gather, merge_call, merged_lse_for


def _covering_part(plan, parts, shape):
    """The part of a ``view`` call covering every row in ``[B, N, H, D]`` order, viewed as such
    (the combined result may overwrite it in place), or None."""
    for c, p in zip(plan, parts):
        if c.mode == "view" and c.start == 0 and c.count * c.length == shape[1] and p.is_contiguous() \
                and p.numel() == math.prod(shape):
            return p.view(shape)
    return None


def _result(plan, parts, like: torch.Tensor, dtype) -> torch.Tensor:
    out = _covering_part(plan, parts, like.shape) if dtype == like.dtype else None
    return out if out is not None else torch.empty(like.shape, dtype=dtype, device=like.device)


def _covered_pairs(c: KernelCall, h: int) -> int:
    """(row, head) pairs of one call's output per batch entry."""
    if c.mode == "view":
        return c.count * c.length * h
    if c.mode == "diag":
        return c.count * c.length * (h // c.r)
    return c.count * len(range(c.first_row, c.length, c.r)) * len(range(c.offset, h, c.r))


#: below this many bytes of call outputs the fast path never asks the device for its free memory
MERGE_MIN_BYTES = 1 << 30
#: the fast path's calls need more than their outputs (kernel workspaces, a backward's float32
#: accumulators): it is taken only where the outputs fit this many times over
MERGE_MARGIN = 1.5
#: merged as they go, calls are cut into pieces of at most this share of the result's rows
PIECE_SHARE = 1 / 32


def merges_as_it_goes(x: torch.Tensor, plan, tensors: int) -> bool:
    """Whether to merge the calls' outputs into the result as they are computed instead of keeping
    every call's output for one combine: where ``tensors`` outputs per call (1 forward, 3
    backward: dq, dk, dv) would not fit in what the device has free. The fast path holds the
    calls' outputs together (about twice the result); merging as it goes holds one piece of a
    call at a time (:func:`pieces`), and reads and writes the result's rows once per piece
    (slower)."""
    if x.device.type != "cuda":
        return False
    b, _, h, d = x.shape
    need = tensors * b * d * x.element_size() * sum(_covered_pairs(c, h) for c in plan)
    return need >= MERGE_MIN_BYTES and MERGE_MARGIN * need > free_bytes(x.device)


def free_bytes(device) -> int:
    """What the caching allocator can still hand out on a CUDA ``device``: the device's free
    memory and what the allocator holds unused."""
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return torch.cuda.mem_get_info(device)[0] + cached


def pieces(plan, n: int, h: int):
    """The calls of ``plan`` cut into consecutive runs of segments, each covering at most
    :data:`PIECE_SHARE` of the ``n * h`` (row, head) pairs (at least one segment): a piece's
    output, gradients and kernel workspace stay small beside the result."""
    most = max(1, int(n * h * PIECE_SHARE))
    for c in plan:
        step = max(1, most // max(1, _covered_pairs(replace(c, count=1), h)))
        for i in range(0, c.count, step):
            yield replace(c, start=c.start + i * c.length, count=min(step, c.count - i))


def _rebased(c: KernelCall) -> tuple[slice, KernelCall]:
    """The rows ``c`` spans, and ``c`` relative to them."""
    return slice(c.start, c.start + c.count * c.length), replace(c, start=0)


@one_operation()
def forward_calls(qkv, plan, spec: AttentionSpec, *, pool=None, dtype=None, extra=None, with_lse=True):
    """Run the kernel calls of ``plan`` on ``qkv = (q, k, v)``; return their mixture ``out``
    (``dtype``, default q's) and its lse in row layout (``[B, N, H]``, float32 or float64; None
    unless ``with_lse``), both written by one :func:`combine`, or merged call by call where the
    calls' outputs would not fit together (:func:`merges_as_it_goes`). ``extra``: ``(calls,
    outputs, lses)`` computed elsewhere, mixed in by the same combine."""
    q, k, v = qkv
    if extra is None and merges_as_it_goes(q, plan, 1):
        return _forward_merging(qkv, plan, spec, pool, dtype or q.dtype, with_lse)
    calls, parts, lses = (list(x) for x in extra) if extra else ([], [], [])
    for c, o, lse in _forward_each(qkv, plan, spec, pool, streams=True):
        calls.append(c)
        parts.append(o)
        lses.append(lse)
    out = _result(calls, parts, q, dtype or q.dtype)
    out_lse = torch.empty(q.shape[:3], device=q.device, dtype=acc_dtype(q.dtype)) if with_lse else None
    return combine(calls, parts, lses, out, out_lse), out_lse


def _forward_each(qkv, plan, spec: AttentionSpec, pool, streams: bool = False):
    """``(call, output, lse)`` of each call of ``plan``; with ``streams``, the calls taken in turns
    by CUDA streams (:mod:`dilated.longnet.call_streams`; not with a ``pool``, whose buffers are ordered
    on one stream), all joined when the last is yielded."""
    q, k, v = qkv
    with call_streams(q.device, len(plan), streams and pool is None) as turn:
        for i, c in enumerate(plan):
            with turn(i):
                (qb, kb, vb), bufs = gather(c, (q, k, v), (False, True, True), pool)
                with no_build(c.clipped):  # a kernel that builds per shape builds nothing for one length's shapes
                    o, lse = attention_forward(spec.backend, qb, kb, vb, spec.causal, spec.scale)
                del qb, kb, vb  # free this branch's inputs before the next branch allocates its own
                for buf in bufs:
                    pool.release(buf)
            yield c, o, lse
            del o, lse  # the caller decides what to keep: merged as it goes, each is freed before the next


def _forward_merging(qkv, plan, spec: AttentionSpec, pool, dtype, with_lse):
    """:func:`forward_calls`, the calls cut into pieces (:func:`pieces`), each piece merged into
    the result over the rows it spans as it finishes."""
    q = qkv[0]
    out = torch.zeros(q.shape, dtype=dtype, device=q.device)
    lse_rows = torch.full(q.shape[:3], float("-inf"), device=q.device, dtype=acc_dtype(q.dtype))
    for c, o, lse in _forward_each(qkv, list(pieces(plan, q.shape[1], q.shape[2])), spec, pool):
        span, c = _rebased(c)
        merge_call(out[:, span], lse_rows[:, span], c, o, lse)
        del o, lse
    return out, (lse_rows if with_lse else None)


def _backward_each(qkv, plan, spec: AttentionSpec, merged, streams: bool = False):
    """``(call, (dq, dk, dv))`` of each call of ``plan``: its kernel backward given ``merged``,
    the merged ``(out, lse rows, dout)``; with ``streams``, the calls taken in turns by CUDA
    streams as the forward's are, all joined when the last is yielded."""
    q, k, v = qkv
    out, lse_rows, dout = merged
    with call_streams(q.device, len(plan), streams) as turn:
        for i, c in enumerate(plan):
            with turn(i):
                (qb, kb, vb, ob, dob), _ = gather(c, (q, k, v, out, dout), (False, True, True, False, False))
                with no_build(c.clipped):
                    g = attention_backward(spec.backend, dob, qb, kb, vb, ob, merged_lse_for(lse_rows, c),
                                           spec.causal, spec.scale)
                del qb, kb, vb, ob, dob
            yield c, g
            del g


def _backward_adding(qkv, plan, spec: AttentionSpec, merged, dtype):
    """:func:`backward_calls`, the calls cut into pieces (:func:`pieces`), each piece's gradients
    added into ``dq, dk, dv`` over the rows it spans as they come."""
    q = qkv[0]
    sums = [torch.zeros(x.shape, dtype=dtype or x.dtype, device=x.device) for x in qkv]
    for c, g in _backward_each(qkv, list(pieces(plan, q.shape[1], q.shape[2])), spec, merged):
        span, c = _rebased(c)
        for i, gi in enumerate(g):
            add_call(sums[i][:, span], c, gi, kv=i > 0)
        del g
    return tuple(sums)


@one_operation()
def backward_calls(qkv, plan, spec: AttentionSpec, out, lse_rows, dout, *, dtype=None):
    """Each call's kernel backward, given the *merged* out and lse, summed into ``dq, dk, dv``
    (``dtype``, default the inputs'), by one combine per gradient, or call by call where the
    calls' gradients would not fit together (:func:`merges_as_it_goes`)."""
    if merges_as_it_goes(qkv[0], plan, 3):
        return _backward_adding(qkv, plan, spec, (out, lse_rows, dout), dtype)
    grads = ([], [], [])
    for _, g in _backward_each(qkv, plan, spec, (out, lse_rows, dout), streams=True):
        for acc, gi in zip(grads, g):
            acc.append(gi)
        del g
    q, k, v = qkv
    result = []
    for i, x in enumerate((q, k, v)):
        parts = grads[i]
        result.append(combine(plan, parts, None, _result(plan, parts, x, dtype or x.dtype), kv=i > 0))
        parts.clear()  # frees this gradient's parts before the next is combined
    return tuple(result)


def resolve_dilated(q, k, v, segment_lengths, dilation_rates, causal, scale, backend,
                    pattern_cache: PatternCache | None = None) -> tuple[AttentionSpec, list]:
    """Validate the inputs and work out the spec and the plan of kernel calls; with a
    ``pattern_cache``, once per input signature (at short sequences the host time before the
    first kernel launch is part of the step)."""

    def resolve():
        segs, dils = check_dilated_inputs(q, k, v, segment_lengths, dilation_rates, causal)
        impl = get_backend(backend, *largest_call_inputs(q, k, segs, dils), causal, v=v)  # auto: by the calls
        plan = plan_for(q, k, segs, dils, impl.reads_strided_rows(q, k, causal))
        return AttentionSpec(impl, causal, default_scale(q.shape[-1], scale)), plan

    try:
        grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
               tuple(segment_lengths), tuple(dilation_rates), causal, scale, backend, grad)  # grad: auto's choice
    except (AttributeError, TypeError):  # not tensors / not sequences: resolve() says what is wrong
        key = None
    return resolve() if pattern_cache is None or key is None else pattern_cache.get(key, resolve)
