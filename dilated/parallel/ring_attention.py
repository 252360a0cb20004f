"""Ring attention: exact dense attention over a sequence sharded across ranks.

Each rank keeps its query shard and computes against one K/V block per step, double-buffered: the
next block is in flight while the current one is computed. Partial outputs merge by log-sum-exp
into a float32 accumulator (:class:`dilated.merge.RowAccumulator`: a piece on rows that hold no
result yet is copied there, and a rank whose one piece covers every row, a ring of one rank,
keeps it as it came). How blocks move (``transport``):

* ``"copy_engine"``: each rank publishes its K/V in symmetric memory and, at step s, pulls the
  block of rank ``rank - s`` straight from its owner (:mod:`dilated.parallel.peer_copy`): the GPU's copy
  engines move it, no SM is taken from the attention kernel, and only the rows a zigzag step
  needs (the first half of an earlier rank's block) are pulled. CUDA, NCCL, one host.
* ``"p2p"``: blocks are passed around the ring by batched send/recv (``dist.batch_isend_irecv``,
  K and V as two messages of one batch, not copied into one buffer); any backend, any number of
  hosts.
* ``"auto"``: copy_engine where it is available, else p2p.

Causal: with ``layout="contiguous"`` rank r computes only blocks from ranks <= r (its own block
square-causal); with ``layout="zigzag"`` (rank r holds chunks r and 2P-1-r of 2P) every step does
the same amount of work: its own block square-causal, an earlier rank's block as all local queries
against that block's first half, a later rank's block as the second half of the local queries
against the whole block.

Backward is a custom autograd Function: K/V travel again (same transport), each rank computes its
contribution with the kernel backward given the *merged* output and lse, and the float32 dK/dV
accumulators travel around the ring by send/recv with their block back to its owner (one extra
hop at the end).

A rank whose computation fails (a kernel error, out of memory) keeps passing blocks on for the
rest of the call and raises only then: the other ranks finish the call instead of waiting for a
block that never comes, and a caller that agrees on the outcome across ranks (the benchmark
harness does) can stop them all together.
"""
from __future__ import annotations

import bisect
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from . import peer_copy
from .._checks import acc_dtype, check_causal, check_qkv, check_scale, dense_rows
from ..backends import get_backend
from ..backends.graph_shapes import one_operation
from .agreement import AgreedSignatures, group_device, signature, validate_on_all_ranks
from .sharding import CommStats
from ..dense import AttentionSpec, attention_backward, attention_forward, default_scale
from ..merge import RowAccumulator
from ..backends.varlen import VarlenKernel, small_documents_kernel, varlen_kernel
from .document_attention import DocumentParts, balanced_layout, document_attention
from .document_calls import block_documents_backward, block_documents_forward
from .document_layout import DocumentLayout, given_or_last
from ..packed import check_cu_seqlens
from .ring_exchange import RingExchange


TRANSPORTS = ("auto", "copy_engine", "p2p")
#: a contiguous or zigzag ring warns where packed documents give its slowest rank this much over the mean work
UNEVEN_DOCUMENTS = 1.25
#: ... judged on the first this many calls with documents of a module (a host cost of O(documents) each)
DOCUMENT_MIXES_CHECKED = 8
#: shard layouts of RingAttention: those of :func:`dilated.shard`, and ``"documents"`` (a
#: :class:`~dilated.DocumentLayout` of each call's documents, see :mod:`dilated.parallel.document_attention`)
RING_LAYOUTS = ("contiguous", "zigzag", "documents")


def _plan(step_src: int, rank: int, n: int, causal: bool, layout: str):
    """(q slice, kv slice, causal) for the block from ``step_src``, or None to skip it."""
    full = slice(0, n)
    if not causal:
        return full, full, False
    if step_src == rank:
        return full, full, True
    if layout == "contiguous":
        return (full, full, False) if step_src < rank else None
    half = n // 2
    if step_src < rank:
        return full, slice(0, half), False
    return slice(half, n), full, False


def _chunks(owner: int, p: int, n: int, layout: str):
    """``(local start, global start, length)`` of the chunks of rank ``owner``'s shard of ``n``."""
    if layout == "contiguous":
        return [(0, owner * n, n)]
    half = n // 2
    return [(0, owner * half, half), (half, (2 * p - 1 - owner) * half, half)]


