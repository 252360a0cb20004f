"""The kernel floor of dilated attention: the backend's attention calls alone, on segment tensors
gathered beforehand, with nothing else (no gather, no merge, no scatter, no launch of anything
but the kernels). ``ImprovedDilatedAttention``'s time over this floor is what its own machinery
costs; the harness times both in one process (``RunOptions.floor``) so the ratio is not noise.
"""
from __future__ import annotations

import torch

from dilated.backends import get_backend
from dilated.functional import attention_backward, attention_forward, default_scale
from dilated.rows import gather
from dilated.plan import build_plan


def kernel_floor_step(q, k, v, segment_lengths, dilation_rates, causal: bool, backend: str, mode: str):
    """A callable running exactly the kernel calls of one ``ImprovedDilatedAttention`` step in
    ``mode`` (``fwd``: forwards; ``fwd_bwd``/``bwd``: forwards and/or backwards) on pre-gathered
    branch tensors."""
    with torch.no_grad():
        q, k, v = q.detach(), k.detach(), v.detach()
        impl = get_backend(backend, q, k, causal)
        scale = default_scale(q.shape[-1], None)
        plan = build_plan(q.shape[1], q.shape[2], k.shape[2], segment_lengths, dilation_rates, q.device)
        calls = []
        for c in plan:
            qb, kb, vb = (x.contiguous() for x in gather(c, (q, k, v), (False, True, True))[0])
            if mode == "fwd":
                calls.append((qb, kb, vb, None, None, None))
                continue
            o, lse = attention_forward(impl, qb, kb, vb, causal, scale)
            calls.append((qb, kb, vb, o, lse, torch.randn_like(o)))

    def step():
        with torch.no_grad():
            for qb, kb, vb, o, lse, do in calls:
                if mode != "bwd":
                    attention_forward(impl, qb, kb, vb, causal, scale)
                if mode != "fwd":
                    attention_backward(impl, do, qb, kb, vb, o, lse, causal, scale)

    return step
