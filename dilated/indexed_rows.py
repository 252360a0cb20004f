"""In place on the rows ``rows`` (dim 1) of ``[B, N, H, D]`` tensors, from a part ``[B, T, H, D]``
computed on those rows gathered (the crossing documents' rectangles of
:mod:`dilated.parallel.document_attention`, the batched calls of :mod:`dilated.packed`):

* :func:`merge_rows_`: merge the part and its lse into the rows and their lse (log-sum-exp);
* :func:`place_rows_`: write the part's rows (or some of them) there;
* :func:`add_rows_`: add the part to the rows in float32, rounded once to their dtype;
* :func:`add_to_slots_`: add the part to float32 rows where rows repeat (their parts summed).

On CUDA with Triton each is one kernel that reads the rows where they lie and writes them once
(no gathered copies, no float32 copy of them in memory; ``index_copy_`` writes rows of
``[B, N, H, D]`` at a fraction of the memory's rate, docs/performance-log.md); elsewhere (CPU, no Triton,
``DILATED_TRITON=0``, float64, a head_dim not contiguous) torch's ``index_select``,
``index_copy_`` and ``index_add_`` give the same results. Repeated rows are summed by atomic adds
on CUDA either way (an order that may vary from call to call where three or more parts meet).
"""
from __future__ import annotations

import torch

from ._checks import acc_dtype
from ._triton.launch import LAUNCH, blocks, triton_enabled
from .merge import merge_


def _on_triton(*tensors: torch.Tensor) -> bool:
    x = tensors[0]
    return (triton_enabled(x.device) and x.dtype != torch.float64 and x.shape[1] > 0
            and all(t.stride(-1) == 1 for t in tensors))


def _grid(b: int, t: int, h: int, d: int) -> tuple[int, int, int, tuple]:
    """``(triples, triples per program, head_dim block, grid)`` of ``b x t x h`` rows of ``d``."""
    rows, block_d = blocks(d)
    count = b * t * h
    return count, rows, block_d, ((count + rows - 1) // rows,)


def merge_rows_(out: torch.Tensor, lse: torch.Tensor, rows: torch.Tensor, part: torch.Tensor,
                part_lse: torch.Tensor) -> None:
    """Merge ``(part [B, T, H, D], part_lse [B, H, T])`` into ``out[:, rows]`` and ``lse[:, :, rows]``
    (``lse`` ``[B, H, N]`` float32; ``rows`` distinct int64) in place."""
    if not rows.numel():
        return
    if _on_triton(out, part):
        from ._triton.indexed_rows import merge_rows_kernel

        count, block, block_d, grid = _grid(*part.shape)
        merge_rows_kernel[grid](out, lse, part, part_lse, rows, count, part.shape[1], part.shape[2], part.shape[3],
                                out.stride(0), out.stride(1), out.stride(2), *lse.stride(), part.stride(0),
                                part.stride(1), part.stride(2), *part_lse.stride(), BLOCK=block, BLOCK_D=block_d,
                                num_warps=LAUNCH["num_warps"])
        return
    acc = out.index_select(1, rows).to(acc_dtype(out.dtype))
    acc_lse = lse.index_select(2, rows).transpose(1, 2).contiguous()
    merge_(acc, acc_lse, part, part_lse.transpose(1, 2))
    out.index_copy_(1, rows, acc.to(out.dtype))
    lse.index_copy_(2, rows, acc_lse.transpose(1, 2).to(lse.dtype))


_PLACE, _ADD, _ATOMIC_ADD = 0, 1, 2


def _rows_op(dst: torch.Tensor, rows: torch.Tensor, src: torch.Tensor, op: int, src_rows=None) -> None:
    from ._triton.indexed_rows import rows_kernel

    count, block, block_d, grid = _grid(dst.shape[0], rows.numel(), dst.shape[2], dst.shape[3])
    rows_kernel[grid](dst, src, rows, rows if src_rows is None else src_rows, count, rows.numel(), dst.shape[2],
                      dst.shape[3], src.shape[1], src.shape[0] // dst.shape[0], dst.stride(0), dst.stride(1),
                      dst.stride(2), src.stride(0), src.stride(1), src.stride(2), OP=op,
                      SRC_ROWS=src_rows is not None, BLOCK=block, BLOCK_D=block_d, num_warps=LAUNCH["num_warps"])


def place_rows_(dst: torch.Tensor, rows: torch.Tensor, src: torch.Tensor, src_rows: torch.Tensor | None = None) -> None:
    """``dst[:, rows] = src[:, src_rows]`` (all of ``src``'s rows where ``src_rows`` is None; ``rows``
    distinct), cast to ``dst``'s dtype. ``src`` is ``[B, T, H, D]``, or a batched call's output
    ``[B * C, L, H, D]`` (its ``C`` calls of each batch row, read as ``C * L`` rows without a copy
    whatever its strides). One pass, where reshaping, gathering and ``index_copy_`` take three and
    the last writes rows at a lower rate."""
    if not rows.numel():
        return
    if _on_triton(dst, src):
        _rows_op(dst, rows, src, _PLACE, src_rows)
        return
    src = src.reshape(dst.shape[0], -1, *src.shape[2:])
    dst.index_copy_(1, rows, (src if src_rows is None else src.index_select(1, src_rows)).to(dst.dtype))


def add_rows_(grad: torch.Tensor, rows: torch.Tensor, part: torch.Tensor) -> None:
    """``grad[:, rows] += part`` in float32 (float64 for float64), rounded once to ``grad``'s dtype:
    only those rows are converted, not the whole gradient (``rows`` distinct)."""
    if not rows.numel():
        return
    if _on_triton(grad, part):
        _rows_op(grad, rows, part, _ADD)
        return
    acc = acc_dtype(grad.dtype)
    grad.index_copy_(1, rows, (grad.index_select(1, rows).to(acc) + part.to(acc)).to(grad.dtype))


def add_to_slots_(acc: torch.Tensor, slots: torch.Tensor, part: torch.Tensor) -> None:
    """``acc[:, slots] += part`` where ``slots`` may repeat (their parts summed), ``acc`` float32 (or
    float64) and ``part`` any dtype; ``acc`` may be a view (a channel range of a larger buffer)."""
    if not slots.numel():
        return
    if _on_triton(acc, part) and acc.dtype == torch.float32:
        _rows_op(acc, slots, part, _ATOMIC_ADD)
        return
    acc.index_add_(1, slots, part.to(acc.dtype))
