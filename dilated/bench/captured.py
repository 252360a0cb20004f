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
        why = _problem(data)
        if why:
            raise ValueError(f"--inputs: {path}: {why}")
        out.append(Captured(path, {k: v for k, v in data.items() if k in ("q", "k", "v", "x")}))
    return out


def _problem(data) -> str | None:
    """What keeps a loaded capture from being benchmarked, or None."""
    if not isinstance(data, dict) or not ({"q", "k", "v"} <= data.keys() or "x" in data):
        return "must hold a dict with keys q, k, v ([B, N, H, D]) or x ([B, N, E])"
    keys = ("q", "k", "v") if "q" in data else ("x",)
    for key in keys:
        t = data[key]
        if not isinstance(t, torch.Tensor):
            return f"{key} is a {type(t).__name__}, not a tensor"
        if not t.is_floating_point():
            return f"{key} is {t.dtype}: attention inputs are floating point"
        want = 3 if key == "x" else 4
        if t.dim() != want or 0 in t.shape:
            shape = "[batch, seq, embed_dim]" if key == "x" else "[batch, seq, heads, head_dim]"
            return f"{key} must be a non-empty {shape}, got shape {tuple(t.shape)}"
    if "q" not in data:
        return None
    q, k, v = data["q"], data["k"], data["v"]
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        return f"q, k and v must have one batch size, got {q.shape[0]}, {k.shape[0]}, {v.shape[0]}"
    if k.shape[:3] != v.shape[:3]:
        return f"k and v must have the same batch, length and heads, got {tuple(k.shape)} and {tuple(v.shape)}"
    if q.shape[3] != k.shape[3] or v.shape[3] != k.shape[3]:
        return f"q, k and v must have one head_dim, got {q.shape[3]}, {k.shape[3]}, {v.shape[3]}"
    if q.shape[2] % k.shape[2]:
        return f"q's {q.shape[2]} heads must be a multiple of k and v's {k.shape[2]} (GQA groups)"
    return None


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
