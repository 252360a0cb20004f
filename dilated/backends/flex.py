"""``flex``: ``torch.nn.attention.flex_attention``, compiled with ``torch.compile``.

flex_attention returns the log-sum-exp itself (``return_aux=AuxRequest(lse=True)``, or
``return_lse=True`` on older torch; flex's lse is base e, float32). Causal uses a cached
``BlockMask`` per shape, so fully masked tiles are skipped. flex has no public backward that takes
``(out, lse)``: backward recomputes the local attention with autograd and takes its
vector-Jacobian product with rescaled cotangents (:meth:`Backend.backward`), which needs flex's
gradient through lse. GQA is native (``enable_gqa=True``).
"""
from __future__ import annotations

import functools
import inspect

import torch

from .._transfer import made_for_a_cache
from .base import Backend, to_bhnd


@functools.lru_cache(maxsize=None)
def _compiled():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


_LIMITS = ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit")


def recompile_limits():
    """Dynamo's recompile limits raised for the duration of a flex call, then restored: one compiled
    kernel per shape (dilated attention calls several), and past dynamo's default limit (8) flex
    would silently fall back to its eager, unfused form. The rest of the process keeps its limits."""
    cfg = torch._dynamo.config
    return cfg.patch(**{name: max(getattr(cfg, name), 1024) for name in _LIMITS if hasattr(cfg, name)})


@functools.lru_cache(maxsize=64)
def _causal_mask(nq: int, nk: int, device: str):
    from torch.nn.attention.flex_attention import create_block_mask

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    # kept by the cache: made outside a CUDA graph's private pool (torch.compile's reduce-overhead)
    return made_for_a_cache(lambda: create_block_mask(causal, None, None, nq, nk, device=device), device)


def _lse_kwargs():
    from torch.nn.attention import flex_attention as fa

    params = inspect.signature(fa.flex_attention).parameters
    if "return_aux" in params and hasattr(fa, "AuxRequest"):
        return {"return_aux": fa.AuxRequest(lse=True)}, lambda res: (res[0], res[1].lse)
    return {"return_lse": True}, lambda res: (res[0], res[1])


class FlexBackend(Backend):
    name = "flex"
    native_gqa = True
    compiles_per_shape = True  # compiled with dynamic=False: seconds at each new shape

    def unavailable_reason(self, device):
        try:
            import torch.nn.attention.flex_attention  # noqa: F401
        except ImportError as e:
            return f"torch.nn.attention.flex_attention not importable: {e}"
        if device.type != "cuda":
            # inductor's CPU lowering: "torch.compile on CPU only supports inference and
            # `return_lse` is not supported yet" (seen with torch 2.13).
            return "compiled flex_attention on CPU supports neither the log-sum-exp nor backward"
        return None

    def input_reason(self, q, k, causal):
        d = q.shape[-1]
        if d < 16 or d & (d - 1):
            return f"flex_attention needs a power-of-two head_dim >= 16, got {d}"
        return None

    def forward(self, q, k, v, causal, scale):
        with torch.no_grad():
            out, lse = self.forward_autograd(q, k, v, causal, scale)
        return out, lse

    def forward_autograd(self, q, k, v, causal, scale):
        kwargs, unpack = _lse_kwargs()
        mask = _causal_mask(q.shape[1], k.shape[1], str(q.device)) if causal else None
        with recompile_limits():
            res = _compiled()(
                to_bhnd(q), to_bhnd(k), to_bhnd(v), block_mask=mask, scale=scale,
                enable_gqa=q.shape[2] != k.shape[2], **kwargs)
        out, lse = unpack(res)
        return out.transpose(1, 2), lse.float()