def _pieces(plan, src: int, rank: int, p: int, n: int, layout: str, cu):
    """The kernel calls ``(q slice, kv slice, causal, documents)`` of one step: ``plan`` itself, or
    with packed documents (``cu``: global cumulative lengths) one per document and pair of chunks
    it meets. Chunks are the ring's causal unit (a chunk pair is all visible, square causal or not
    visible), so a document's part of a pair is all visible or square causal the same way. Two
    different chunks share at most one document (a document meeting both holds every position
    between them); a chunk with itself holds all of its documents, whose q and kv rows are the
    same: that pair is one entry whose ``documents`` are their cumulative lengths within it (one
    varlen call, or batched calls per length); elsewhere ``documents`` is None. Documents are found
    by bisection: the cost does not grow with their number."""
    if plan is None:
        return []
    if cu is None:
        return [(*plan, None)]
    qs, ks, causal = plan
    out = []
    for ql, qg, qn in _chunks(rank, p, n, layout):
        for kl, kg, kn in _chunks(src, p, n, layout):
            if not (qs.start <= ql and ql + qn <= qs.stop and ks.start <= kl and kl + kn <= ks.stop):
                continue  # this chunk pair is not part of the step
            if causal and kg > qg:
                continue  # keys after the queries
            square = causal and kg == qg
            if (kg, kn) == (qg, qn):  # one chunk with itself: its documents tile it
                inside = [qg, *cu[bisect.bisect_right(cu, qg):bisect.bisect_left(cu, qg + qn)], qg + qn]
                docs = [c - qg for c in inside] if len(inside) > 2 else None
                out.append((slice(ql, ql + qn), slice(kl, kl + kn), square, docs))
                continue
            # the one document that can meet both: the one holding the earlier chunk's last position
            i = bisect.bisect_right(cu, min(qg + qn, kg + kn) - 1) - 1
            a, b = cu[i], cu[i + 1]
            q0, q1, k0, k1 = max(a, qg), min(b, qg + qn), max(a, kg), min(b, kg + kn)
            if q0 < q1 and k0 < k1:
                out.append((slice(ql + q0 - qg, ql + q1 - qg), slice(kl + k0 - kg, kl + k1 - kg), square, None))
    return out


def _ring_blocks(ring: RingExchange, k, v, n: int, causal: bool, layout: str, overlap: bool, cu):
    """Yield ``(k_block, v_block, kernel calls)`` for each ring step; the next block is in flight
    meanwhile (or, with ``overlap=False``, received before the current one is computed). Every block
    goes round the whole ring (each rank relays it), whether or not a rank's step uses it."""
    rank, p = ring.rank, ring.size
    kv = (k, v)
    for step in range(p):
        pending = ring.start(kv) if step < p - 1 else None
        if pending is not None and not overlap:
            kv_next, pending = ring.wait(pending), None
        src = (rank - step) % p
        yield *kv, _pieces(_plan(src, rank, n, causal, layout), src, rank, p, n, layout, cu)
        if pending is not None:
            kv_next = ring.wait(pending)
        if step < p - 1:
            kv = kv_next
        ring.stats.steps += 1


def _pulled_blocks(ring: RingExchange, k, v, n: int, causal: bool, layout: str, overlap: bool, cu):
    """``_ring_blocks`` by copy-engine pulls from each block's owner: the pull of step s + 1 runs on
    a high-priority side stream while step s computes (``overlap=False``: right before it). A step
    pulls only the key rows its kernel calls read (with packed documents, those of the documents
    its queries meet), and nothing where it has none."""
    rank, p = ring.rank, ring.size
    published = peer_copy.Published(ring.group, [k, v])
    cur, side = torch.cuda.current_stream(k.device), peer_copy.side_stream(k.device)
    steps = [_pieces(_plan((rank - step) % p, rank, n, causal, layout), (rank - step) % p, rank, p, n, layout, cu)
             for step in range(p)]
    slots = [tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (k, v)) for _ in range(min(2, p - 1))]

    def pull(step):  # into the slot of step - 2, once the compute stream is done with it
        if step >= p or not steps[step]:
            return None
        rows = slice(min(c[1].start for c in steps[step]), max(c[1].stop for c in steps[step]))
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            dst = slots[(step - 1) % len(slots)]
            ring.stats.sent(published.pull((rank - step) % p, rows, dst))
            done = torch.cuda.Event()
            done.record(side)
        return dst, done

    pending = pull(1) if overlap else None
    yield k, v, steps[0]
    ring.stats.steps += 1
    for step in range(1, p):
        got = pending if overlap else pull(step)
        if got is not None:
            with ring.stats.waiting(k.device):
                cur.wait_event(got[1])
        if overlap:
            pending = pull(step + 1)  # its slot was last read by step - 1, already enqueued
        yield (*got[0], steps[step]) if got is not None else (None, None, [])
        ring.stats.steps += 1
    cur.wait_stream(side)


