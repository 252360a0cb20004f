"""``sdpa_fp8``: FP8 attention (float8_e4m3fn q, k, v with per-head descale factors) through
PyTorch's ``torch.nn.attention.experimental._scaled_dot_product_attention_quantized``, which runs
flash-attn 3's FP8 forward kernel (Hopper) once torch's FA3 flash implementation is active. A
quantized kernel: forward only, not exact (its error against float64 is in every benchmark row),
never chosen by ``auto``; no log-sum-exp (dense forward only, as SageAttention 1.x).

Inputs in bf16/fp16 are quantized here per (batch, head): ``descale = amax / 448`` (the largest
e4m3 value), ``x8 = x / descale``. FA3 is activated for the call and the previous flash
implementation restored after it (torch's switch is process-wide). Tested on CPU against a
stand-in of the quantized function (``tests/backends/test_kernel_adapters.py``); not run on a GPU.
"""
from __future__ import annotations

import contextlib
import importlib.util

import torch

from .base import Backend, cuda_library_reason, needs_half

E4M3_MAX = 448.0


def _quantized():
    from torch.nn.attention.experimental._scaled_dot_product_attention_quantized import (
        _scaled_dot_product_attention_quantized)

    return _scaled_dot_product_attention_quantized


@contextlib.contextmanager
def _fa3_active():
    """torch's SDPA flash kernel from flash-attn 3 for the block, the previous one after it."""
    from torch.nn.attention import (activate_flash_attention_impl, current_flash_attention_impl,
                                    restore_flash_attention_impl)

    before = current_flash_attention_impl()
    if before != "FA3":
        activate_flash_attention_impl("FA3")
    try:
        yield
    finally:
        if before is None:
            restore_flash_attention_impl()
        elif before != "FA3":
            activate_flash_attention_impl(before)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[B, N, H, D]`` as float8_e4m3fn ``[B, H, N, D]`` and its descale ``[B, H]`` (float32)."""
    xt = x.transpose(1, 2).float()
    descale = xt.abs().amax(dim=(2, 3)).clamp_min(1e-12) / E4M3_MAX
    return (xt / descale[:, :, None, None]).to(torch.float8_e4m3fn), descale


class SdpaFp8Backend(Backend):
    name = "sdpa_fp8"
    native_gqa = False
    supports_backward = False

    def unavailable_reason(self, device):
        reason = cuda_library_reason(device, "FP8 attention", _quantized)  # torch's quantized SDPA
        if reason is not None:
            return reason
        from torch.nn.attention import list_flash_attention_impls

        if "FA3" not in list_flash_attention_impls():
            return "torch's FA3 flash implementation is not registered (flash-attn 3's FP8 kernel runs the FP8 path)"
        if importlib.util.find_spec("flash_attn_interface") is None:
            return ("torch runs FP8 attention on flash-attn 3's kernel, and flash-attn 3 (flash_attn_interface, "
                    "the hopper build) is not installed")
        if torch.cuda.get_device_capability(device) != (9, 0):
            return "flash-attn 3's FP8 forward runs on Hopper (sm90) only"
        return None

    def input_reason(self, q, k, causal):
        if q.shape[-1] > 256 or q.shape[-1] % 16:
            return f"FP8 flash attention needs head_dim a multiple of 16 up to 256, got {q.shape[-1]}"
        return needs_half(q, "FP8 attention (quantized from)")

    def forward(self, q, k, v, causal, scale):
        (q8, dq), (k8, dk), (v8, dv) = quantize(q), quantize(k), quantize(v)
        with _fa3_active():
            out = _quantized()(q8, k8, v8, is_causal=causal, scale=scale, q_descale=dq, k_descale=dk,
                               v_descale=dv)
        return out.transpose(1, 2).to(q.dtype), None
