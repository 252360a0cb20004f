"""``flash_attn_4``: flash-attn 4, the CuTe-DSL kernels in ``flash_attn.cute`` (Hopper/Blackwell).

``flash_attn.cute.interface._flash_attn_fwd(..., return_lse=True)`` returns ``(out, lse)``;
backward is ``_flash_attn_bwd(q, k, v, out, dout, lse, ...)`` with the (merged) ``out`` and
``lse``. Both are called by keyword. GQA is native. Its backward asserts that q, out and dout
share a dtype: out and dout are passed in q's. Both entry points read any 16-byte-aligned
layout with a contiguous last dim in place (``maybe_contiguous`` of its ``cute_dsl_utils``): q,
k, v, out and dout are passed as they lie.

Its backward on Hopper (4.0.0b36, measured on an H200) is wrong where a head dim is not a multiple
of 32 (16, 48, 80, 112: dq off by 40-100%, and with grouped heads dk and dv too; 112 non-causal
does not compile), while its forward is right: the backward runs on q, k, v, out and dout padded
with zero columns to the next multiple of 32 (:func:`backward_head_dims`), which changes no score
and no output, and the gradients are cut back.

Its backward compiles a kernel variant per "one query block" / "one key block" pair (flags of
its compile key, against the "TVM stride poisoning" of single-block calls): a call of 81-128
query rows (head_dim 128 on Hopper: 80-row query tiles, 128-row key tiles) compiled one more
variant, seconds long, at whatever length first had one (a dilated plan's clipped last
segment, 664 rows over r = 8). So the first backward of each dtype, head dims, head grouping and
causality with more rows than those calls also runs tiny calls of :data:`VARIANT_ROWS` query
rows, which compile every variant then (a short call, such as the availability probe's, leaves
them to the first long one); ``DILATED_FA4_COMPILE_VARIANTS=0`` skips them.

Written against the published CuTe interface; where flash-attn 4 is not installed it reports
itself unavailable.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ._signature import call_by_name
from .base import Backend, cuda_library_reason, head_dim_reason, needs_half


def cute_interface():
    """flash-attn 4's ``flash_attn.cute.interface`` module (ImportError where it is not installed)."""
    from flash_attn.cute import interface

    return interface


#: query (and key) rows of the calls that compile the backward's variants: 1, and one more than
#: each tile size flash-attn 4 uses (64-256 rows), so every pair of single-block flags occurs
VARIANT_ROWS = (1, 65, 81, 97, 113, 129, 177, 193, 257)


#: the block-sparse path on Hopper: 128 x 128 tiles, head dims measured exact forward and backward
BLOCK_SPARSE_BLOCK = 128
BLOCK_SPARSE_HEAD_DIMS = (64, 128)


def _block_sparse_tensors(lists):
    """flash-attn 4's ``BlockSparseTensorsTorch`` for ``lists`` (a
    :class:`dilated.longnet.residue_major.BlockLists`): every listed block is a full block (no mask within
    it); the same lists serve the forward (key blocks per query block) and, being symmetric, the
    backward (query blocks per key block)."""
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

    none_cnt = torch.zeros_like(lists.counts)
    none_idx = torch.zeros(*lists.counts.shape, 1, dtype=torch.int32, device=lists.counts.device)
    return BlockSparseTensorsTorch(mask_block_cnt=none_cnt, mask_block_idx=none_idx, full_block_cnt=lists.counts,
                                   full_block_idx=lists.indices, block_size=(lists.block, lists.block))


