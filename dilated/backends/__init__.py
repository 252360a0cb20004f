"""Registry of local attention kernels.

Every backend implements :class:`~dilated.backends.base.Backend`. Whether one *works* on a device
is decided by a tiny real forward+backward call there (cached per device), not by an import:
a wheel can import and still fail every call.

``auto`` takes, among the backends that work on the device and accept the inputs (dtype,
head_dim), the fastest for the inputs' shape class on CUDA, found by a short measurement cached
per process and on disk (:mod:`dilated.backends.auto`), and the first in the order below on CPU
(or with ``DILATED_AUTO=order``). On CUDA the order follows measured forward throughput on Hopper
(docs/performance-log.md), with flash-attn 3/4 first where installed:

    CUDA: flash_attn_3, flash_attn_4, sdpa_cudnn, flash_attn, flex, sdpa_flash,
          sdpa_efficient, xformers, sdpa, sdpa_math, manual
    CPU:  sdpa_flash, sdpa, sdpa_math, manual
"""
from __future__ import annotations

import torch

from . import auto
from .base import Backend, autograd_on
from .flash_attn import FlashAttn2Backend
from .flash_attn_3 import FlashAttn3Backend
from .flash_attn_4 import FlashAttn4Backend
from .flex import FlexBackend
from .manual import ManualBackend
from .sageattention import SageAttentionBackend
from .sdpa_fp8 import SdpaFp8Backend
from .sdpa import BACKENDS as _SDPA_BACKENDS
from .xformers import XFormersBackend

AUTO_ORDER = {
    "cuda": ["flash_attn_3", "flash_attn_4", "sdpa_cudnn", "flash_attn", "flex", "sdpa_flash",
             "sdpa_efficient", "xformers", "sdpa", "sdpa_math", "manual"],
    "cpu": ["sdpa_flash", "sdpa", "sdpa_math", "manual"],
}

_REGISTRY: dict[str, Backend] = {}
_PROBES: dict[tuple[str, str], str | None] = {}


class BackendUnavailableError(RuntimeError):
    """Asked for a backend that does not work on this device or for these inputs."""


def register_backend(backend: Backend) -> Backend:
    """Add a backend to the registry (users may register their own kernels)."""
    _REGISTRY[backend.name] = backend
    return backend


for _b in [*_SDPA_BACKENDS, FlexBackend(), FlashAttn2Backend(), FlashAttn3Backend(),
           FlashAttn4Backend(), XFormersBackend(), SageAttentionBackend(), SdpaFp8Backend(), ManualBackend()]:
    register_backend(_b)


def backend_names() -> list[str]:
    return list(_REGISTRY) + ["auto"]


def _device(device) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must name a torch device (cpu, cuda, cuda:1, ...), got {device!r}") from None
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def _probe(backend: Backend, device: torch.device) -> str | None:
    """A tiny real forward and backward on ``device``; None if it ran and gave finite numbers.
    Its answer is kept for the process, so it runs with autograd on whatever the caller's mode
    (``torch.inference_mode``, ``no_grad``, a custom op's implementation, so a compiled graph's
    runtime): a backward through autograd would otherwise fail there and mark the backend
    unavailable for good."""
    reason = backend.unavailable_reason(device)
    if reason is not None:
        return reason
    with autograd_on():
        return _probe_calls(backend, device)


def _probe_calls(backend: Backend, device: torch.device) -> str | None:
    dtype = backend.probe_dtype(device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(1, 16, 2, 64, generator=gen).to(device=device, dtype=dtype) for _ in range(3))
    scale = 64 ** -0.5
    try:
        out, lse = backend.forward(q, k, v, True, scale)
        if backend.supports_backward:
            grads = backend.backward(torch.randn_like(out), q, k, v, out, lse, True, scale)
            if not all(torch.isfinite(g).all() for g in grads):
                return "probe backward gave non-finite gradients"
        if not (torch.isfinite(out).all() and (lse is None or torch.isfinite(lse).all())):
            return "probe forward gave non-finite output"
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as e:  # any failure of a real call means "not available", with its reason
        return _one_line(e)
    return None


def backend_reason(name: str, device=None) -> str | None:
    device = _device(device)
    if name not in _REGISTRY:
        return f"unknown backend {name!r}; known: {', '.join(backend_names())}"
    key = (name, str(device))
    if key not in _PROBES:
        _PROBES[key] = _probe(_REGISTRY[name], device)
    return _PROBES[key]


def available_backends(device=None) -> dict[str, str | None]:
    """For every backend (and ``auto``): None if it works on ``device``, else the reason in one line."""
    device = _device(device)
    report = {name: backend_reason(name, device) for name in _REGISTRY}
    order = AUTO_ORDER.get(device.type, AUTO_ORDER["cpu"])
    working = [n for n in order if report.get(n) is None]
    report["auto"] = None if working else "no backend works on this device"
    return report


def _input_reason(backend: Backend, q, k, v, causal) -> str | None:
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v))
    if needs_grad and not backend.supports_backward:
        return f"{backend.name} has no backward (forward only); the inputs require grad"
    reason = backend.input_reason(q, k, causal)
    if reason is None and v is not None:
        reason = backend.value_head_dim_reason(q, v)
    return reason


def get_backend(name: str, q: torch.Tensor | None = None, k: torch.Tensor | None = None,
                causal: bool = False, device=None, v: torch.Tensor | None = None) -> Backend:
    """Resolve ``name`` (or ``auto``) to a backend that works here and accepts ``q``/``k`` (and
    ``v``'s head_dim, where given)."""
    device = _device(q.device if q is not None else device)
    if name == "auto":
        order = AUTO_ORDER.get(device.type, AUTO_ORDER["cpu"])
        candidates = [_REGISTRY[n] for n in order if backend_reason(n, device) is None
                      and (q is None or _input_reason(_REGISTRY[n], q, k, v, causal) is None)]
        if not candidates:
            raise BackendUnavailableError(f"backend 'auto': no backend works on {device} for these inputs")
        return candidates[0] if q is None else auto.fastest(candidates, q, k, v, causal)
    if name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}; choose one of: {', '.join(backend_names())}")
    reason = backend_reason(name, device)
    if reason is None and q is not None:
        reason = _input_reason(_REGISTRY[name], q, k, v, causal)
    if reason is not None:
        ok = [n for n, r in available_backends(device).items() if r is None]
        raise BackendUnavailableError(
            f"backend {name!r} is not available on {device}: {reason}. Available here: {', '.join(ok)}")
    return _REGISTRY[name]


from .kernel_log import record_kernels  # noqa: E402

__all__ = ["Backend", "BackendUnavailableError", "available_backends", "get_backend",
           "register_backend", "backend_names", "backend_reason", "AUTO_ORDER", "record_kernels"]
