"""Kernels' own varlen entry points: packed ``[T, H, D]`` rows whose documents are given by int32
cumulative lengths (``cu_seqlens``, the flash-attn varlen convention), all documents in one call.

A :class:`VarlenKernel` has a forward ``(out [T, H, D], lse [H, T] float32)`` and a backward that
takes the (merged) ``out`` and ``lse`` like the dense backends' backward, so ring attention can
call it on its merged results. Two kernels:

* ``torch``: torch's varlen flash kernel, the ``torch_attn::_varlen_attn`` and
  ``torch_attn::_varlen_attn_backward`` ops behind ``torch.nn.attention.varlen``: the varlen entry
  point of ``sdpa_flash`` (and of ``auto`` where that resolves to it). Its arguments changed across
  releases (``is_causal`` or ``window_size``, ``scale``, ``enable_gqa``): they are passed by the
  names in the op's schema.
* ``flash_attn_4``: flash-attn 4's ``_flash_attn_fwd`` / ``_flash_attn_bwd`` with
  ``cu_seqlens_q`` / ``cu_seqlens_k`` (GQA native; its backward takes ``dlse``); faster than the
  batched dense calls per document length (docs/performance-log.md).

The gradient of lse (``dlse``) is part of the backward: flash-attn 4 takes it, torch's op does not
(its autograd drops it), so there it is one more backward pass with a unit ``v`` (see
:func:`dilated.dense.lse_gradient`).

torch's varlen flash backward indexes its float32 dq accumulator, ``heads x (rows + 128 x
documents) x head_dim`` (rounded up) elements, with 32-bit integers, as the dense one does
(:data:`dilated.backends.sdpa.FLASH_BACKWARD_MAX`): beyond 2**31 it reads and writes out of bounds
(an illegal memory access on an H200, torch 2.11, at 1M tokens of short documents in one call).
Such calls run in slices of the heads, in whole GQA groups, that stay within it
(:func:`accumulator_head_slices`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ._signature import call_by_name, parameters
from ..dense import lse_gradient
from .base import expand_kv_heads, reduce_kv_heads
from .sdpa import FLASH_BACKWARD_MAX


@dataclass(frozen=True)
class VarlenCall:
    """The documents and flags of one varlen call: int32 cumulative lengths of the q and kv rows
    (on the inputs' device), the longest document of each, causal (within each document, top-left
    aligned as the documents' q and kv rows coincide) and the softmax scale."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    causal: bool
    scale: float


def _lse_rows_last(lse: torch.Tensor, t: int, h: int) -> torch.Tensor:
    """A kernel's lse as ``[H, T]`` in float32 or wider (releases return ``[H, T]``, ``[T, H]`` or
    ``[H, T, 1]``)."""
    if lse.dim() == 3 and lse.shape[-1] == 1:
        lse = lse[..., 0]
    if lse.shape == (t, h) and lse.shape != (h, t):
        lse = lse.t()
    if lse.shape != (h, t):
        raise RuntimeError(f"the varlen kernel returned lse of shape {tuple(lse.shape)}, expected [H, T] = {(h, t)}")
    return lse if lse.dtype == torch.float64 else lse.float()


def accumulator_head_slices(rows: int, documents: int, heads: int, kv_heads: int, head_dim: int,
                            most: int | None) -> list[tuple[int, int]] | None:
    """``[(start, stop), ...]``: the fewest slices of the ``heads`` query heads, as even as whole GQA
    groups (``heads / kv_heads`` heads each) make them, whose float32 dq accumulator in a flash
    varlen backward of ``rows`` packed rows of ``documents`` documents (``(rows + 128 x documents) x
    head_dim`` rounded up, per head) stays within ``most`` elements; None where the whole call does,
    or ``most`` is None. ValueError where one group is larger."""
    if most is None:
        return None
    per_head = (rows + 128 * documents) * (-(-head_dim // 32) * 32 if head_dim <= 128 else -(-head_dim // 64) * 64)
    if heads * per_head <= most:
        return None
    group = heads // kv_heads
    if group * per_head > most:
        raise ValueError(f"torch's varlen flash backward cannot take {rows} rows of {documents} documents in one "
                         f"call of {group} head(s) sharing a kv head ({group * per_head} dq accumulator elements > "
                         f"{most}): use flash_attn_4, or fewer tokens per call")
    groups = heads // group
    count = -(-groups // (most // (group * per_head)))  # slices, as even as whole groups make them
    sizes = [(groups // count + (i < groups % count)) * group for i in range(count)]
    return [(sum(sizes[:i]), sum(sizes[:i + 1])) for i in range(count)]


class VarlenKernel:
    """A kernel's varlen forward and backward on packed ``[T, H, D]`` rows."""

    name = "varlen"
    #: the largest float32 dq accumulator (elements) its backward indexes right (None: no limit known)
    dq_accumulator_limit: int | None = None
    #: what a causal pair of its calls costs, ``(triangle, rectangle)``: a piece's own keys (a causal
    #: call) against the keys of its document before it (a rectangle, every tile full); what a
    #: :class:`~dilated.DocumentLayout` of documents this kernel attends balances (``pair_costs``)
    pair_costs: tuple = (1, 1)

    def forward(self, q, k, v, call: VarlenCall):
        """``(out [T, H, D], lse [H, T] float32)`` (float64 for float64 inputs)."""
        raise NotImplementedError

    def backward(self, dout, q, k, v, out, lse, call: VarlenCall, dlse=None):
        """``(dq, dk, dv)`` given the (merged) ``out`` and ``lse [H, T]``; ``dlse`` (``[H, T]`` or None)
        is the gradient of lse. In slices of the heads where the whole call's dq accumulator would
        pass :attr:`dq_accumulator_limit` (:func:`accumulator_head_slices`)."""
        slices = accumulator_head_slices(q.shape[0], call.cu_q.numel() - 1, q.shape[1], k.shape[1], q.shape[2],
                                         self.dq_accumulator_limit)
        if slices is None:
            return self.backward_heads(dout, q, k, v, out, lse, call, dlse)
        g = q.shape[1] // k.shape[1]
        parts = []
        for a, b in slices:
            dout_s, q_s, out_s = (x[:, a:b].contiguous() for x in (dout, q, out))
            k_s, v_s = (x[:, a // g:b // g].contiguous() for x in (k, v))
            parts.append(self.backward_heads(dout_s, q_s, k_s, v_s, out_s, lse[a:b], call,
                                             None if dlse is None else dlse[a:b]))
        return tuple(torch.cat([part[i] for part in parts], 1) for i in range(3))

    def backward_heads(self, dout, q, k, v, out, lse, call: VarlenCall, dlse=None):
        """:meth:`backward` in one call of the kernel."""
        raise NotImplementedError


def torch_varlen_ops():
    """torch's varlen forward and backward ops, or None in a torch without ``torch.nn.attention.varlen``."""
    try:
        import torch.nn.attention.varlen  # noqa: F401 - registers the torch_attn ops
        return torch.ops.torch_attn._varlen_attn, torch.ops.torch_attn._varlen_attn_backward
    except (ImportError, AttributeError, RuntimeError):
        return None


class TorchVarlen(VarlenKernel):
    name = "torch_varlen"
    dq_accumulator_limit = FLASH_BACKWARD_MAX

    def _args(self, op, call: VarlenCall, d: int) -> dict:
        params = parameters(op)
        args = dict(cu_seq_q=call.cu_q, cu_seq_k=call.cu_k, max_q=call.max_q, max_k=call.max_k, is_causal=call.causal)
        if "scale" in params:
            args["scale"] = call.scale
        elif abs(call.scale - d ** -0.5) > 1e-12 * call.scale:
            raise NotImplementedError(f"this torch's {op} takes no scale; use another backend for scale != D^-0.5")
        if "window_size" in params:
            args["window_size"] = [-1, 0] if call.causal else [-1, -1]
        return args

    def _groups(self, q, k) -> int:
        """kv head repeats this torch needs (1 where its forward takes ``enable_gqa``)."""
        groups = q.shape[1] // k.shape[1]
        return 1 if "enable_gqa" in parameters(torch_varlen_ops()[0]) else groups

    def forward(self, q, k, v, call):
        fwd, _ = torch_varlen_ops()
        groups = self._groups(q, k)
        args = dict(self._args(fwd, call, q.shape[-1]), query=q, key=expand_kv_heads(k, groups, 1),
                    value=expand_kv_heads(v, groups, 1),
                    enable_gqa=k.shape[1] != q.shape[1])
        out, lse = call_by_name(fwd, args, required=("query", "key", "value", "cu_seq_q", "is_causal"))[:2]
        return out, _lse_rows_last(lse, q.shape[0], q.shape[1])

    def backward_heads(self, dout, q, k, v, out, lse, call, dlse=None):
        _, bwd = torch_varlen_ops()
        groups = self._groups(q, k)
        ke, ve = expand_kv_heads(k, groups, 1), expand_kv_heads(v, groups, 1)
        rng = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout: the state is unused
        base = dict(self._args(bwd, call, q.shape[-1]), query=q, key=ke, lse=lse.contiguous(), rng_state=rng)
        required = ("grad_out", "query", "key", "value", "out", "lse", "cu_seq_q", "is_causal")

        def run(dout_, v_, out_):
            return call_by_name(bwd, dict(base, grad_out=dout_.contiguous(), value=v_, out=out_.contiguous()),
                                required=required)[:3]

        dq, dk, dv = run(dout, ve, out)
        if dlse is not None:
            dq_l, dk_l = lse_gradient(run, dout, ve, out, dlse.t())
            dq, dk = dq + dq_l, dk + dk_l
        return dq, reduce_kv_heads(dk, groups, 1), reduce_kv_heads(dv, groups, 1)


def bucketed_max_seqlen(n: int) -> int:
    """The longest document as flash-attn 4 is told it: the next power of two, at least 256. The
    value is an upper bound (the kernel reads the real lengths from ``cu_seqlens``); flash-attn 4
    derives launch choices that are part of its compiled kernel's key from it (split-KV, a
    single-block specialisation), so each new document mix would otherwise risk a compile."""
    return max(256, 1 << max(0, n - 1).bit_length())


class FlashAttn4Varlen(VarlenKernel):
    name = "flash_attn_4_varlen"
    # at equal pairs its causal calls cost more than its rectangles' (measured: docs/performance-log.md,
    # "Causal pairs weighted in the document layout")
    pair_costs = (12, 11)

    def _args(self, call: VarlenCall) -> dict:
        return dict(cu_seqlens_q=call.cu_q, cu_seqlens_k=call.cu_k, max_seqlen_q=bucketed_max_seqlen(call.max_q),
                    max_seqlen_k=bucketed_max_seqlen(call.max_k), softmax_scale=call.scale, causal=call.causal)

    def forward(self, q, k, v, call):
        from .flash_attn_4 import cute_interface

        fwd = cute_interface()._flash_attn_fwd
        out, lse = call_by_name(fwd, dict(self._args(call), q=q, k=k, v=v, return_lse=True),
                                required=("q", "k", "v", "cu_seqlens_q", "causal", "return_lse"))[:2]
        return out, _lse_rows_last(lse, q.shape[0], q.shape[1])

    def backward_heads(self, dout, q, k, v, out, lse, call, dlse=None):
        from .flash_attn_4 import cute_interface, padded_backward

        def run(dout, q, k, v, out):  # head dims padded as the dense backend's (flash_attn_4.py says why)
            args = dict(self._args(call), q=q, k=k, v=v, out=out.contiguous(), dout=dout.contiguous(),
                        lse=lse.contiguous(), dlse=None if dlse is None else dlse.contiguous())
            return call_by_name(cute_interface()._flash_attn_bwd, args,
                                required=("q", "k", "v", "out", "dout", "lse", "cu_seqlens_q", "causal", "dlse"))[:3]

        return padded_backward(run, dout.to(q.dtype), q, k, v, out.to(q.dtype))


#: the varlen entry point of each dense backend that has one: the same kernels, documents packed.
#: (cuDNN has one in torch too, which torch's own varlen_attn leaves off; the batched cuDNN calls per
#: document length beat torch's varlen flash kernel on documents of mean 8K, so ``auto``, which
#: resolves to cuDNN there, keeps them, and runs only the documents of calls too small to keep the
#: GPU busy in one call of torch's: see :func:`small_documents_kernel` and docs/performance-log.md.)
_KERNELS = {"sdpa_flash": TorchVarlen(), "flash_attn_4": FlashAttn4Varlen()}


def dense_kernel(q, k, v, backend: str, causal: bool) -> str:
    """The dense backend ``backend`` resolves to for these inputs (``auto``: by its measurement)."""
    if backend != "auto":
        return backend
    from . import get_backend

    return get_backend("auto", q, k, causal, v=v).name


def varlen_reason(q, k, v, backend: str, causal: bool = False) -> str | None:
    """Why packed documents do not go to a varlen entry point here, or None: they do where the
    dense kernel that ``backend`` resolves to has one (``sdpa_flash``: torch's varlen flash kernel;
    ``flash_attn_4``: its own)."""
    name = dense_kernel(q, k, v, backend, causal)
    if name not in _KERNELS:
        return (f"the kernel {name!r} has no varlen entry point here (sdpa_flash and flash_attn_4 do): documents "
                "run in its batched calls per document length")
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return "the varlen kernels are flash attention: CUDA and float16/bfloat16 only"
    if q.shape[-1] > 256 or q.shape[-1] % 8 or v.shape[-1] != q.shape[-1]:
        return "flash attention needs one head_dim, a multiple of 8 up to 256"
    from . import backend_reason

    reason = backend_reason(name, q.device)
    if reason is None and name == "sdpa_flash" and torch_varlen_ops() is None:
        reason = "this torch has no torch.nn.attention.varlen"
    return reason


def varlen_kernel(q, k, v, backend: str, causal: bool = False) -> VarlenKernel | None:
    """The varlen entry point of the kernel ``backend`` resolves to for these inputs, or None (see
    :func:`varlen_reason`). ``auto`` takes flash-attn 4's wherever it runs, whichever kernel won
    ``auto``'s dense measurement: its one call over every document runs packed documents faster
    than cuDNN's batched calls per document length, where the dense kernels are within a few
    percent of each other (docs/performance-log.md)."""
    if backend == "auto" and varlen_reason(q, k, v, "flash_attn_4", causal) is None:
        return _KERNELS["flash_attn_4"]
    if varlen_reason(q, k, v, backend, causal) is not None:
        return None
    return _KERNELS[dense_kernel(q, k, v, backend, causal)]


def varlen_kernel_of_shape(backend: str, heads: int, kv_heads: int, head_dim: int, device, dtype=torch.bfloat16,
                           causal: bool = True) -> VarlenKernel | None:
    """:func:`varlen_kernel` for inputs of ``heads`` / ``kv_heads`` heads of ``head_dim`` in ``dtype`` on
    ``device`` (judged from empty tensors of that shape)."""
    q = torch.empty(1, 256, heads, head_dim, device=device, dtype=dtype)
    kv = torch.empty(1, 256, kv_heads, head_dim, device=device, dtype=dtype)
    return varlen_kernel(q, kv, kv, backend, causal)


def documents_pair_costs(backend: str, device=None, dtype=torch.bfloat16) -> tuple:
    """The ``pair_costs`` of the varlen kernel that packed documents of ``dtype`` on ``device`` (default:
    the current CUDA device, else the host) go to with ``backend`` where it is flash-attn 4's (``auto``
    takes it wherever it runs), else ``(1, 1)``: what the modules' document layouts balance. Judged
    from the backend, the device and the dtype alone, so that a layout made before the call (from
    ``cu_seqlens`` only) is the one the call makes."""
    if backend not in ("auto", "flash_attn_4"):
        return (1, 1)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    probe = torch.empty(1, 1, 1, 64, device=device, dtype=dtype)
    reason = varlen_reason(probe, probe, probe, "flash_attn_4", True)
    return _KERNELS["flash_attn_4"].pair_costs if reason is None else (1, 1)


def varlen_pair_costs(name: str | None) -> tuple:
    """The ``pair_costs`` of the varlen kernel named ``name`` (:attr:`VarlenKernel.name`; None or
    unknown: ``(1, 1)``)."""
    return next((kernel.pair_costs for kernel in _KERNELS.values() if kernel.name == name), (1, 1))


def small_documents_kernel(q, k, v, causal: bool = False) -> VarlenKernel | None:
    """torch's varlen flash kernel where it runs for these inputs, else None: ``auto`` runs documents
    too small for batched calls of another kernel in one call of it (:data:`dilated.packed.SMALL_CALL_FLOPS`)."""
    return _KERNELS["sdpa_flash"] if varlen_reason(q, k, v, "sdpa_flash", causal) is None else None