def shard_work(cu, p: int, layout: str, causal: bool) -> list[int]:
    """The (query, key) pairs each of ``p`` ranks' queries attend within the packed documents ``cu``
    (global cumulative lengths) on ``"contiguous"`` or ``"zigzag"`` shards."""
    chunks = 2 * p if layout == "zigzag" else p
    c, work = cu[-1] // chunks, [0] * chunks
    for a, b in zip(cu, cu[1:]):
        for j in range(a // c, (b - 1) // c + 1):
            lo, hi = max(a, j * c), min(b, (j + 1) * c)  # the document's queries in chunk j
            work[j] += (hi - lo) * (lo + hi + 1 - 2 * a) // 2 if causal else (hi - lo) * (b - a)
    return work if layout != "zigzag" else [work[r] + work[chunks - 1 - r] for r in range(p)]


def step_calls(step: int, rank: int, p: int, n: int, causal: bool, layout: str, cu=None):
    """The kernel calls ``(q slice, kv slice, causal, documents)`` of rank ``rank``'s step ``step``
    of a ring of ``p`` ranks with shards of ``n`` rows in ``layout`` (``"contiguous"`` or
    ``"zigzag"``; ``cu``: global cumulative document lengths or None), the block of rank
    ``(rank - step) % p``; empty where the step is skipped. What the forward and backward run, and
    what a cost model of the ring counts."""
    src = (rank - step) % p
    return _pieces(_plan(src, rank, n, causal, layout), src, rank, p, n, layout, cu)


def _blocks(transport: str, ring: RingExchange, k, v, n, causal, layout, overlap, cu):
    fn = _pulled_blocks if transport == "copy_engine" and ring.size > 1 else _ring_blocks
    return fn(ring, k, v, n, causal, layout, overlap, cu)


@dataclass(frozen=True)
class RingCall:
    """What one ring attention call needs besides its tensors: the kernel spec (backend, causal,
    scale), the ring (layout, group, transport, overlap, stats) and packed documents (``cu``,
    global cumulative lengths, or None; ``varlen``: the kernel's own varlen entry point that runs
    the documents of a chunk with itself in one call, or None where there is none; ``small``: with
    ``auto`` and no such entry point, torch's varlen kernel for the documents of batched calls too
    small to keep the GPU busy, see :data:`dilated.packed.SMALL_CALL_FLOPS`)."""

    spec: AttentionSpec
    layout: str
    group: object
    stats: CommStats
    overlap: bool
    transport: str
    cu: tuple | None = None
    varlen: VarlenKernel | None = None
    small: VarlenKernel | None = None

    def steps(self, ring: RingExchange, k, v, n: int):
        """``(k block, v block, kernel calls)`` per ring step."""
        return _blocks(self.transport, ring, k, v, n, self.spec.causal, self.layout, self.overlap, self.cu)


def _forward_piece(call: RingCall, qkv, causal: bool, docs):
    """``(out, lse)`` of one kernel call of a step on ``qkv``, or of the documents ``docs`` it holds
    (in one varlen call where the kernel has one, else in batched calls per document length)."""
    spec = call.spec
    if docs is None:
        return attention_forward(spec.backend, *qkv, causal, spec.scale)
    return block_documents_forward(spec, call.varlen, call.small, *qkv, docs, causal)


def _backward_piece(call: RingCall, tensors, causal: bool, docs):
    """``(dq, dk, dv)`` of one kernel call of a step on ``tensors = (dout, q, k, v, out, lse)``, or
    of the documents ``docs`` it holds (as :func:`_forward_piece`)."""
    spec = call.spec
    if docs is None:
        return attention_backward(spec.backend, *tensors, causal, spec.scale)
    return block_documents_backward(spec, call.varlen, call.small, tensors, docs, causal)


class _RingFunction(torch.autograd.Function):
    @staticmethod
    @one_operation()
    def forward(ctx, q, k, v, call: RingCall):
        ring, n = RingExchange(call.group, call.stats), q.shape[1]
        rows = RowAccumulator.merging((*q.shape[:3], v.shape[3]), q.device, acc_dtype(q.dtype))
        failure = None
        for kb, vb, pieces in call.steps(ring, k, v, n):
            for qs, ks, c, docs in pieces if failure is None else ():
                try:
                    o, lse = _forward_piece(call, (q[:, qs], kb[:, ks], vb[:, ks]), c, docs)
                    rows.add(qs, (o, lse.transpose(1, 2)))
                except Exception as e:  # noqa: BLE001 - raised below, after the ring has moved every block
                    failure = e
                    break
        if failure is not None:  # the other ranks got every block they wait for; now this one fails
            raise failure
        out, lse = rows.result()
        out = out.to(q.dtype)
        lse = lse.transpose(1, 2).to(acc_dtype(q.dtype)).contiguous()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.call = call
        return out

    @staticmethod
    @one_operation()
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        call = ctx.call
        ring = RingExchange(call.group, call.stats)
        p, n, dtype = ring.size, q.shape[1], acc_dtype(q.dtype)
        dout = dout.contiguous()
        dq = RowAccumulator.summing([q.shape], q.device, dtype)
        pending_d, failure = None, None
        for kb, vb, pieces in call.steps(ring, k, v, n):
            # this rank's dK/dV for the step's block: at the first step the block's accumulator; after
            # it, added to the accumulator from the previous ranks (received while the kernels run)
            first = pending_d is None
            dkv, later = RowAccumulator.summing([k.shape, v.shape], k.device, dtype) if first else None, []
            for qs, ks, c, docs in pieces if failure is None else ():
                try:
                    g = _backward_piece(call, (dout[:, qs], q[:, qs], kb[:, ks], vb[:, ks], out[:, qs],
                                               lse[:, :, qs].contiguous()), c, docs)
                except Exception as e:  # noqa: BLE001 - raised below, after the ring has moved every block
                    failure, later = e, []
                    break
                dq.add(qs, g[:1])
                if first:
                    dkv.add(ks, g[1:])
                else:
                    later.append((ks, g[1:]))
                del g
            if first:  # what travels is float32 (float64), whatever the pieces' dtype
                local = tuple(t.to(dtype).contiguous() for t in dkv.result()) if p > 1 else dkv.result()
            else:
                local = ring.wait(pending_d)
                for ks, (dk_piece, dv_piece) in later:
                    local[0][:, ks] += dk_piece
                    local[1][:, ks] += dv_piece
                del later
            if p > 1:  # pass this block's dK/dV on (after the last step: to its owner)
                pending_d = ring.start(local, tag=1)
        dk, dv = ring.wait(pending_d) if p > 1 else local
        if failure is not None:
            raise failure
        (dq,) = dq.result()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


class RingAttention(nn.Module):
    """Exact dense attention over the global sequence; ``forward(q, k, v)`` on this rank's shards
    ``[B, N/P, H, D]`` in ``layout`` (see :func:`dilated.shard`) returns this rank's output
    ``[B, N/P, H, D]``, differentiable. GQA allowed (k/v ``[B, N/P, Hkv, D]``).

    Args:
        causal: causal attention over the global sequence (within each document with packed ones).
        scale: softmax scale (default ``head_dim ** -0.5``).
        backend: the local kernel (``"auto"``, ``"sdpa"``, ``"flash_attn_4"``, ...).
        layout: ``"contiguous"``, ``"zigzag"`` (rank r holds chunks r and 2P-1-r of 2P: balanced
            causal work) or ``"documents"`` (the :class:`~dilated.DocumentLayout` of each call's
            documents, :meth:`document_layout`; only crossing documents' K/V rows are relayed round
            the ring, see :mod:`dilated.parallel.document_attention`).
        group: the process group (default: the world).
        overlap: False waits for each K/V block before computing (to measure what overlap buys).
        measure_comm: record the time the compute stream stalls on communication in ``self.stats``
            (a :class:`dilated.parallel.sharding.CommStats`; CUDA events, read lazily).
        transport: how K/V blocks move (see the module docstring): ``"auto"``, ``"copy_engine"``,
            ``"p2p"``; ``self.transport_used`` says which the last call took.
    """

    def __init__(self, *, causal=False, scale=None, backend="auto", layout="contiguous", group=None,
                 overlap: bool = True, measure_comm: bool = False, transport: str = "auto"):
        super().__init__()
        if layout not in RING_LAYOUTS:
            raise ValueError(f"layout must be one of {RING_LAYOUTS}, got {layout!r}")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if layout == "documents" and transport == "copy_engine":
            raise ValueError("transport='copy_engine' pulls whole shards; with layout='documents' only crossing "
                             "documents' rows move, by send/recv: use transport='p2p' or 'auto'")
        check_causal(causal)
        check_scale(scale)
        self.causal, self.scale, self.backend, self.layout, self.group = causal, scale, backend, layout, group
        self._agreed = AgreedSignatures()  # input signatures all ranks agreed on
        self.overlap, self.transport, self.transport_used = overlap, transport, None
        self.stats = CommStats(measure_comm)
        self.last_layout = None
        self._mixes_checked = 0  # calls with documents whose balance on this layout was judged

    def document_layout(self, cu_seqlens) -> DocumentLayout:
        """The :class:`~dilated.DocumentLayout` of the documents ``cu_seqlens`` (global cumulative
        lengths) over this module's group (``layout="documents"``)."""
        return balanced_layout(cu_seqlens, dist.get_world_size(self.group), self.causal, self.backend,
                               group_device(self.group))

    def _resolve_transport(self, k, v) -> str:
        if self.transport == "p2p":
            return "p2p"
        why = peer_copy.prepare(self.group, k.device, (k.numel() + v.numel()) * k.element_size())
        if why is None:
            return "copy_engine"
        if self.transport == "copy_engine":
            raise ValueError(f"transport='copy_engine' is unavailable here: {why}; use transport='p2p' or 'auto'")
        return "p2p"

    def _validate(self, q, k, v, cu_seqlens):
        check_qkv(q, k, v)
        if k.shape[1] != q.shape[1]:
            raise ValueError(f"q and k/v shards must have one length, got {q.shape[1]} and {k.shape[1]}")
        if self.layout == "zigzag" and q.shape[1] % 2:
            raise ValueError(f"zigzag shards hold two chunks: the local length {q.shape[1]} must be even "
                             "(global N divisible by 2 x world size)")
        scale = default_scale(q.shape[-1], self.scale)
        impl = get_backend(self.backend, q, k, self.causal, v=v)
        docs = None if cu_seqlens is None else tuple(check_cu_seqlens(cu_seqlens, q.shape[1] * dist.get_world_size(
            self.group)))
        fields = signature(q, k, v, causal=self.causal, scale=scale, layout=self.layout, transport=self.transport,
                           overlap=self.overlap, documents=docs)
        if docs is not None and self._mixes_checked < DOCUMENT_MIXES_CHECKED:
            self._mixes_checked += 1
            work = shard_work(docs, dist.get_world_size(self.group), self.layout, self.causal)
            uneven = max(work) / (sum(work) / len(work))
            if uneven > UNEVEN_DOCUMENTS:
                self._mixes_checked = DOCUMENT_MIXES_CHECKED  # once per module
                warnings.warn(f"RingAttention(layout={self.layout!r}) on these packed documents: its slowest rank "
                              f"attends {uneven:.2f}x the mean work (the {self.layout} layout balances one sequence, "
                              "not documents); layout='documents' balances them (dilated.DocumentLayout)",
                              stacklevel=4)
        varlen = None if docs is None else varlen_kernel(q, k, v, self.backend, self.causal)
        small = None
        if docs is not None and varlen is None and self.backend == "auto":
            small = small_documents_kernel(q, k, v, self.causal)
        return (AttentionSpec(impl, self.causal, scale), docs, varlen, small), fields

    def forward(self, q, k, v, cu_seqlens: torch.Tensor | None = None, layout: DocumentLayout | None = None):
        """``cu_seqlens``: packed documents of the *global* sequence (int32 cumulative lengths
        ``[0, ..., N]`` in sequence order, the same on every rank); attention stays within each
        document (the documents of a chunk with itself in one varlen call where the kernel has
        a varlen entry point, else in batched calls per length, ``auto`` running those of calls too
        small to keep the GPU busy in one call of torch's varlen kernel; one call per document and
        pair of different chunks it meets in a step). With ``layout="documents"`` the shards are in
        the documents' :class:`~dilated.DocumentLayout`, or pass that ``layout`` instead of
        ``cu_seqlens``."""
        if not dist.is_initialized():
            raise RuntimeError("RingAttention needs torch.distributed initialised (see dilated.init_distributed)")
        if self.layout == "documents":
            return self._documents(q, k, v, cu_seqlens, layout)
        if layout is not None:
            raise ValueError(f"layout: a DocumentLayout is taken by RingAttention(layout='documents'); this module's "
                             f"shards are {self.layout}")
        spec, docs, varlen, small = validate_on_all_ranks(self.group, self._agreed, "RingAttention",
                                                          lambda: self._validate(q, k, v, cu_seqlens))
        q, k, v = dense_rows(q), k.contiguous(), v.contiguous()
        self.transport_used = self._resolve_transport(k, v)
        call = RingCall(spec, self.layout, self.group, self.stats, self.overlap, self.transport_used, docs, varlen,
                        small)
        return _RingFunction.apply(q, k, v, call)

    def _documents(self, q, k, v, cu_seqlens, layout):
        def validate():
            parts = DocumentParts.resolve(q, k, v, causal=self.causal, scale=self.scale, backend=self.backend,
                                          world_size=dist.get_world_size(self.group), cu_seqlens=cu_seqlens,
                                          layout=layout)
            return parts, parts.signature(q, k, v, algorithm="ring", layout="documents")

        parts = validate_on_all_ranks(self.group, self._agreed, "RingAttention", validate)
        self.last_layout, self.transport_used = parts.layout, "p2p"
        call = parts.call(dist.get_rank(self.group), self.group, self.stats, transport="ring")
        return document_attention(dense_rows(q), k.contiguous(), v.contiguous(), call)

    def _shard_layout(self, layout):
        return given_or_last(layout, self.last_layout) if self.layout == "documents" else self.layout

    def shard(self, x: torch.Tensor, layout: DocumentLayout | None = None) -> torch.Tensor:
        """This rank's part ``[B, N/P, ...]`` of a global ``[B, N, ...]`` tensor, in this module's
        layout (``layout="documents"``: ``layout``, default the last call's)."""
        from .sharding import shard

        return shard(x, group=self.group, layout=self._shard_layout(layout))

    def unshard(self, x_local: torch.Tensor, layout: DocumentLayout | None = None) -> torch.Tensor:
        """The global tensor from every rank's part (an all-gather), in sequence order."""
        from .sharding import unshard

        return unshard(x_local, group=self.group, layout=self._shard_layout(layout))


_MODULES: dict = {}  # (group, settings) -> RingAttention: the agreed input signatures are kept per module


def ring_attention(q, k, v, *, causal: bool = False, scale: float | None = None, backend: str = "auto",
                   layout: str = "contiguous", group=None, transport: str = "auto",
                   cu_seqlens: torch.Tensor | None = None):
    """Functional form of :class:`RingAttention`: exact attention over the global sequence from
    this rank's shards ``[B, N/P, H, D]`` in ``layout`` (see :func:`dilated.shard`); differentiable.
    Calls with the same settings on the same group share one module, so the ranks compare their
    inputs once per signature, not per call."""
    key = (id(group) if group is not None else None, causal, scale, backend, layout, transport)
    module = _MODULES.get(key)
    if module is None:
        module = _MODULES[key] = RingAttention(causal=causal, scale=scale, backend=backend, layout=layout,
                                               group=group, transport=transport)
    return module(q, k, v, cu_seqlens=cu_seqlens)
