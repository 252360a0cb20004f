"""Document workloads: lengths drawn from a distribution and packed, in order, into a sequence of N
positions (the last document cut at N), as training on packed corpora does.

``--doc-lengths`` specs:

* ``fixed:8k``: every document 8192 long;
* ``uniform:1k-64k``: lengths uniform in [1024, 65536];
* ``lognormal:MEAN,SIGMA``: lengths ``round(exp(normal(log(MEAN) - SIGMA^2/2, SIGMA)))`` (mean MEAN),
  at least 1.

The draw is seeded by the spec and N alone, so every rank, every implementation and the reference
see the same documents. A suffix ``#K`` (``lognormal:8k,1.0#3``) is another draw of the same
distribution: a new document mix, as each training batch brings.
"""
from __future__ import annotations

import argparse
import functools
import math
import zlib

import torch

from .sizes import parse_size as size


def parse_spec(spec: str) -> tuple:
    """``(kind, parameters)``; ValueError naming the form on a bad spec."""
    spec, _, draw = spec.partition("#")
    kind, _, rest = spec.partition(":")
    try:
        if draw and not (draw.isdigit() and draw.isascii()):
            raise ValueError
        if kind == "fixed":
            return kind, (size(rest),)
        if kind == "uniform":
            lo, hi = (size(x) for x in rest.split("-"))
            if lo > hi:
                raise ValueError
            return kind, (lo, hi)
        if kind == "lognormal":
            mean, sigma = rest.split(",")
            mean, sigma = size(mean), float(sigma)
            if not (sigma >= 0 and math.isfinite(sigma)):
                raise ValueError
            return kind, (mean, sigma)
    except (ValueError, TypeError, argparse.ArgumentTypeError):
        pass
    raise ValueError(f"--doc-lengths {spec + ('#' + draw if draw else '')!r}: use fixed:LEN, uniform:MIN-MAX or "
                     "lognormal:MEAN,SIGMA, optionally #K for another draw (lengths such as 8k; SIGMA a non-negative "
                     "number; K a non-negative integer)")


@functools.lru_cache(maxsize=64)
def cu_seqlens_of(spec: str, n: int) -> tuple[int, ...]:
    """The cumulative document lengths ``(0, ..., n)`` of ``spec`` packed into ``n`` positions."""
    kind, params = parse_spec(spec)
    gen = torch.Generator().manual_seed(zlib.crc32(f"{spec}/{n}".encode()))
    cu, total = [0], 0
    while total < n:
        if kind == "fixed":
            length = params[0]
        elif kind == "uniform":
            length = int(torch.randint(params[0], params[1] + 1, (1,), generator=gen))
        else:
            mean, sigma = params
            z = float(torch.randn(1, generator=gen))
            log_length = math.log(mean) - sigma * sigma / 2 + sigma * z  # a length past n is cut at n anyway
            length = n if log_length > math.log(n) else max(1, round(math.exp(log_length)))
        total = min(n, total + length)
        cu.append(total)
    return tuple(cu)


def cu_tensor(spec: str | None, n: int) -> torch.Tensor | None:
    """:func:`cu_seqlens_of` as the int32 tensor the library takes (None without documents), on the
    host as the library asks: it reads the lengths there, and a CUDA tensor's would be a copy to the
    GPU and one back, each waiting for the GPU's queue, in every timed call."""
    return None if spec is None else torch.tensor(cu_seqlens_of(spec, n), dtype=torch.int32)


def attended_pairs(cu, causal: bool) -> float:
    """(query, key) pairs attention computes within the documents (causal: the diagonal included)."""
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    return float(sum(length * (length + 1) / 2 if causal else length * length for length in lengths))


def add_layout_args(p: argparse.ArgumentParser) -> None:
    """The options of the scripts that time a document layout's ranks on one GPU: ``--backend`` (one
    with a varlen entry point), ``--doc-lengths``, ``--seq-len``, ``--world-size``, ``--head-shapes``."""
    p.add_argument("--backend", default="flash_attn_4", help="a backend with a varlen entry point")
    p.add_argument("--doc-lengths", default="lognormal:8k,1.0")
    p.add_argument("--seq-len", default="256k")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--head-shapes", default="16/16,32/8", help="H/Hkv pairs, comma-separated (head_dim 128)")
