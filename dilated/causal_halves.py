"""Non-causal attention as two causal calls: a query's keys at or before it, and at or after it.

A non-causal document padded at its end to a bucket length (as :mod:`dilated.packed` pads causal
documents, so that calls come in a bounded set of shapes) cannot be attended by one non-causal call:
every query would see the padding keys. Two causal calls see none of them: the document in order
(row ``i`` sees keys ``0 .. i``) and the document reversed (row ``i`` sees keys ``i .. m-1``), the
padding after the document in both. Together they cover every key of the document, the diagonal
``(i, i)`` twice; merged by their log-sum-exp less that one term, they are the non-causal attention,
exactly:

    Z = e^{lse_1} + e^{lse_2} - e^{s_ii},   out = (e^{lse_1} o_1 + e^{lse_2} o_2 - e^{s_ii} v_i) / Z,

``s_ii = scale * q_i . k_i``, every exponent taken relative to ``max(lse_1, lse_2)`` (at least
``s_ii``, so ``Z >= 1``). The backward of each causal call, given the merged ``out`` and ``lse`` as
every split of keys is (ring attention's steps), gives its keys' share of the gradients; the
diagonal's share, counted by both, is taken off once (:func:`diagonal_gradients`).

:func:`merge` and :func:`combine_gradients` do each in one pass over a call's rows on CUDA
(:mod:`dilated._triton.causal_halves`), reading the second half's rows where the reversed call left
them; elsewhere (CPU, float64, ``DILATED_TRITON=0``) torch's ops give the same results.

Tensors ``[B, L, H, D]`` (k and v with ``H / G`` heads, GQA), lse ``[B, H, L]`` float32.
"""
from __future__ import annotations

import torch

from ._checks import acc_dtype
from ._triton.launch import LAUNCH, blocks, triton_enabled


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[B, L, H, D]`` as ``[B, L, Hkv, G, D]``: the query heads of each kv head together."""
    return q.reshape(*q.shape[:2], kv_heads, q.shape[2] // kv_heads, q.shape[3])


def _diagonal_logits(q, k, scale: float) -> torch.Tensor:
    """``scale * q_i . k_i`` per row and query head, ``[B, L, H]`` in float32 (float64 for float64)."""
    acc = acc_dtype(q.dtype)
    s = (_grouped(q, k.shape[2]).to(acc) * k.unsqueeze(3).to(acc)).sum(-1)
    return s.flatten(2) * scale


def merge_halves(o1, lse1, o2, lse2, q, k, v, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of the non-causal attention whose two causal halves are ``(o1, lse1)`` (keys at
    or before each query) and ``(o2, lse2)`` (at or after it), each counting the diagonal: ``out`` in
    ``o1``'s dtype, ``lse`` ``[B, H, L]`` float32 (float64 for float64)."""
    acc = acc_dtype(q.dtype)
    l1, l2 = lse1.transpose(1, 2).to(acc), lse2.transpose(1, 2).to(acc)  # [B, L, H]
    top = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - top), torch.exp(l2 - top)
    wd = torch.exp(_diagonal_logits(q, k, scale) - top)
    total = w1 + w2 - wd
    out = o1.to(acc) * w1.unsqueeze(-1) + o2.to(acc) * w2.unsqueeze(-1)
    diag = _grouped(wd.unsqueeze(-1), k.shape[2])  # [B, L, Hkv, G, 1]
    out = _grouped(out, k.shape[2]).sub_(diag * v.unsqueeze(3).to(acc)).flatten(2, 3)
    out = out / total.unsqueeze(-1)
    return out.to(o1.dtype), (top + torch.log(total)).transpose(1, 2).contiguous()


def diagonal_gradients(dout, q, k, v, out, lse, scale: float, dlse=None) -> tuple[torch.Tensor, ...]:
    """``(dq, dk, dv)`` (float32) of the diagonal terms alone, given the merged ``out`` and ``lse``
    and the gradients ``dout`` and ``dlse`` (or None) of both: what each causal half's backward
    adds for them, which the two halves' sum holds twice. With ``p = exp(s_ii - lse_i)``:
    ``dv_i = sum_h p dout_i``, ``dS = p (dout_i . v_i - dout_i . out_i + dlse_i)``,
    ``dq_i = scale dS k_i``, ``dk_i = scale sum_h dS q_i``."""
    acc = acc_dtype(q.dtype)
    hkv = k.shape[2]
    p = torch.exp(_diagonal_logits(q, k, scale) - lse.transpose(1, 2).to(acc))  # [B, L, H]
    g_out = _grouped(dout.to(acc), hkv)  # [B, L, Hkv, G, D]
    dp = (g_out * v.unsqueeze(3).to(acc)).sum(-1).flatten(2)  # dout_i . v_i per query head
    delta = (dout.to(acc) * out.to(acc)).sum(-1)
    ds = p * (dp - delta + (0 if dlse is None else dlse.transpose(1, 2).to(acc)))
    dq = (_grouped(ds.unsqueeze(-1), hkv) * k.unsqueeze(3).to(acc)).flatten(2, 3) * scale
    dk = (_grouped(ds.unsqueeze(-1), hkv) * _grouped(q.to(acc), hkv)).sum(3) * scale
    dv = (_grouped(p.unsqueeze(-1), hkv) * g_out).sum(3)
    return dq, dk, dv


