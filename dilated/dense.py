"""The exact dense attention pieces every entry point runs a backend's kernels through: forward with
its log-sum-exp, backward, and their autograd Function (:func:`dilated.attention` is in
:mod:`dilated.functional`).

This layer does, once for every backend, what the kernels disagree on:

* causal alignment: for ``seq_q != seq_k`` causal is bottom-right aligned (query ``i`` sees keys
  ``j <= i + seq_k - seq_q``, as flash-attn defines it). Kernels only ever see square-causal or
  non-causal pieces: a fully visible key prefix plus a square causal block, merged by lse; query
  rows that see no key output 0 with lse ``-inf``.
* long causal blocks: where a kernel's causal forward slows down past some length
  (:meth:`~dilated.backends.base.Backend.longest_causal_block`; cuDNN past 64K rows), the forward
  runs it as query chunks, each an unmasked call over earlier keys and a short causal block,
  merged by lse. The backward stays one kernel call over the merged ``out`` and ``lse``: cuDNN's
  causal backward keeps its rate on long blocks (measured in docs/performance-log.md, "cuDNN's
  causal forward on long blocks, in query chunks").
* GQA: k/v heads are repeated for kernels without native GQA, and their gradients summed back.
* autograd: :class:`AttentionFunction` calls the backend's backward with the merged ``out`` and
  ``lse``. The returned lse is differentiable too: its gradient adds ``P * dlse`` to ``dS``,
  which is one more kernel backward with ``v`` a constant unit vector, ``dout = dlse`` along it and
  ``out = 0`` (then ``dP = dlse`` and ``D = 0``). That pass runs only when lse gets a gradient.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from ._checks import acc_dtype, check_scale, dense_rows
from .backends import Backend
from .backends.base import expand_kv_heads, reduce_kv_heads
from .backends.graph_shapes import one_operation
from .backends.kernel_log import note_kernel, recording
from .merge import empty_accumulators, merge_

@dataclass(frozen=True)
class AttentionSpec:
    """What the kernel calls of one computation share: the resolved backend, causality and scale."""

    backend: object  # a dilated.backends.Backend
    causal: bool
    scale: float


def causal_pieces(nq: int, nk: int, causal: bool, longest: int | None = None) -> list[tuple[int, int, int, int, bool]]:
    """Split bottom-right causal attention into kernel calls ``(q0, q1, k0, k1, causal)``.

    ``longest``: the longest square causal call to make (a backend's
    :meth:`~dilated.backends.base.Backend.longest_causal_block`). A longer causal block becomes
    query chunks of at most that length, each an unmasked call over the keys before it and a
    causal call on its own block: the same work, most of it unmasked.
    """
    if not causal:
        return [(0, nq, 0, nk, False)]
    n = min(nq, nk)  # the square causal block: query rows [nq - n, nq), keys [nk - n, nk)
    q_start, k_start = nq - n, nk - n  # rows before q_start see no key; keys before k_start all rows see
    if n == 0:
        return [(q_start, nq, k_start, nk, True)]
    chunks = 1 if longest is None else -(-n // longest)  # ceil(n / longest)
    size = -(-n // chunks)  # the last chunk takes what is left
    pieces = []
    for a in range(0, n, size):
        b = min(a + size, n)
        if k_start + a:
            pieces.append((q_start + a, q_start + b, 0, k_start + a, False))
        pieces.append((q_start + a, q_start + b, k_start + a, k_start + b, True))
    return pieces


def _kv_for(backend: Backend, q, k, v):
    groups = q.shape[2] // k.shape[2]
    if groups > 1 and not backend.takes_kv_heads(q, k, False):
        return expand_kv_heads(k, groups), expand_kv_heads(v, groups), groups
    return k, v, 1


def _no_lse(backend: Backend) -> ValueError:
    return ValueError(f"backend {backend.name!r} returns no log-sum-exp here: it serves dense attention forward "
                      "(dilated.attention without return_lse, seq_q == seq_k or non-causal) only; dilated, ring and "
                      "return_lse=True need a backend that gives one")


@one_operation()
def attention_forward(backend: Backend, q, k, v, causal: bool, scale: float, need_lse: bool = True):
    """``(out, lse)`` without autograd; bottom-right causal, GQA and strided head_dim handled here.
    ``need_lse=False``: a backend without a log-sum-exp may return None for it."""
    q, k, v = dense_rows(q), dense_rows(k), dense_rows(v)
    k, v, _ = _kv_for(backend, q, k, v)
    if recording():
        note_kernel(backend.kernel_name(q, k, causal))
    pieces = causal_pieces(q.shape[1], k.shape[1], causal, backend.longest_causal_block(q, k) if causal else None)
    if len(pieces) == 1 and pieces[0][0] == 0:
        out, lse = backend.forward(q, k, v, pieces[0][4], scale)
        if lse is None and need_lse:
            raise _no_lse(backend)
        return out, lse
    b, nq, h = q.shape[:3]
    out = q.new_empty(b, nq, h, v.shape[3])
    lse = torch.empty(b, h, nq, device=q.device, dtype=acc_dtype(q.dtype))
    seen = pieces[0][0]  # rows before the first piece see no key
    out[:, :seen] = 0
    lse[:, :, :seen] = float("-inf")

    def call(q0, q1, k0, k1, c):
        o, l = backend.forward(q[:, q0:q1], k[:, k0:k1], v[:, k0:k1], c, scale)
        if l is None:  # pieces merge by their log-sum-exp
            raise _no_lse(backend)
        return o, l

    for (q0, q1), rows in itertools.groupby(pieces, key=lambda p: p[:2]):
        rows = list(rows)
        if len(rows) == 1:
            out[:, q0:q1], lse[:, :, q0:q1] = call(*rows[0])
            continue
        # accumulators for these rows only: a long causal block's chunks hold float32 for one chunk
        acc, acc_lse = empty_accumulators(b, q1 - q0, h, v.shape[3], q.device, acc_dtype(q.dtype))
        for piece in rows:
            o, l = call(*piece)
            merge_(acc, acc_lse, o, l.transpose(1, 2))
        out[:, q0:q1], lse[:, :, q0:q1] = acc, acc_lse.transpose(1, 2)
    return out, lse


@one_operation()
def attention_backward(backend: Backend, dout, q, k, v, out, lse, causal: bool, scale: float, dlse=None):
    """``dq, dk, dv`` of the attention whose (merged) output and lse are ``out`` and ``lse``."""
    dout, q, k, v, out = (dense_rows(t) for t in (dout, q, k, v, out))
    k_e, v_e, groups = _kv_for(backend, q, k, v)
    if recording():
        note_kernel(backend.kernel_name(q, k_e, causal))
    pieces = causal_pieces(q.shape[1], k.shape[1], causal)

    def run(dout_, v_, out_):
        if len(pieces) == 1 and pieces[0][0] == 0:
            return backend.backward(dout_, q, k_e, v_, out_, lse, pieces[0][4], scale)
        acc = acc_dtype(q.dtype)
        dq = torch.zeros_like(q, dtype=acc)
        dk = torch.zeros_like(k_e, dtype=acc)
        dv = torch.zeros_like(v_, dtype=acc)
        for q0, q1, k0, k1, c in pieces:
            g = backend.backward(dout_[:, q0:q1], q[:, q0:q1], k_e[:, k0:k1], v_[:, k0:k1],
                                 out_[:, q0:q1], lse[:, :, q0:q1].contiguous(), c, scale)
            dq[:, q0:q1] += g[0]
            dk[:, k0:k1] += g[1]
            dv[:, k0:k1] += g[2]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    dq, dk, dv = run(dout, v_e, out)
    if dlse is not None:
        dq_l, dk_l = lse_gradient(run, dout, v_e, out, dlse.transpose(1, 2))
        dq, dk = dq + dq_l, dk + dk_l
    return dq, reduce_kv_heads(dk, groups), reduce_kv_heads(dv, groups)


def lse_gradient(run, dout, v, out, dlse_rows):
    """``(dq, dk)`` from the gradient of the log-sum-exp, by one more kernel backward
    ``run(dout_, v_, out_) -> (dq, dk, dv)`` with ``v`` a unit vector, ``dout = dlse`` along it and
    ``out = 0`` (then ``dP = dlse`` and ``D = 0``, so ``dS = P * dlse``). ``dlse_rows``: the lse
    gradient laid out like ``dout[..., 0]``."""
    unit = torch.zeros_like(v)
    unit[..., 0] = 1
    dout_l = torch.zeros_like(dout)
    dout_l[..., 0] = dlse_rows.to(dout.dtype)
    dq_l, dk_l, _ = run(dout_l, unit, torch.zeros_like(out))
    return dq_l, dk_l


class AttentionFunction(torch.autograd.Function):
    """Autograd for one attention call; backward goes through the backend's kernel backward."""

    @staticmethod
    def forward(ctx, q, k, v, backend: Backend, causal: bool, scale: float):
        ctx.set_materialize_grads(False)  # an unused lse's gradient comes as None, not as zeros
        out, lse = attention_forward(backend, q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.backend, ctx.causal, ctx.scale = backend, causal, scale
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = attention_backward(ctx.backend, dout.contiguous(), q, k, v, out, lse,
                                        ctx.causal, ctx.scale, dlse)
        return dq, dk, dv, None, None, None


def default_scale(head_dim: int, scale: float | None) -> float:
    check_scale(scale)
    return float(scale) if scale is not None else 1.0 / math.sqrt(head_dim)
