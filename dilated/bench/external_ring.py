"""Other people's ring attention as benchmark implementations, on the same shards as ours.

* ``torch_cp``: PyTorch's context parallel attention
  (``torch.distributed.tensor.experimental.context_parallel``), which patches
  ``F.scaled_dot_product_attention`` with a ring over a device mesh; its backward runs inside the
  same context (:meth:`TorchContextParallel.step_context`). Packed documents run its flex_attention
  path with its per-document balancer (:class:`TorchContextParallelDocuments`). Causal runs use its
  head-tail load balancing, whose shard layout is our ``zigzag``; non-causal runs turn load
  balancing off (PyTorch refuses non-causal with it on), which is our ``contiguous``. The local
  kernel is pinned with ``sdpa_kernel`` to the SDPA kernel our backend name resolves to, so
  both rings run the same kernel; where it resolves to ``sdpa`` (``auto`` often does), PyTorch
  picks the kernel in both. GQA goes through SDPA's ``enable_gqa``, so its ring moves the fewer
  k/v heads, as ours does. CUDA only: its ring dispatches the CUDA SDPA kernels.
* ``ring_flash_attn`` / ``ring_flash_attn_zigzag``: zhuzilin's ring-flash-attention
  (``ring_flash_attn_func`` / ``zigzag_ring_flash_attn_func`` on ``[B, N/P, H, D]`` shards),
  when installed. It needs flash-attn; written against its published signature.
* ``yunchang_usp`` / ``yunchang_ulysses``: yunchang's ``LongContextAttention`` (``pip install
  yunchang``, 0.6.x) on contiguous shards: USP (Ulysses inside groups of consecutive ranks, its
  ``basic`` ring across them, on our hybrid's grid) and Ulysses over every rank. It runs
  flash-attn 2 where yunchang imports it; otherwise its torch ring on torch's flash kernel, which
  has no backward and no GQA in yunchang 0.6.4 (such rows say so). yunchang keeps its process
  groups in a process-wide singleton set by ``set_seq_parallel_pg`` for the whole launched world,
  so its rows run at the launched world size only (smaller ``--world-sizes`` say so). Written
  against its published API (0.6.4).
"""
from __future__ import annotations

import contextlib
import importlib.util

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dilated.backends import get_backend

from .distributed import DistributedImplementation
from .registry import register_implementation
from .workload import grid_work_per_rank, ulysses_size_for

_SDPA_KERNELS = {"sdpa_cudnn": "CUDNN_ATTENTION", "sdpa_flash": "FLASH_ATTENTION",
                 "sdpa_efficient": "EFFICIENT_ATTENTION", "sdpa_math": "MATH"}


def torch_cp_unavailable() -> str | None:
    """Why PyTorch's context parallel cannot run here, or None."""
    try:
        from torch.distributed.tensor.experimental import context_parallel  # noqa: F401
        from torch.distributed.tensor.experimental._attention import _cp_options  # noqa: F401
    except ImportError as e:
        return f"this torch ({torch.__version__}) has no context_parallel: {e}"
    if not torch.cuda.is_available():
        return "PyTorch's context parallel rings the CUDA SDPA kernels only (no CPU path)"
    return None


