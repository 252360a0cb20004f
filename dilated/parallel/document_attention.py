"""Document-parallel attention: packed documents balanced over ranks, only crossing documents' K/V moved.

Each rank holds the positions a :class:`~dilated.parallel.document_layout.DocumentLayout` gives it: most
documents whole on one rank, the few whose work no whole assignment balances cut head-tail over
every rank. A call on rank r:

1. starts gathering the K/V rows of its pieces of *crossing* documents (those with pieces on
   several ranks), padded to the largest such count over the ranks (the layout knows every rank's,
   so no sizes are exchanged): one all-gather (``transport="all_gather"``), or ``P - 1`` send/recv
   hops round the ring issued on a side stream (``"ring"``, :class:`~dilated.RingAttention` with
   ``layout="documents"``: traffic only between ring neighbours);
2. meanwhile computes every local piece against itself (one varlen call over the pieces; causal,
   square within each piece): whole documents are done here, with no communication;
3. computes each local piece of a crossing document against the other keys of its document that
   its queries see (causal: the positions before the piece; otherwise all others), gathered from
   the all-gather's rows, as one varlen call of rectangles; then merges the two by log-sum-exp.

Backward runs the second part first, sends its dK/dV back to the keys' owners with one
reduce-scatter (float32; on the ring, ``P - 1`` hops each adding its own part) that overlaps the
local pieces' backward, and adds them to the owners' gradients. Kernels: the backend's varlen entry point where it has one (flash-attn 4, torch's
varlen flash kernel), else the pieces in batched calls per length (local) and one call per
rectangle (crossing), with ``auto`` those too small for a call each in one call of torch's varlen
kernel (:func:`dilated.packed.small_rectangles`).
"""
from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from .._checks import acc_dtype, check_causal, check_qkv, check_scale, dense_rows
from .._transfer import host_tensor_on, host_values_on
from .agreement import AgreedSignatures, group_device, signature, validate_on_all_ranks
from ..backends import get_backend
from ..backends.varlen import VarlenCall, VarlenKernel, documents_pair_costs, small_documents_kernel, varlen_kernel
from .sharding import CommStats, all_gather_into, reduce_scatter_from
from .document_layout import DocumentLayout, given_or_last, ranges_to_positions
from ..dense import AttentionSpec, attention_backward, attention_forward, default_scale
from ..indexed_rows import add_rows_, add_to_slots_, merge_rows_
from .document_calls import block_documents_backward, block_documents_forward
from .ring_exchange import RingExchange
from ..packed import small_rectangles


def balanced_layout(cu_seqlens, world_size: int, causal: bool, backend: str, device=None,
                    dtype=torch.bfloat16) -> DocumentLayout:
    """:meth:`DocumentLayout.balance` of ``cu_seqlens`` over ``world_size`` ranks balancing the pairs as the
    kernel that attends them costs them (:func:`~dilated.backends.varlen.documents_pair_costs` of ``backend``
    for inputs of ``dtype`` on ``device``; a module's :meth:`document_layout`: on its group's device, in
    bfloat16): what the modules on document layouts make."""
    return DocumentLayout.balance(cu_seqlens, world_size, causal, pair_costs=documents_pair_costs(backend, device, dtype))


@dataclass(frozen=True, eq=False)
class RankPlan:
    """What rank ``rank`` of ``layout`` computes and exchanges (host tensors; device copies cached).

    ``local_cu``: cumulative lengths of its pieces (local order); ``send``: its local rows of crossing
    documents; ``rows``: rows every rank sends (the largest ``send`` over the ranks; 0: none);
    ``q_rows``/``k_slots``: the local query rows of the rectangles and their keys' slots in the
    gathered ``[P * rows]`` buffer; ``cu_q``/``cu_k``: the rectangles' cumulative sizes."""

    local_cu: tuple
    send: torch.Tensor
    rows: int
    q_rows: torch.Tensor
    k_slots: torch.Tensor
    cu_q: tuple
    cu_k: tuple
    _on: dict = field(default_factory=dict, repr=False)

    def on(self, device) -> tuple:
        """``(send, q_rows, k_slots)`` on ``device`` (copied without waiting for it)."""
        key = str(device)
        if key not in self._on:
            # with their pinned sources: a CUDA graph captured here replays the copies from them
            self._on[key] = tuple(host_tensor_on(t, device) for t in (self.send, self.q_rows, self.k_slots))
        return tuple(t for t, _ in self._on[key])


