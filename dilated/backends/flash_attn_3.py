"""``flash_attn_3``: FlashAttention-3, the ``flash_attn_interface`` module of flash-attention's
``hopper/`` build (Hopper GPUs, sm90).

The log-sum-exp comes from the public API: ``flash_attn_func`` returns ``(out, softmax_lse)``
(older betas always; newer releases with ``return_attn_probs=True``). Backward calls
``flash_attn_interface._flash_attn_backward`` (a ``torch.library`` custom op,
``flash_attn_3::_flash_attn_backward``, filling ``dq``, ``dk``, ``dv`` in place) with the (merged)
``out`` and ``softmax_lse`` by keyword, names from the op schema (its varlen arguments are None
for dense batches; its causal flag is named ``is_causal``, older builds ``causal``). GQA is native.

Tested on CPU against stand-ins registered with the real signatures (``tests/backends/test_backends.py``);
not run against an installed FA3 build. Where it is not installed it reports itself unavailable.
"""
from __future__ import annotations

import torch

from ._signature import call_by_name
from .base import Backend, cuda_library_reason, head_dim_reason, needs_half


def _import():
    import flash_attn_interface as fa3

    return fa3


class FlashAttn3Backend(Backend):
    name = "flash_attn_3"
    native_gqa = True

    def unavailable_reason(self, device):
        reason = cuda_library_reason(device, "flash-attn 3 (flash_attn_interface, hopper build)", _import)
        if reason is not None:
            return reason
        if torch.cuda.get_device_capability(device)[0] != 9:
            return "flash-attn 3 runs on Hopper (sm90) only"
        return None

    def input_reason(self, q, k, causal):
        return needs_half(q, "flash-attn 3") or head_dim_reason(q.shape[-1], "flash-attn 3")

    def forward(self, q, k, v, causal, scale):
        fa3 = _import()
        out, lse = call_by_name(fa3.flash_attn_func, dict(q=q, k=k, v=v, softmax_scale=scale, causal=causal,
                                                          return_attn_probs=True),
                                required=("q", "k", "v", "softmax_scale", "causal"))[:2]
        return out, lse.float()

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        fa3 = _import()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        call_by_name(fa3._flash_attn_backward, dict(
            dout=dout.contiguous(), q=q, k=k, v=v, out=out.contiguous(), softmax_lse=lse.contiguous(),
            dq=dq, dk=dk, dv=dv, softmax_scale=scale, causal=causal, is_causal=causal, window_size=(-1, -1),
            window_size_left=-1, window_size_right=-1, softcap=0.0, deterministic=False, sm_margin=0),
            required=("dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "softmax_scale",
                      ("causal", "is_causal")))
        return dq, dk, dv
