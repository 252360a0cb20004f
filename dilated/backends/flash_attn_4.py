"""``flash_attn_4``: flash-attn 4, the CuTe-DSL kernels in ``flash_attn.cute`` (Hopper/Blackwell).

``flash_attn.cute.interface._flash_attn_fwd(..., return_lse=True)`` returns ``(out, lse)``;
backward is ``_flash_attn_bwd(q, k, v, out, dout, lse, ...)`` with the (merged) ``out`` and
``lse``. Both are called by keyword. GQA is native. Its backward asserts that q, out and dout
share a dtype: out and dout are passed in q's. Both entry points read any 16-byte-aligned
layout with a contiguous last dim in place (``maybe_contiguous`` of its ``cute_dsl_utils``): q,
k, v, out and dout are passed as they lie.

Written against the published CuTe interface; where flash-attn 4 is not installed it reports
itself unavailable.
"""
from __future__ import annotations

from ._signature import call_by_name
from .base import Backend, cuda_library_reason, needs_half


def _import():
    from flash_attn.cute import interface

    return interface


class FlashAttn4Backend(Backend):
    name = "flash_attn_4"
    native_gqa = True

    def unavailable_reason(self, device):
        return cuda_library_reason(device, "flash-attn 4 (flash_attn.cute)", _import)

    def input_reason(self, q, k, causal):
        return needs_half(q, "flash-attn 4")

    def reads_strided_rows(self, q, k, causal):
        # its interface keeps any layout whose last dim is contiguous and whose other strides and
        # pointer are 16-byte aligned (flash_attn.cute.cute_dsl_utils.maybe_contiguous), and copies
        # the rest: dilated rows are read where they lie when head_dim * itemsize is a multiple of 16
        return q.device.type == "cuda" and (q.shape[-1] * q.element_size()) % 16 == 0

    def forward(self, q, k, v, causal, scale):
        fa4 = _import()
        out, lse = call_by_name(fa4._flash_attn_fwd, dict(
            q=q, k=k, v=v, softmax_scale=scale, causal=causal, return_lse=True),
            required=("q", "k", "v", "softmax_scale", "causal", "return_lse"))[:2]
        return out, lse.float()

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        fa4 = _import()
        dq, dk, dv = call_by_name(fa4._flash_attn_bwd, dict(
            q=q, k=k, v=v, out=out.to(q.dtype), dout=dout.to(q.dtype), lse=lse.contiguous(), softmax_scale=scale,
            causal=causal),
            required=("q", "k", "v", "out", "dout", "lse", "softmax_scale", "causal"))[:3]
        return dq, dk, dv
