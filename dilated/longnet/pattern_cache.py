"""The pattern cache: a bounded LRU of what a call's input signature determines (its plan of kernel
calls, :mod:`dilated.longnet.plan`, or all an entry point resolves from the signature), with hit/miss counts."""
from __future__ import annotations

from collections import OrderedDict

from ..handles import handle_of


class PatternCache:
    """LRU of what a call's input signature determines (its plan, or all an entry point resolves
    from it), at most ``max_entries``; ``stats()`` gives hits, misses and size."""

    def __init__(self, max_entries: int = 32):
        self.max_entries = max_entries
        self._plans: OrderedDict = OrderedDict()
        self.hits = 0
        self.misses = 0
        self.handle = handle_of(self)  # how a custom op finds it (dilated.ops)

    def get(self, key, build):
        """The entry for ``key`` (hashable), made by ``build()`` on a miss."""
        if key in self._plans:
            self.hits += 1
            self._plans.move_to_end(key)
            return self._plans[key]
        self.misses += 1
        value = self._plans[key] = build()
        while len(self._plans) > self.max_entries:
            self._plans.popitem(last=False)
        return value

    def stats(self) -> dict:
        return {"hits": self.hits, "misses": self.misses, "size": len(self._plans), "max_entries": self.max_entries}

    def clear(self) -> None:
        self._plans.clear()
        self.hits = self.misses = 0