def rank_plan(layout: DocumentLayout, rank: int) -> RankPlan:
    """The :class:`RankPlan` of ``rank`` (computed once per layout and rank, kept with the layout)."""
    return layout.derived(("rank_plan", rank), lambda: _rank_plan(layout, rank))


def _slot_runs(pieces, a: int, b: int) -> list[tuple[int, int]]:
    """``[(slot, count), ...]``: where positions ``a .. b - 1`` of a document lie in the gathered
    buffer, given the document's ``pieces`` as ``(start, length, slot)`` in sequence order."""
    runs = []
    for start, length, slot in pieces:
        lo, hi = max(a, start), min(b, start + length)
        if lo < hi:
            runs.append((slot + lo - start, hi - lo))
    return runs


def _rank_plan(layout: DocumentLayout, rank: int) -> RankPlan:
    p = layout.world_size
    layout.crossing_pieces(rank)  # a ValueError for a rank the layout does not have
    sent = [layout.crossing_pieces(r) for r in range(p)]
    rows = max(sum(x.length for x, _ in s) for s in sent)
    by_doc = {}  # crossing document -> its pieces (start, length, slot in the gathered [P * rows] buffer)
    for o, s in enumerate(sent):
        at = o * rows
        for x, _ in s:
            by_doc.setdefault(x.doc, []).append((x.start, x.length, at))
            at += x.length
    for pieces in by_doc.values():
        pieces.sort()
    q_starts, q_lengths, k_starts, k_lengths, cu_q, cu_k = [], [], [], [], [0], [0]
    for x, off in sent[rank]:
        keys = [(x.doc_start, x.start)]  # the keys its queries see beyond its own: before it (causal) ...
        if not layout.causal:
            keys.append((x.start + x.length, x.doc_end))  # ... and after it
        runs = [run for a, b in keys if a < b for run in _slot_runs(by_doc[x.doc], a, b)]
        if not runs:
            continue
        q_starts.append(off)
        q_lengths.append(x.length)
        cu_q.append(cu_q[-1] + x.length)
        for slot, count in runs:
            k_starts.append(slot)
            k_lengths.append(count)
        cu_k.append(cu_k[-1] + sum(count for _, count in runs))
    mine = layout.pieces_of(rank)
    local_cu = tuple(itertools.accumulate(map(operator.itemgetter(2), mine), initial=0))
    send = ranges_to_positions([off for _, off in sent[rank]], [x.length for x, _ in sent[rank]])
    return RankPlan(local_cu, send, rows if p > 1 else 0, ranges_to_positions(q_starts, q_lengths),
                    ranges_to_positions(k_starts, k_lengths), tuple(cu_q), tuple(cu_k))


def _batched_call(cu_q, cu_k, b: int, tq: int, tk: int, causal: bool, scale: float, device) -> VarlenCall:
    """The :class:`VarlenCall` of rectangles ``cu_q`` x ``cu_k`` repeated in each of ``b`` batch rows."""
    q_all = [s + i * tq for i in range(b) for s in cu_q[:-1]] + [b * tq]
    k_all = [s + i * tk for i in range(b) for s in cu_k[:-1]] + [b * tk]
    (tq_t, tk_t), _ = host_values_on([q_all, k_all], torch.int32, device)
    longest_q = max(y - x for x, y in zip(cu_q, cu_q[1:]))
    longest_k = max(y - x for x, y in zip(cu_k, cu_k[1:]))
    return VarlenCall(tq_t, tk_t, longest_q, longest_k, causal, scale)


def _flat(x):
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


