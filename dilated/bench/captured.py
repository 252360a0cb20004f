"""Captured inputs: benchmark on tensors saved from a real model instead of random ones.

A capture directory holds ``.pt`` files, each a dict saved with ``torch.save``:

* ``{"q": [B, Nq, H, D], "k": [B, N, Hkv, D], "v": [B, N, Hkv, D]}`` for attention
  implementations (dense, dilated, improved, ...), or
* ``{"x": [B, N, E]}`` for modules (``MultiheadDilatedAttention``), whose heads come from
  ``--num-heads``.

Files are loaded with ``weights_only=True`` (no code runs on load). The benchmarked case (batch,
lengths, heads, head dim, dtype) is read from the tensors' shapes.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .registry import DTYPES, Case

_DTYPE_NAMES = {v: k for k, v in reversed(list(DTYPES.items()))}


@dataclass
class Captured:
    path: str
    tensors: dict

    @property
    def name(self) -> str:
        return os.path.basename(self.path)


def load_captured(directory: str) -> list[Captured]:
    """Every ``*.pt`` file of ``directory``, sorted by name, checked for the expected keys and shapes."""
    if not os.path.isdir(directory):
        raise ValueError(f"--inputs {directory!r}: not a directory of .pt files")
    files = sorted(f for f in os.listdir(directory) if f.endswith(".pt"))
    if not files:
        raise ValueError(f"--inputs {directory!r}: no .pt files there")
    out = []
    for f in files:
        path = os.path.join(directory, f)
        try:
            data = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise ValueError(f"--inputs: cannot load {path} with weights_only=True: {e}") from None
        if not isinstance(data, dict) or not ({"q", "k", "v"} <= data.keys() or "x" in data):
            raise ValueError(f"--inputs: {path} must hold a dict with keys q, k, v ([B, N, H, D]) or x ([B, N, E])")
        for key in ("q", "k", "v"):
            if key in data and data[key].dim() != 4:
                raise ValueError(f"--inputs: {path}: {key} must be [batch, seq, heads, head_dim], "
                                 f"got shape {tuple(data[key].shape)}")
        if "x" in data and data["x"].dim() != 3:
            raise ValueError(f"--inputs: {path}: x must be [batch, seq, embed_dim], got {tuple(data['x'].shape)}")
        out.append(Captured(path, {k: v for k, v in data.items() if k in ("q", "k", "v", "x")}))
    return out


def captured_case(cap: Captured, num_heads: int, **fields) -> Case:
    """The :class:`Case` the captured tensors describe; ``fields`` add mode, causal, schedule (and a
    ``dtype`` to cast to; ``None`` keeps the tensors' own)."""
    t = cap.tensors
    if "q" in t:
        q, k = t["q"], t["k"]
        b, nq, h, d = q.shape
        n, hkv = k.shape[1], k.shape[2]
        dtype = q.dtype
    else:
        b, n, e = t["x"].shape
        if e % num_heads:
            raise ValueError(f"--inputs: {cap.path}: embed dim {e} is not divisible by --num-heads {num_heads}")
        h, d, hkv, nq, dtype = num_heads, e // num_heads, num_heads, n, t["x"].dtype
    kw = dict(batch=b, seq_len=n, num_heads=h, head_dim=d, num_kv_heads=hkv if hkv != h else None,
              q_len=nq if nq != n else None, dtype=_DTYPE_NAMES.get(dtype, "float32"))
    kw.update({k: v for k, v in fields.items() if v is not None})
    return Case(**kw)
