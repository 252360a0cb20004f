"""The sequence-parallel strategies the harness benchmarks, by name: ring attention variants
(layout, transport, overlap), Ulysses, the Ulysses x ring hybrid and LongNet's distributed dilated
attention; and the single-device implementation each is compared with. Other people's rings are in
:mod:`dilated.bench.external_ring`."""
from __future__ import annotations

import torch.distributed as dist

import dilated

from .distributed import DistributedImplementation
from .registry import register_implementation
from .workload import ulysses_size_for


def _ring(case, backend, layout, overlap, group, transport="auto"):
    return dilated.RingAttention(causal=case.causal, backend=backend, layout=layout, group=group, overlap=overlap,
                                 transport=transport)


def _distributed_dilated(case, backend, group):
    return dilated.DistributedDilatedAttention(case.segment_lengths, case.dilation_rates, causal=case.causal,
                                               backend=backend, group=group)


def _make(name, problem, layout, factory, description, documents=True, splits_heads=False, local=False):
    return DistributedImplementation(name, problem, None, description, layout=layout, factory=factory,
                                     takes_documents=documents, splits_heads=splits_heads, local_documents=local)


#: Ulysses' benchmark names and the head groups each runs (:mod:`dilated.parallel.head_groups`)
ULYSSES_HEAD_GROUPS = {"ulysses": "auto", "ulysses_exchange_all": "auto", "ulysses_no_overlap": 1,
                       "ulysses_head_groups_2": 2, "ulysses_head_groups_4": 4, "ulysses_head_groups_8": 8}
#: the hybrid's benchmark names and the head groups each runs
HYBRID_HEAD_GROUPS = {"hybrid": "auto", "hybrid_no_overlap": 1, "hybrid_head_groups_2": 2, "hybrid_head_groups_4": 4,
                      "hybrid_documents": "auto", "hybrid_documents_one_exchange": "auto",
                      "hybrid_documents_exchange_all": "auto",
                      "hybrid_documents_no_overlap": 1, "hybrid_documents_head_groups_2": 2,
                      "hybrid_documents_head_groups_4": 4}
#: the hybrid's names that exchange a row by documents (``document_groups="always"``) and the
#: ``local_documents`` each runs (:mod:`dilated.parallel.row_documents`)
ROW_GROUPS = {"hybrid_documents_row_groups": False, "hybrid_documents_row_groups_local": "auto"}
#: the Ulysses and hybrid names that keep documents where they lie, as the modules' defaults do:
#: ``local_documents="auto"`` (packed documents whole within a rank attended there:
#: :mod:`dilated.parallel.local_documents`); the other names measure their exchanges' schedule on
#: every document (``local_documents=False``)
LOCAL_DOCUMENTS = {"ulysses", "hybrid_documents", "hybrid_documents_one_exchange"}
#: the names that run the modules' default ``document_groups="auto"``; the other Ulysses and hybrid
#: names exchange at once (``document_groups=1``) or, :data:`ROW_GROUPS`, by documents
DOCUMENT_GROUPS_AUTO = {"ulysses", "hybrid_documents"}


def local_documents_of(name: str):
    """The ``local_documents`` setting the benchmark's Ulysses or hybrid ``name`` runs."""
    return "auto" if name in LOCAL_DOCUMENTS else False


def document_groups_of(name: str):
    """The ``document_groups`` setting the benchmark's Ulysses or hybrid ``name`` runs."""
    return "always" if name in ROW_GROUPS else "auto" if name in DOCUMENT_GROUPS_AUTO else 1


def _ulysses(case, backend, group, head_groups="auto", local="auto", document_groups="auto"):
    return dilated.UlyssesAttention(causal=case.causal, backend=backend, group=group, head_groups=head_groups,
                                    local_documents=local, document_groups=document_groups)


def _hybrid(case, backend, group, layout="zigzag", head_groups="auto", local="auto", document_groups="auto"):
    p = dist.get_world_size(group)
    ulysses = ulysses_size_for(p, case.num_heads)
    if ulysses is None:
        raise NotImplementedError(f"a Ulysses x ring grid needs 2 or more ranks in both directions: {p} ranks with "
                                  f"{case.num_heads} heads have none (launch 4 or more ranks)")
    return dilated.HybridAttention(ulysses, p // ulysses, causal=case.causal, layout=layout, backend=backend,
                                   group=group, head_groups=head_groups, local_documents=local,
                                   document_groups=document_groups)


def _ulysses_impl(name, groups):
    what = {1: "nothing overlapped", "auto": "two pipelined groups where packed documents run in one varlen call "
            "each, else one"}.get(groups, "exchanges pipelined with attention")
    local, by_docs = local_documents_of(name), document_groups_of(name)
    return _make(name, "dense", "contiguous", lambda c, b, g: _ulysses(c, b, g, groups, local, by_docs),
                 f"UlyssesAttention (all-to-all: the whole sequence on H/P heads per rank), head_groups={groups!r}: "
                 f"{what}; local_documents={local!r}, document_groups={by_docs!r}", splits_heads=True, local=local)