def backward_head_dims(head_dim: int, head_dim_v: int) -> tuple[int, int]:
    """The head dims its backward runs at: each rounded up to a multiple of 32."""
    return -(-head_dim // 32) * 32, -(-head_dim_v // 32) * 32


def padded_backward(backward, dout, q, k, v, out):
    """``backward(dout, q, k, v, out)`` with q, k and v, out, dout zero-padded to
    :func:`backward_head_dims` where they differ, its gradients cut back to the given head dims."""
    d, dv = q.shape[-1], v.shape[-1]
    pd, pdv = backward_head_dims(d, dv)
    if (pd, pdv) == (d, dv):
        return backward(dout, q, k, v, out)
    q, k = (F.pad(t, (0, pd - d)) for t in (q, k))
    v, out, dout = (F.pad(t, (0, pdv - dv)) for t in (v, out, dout))
    dq, dk, dv_ = backward(dout, q, k, v, out)[:3]
    return dq[..., :d].contiguous(), dk[..., :d].contiguous(), dv_[..., :dv].contiguous()


class FlashAttn4Backend(Backend):
    name = "flash_attn_4"
    native_gqa = True

    def __init__(self):
        self._compiled: set = set()  # (device, dtype, head dims, heads per kv head, causal) whose variants ran

    def unavailable_reason(self, device):
        return cuda_library_reason(device, "flash-attn 4 (flash_attn.cute)", cute_interface)

    def input_reason(self, q, k, causal):
        # its own check, an assertion: "head_dim and head_dim_v must be between 8 and 256 and divisible by 8"
        return needs_half(q, "flash-attn 4") or head_dim_reason(q.shape[-1], "flash-attn 4")

    def reads_strided_rows(self, q, k, causal):
        # its interface keeps any layout whose last dim is contiguous and whose other strides and
        # pointer are 16-byte aligned (flash_attn.cute.cute_dsl_utils.maybe_contiguous), and copies
        # the rest: dilated rows are read where they lie when head_dim * itemsize is a multiple of 16
        return q.device.type == "cuda" and (q.shape[-1] * q.element_size()) % 16 == 0

    def forward(self, q, k, v, causal, scale):
        fa4 = cute_interface()
        out, lse = call_by_name(fa4._flash_attn_fwd, dict(
            q=q, k=k, v=v, softmax_scale=scale, causal=causal, return_lse=True),
            required=("q", "k", "v", "softmax_scale", "causal", "return_lse"))[:2]
        return out, lse.float()

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        def run(dout, q, k, v, out):
            self._compile_variants(q, k, v, causal, scale)
            return self._backward(dout, q, k, v, out, lse, causal, scale)

        return padded_backward(run, dout.to(q.dtype), q, k, v, out.to(q.dtype))

    def _backward(self, dout, q, k, v, out, lse, causal, scale):
        fa4 = cute_interface()
        dq, dk, dv = call_by_name(fa4._flash_attn_bwd, dict(
            q=q, k=k, v=v, out=out, dout=dout, lse=lse.contiguous(), softmax_scale=scale,
            causal=causal),
            required=("q", "k", "v", "out", "dout", "lse", "softmax_scale", "causal"))[:3]
        return dq, dk, dv

    def block_sparse_reason(self, q, k, block):
        reason = self.unavailable_reason(q.device) or self.input_reason(q, k, False)
        if reason:
            return reason
        if torch.cuda.get_device_capability(q.device)[0] != 9:
            return "flash-attn 4's block-sparse path is used on Hopper (compute capability 9.x) only"
        if block != BLOCK_SPARSE_BLOCK:
            return f"flash-attn 4's block-sparse path on Hopper takes blocks of {BLOCK_SPARSE_BLOCK} rows, not {block}"
        if q.shape[-1] not in BLOCK_SPARSE_HEAD_DIMS:
            return (f"flash-attn 4's block-sparse path is tested with head_dim in {BLOCK_SPARSE_HEAD_DIMS}, "
                    f"got {q.shape[-1]}")
        return None

    def block_sparse_forward(self, q, k, v, lists, scale):
        fa4 = cute_interface()
        out, lse = fa4._flash_attn_fwd(q=q, k=k, v=v, softmax_scale=scale, causal=False, return_lse=True,
                                       block_sparse_tensors=_block_sparse_tensors(lists))[:2]
        return out, lse.float()

    def block_sparse_backward(self, dout, q, k, v, out, lse, lists, scale):
        fa4 = cute_interface()
        dq, dk, dv = fa4._flash_attn_bwd(q=q, k=k, v=v, out=out.to(q.dtype), dout=dout.to(q.dtype),
                                         lse=lse.contiguous(), softmax_scale=scale, causal=False,
                                         block_sparse_tensors=_block_sparse_tensors(lists))[:3]
        return dq, dk, dv

    def _compile_variants(self, q, k, v, causal, scale):
        """At the first long backward of its class, tiny calls of :data:`VARIANT_ROWS` rows."""
        groups = q.shape[2] // k.shape[2]
        key = (q.device, q.dtype, q.shape[-1], v.shape[-1], groups, causal)
        if q.shape[1] <= VARIANT_ROWS[-1] or key in self._compiled \
                or os.environ.get("DILATED_FA4_COMPILE_VARIANTS", "1") == "0":
            return
        self._compiled.add(key)
        gen = torch.Generator(device=q.device).manual_seed(0)  # the caller's random streams stay as they are
        with torch.no_grad():
            for n in VARIANT_ROWS:
                qs, ks, vs, do = (torch.randn(1, n, h, t.shape[-1], device=q.device, dtype=q.dtype, generator=gen)
                                  for t, h in ((q, groups), (k, 1), (v, 1), (v, groups)))
                o, l = self.forward(qs, ks, vs, causal, scale)
                self._backward(do, qs, ks, vs, o, l, causal, scale)