@dataclass(frozen=True)
class DocumentCall:
    """One call's kernel spec, layout, group and kernels (``varlen``: the backend's varlen entry point
    or None; ``small``: torch's varlen kernel for batched calls too small otherwise, or None), on
    ``rank`` of the group (``plan``: its :class:`RankPlan`); ``transport``: how the crossing rows
    move, ``"all_gather"`` (one collective each way) or ``"ring"`` (send/recv hops round the ring)."""

    spec: AttentionSpec
    layout: DocumentLayout
    plan: RankPlan
    group: object
    stats: CommStats
    varlen: VarlenKernel | None
    small: VarlenKernel | None
    rank: int
    transport: str = "all_gather"

    def local_forward(self, q, k, v):
        """``(out, lse)`` of every local piece against itself."""
        return block_documents_forward(self.spec, self.varlen, self.small, q, k, v, list(self.plan.local_cu),
                                       self.spec.causal)

    def local_backward(self, tensors):
        return block_documents_backward(self.spec, self.varlen, self.small, tensors, list(self.plan.local_cu),
                                        self.spec.causal)

    def rectangles_kernel(self, q, cu_q, cu_k) -> VarlenKernel | None:
        """The varlen kernel of the rectangles ``cu_q`` x ``cu_k`` of ``q``'s heads: the backend's
        entry point where it has one; else torch's (``small``, with ``auto``) where they are on
        average too small for a call each (:func:`dilated.packed.small_rectangles`); else None, a
        dense call per rectangle."""
        if self.varlen is not None or self.small is None:
            return self.varlen
        return self.small if small_rectangles(cu_q, cu_k, q.shape[2], q.shape[3]) else None

    def crossing_forward(self, q, k, v, cu_q, cu_k):
        """``(out, lse [B, H, T])`` of the rectangles ``cu_q`` x ``cu_k`` (cumulative query and key
        counts; every key of a rectangle visible)."""
        spec = self.spec
        b, tq, h = q.shape[:3]
        kernel = self.rectangles_kernel(q, cu_q, cu_k)
        if kernel is not None:
            call = _batched_call(cu_q, cu_k, b, tq, k.shape[1], False, spec.scale, q.device)
            out, lse = kernel.forward(_flat(q), _flat(k), _flat(v), call)
            return out.view(b, tq, h, out.shape[-1]), lse.view(h, b, tq).transpose(0, 1)
        outs, lses = [], []
        for (qa, qb), (ka, kb) in zip(zip(cu_q, cu_q[1:]), zip(cu_k, cu_k[1:])):
            o, lse = attention_forward(spec.backend, q[:, qa:qb], k[:, ka:kb], v[:, ka:kb], False, spec.scale)
            outs.append(o)
            lses.append(lse)
        return torch.cat(outs, 1), torch.cat(lses, 2)

    def crossing_backward(self, dout, q, k, v, out, lse, cu_q, cu_k):
        """``(dq, dk, dv)`` of the rectangles of :meth:`crossing_forward`."""
        spec = self.spec
        kernel = self.rectangles_kernel(q, cu_q, cu_k)
        if kernel is not None:
            b, tq, h = q.shape[:3]
            call = _batched_call(cu_q, cu_k, b, tq, k.shape[1], False, spec.scale, q.device)
            lse_rows = lse.transpose(0, 1).reshape(h, b * tq)
            grads = kernel.backward(_flat(dout), _flat(q), _flat(k), _flat(v), _flat(out), lse_rows, call)
            return tuple(g.view(x.shape) for g, x in zip(grads, (q, k, v)))
        parts = []
        for (qa, qb), (ka, kb) in zip(zip(cu_q, cu_q[1:]), zip(cu_k, cu_k[1:])):
            parts.append(attention_backward(spec.backend, dout[:, qa:qb], q[:, qa:qb], k[:, ka:kb], v[:, ka:kb],
                                            out[:, qa:qb], lse[:, :, qa:qb].contiguous(), False, spec.scale))
        return tuple(torch.cat([g[i] for g in parts], 1) for i in range(3))


