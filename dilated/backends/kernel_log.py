"""Which kernels actually ran: ``with record_kernels() as ran: ...`` collects the name of every
backend whose forward or backward ran inside the block (``auto`` resolves to one of them), so a
benchmark row can say what it timed."""
from __future__ import annotations

from contextlib import contextmanager

_OPEN: list[set] = []


@contextmanager
def record_kernels():
    """A set that fills with the names of the backends that run inside the block."""
    ran: set = set()
    _OPEN.append(ran)
    try:
        yield ran
    finally:
        _OPEN.remove(ran)


def recording() -> bool:
    """Whether a :func:`record_kernels` block is open (working out a kernel's name can cost host time)."""
    return bool(_OPEN)


def note_kernel(name: str) -> None:
    """Called by :mod:`dilated.functional` for each backend call."""
    for ran in _OPEN:
        ran.add(name)
