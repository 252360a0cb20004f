"""Packed documents: several documents in one sequence, ``cu_seqlens`` their cumulative lengths
(int32 ``[0, l_0, l_0 + l_1, ..., N]``, the flash-attn varlen convention). Attention never crosses
a document boundary; causal applies within each document.

On CUDA, with half-precision inputs, documents go to a kernel's own varlen entry point in one
call over all of them: torch's varlen flash kernel (``torch.nn.attention.varlen.varlen_attn``,
where the installed torch has it) with ``backend="auto"``, flash-attn 4's
``flash_attn_varlen_func`` with ``backend="flash_attn_4"``. Elsewhere, documents run in batched kernel calls, not one call per document: non-causal documents of one
length share a call (their batch is the number of such documents); causal ones are padded at
their end to a bucket length (four buckets per octave, so at most a quarter of a call is padding)
and share the bucket's call. Padding at the end is exact under causality: a real query sees only
keys at or before it, never a padded one, and the padded rows' outputs are dropped (their
gradients are zero). So the calls are at most one per distinct length (non-causal) or about four
per octave of lengths (causal).
"""
from __future__ import annotations

from collections import defaultdict

import torch


def check_cu_seqlens(cu_seqlens, n: int) -> list[int]:
    """Validate ``cu_seqlens`` for a packed sequence of ``n`` positions; return it as a list."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor (int32 cumulative document lengths), got "
                        f"{type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"cu_seqlens must be int32 (the flash-attn varlen convention), got {cu_seqlens.dtype}: "
                        "convert it with cu_seqlens.to(torch.int32)")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-d with at least 2 entries [0, ..., N], got shape "
                         f"{tuple(cu_seqlens.shape)}")
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != n:
        raise ValueError(f"cu_seqlens must start at 0 and end at the sequence length {n}, got {cu[0]} ... {cu[-1]}: "
                         "the documents' lengths must sum to N")
    if any(b <= a for a, b in zip(cu, cu[1:])):
        raise ValueError("cu_seqlens must be strictly increasing (every document at least one position long), got "
                         f"{cu[:12]}{' ...' if len(cu) > 12 else ''}")
    return cu


def _bucket(length: int) -> int:
    """The smallest of ``2^e, 1.25 * 2^e, 1.5 * 2^e, 1.75 * 2^e`` at or above ``length``."""
    if length <= 4:
        return length
    e = (length - 1).bit_length() - 1  # 2^e < length <= 2^(e+1)
    step = 1 << (e - 2)
    return -(-length // step) * step


def document_calls(cu: list[int], causal: bool) -> list[tuple[int, list[tuple[int, int]]]]:
    """``(call length, [(start, length), ...])`` per kernel call: documents of one length, or
    (causal) of one bucket length, together."""
    groups = defaultdict(list)
    for start, end in zip(cu, cu[1:]):
        length = end - start
        groups[_bucket(length) if causal else length].append((start, length))
    return sorted(groups.items())


def packed_attention(q, k, v, cu_seqlens, attend, causal: bool):
    """``attend(q, k, v) -> (out, lse)`` (a plain attention, causal as given) over each document of
    the packed ``[B, N, H, D]`` q, k, v separately; returns ``(out, lse)`` for the whole sequence,
    lse ``[B, H, N]``. Differentiable (gathers and one inverse permutation)."""
    return documents_forward(q, k, v, check_cu_seqlens(cu_seqlens, q.shape[1]), attend, causal)


def _document_rows(cu: list[int], causal: bool, n: int, device):
    """Per kernel call of :func:`document_calls`: ``(length, documents, pos, real)``: the positions
    its ``[documents, length]`` rows read (``n``: a padding row) and which of them are real."""
    for length, docs in document_calls(cu, causal):
        starts, lengths = torch.tensor(docs, device=device).unbind(1)
        offsets = torch.arange(length, device=device)
        pos = torch.where(offsets < lengths[:, None], starts[:, None] + offsets, n).flatten()
        yield length, len(docs), pos, pos != n


def _padded(x: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """``x`` with one zero row appended along ``dim`` (what padded positions read)."""
    return torch.cat([x, x.new_zeros(*x.shape[:dim], 1, *x.shape[dim + 1:])], dim)


def documents_forward(q, k, v, cu: list[int], attend, causal: bool):
    """:func:`packed_attention` on validated cumulative lengths ``cu`` (a list): documents of one
    length (causal: one bucket) in one call of ``attend``."""
    b, n = q.shape[:2]
    if len(cu) == 2:
        return attend(q, k, v)
    ext = [_padded(x) for x in (q, k, v)]
    outs, lses, order = [], [], []
    for length, count, pos, real in _document_rows(cu, causal, n, q.device):
        qg, kg, vg = (x[:, pos].reshape(b * count, length, *x.shape[2:]) for x in ext)
        o, lse = attend(qg, kg, vg)
        outs.append(o.reshape(b, count * length, *o.shape[2:])[:, real])
        lses.append(lse.reshape(b, count, lse.shape[1], length).transpose(1, 2)
                    .reshape(b, lse.shape[1], count * length)[:, :, real])
        order.append(pos[real])
    inverse = torch.empty(n, dtype=torch.long, device=q.device)
    inverse[torch.cat(order)] = torch.arange(n, device=q.device)
    return torch.cat(outs, 1)[:, inverse], torch.cat(lses, 2)[:, :, inverse]


def documents_backward(tensors, cu: list[int], backward, causal: bool):
    """``backward(dout, q, k, v, out, lse) -> (dq, dk, dv)`` (a kernel backward, causal as given)
    over each document of the packed ``tensors = (dout, q, k, v, out, lse)`` separately, in the
    calls of :func:`documents_forward`; lse ``[B, H, N]``. Padded rows have q, out and dout 0 and
    lse 0: they add no gradient."""
    dout, q, k, v, out, lse = tensors
    b, n = q.shape[:2]
    if len(cu) == 2:
        return backward(*tensors)
    ext = [_padded(x) for x in (dout, q, k, v, out)]
    lse_ext = _padded(lse, 2)
    grads = [None, None, None]
    for length, count, pos, real in _document_rows(cu, causal, n, q.device):
        dg, qg, kg, vg, og = (x[:, pos].reshape(b * count, length, *x.shape[2:]) for x in ext)
        h = lse.shape[1]
        lg = lse_ext[:, :, pos].reshape(b, h, count, length).transpose(1, 2).reshape(b * count, h, length)
        for i, (x, gi) in enumerate(zip((q, k, v), backward(dg, qg, kg, vg, og, lg.contiguous()))):
            if grads[i] is None:
                grads[i] = torch.zeros(x.shape, dtype=gi.dtype, device=x.device)
            grads[i][:, pos[real]] = gi.reshape(b, count * length, *gi.shape[2:])[:, real]
    return tuple(grads)


def varlen_kernel():
    """torch's varlen flash attention (``varlen_attn``, ``AuxRequest``), or None in a torch without it."""
    try:
        from torch.nn.attention.varlen import AuxRequest, varlen_attn
    except ImportError:
        return None
    return varlen_attn, AuxRequest


