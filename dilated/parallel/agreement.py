"""Ranks that agree before they communicate: every rank's inputs and settings compared (one small
all-gather per new input signature), and the text each rank has to tell the others.

A collective module checks its call here before any collective: ranks that disagree on shape,
dtype, layout, causal or schedule get :class:`RankMismatchError` on every rank, and a rank whose own
input is invalid raises its error while the others are told which rank failed and why, instead
of waiting for it in the next collective.
"""
from __future__ import annotations

import hashlib
import json
import warnings
import zlib
from collections import OrderedDict

import torch
import torch.distributed as dist

from .sharding import nccl_group, rank_and_size


_AGREE_BYTES = 2048


def _encode(fields: dict) -> bytes:
    """``fields`` as JSON in at most ``_AGREE_BYTES`` (long values replaced by their crc32)."""
    text = json.dumps(fields, sort_keys=True, default=str).encode()
    if len(text) > _AGREE_BYTES:
        short = {k: (v if len(json.dumps(v, default=str)) <= 64 else f"crc32:{zlib.crc32(json.dumps(v, default=str).encode())}")
                 for k, v in fields.items()}
        text = json.dumps(short, sort_keys=True, default=str).encode()[:_AGREE_BYTES]
    return text


class RankMismatchError(ValueError):
    """Ranks of one group called a collective module with inputs or settings that do not agree."""