@dataclass(frozen=True)
class DocumentParts:
    """The validated parts of a call on a :class:`~dilated.DocumentLayout` (shared by every module
    that takes one): the kernel spec, the layout and the kernels of :class:`DocumentCall`."""

    spec: AttentionSpec
    layout: DocumentLayout
    varlen: VarlenKernel | None
    small: VarlenKernel | None

    @classmethod
    def resolve(cls, q, k, v, *, causal: bool, scale, backend: str, world_size: int, cu_seqlens=None,
                layout=None) -> "DocumentParts":
        """Check the shards ``[B, N/P, H, D]`` against ``cu_seqlens`` (global cumulative lengths;
        None: one document) or ``layout`` over ``world_size`` ranks, and pick the kernels; a
        ValueError or TypeError naming the argument where they disagree."""
        check_qkv(q, k, v)
        if k.shape[1] != q.shape[1]:
            raise ValueError(f"q and k/v shards must have one length, got {q.shape[1]} and {k.shape[1]}")
        p = world_size
        if layout is None:
            layout = balanced_layout([0, q.shape[1] * p] if cu_seqlens is None else cu_seqlens, p, causal, backend,
                                     q.device, q.dtype)
        elif not isinstance(layout, DocumentLayout):
            raise TypeError(f"layout must be a DocumentLayout (DocumentLayout.balance), got {type(layout).__name__}")
        elif cu_seqlens is not None:
            raise ValueError("pass cu_seqlens or layout, not both (a layout holds its documents)")
        if layout.world_size != p or layout.causal != causal:
            raise ValueError(f"layout: balanced for {layout.world_size} ranks, causal={layout.causal}; this module runs "
                             f"on {p} ranks, causal={causal}: build it with module.document_layout(cu_seqlens)")
        if layout.seq_len != q.shape[1] * p:
            raise ValueError(f"cu_seqlens: the documents total {layout.seq_len} positions, but {p} shards of "
                             f"{q.shape[1]} hold {q.shape[1] * p}: cu_seqlens must end at the global length N")
        return cls.on(q, k, v, causal=causal, scale=scale, backend=backend, layout=layout)

    @classmethod
    def on(cls, q, k, v, *, causal: bool, scale, backend: str, layout: DocumentLayout) -> "DocumentParts":
        """The parts of a call on ``layout`` whose shards ``q``, ``k``, ``v`` hold this rank's pieces (a
        layout derived inside a module, of shards of any length: unchecked), and their kernels."""
        scale = default_scale(q.shape[-1], scale)
        varlen = varlen_kernel(q, k, v, backend, causal)
        # the dense kernel runs only without a varlen entry point (every call is then a varlen one)
        impl = get_backend(backend, q, k, causal, v=v) if varlen is None else None
        small = small_documents_kernel(q, k, v, causal) if varlen is None and backend == "auto" else None
        return cls(AttentionSpec(impl, causal, scale), layout, varlen, small)

    def signature(self, q, k, v, **more) -> dict:
        """The fields every rank must agree on (:func:`dilated.parallel.agreement.signature`)."""
        return signature(q, k, v, causal=self.spec.causal, scale=self.spec.scale, documents=self.layout.cu_seqlens,
                         **more)

    def call(self, rank: int, group, stats: CommStats, transport: str = "all_gather") -> DocumentCall:
        """The :class:`DocumentCall` of ``rank``; ``transport``: how crossing rows move
        (``"all_gather"``: one collective each way; ``"ring"``: relayed round the ring by send/recv)."""
        return DocumentCall(self.spec, self.layout, rank_plan(self.layout, rank), group, stats, self.varlen,
                            self.small, rank, transport)


def crossing_rows(k, v, send, rows: int):
    """This rank's K/V rows ``send`` of crossing documents as one buffer ``[B, rows, Hkv, Dk + Dv]``
    (zero-padded to the ``rows`` every rank sends)."""
    mine = k.new_zeros(k.shape[0], rows, k.shape[2], k.shape[3] + v.shape[3])
    mine[:, :send.numel()] = torch.cat([k.index_select(1, send), v.index_select(1, send)], -1)
    return mine


def split_kv(rows, dk: int):
    """``(k, v)`` of a buffer of :func:`crossing_rows` (keys: the first ``dk`` channels)."""
    return rows[..., :dk], rows[..., dk:]


def add_crossing_grads(dk, dv, got, send):
    """Add the gradient rows ``got`` (``[B, rows, Hkv, Dk + Dv]`` float32, this rank's crossing rows
    first) to ``dk``/``dv`` at the local rows ``send`` (in float32, rounded once)."""
    if send.numel():
        got = got[:, :send.numel()]
        add_rows_(dk, send, got[..., :dk.shape[3]])
        add_rows_(dv, send, got[..., dk.shape[3]:])


class _Collective:
    """An asynchronous collective's result; :meth:`wait` makes the current stream wait for it
    (counted as exposed communication) and returns it."""

    def __init__(self, work, result: torch.Tensor, stats: CommStats):
        self.work, self.result, self.stats = work, result, stats

    def wait(self) -> torch.Tensor:
        with self.stats.waiting(self.result.device):
            self.work.wait()
        return self.result


