"""Process groups and sequence sharding for the distributed implementations.

``init_distributed()`` works under torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) and
under srun (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID), picks NCCL on GPUs and gloo on CPUs, and
sets a process-group timeout so that a dead rank ends the job with an error instead of a hang.

Layouts along the sequence dimension:

* ``contiguous``: rank r holds chunk r of P.
* ``zigzag``: the sequence is cut into 2P chunks and rank r holds chunks r and 2P-1-r, so that
  causal work is balanced across ranks.
* a :class:`~dilated.DocumentLayout`: packed documents placed so that every rank's work within
  the documents is equal (see :mod:`dilated.parallel.document_layout`).
"""
from __future__ import annotations

import contextlib
import datetime
import os
import time
import zlib

import torch
import torch.distributed as dist

from .document_layout import DocumentLayout

LAYOUTS = ("contiguous", "zigzag")

#: one all-gather into one tensor and one reduce-scatter from one (torch renamed them ``*_single``)
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_from = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CommStats:
    """What a rank's attention module communicated: point-to-point messages, collectives, bytes
    sent, and (``measure=True``) the time its compute stream stalled waiting on communication.
    A copy-engine pull (:mod:`dilated.parallel.peer_copy`) counts as one message of the bytes pulled: the
    bytes its owner would have sent.

    The stall is measured with CUDA events around each wait, read lazily (no synchronisation per
    wait), so measuring does not change what it measures; on CPU it is wall time in the waits.
    """

    def __init__(self, measure: bool = False):
        self.measure = measure
        self.reset()

    def reset(self):
        self.messages = 0
        self.collectives = 0
        self.bytes_sent = 0
        self.steps = 0
        self._cpu_ms = 0.0
        self._events = []

    def sent(self, nbytes: int, collective: bool = False):
        if collective:
            self.collectives += 1
        else:
            self.messages += 1
        self.bytes_sent += int(nbytes)

    @contextlib.contextmanager
    def waiting(self, device: torch.device):
        if not self.measure:
            yield
            return
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((start, end))
        else:
            t = time.perf_counter()
            yield
            self._cpu_ms += (time.perf_counter() - t) * 1e3

    @property
    def exposed_ms(self) -> float:
        for start, end in self._events:
            end.synchronize()
            self._cpu_ms += start.elapsed_time(end)
        self._events = []
        return self._cpu_ms

    def as_dict(self) -> dict:
        return {"p2p_messages": self.messages, "collectives": self.collectives, "bytes_sent": self.bytes_sent,
                "exposed_comm_ms": self.exposed_ms if self.measure else None, "ring_steps": self.steps}


def _check_one_gpu_per_rank(local_ranks: int, gpus: int, backend: str | None) -> None:
    """NCCL needs a GPU of its own per rank: two ranks on one GPU fail inside NCCL ("Duplicate GPU detected").

    ``local_ranks`` is torchrun's LOCAL_WORLD_SIZE, whose ranks all see the same GPUs (srun may give each
    task GPUs of its own, so its task count is not checked here).
    """
    if (backend or "nccl") == "nccl" and local_ranks > gpus:
        raise RuntimeError(f"{local_ranks} ranks on this node but {gpus} GPU(s) visible, and NCCL needs one GPU "
                           f"per rank: start {gpus} rank(s) per node (torchrun --nproc_per_node={gpus}), or "
                           "pass backend='gloo' to run on the CPU")


#: the variable that makes torch's NCCL process groups issue on high-priority streams
NCCL_HIGH_PRIORITY = "TORCH_NCCL_HIGH_PRIORITY"


