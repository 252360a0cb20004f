"""A bounded pool of scratch buffers (the gather buffers of the dilated path) reused across calls.

``acquire`` hands out a free buffer of the exact shape/dtype/device or allocates one;
``release`` returns it (dropped if the pool would exceed ``max_bytes``). On CUDA, reuse is
stream-ordered like the caching allocator's, so a buffer released after its last use on the
current stream is safe to hand out again. PyTorch's caching allocator already recycles memory,
so this pool is off by default; the benchmarks measure it on and off.
"""
from __future__ import annotations

from collections import defaultdict

import torch

from ..handles import handle_of


class MemoryPool:
    def __init__(self, max_bytes: int = 8 << 30):
        self.max_bytes = max_bytes
        self._free: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        self.bytes_held = 0
        self.hits = 0
        self.misses = 0
        self.outstanding = 0
        self.handle = handle_of(self)  # how a custom op finds it (dilated.ops)

    def acquire(self, shape, dtype, device) -> torch.Tensor:
        key = (tuple(shape), dtype, str(device))
        self.outstanding += 1
        free = self._free.get(key)
        if free:
            t = free.pop()
            self.bytes_held -= t.numel() * t.element_size()
            self.hits += 1
            return t
        self.misses += 1
        return torch.empty(shape, dtype=dtype, device=device)

    def release(self, t: torch.Tensor) -> None:
        self.outstanding -= 1
        size = t.numel() * t.element_size()
        if self.bytes_held + size > self.max_bytes:
            return
        self._free[(tuple(t.shape), t.dtype, str(t.device))].append(t)
        self.bytes_held += size

    def stats(self) -> dict:
        return {"hits": self.hits, "misses": self.misses, "bytes_held": self.bytes_held,
                "buffers_held": sum(len(v) for v in self._free.values()),
                "outstanding": self.outstanding, "max_bytes": self.max_bytes}

    def clear(self) -> None:
        self._free.clear()
        self.bytes_held = 0
