"""Copy-engine transfers between the GPUs of one host, over PyTorch's symmetric memory.

A rank *publishes* tensors into a symmetric buffer of its process group; any peer then *pulls*
row ranges of them into its own memory with ``copy_`` from a view of the owner's buffer. Such a
copy is a device-to-device ``cudaMemcpyAsync``: the GPU's copy engines move the bytes over
NVLink and no SM runs a communication kernel. That matters when the transfer is meant to hide
under an attention kernel: NCCL's send/recv kernels compete with it for SMs, so a block sent
during a kernel lengthens it about as much as not overlapping at all, where a copy-engine pull
from a high-priority stream lengthens it far less (measured: docs/performance-log.md).

Only for CUDA tensors of NCCL groups whose ranks share one host (:func:`prepare` sets the group's
buffer up, or says why not; callers then fall back to point-to-point messages). The group's barrier (a tiny kernel in
stream order) fences each publication: one before writing (peers have finished pulling the last
publication) and one after (the new one is complete everywhere).
"""
from __future__ import annotations

import importlib.util
import socket
import warnings

import torch
import torch.distributed as dist

_BARRIER_TIMEOUT_MS = 10 * 60 * 1000  # a dead peer ends the job instead of hanging the GPU forever
_WORKSPACES: dict = {}  # (group name, device index) -> (bytes tensor, handle), or why none
_RENDEZVOUS = {"count": 0}  # symmetric-memory rendezvous this process has done
_SIDE: dict = {}  # device index -> high-priority stream for pulls


def _group_name(group) -> str:
    return (group or dist.group.WORLD).group_name


def prepare(group, device: torch.device, nbytes: int) -> str | None:
    """Set up ``group``'s symmetric buffer for publications of ``nbytes`` per rank and return
    None, or return why copy-engine pulls cannot serve it here. Collective: every rank of the
    group calls it with the same ``nbytes``; a refusal is remembered per group and device."""
    if device.type != "cuda":
        return "copy-engine pulls need CUDA tensors"
    if "nccl" not in dist.get_backend(group):
        return f"copy-engine pulls need an NCCL group, this one is {dist.get_backend(group)}"
    if importlib.util.find_spec("torch.distributed._symmetric_memory") is None:  # pragma: no cover
        return "this torch has no symmetric memory (torch.distributed._symmetric_memory)"
    key = (_group_name(group), device.index)
    ws = _WORKSPACES.get(key)
    if isinstance(ws, str):
        return ws
    if ws is not None and ws[0].numel() >= nbytes:
        return None
    # Before a (new) buffer: the ranks must share one host, and must have set up symmetric memory
    # equally often so far: torch's rendezvous numbers its exchanges per process, not per group,
    # so a subgroup whose ranks disagree would wait forever (it happens when a subset of the world
    # rendezvoused on a smaller group first).
    seen = [None] * dist.get_world_size(group)
    dist.all_gather_object(seen, (socket.gethostname(), _RENDEZVOUS["count"]), group=group)
    if len({h for h, _ in seen}) > 1:
        _WORKSPACES[key] = "the group spans hosts (symmetric memory maps the peers of one host)"
    elif len({c for _, c in seen}) > 1:
        _WORKSPACES[key] = (f"its ranks set up symmetric memory on other groups unequally before "
                            f"({[c for _, c in seen]} times): torch's rendezvous would wait forever")
    else:
        _new_workspace(key, group, nbytes, device)
        return None
    return _WORKSPACES[key]


def _new_workspace(key, group, nbytes: int, device: torch.device):
    import torch.distributed._symmetric_memory as symm_mem

    _WORKSPACES.pop(key, None)
    if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed by older torch, a no-op since
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(key[0])
    buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    _WORKSPACES[key] = (buf, symm_mem.rendezvous(buf, group or dist.group.WORLD))
    _RENDEZVOUS["count"] += 1


def held_bytes(device) -> int:
    """Bytes of symmetric buffers this process holds on ``device`` (every group's): device memory that
    torch's allocator statistics leave out (symmetric memory maps its own)."""
    index = torch.device(device).index
    return sum(ws[0].numel() * ws[0].element_size() for (_, i), ws in _WORKSPACES.items()
               if i == index and not isinstance(ws, str))


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The high-priority stream pulls are issued on (one per device)."""
    if device.index not in _SIDE:
        _SIDE[device.index] = torch.cuda.Stream(device, priority=-1)
    return _SIDE[device.index]


class Published:
    """``tensors`` (``[B, N, ...]``, one dtype) published by every rank of ``group``, contiguous in
    its buffer; :meth:`pull` copies rows of a peer's into local contiguous tensors on the current
    stream."""

    def __init__(self, group, tensors):
        dtype = tensors[0].dtype
        if any(t.dtype != dtype for t in tensors):
            raise ValueError("published tensors must be of one dtype")
        self.shapes = [t.shape for t in tensors]
        self.dtype = dtype
        self.offsets, total = [], 0
        for t in tensors:
            self.offsets.append(total)
            total += t.numel()
        buf, self.handle = _WORKSPACES[(_group_name(group), tensors[0].device.index)]
        if buf.numel() < total * dtype.itemsize:
            raise RuntimeError("call peer_copy.prepare(group, device, nbytes) before publishing")
        self.handle.barrier(channel=0, timeout_ms=_BARRIER_TIMEOUT_MS)  # peers are done with the last one
        for t, mine in zip(tensors, self.views(self.handle.rank)):
            mine.copy_(t)
        self.handle.barrier(channel=0, timeout_ms=_BARRIER_TIMEOUT_MS)  # everyone's is complete

    def views(self, rank: int) -> list[torch.Tensor]:
        """The published tensors of ``rank``, as views of its buffer."""
        return [self.handle.get_buffer(rank, tuple(s), self.dtype, storage_offset=o)
                for s, o in zip(self.shapes, self.offsets)]

    def pull(self, rank: int, rows: slice, out) -> int:
        """Copy ``[:, rows]`` of ``rank``'s tensors into ``out`` (same shapes); returns the bytes.
        Each copy is one contiguous range (one per batch row where a batch row is not)."""
        nbytes = 0
        for src, dst in zip(self.views(rank), out):
            if src.shape[0] == 1 or rows == slice(0, src.shape[1]):
                dst[:, rows].copy_(src[:, rows])
            else:
                for b in range(src.shape[0]):
                    dst[b, rows].copy_(src[b, rows])
            nbytes += dst[:, rows].numel() * dst.element_size()
        return nbytes
