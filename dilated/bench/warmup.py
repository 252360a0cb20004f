"""A process's warm-up: before its first timed row, each backend a sweep will use runs on tiny
inputs of the rows' head shapes, dtype, masking and mode, on the rows' device.

The first call of a process pays for what no steady call pays again: CUDA and cuDNN start-up,
``auto``'s measurement of its candidates, kernels compiled per configuration (Triton, flash-attn
4). Done here, a row's first call is only that row's own first call, so that a row bounded by
``--time-budget`` reaches its warm, timed calls. A row whose only sample is still its first call
says so (``first_call_only``) and no derived figure uses it (:func:`dilated.bench.results.trusted`).
"""
from __future__ import annotations

import time

import torch

import dilated

from .progress import checkpoint

#: tokens of the warm-up's tiny inputs
WARMUP_TOKENS = 256

_warmed: set = set()  # (device, backend, dtype, heads, kv heads, head dims, causal, backward) this process ran


def _key(case, backend: str, device) -> tuple:
    return (str(device), backend, case.dtype, case.num_heads, case.kv_heads, case.head_dim, case.dv, case.causal,
            case.mode != "fwd")


def warm_up(jobs, device) -> dict | None:
    """Run each backend of ``jobs`` (``(implementation, case, backend, ...)``) not yet warmed in this
    process once on tiny inputs; returns what ran (seconds, configurations, and those that raised,
    with their error: the rows will say why for themselves), or None where nothing was new."""
    device = torch.device(device)
    todo = {}
    for _, case, backend, *_ in jobs:
        key = _key(case, backend, device)
        if key not in _warmed:
            todo.setdefault(key, (case, backend))
    if not todo:
        return None
    t0 = time.perf_counter()
    failed = {}
    for key, (case, backend) in todo.items():
        _warmed.add(key)
        checkpoint(f"process warm-up: {backend} {case.dtype} H={case.num_heads}/{case.kv_heads} D={case.head_dim}")
        try:
            _tiny_call(case, backend, device)
        except Exception as e:  # noqa: BLE001 - recorded here; the rows that use it report it themselves
            failed[f"{backend} {case.dtype} H={case.num_heads}/{case.kv_heads} D={case.head_dim}"] = \
                f"{type(e).__name__}: {str(e)[:160]}"
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {"seconds": time.perf_counter() - t0, "configurations": len(todo), "failed": failed}


def _tiny_call(case, backend: str, device) -> None:
    """One forward (and backward, where the rows take one) of dense attention through ``backend``."""
    dtype, grad = case.torch_dtype, case.mode != "fwd"

    def r(h, d):
        return torch.randn(1, WARMUP_TOKENS, h, d, device=device, dtype=dtype, requires_grad=grad)

    q, k, v = r(case.num_heads, case.head_dim), r(case.kv_heads, case.head_dim), r(case.kv_heads, case.dv)
    with torch.enable_grad() if grad else torch.no_grad():
        out = dilated.attention(q, k, v, causal=case.causal, backend=backend)
        if grad:
            out.sum().backward()
