"""``xformers``: ``xformers.ops.memory_efficient_attention``.

The log-sum-exp comes from ``memory_efficient_attention_forward_requires_grad`` (returns
``out, lse``; lse may be padded along the query axis, which we slice off and pad back for
backward). Backward is ``memory_efficient_attention_backward(grad, out, lse, q, k, v, ...)`` with
the (merged) ``out`` and ``lse``. Causal uses ``LowerTriangularMask`` (we only pass square causal
problems). GQA is expanded above the backend (xformers wants a 5-D layout for it).

With torch 2.11 the xformers 0.0.35 wheel imports but every call fails with "No operator found";
:func:`dilated.available_backends` reports that reason, from a real call.
"""
from __future__ import annotations

import torch.nn.functional as F

from .base import Backend, cuda_library_reason, needs_half


def _import():
    import xformers.ops as xops

    return xops


def _bias(xops, causal):
    return xops.fmha.attn_bias.LowerTriangularMask() if causal else None


class XFormersBackend(Backend):
    name = "xformers"
    native_gqa = False

    def unavailable_reason(self, device):
        return cuda_library_reason(device, "xformers", _import)

    def input_reason(self, q, k, causal):
        return needs_half(q, "xformers")

    def forward(self, q, k, v, causal, scale):
        xops = _import()
        out, lse = xops.memory_efficient_attention_forward_requires_grad(q, k, v, attn_bias=_bias(xops, causal), scale=scale)
        return out, lse[..., : q.shape[1]].float()

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        xops = _import()
        pad = (-q.shape[1]) % 32
        lse_p = F.pad(lse, (0, pad)) if pad else lse
        dq, dk, dv = xops.memory_efficient_attention_backward(
            dout.contiguous(), out.contiguous(), lse_p.contiguous(), q, k, v, attn_bias=_bias(xops, causal), scale=scale)
        return dq, dk, dv
