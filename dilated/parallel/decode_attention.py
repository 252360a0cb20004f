"""Decoding against a KV cache sharded over ranks: a few query tokens, the cache's rows split along
the sequence over ``P`` ranks, each rank's partial attention merged by its log-sum-exp in one
collective.

Every rank holds the same query tokens and its own rows of the cache. It attends them alone
(``out_r``, ``lse_r``: one local kernel call over ``S_r`` keys, cut into chunks that fill the GPU
and merged by lse, as flash-decoding splits them), and one all-gather of the small
``(out_r, lse_r)`` (``B x Tq x H x (D + 1)`` float32 numbers per rank, float64 for float64
inputs, whatever the cache's length) gives every rank all ``P`` partial results, which it merges
exactly: ``out = sum_r exp(lse_r - L) out_r``, ``L = logsumexp_r lse_r``
(:func:`dilated.merge.merge_stacked`: a few kernels whatever ``P``). The cache never moves, so a
step costs one local pass over ``S / P`` keys and one collective of a few kilobytes, as Tree
Attention and pass-Q decoding do. A rank with no rows of the cache (``S_r = 0``) contributes ``lse = -inf``.

The query tokens attend every cached row: the keys and values of the tokens being decoded belong
in the cache (on any one rank) before the call. Inference only: no autograd across the ranks.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .._checks import acc_dtype
from ..functional import attention
from ..merge import empty_accumulators, merge_stacked
from .sharding import CommStats, all_gather_into


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a [batch, seq, heads, head_dim] tensor")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(f"this rank's cache rows k {tuple(k.shape)} and v {tuple(v.shape)} must match each "
                         f"other and q {tuple(q.shape)} in batch and head_dim")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"q's {q.shape[2]} heads must be a multiple of the cache's {k.shape[2]} kv heads")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise ValueError("decode_attention is for inference: call it under torch.no_grad() or "
                         "torch.inference_mode()")


#: a split of the keys keeps at least this many rows per chunk
MIN_CHUNK = 256
#: kernel programs a split aims for (chunks x batch x kv heads): a few per SM of a large GPU
TARGET_PROGRAMS = 512


def key_chunks(b: int, s: int, hkv: int) -> int:
    """Chunks of this rank's ``s`` keys that run as one kernel call's batch (flash-decoding's split):
    the largest power of two up to ``TARGET_PROGRAMS / (b * hkv)`` that divides ``s`` into chunks
    of at least :data:`MIN_CHUNK` rows (1: no split)."""
    c = 1
    while 2 * c * b * hkv <= TARGET_PROGRAMS and s % (2 * c) == 0 and s // (2 * c) >= MIN_CHUNK:
        c *= 2
    return c


def local_part(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, backend: str,
               split: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of ``q`` over this rank's rows alone: out ``[B, Tq, H, D]``, lse ``[B, Tq, H]``
    (row layout), float32 (float64 for float64 inputs); zeros and ``-inf`` where the rank holds no
    rows.

    One kernel call without copying the cache: each group of query heads sharing a kv head becomes
    rows of that kv head (``Tq x H / Hkv`` rows, no GQA expansion), and the keys are cut into
    ``split`` chunks (default :func:`key_chunks`) that are the call's batch (views of k and v, the
    few query rows repeated), merged by their lse."""
    dtype = acc_dtype(q.dtype)
    b, tq, h, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    if s == 0:
        return empty_accumulators(*q.shape, q.device, dtype)
    c = key_chunks(b, s, hkv) if split is None else split
    if isinstance(c, bool) or not isinstance(c, int) or c < 1 or s % c:
        raise ValueError(f"split must be a positive int dividing this rank's {s} cache rows, got {split!r}")
    g = h // hkv
    rows = q.view(b, tq, hkv, g, d).transpose(2, 3).reshape(b, 1, tq * g, hkv, d)  # row (t, j) of kv head i
    qc = rows.expand(b, c, tq * g, hkv, d).reshape(b * c, tq * g, hkv, d)
    kc, vc = (x.reshape(b * c, s // c, hkv, d) for x in (k, v))  # views where k, v are contiguous
    out, lse = attention(qc, kc, vc, scale=scale, backend=backend, return_lse=True)
    out, lse = out.view(b, c, tq * g, hkv, d), lse.to(dtype).view(b, c, hkv, tq * g)
    out, lse = merge_stacked(out.transpose(0, 1), lse.permute(1, 0, 3, 2))  # the chunks: [B, Tq g, Hkv(, D)]
    out = out.view(b, tq, g, hkv, d).transpose(2, 3).reshape(b, tq, h, d)
    return out, lse.view(b, tq, g, hkv).transpose(2, 3).reshape(b, tq, h)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, *,
                     scale: float | None = None, backend: str = "auto", split: int | None = None,
                     stats: CommStats | None = None) -> torch.Tensor:
    """Attention of the query tokens ``q`` ``[B, Tq, H, D]`` (the same on every rank of ``group``)
    over a KV cache whose rows are split along the sequence over those ranks.

    Args:
        q: the query tokens, ``[batch, tokens, heads, head_dim]``, identical on every rank.
        k, v: this rank's rows of the cache, ``[batch, rows, kv_heads, head_dim]``; any number of
            rows, 0 included; ``kv_heads`` divides ``heads`` (GQA).
        group: the process group the cache is split over (default: the whole world; without an
            initialised process group, this process alone holds the whole cache).
        scale: the softmax scale (default ``head_dim ** -0.5``).
        backend: the local kernel (:func:`dilated.attention`'s backends).
        split: chunks this rank's rows are cut into for the local call (default: enough to fill
            the GPU, :func:`key_chunks`); it must divide the rank's row count.
        stats: a :class:`~dilated.CommStats` that counts the one collective and its bytes.

    Returns ``out`` ``[B, Tq, H, D]`` in q's dtype, the same on every rank. Under
    ``torch.no_grad()`` or ``torch.inference_mode()`` only (ValueError otherwise)."""
    _check(q, k, v)
    out, lse = local_part(q, k, v, scale, backend, split)
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    if world == 1:
        return out.to(q.dtype)
    mine = torch.cat([out, lse.unsqueeze(-1)], -1).contiguous()  # [B, Tq, H, D + 1]: one message
    parts = mine.new_empty(world * mine.shape[0], *mine.shape[1:])  # rank-major
    stats = CommStats() if stats is None else stats
    with stats.waiting(q.device):
        all_gather_into(parts, mine, group=group)
    stats.sent(mine.numel() * mine.element_size() * (world - 1), collective=True)
    parts = parts.view(world, *mine.shape)
    return merge_stacked(parts[..., :-1], parts[..., -1])[0].to(q.dtype)
