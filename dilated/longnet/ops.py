"""The fast dilated computation as ``torch.library`` custom ops (``dilated::dilated_forward`` /
``dilated_backward``, see :mod:`dilated.ops`), and the autograd formula every dilated forward op
shares (the residue-major ops in :mod:`dilated.longnet.residue_major` use it too)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .._checks import acc_dtype, dense_rows
from ..handles import object_of
from .dilated_calls import backward_calls, forward_calls, resolve_dilated


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
