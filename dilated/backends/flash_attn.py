"""``flash_attn``: flash-attn 2 (``pip install flash-attn``), Dao-AILab's CUDA kernels.

The log-sum-exp comes from the public API (``flash_attn_func(..., return_attn_probs=True)``
returns ``out, softmax_lse, S_dmask``). Backward calls
``flash_attn.flash_attn_interface._flash_attn_backward`` with the (merged) ``out`` and
``softmax_lse``, by keyword (:func:`~dilated.backends._signature.call_by_name`): its positional
signature changed across 2.x releases, and since 2.7 it is a ``torch.library`` custom op
(``flashattn::_flash_attn_backward``, filling ``dq``, ``dk``, ``dv`` in place) whose parameter
names come from the op schema. GQA is native. Causal in flash-attn >= 2.1 is bottom-right aligned;
only square causal problems are passed.

Tested on CPU against stand-ins registered with the real signatures (``tests/backends/test_backends.py``);
not run against an installed flash-attn 2. Where it is not installed it reports itself unavailable.
"""
from __future__ import annotations

import torch

from ._signature import call_by_name
from .base import Backend, cuda_library_reason, head_dim_reason, needs_half


def _import():
    import flash_attn  # noqa: F401
    from flash_attn import flash_attn_func
    from flash_attn.flash_attn_interface import _flash_attn_backward

    return flash_attn_func, _flash_attn_backward


class FlashAttn2Backend(Backend):
    name = "flash_attn"
    native_gqa = True

    def unavailable_reason(self, device):
        return cuda_library_reason(device, "flash-attn 2", _import)

    def input_reason(self, q, k, causal):
        return needs_half(q, "flash-attn") or head_dim_reason(q.shape[-1], "flash-attn")

    def forward(self, q, k, v, causal, scale):
        fwd, _ = _import()
        out, lse, _ = fwd(q, k, v, softmax_scale=scale, causal=causal, return_attn_probs=True)
        return out, lse.float()

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        _, bwd = _import()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        call_by_name(bwd, dict(
            dout=dout.contiguous(), q=q, k=k, v=v, out=out.contiguous(), softmax_lse=lse.contiguous(),
            dq=dq, dk=dk, dv=dv, dropout_p=0.0, softmax_scale=scale, causal=causal,
            window_size=(-1, -1), window_size_left=-1, window_size_right=-1, softcap=0.0,
            alibi_slopes=None, deterministic=False, rng_state=None),
            required=("dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "softmax_scale", "causal"))
        return dq, dk, dv
