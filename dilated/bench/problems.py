"""What a benchmarked implementation computes: its inputs, FLOPs, least memory traffic and reference.

An :class:`~dilated.bench.registry.Implementation` names one of these; the harness asks it, never
the implementation's type, how to make inputs, count work and check the result. A new kind of
thing to benchmark is a new :class:`Problem` subclass registered in :data:`PROBLEMS`.

* :class:`DenseAttention` – ``f(q, k, v)``, exact (optionally causal) attention.
* :class:`DilatedAttention` – ``f(q, k, v)``, LongNet dilated attention over ``case``'s schedule.
* :class:`ResidueMajorDilatedAttention` – the same on q, k, v in the schedule's residue-major order.
* :class:`SelfAttentionLayer` – ``f(x)`` on ``[B, N, E]``, a layer with projections around dilated
  attention; the layer itself says how it projects (``model.project(x)`` gives q, k, v and
  ``model.output(attn)`` the layer's output), so the reference runs the same projections in float64.
"""
from __future__ import annotations

import copy

import torch

import dilated
from dilated.reference import dense_reference, dilated_bias, sampled_reference

from . import flops as F
from .documents import attended_pairs, cu_seqlens_of


def _documents(case) -> list[tuple[int, int]]:
    """The ``(start, end)`` of each packed document of ``case`` (one, the whole sequence, without)."""
    cu = cu_seqlens_of(case.documents, case.seq_len) if case.documents else (0, case.seq_len)
    return list(zip(cu, cu[1:]))


def device_generator(gen: torch.Generator, device) -> torch.Generator:
    """A generator on ``device`` seeded from ``gen``: inputs are made where they live (a 4M-token
    q in float32 would be 32 GB of host memory), reproducibly for a given seed and device type."""
    seed = int(torch.randint(0, 2 ** 62, (1,), generator=gen))
    return torch.Generator(device=device).manual_seed(seed)


def _from_captured(captured: dict, keys: tuple, case, device, requires_grad: bool, what: str):
    if not set(keys) <= captured.keys():
        raise NotImplementedError(f"captured inputs hold {sorted(captured)}; {what} needs {', '.join(keys)}")
    return tuple(captured[k].detach().to(device=device, dtype=case.torch_dtype).requires_grad_(requires_grad)
                 for k in keys)


