"""A step's independent kernel calls taken in turns by the current CUDA stream and side streams.

The calls of a dilated step (one per branch, head offset or run of segments) are independent,
forward and backward: each reads q, k and v (and the merged out, lse and dout) and writes outputs
of its own, which only the combine after them reads. On one stream each call's last wave leaves
SMs idle until the next call starts, and the small calls (the r = 16 branch at 32K: a few waves)
are mostly tail. Taken in turns by two streams, one call's tail runs beside the next call's first
wave.

What two streams buy, forward and backward, on flash-attn 4 and cuDNN: docs/performance-log.md
("Calls one after another against taken in turns by two streams").

Why the caching allocator needs no ``record_stream`` here: every use of a side stream begins
by waiting for the current stream (the fork), and the current stream waits for every side
stream before anything reads the calls' outputs (the join). A block freed after its last use
goes back to the pool of the stream that allocated it; a side stream hands it out again only to
work after a later fork, which the current stream has ordered after every earlier use.

``DILATED_CALL_STREAMS`` sets how many streams take turns (default 2; 1 runs every call on the
current stream).
"""
from __future__ import annotations

import contextlib

import torch

from .._checks import positive_int_env

ENV = "DILATED_CALL_STREAMS"
DEFAULT_STREAMS = 2
_SIDE: dict = {}  # device index -> the side streams (made once, reused by every step)


def streams_from_env() -> int:
    """``DILATED_CALL_STREAMS`` as an integer of at least 1 (a clear error otherwise)."""
    return positive_int_env(ENV, DEFAULT_STREAMS, "how many CUDA streams take the calls of a step in turns; "
                                                  "1: all on the current stream")


def _side_streams(device: torch.device, n: int) -> list:
    index = device.index if device.index is not None else torch.cuda.current_device()
    streams = _SIDE.setdefault(index, [])
    while len(streams) < n:
        streams.append(torch.cuda.Stream(device=index))
    return streams[:n]


@contextlib.contextmanager
def call_streams(device: torch.device, calls: int, enabled: bool = True):
    """A context giving ``turn(i)``, the stream context of call ``i`` of ``calls``; on leaving it
    the current stream waits for every stream used. Off CUDA, with one call, or not ``enabled``,
    every turn is the current stream."""
    n = min(streams_from_env(), calls) if enabled and device.type == "cuda" else 1
    if n < 2:
        yield lambda i: contextlib.nullcontext()
        return
    main = torch.cuda.current_stream(device)
    streams = [main] + _side_streams(device, n - 1)
    for s in streams[1:]:
        s.wait_stream(main)  # the fork: nothing on a side stream starts before what came first here
    try:
        yield lambda i: torch.cuda.stream(streams[i % n])
    finally:
        for s in streams[1:]:
            main.wait_stream(s)  # the join