def _gather_kv(call: DocumentCall, k, v, send):
    """Start gathering every rank's crossing K/V rows (one all-gather, or relayed round the ring):
    its ``wait()`` gives ``[P, B, rows, Hkv, Dk + Dv]``."""
    p = call.layout.world_size
    mine = crossing_rows(k, v, send, call.plan.rows)
    if call.transport == "ring":
        return RingExchange(call.group, call.stats).all_gather(mine)
    gathered = k.new_empty(p * k.shape[0], *mine.shape[1:])  # rank-major, as every backend takes it
    work = all_gather_into(gathered, mine, group=call.group, async_op=True)
    call.stats.sent(mine.numel() * mine.element_size(), collective=True)
    return _Collective(work, gathered.view(p, *mine.shape), call.stats)


def _reduce_grads(call: DocumentCall, blocks):
    """Start summing every rank's gradient rows ``blocks [P, B, rows, ...]`` of each rank's crossing
    rows onto their owner (one reduce-scatter, or relayed round the ring): its ``wait()`` gives this
    rank's ``[B, rows, ...]``."""
    if call.transport == "ring":
        return RingExchange(call.group, call.stats).reduce_scatter(blocks)
    p, b = blocks.shape[:2]
    mine = torch.empty(blocks.shape[1:], dtype=blocks.dtype, device=blocks.device)
    work = reduce_scatter_from(mine, blocks.view(p * b, *blocks.shape[2:]), group=call.group, async_op=True)
    call.stats.sent(blocks.numel() * blocks.element_size() * (p - 1) // p, collective=True)
    return _Collective(work, mine, call.stats)


def _crossing_kv(gathered, k_slots, dk: int):
    """The rectangles' keys and values from the gathered buffer, ``[B, T, Hkv, D]`` each."""
    p, b, rows = gathered.shape[:3]
    flat = gathered.transpose(0, 1).reshape(b, p * rows, *gathered.shape[3:])
    return split_kv(flat.index_select(1, k_slots), dk)


class _DocumentFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, call: DocumentCall):
        plan = call.plan
        send, q_rows, k_slots = plan.on(q.device)
        pending = _gather_kv(call, k, v, send) if plan.rows else None
        failure = None
        try:
            out, lse = call.local_forward(q, k, v)
        except Exception as e:  # noqa: BLE001 - raised once this rank has joined the all-gather
            failure, out, lse = e, None, None
        gathered = pending.wait() if pending is not None else None
        if failure is not None:
            raise failure
        if q_rows.numel():
            kr, vr = _crossing_kv(gathered, k_slots, k.shape[3])
            o_r, lse_r = call.crossing_forward(q.index_select(1, q_rows), kr, vr, plan.cu_q, plan.cu_k)
            merge_rows_(out, lse, q_rows, o_r, lse_r)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, *(() if gathered is None else (gathered,)))
        ctx.call = call
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *rest = ctx.saved_tensors
        call, plan = ctx.call, ctx.call.plan
        send, q_rows, k_slots = plan.on(q.device)
        dout = dout.contiguous()
        acc = acc_dtype(q.dtype)
        pending, d_rows, failure = None, None, None
        if plan.rows:
            p, b = call.layout.world_size, q.shape[0]
            dk_all = k.shape[3]
            d_full = torch.zeros(b, p * plan.rows, k.shape[2], dk_all + v.shape[3], dtype=acc, device=q.device)
            if q_rows.numel():
                try:
                    kr, vr = _crossing_kv(rest[0], k_slots, dk_all)
                    d_rows = call.crossing_backward(*(x.index_select(1, q_rows) for x in (dout, q)), kr, vr,
                                                    out.index_select(1, q_rows), lse.index_select(2, q_rows),
                                                    plan.cu_q, plan.cu_k)
                    add_to_slots_(d_full[..., :dk_all], k_slots, d_rows[1])
                    add_to_slots_(d_full[..., dk_all:], k_slots, d_rows[2])
                except Exception as e:  # noqa: BLE001 - raised once this rank has joined the reduce-scatter
                    failure = e
            pending = _reduce_grads(call, d_full.view(b, p, plan.rows, *d_full.shape[2:]).transpose(0, 1).contiguous())
        if failure is None:
            try:
                dq, dk, dv = call.local_backward((dout, q, k, v, out, lse))
            except Exception as e:  # noqa: BLE001 - as above
                failure = e
        got = pending.wait() if pending is not None else None
        if failure is not None:
            raise failure
        if d_rows is not None:
            add_rows_(dq, q_rows, d_rows[0])
        if got is not None:
            add_crossing_grads(dk, dv, got, send)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def document_attention(q, k, v, call: DocumentCall):
    """Exact attention within documents on this rank's shards of ``call.layout`` (differentiable):
    the local pieces while the crossing documents' K/V rows move (``call.transport``), then those."""
    return _DocumentFunction.apply(q, k, v, call)


