"""``MultiheadDilatedAttention``: projections around dilated attention, a drop-in self-attention layer.

Batch-first ``[B, N, embed_dim]``. q/k/v projections (k/v to ``num_kv_heads`` heads for GQA),
dilated attention, then LongNet's MAGNETO sub-layer norm (a LayerNorm on the attention output
before the output projection) when ``layer_norm`` is set, and the output projection.
Initialisation follows MAGNETO (Wang et al., 2022): Xavier-uniform for q and k with gain 1, and
for v and the output projection with gain ``gamma`` (``sqrt(log(2L))`` for an L-layer encoder;
pass ``gamma_init``; 1.0 by default), biases zero.

``layout="residue_major"``: the layer's input and output are in the schedule's residue-major
order along the sequence (:mod:`dilated.longnet.residue_major`; every step of the layer but the attention
is token-wise, so only the attention sees the order); ``layer.attention.to_layout(x)`` puts a
sequence in it once, for a whole stack of such layers.
"""
from __future__ import annotations


import torch
from torch import nn

from .dilated_attention import DilatedAttention
from .improved_dilated_attention import ImprovedDilatedAttention


class MultiheadDilatedAttention(nn.Module):
    """A self-attention layer (see the module docstring): ``forward(query, key=None, value=None)`` on
    ``[B, N, embed_dim]`` (key and value default to query) returns ``[B, N, embed_dim]``.

    Args:
        embed_dim: the model width; ``num_heads`` must divide it (head_dim = embed_dim / num_heads).
        num_heads: query heads.
        segment_lengths, dilation_rates: the dilated schedule (see :func:`dilated.dilated_attention`).
        num_kv_heads: key/value heads (GQA; default ``num_heads``), dividing ``num_heads``.
        causal: causal attention within each segment.
        bias: biases in the four projections.
        layer_norm: MAGNETO's sub-layer norm before the output projection.
        backend: the local kernel (``"auto"``, ``"sdpa"``, ``"flash_attn_4"``, ...).
        improved: the fast :class:`~dilated.ImprovedDilatedAttention` (True) or the readable
            :class:`~dilated.DilatedAttention`.
        device, dtype: of the parameters.
        layer_norm_eps: the sub-layer norm's epsilon.
        gamma_init: MAGNETO's gain for the value and output projections.
        layout: ``"natural"`` or ``"residue_major"`` (the module docstring; needs ``improved``).
    """

    def __init__(self, embed_dim, num_heads, segment_lengths, dilation_rates, *, num_kv_heads=None,
                 causal=False, bias=True, layer_norm=True, backend="auto", improved=True, device=None,
                 dtype=None, layer_norm_eps=1e-5, gamma_init=1.0, layout="natural"):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads <= 0 or embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        if num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads})")
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.gamma_init = gamma_init
        kw = {"device": device, "dtype": dtype}
        kv_dim = num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **kw)
        self.k_proj = nn.Linear(embed_dim, kv_dim, bias=bias, **kw)
        self.v_proj = nn.Linear(embed_dim, kv_dim, bias=bias, **kw)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **kw)
        self.norm = nn.LayerNorm(embed_dim, eps=layer_norm_eps, **kw) if layer_norm else None
        if improved:
            self.attention = ImprovedDilatedAttention(segment_lengths, dilation_rates, causal=causal, backend=backend,
                                                      layout=layout)
        elif layout != "natural":
            raise ValueError(f"layout={layout!r} needs improved=True (DilatedAttention takes the natural order only)")
        else:
            self.attention = DilatedAttention(segment_lengths, dilation_rates, causal=causal, backend=backend)
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.xavier_uniform_(self.q_proj.weight)
        nn.init.xavier_uniform_(self.k_proj.weight)
        nn.init.xavier_uniform_(self.v_proj.weight, gain=self.gamma_init)
        nn.init.xavier_uniform_(self.out_proj.weight, gain=self.gamma_init)
        for lin in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)

    def forward(self, query: torch.Tensor, key: torch.Tensor | None = None, value: torch.Tensor | None = None):
        key = query if key is None else key
        value = key if value is None else value
        if query.dim() != 3 or query.shape[-1] != self.embed_dim:
            raise ValueError(f"query must be [batch, seq, {self.embed_dim}], got {tuple(query.shape)}")
        if key.shape != query.shape or value.shape != query.shape:
            raise ValueError(f"key and value must match query's shape {tuple(query.shape)}, "
                             f"got key {tuple(key.shape)}, value {tuple(value.shape)}")
        return self.output(self.attention(*self.project(query, key, value)))

    def project(self, query: torch.Tensor, key: torch.Tensor | None = None, value: torch.Tensor | None = None):
        """The attention's q ``[B, N, num_heads, head_dim]`` and k, v ``[B, N, num_kv_heads, head_dim]``."""
        key = query if key is None else key
        value = key if value is None else value
        b, n, _ = query.shape
        return (self.q_proj(query).view(b, n, self.num_heads, self.head_dim),
                self.k_proj(key).view(b, n, self.num_kv_heads, self.head_dim),
                self.v_proj(value).view(b, n, self.num_kv_heads, self.head_dim))

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        """The layer's output ``[B, N, embed_dim]`` from the attention's ``[B, N, num_heads, head_dim]``."""
        x = attn.reshape(*attn.shape[:2], self.embed_dim)
        if self.norm is not None:
            x = layer_norm_rows(self.norm, x)
        return self.out_proj(x)


#: CUDA's layer_norm computes row offsets in 32 bits and returns wrong values (NaN) once a tensor
#: has 2^32 elements (pytorch/pytorch#181555, fixed in pytorch/pytorch#181600; torch 2.11 has the
#: bug: seen here from 2.36M tokens x 2048 features on an H200). Normalise in chunks of rows below it.
LAYER_NORM_MAX_ELEMENTS = 1 << 31


def layer_norm_rows(norm: nn.LayerNorm, x: torch.Tensor, max_elements: int = LAYER_NORM_MAX_ELEMENTS) -> torch.Tensor:
    """``norm(x)`` for ``x`` ``[B, N, E]``, in chunks of whole rows of under ``max_elements`` each."""
    if x.numel() < max_elements:
        return norm(x)
    rows = max(1, max_elements // (x.shape[0] * x.shape[2]))
    out = torch.empty_like(x)
    for s in range(0, x.shape[1], rows):
        out[:, s:s + rows] = norm(x[:, s:s + rows])
    return out