class TorchContextParallel(nn.Module):
    """``forward(q, k, v)`` on shards ``[B, N/P, H, D]`` (zigzag when causal, else contiguous),
    called inside :meth:`step_context`, which holds the forward and the backward of a step.

    PyTorch's context parallel dispatches SDPA's ops to its ring while its context is entered;
    a backward run after leaving it runs the local kernel's backward alone and computes wrong
    gradients. torchtitan keeps the whole training step (forward, loss, backward) inside it, and
    so does the harness: a model's ``step_context()`` spans each timed call
    (:meth:`dilated.bench.runner._RowRun.step_context`). A forward outside it raises.
    """

    def __init__(self, causal: bool, backend: str, group=None):
        super().__init__()
        from torch.distributed.device_mesh import DeviceMesh

        reason = torch_cp_unavailable()
        if reason:
            raise NotImplementedError(reason)
        self.causal, self.backend = causal, backend
        self.entered = 0
        # from the existing group: building a mesh from ranks would create groups, a collective
        # that ranks outside this run's sub-group never join
        self.mesh = DeviceMesh.from_group(group if group is not None else dist.group.WORLD, "cuda")

    @contextlib.contextmanager
    def step_context(self):
        """PyTorch's ``context_parallel`` for one step, forward and backward. It shards its buffers
        on entry: a two-element dummy keeps that to nothing. Its load balancer follows
        ``_cp_options``, a process-wide option set here per step (causal -> head-tail) and restored."""
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import _cp_options

        before = _cp_options.enable_load_balance
        _cp_options.enable_load_balance = self.causal
        self.entered += 1
        try:
            dummy = torch.zeros(2 * self.mesh.size(), device="cuda")
            with context_parallel(self.mesh, buffers=[dummy], buffer_seq_dims=[0], no_restore_buffers={dummy}):
                yield
        finally:
            self.entered -= 1
            _cp_options.enable_load_balance = before

    def forward(self, q, k, v):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if not self.entered:
            raise RuntimeError("TorchContextParallel runs inside its step_context() (forward and backward): "
                               "outside it PyTorch's SDPA is not its ring")
        name = get_backend(self.backend, q, k, self.causal).name
        if name != "sdpa" and name not in _SDPA_KERNELS:
            raise NotImplementedError(f"torch context parallel runs SDPA kernels only, not backend {name!r}")
        # "sdpa": PyTorch picks the kernel, as our sdpa backend lets it; a pinned forward kernel
        # pins its backward too (autograd records the op that ran)
        pinned = contextlib.nullcontext() if name == "sdpa" else sdpa_kernel(getattr(SDPBackend, _SDPA_KERNELS[name]))
        with pinned:
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=self.causal, enable_gqa=k.shape[2] != q.shape[2])
        return out.transpose(1, 2)


class TorchContextParallelDocuments(nn.Module):
    """PyTorch's context parallel for packed documents, as its authors document it: flex_attention
    with a document block mask (causal within each document, or each document's full square),
    the module parallelized with ``_ContextParallel(attention_type=FLEX)`` (K/V all-gathered) and
    the sequence laid out by ``_PerDocumentHeadTailLoadBalancer`` (each document cut into 2P chunks,
    head and tail chunks paired). ``forward(q, k, v)`` on this rank's ``[B, N/P, H, D]`` shard of
    that layout; :meth:`unshard` puts a shard back in sequence order. The block mask is built and
    sharded once per document mix (here: at build), outside the timed calls. flex_attention is
    compiled on CUDA (as PyTorch runs it) and eager on CPU, where it has no backward."""

    def __init__(self, case, group=None):
        super().__init__()
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor.experimental._attention import (
            _context_parallel_shard, _ContextParallel, _PerDocumentHeadTailLoadBalancer)
        from torch.distributed.tensor.parallel import parallelize_module
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        from .documents import cu_seqlens_of

        group = group if group is not None else dist.group.WORLD
        p = dist.get_world_size(group)
        cu = cu_seqlens_of(case.documents, case.seq_len)
        lengths = [b - a for a, b in zip(cu, cu[1:])]
        odd = [n for n in lengths if n % (2 * p)]
        if odd:
            raise NotImplementedError(
                f"PyTorch's per-document head-tail balancer needs every document's length to be a multiple of "
                f"2P = {2 * p}: {len(odd)} of the {len(lengths)} documents of {case.documents} are not "
                f"(e.g. {odd[0]}); fixed-length documents of such a length run")
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else \
            torch.device("cpu")
        self.mesh = DeviceMesh.from_group(group, device.type)
        self.balancer = _PerDocumentHeadTailLoadBalancer([lengths], p, device)
        self.cu, self.causal, self.gqa, self.checked = cu, case.causal, case.kv_heads != case.num_heads, False
        doc = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))
        causal = case.causal

        def same_document(b, h, q_idx, kv_idx):
            inside = doc[q_idx] == doc[kv_idx]
            return inside & (q_idx >= kv_idx) if causal else inside

        # compiled on CUDA (its ``_compile``): eager, it materializes the N x N mask, a terabyte at 1M
        mask = create_block_mask(same_document, B=1, H=1, Q_LEN=case.seq_len, KV_LEN=case.seq_len, device=device,
                                 _compile=device.type == "cuda")
        (self.block_mask,) = _context_parallel_shard(self.mesh, [mask], [2], load_balancer=self.balancer)
        attend = torch.compile(flex_attention) if device.type == "cuda" else flex_attention

        class Flex(nn.Module):
            def forward(self, *args, **kwargs):
                return attend(*args, **kwargs)

        self.flex = parallelize_module(Flex(), self.mesh, _ContextParallel(
            seq_dim=2, attention_type=_ContextParallel.AttentionType.FLEX))

    def forward(self, q, k, v, cu_seqlens=None):
        if cu_seqlens is not None and not self.checked:  # once: a read of the lengths is a host sync
            if tuple(int(x) for x in cu_seqlens.tolist()) != self.cu:
                raise ValueError("TorchContextParallelDocuments: cu_seqlens differ from the documents it was built for")
            self.checked = True
        out = self.flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=self.block_mask,
                        enable_gqa=self.gqa)
        return out.transpose(1, 2)

    def unshard(self, x_local):
        """A ``[B, N/P, ...]`` shard of the balancer's layout, gathered in sequence order."""
        from torch.distributed.tensor.experimental._attention import context_parallel_unshard

        (full,) = context_parallel_unshard(self.mesh, [x_local.contiguous()], [1], load_balancer=self.balancer)
        return full


