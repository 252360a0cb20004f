"""``dilated.attention``: exact softmax attention on any registered backend, with its log-sum-exp;
packed documents through :mod:`dilated.packed`, the dense pieces in :mod:`dilated.dense`."""
from __future__ import annotations

import torch

from ._checks import check_causal, check_qkv, dense_rows
from .backends import get_backend
from .backends.varlen import varlen_kernel
from .dense import AttentionFunction, attention_forward, default_scale
from .packed import check_cu_seqlens, packed_attention, varlen_attention


def attention(q, k, v, *, causal: bool = False, scale: float | None = None, backend: str = "auto",
              return_lse: bool = False, cu_seqlens: torch.Tensor | None = None):
    """Exact softmax attention on ``[batch, seq, heads, head_dim]`` tensors.

    k/v may have fewer heads than q (GQA: heads divisible by kv heads) and another length than q
    (causal is then bottom-right aligned); v may have another head_dim than q and k where the
    backend takes it (``manual``, ``sdpa_math``; the output then has v's). Any strides are accepted. Returns ``out`` (q's dtype), or
    ``(out, lse)`` with lse ``[batch, heads, seq_q]`` in float32 (float64 for float64 inputs).
    Gradients flow through ``out`` and ``lse``. Under ``torch.compile`` the call is one custom op
    (:mod:`dilated.ops`).

    ``cu_seqlens``: packed documents (int32 cumulative lengths ``[0, ..., N]``, the same for every
    batch row; q and k/v of one length): attention stays within each document, causal applies
    within each (see :mod:`dilated.packed`). Its values are read on the host: pass a CPU tensor,
    since reading a CUDA one waits for the GPU to finish the work queued before the call.
    """
    check_qkv(q, k, v)
    check_causal(causal)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be True or False, got {type(return_lse).__name__} {return_lse!r}")
    scale = default_scale(q.shape[-1], scale)
    if cu_seqlens is not None:
        if k.shape[1] != q.shape[1]:
            raise ValueError(f"cu_seqlens packs q and k/v alike: they need one length, got {q.shape[1]} and "
                             f"{k.shape[1]}")
        kernel = varlen_kernel(q, k, v, backend, causal)
        if kernel is not None:  # the kernel's own varlen entry point
            q, k, v = dense_rows(q), dense_rows(k), dense_rows(v)
            out, lse = varlen_attention(q, k, v, check_cu_seqlens(cu_seqlens, q.shape[1]), causal, scale, kernel)
        else:
            out, lse = packed_attention(q, k, v, check_cu_seqlens(cu_seqlens, q.shape[1]), backend, causal, scale)
        return (out, lse) if return_lse else out
    if torch.compiler.is_compiling():  # one custom op (dilated.ops): dynamo traces no backend code
        out, lse = torch.ops.dilated.attention_forward(q, k, v, causal, scale, backend, return_lse)
        return (out, lse) if return_lse else out
    impl = get_backend(backend, q, k, causal, v=v)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        out, lse = AttentionFunction.apply(q, k, v, impl, causal, scale)
    else:
        out, lse = attention_forward(impl, q, k, v, causal, scale, need_lse=return_lse)
    return (out, lse) if return_lse else out
