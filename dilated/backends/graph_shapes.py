"""When a kernel that builds an execution plan per call shape gets to build one.

torch's cuDNN attention builds a cuDNN graph for each new call shape and caches it: the batch,
heads, query and key lengths and the q/k/v strides are its key (``MHACacheKeyWrapper`` in ATen's
``native/cudnn/MHA.cpp``), and a graph takes tens of milliseconds to build. A dilated call at a
sequence length never seen before has several new shapes (the batch of each branch's full
segments, the clipped last segment), so its first call took far longer than a steady one
(docs/performance-log.md). :class:`GraphShapes` counts the calls of each shape: the first ``build_after - 1`` of
a shape go to a kernel that builds nothing per shape (the SDPA backend takes torch's flash kernel,
and records it as run), and the graph is built at the call that reaches ``build_after``. A shape
seen once, as at an inference server's varied prompt lengths, never waits for a graph; a shape
that recurs, as in a training loop, pays for its graph once, at that call.

Calls inside :func:`no_build` never build (a graph already built is used): the dilated path
runs its clipped last segments there (their length is the sequence length modulo the segment
length, so their shapes belong to one length and would get a graph per length); the full
segments' shapes (a batch per branch) are shared by every length with as many segments, so their
graphs are a bounded set.

What counts is operations, not kernel calls: one dilated forward makes several calls of one
shape (a call per head offset of a branch, per segment, per ring step), so inside
:class:`one_operation` (the dilated, ring and dense entry points) a shape counts once, and all of
its calls there take the kernel its first one took.

``DILATED_CUDNN_BUILD_AFTER`` sets ``build_after`` (default 2; 1: a shape's first call builds,
as torch does; calls under :func:`no_build` still take the flash kernel).

Calls inside :func:`build_at_first_call` build at a shape's first call whatever ``build_after``:
packed documents' batched calls (:func:`dilated.packed.documents_forward`), whose shapes (a
bucket length and a power-of-two count of documents) are a bounded set that every new document
mix draws from again, so a graph built at once serves the mixes that follow, where a first call
on the flash kernel costs every new mix that meets a new shape.
"""
from __future__ import annotations

import contextlib
import contextvars

from .._checks import positive_int_env

ENV = "DILATED_CUDNN_BUILD_AFTER"
DEFAULT_BUILD_AFTER = 2
_MAX_SHAPES = 8192  # counts kept at most; beyond, they start again (a shape then waits once more)


def build_after_from_env() -> int:
    """``DILATED_CUDNN_BUILD_AFTER`` as an integer of at least 1 (a clear error otherwise)."""
    return positive_int_env(ENV, DEFAULT_BUILD_AFTER, "the call of a shape at which its cuDNN graph is built; "
                                                      "1 builds at the first call")


_OPERATION: contextvars.ContextVar = contextvars.ContextVar("dilated_operation", default=None)
_NO_BUILD: contextvars.ContextVar = contextvars.ContextVar("dilated_no_build", default=False)
_AT_FIRST_CALL: contextvars.ContextVar = contextvars.ContextVar("dilated_build_at_first_call", default=False)


@contextlib.contextmanager
def no_build(active: bool = True):
    """Where ``active``, the kernel calls inside build no graph (a shape already built is used)."""
    token = _NO_BUILD.set(True) if active else None
    try:
        yield
    finally:
        if token is not None:
            _NO_BUILD.reset(token)


@contextlib.contextmanager
def build_at_first_call():
    """The kernel calls inside build a shape's graph at its first call (``build_after`` 1)."""
    token = _AT_FIRST_CALL.set(True)
    try:
        yield
    finally:
        _AT_FIRST_CALL.reset(token)


def building_at_first_call() -> bool:
    """Whether this call is inside :func:`build_at_first_call`."""
    return _AT_FIRST_CALL.get()


class one_operation(contextlib.ContextDecorator):
    """The kernel calls inside count as one call per shape (nested: the outermost counts)."""

    def _recreate_cm(self):  # a decorated function's calls each get their own (nesting, threads)
        return type(self)()

    def __enter__(self):
        self._token = _OPERATION.set(object()) if _OPERATION.get() is None else None
        return self

    def __exit__(self, *exc):
        if self._token is not None:
            _OPERATION.reset(self._token)
        return False


class GraphShapes:
    """Counts operations per shape key (:class:`one_operation`; outside one, each call is one);
    :meth:`build` says whether this call may build (or reuse) the shape's graph.
    ``build_after=None`` reads :data:`ENV` at the first call."""

    def __init__(self, build_after: int | None = None):
        self.build_after = build_after
        self._seen: dict = {}  # key -> (operations, the last of them, built)

    def build(self, key) -> bool:
        if self.build_after is None:
            self.build_after = build_after_from_env()
        n, last, built = self._seen.get(key, (0, None, False))
        if built:  # no more counting
            return True
        if _NO_BUILD.get():
            return False
        operation = _OPERATION.get()
        if operation is not None and operation is last:  # counted in this operation: decided then
            return False
        if len(self._seen) >= _MAX_SHAPES:
            self._seen.clear()
        built = n + 1 >= (1 if _AT_FIRST_CALL.get() else self.build_after)
        self._seen[key] = (n + 1, operation, built)
        return built


def shape_key(tensors, *flags) -> tuple:
    """What torch keys a cuDNN attention graph on: each tensor's shape and strides, its dtype and
    device, and the flags given (direction, causal)."""
    first = tensors[0]
    return (first.device, first.dtype, *flags, *((tuple(t.shape), t.stride()) for t in tensors))
