"""Integer handles for the host objects a custom op looks up (a module's pattern cache, its memory
pool): :mod:`dilated.ops` passes ints through ``torch.compile`` graphs, which cannot carry them.

Both objects only save work (plans, buffers), so a handle whose object was freed (a module dropped
between a compiled forward and its backward) reads as "none": the op computes without it. Handles
count up and are never reused, so a freed object's handle can never name another object."""
from __future__ import annotations

import itertools
import weakref

_OBJECTS: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_NEXT = itertools.count(1)


def handle_of(obj) -> int:
    """A new handle for ``obj`` (0 for None); it names ``obj`` while ``obj`` lives."""
    if obj is None:
        return 0
    handle = next(_NEXT)
    _OBJECTS[handle] = obj
    return handle


def object_of(handle: int):
    """The object of ``handle``: None for 0 and for an object that was freed."""
    return _OBJECTS.get(handle) if handle else None


def handle_or_zero(obj) -> int:
    """The handle an object made for itself at construction (its ``handle``), or 0 for None."""
    return 0 if obj is None else obj.handle