def varlen_reason(q, k, v, backend: str) -> str | None:
    """Why packed documents do not go to a kernel's own varlen entry point here (torch's varlen
    kernel for ``auto``, flash-attn 4's ``flash_attn_varlen_func`` for ``flash_attn_4``), or None."""
    if backend not in ("auto", "flash_attn_4"):
        return (f"backend {backend!r} asked for by name (torch's varlen kernel serves 'auto', flash-attn 4's "
                "'flash_attn_4')")
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return "the varlen kernels are flash attention: CUDA and float16/bfloat16 only"
    if q.shape[-1] > 256 or q.shape[-1] % 8 or v.shape[-1] != q.shape[-1]:
        return "flash attention needs one head_dim, a multiple of 8 up to 256"
    if backend == "flash_attn_4":
        from .backends import backend_reason

        return backend_reason("flash_attn_4", q.device)
    if varlen_kernel() is None:
        return "this torch has no torch.nn.attention.varlen"
    return None


def varlen_attention(q, k, v, cu: list[int], causal: bool, scale: float, backend: str = "auto"):
    """``(out, lse)`` of the packed documents by one call of a varlen kernel (torch's for
    ``auto``, flash-attn 4's for ``flash_attn_4``) over every batch row's documents (the rows
    are packed one after another). Differentiable."""
    b, n, h, d = q.shape
    starts = torch.tensor(cu, dtype=torch.int32, device=q.device)
    cu_all = torch.cat([starts[:-1] + i * n for i in range(b)] + [starts[-1:] + (b - 1) * n])
    longest = max(e - s for s, e in zip(cu, cu[1:]))
    packed = q.reshape(b * n, h, d), k.reshape(b * n, k.shape[2], d), v.reshape(b * n, v.shape[2], d)
    if backend == "flash_attn_4":
        out, lse = _flash_attn_4_varlen(packed, cu_all, longest, causal, scale)  # lse [H, T]
        return out.reshape(b, n, h, d), lse.reshape(h, b, n).transpose(0, 1).float()
    out, lse = _torch_varlen(packed, cu_all, longest, causal, scale)
    if lse.shape == (h, b * n) and lse.shape != (b * n, h):  # [H, T] in releases that return it so
        lse = lse.transpose(0, 1)
    return out.reshape(b, n, h, d), lse.reshape(b, n, h).transpose(1, 2).float()


def _flash_attn_4_varlen(packed, cu_all, longest: int, causal: bool, scale: float):
    """flash-attn 4's ``flash_attn_varlen_func`` (an autograd Function; GQA native) on packed
    ``(q, k, v)`` ``[T, H, D]`` rows: ``(out [T, H, D], lse [H, T])``."""
    from .backends._signature import call_by_name
    from .backends.flash_attn_4 import _import

    q, k, v = packed
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_all, cu_seqlens_k=cu_all, max_seqlen_q=longest,
                max_seqlen_k=longest, softmax_scale=scale, causal=causal, return_lse=True)
    return call_by_name(_import().flash_attn_varlen_func, args, required=tuple(args))[:2]


def _torch_varlen(packed, cu_all, longest: int, causal: bool, scale: float):
    """torch's ``varlen_attn`` over packed ``(q, k, v)`` ``[T, H, D]`` rows: ``(out, lse)`` (lse
    ``[T, H]`` or ``[H, T]``, by release)."""
    from .backends._signature import parameters

    q, k, v = packed
    varlen_attn, aux_request = varlen_kernel()
    h, d = q.shape[1], q.shape[2]
    params = parameters(varlen_attn)
    kwargs = {"return_aux": aux_request(lse=True)}
    if "scale" in params:
        kwargs["scale"] = scale
    elif abs(scale - d ** -0.5) > 1e-12 * scale:
        raise NotImplementedError("this torch's varlen_attn takes no scale")
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0) if causal else (-1, -1)
    elif "is_causal" in params:
        kwargs["is_causal"] = causal
    else:
        raise NotImplementedError("this torch's varlen_attn takes neither window_size nor is_causal")
    if k.shape[1] != h:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            k, v = (x.repeat_interleave(h // k.shape[1], 1) for x in (k, v))
    return varlen_attn(q, k, v, cu_all, cu_all, longest, longest, **kwargs)
