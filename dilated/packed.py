"""Packed documents: several documents in one sequence, ``cu_seqlens`` their cumulative lengths
(int32 ``[0, l_0, l_0 + l_1, ..., N]``, the flash-attn varlen convention). Attention never crosses
a document boundary; causal applies within each document.

On CUDA, with half-precision inputs, documents go to a kernel's own varlen entry point in one
call over all of them (:mod:`dilated.backends.varlen`) where the kernel the backend resolves to
has one: torch's varlen flash kernel (the ops behind ``torch.nn.attention.varlen``, where the
installed torch has them) for ``sdpa_flash``, flash-attn 4's for ``flash_attn_4``; ``auto`` takes
flash-attn 4's wherever it runs, else the entry point of the kernel it resolves to; forward and
backward are the kernel's own, the backward given the (merged) out and lse, so ring attention
calls them too. Elsewhere, documents run in batched kernel calls, not one call per document:
non-causal documents of one length share a call (their batch is the number of such documents);
causal ones are padded at their end to a bucket length (:func:`bucket_length`: ``B`` per octave,
at most ``1 / B`` of a call's length padding; four up to :data:`FINE_BUCKETS_ABOVE` positions,
:data:`BUCKETS_PER_OCTAVE` above) and share the bucket's call.
Padding at the end is exact under causality: a real query sees only keys at or before it, never
a padded one, and the padded rows' outputs are dropped (their gradients are zero). So the calls
are at most one per distinct length (non-causal) or about ``B`` per octave of lengths (causal).
On SDPA's cuDNN kernel, which builds a graph per call shape, a call per distinct length would meet
new shapes at nearly every new mix, so there non-causal documents are padded to bucket lengths too,
and a call with padding runs as two causal calls, each document in order and reversed, whose merge
is the non-causal attention (:mod:`dilated.causal_halves`; :func:`halves_backend`): the causal
documents' shapes, a bounded set.
Their backward gathers each call's rows again and scatters its gradients back
(:class:`DocumentsFunction`), as the rings do. The calls' row indices are made on the device once
per mix and kept for the last few (:func:`document_rows`): a model's layers and a call's backward
meet one batch's documents again.
"""
from __future__ import annotations

import itertools
import os
from collections import OrderedDict, defaultdict

import torch

from .indexed_rows import place_rows_
from ._transfer import host_values_on, made_for_a_cache
from .backends import get_backend
from .backends.graph_shapes import build_at_first_call
from . import causal_halves
from .backends.kernel_log import note_kernel
from .backends.varlen import VarlenCall, VarlenKernel, small_documents_kernel
from .dense import attention_backward, attention_forward