def _ring_flash_attn(zigzag: bool):
    def factory(case, backend, group):
        if importlib.util.find_spec("ring_flash_attn") is None:
            raise NotImplementedError("ring-flash-attn is not installed (pip install ring-flash-attn; needs flash-attn)")
        import ring_flash_attn as rfa

        fn = rfa.zigzag_ring_flash_attn_func if zigzag else rfa.ring_flash_attn_func

        class RingFlashAttn(nn.Module):
            def forward(self, q, k, v):
                return fn(q, k, v, causal=case.causal, group=group)

        return RingFlashAttn()

    return factory


def _torch_cp(case, backend, group):
    if case.documents:
        return TorchContextParallelDocuments(case, group)
    return TorchContextParallel(case.causal, backend, group)


class _CausalLayout(DistributedImplementation):
    """Shards in zigzag for causal cases and contiguous otherwise (PyTorch's CP convention); for
    packed documents, PyTorch's per-document head-tail layout (gathered by the model's unshard)."""

    def inputs(self, case, device, gen, requires_grad, captured=None):
        self.layout = "per_document" if case.documents else ("zigzag" if case.causal else "contiguous")
        return super().inputs(case, device, gen, requires_grad, captured)


def _yunchang(grid):
    """A factory of yunchang's ``LongContextAttention`` on ``grid(p, heads)`` = its Ulysses size."""

    def factory(case, backend, group):
        if importlib.util.find_spec("yunchang") is None:
            raise NotImplementedError("yunchang is not installed (pip install yunchang)")
        if group is not None:
            raise NotImplementedError("yunchang sets its process groups for the whole launched world: it runs at "
                                      "the launched world size only")
        try:
            import yunchang
            from yunchang import LongContextAttention, set_seq_parallel_pg
            from yunchang.globals import HAS_FLASH_ATTN
            from yunchang.kernels import AttnType
        except Exception as e:  # noqa: BLE001 - an install that does not import is a row's reason
            raise NotImplementedError(f"yunchang does not import here: {type(e).__name__}: {e}") from None
        p = dist.get_world_size()
        ulysses = grid(p, case.num_heads)
        if case.num_heads % ulysses or case.kv_heads % ulysses:
            raise NotImplementedError(f"yunchang's Ulysses of {ulysses} ranks splits the heads: H={case.num_heads}, "
                                      f"H_kv={case.kv_heads} must both divide by it")
        # flash-attn 2 where yunchang found it (flash-attn 4 alone, the package flash_attn.cute, is not
        # it); else its torch ring, on torch's flash kernel, whose backward yunchang does not implement
        if not HAS_FLASH_ATTN:
            if case.mode != "fwd":
                raise NotImplementedError(f"yunchang {yunchang.__version__} without flash-attn 2: its torch "
                                          "attention has no backward (pytorch_attn_backward raises)")
            if case.kv_heads != case.num_heads:
                raise NotImplementedError("yunchang without flash-attn 2: its torch attention (torch's flash "
                                          "kernel) needs as many k/v heads as query heads")
        _yunchang_groups(set_seq_parallel_pg, ulysses, p)
        layer = (LongContextAttention(ring_impl_type="basic", attn_type=AttnType.FA) if HAS_FLASH_ATTN
                 else LongContextAttention(ring_impl_type="basic_pytorch", attn_type=AttnType.TORCH_FLASH))

        class Yunchang(nn.Module):
            def forward(self, q, k, v):
                if not HAS_FLASH_ATTN and q.device.type != "cuda":
                    raise NotImplementedError("yunchang without flash-attn 2 runs torch's CUDA flash kernel "
                                              "(aten::_scaled_dot_product_flash_attention): CUDA only")
                return layer(q, k, v, causal=case.causal)

        return Yunchang()

    return factory


