"""A CPU stand-in for yunchang 0.6.4 (the parts the benchmark's adapter calls), with its real
interface: ``set_seq_parallel_pg(sp_ulysses_degree, sp_ring_degree, rank, world_size)``, which
fills ``yunchang.globals.PROCESS_GROUP``, and ``LongContextAttention(ring_impl_type, attn_type)``
on contiguous shards ``[B, N/P, H, D]``. It gathers the sequence and runs torch's SDPA, so a
caller that hands it another layout, or drops ``causal``, gets a wrong answer.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.distributed._functional_collectives as fc

from .globals import PROCESS_GROUP, set_seq_parallel_pg  # noqa: F401
from .kernels import AttnType

__version__ = "0.6.4"
RING_IMPL_DICT = {"basic", "zigzag", "strip", "basic_pytorch", "basic_flashinfer", "basic_npu"}


class LongContextAttention(torch.nn.Module):
    def __init__(self, scatter_idx=2, gather_idx=1, ring_impl_type="basic", use_pack_qkv=False, use_sync=False,
                 attn_type=AttnType.FA, attn_processor=None):
        super().__init__()
        assert ring_impl_type in RING_IMPL_DICT and isinstance(attn_type, AttnType)
        assert PROCESS_GROUP.ULYSSES_PG is not None, "use set_seq_parallel_pg() first"
        self.ring_impl_type, self.attn_type = ring_impl_type, attn_type

    def forward(self, query, key, value, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *args):
        rank, p = dist.get_rank(), dist.get_world_size()
        gather = getattr(fc, "all_gather_single_autograd", None) or fc.all_gather_tensor_autograd
        # the sequence gathered along dim 0, where the newer gather works; then [B, H, N, D]
        q, k, v = (gather(t.transpose(0, 1).contiguous(), 0, dist.group.WORLD).permute(1, 2, 0, 3).float()
                   for t in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=softmax_scale,
                                             enable_gqa=k.shape[1] != q.shape[1])
        return out.transpose(1, 2).chunk(p, dim=1)[rank].to(query.dtype)
