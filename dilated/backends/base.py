"""The one interface every local attention kernel sits behind.

A backend computes exact softmax attention for *square-causal or non-causal* problems on
``[batch, seq, heads, head_dim]`` tensors and returns ``(out, lse)`` with ``lse`` the float32
(float64 for float64 inputs) per-row log-sum-exp of the scaled scores, shape ``[batch, heads, seq_q]``. Bottom-right causal
alignment for ``seq_q != seq_k`` and GQA expansion for kernels without native GQA are done once,
above the backends, in :mod:`dilated.functional`.

``backward(dout, q, k, v, out, lse, ...)`` returns ``dq, dk, dv`` for the attention whose output
and log-sum-exp are ``out`` and ``lse``. Callers that merge partial attentions (dilated branches,
ring steps, the causal split) pass the *merged* ``out`` and ``lse``: the kernel then recomputes
``P = exp(S - lse)`` with the global normaliser and ``D = rowsum(dout * out)`` with the global
output, which gives the exact gradient of the merged attention.
"""
from __future__ import annotations

import contextlib

import torch

from .._checks import acc_dtype


@contextlib.contextmanager
def autograd_on():
    """Record autograd graphs here, whatever the caller turned off: grad mode (``no_grad``),
    ``inference_mode``, and autograd's dispatch, which torch turns off while a custom op's
    implementation runs (the :mod:`dilated.ops` ops, and so every call of a compiled graph), where
    ``torch.enable_grad()`` alone records nothing; ``inference_mode(False)`` turns it back on. For
    computations that take a gradient of their own local tensors: a backward that recomputes its
    forward, a backend's availability probe."""
    with torch.inference_mode(False), torch.enable_grad():
        yield


def expand_kv_heads(x: torch.Tensor, groups: int, dim: int = 2) -> torch.Tensor:
    """k or v with each head repeated ``groups`` times along ``dim`` (GQA for kernels that need q's
    head count): head ``h`` reads kv head ``h // groups``."""
    return x.repeat_interleave(groups, dim=dim) if groups > 1 else x


