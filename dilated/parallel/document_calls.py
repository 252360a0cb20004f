"""The packed documents of one block on a local kernel, forward and backward: in one call of the
kernel's varlen entry point where it has one, else in batched dense calls per document length
(those too small to keep the GPU busy in one call of torch's varlen kernel, where given). Shared by
the sequence-parallel modules that take packed documents (:mod:`dilated.parallel.ring_attention`,
:mod:`dilated.parallel.document_attention`)."""
from __future__ import annotations

from ..backends.varlen import VarlenKernel
from ..dense import AttentionSpec, attention_backward, attention_forward
from ..packed import documents_backward, documents_forward, halves_for, varlen_backward, varlen_forward


def block_documents_forward(spec: AttentionSpec, varlen: VarlenKernel | None, small: VarlenKernel | None,
                            q, k, v, cu: list[int], causal: bool):
    """``(out, lse)`` of the documents ``cu`` (cumulative lengths within the block; q and kv rows
    coincide) of ``q, k, v``; no autograd."""
    if varlen is not None:
        return varlen_forward(varlen, q, k, v, cu, causal, spec.scale)

    def attend(qd, kd, vd):
        return attention_forward(spec.backend, qd, kd, vd, causal, spec.scale)
    return documents_forward(q, k, v, cu, attend, causal, small and (small, spec.scale),
                             halves_for(spec.backend, q, k, v, causal, spec.scale))


def block_documents_backward(spec: AttentionSpec, varlen: VarlenKernel | None, small: VarlenKernel | None,
                             tensors, cu: list[int], causal: bool):
    """``(dq, dk, dv)`` of :func:`block_documents_forward` given ``tensors = (dout, q, k, v, out, lse)``
    (the merged out and lse)."""
    if varlen is not None:
        return varlen_backward(varlen, tensors, cu, causal, spec.scale)

    def grads(*ts):
        return attention_backward(spec.backend, *ts, causal, spec.scale)
    return documents_backward(tensors, cu, grads, causal, small=small and (small, spec.scale),
                              halves=halves_for(spec.backend, *tensors[1:4], causal, spec.scale))