class DenseAttention:
    """Exact attention ``softmax(q k^T * scale) v`` on ``[B, N, H, D]`` q, k, v (GQA: fewer kv heads)."""

    name = "dense"
    #: the case carries a dilated schedule (segment lengths and dilation rates)
    needs_schedule = False

    def inputs(self, case, device, gen: torch.Generator, requires_grad: bool, captured: dict | None = None):
        """Seeded random q, k, v (q and k times ``case.input_scale``), or ``captured`` tensors."""
        if captured is not None:
            return _from_captured(captured, ("q", "k", "v"), case, device, requires_grad, f"a {self.name} problem")
        dev_gen = device_generator(gen, device)

        def r(*shape):
            return torch.randn(*shape, generator=dev_gen, device=device, dtype=case.torch_dtype)

        s = case.input_scale
        q = r(case.batch, case.nq, case.num_heads, case.head_dim) * s
        k = r(case.batch, case.seq_len, case.kv_heads, case.head_dim) * s
        v = r(case.batch, case.seq_len, case.kv_heads, case.dv)
        return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))

    def flops(self, case, mode: str) -> float:
        if case.documents:  # the attended area only: within documents
            pairs = attended_pairs(cu_seqlens_of(case.documents, case.seq_len), case.causal)
            return 2.0 * case.batch * case.num_heads * pairs * (case.head_dim + case.dv) * F.MODE_FACTOR[mode]
        return F.dense_flops(case.batch, case.num_heads, case.nq, case.seq_len, case.head_dim, case.causal, mode,
                             case.dv)

    def min_bytes(self, case, mode: str) -> float:
        elem = torch.empty((), dtype=case.torch_dtype).element_size()
        return F.min_bytes(case.batch, case.nq, case.seq_len, case.num_heads, case.kv_heads, case.head_dim, elem, mode,
                           case.dv)

    def score_matrix_bytes(self, case) -> float | None:
        """What materialising the attention scores would take (how much a fused kernel avoids)."""
        elem = torch.empty((), dtype=case.torch_dtype).element_size()
        return case.batch * case.num_heads * case.nq * case.seq_len * elem

    def kernel_floor(self, inputs, case, backend: str):
        """A step running only the backend kernel calls this problem needs, or None where there is
        no such floor (see :mod:`dilated.bench.floor`)."""
        return None

    def one_call_floor(self, inputs, case, backend: str):
        """``(step, [(batch, rows)] per call)``: the same attention rows as one dense call per row
        count, or None."""
        return None

    def qkv(self, case, inputs, model):
        """The q, k, v the attention reads."""
        return inputs

    def reference(self, case, inputs, model, dtype=torch.float64):
        """Full reference output (differentiable in ``inputs`` when they require grad); with
        documents, each document alone."""
        q, k, v = (t.to(dtype) for t in self.qkv(case, inputs, model))
        return torch.cat([dense_reference(q[:, a:b], k[:, a:b], v[:, a:b], causal=case.causal, dtype=dtype)[0]
                          for a, b in _documents(case)], 1)

    def sampled_reference(self, case, inputs, model, rows, dout=None):
        """Reference output at query ``rows`` only, streaming over keys (for long sequences); with
        ``dout`` (the output's gradient), ``(out, dq)`` of those rows (dq None where the inputs are
        not q, k, v)."""
        with torch.no_grad():
            q, k, v = self.qkv(case, inputs, model)
            if not case.documents:
                return sampled_reference(q, k, v, rows, causal=case.causal, dout=dout)
            rows = torch.as_tensor(rows)
            out = dq = None
            for a, b in _documents(case):  # each row against its own document's keys
                mine = (rows >= a) & (rows < b)
                if mine.any():
                    part = sampled_reference(q[:, a:b], k[:, a:b], v[:, a:b], rows[mine] - a, causal=case.causal,
                                             dout=None if dout is None else dout[:, a:b])
                    part, part_dq = part if dout is not None else (part, None)
                    at = mine.to(part.device)
                    out = part.new_zeros(part.shape[0], len(rows), *part.shape[2:]) if out is None else out
                    out[:, at] = part
                    if part_dq is not None:
                        dq = part_dq.new_zeros(part_dq.shape[0], len(rows), *part_dq.shape[2:]) if dq is None else dq
                        dq[:, at] = part_dq
            return out if dout is None else (out, dq)


class DilatedAttention(DenseAttention):
    """LongNet dilated attention of q, k, v over ``case.segment_lengths`` / ``case.dilation_rates``."""

    name = "dilated"
    needs_schedule = True

    def flops(self, case, mode: str) -> float:
        return F.dilated_flops(case.batch, case.num_heads, case.seq_len, case.head_dim, case.segment_lengths,
                               case.dilation_rates, case.causal, mode)

    def score_matrix_bytes(self, case) -> float | None:
        return None

    def kernel_floor(self, inputs, case, backend: str):
        from .floor import kernel_floor_step

        return kernel_floor_step(*inputs, case.segment_lengths, case.dilation_rates, case.causal, backend, case.mode)

    def one_call_floor(self, inputs, case, backend: str):
        from .floor import one_call_floor_step

        return one_call_floor_step(*inputs, case.segment_lengths, case.dilation_rates, case.causal, backend,
                                   case.mode)

    def reference(self, case, inputs, model, dtype=torch.float64):
        q, k, v = (t.to(dtype) for t in self.qkv(case, inputs, model))
        bias = dilated_bias(case.seq_len, case.num_heads, case.segment_lengths, case.dilation_rates, case.causal,
                            q.device, dtype)
        return dense_reference(q, k, v, bias=bias, dtype=dtype)[0]

    def sampled_reference(self, case, inputs, model, rows, dout=None):
        with torch.no_grad():
            q, k, v = self.qkv(case, inputs, model)
            return sampled_reference(q, k, v, rows, causal=case.causal, segment_lengths=case.segment_lengths,
                                     dilation_rates=case.dilation_rates, dout=dout)