def _hybrid_impl(name, groups):
    documents = name.startswith("hybrid_documents")
    ring = "a ring on the documents' DocumentLayout" if documents else "zigzag ring"
    local, by_docs = local_documents_of(name), document_groups_of(name)
    return _make(name, "dense", "hybrid_documents" if documents else "hybrid",
                 lambda c, b, g: _hybrid(c, b, g, layout="documents" if documents else "zigzag", head_groups=groups,
                                         local=local, document_groups=by_docs),
                 f"HybridAttention: Ulysses inside a row, {ring} across rows of the rank grid, head_groups={groups!r}, "
                 f"local_documents={local!r}, document_groups={by_docs!r}", local=local)


def _row_groups_impl(name, local):
    kept = "" if not local else (", each rank's documents within its part of the row attended where they lie "
                                 f"(local_documents={local!r})")
    return _make(name, "dense", "hybrid_documents",
                 lambda c, b, g: _hybrid(c, b, g, layout="documents", head_groups=1, local=local,
                                         document_groups="always"),
                 "HybridAttention on the documents' DocumentLayout, document_groups='always': a row exchanges its "
                 f"pieces of documents across rows first (then their ring), its other documents behind them{kept}",
                 local=local)


RING_IMPLEMENTATIONS = {
    "ring": _make("ring", "dense", "contiguous", lambda c, b, g: _ring(c, b, "contiguous", True, g),
                  "RingAttention, contiguous shards, communication overlapped"),
    "ring_zigzag": _make("ring_zigzag", "dense", "zigzag", lambda c, b, g: _ring(c, b, "zigzag", True, g),
                         "RingAttention, zigzag shards (balanced causal work), overlapped"),
    "ring_zigzag_p2p": _make("ring_zigzag_p2p", "dense", "zigzag",
                             lambda c, b, g: _ring(c, b, "zigzag", True, g, transport="p2p"),
                             "RingAttention, zigzag, overlapped, blocks passed by send/recv (not copy-engine pulls)"),
    "ring_no_overlap": _make("ring_no_overlap", "dense", "contiguous",
                             lambda c, b, g: _ring(c, b, "contiguous", False, g),
                             "RingAttention, contiguous, each K/V block received before it is computed"),
    "ring_zigzag_no_overlap": _make("ring_zigzag_no_overlap", "dense", "zigzag",
                                    lambda c, b, g: _ring(c, b, "zigzag", False, g),
                                    "RingAttention, zigzag, no overlap"),
    "distributed_dilated": _make("distributed_dilated", "dilated", "contiguous", _distributed_dilated,
                                 "DistributedDilatedAttention (LongNet sequence parallel)", documents=False),
    **{name: _ulysses_impl(name, groups) for name, groups in ULYSSES_HEAD_GROUPS.items()},
    "ulysses_document_groups": _make(
        "ulysses_document_groups", "dense", "contiguous",
        lambda c, b, g: dilated.UlyssesAttention(causal=c.causal, backend=b, group=g, document_groups="always",
                                                 local_documents=False),
        "UlyssesAttention, document_groups='always': on packed documents, the all-to-alls pipelined with attention by "
        "groups of documents (the longest first, the next longest last)", splits_heads=True),
    "documents": _make("documents", "dense", "documents",
                       lambda c, b, g: dilated.DocumentParallelAttention(causal=c.causal, backend=b, group=g),
                       "DocumentParallelAttention: documents balanced over the ranks (DocumentLayout), only "
                       "crossing documents' K/V all-gathered, overlapped with the local documents"),
    "ring_documents": _make("ring_documents", "dense", "documents", lambda c, b, g: _ring(c, b, "documents", True, g),
                            "RingAttention on the documents' DocumentLayout: only crossing documents' K/V rows "
                            "passed round the ring"),
    "ring_head_tail": _make("ring_head_tail", "dense", "documents_head_tail",
                            lambda c, b, g: _ring(c, b, "documents", True, g),
                            "RingAttention on DocumentLayout.head_tail: every document cut head-tail over the ranks "
                            "(TransformerEngine's THD layout), so every document's K/V rows go round the ring"),
    **{name: _hybrid_impl(name, groups) for name, groups in HYBRID_HEAD_GROUPS.items()},
    **{name: _row_groups_impl(name, local) for name, local in ROW_GROUPS.items()},
}
for _impl in RING_IMPLEMENTATIONS.values():
    register_implementation(_impl)

#: the single-device implementation each distributed one is compared with, by problem
BASELINE_OF = {"dense": "dense", "dilated": "improved"}