_YUNCHANG_GROUPS: dict = {}  # (world group, Ulysses size) -> yunchang's (Ulysses, ring) groups


def _yunchang_groups(set_seq_parallel_pg, ulysses: int, p: int) -> None:
    """yunchang's process-wide groups for a grid, made once per grid: ``set_seq_parallel_pg``
    creates new groups (communicators) on every call, and each row builds a layer."""
    from yunchang.globals import PROCESS_GROUP

    key = (dist.group.WORLD, ulysses)  # the group itself: a new world is a new key
    if key not in _YUNCHANG_GROUPS:
        set_seq_parallel_pg(ulysses, p // ulysses, dist.get_rank(), p)
        _YUNCHANG_GROUPS[key] = PROCESS_GROUP.ULYSSES_PG, PROCESS_GROUP.RING_PG
    PROCESS_GROUP.ULYSSES_PG, PROCESS_GROUP.RING_PG = _YUNCHANG_GROUPS[key]


def _usp_grid(p, heads):
    return ulysses_size_for(p, heads) or 1


class _YunchangUSP(DistributedImplementation):
    """yunchang's USP on contiguous shards: Ulysses over consecutive ranks, its basic ring across."""

    def work_per_rank(self, case, p, backend="auto"):
        if case.documents:
            return None
        return grid_work_per_rank(case, p, _usp_grid(p, case.num_heads), "contiguous")


EXTERNAL_RINGS = {
    "torch_cp": _CausalLayout("torch_cp", "dense", None, "PyTorch context_parallel (ring over SDPA; packed "
                              "documents: flex_attention with its per-document head-tail balancer)",
                              factory=_torch_cp, takes_documents=True),
    "ring_flash_attn": DistributedImplementation("ring_flash_attn", "dense", None, "ring-flash-attn ring_flash_attn_func",
                                                 factory=_ring_flash_attn(False)),
    "ring_flash_attn_zigzag": DistributedImplementation("ring_flash_attn_zigzag", "dense", None,
                                                        "ring-flash-attn zigzag_ring_flash_attn_func",
                                                        layout="zigzag", factory=_ring_flash_attn(True)),
    "yunchang_usp": _YunchangUSP("yunchang_usp", "dense", None,
                                              "yunchang LongContextAttention (USP: Ulysses x basic ring, our "
                                              "hybrid's grid; on 2 ranks a ring of 2)", factory=_yunchang(_usp_grid)),
    "yunchang_ulysses": DistributedImplementation("yunchang_ulysses", "dense", None,
                                                  "yunchang LongContextAttention as Ulysses over every rank",
                                                  factory=_yunchang(lambda p, heads: p), splits_heads=True),
}
for _impl in EXTERNAL_RINGS.values():
    register_implementation(_impl)