def all_gather_text(group, text: str, device: torch.device) -> list[str]:
    """Every rank's ``text`` (at most ``_AGREE_BYTES`` bytes of UTF-8 each), in rank order: one
    all-gather of a small buffer and one host synchronisation."""
    _, p = rank_and_size(group)
    payload = text.encode()[:_AGREE_BYTES]
    buf = torch.zeros(_AGREE_BYTES + 2, dtype=torch.uint8)
    buf[0], buf[1] = len(payload) // 256, len(payload) % 256
    if payload:
        buf[2:2 + len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    if p == 1:
        return [payload.decode(errors="replace")]
    buf = buf.to(device if device.type == "cuda" else torch.device("cpu"))
    parts = [torch.empty_like(buf) for _ in range(p)]
    dist.all_gather(parts, buf, group=group)
    texts = []
    for t in parts:
        t = t.cpu()
        n = int(t[0]) * 256 + int(t[1])
        texts.append(bytes(t[2:2 + n].tolist()).decode(errors="replace"))
    return texts


def group_device(group) -> torch.device:
    """Where ``group``'s collectives take tensors: this rank's GPU for NCCL, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if nccl_group(group) else torch.device("cpu")


def check_ranks_agree(group, fields: dict, device: torch.device, what: str) -> None:
    """Raise :class:`RankMismatchError` on every rank of ``group`` unless all ranks pass equal
    ``fields`` (shapes, dtype, layout, causal, schedule, ...). One all-gather of a small buffer and
    one host synchronisation: callers do it once per new input signature, not per step. A field
    ``"error"`` carries a rank's own validation failure, so that the others stop too instead of
    waiting for it in the next collective."""
    rank, p = rank_and_size(group)
    if p == 1:
        if "error" in fields:
            raise RankMismatchError(f"{what}: {fields['error']}")
        return
    decoded = [json.loads(t) for t in all_gather_text(group, _encode(fields).decode(), device)]
    errors = [(r, d["error"]) for r, d in enumerate(decoded) if "error" in d]
    if errors:
        raise RankMismatchError(f"{what}: " + "; ".join(f"rank {r}: {e}" for r, e in errors))
    keys = sorted({k for d in decoded for k in d})
    differ = [k for k in keys if any(d.get(k) != decoded[0].get(k) for d in decoded)]
    if differ:
        lines = [f"{k}: " + ", ".join(f"rank {r} {d.get(k)}" for r, d in enumerate(decoded)) for k in differ]
        raise RankMismatchError(f"{what}: the ranks of the group disagree on {', '.join(differ)} "
                                f"(every rank must pass inputs of one shape, dtype and layout and the same "
                                f"settings): " + "; ".join(lines))


class AgreedSignatures:
    """The input signatures a module's ranks have agreed on: the most recent ``capacity`` of them
    (digests, not the signatures), so that a training run whose packed documents change every step
    holds a bounded record, not one entry per step. A signature dropped from it is checked again
    when it comes back."""

    def __init__(self, capacity: int = 64):
        self.capacity = capacity
        self._seen: OrderedDict = OrderedDict()

    @staticmethod
    def _digest(key: str) -> bytes:
        return hashlib.sha256(key.encode()).digest()

    def __contains__(self, key: str) -> bool:
        digest = self._digest(key)
        if digest in self._seen:
            self._seen.move_to_end(digest)
            return True
        return False

    def add(self, key: str) -> None:
        digest = self._digest(key)
        self._seen[digest] = None
        self._seen.move_to_end(digest)
        while len(self._seen) > self.capacity:
            self._seen.popitem(last=False)

    def __len__(self) -> int:
        return len(self._seen)


_HOST_GROUPS: dict = {}  # ranks -> a gloo group of them (the per-call digest travels there)
_DEVICE_CHECKED: set = set()  # groups told once that their per-call check waits for the GPU


def host_group(group):
    """A group of ``group``'s ranks whose collectives of CPU tensors run on the host, so that the
    per-call check makes no GPU work and no host wait for the GPU; ``None`` where none can be had.

    ``group`` itself where it has a gloo backend (``"gloo"``, ``"cpu:gloo,cuda:nccl"``). For an NCCL
    group of every rank of the world, a gloo group made once by all of them (every rank of the world
    calls the module, so ``new_group``'s rule that every rank calls it in one order holds). An NCCL
    group of some of the world's ranks gets ``None``: only its ranks call, and a gloo group made by
    them alone (``use_local_synchronization``) is named after how many groups each rank has made, so
    ranks that made different numbers of groups before would wait for each other forever. Such a
    group made with ``backend="cpu:gloo,cuda:nccl"`` has its own host backend."""
    if "gloo" in dist.get_backend(group):
        return dist.group.WORLD if group is None else group  # None would read as "no host group"
    ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    if len(ranks) < dist.get_world_size():
        return None
    key = (dist.group.WORLD, ranks)  # the world object itself: a world made again is another key
    if key not in _HOST_GROUPS:
        _HOST_GROUPS[key] = dist.new_group(list(ranks), backend="gloo")
    return _HOST_GROUPS[key]


def host_and_device_backend() -> str | None:
    """The backend to make a subgroup with so that :func:`host_group` finds a host backend in it:
    ``"cpu:gloo,cuda:nccl"`` in an NCCL-only world, else ``None`` (the world's own)."""
    return "cpu:gloo,cuda:nccl" if dist.get_backend() == "nccl" else None


def _same_everywhere(group, key: str, known: bool) -> bool:
    """Whether every rank of ``group`` has this ``key`` and has agreed on it before: one all-reduce
    of 24 bytes (the key's digest, its negation and a flag), made by every rank on every call, so
    that the ranks take the same path whatever each has seen before. On the host where the group
    has a host group (:func:`host_group`); else on the GPU, whose result the host then waits for
    (said once per group, with the fix)."""
    digest = int.from_bytes(hashlib.sha256(key.encode()).digest()[:7], "big")  # < 2**56: an int64
    t = torch.tensor([digest, -digest, 0 if known else 1], dtype=torch.int64)
    host = host_group(group)
    if host is not None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=host)
    else:
        ranks = tuple(dist.get_process_group_ranks(group))
        if ranks not in _DEVICE_CHECKED:
            _DEVICE_CHECKED.add(ranks)
            warnings.warn(f"the process group of ranks {list(ranks)} is NCCL only and not the whole world: each "
                          f"call's agreement check waits for the GPU; make the group with "
                          f"dist.new_group(ranks, backend='cpu:gloo,cuda:nccl') to keep it on the host",
                          stacklevel=4)
        on_device = t.to(group_device(group))
        dist.all_reduce(on_device, op=dist.ReduceOp.MAX, group=group)
        t = on_device.cpu()
    return int(t[0]) == digest and -int(t[1]) == digest and int(t[2]) == 0


def validate_on_all_ranks(group, checked: AgreedSignatures, what: str, validate):
    """Run ``validate() -> (result, fields)`` on this rank and make every rank of ``group`` agree
    before any collective of the call. Every call, every rank compares a digest of its ``fields``
    (the call's signature) with the others' (:func:`_same_everywhere`: a few bytes on the host);
    where they differ, a rank has not agreed on them before, or validation failed somewhere, all
    ranks make the full :func:`check_ranks_agree`. A rank whose own validation failed raises its
    error; the others raise :class:`RankMismatchError` naming it. Returns ``result``."""
    try:
        result, fields = validate()
        err = None
    except (ValueError, TypeError, RuntimeError) as e:
        result, fields, err = None, {"error": f"{type(e).__name__}: {e}"}, e
    key = json.dumps(fields, sort_keys=True, default=str)
    if rank_and_size(group)[1] > 1 and _same_everywhere(group, key, err is None and key in checked):
        return result
    try:
        check_ranks_agree(group, fields, group_device(group), what)
    except RankMismatchError:
        if err is not None:
            raise err
        raise
    if err is not None:
        raise err
    checked.add(key)
    return result


def signature(q, k, v, **settings) -> dict:
    """The fields ranks must agree on for one call: shapes, dtype, device type and ``settings``."""
    return {"q": list(q.shape), "k": list(k.shape), "v": list(v.shape), "dtype": str(q.dtype),
            "device": q.device.type, **settings}
