"""Where each rank is: a row and its phase, kept in the rendezvous store, so that when a rank
dies or stops the others can say which one and where (a leaf: the runner, the warm-up and the
exit path all record or read it)."""
from __future__ import annotations

import torch.distributed as dist


def _store():
    """The default group's key-value store (the rendezvous store), or None."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):  # private helper: absent in some versions
        return None


def checkpoint(text: str) -> None:
    """Record where this rank is (a row and its phase) in the rendezvous store, so that when a
    rank dies or stops the others can say which one and where (:func:`last_seen`)."""
    store = _store()
    if store is not None:
        store.set(f"dilated/progress/{dist.get_rank()}", text)


def last_seen() -> list[str]:
    """``rank R: <where it last checked in>`` for every rank of the default group."""
    store = _store()
    if store is None:
        return []
    lines = []
    for r in range(dist.get_world_size()):
        key = f"dilated/progress/{r}"
        try:
            where = store.get(key).decode() if store.check([key]) else "never checked in"
        except (RuntimeError, ValueError) as e:  # the store itself is gone (its host rank died)
            return [f"the rendezvous store is unreachable ({e})"]
        lines.append(f"rank {r}: {where}")
    return lines
