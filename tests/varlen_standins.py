"""CPU stand-ins for the kernels' varlen entry points, with their real interfaces: torch's
``torch_attn::_varlen_attn`` / ``_varlen_attn_backward`` ops (as ``torch.library`` custom ops with
the schemas of torch 2.13 and of the first release, which had only ``is_causal``) and flash-attn
4's ``_flash_attn_fwd`` / ``_flash_attn_bwd`` (flash_attn/cute/interface.py, 4.0.0b36).

They compute each document alone in float64 math; the backward ones use the out and lse they are
given (the flash contract), so an adapter that hands over a wrong lse or layout gets a wrong
gradient. Every call is counted in ``CALLS``.
"""
from __future__ import annotations

from collections import Counter
from typing import List, Optional

import torch
from torch import Tensor

from conftest import flash_grads
from dilated.reference import dense_reference

CALLS: Counter = Counter()


def _documents(cu_q, cu_k, max_q, max_k):
    """``[((q start, q end), (k start, k end))]`` per document; the longest lengths given must bound
    the real ones (the kernels read the lengths from cu_seqlens and size their grids by these)."""
    assert cu_q.dtype == cu_k.dtype == torch.int32 and cu_q.shape == cu_k.shape
    cq, ck = cu_q.tolist(), cu_k.tolist()
    assert max_q >= max(b - a for a, b in zip(cq, cq[1:])) and max_k >= max(b - a for a, b in zip(ck, ck[1:]))
    return list(zip(zip(cq, cq[1:]), zip(ck, ck[1:])))


def varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    """Packed ``[T, H, D]`` rows: ``(out in q's dtype, lse [H, T] float32, float64 for float64
    inputs)``; GQA by kv head groups."""
    g = q.shape[1] // k.shape[1]
    outs, lses = [], []
    for (a, b), (c, e) in _documents(cu_q, cu_k, max_q, max_k):
        kk, vv = (x[c:e].repeat_interleave(g, 1) for x in (k, v))
        o, l = dense_reference(q[None, a:b].detach(), kk[None].detach(), vv[None].detach(), causal=causal, scale=scale)
        outs.append(o[0].to(q.dtype))
        lses.append(l[0])
    lse = torch.cat(lses, 1)
    return torch.cat(outs), (lse if q.dtype == torch.float64 else lse.float())


def varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, dlse=None):
    """``(dq, dk, dv)`` in the inputs' dtypes from the given out and lse ``[H, T]`` (and dlse)."""
    grads = [torch.zeros(x.shape, dtype=torch.float64) for x in (q, k, v)]
    for (a, b), (c, e) in _documents(cu_q, cu_k, max_q, max_k):
        one = [dout[None, a:b], q[None, a:b], k[None, c:e], v[None, c:e], out[None, a:b]]
        g = flash_grads(*one, lse[None, :, a:b], scale, causal, None if dlse is None else dlse[None, :, a:b])
        for dst, gi, (x, y) in zip(grads, g, ((a, b), (c, e), (c, e))):
            dst[x:y] += gi[0]
    return tuple(gi.to(x.dtype) for gi, x in zip(grads, (q, k, v)))


def _default(scale, d):
    return scale if scale is not None else d ** -0.5


# -- torch 2.13 (torch/nn/attention/varlen.py) ------------------------------------------------

@torch.library.custom_op("dilated_standin_torch_new::_varlen_attn", mutates_args={})
def new_forward(query: Tensor, key: Tensor, value: Tensor, cu_seq_q: Tensor, cu_seq_k: Optional[Tensor], max_q: int,
                max_k: int, is_causal: bool = False, scale: Optional[float] = None,
                window_size: Optional[List[int]] = None, enable_gqa: bool = False, seqused_k: Optional[Tensor] = None,
                block_table: Optional[Tensor] = None, num_splits: Optional[int] = None
                ) -> tuple[Tensor, Tensor, Tensor]:
    CALLS["torch_forward"] += 1
    assert window_size == ([-1, 0] if is_causal else [-1, -1]), "window_size and is_causal disagree"
    assert enable_gqa == (key.shape[1] != query.shape[1]), "enable_gqa"
    out, lse = varlen_forward(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal,
                              _default(scale, query.shape[-1]))
    return out, lse, torch.zeros(2, dtype=torch.int64)


@torch.library.custom_op("dilated_standin_torch_new::_varlen_attn_backward", mutates_args={})
def new_backward(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor,
                 cu_seq_q: Tensor, cu_seq_k: Tensor, max_q: int, max_k: int, is_causal: bool, rng_state: Tensor,
                 scale: Optional[float] = None, window_size: Optional[List[int]] = None
                 ) -> tuple[Tensor, Tensor, Tensor]:
    CALLS["torch_backward"] += 1
    assert window_size == ([-1, 0] if is_causal else [-1, -1]), "window_size and is_causal disagree"
    return varlen_backward(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, is_causal,
                           _default(scale, query.shape[-1]))