class ResidueMajorDilatedAttention(DilatedAttention):
    """Dilated attention of q, k, v that lie in the schedule's residue-major order
    (``layout="residue_major"``, :mod:`dilated.longnet.residue_major`): the same work and FLOPs, the
    reference in that order. No kernel floor: on a block-sparse kernel the step is one call."""

    name = "dilated_residue_major"

    def kernel_floor(self, inputs, case, backend: str):
        return None

    def _natural(self, case, tensors):
        return [dilated.from_residue_major(t, case.segment_lengths, case.dilation_rates) for t in tensors]

    def reference(self, case, inputs, model, dtype=torch.float64):
        out = super().reference(case, self._natural(case, self.qkv(case, inputs, model)), model, dtype)
        return dilated.to_residue_major(out, case.segment_lengths, case.dilation_rates)

    def sampled_reference(self, case, inputs, model, rows, dout=None):
        with torch.no_grad():
            q, k, v = self._natural(case, self.qkv(case, inputs, model))
            dout = None if dout is None else self._natural(case, [dout])[0]
            at = dilated.residue_major_positions(case.seq_len, case.segment_lengths, case.dilation_rates,
                                                 torch.as_tensor(rows).device)[torch.as_tensor(rows)]
            return sampled_reference(q, k, v, at, causal=case.causal, segment_lengths=case.segment_lengths,
                                     dilation_rates=case.dilation_rates, dout=dout)


class SelfAttentionLayer(DilatedAttention):
    """A self-attention layer on ``x`` ``[B, N, num_heads * head_dim]``: the model's projections
    (``model.project(x) -> q, k, v`` and ``model.output(attn) -> y``) around dilated attention."""

    name = "module"

    def inputs(self, case, device, gen, requires_grad, captured=None):
        if captured is not None:
            return _from_captured(captured, ("x",), case, device, requires_grad, "a self-attention layer")
        x = torch.randn(case.batch, case.seq_len, case.num_heads * case.head_dim, generator=device_generator(gen, device),
                        device=device, dtype=case.torch_dtype) * case.input_scale
        return (x.requires_grad_(requires_grad),)

    def flops(self, case, mode: str) -> float:
        e, kv = case.num_heads * case.head_dim, case.kv_heads * case.head_dim
        linear_factor = {"fwd": 1.0, "bwd": 2.0, "fwd_bwd": 3.0}[mode]  # dX and dW in backward
        return super().flops(case, mode) + 2.0 * case.batch * case.seq_len * e * (2 * e + 2 * kv) * linear_factor

    def kernel_floor(self, inputs, case, backend):
        return None

    def one_call_floor(self, inputs, case, backend):
        return None

    def qkv(self, case, inputs, model):
        return model.project(inputs[0])

    def reference(self, case, inputs, model, dtype=torch.float64):
        model = copy.deepcopy(model).to(dtype)
        inputs = tuple(t.to(dtype) for t in inputs)
        return model.output(super().reference(case, inputs, model, dtype))

    def sampled_reference(self, case, inputs, model, rows, dout=None):
        out = super().sampled_reference(case, inputs, model, rows)
        with torch.no_grad():  # the output projection (and sub-LN) of the sampled rows in float64 too
            out = copy.deepcopy(model).to(out.dtype).output(out)
        return out if dout is None else (out, None)  # the gradient is x's, through the projections


#: the problems by name (an implementation may name one instead of passing it)
PROBLEMS = {p.name: p for p in (DenseAttention(), DilatedAttention(), ResidueMajorDilatedAttention(),
                                 SelfAttentionLayer())}


def problem_named(problem) -> DenseAttention:
    """``problem`` itself, or the registered problem of that name."""
    if isinstance(problem, str):
        if problem not in PROBLEMS:
            raise ValueError(f"unknown problem {problem!r}; choose from: {', '.join(PROBLEMS)}")
        return PROBLEMS[problem]
    return problem
