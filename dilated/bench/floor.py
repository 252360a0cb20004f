"""Two floors of dilated attention, each timed in turns with the step (``RunOptions.floor``) so the
ratios are not the machine's drift:

* the kernel floor (:func:`kernel_floor_step`): the backend's attention calls of the step's plan
  alone (the same calls: in place where the kernel reads strided rows, taken in turns by the
  same CUDA streams, :mod:`dilated.longnet.call_streams`), on segment tensors
  gathered beforehand (no gather, no merge, no scatter, no launch of anything but
  the kernels): ``ImprovedDilatedAttention``'s time over it is what its own machinery costs;
* the one-call floor (:func:`one_call_floor_step`): the same rows as one dense call per distinct
  row count, every call's heads folded into the batch (``[sum of B' * h, rows, 1, D]``). Where every
  call of the schedule has one row count (LongNet's, ``w_i / r_i`` constant) that is a single
  call: the best the kernel does on this much work in one launch, whatever the plan.
"""
from __future__ import annotations

import torch

from dilated.backends import get_backend
from dilated.longnet.call_streams import call_streams
from dilated.dense import attention_backward, attention_forward, default_scale
from dilated.longnet.rows import gather
from dilated.longnet.plan import build_plan, plan_for


def _prepared(impl, qb, kb, vb, causal: bool, scale: float, mode: str) -> tuple:
    """One call's tensors for the floor's step: its inputs, and for a backward its output, lse and
    a random incoming gradient."""
    if mode == "fwd":
        return qb, kb, vb, None, None, None
    o, lse = attention_forward(impl, qb, kb, vb, causal, scale)
    return qb, kb, vb, o, lse, torch.randn_like(o)


def _step(impl, calls, causal: bool, scale: float, mode: str):
    """A callable running each prepared call's forward and/or backward in ``mode``, nothing else."""
    def in_turns(run):  # the calls taken in turns by the step's streams, as the step takes them
        with call_streams(calls[0][0].device, len(calls)) as turn:
            for i, call in enumerate(calls):
                with turn(i):
                    run(*call)

    def step():
        with torch.no_grad():
            if mode != "bwd":
                in_turns(lambda qb, kb, vb, *_: attention_forward(impl, qb, kb, vb, causal, scale))
            if mode != "fwd":
                in_turns(lambda qb, kb, vb, o, lse, do: attention_backward(impl, do, qb, kb, vb, o, lse, causal, scale))

    return step


def kernel_floor_step(q, k, v, segment_lengths, dilation_rates, causal: bool, backend: str, mode: str):
    """A callable running exactly the kernel calls of one ``ImprovedDilatedAttention`` step in
    ``mode`` (``fwd``: forwards; ``fwd_bwd``/``bwd``: forwards and/or backwards) on pre-gathered
    branch tensors."""
    impl = get_backend(backend, q, k, causal)  # as the step resolves it (gradients included)
    with torch.no_grad():
        q, k, v = q.detach(), k.detach(), v.detach()
        scale = default_scale(q.shape[-1], None)
        # the step's own plan: a kernel that reads strided rows makes more, smaller calls in place
        plan = plan_for(q, k, segment_lengths, dilation_rates, impl.reads_strided_rows(q, k, causal))
        calls = [_prepared(impl, *(x.contiguous() for x in gather(c, (q, k, v), (False, True, True))[0]), causal,
                           scale, mode) for c in plan]
    return _step(impl, calls, causal, scale, mode)


def one_call_floor_step(q, k, v, segment_lengths, dilation_rates, causal: bool, backend: str, mode: str):
    """A callable running the plan's attention rows as one dense call per distinct row count
    (heads folded into the batch; GQA kv heads repeated), in ``mode``; and each call's
    ``(batch, rows)``."""
    impl = get_backend(backend, q, k, causal)  # the step's kernel, not one resolved for the folded shape
    with torch.no_grad():
        q, k, v = q.detach(), k.detach(), v.detach()
        scale = default_scale(q.shape[-1], None)
        plan = build_plan(q.shape[1], q.shape[2], k.shape[2], segment_lengths, dilation_rates, q.device)
        by_rows = {}
        for c in plan:
            qb, kb, vb = (x.contiguous() for x in gather(c, (q, k, v), (False, True, True))[0])
            g = qb.shape[2] // kb.shape[2]
            kb, vb = (x.repeat_interleave(g, 2) if g > 1 else x for x in (kb, vb))
            folded = [x.transpose(1, 2).reshape(-1, x.shape[1], 1, x.shape[3]) for x in (qb, kb, vb)]
            by_rows.setdefault(qb.shape[1], []).append(folded)
        calls = [_prepared(impl, *(torch.cat([p[i] for p in parts]) for i in range(3)), causal, scale, mode)
                 for parts in by_rows.values()]
    return _step(impl, calls, causal, scale, mode), [(qf.shape[0], qf.shape[1]) for qf, *_ in calls]
