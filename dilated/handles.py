"""Integer handles for the host objects a custom op looks up (a module's pattern cache, its memory
pool): :mod:`dilated.ops` passes ints through ``torch.compile`` graphs, which cannot carry them."""
from __future__ import annotations

import weakref

_OBJECTS: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()


def handle_of(obj) -> int:
    """A handle for ``obj`` (0 for None), valid while ``obj`` lives."""
    if obj is None:
        return 0
    _OBJECTS[id(obj)] = obj
    return id(obj)


def object_of(handle: int):
    """The object of ``handle`` (None for 0)."""
    if handle == 0:
        return None
    obj = _OBJECTS.get(handle)
    if obj is None:
        raise RuntimeError(f"handle {handle} names no live object: its pattern cache or memory pool was freed")
    return obj
