"""Input validation shared by every public entry point: one clear error per mistake."""
from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Validate ``[batch, seq, heads, head_dim]`` inputs; raise ValueError/TypeError naming the argument."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must have 4 dimensions [batch, seq, heads, head_dim], got shape {tuple(t.shape)}"
            )
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(
                f"{name} has dtype {t.dtype}; attention needs a floating dtype "
                f"(float16, bfloat16, float32 or float64): convert it with {name}.to(torch.bfloat16)"
            )
        if t.shape[1] == 0:
            raise ValueError(f"{name} has an empty sequence (shape {tuple(t.shape)}); seq must be >= 1")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share one dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must be on one device, got q={q.device}, k={k.device}, v={v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k={tuple(k.shape)}, v={tuple(v.shape)}")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"batch size of k ({k.shape[0]}) differs from q ({q.shape[0]})")
    if k.shape[3] != q.shape[3]:
        raise ValueError(f"head_dim of k ({k.shape[3]}) differs from q ({q.shape[3]})")
    hq, hkv = q.shape[2], k.shape[2]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(
            f"heads of q ({hq}) must be divisible by heads of k/v ({hkv}) (GQA/MQA); "
            f"use a number of kv heads that divides {hq}"
        )


def check_scale(scale) -> None:
    if scale is not None and not (isinstance(scale, (int, float)) and scale > 0):
        raise ValueError(f"scale must be a positive float or None (1/sqrt(head_dim)), got {scale!r}")


def check_schedule(segment_lengths, dilation_rates) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Validate a LongNet schedule; return it as tuples of ints."""
    seg = tuple(segment_lengths) if segment_lengths is not None else ()
    dil = tuple(dilation_rates) if dilation_rates is not None else ()
    if not seg:
        raise ValueError("segment_lengths is empty; give at least one segment length, e.g. [2048]")
    if not dil:
        raise ValueError("dilation_rates is empty; give one dilation rate per segment, e.g. [1]")
    if len(seg) != len(dil):
        raise ValueError(
            f"segment_lengths ({len(seg)} entries) and dilation_rates ({len(dil)} entries) "
            "must have the same length: one dilation rate per segment length"
        )
    for w in seg:
        if not isinstance(w, int) or isinstance(w, bool) or w <= 0:
            raise ValueError(f"segment_lengths must be positive integers, got {w!r} in {list(seg)}")
    for r in dil:
        if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
            raise ValueError(f"dilation_rates must be positive integers, got {r!r} in {list(dil)}")
    for w, r in zip(seg, dil):
        if r > w:
            raise ValueError(
                f"dilation rate {r} is larger than its segment length {w} in dilation_rates; "
                "a dilation must not exceed its segment"
            )
    return seg, dil