def flipped(x: torch.Tensor, flip: torch.Tensor, b: int) -> torch.Tensor:
    """A call's rows ``[b * count, L, ...]`` in the order ``flip`` gives within each of its ``b`` batch
    rows of ``count * L`` (:func:`dilated.packed.document_rows`: each document reversed; its own inverse)."""
    return x.reshape(b, -1, *x.shape[2:]).index_select(1, flip).reshape(x.shape)


def flipped_lse(lse: torch.Tensor, flip: torch.Tensor, b: int) -> torch.Tensor:
    """:func:`flipped` of a call's lse ``[b * count, H, L]``."""
    return flipped(lse.transpose(1, 2), flip, b).transpose(1, 2).contiguous()


def _on_triton(x: torch.Tensor) -> bool:
    return triton_enabled(x.device) and x.dtype != torch.float64


def _launch(pairs: int, d: int) -> tuple[int, int, tuple]:
    rows, block_d = blocks(d)
    return rows, block_d, ((pairs + rows - 1) // rows,)


def merge(o1, lse1, o2, lse2, q, k, v, scale: float, flip: torch.Tensor, b: int):
    """:func:`merge_halves` of a call whose second half ``(o2, lse2)`` is in the order ``flip`` (each
    document reversed: :func:`flipped`): one Triton kernel on CUDA (or Triton's interpreter), else torch."""
    if not _on_triton(q):
        return merge_halves(o1, lse1, flipped(o2, flip, b), flipped_lse(lse2, flip, b), q, k, v, scale)
    from ._triton.causal_halves import merge_halves_kernel

    o1, lse1, o2, lse2, q, k, v = (x.contiguous() for x in (o1, lse1, o2, lse2, q, k, v))
    out = torch.empty_like(o1)
    lse = torch.empty(lse1.shape, dtype=torch.float32, device=q.device)
    calls, n, h, d = q.shape
    block, block_d, grid = _launch(calls * n * h, d)
    merge_halves_kernel[grid](out, lse, o1, lse1, o2, lse2, q, k, v, flip, calls * n, calls * n // b, n, h,
                              k.shape[2], d, scale, BLOCK=block, BLOCK_D=block_d, num_warps=LAUNCH["num_warps"])
    return out, lse


def combine_gradients(first, second, dout, q, k, v, out, lse, scale: float, flip: torch.Tensor, b: int, dlse=None):
    """``(dq, dk, dv)`` of a call in two causal halves: the first half's gradients ``first``, plus the
    second's ``second`` (in the order ``flip``), less the diagonal's share both hold
    (:func:`diagonal_gradients`); one Triton kernel on CUDA (writing into ``first``), else torch."""
    if not _on_triton(q):
        diagonal = diagonal_gradients(dout, q, k, v, out, lse, scale, dlse)
        return tuple((g1.to(x.dtype) + flipped(g2, flip, b).to(x.dtype) - x).to(g1.dtype)
                     for g1, g2, x in zip(first, second, diagonal))
    from ._triton.causal_halves import halves_gradients_kernel

    dq, dk, dv = (g.contiguous() for g in first)
    dq2, dk2, dv2, dout, q, k, v, out, lse = (x.contiguous() for x in (*second, dout, q, k, v, out, lse))
    dlse = None if dlse is None else dlse.contiguous()
    calls, n, h, d = q.shape
    block, block_d, grid = _launch(calls * n * k.shape[2], d)
    halves_gradients_kernel[grid](dq, dk, dv, dq2, dk2, dv2, dout, q, k, v, out, lse, lse if dlse is None else dlse,
                                  flip, calls * n, calls * n // b, n, h, k.shape[2], d, scale,
                                  HAS_DLSE=dlse is not None, BLOCK=block, BLOCK_D=block_d,
                                  num_warps=LAUNCH["num_warps"])
    return dq, dk, dv
