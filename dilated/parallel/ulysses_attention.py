"""Ulysses attention (DeepSpeed-Ulysses): exact dense attention over a sequence sharded across
ranks by trading the sequence split for a head split.

Each rank holds a contiguous shard ``[B, N/P, H, D]``. All-to-alls give every rank the whole
sequence for ``H/P`` heads, one local attention runs over it (any backend; causal is plain causal
over the whole sequence, so no load balancing is needed; where the kernel's causal rate drops on
long blocks, as cuDNN's does past 64K rows, :func:`dilated.attention` runs it as query chunks), and
all-to-alls bring the output back to sequence shards. The ``H/P`` heads attend in ``head_groups``
groups, each group's exchanges overlapping the other groups' attention
(:mod:`dilated.parallel.head_groups`). Backward is the same steps reversed. Per rank and call it
moves ``(P-1)/P`` of its q, k, v and out shards, independent of the number of ranks' positions:
what it pays for needing ``H`` divisible by ``P``. Packed documents (``cu_seqlens`` of the global
sequence) cost nothing extra: the local attention sees the whole sequence and its documents.

GQA: kv heads are split like q heads when ``H_kv`` is divisible by ``P``; else each kv head is
repeated to the smallest count that ``P`` divides and that divides ``H`` (so every q head still
reads its own kv head), which costs kv traffic but no extra attention work.

Packed documents that lie whole within one rank's shard need no exchange: with ``local_documents``
(default ``"auto"``: all but the longest few where those would leave the ranks' work uneven) a
rank attends them where they lie, on all its heads, in two parts: beside the exchange of the other
documents' inputs, and beside that of their output (:mod:`dilated.parallel.local_documents`).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from .._checks import check_causal, check_qkv, check_scale
from .agreement import AgreedSignatures, signature, validate_on_all_ranks
from .document_groups import attend_by_document_groups, check_document_groups, check_groups_of_one_kind, groups_to_use
from .head_groups import attend_by_head_groups, check_head_groups, head_groups_for
from .local_documents import check_local_documents, contiguous_ranges, local_documents
from .sharding import CommStats, rank_and_size
from ..functional import attention
from ..dense import default_scale
from ..packed import check_cu_seqlens
from ..backends import get_backend
from ..backends.varlen import varlen_kernel


def kv_heads_for(num_heads: int, num_kv_heads: int, p: int) -> int:
    """How many kv heads Ulysses spreads over ``p`` ranks: ``num_kv_heads`` if ``p`` divides it,
    else the smallest multiple of it that ``p`` divides and that divides ``num_heads``."""
    if num_kv_heads % p == 0:
        return num_kv_heads
    m = math.lcm(num_kv_heads, p)
    if num_heads % m:
        raise ValueError(f"UlyssesAttention on {p} ranks: {num_kv_heads} kv heads cannot be spread over the ranks "
                         f"with {num_heads} q heads ({num_heads} must be divisible by lcm(kv heads, ranks) = {m}); "
                         "use a world size that divides the number of heads, or RingAttention")
    return m


class UlyssesAttention(nn.Module):
    """Exact dense attention over the global sequence; ``forward(q, k, v, cu_seqlens=None)`` on this
    rank's contiguous shards ``[B, N/P, H, D]`` (see :meth:`shard`) returns this rank's output
    ``[B, N/P, H, D]``, differentiable; heads must be divisible by P (kv heads are split over the
    ranks, repeated up to a multiple of P where P does not divide them: :func:`kv_heads_for`).

    Args:
        causal: causal attention over the global sequence (within each document with packed ones).
        scale: softmax scale (default ``head_dim ** -0.5``).
        backend: the local kernel (``"auto"``, ``"sdpa"``, ``"flash_attn_4"``, ...).
        group: the process group (default: the world).
        measure_comm: also time the compute stream's waits on the all-to-alls.
        head_groups: this rank's ``H/P`` heads attend in this many groups, each group's all-to-alls
            overlapping the others' attention (:mod:`dilated.parallel.head_groups`); ``1``: one
            exchange per tensor, nothing overlapped; ``"auto"``: two where packed documents run in one
            varlen kernel call per group, else one (:func:`~dilated.parallel.head_groups.head_groups_for`).
        document_groups: with packed documents, ``"always"`` pipelines the all-to-alls with attention
            by groups of documents instead (:mod:`dilated.parallel.document_groups`: the longest
            documents first, the next longest last, the rest between, each group on all of this rank's
            heads); ``"auto"`` (default): only where the groups make about the kernel calls of one
            exchange (not on one varlen call, nor on documents of one length:
            :func:`~dilated.parallel.document_groups.groups_to_use`) and ``head_groups`` is not a
            number above 1; ``1``: not. ``"always"`` is not combined with ``head_groups`` above 1.
        local_documents: with packed documents, those that lie whole within one rank's shard attend
            there on all its heads, without an exchange; the others go through one exchange (no head
            or document groups), beside that attention. ``"auto"`` (default): the longest of the
            slowest rank's documents are exchanged too, one at a time, while its work is more than
            :data:`~dilated.parallel.local_documents.LOCAL_IMBALANCE` over the mean (on documents of
            one length whose boundaries meet the shards': none, nothing moves); ``"always"``: every
            document whole within a rank stays; ``False``: every document exchanged.

    ``self.stats`` (a :class:`dilated.parallel.sharding.CommStats`) counts the all-to-alls and bytes sent.
    """

    def __init__(self, *, causal=False, scale=None, backend="auto", group=None, measure_comm: bool = False,
                 head_groups: int | str = "auto", document_groups: int | str = "auto",
                 local_documents: bool | str = "auto"):
        super().__init__()
        check_causal(causal)
        check_scale(scale)
        check_head_groups(head_groups)
        check_document_groups(document_groups)
        check_local_documents(local_documents)
        check_groups_of_one_kind(document_groups, head_groups)
        self.causal, self.scale, self.backend, self.group = causal, scale, backend, group
        self.head_groups, self.document_groups, self.local_documents = head_groups, document_groups, local_documents
        self._agreed = AgreedSignatures()  # input signatures all ranks agreed on
        self.stats = CommStats(measure_comm)

    def _validate(self, q, k, v, cu_seqlens):
        check_qkv(q, k, v)
        _, p = rank_and_size(self.group)
        docs = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, q.shape[1] * p)
        if k.shape[1] != q.shape[1]:
            raise ValueError(f"q and k/v shards must have one length, got {q.shape[1]} and {k.shape[1]}")
        if q.shape[2] % p:
            raise ValueError(f"UlyssesAttention splits heads over the {p} ranks: num_heads {q.shape[2]} must be "
                             f"divisible by {p}; use a world size that divides the heads, or RingAttention")
        hkv = kv_heads_for(q.shape[2], k.shape[2], p)
        scale = default_scale(q.shape[-1], self.scale)
        qh, kh, vh = q[:, :, :q.shape[2] // p], k[:, :, :hkv // p], v[:, :, :hkv // p]
        get_backend(self.backend, qh, kh, self.causal, v=vh)
        local = None if docs is None else local_documents(self.local_documents, docs,
                                                          contiguous_ranges(docs[-1], p), self.causal)
        one_call = docs is not None and varlen_kernel(qh, kh, vh, self.backend, self.causal) is not None
        by_docs = None if docs is None or local or self.head_groups not in ("auto", 1) else groups_to_use(
            self.document_groups, docs, qh.shape[2], q.shape[3], self.causal, one_call)
        groups = 1 if by_docs or local else head_groups_for(self.head_groups, q.shape[2] // p, hkv // p, one_call)
        return (hkv, groups, scale, docs, by_docs, local), signature(
            q, k, v, causal=self.causal, scale=scale, algorithm="ulysses", documents=docs, head_groups=groups,
            document_groups=len(by_docs) if by_docs else 1, local_documents=local is not None)

    def forward(self, q, k, v, cu_seqlens: torch.Tensor | None = None):
        """``cu_seqlens``: packed documents of the *global* sequence (int32 cumulative lengths
        ``[0, ..., N]``, the same on every rank); attention stays within each document."""
        if not dist.is_initialized():
            raise RuntimeError("UlyssesAttention needs torch.distributed initialised (see dilated.init_distributed)")
        hkv, groups, scale, docs, by_docs, local = validate_on_all_ranks(
            self.group, self._agreed, "UlyssesAttention", lambda: self._validate(q, k, v, cu_seqlens))

        def attend_documents(qg, kg, vg, cu):
            cu_t = torch.tensor(cu, dtype=torch.int32)
            return attention(qg, kg, vg, causal=self.causal, scale=scale, backend=self.backend, cu_seqlens=cu_t)

        mine = ()
        if local:
            rank = rank_and_size(self.group)[0]
            if not local.exchanged:  # every document where it lies: nothing to exchange
                return attend_documents(q, k, v, local.local_cu(rank))
            mine = local.parts(rank, q.device)
        if hkv != k.shape[2]:
            k, v = (x.repeat_interleave(hkv // k.shape[2], dim=2) for x in (k, v))
        if local or by_docs:
            return attend_by_document_groups(q, k, v, attend_documents, cu=docs,
                                             groups=[list(local.exchanged)] if local else by_docs, group=self.group,
                                             stats=self.stats, local=mine)

        def attend(qh, kh, vh):
            return attention(qh, kh, vh, causal=self.causal, scale=scale, backend=self.backend, cu_seqlens=cu_seqlens)

        return attend_by_head_groups(q, k, v, attend, groups=groups, group=self.group, stats=self.stats)

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's part ``[B, N/P, ...]`` of a global ``[B, N, ...]`` tensor (contiguous)."""
        from .sharding import shard

        return shard(x, group=self.group, layout="contiguous")

    def unshard(self, x_local: torch.Tensor) -> torch.Tensor:
        """The global tensor from every rank's part (an all-gather)."""
        from .sharding import unshard

        return unshard(x_local, group=self.group, layout="contiguous")