class DocumentParallelAttention(nn.Module):
    """Exact attention within packed documents over a sequence sharded by a
    :class:`~dilated.DocumentLayout`; ``forward(q, k, v, cu_seqlens)`` on this rank's shards
    ``[B, N/P, H, D]`` (the positions ``layout.positions(rank)``, see :meth:`shard`). GQA allowed.

    Args:
        causal: causal attention within each document.
        scale: softmax scale (default ``head_dim ** -0.5``).
        backend: the local kernel (``"auto"``, ``"sdpa"``, ``"flash_attn_4"``, ...).
        group: the process group (default: the world).
        measure_comm: record the time the compute stream waits on communication in ``self.stats``.

    The layout of a batch's documents is :meth:`document_layout` (computed on the host, cached per
    ``cu_seqlens``); shard inputs with :meth:`shard` and gather results with :meth:`unshard`.
    """

    def __init__(self, *, causal: bool = False, scale: float | None = None, backend: str = "auto", group=None,
                 measure_comm: bool = False):
        super().__init__()
        check_causal(causal)
        check_scale(scale)
        self.causal, self.scale, self.backend, self.group = causal, scale, backend, group
        self.stats = CommStats(measure_comm)
        self._agreed = AgreedSignatures()
        self.last_layout = None

    def document_layout(self, cu_seqlens) -> DocumentLayout:
        """The :class:`~dilated.DocumentLayout` of the documents ``cu_seqlens`` (cumulative lengths
        ``[0, ..., N]`` of the global sequence) over this module's group."""
        return balanced_layout(cu_seqlens, dist.get_world_size(self.group), self.causal, self.backend,
                               group_device(self.group))

    def _validate(self, q, k, v, cu_seqlens, layout):
        parts = DocumentParts.resolve(q, k, v, causal=self.causal, scale=self.scale, backend=self.backend,
                                      world_size=dist.get_world_size(self.group), cu_seqlens=cu_seqlens,
                                      layout=layout)
        return parts, parts.signature(q, k, v)

    def forward(self, q, k, v, cu_seqlens: torch.Tensor | None = None, layout: DocumentLayout | None = None):
        """``cu_seqlens``: the documents of the *global* sequence (int32 cumulative lengths ``[0, ...,
        N]``, the same on every rank; a CPU tensor or a list avoids a device sync; None: one
        document), or ``layout``, a :class:`~dilated.DocumentLayout` of them. The shards must be in
        that layout's order (:meth:`shard`)."""
        if not dist.is_initialized():
            raise RuntimeError("DocumentParallelAttention needs torch.distributed initialised "
                               "(see dilated.init_distributed)")
        parts = validate_on_all_ranks(self.group, self._agreed, "DocumentParallelAttention",
                                      lambda: self._validate(q, k, v, cu_seqlens, layout))
        self.last_layout = parts.layout
        call = parts.call(dist.get_rank(self.group), self.group, self.stats)
        return document_attention(dense_rows(q), k.contiguous(), v.contiguous(), call)

    def shard(self, x: torch.Tensor, layout: DocumentLayout | None = None) -> torch.Tensor:
        """This rank's part ``[B, N/P, ...]`` of a global ``[B, N, ...]`` tensor in ``layout`` (default:
        the last call's)."""
        from .sharding import shard

        return shard(x, group=self.group, layout=given_or_last(layout, self.last_layout))

    def unshard(self, x_local: torch.Tensor, layout: DocumentLayout | None = None) -> torch.Tensor:
        """The global tensor in sequence order from every rank's part (an all-gather)."""
        from .sharding import unshard

        return unshard(x_local, group=self.group, layout=given_or_last(layout, self.last_layout))