# -- the first torch with varlen_attn: is_causal only, no scale, no GQA -----------------------

@torch.library.custom_op("dilated_standin_torch_old::_varlen_attn", mutates_args={})
def old_forward(query: Tensor, key: Tensor, value: Tensor, cu_seq_q: Tensor, cu_seq_k: Tensor, max_q: int, max_k: int,
                is_causal: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    CALLS["torch_forward"] += 1
    assert key.shape[1] == query.shape[1], "no GQA in this release"
    out, lse = varlen_forward(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, None)
    return out, lse, torch.zeros(2, dtype=torch.int64)


@torch.library.custom_op("dilated_standin_torch_old::_varlen_attn_backward", mutates_args={})
def old_backward(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor,
                 cu_seq_q: Tensor, cu_seq_k: Tensor, max_q: int, max_k: int, is_causal: bool, rng_state: Tensor
                 ) -> tuple[Tensor, Tensor, Tensor]:
    CALLS["torch_backward"] += 1
    assert key.shape[1] == query.shape[1], "no GQA in this release"
    return varlen_backward(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, is_causal,
                           query.shape[-1] ** -0.5)


TORCH_OPS = {"new": (new_forward, new_backward), "old": (old_forward, old_backward)}


# -- flash-attn 4 (flash_attn/cute/interface.py, 4.0.0b36) ------------------------------------

class FA4:
    @staticmethod
    def _flash_attn_fwd(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                        max_seqlen_q=None, max_seqlen_k=None, min_seqlen_k=None, page_table=None, softmax_scale=None,
                        causal=False, softcap=None, window_size_left=None, window_size_right=None,
                        learnable_sink=None, tile_mn=None, mma_pv_is_rs=None, intra_wg_overlap=None, num_threads=384,
                        num_splits=1, pack_gqa=None, _arch=None, score_mod=None, mask_mod=None,
                        block_sparse_tensors=None, return_lse=False, out=None, lse=None, **more):
        CALLS["fa4_forward"] += 1
        o, l = varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                              _default(softmax_scale, q.shape[-1]))
        return o, (l if return_lse else None), None, None, None

    @staticmethod
    def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0, window_size_left=None,
                        window_size_right=None, m_block_size=64, n_block_size=128, num_threads=256, pack_gqa=False,
                        num_stages_Q=2, num_stages_dO=2, SdP_swapAB=False, dKV_swapAB=False, dQ_swapAB=False,
                        AtomLayoutMSdP=2, AtomLayoutNdKV=2, AtomLayoutMdQ=2, V_in_regs=False, cu_seqlens_q=None,
                        cu_seqlens_k=None, seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None,
                        deterministic=False, dq=None, dk=None, dv=None, score_mod=None, score_mod_bwd=None,
                        mask_mod=None, aux_tensors=None, aux_scalars=None, block_sparse_tensors=None, dlse=None,
                        learnable_sink=None):
        CALLS["fa4_backward"] += 1
        assert q.dtype == out.dtype == dout.dtype, "flash-attn 4 asserts q, out and dout share a dtype"
        return varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               causal, _default(softmax_scale, q.shape[-1]), dlse)


def install(monkeypatch_or_none, kernel: str, release: str = "new"):
    """Route ``backend="auto"`` (resolving to ``sdpa_flash``: ``kernel="torch"``, ops of ``release``) or
    ``backend="flash_attn_4"`` (``kernel="fa4"``) packed documents to these stand-ins. With a pytest ``monkeypatch`` the
    change is undone after the test; with None (a spawned worker) it lasts for the process."""
    from dilated.backends import flash_attn_4, varlen

    served = "auto" if kernel == "torch" else "flash_attn_4"
    patches = [(varlen, "varlen_reason", lambda q, k, v, backend, causal=False: None if backend == served else "no"),
               (varlen, "dense_kernel", lambda q, k, v, backend, causal: "sdpa_flash" if backend == "auto" else backend)]
    if kernel == "torch":
        patches.append((varlen, "torch_varlen_ops", lambda: TORCH_OPS[release]))
    else:
        patches.append((flash_attn_4, "cute_interface", lambda: FA4))
    for module, name, value in patches:
        if monkeypatch_or_none is None:
            setattr(module, name, value)
        else:
            monkeypatch_or_none.setattr(module, name, value)