def reduce_kv_heads(g: torch.Tensor, groups: int, dim: int = 2) -> torch.Tensor:
    """The gradient of :func:`expand_kv_heads`: each kv head's group of ``groups`` heads summed."""
    if groups == 1:
        return g
    shape = g.shape
    return g.reshape(*shape[:dim], shape[dim] // groups, groups, *shape[dim + 1:]).sum(dim + 1)


class Backend:
    name: str = "?"
    #: k/v may have fewer heads than q without expansion.
    native_gqa: bool = False
    #: whether backward() is implemented.
    supports_backward: bool = True
    #: whether it materialises the score matrix (memory quadratic in the length): ``auto`` does not
    #: time such a kernel where a fused one works.
    materializes_scores: bool = False
    #: whether its first call at each new shape compiles (seconds): ``auto`` does not time such a
    #: kernel where one that does not compile per shape works.
    compiles_per_shape: bool = False

    # -- availability -------------------------------------------------------------------
    def unavailable_reason(self, device: torch.device) -> str | None:
        """A static reason why this backend cannot run on ``device`` (import, device type), or None.

        The authoritative answer is :func:`dilated.available_backends`, which also makes a tiny
        real call on the device.
        """
        return None

    def takes_kv_heads(self, q: torch.Tensor, k: torch.Tensor, causal: bool) -> bool:
        """Whether this call may pass k/v with fewer heads than q as they are (GQA), rather than
        expanded to q's heads above the backend; :attr:`native_gqa` by default."""
        return self.native_gqa

    def input_reason(self, q: torch.Tensor, k: torch.Tensor, causal: bool) -> str | None:
        """Why this backend cannot take these particular inputs (dtype, head_dim), or None."""
        return None

    def value_head_dim_reason(self, q: torch.Tensor, v: torch.Tensor) -> str | None:
        """Why this backend cannot take a value head_dim other than q's and k's, or None."""
        if v.shape[-1] != q.shape[-1]:
            return f"{self.name} needs v's head_dim ({v.shape[-1]}) equal to q's ({q.shape[-1]})"
        return None

    def reads_strided_rows(self, q: torch.Tensor, k: torch.Tensor, causal: bool) -> bool:
        """Whether ``forward``/``backward`` take q, k, v, out, dout with any row and head strides
        (last dim contiguous) and read them in place, at the speed of dense inputs. The dilated
        path then hands the kernel its rows as strided views instead of gathering them."""
        return False

    def longest_causal_block(self, q: torch.Tensor, k: torch.Tensor) -> int | None:
        """The longest square causal call this kernel runs at its full rate here, or None (no
        limit). A longer causal forward is split into query chunks of at most this length, each an
        unmasked call over the keys before it and a causal call on its own block, merged by lse
        (:func:`dilated.dense.causal_pieces`): the same causal work at the unmasked rate."""
        return None

    def block_sparse_reason(self, q: torch.Tensor, k: torch.Tensor, block: int) -> str | None:
        """Why this kernel cannot run a block-sparse attention over ``block`` x ``block`` tiles of
        q and k (:meth:`block_sparse_forward`), or None where it can."""
        return f"{self.name} does not take lists of key blocks per query block"

    def kernel_name(self, q: torch.Tensor, k: torch.Tensor, causal: bool) -> str:
        """The kernel that runs for these inputs, by the name of the backend that forces it: the
        backend's own name, but ``sdpa`` (PyTorch's choice) says which SDPA kernel it chose."""
        return self.name

    def probe_dtype(self, device: torch.device) -> torch.dtype:
        return torch.bfloat16 if device.type == "cuda" else torch.float32

    # -- compute ------------------------------------------------------------------------
    def forward(self, q, k, v, causal: bool, scale: float):
        """Return ``(out, lse)``; ``out`` in q's dtype, ``lse`` ``[B, H, Nq]`` float32 (float64 for
        float64 inputs). Inputs have a contiguous last dimension. No autograd."""
        raise NotImplementedError

    def block_sparse_forward(self, q, k, v, lists, scale: float):
        """``(out, lse)`` of non-causal attention where query block ``m`` (of ``lists.block`` rows)
        of head ``h`` sees the key blocks ``lists.indices[0, h, m, :lists.counts[0, h, m]]``, each as
        many times as it is listed (a block listed twice counts twice in the softmax). ``lists``
        is a :class:`dilated.longnet.residue_major.BlockLists`; see :meth:`block_sparse_reason`."""
        raise NotImplementedError(self.block_sparse_reason(q, k, lists.block))

    def block_sparse_backward(self, dout, q, k, v, out, lse, lists, scale: float):
        """``dq, dk, dv`` of :meth:`block_sparse_forward`; the lists must be symmetric (key block
        ``n`` lists query block ``m`` as often as ``m`` lists ``n``), as the backward reads them per
        key block."""
        raise NotImplementedError(self.block_sparse_reason(q, k, lists.block))

    def forward_autograd(self, q, k, v, causal: bool, scale: float):
        """``(out, lse)`` built with autograd, both differentiable. Used by the default backward."""
        raise NotImplementedError

    def backward(self, dout, q, k, v, out, lse, causal: bool, scale: float):
        """Gradient of the attention whose (merged) output and lse are ``out`` and ``lse``.

        Default for kernels without a public backward that takes ``(out, lse)``: recompute the
        local ``(o, l)`` with autograd and take its vector-Jacobian product with rescaled
        cotangents. With ``w = exp(l - lse)`` per row, the merged gradient
        ``dS = exp(S - lse) * (dout V^T - rowsum(dout * out))`` equals the local one for
        ``g_out = w * dout`` and ``g_lse = w * (rowsum(dout * o) - rowsum(dout * out))``.
        Costs one extra forward; needs a differentiable lse.
        """
        with autograd_on():
            # an inference tensor cannot take part in a recorded graph: such inputs are copied
            qg, kg, vg = ((t.clone() if t.is_inference() else t.detach()).requires_grad_(True) for t in (q, k, v))
            o, l = self.forward_autograd(qg, kg, vg, causal, scale)
        with torch.no_grad():  # the cotangents: no graph
            acc = acc_dtype(q.dtype)
            lse = lse.to(acc)
            w = torch.exp(l.to(acc) - lse)  # [B, H, N]
            w = torch.where(lse == float("-inf"), 0.0, w)  # rows that see no key; NaN stays NaN
            w_bnh = w.transpose(1, 2)  # [B, N, H]
            dout_f = dout.to(acc)
            d_local = (dout_f * o.to(acc)).sum(-1)
            d_merged = (dout_f * out.to(acc)).sum(-1)
            g_out = (dout_f * w_bnh.unsqueeze(-1)).to(o.dtype)
            g_lse = (w_bnh * (d_local - d_merged)).transpose(1, 2).to(l.dtype)
        with autograd_on():
            dq, dk, dv = torch.autograd.grad((o, l), (qg, kg, vg), (g_out, g_lse), allow_unused=True)
        return tuple(torch.zeros_like(t) if g is None else g for g, t in zip((dq, dk, dv), (q, k, v)))

    def __repr__(self) -> str:
        return f"<backend {self.name}>"


def to_bhnd(x: torch.Tensor) -> torch.Tensor:
    """``[B, N, H, D]`` -> ``[B, H, N, D]`` as a view (last dim stays contiguous)."""
    return x.transpose(1, 2)


def cuda_library_reason(device: torch.device, what: str, load) -> str | None:
    """Why a CUDA kernel library cannot run on ``device``: not a CUDA device, or ``load()`` fails
    (an ImportError, or a broken extension raising something else); None when both pass."""
    if device.type != "cuda":
        return f"{what} needs a CUDA device (this is {device.type})"
    try:
        load()
    except Exception as e:  # noqa: BLE001 - whatever it raises is the reason, reported
        return f"{what} not importable: {type(e).__name__}: {e}"
    return None


def head_dim_reason(head_dim: int, what: str, largest: int | None = 256) -> str | None:
    """Why a fused kernel cannot take ``head_dim``: it needs a multiple of 8 (up to ``largest``)."""
    if head_dim % 8 == 0 and head_dim >= 8 and (largest is None or head_dim <= largest):
        return None
    needs = "a multiple of 8" + ("" if largest is None else f" from 8 to {largest}")
    fix = (f"pad q, k and v with zero columns to {-(-head_dim // 8) * 8} (no score changes; cut the output back)"
           if largest is None or head_dim < largest else f"use a head_dim of at most {largest}")
    return f"{what} needs a head_dim that is {needs}, got {head_dim}: {fix}, or use sdpa_math or manual (any head_dim)"


def needs_half(q: torch.Tensor, what: str) -> str | None:
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"{what} needs float16 or bfloat16 inputs, got {q.dtype}"
    return None