def init_distributed(timeout_s: float = 300.0, backend: str | None = None,
                     nccl_high_priority: bool = True) -> tuple[int, int, torch.device]:
    """Initialise the default group from the environment; return ``(rank, world_size, device)``.

    ``nccl_high_priority``: on NCCL, the process groups (this one and those made after it) issue on
    high-priority streams (``TORCH_NCCL_HIGH_PRIORITY=1``, where the variable is not set already):
    a communication kernel that becomes ready together with a compute kernel then gets the SMs first,
    so an exchange issued beside an attention kernel that fills every SM (flash-attn 4's) runs beside
    it instead of after it (docs/performance/context-parallel.md)."""
    env = os.environ
    if "RANK" not in env and "SLURM_PROCID" in env:  # srun without torchrun
        env.setdefault("RANK", env["SLURM_PROCID"])
        env.setdefault("WORLD_SIZE", env["SLURM_NTASKS"])
        env.setdefault("LOCAL_RANK", env.get("SLURM_LOCALID", "0"))
    rank, world = int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))
    local = int(env.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and backend != "gloo"
    if use_cuda:
        _check_one_gpu_per_rank(int(env.get("LOCAL_WORLD_SIZE", "1")), torch.cuda.device_count(), backend)
    device = torch.device("cuda", local % torch.cuda.device_count()) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if use_cuda and (backend or "nccl") == "nccl" and nccl_high_priority:
            env.setdefault(NCCL_HIGH_PRIORITY, "1")
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", "29500")
        dist.init_process_group(backend or ("nccl" if use_cuda else "gloo"), rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=device if use_cuda else None)
    return dist.get_rank(), dist.get_world_size(), device


def rank_and_size(group) -> tuple[int, int]:
    """This rank's index in ``group`` and the group's size; ``(0, 1)`` without a process group."""
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def nccl_group(group) -> bool:
    """Whether ``group`` runs collectives of CUDA tensors on NCCL: a group of backend ``"nccl"``, or
    of several backends one of which is NCCL (``"cpu:gloo,cuda:nccl"``)."""
    return dist.is_initialized() and "nccl" in dist.get_backend(group)


def _check_layout(layout, n, p):
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    parts = 2 * p if layout == "zigzag" else p
    if n % parts:
        raise ValueError(f"sequence length {n} must be divisible by {parts} "
                         f"({'2 x ' if layout == 'zigzag' else ''}world size {p}) for layout={layout!r}")


def _check_document_layout(layout: DocumentLayout, n: int, p: int) -> None:
    if layout.world_size != p or layout.seq_len != n:
        raise ValueError(f"layout: a DocumentLayout of {layout.seq_len} positions over {layout.world_size} ranks, "
                         f"but the tensor has {n} positions over {p} ranks: build it from this batch's cu_seqlens "
                         "and this group")


def shard(x: torch.Tensor, group=None, layout: str | DocumentLayout = "contiguous", dim: int = 1) -> torch.Tensor:
    """This rank's part of the full tensor ``x`` along ``dim``."""
    rank, p = rank_and_size(group)
    if isinstance(layout, DocumentLayout):
        _check_document_layout(layout, x.shape[dim], p)
        return x.index_select(dim, layout.positions(rank, x.device)).contiguous()
    _check_layout(layout, x.shape[dim], p)
    if layout == "contiguous":
        return x.chunk(p, dim)[rank].contiguous()
    chunks = x.chunk(2 * p, dim)
    return torch.cat([chunks[rank], chunks[2 * p - 1 - rank]], dim).contiguous()


_MAX_DIMS = 8


def _check_same_shards(x: torch.Tensor, group, p: int) -> None:
    """Every rank's shard must have one shape and dtype before they are gathered (an all-gather
    of different sizes aborts or hangs): one small all-gather; a ValueError on every rank naming
    each rank's shard otherwise."""
    if x.dim() > _MAX_DIMS:
        raise ValueError(f"unshard takes tensors of at most {_MAX_DIMS} dimensions, got {x.dim()}")
    code = zlib.crc32(str(x.dtype).encode())
    meta = torch.tensor([x.dim(), code, *x.shape] + [0] * (_MAX_DIMS - x.dim()), dtype=torch.int64)
    if nccl_group(group):
        meta = meta.to(x.device)
    metas = [torch.empty_like(meta) for _ in range(p)]
    dist.all_gather(metas, meta, group=group)
    metas = [m.tolist() for m in metas]
    if any(m != metas[0] for m in metas):
        shards = "; ".join(f"rank {r}: shape {tuple(m[2:2 + m[0]])}"
                           + ("" if m[1] == metas[0][1] else " (another dtype)") for r, m in enumerate(metas))
        raise ValueError(f"unshard: the ranks' shards differ ({shards}); every rank must pass its shard of one "
                         "global tensor, of one shape and dtype")


def unshard(x_local: torch.Tensor, group=None, layout: str | DocumentLayout = "contiguous",
            dim: int = 1) -> torch.Tensor:
    """All-gather the shards and put the full sequence back in order (differentiable is not needed here)."""
    rank, p = rank_and_size(group)
    if isinstance(layout, DocumentLayout):
        _check_document_layout(layout, x_local.shape[dim] * p, p)
        whole = x_local if p == 1 else None
        if whole is None:
            _check_same_shards(x_local, group, p)
            parts = [torch.empty_like(x_local) for _ in range(p)]
            dist.all_gather(parts, x_local.contiguous(), group=group)
            whole = torch.cat(parts, dim)
        return torch.empty_like(whole).index_copy_(dim, layout.order(whole.device), whole)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if p == 1:
        return x_local
    _check_same_shards(x_local, group, p)
    parts = [torch.empty_like(x_local) for _ in range(p)]
    dist.all_gather(parts, x_local.contiguous(), group=group)
    if layout == "contiguous":
        return torch.cat(parts, dim)
    halves = [t.chunk(2, dim) for t in parts]
    ordered = [halves[i][0] for i in range(p)] + [halves[i][1] for i in reversed(range(p))]
    return torch.cat(ordered, dim)
