"""Input validation shared by every public entry point: one clear error per mistake."""
from __future__ import annotations

import math
import numbers
import os
import warnings

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
        if t.shape[3] == 0:
            raise ValueError(f"{name} has head_dim 0 (shape {tuple(t.shape)}); head_dim must be >= 1")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share one dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must be on one device, got q={q.device}, k={k.device}, v={v.device}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must have the same batch, length and heads, got k={tuple(k.shape)}, "
                         f"v={tuple(v.shape)} (v's head_dim may differ where the backend allows it)")
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
    """``scale`` is None (1/sqrt(head_dim)) or a finite positive real number."""
    if scale is None:
        return
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a float or None (1/sqrt(head_dim)), got {type(scale).__name__} {scale!r}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be finite and positive, or None for 1/sqrt(head_dim); got {scale!r}")


def check_causal(causal) -> None:
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {type(causal).__name__} {causal!r}")


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of accumulators and log-sum-exps for inputs of ``dtype``: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def dense_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` with a contiguous last dimension (a copy only where it is strided): every kernel reads
    rows of ``head_dim`` adjacent elements, and some misread other strides instead of refusing them."""
    return x if x.stride(-1) == 1 or x.shape[-1] == 1 else x.contiguous()


class UncoveredRowsWarning(UserWarning):
    """A dilated schedule leaves some (position, head) rows to no branch: they output 0."""


def check_schedule(segment_lengths, dilation_rates, warn: bool = True) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Validate a LongNet schedule; return it as tuples of ints (``warn``: an
    :class:`UncoveredRowsWarning` where no rate is 1)."""
    for name, value in (("segment_lengths", segment_lengths), ("dilation_rates", dilation_rates)):
        if isinstance(value, (str, bytes)) or (value is not None and not hasattr(value, "__iter__")):
            raise TypeError(f"{name} must be a list of positive integers, e.g. [2048, 4096], got "
                            f"{type(value).__name__} {value!r}")
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
    if warn and 1 not in dil:
        warnings.warn(
            f"dilation_rates {list(dil)} has no rate 1: in every segment, positions whose offset mod r differs "
            "from the head index mod r are selected by no branch and output 0 (e.g. position 1 of head 0). "
            "Add a branch with dilation rate 1 to cover every row.", UncoveredRowsWarning, stacklevel=3)
    return seg, dil


def positive_int_env(name: str, default: int, meaning: str) -> int:
    """The environment variable ``name`` as a whole number of at least 1 (``default`` when unset);
    a clear error otherwise, saying what it sets (``meaning``)."""
    value = os.environ.get(name, str(default))
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{name}={value!r}: set it to a whole number of at least 1 ({meaning}) or unset it "
                         f"(default {default})")
    return n
