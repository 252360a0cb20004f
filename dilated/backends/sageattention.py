"""``sageattention``: SageAttention (``pip install sageattention``; 1.0.6 is Triton, INT8 Q·K with
per-block scales, fp16 P·V), a quantized kernel: forward only, and not exact (its error against
float64 is in every benchmark row). Never chosen by ``auto``; name it to use it.

``sageattn(q, k, v, tensor_layout="NHD", is_causal=..., sm_scale=...)`` takes ``[B, N, H, D]`` as
is. SageAttention 2 returns the log-sum-exp with ``return_lse=True``; 1.x has no such argument and
returns the output alone, so with 1.x this backend serves dense attention whose lse nobody needs
(``dilated.attention`` without ``return_lse``, no merge): dilated, ring and causal pieces of
``seq_q != seq_k`` need the lse and say so. SageAttention 1.0.6's non-causal kernel gives wrong
outputs when seq_k is not a multiple of its key block (64): it loads the padding keys as zeros
but does not mask their scores, so each counts as a score of 0 in the softmax; such inputs are
refused with that reason (seen on an H200; its causal kernel masks them).
"""
from __future__ import annotations

from ._signature import call_by_name, parameters
from .base import Backend, cuda_library_reason, needs_half


#: SageAttention 1.x's key block (BLOCK_N of ``attn_qk_int8_per_block``)
KEY_BLOCK = 64


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sageattention")
    except PackageNotFoundError:
        return "unknown"


def _import():
    from sageattention import sageattn

    return sageattn


class SageAttentionBackend(Backend):
    name = "sageattention"
    native_gqa = False
    supports_backward = False

    def unavailable_reason(self, device):
        return cuda_library_reason(device, "SageAttention (sageattention)", _import)

    def input_reason(self, q, k, causal):
        if q.shape[-1] not in (64, 96, 128):
            return f"SageAttention takes head_dim 64, 96 or 128, got {q.shape[-1]}"
        if not causal and k.shape[1] % KEY_BLOCK and _version().startswith("1."):
            return (f"SageAttention {_version()}'s non-causal kernel counts the zero-padded keys of a last partial "
                    f"block of {KEY_BLOCK} in its softmax (it masks the loads, not the scores), so its seq_k must be "
                    f"a multiple of {KEY_BLOCK}, got {k.shape[1]}; pad the keys or use another backend")
        return needs_half(q, "SageAttention")

    def forward(self, q, k, v, causal, scale):
        sageattn = _import()
        gives_lse = "return_lse" in parameters(sageattn)
        result = call_by_name(sageattn, dict(q=q, k=k, v=v, tensor_layout="NHD", is_causal=causal, sm_scale=scale,
                                             return_lse=gives_lse),
                              required=("q", "k", "v", "tensor_layout", "is_causal", "sm_scale"))
        if gives_lse:
            out, lse = result
            return out, lse.float()
        return result, None  # no log-sum-exp from SageAttention 1.x
