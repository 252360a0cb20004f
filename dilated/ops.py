"""The kernel boundary as ``torch.library`` custom ops, so that ``torch.compile(fullgraph=True)``
traces :func:`dilated.attention`, :class:`~dilated.DilatedAttention`,
:class:`~dilated.ImprovedDilatedAttention` and :class:`~dilated.MultiheadDilatedAttention` without
graph breaks (as flash-attention registers its kernels).

* ``dilated::attention_forward`` / ``attention_backward`` (here): one exact attention (any
  backend, by name), its lse, and the gradients of both.
* ``dilated::dilated_forward`` / ``dilated_backward`` (:mod:`dilated.longnet.ops`): the whole fast
  dilated computation of :func:`~dilated.improved_dilated_attention` (plan, gathers, kernel calls,
  combine).
* ``dilated::residue_major_forward`` / ``residue_major_backward`` (registered in
  :mod:`dilated.longnet.residue_major`, beside what they run): the same in the residue-major layout.

Each has a fake implementation (shapes and dtypes only) and the forward ops have autograd
formulas that call the backward ops. The ops take what a graph can carry: tensors, numbers,
strings, lists of ints, and integer handles (:mod:`dilated.handles`) for a module's pattern cache
and memory pool. Eager calls go straight to the same functions, without the dispatcher.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ._checks import acc_dtype
from .backends import get_backend
from .dense import attention_backward, attention_forward

# -- one exact attention -------------------------------------------------------------------


@torch.library.custom_op("dilated::attention_forward", mutates_args=())
def attention_forward_op(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float,
                         backend: str, lse_grad: bool = True) -> tuple[Tensor, Tensor]:
    """``(out [B, Nq, H, Dv], lse [B, H, Nq])`` of :func:`dilated.attention` on ``backend``.
    ``lse_grad=False`` where the caller drops lse: its backward then takes no lse gradient (autograd
    hands it zeros, and telling zeros apart on the host would wait for the GPU)."""
    out, lse = attention_forward(get_backend(backend, q, k, causal, v=v), q, k, v, causal, scale)
    return out.contiguous(), lse.contiguous()


@attention_forward_op.register_fake
def _(q, k, v, causal, scale, backend, lse_grad=True):
    b, nq, h, _ = q.shape
    return q.new_empty(b, nq, h, v.shape[3]), q.new_empty(b, h, nq, dtype=acc_dtype(q.dtype))


@torch.library.custom_op("dilated::attention_backward", mutates_args=())
def attention_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                          dlse: Optional[Tensor], causal: bool, scale: float,
                          backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """``dq, dk, dv`` of the attention whose output and lse are ``out``, ``lse`` (``dlse``: lse's gradient)."""
    grads = attention_backward(get_backend(backend, q, k, causal, v=v), dout.contiguous(), q, k, v, out, lse,
                               causal, scale, dlse)
    return tuple(g.to(x.dtype).contiguous() for g, x in zip(grads, (q, k, v)))


@attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, dlse, causal, scale, backend):
    return tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))


def _attention_setup(ctx, inputs, output):
    q, k, v, ctx.causal, ctx.scale, ctx.backend, ctx.lse_grad = inputs
    ctx.save_for_backward(q, k, v, *output)


def _attention_grad(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dout = torch.zeros_like(out) if dout is None else dout
    dlse = dlse if ctx.lse_grad else None
    dq, dk, dv = attention_backward_op(dout, q, k, v, out, lse, dlse, ctx.causal, ctx.scale, ctx.backend)
    return dq, dk, dv, None, None, None, None


attention_forward_op.register_autograd(_attention_grad, setup_context=_attention_setup)
