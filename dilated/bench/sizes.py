"""Sizes as the options and specs write them (``8192``, ``8k``, ``1M``): a leaf the parsers and the
document specs share."""
from __future__ import annotations

import argparse
import math

#: the largest size any option takes (2**40 tokens: far beyond a GPU, within 64-bit index arithmetic)
LARGEST_SIZE = 1 << 40


def parse_size(text) -> int:
    """``8192``, ``8k``, ``1M``, ``2m`` -> int (k = 1024)."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text <= 0 or text > LARGEST_SIZE:
            raise argparse.ArgumentTypeError(f"not a positive size up to {LARGEST_SIZE >> 30}G: {text!r}")
        return text
    s = str(text).strip().lower()
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(s[-1:], 1)
    num = s[:-1] if mult > 1 else s
    try:
        value = float(num) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 8192, 8k, 1M)") from None
    if not math.isfinite(value) or value <= 0 or value != int(value):
        raise argparse.ArgumentTypeError(f"not a positive whole size: {text!r} (use e.g. 8192, 8k, 1M)")
    if value > LARGEST_SIZE:
        raise argparse.ArgumentTypeError(f"too large a size: {text!r} (at most {LARGEST_SIZE >> 30}G)")
    return int(value)


def size_list(text) -> list[int]:
    if isinstance(text, (list, tuple)):
        sizes = [parse_size(t) for t in text]
    else:
        sizes = [parse_size(t) for t in str(text).split(",") if t.strip()]
    if not sizes:
        raise argparse.ArgumentTypeError(f"an empty list: {text!r} (give at least one size, e.g. 8k)")
    return sizes
