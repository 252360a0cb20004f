"""The kernel boundary as ``torch.library`` custom ops, so that ``torch.compile(fullgraph=True)``
traces :func:`dilated.attention`, :class:`~dilated.DilatedAttention`,
:class:`~dilated.ImprovedDilatedAttention` and :class:`~dilated.MultiheadDilatedAttention` without
graph breaks (as flash-attention registers its kernels).

* ``dilated::attention_forward`` / ``attention_backward``: one exact attention (any backend, by
  name), its lse, and the gradients of both.
* ``dilated::dilated_forward`` / ``dilated_backward``: the whole fast dilated computation of
  :func:`~dilated.improved_dilated_attention` (plan, gathers, kernel calls, combine).
* ``dilated::residue_major_forward`` / ``residue_major_backward`` (registered in
  :mod:`dilated.residue_major`, beside what they run): the same in the residue-major layout.

Each has a fake implementation (shapes and dtypes only) and the forward ops have autograd
formulas that call the backward ops. The ops take what a graph can carry: tensors, numbers,
strings, lists of ints, and integer handles (:mod:`dilated.handles`) for a module's pattern cache
and memory pool. Eager calls go straight to the same functions, without the dispatcher.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ._checks import acc_dtype, dense_rows
from .backends import get_backend
from .dense import attention_backward, attention_forward
from .dilated_calls import backward_calls, forward_calls, resolve_dilated
from .handles import object_of

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

# -- the fast dilated computation ----------------------------------------------------------


def _resolved(q, k, v, segment_lengths, dilation_rates, causal, scale, backend, cache):
    return resolve_dilated(q, k, v, segment_lengths, dilation_rates, causal, scale, backend, object_of(cache))


@torch.library.custom_op("dilated::dilated_forward", mutates_args=())
def dilated_forward_op(q: Tensor, k: Tensor, v: Tensor, segment_lengths: list[int], dilation_rates: list[int],
                       causal: bool, scale: Optional[float], backend: str, cache: int, pool: int,
                       with_lse: bool) -> tuple[Tensor, Tensor]:
    """``(out [B, N, H, D], lse [B, N, H])`` of :func:`dilated.improved_dilated_attention` (lse empty
    unless ``with_lse``); ``cache``, ``pool``: handles of a pattern cache and a memory pool, or 0."""
    spec, plan = _resolved(q, k, v, segment_lengths, dilation_rates, causal, scale, backend, cache)
    q, k, v = dense_rows(q), dense_rows(k), dense_rows(v)
    out, lse = forward_calls((q, k, v), plan, spec, pool=object_of(pool), with_lse=with_lse)
    return out, (lse if with_lse else q.new_empty(0, dtype=acc_dtype(q.dtype)))


@dilated_forward_op.register_fake
def _(q, k, v, segment_lengths, dilation_rates, causal, scale, backend, cache, pool, with_lse):
    lse_shape = q.shape[:3] if with_lse else (0,)
    return q.new_empty(q.shape), q.new_empty(lse_shape, dtype=acc_dtype(q.dtype))


@torch.library.custom_op("dilated::dilated_backward", mutates_args=())
def dilated_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                        segment_lengths: list[int], dilation_rates: list[int], causal: bool,
                        scale: Optional[float], backend: str, cache: int) -> tuple[Tensor, Tensor, Tensor]:
    """``dq, dk, dv`` of :func:`dilated_forward_op` given its ``out`` and ``lse``."""
    spec, plan = _resolved(q, k, v, segment_lengths, dilation_rates, causal, scale, backend, cache)
    q, k, v = dense_rows(q), dense_rows(k), dense_rows(v)
    return backward_calls((q, k, v), plan, spec, out, lse, dout.contiguous())


@dilated_backward_op.register_fake
def _(dout, q, k, v, out, lse, segment_lengths, dilation_rates, causal, scale, backend, cache):
    return tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))


def save_inputs_and_outputs(ctx, inputs, output):
    """``setup_context`` of a dilated forward op: its q, k, v, outputs and other arguments."""
    q, k, v, *ctx.args = inputs  # segment_lengths ... with_lse
    ctx.save_for_backward(q, k, v, *output)


def grad_by(backward_op, forward_name: str):
    """The autograd formula of a forward op with :func:`save_inputs_and_outputs`'s arguments: ``backward_op``
    on the saved inputs, output and lse."""

    def grad(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        segs, dils, causal, scale, backend, cache, _pool, with_lse = ctx.args
        if not with_lse:
            raise RuntimeError(f"dilated::{forward_name} was called with with_lse=False, which keeps no lse for a "
                               "backward; call it with with_lse=True where gradients are needed")
        dq, dk, dv = backward_op(dout, q, k, v, out, lse, segs, dils, causal, scale, backend, cache)
        return dq, dk, dv, *([None] * 8)

    return grad


dilated_forward_op.register_autograd(grad_by(dilated_backward_op, "dilated_forward"),
                                     setup_context=save_inputs_and_outputs)