def check_cu_seqlens(cu_seqlens, n: int) -> list[int]:
    """Validate ``cu_seqlens`` for a packed sequence of ``n`` positions; return it as a list."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor (int32 cumulative document lengths), got "
                        f"{type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"cu_seqlens must be int32 (the flash-attn varlen convention), got {cu_seqlens.dtype}: "
                        "convert it with cu_seqlens.to(torch.int32)")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-d with at least 2 entries [0, ..., N], got shape "
                         f"{tuple(cu_seqlens.shape)}")
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != n:
        raise ValueError(f"cu_seqlens must start at 0 and end at the sequence length {n}, got {cu[0]} ... {cu[-1]}: "
                         "the documents' lengths must sum to N")
    if any(b <= a for a, b in zip(cu, cu[1:])):
        raise ValueError("cu_seqlens must be strictly increasing (every document at least one position long), got "
                         f"{cu[:12]}{' ...' if len(cu) > 12 else ''}")
    return cu


#: causal documents longer than :data:`FINE_BUCKETS_ABOVE` are padded to the next of this many bucket
#: lengths per octave by default: padding costs up to ``2 / B`` of a document's causal work, and every
#: bucket is a call shape of its own (a cuDNN graph, built at the shape's first call)
DEFAULT_BUCKETS_PER_OCTAVE = 8
#: ... and documents up to this length to the next of four per octave: a short document's padding costs
#: little, and finer buckets would split its call into calls small enough for the slower varlen kernel
FINE_BUCKETS_ABOVE = 4096


#: the environment variable that sets :data:`BUCKETS_PER_OCTAVE`
BUCKETS_ENV = "DILATED_BUCKETS_PER_OCTAVE"


def buckets_per_octave_from_env() -> int:
    """``DILATED_BUCKETS_PER_OCTAVE`` (1, 2, 4, 8 or 16; :data:`DEFAULT_BUCKETS_PER_OCTAVE` where unset); a
    clear error otherwise."""
    value = os.environ.get(BUCKETS_ENV)
    if value is None:
        return DEFAULT_BUCKETS_PER_OCTAVE
    if value.strip() not in ("1", "2", "4", "8", "16"):
        raise ValueError(f"{BUCKETS_ENV}={value!r}: set it to 1, 2, 4, 8 or 16 (the bucket lengths per "
                         "octave that long causal packed documents are padded to) or unset it "
                         f"(default {DEFAULT_BUCKETS_PER_OCTAVE})")
    return int(value)


#: the bucket lengths per octave of documents longer than :data:`FINE_BUCKETS_ABOVE` in this process
#: (``DILATED_BUCKETS_PER_OCTAVE``, read at import)
BUCKETS_PER_OCTAVE = buckets_per_octave_from_env()


def bucket_length(length: int, per_octave: int | None = None) -> int:
    """The smallest of ``2^e + i * 2^e / B`` (``i = 0 .. B``) at or above ``length``, where ``2^e <
    length <= 2^(e+1)`` and ``B`` is ``per_octave`` if given, else :data:`BUCKETS_PER_OCTAVE` above
    :data:`FINE_BUCKETS_ABOVE` and 4 up to it."""
    if per_octave is None:
        per_octave = BUCKETS_PER_OCTAVE if length > FINE_BUCKETS_ABOVE else min(4, BUCKETS_PER_OCTAVE)
    e = (length - 1).bit_length() - 1
    step = (1 << e) // per_octave if e >= 0 else 0
    if step < 1:
        return length
    return -(-length // step) * step


def document_calls(cu: list[int], causal: bool, halves: bool = False) -> list[tuple[int, list[tuple[int, int]]]]:
    """``(call length, [(start, length), ...])`` per kernel call: documents of one length, or
    (causal, or with ``halves``: non-causal attended as two causal halves, :func:`halves_backend`)
    of one bucket length, together, in calls of a power-of-two count each (the binary
    digits of the group's count, largest first); the longest call first, so the GPU starts on the
    largest work while the host launches the small calls (which take it longer than they take
    the GPU). A kernel that builds a plan per call shape (cuDNN's graphs: the batch is in the key)
    thus meets the same few shapes at every new document mix, not a new batch per mix."""
    groups = defaultdict(list)
    for start, end in zip(cu, cu[1:]):
        length = end - start
        groups[bucket_length(length) if causal or halves else length].append((start, length))
    calls = []
    for length, docs in sorted(groups.items(), reverse=True):
        while docs:
            count = 1 << (len(docs).bit_length() - 1)
            calls.append((length, docs[:count]))
            docs = docs[count:]
    return calls


def packed_attention(q, k, v, cu: list[int], backend: str, causal: bool, scale: float):
    """``(out, lse)`` (lse ``[B, H, N]``) of the packed ``[B, N, H, D]`` q, k, v, each document of the
    validated cumulative lengths ``cu`` attended alone, in the batched calls of :func:`document_calls`
    on ``backend`` (resolved per call). Differentiable through out and lse: the backward runs the
    kernels' backward on the same calls (:class:`DocumentsFunction`). With ``auto``, the documents of
    calls too small to keep the GPU busy (:data:`SMALL_CALL_FLOPS`) run in one call of torch's varlen
    flash kernel where it runs."""
    if torch.compiler.is_compiling():  # each call one custom op (dilated.ops); autograd through the gathers
        return documents_forward(q, k, v, cu, lambda a, b, c: torch.ops.dilated.attention_forward(
            a, b, c, causal, scale, backend, True), causal)
    small = small_documents_kernel(q, k, v, causal) if backend == "auto" else None
    small = None if small is None else (small, scale)
    halves = halves_for(backend, q, k, v, causal, scale)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return DocumentsFunction.apply(q, k, v, tuple(cu), backend, causal, scale, small, halves)
    return documents_forward(q, k, v, cu, _DocumentCalls(backend, causal, scale).forward, causal, small, halves)


class _DocumentCalls:
    """The kernel calls of one packed attention: each call's backend resolved in the forward (``auto``
    by the call's shape) and reused, call by call, in the backward."""

    def __init__(self, backend: str, causal: bool, scale: float):
        self.backend, self.causal, self.scale, self.resolved = backend, causal, scale, []

    def forward(self, q, k, v):
        impl = get_backend(self.backend, q, k, self.causal, v=v)
        self.resolved.append(impl)
        return attention_forward(impl, q, k, v, self.causal, self.scale)

    def backward(self, index: int, dout, q, k, v, out, lse, dlse=None):
        return attention_backward(self.resolved[index], dout, q, k, v, out, lse, self.causal, self.scale, dlse)


class DocumentsFunction(torch.autograd.Function):
    """Autograd over :func:`documents_forward` / :func:`documents_backward`: the backward gathers each
    call's rows and scatters its gradients back (autograd through the forward's gathers would
    accumulate them by sorting indices, a large share of a step: docs/performance-log.md)."""

    @staticmethod
    def forward(ctx, q, k, v, cu: tuple, backend: str, causal: bool, scale: float, small=None, halves=None):
        ctx.set_materialize_grads(False)  # an unused lse's gradient comes as None, not as zeros
        calls = _DocumentCalls(backend, causal, scale)
        out, lse = documents_forward(q, k, v, list(cu), calls.forward, causal, small, halves)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.calls, ctx.cu, ctx.small, ctx.halves = calls, list(cu), small, halves
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout
        count = iter(range(len(ctx.calls.resolved)))
        grads = documents_backward((dout, q, k, v, out, lse), ctx.cu,
                                   lambda *t, dlse=None: ctx.calls.backward(next(count), *t, dlse=dlse),
                                   ctx.calls.causal, dlse, ctx.small, ctx.halves)
        return *grads, None, None, None, None, None, None


#: :func:`document_rows` keeps at most this many mixes (a ring's steps on documents meet several per call) ...
KEPT_MIXES = 16
#: ... holding at most this many positions in all (the most recent mix is kept whatever its size)
KEPT_POSITIONS = 1 << 22

_KEPT: OrderedDict = OrderedDict()


def document_rows(cu: list[int], causal: bool, heads: int, head_dim: int, small: bool, device,
                  halves: bool = False) -> tuple:
    """``(rest, calls)`` of the packed documents ``cu`` on ``device``: the rows of the documents that
    the small-documents call takes (:func:`_small_rows`; None where none do or ``small`` is off) and
    each batched call's rows (:func:`_document_rows`; ``halves``: as :func:`document_calls`). A
    model's layers, and a call's backward, meet one batch's documents again, so the last mixes are
    kept (:data:`KEPT_MIXES`, up to :data:`KEPT_POSITIONS` positions in all; their index tensors take
    about ``4 * 8`` bytes per position) instead of being made again in a dozen small kernels per
    call; under CUDA-graph capture they are made anew (the graph keeps what it reads)."""
    device = torch.device(device)
    key = (tuple(cu), causal, heads, head_dim, SMALL_CALL_FLOPS if small else None, device, halves)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return _make_rows(*key)
    kept = _KEPT.pop(key, None)
    if kept is None:
        rows = made_for_a_cache(lambda: _make_rows(*key), device)
        made = None
        if device.type == "cuda":  # made where the current stream has waited for them: a call on another waits too
            made = torch.cuda.Event()
            made.record(torch.cuda.current_stream(device))
        kept = rows, made
    elif kept[1] is not None:
        torch.cuda.current_stream(device).wait_event(kept[1])
    _KEPT[key] = kept  # the most recent last
    while len(_KEPT) > 1 and (len(_KEPT) > KEPT_MIXES or sum(k[0][-1] for k in _KEPT) > KEPT_POSITIONS):
        _KEPT.popitem(last=False)
    return kept[0]


def _make_rows(cu: tuple, causal: bool, heads: int, head_dim: int, small_flops, device, halves: bool) -> tuple:
    """:func:`document_rows`; ``small_flops``: :data:`SMALL_CALL_FLOPS` as it is now (None: no small call)."""
    calls, rest = document_calls(list(cu), causal, halves), []
    if small_flops is not None:
        calls, rest = split_small_calls(calls, heads, head_dim, causal)
    return (_small_rows(rest, device) if rest else None), tuple(_document_rows(calls, device, halves and not causal))


def _document_rows(calls, device, halves: bool = False):
    """Per kernel call of :func:`document_calls`: ``(length, documents, pos, pad, real, at, flip)``:
    the positions its ``[documents, length]`` rows read, the indices of its padding rows among them
    (None where it has none), the indices of its real rows among them, their positions in the
    sequence, and, with ``halves`` where the call has padding, the order of its rows with each
    document reversed (padding in place; its own inverse; else None). Made on the device from the
    documents' starts and lengths without waiting for it: the sizes are known here (a boolean mask
    would make indexing wait for its count)."""
    for length, docs in calls:
        starts, lengths = host_values_on(docs, torch.int64, device)[0].unbind(1)
        offsets = torch.arange(length, device=device)
        inside = offsets < lengths[:, None]
        pos = torch.where(inside, starts[:, None] + offsets, 0).flatten()
        total = sum(size for _, size in docs)
        doc, within = _runs(lengths, total)
        pad = None
        if total < length * len(docs):
            pad_doc, pad_within = _runs(length - lengths, length * len(docs) - total)
            pad = pad_doc * length + lengths[pad_doc] + pad_within
        flip = None
        if halves and pad is not None:  # row i * length + t of a document of m rows <-> i * length + m - 1 - t
            first = torch.arange(len(docs), device=device)[:, None] * length
            flip = torch.where(inside, first + lengths[:, None] - 1 - offsets, first + offsets).flatten()
        yield length, len(docs), pos, pad, doc * length + within, starts[doc] + within, flip


def _runs(sizes: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(run, offset)`` of each of the ``total = sum(sizes)`` elements of consecutive runs of the given
    sizes (``total`` given: the host knows it, and computing it would wait for the device)."""
    run = torch.repeat_interleave(torch.arange(len(sizes), device=sizes.device), sizes, output_size=total)
    return run, torch.arange(total, device=sizes.device) - (torch.cumsum(sizes, 0) - sizes)[run]


def halves_backend(backend, q, k, v, causal: bool):
    """The backend on which non-causal documents go padded to bucket lengths, as causal ones do, each
    padded call attended as two causal calls (:mod:`dilated.causal_halves`), or None: SDPA's cuDNN
    kernel, where ``backend`` (a name or a resolved :class:`~dilated.backends.Backend`) runs these
    inputs on it. A call per document length would make new call shapes at nearly every new mix,
    and cuDNN builds a graph for each (docs/performance-log.md); padded, the shapes are a bounded set,
    the causal documents' own."""
    if causal or q.device.type != "cuda" or torch.compiler.is_compiling():
        return None
    impl = get_backend(backend, q, k, False, v=v) if isinstance(backend, str) else backend
    if impl.kernel_name(q, k, False) != "sdpa_cudnn":
        return None
    return get_backend("sdpa_cudnn", q, k, True, v=v)


def halves_for(backend, q, k, v, causal: bool, scale: float):
    """``(backend, scale)``, the ``halves`` argument of :func:`documents_forward`, where non-causal
    documents go as two causal halves (:func:`halves_backend`), else None."""
    impl = halves_backend(backend, q, k, v, causal)
    return None if impl is None else (impl, scale)


#: a batched call doing less work than this (a fraction of a millisecond of a Hopper GPU) takes the
#: host about as long to launch (its gathers, the call, its scatter) as the GPU to run: with ``auto``,
#: the documents of such calls run in one varlen call instead (many short documents: see
#: docs/performance-log.md).
SMALL_CALL_FLOPS = 2e11


def split_small_calls(calls, heads: int, head_dim: int, causal: bool):
    """``(calls that stay batched, [(start, length), ...] of the documents of the smaller ones)``."""
    big, small = [], []
    for length, docs in calls:
        flops = 4 * len(docs) * length * length * heads * head_dim / (2 if causal else 1)
        if flops >= SMALL_CALL_FLOPS:
            big.append((length, docs))
        else:
            small.extend(docs)
    return big, sorted(small)


def small_rectangles(cu_q, cu_k, heads: int, head_dim: int) -> bool:
    """Whether the rectangles ``cu_q`` x ``cu_k`` (cumulative query and key counts, every key
    visible) are on average smaller than :data:`SMALL_CALL_FLOPS` per batch row: then, with ``auto``
    and no varlen entry point, they run in one call of torch's varlen kernel, as the documents of
    small batched calls do, not in a call each."""
    pairs = [(b - a) * (d - c) for a, b, c, d in zip(cu_q, cu_q[1:], cu_k, cu_k[1:])]
    return bool(pairs) and 4 * sum(pairs) * heads * head_dim < SMALL_CALL_FLOPS * len(pairs)


def _small_rows(docs, device):
    """``(positions of the documents' rows, one document after another; their cumulative lengths)``."""
    starts, lengths = host_values_on(docs, torch.int64, device)[0].unbind(1)
    cu = [0, *itertools.accumulate(size for _, size in docs)]
    run, within = _runs(lengths, cu[-1])
    return starts[run] + within, cu


def _gather(x: torch.Tensor, pos: torch.Tensor, pad: torch.Tensor | None, dim: int = 1) -> torch.Tensor:
    """``x``'s rows ``pos`` along ``dim``, the padding rows ``pad`` zero (so a padded query or key
    adds nothing, and a padded key holds no NaN or Inf read from elsewhere)."""
    rows = x.index_select(dim, pos)
    return rows if pad is None else rows.index_fill_(dim, pad, 0)


def documents_forward(q, k, v, cu: list[int], attend, causal: bool, small=None, halves=None):
    """:func:`packed_attention` on validated cumulative lengths ``cu`` (a list): documents of one
    length (causal: one bucket) in one call of ``attend``; ``small = (varlen kernel, scale)``: the
    documents of calls below :data:`SMALL_CALL_FLOPS` in one call of that kernel instead;
    ``halves = (backend, scale)``: non-causal documents in calls of a bucket length, a call with
    padding as two causal calls of that backend (:func:`halves_backend`)."""
    b, n = q.shape[:2]
    if len(cu) == 2:
        return attend(q, k, v)
    rest, calls = document_rows(cu, causal, q.shape[2], q.shape[3], small is not None, q.device, halves is not None)
    out = lse = None
    if rest:
        pos, cu_rest = rest
        o, l = varlen_forward(small[0], *(x.index_select(1, pos) for x in (q, k, v)), cu_rest, causal, small[1])
        out, lse = o.new_empty(b, n, *o.shape[2:]), l.new_empty(b, l.shape[1], n)
        place_rows_(out, pos, o)
        lse[:, :, pos] = l
    for length, count, pos, pad, real, at, flip in calls:
        qg, kg, vg = (_gather(x, pos, pad).reshape(b * count, length, *x.shape[2:]) for x in (q, k, v))
        with build_at_first_call():  # a bounded set of shapes that new mixes meet again
            if flip is None:
                o, l = attend(qg, kg, vg)
            else:  # keys at or before each query, then at or after it (each document reversed)
                impl, scale = halves
                o, l = attention_forward(impl, qg, kg, vg, True, scale)
                reversed_ = (causal_halves.flipped(x, flip, b) for x in (qg, kg, vg))
                o2, l2 = attention_forward(impl, *reversed_, True, scale)
                o, l = causal_halves.merge(o, l, o2, l2, qg, kg, vg, scale, flip, b)
        h = l.shape[1]
        l = _real(l.reshape(b, count, h, length).transpose(1, 2).reshape(b, h, count * length), real, pad, 2)
        if out is None:  # every position is in one call: all of it is written
            out = o.new_empty(b, n, *o.shape[2:])
            lse = l.new_empty(b, h, n)
        place_rows_(out, at, o, None if pad is None else real)  # the call's real rows, read where they lie
        lse[:, :, at] = l
    return out, lse


def _halves_backward(halves, flip: torch.Tensor, b: int, dout, q, k, v, out, lse, dlse):
    """``(dq, dk, dv)`` of a call attended as two causal halves (:func:`documents_forward`): each half's
    backward given the merged out and lse, the second's rows put back in order, less the diagonal's
    share that both hold (:func:`dilated.causal_halves.diagonal_gradients`). The reversed half runs
    first, so that its reversed inputs are gone before the first half's gradients are made."""
    impl, scale = halves
    reversed_ = [causal_halves.flipped(x, flip, b) for x in (dout, q, k, v, out)]
    reversed_lse = [None if x is None else causal_halves.flipped_lse(x, flip, b) for x in (lse, dlse)]
    second = attention_backward(impl, *reversed_, reversed_lse[0], True, scale, reversed_lse[1])
    del reversed_, reversed_lse  # freed before the first half's gradients are made
    first = attention_backward(impl, dout, q, k, v, out, lse, True, scale, dlse)
    return causal_halves.combine_gradients(first, second, dout, q, k, v, out, lse, scale, flip, b, dlse)


def _real(rows: torch.Tensor, real: torch.Tensor, pad: torch.Tensor | None, dim: int = 1) -> torch.Tensor:
    """A call's real rows ``real`` along ``dim`` (all of them where it has no padding ``pad``)."""
    return rows if pad is None else rows.index_select(dim, real)


def documents_backward(tensors, cu: list[int], backward, causal: bool, dlse=None, small=None, halves=None):
    """``backward(dout, q, k, v, out, lse[, dlse=]) -> (dq, dk, dv)`` (a kernel backward, causal as
    given) over each document of the packed ``tensors = (dout, q, k, v, out, lse)`` separately, in
    the calls of :func:`documents_forward`; lse ``[B, H, N]``; ``dlse`` (``[B, H, N]`` or None) the
    gradient of lse; ``small`` and ``halves`` as in :func:`documents_forward`. Padded rows have q, out and dout 0
    and lse and dlse 0: they add no gradient."""
    dout, q, k, v, out, lse = tensors
    b, n = q.shape[:2]
    if len(cu) == 2:
        return backward(*tensors) if dlse is None else backward(*tensors, dlse=dlse)
    h = lse.shape[1]
    grads = [None, None, None]
    rest, calls = document_rows(cu, causal, q.shape[2], q.shape[3], small is not None, q.device, halves is not None)
    if rest:
        pos, cu_rest = rest
        rows = tuple(x.index_select(1, pos) for x in (dout, q, k, v, out)) + (lse.index_select(2, pos),)
        for i, (x, gi) in enumerate(zip((q, k, v), varlen_backward(
                small[0], rows, cu_rest, causal, small[1], None if dlse is None else dlse.index_select(2, pos)))):
            grads[i] = torch.empty(x.shape, dtype=gi.dtype, device=x.device)
            place_rows_(grads[i], pos, gi)
    for length, count, pos, pad, real, at, flip in calls:
        dg, qg, kg, vg, og = (_gather(x, pos, pad).reshape(b * count, length, *x.shape[2:])
                              for x in (dout, q, k, v, out))
        lg, dlg = (None if x is None else _gather(x, pos, pad, 2).reshape(b, h, count, length).transpose(1, 2)
                   .reshape(b * count, h, length).contiguous() for x in (lse, dlse))
        extra = {} if dlg is None else {"dlse": dlg}
        with build_at_first_call():
            if flip is None:
                call_grads = backward(dg, qg, kg, vg, og, lg, **extra)
            else:
                call_grads = _halves_backward(halves, flip, b, dg, qg, kg, vg, og, lg, dlg)
        for i, (x, gi) in enumerate(zip((q, k, v), call_grads)):
            if grads[i] is None:  # every position is in one call: all of it is written
                grads[i] = torch.empty(x.shape, dtype=gi.dtype, device=x.device)
            place_rows_(grads[i], at, gi, None if pad is None else real)
    return tuple(grads)


def varlen_call(cu: list[int], b: int, n: int, causal: bool, scale: float, device) -> VarlenCall:
    """The :class:`VarlenCall` of the documents ``cu`` in each of ``b`` batch rows of length ``n``
    (the rows packed one after another)."""
    cu_all = [s + i * n for i in range(b) for s in cu[:-1]] + [b * n]
    cu_t = host_values_on(cu_all, torch.int32, device)[0]
    longest = max(e - s for s, e in zip(cu, cu[1:]))
    return VarlenCall(cu_t, cu_t, longest, longest, causal, scale)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``[B, N, H, D]`` as packed ``[B * N, H, D]`` rows."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _lse_packed(lse: torch.Tensor) -> torch.Tensor:
    """``[B, H, N]`` as the varlen kernels' ``[H, B * N]``."""
    return lse.transpose(0, 1).reshape(lse.shape[1], -1)


def varlen_forward(kernel: VarlenKernel, q, k, v, cu: list[int], causal: bool, scale: float):
    """``(out [B, N, H, D], lse [B, H, N] float32)`` of the packed documents ``cu`` (the same in every
    batch row) by one call of ``kernel``; no autograd."""
    b, n, h, _ = q.shape
    note_kernel(kernel.name)
    out, lse = kernel.forward(_rows(q), _rows(k), _rows(v), varlen_call(cu, b, n, causal, scale, q.device))
    return out.view(b, n, h, out.shape[-1]), lse.view(h, b, n).transpose(0, 1)


def varlen_backward(kernel: VarlenKernel, tensors, cu: list[int], causal: bool, scale: float, dlse=None):
    """``(dq, dk, dv)`` of :func:`varlen_forward` given ``tensors = (dout, q, k, v, out, lse)``, the
    (merged) out and lse ``[B, H, N]``; ``dlse`` (``[B, H, N]`` or None) is the gradient of lse."""
    dout, q, k, v, out, lse = tensors
    b, n = q.shape[:2]
    note_kernel(kernel.name)
    grads = kernel.backward(_rows(dout), _rows(q), _rows(k), _rows(v), _rows(out), _lse_packed(lse),
                            varlen_call(cu, b, n, causal, scale, q.device),
                            None if dlse is None else _lse_packed(dlse))
    return tuple(g.view(x.shape) for g, x in zip(grads, (q, k, v)))


class VarlenFunction(torch.autograd.Function):
    """Autograd over :func:`varlen_forward` / :func:`varlen_backward`: gradients flow through out
    and lse."""

    @staticmethod
    def forward(ctx, q, k, v, kernel: VarlenKernel, cu: tuple, causal: bool, scale: float):
        ctx.set_materialize_grads(False)  # an unused lse's gradient comes as None, not as zeros
        out, lse = varlen_forward(kernel, q, k, v, list(cu), causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kernel, ctx.cu, ctx.causal, ctx.scale = kernel, list(cu), causal, scale
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout
        dq, dk, dv = varlen_backward(ctx.kernel, (dout, q, k, v, out, lse), ctx.cu, ctx.causal, ctx.scale, dlse)
        return dq, dk, dv, None, None, None, None


def varlen_attention(q, k, v, cu: list[int], causal: bool, scale: float, kernel: VarlenKernel):
    """``(out, lse)`` of the packed documents ``cu`` by one call of a varlen kernel over every batch
    row's documents; differentiable (through out and lse)."""
    return VarlenFunction.apply(q, k, v, kernel, tuple(cu), causal, scale)
