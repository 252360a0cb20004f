"""``sdpa*``: PyTorch's scaled_dot_product_attention kernels, one backend per forced kernel.

``sdpa`` lets PyTorch pick (``torch._fused_sdp_choice``, the same decision the public function
makes); ``sdpa_flash``, ``sdpa_efficient``, ``sdpa_cudnn`` and ``sdpa_math`` force one kernel.

The public ``F.scaled_dot_product_attention`` does not return the log-sum-exp, so the fused
kernels are called through the private ATen ops that do (the ones PyTorch's own context-parallel
attention uses), and backward calls their private backward ops with the (merged) ``out`` and
``lse``:

* flash (CUDA): ``aten._scaled_dot_product_flash_attention`` / ``..._backward``; on CPU,
  ``aten._scaled_dot_product_flash_attention_for_cpu`` / ``..._backward``.
* efficient: ``aten._scaled_dot_product_efficient_attention(compute_log_sumexp=True)``; its lse
  is padded to a multiple of 32 rows, which we slice off (and pad again for backward).
* cuDNN: ``aten._scaled_dot_product_cudnn_attention(compute_log_sumexp=True)`` / ``..._backward``.
  cuDNN rejects one query against one key; such calls go to the flash kernel. cuDNN builds a graph
  per call shape: the first call of a shape goes to the flash kernel too, the graph is built when
  the shape comes back (:mod:`dilated.backends.graph_shapes`), also where ``sdpa`` resolves to
  cuDNN; both are recorded as run (``sdpa`` records the kernel it resolved to).
* flash's backward (CUDA) indexes its float32 dq accumulator, ``batch * heads * round_up(seq_q,
  128) * round_up(head_dim, 32)`` elements, with 32-bit integers: beyond 2**31 it reads and writes
  out of bounds (an illegal memory access on an H200, torch 2.11, at 15872 x 2048 rows x 128; fixed
  upstream by flash-attention's pull requests 1500 and 2260). cuDNN's backward returns a wrong dq
  once dq has more than 2**31 elements, its forward staying right (cuDNN 9.19 with torch 2.11;
  ``benchmarks/specialized/check_large_backward.py`` checks it, results linked from
  docs/performance/packed-documents.md). Such calls run in slices of the batch, or of the heads
  in whole GQA groups, that stay within it (:func:`backward_slices`).
* math: the math kernel returns no lse; it is obtained by a second pass (the logsumexp of the
  scores, computed like the ``manual`` backend) and backward is autograd through math SDPA with
  the rescaled-cotangent rule of :meth:`Backend.backward` (one extra forward).

GQA: where the call resolves to cuDNN on CUDA, k/v keep their fewer heads (cuDNN takes them, as
PyTorch's public SDPA passes them with ``enable_gqa``: k/v are read once per head group, and the
gradients come back with k/v's heads); flash, efficient and math calls get k/v expanded to q's heads
above the backend, and a cuDNN call that falls back to flash (:meth:`SDPABackend._graph_or_flash`)
expands them here.

Non-finite inputs: a NaN/Inf in q or k reaches exactly the rows that read it. The fused kernels
multiply a causal tile's zero probabilities by its V rows, so a NaN/Inf in *v* under a causal mask
would also reach the rows before it within that tile: on a CPU such calls (found by one pass over
v) take the exact masked computation; on CUDA, where that pass would cost a few percent of every
call, they do not (more rows NaN, never a finite wrong row). The math kernel adds the causal mask
to the scores (NaN + -inf = NaN), so its causal calls with a non-finite k or v are computed with
the mask applied by ``masked_fill`` instead.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .._checks import acc_dtype
from .base import Backend, expand_kv_heads, head_dim_reason, needs_half, reduce_kv_heads, to_bhnd
from .graph_shapes import GraphShapes, shape_key
from .kernel_log import note_kernel
from .manual import ManualBackend

aten = torch.ops.aten

_KERNELS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}


def _back(x):  # [B, H, N, D] -> [B, N, H, D] view
    return x.transpose(1, 2)


CUDNN_LONGEST_CAUSAL_BLOCK = 65536

#: torch's opt-in to cuDNN graphs keyed on lengths rounded up to powers of two (ragged offsets on
#: contiguous BSHD calls): its backward returned gradients off by orders of magnitude, then an illegal
#: memory access, on packed documents' batched calls (torch 2.11, cuDNN 9.19; docs/performance-log.md)
CUDNN_RAGGED_ENV = "TORCH_CUDNN_SDPA_AVOID_RECOMPILE"


def cudnn_ragged_reason() -> str | None:
    """Why cuDNN is not taken while :data:`CUDNN_RAGGED_ENV` is on (None where it is off)."""
    if os.environ.get(CUDNN_RAGGED_ENV, "").strip().lower() not in ("1", "true", "on", "yes", "y"):
        return None
    return (f"{CUDNN_RAGGED_ENV} is set: torch's cuDNN attention then runs ragged graphs whose backward "
            "returned wrong gradients; unset it (this library bounds cuDNN's graphs itself)")


class SDPABackend(Backend):
    native_gqa = False

    def __init__(self, kernel: str | None):
        self.kernel = kernel
        self.name = "sdpa" if kernel is None else f"sdpa_{kernel}"
        self.materializes_scores = kernel == "math"
        # cuDNN's graphs wait for a shape's second call also where PyTorch's choice (``sdpa``) is cuDNN
        self.graph_shapes = GraphShapes() if kernel in ("cudnn", None) else None

    # -- availability -------------------------------------------------------------------
    def unavailable_reason(self, device):
        if self.kernel == "cudnn" and cudnn_ragged_reason():
            return cudnn_ragged_reason()
        if self.kernel in ("efficient", "cudnn") and device.type != "cuda":
            return f"{self.name} needs a CUDA device (this is {device.type})"
        if self.kernel == "cudnn" and not torch.backends.cudnn.is_available():
            return "cuDNN is not available in this PyTorch build"
        return None

    def input_reason(self, q, k, causal):
        kern = self._resolve(q, k, causal)
        # torch's public SDPA pads head dims to a multiple of 8 for its fused kernels; called directly
        # they fail ("head_size must be a multiple of 8", and efficient's "cutlassF: no kernel found")
        if kern in ("flash", "cudnn") and q.device.type == "cuda":
            return needs_half(q, f"SDPA {kern}") or head_dim_reason(q.shape[-1], f"SDPA {kern}")
        if kern == "efficient" and q.device.type == "cuda" and q.element_size() == 2:
            return head_dim_reason(q.shape[-1], "SDPA efficient in 16-bit", largest=None)
        if kern is None:
            return "PyTorch found no SDPA kernel for these inputs"
        return None

    def takes_kv_heads(self, q, k, causal):
        return q.device.type == "cuda" and self._resolve(q, k, causal) == "cudnn"

    def kernel_name(self, q, k, causal):
        kern = self._resolve(q, k, causal) if self.kernel is None else None
        return self.name if kern is None else f"sdpa_{kern}"

    def _resolve(self, q, k, causal, v=None):
        if self.kernel == "cudnn" and q.shape[1] == 1 and k.shape[1] == 1:
            return "flash"  # cuDNN frontend: "s_q = s_kv = 1 is not supported" (seen, cuDNN 9.19)
        if self.kernel is not None:
            return self.kernel
        v = k if v is None else v
        gqa = {"enable_gqa": True} if k.shape[2] != q.shape[2] else {}  # PyTorch's choice for GQA heads
        choice = SDPBackend(torch._fused_sdp_choice(to_bhnd(q), to_bhnd(k), to_bhnd(v), None, 0.0, causal, **gqa))
        for name, value in _KERNELS.items():
            if value == choice:
                if name != "math" and q.device.type == "cuda" and q.element_size() == 2 and q.shape[-1] % 8:
                    return "math"  # torch chose it for its public call, which pads the head dim first
                if name == "cudnn" and cudnn_ragged_reason():
                    return "flash"
                return name
        return None

    def _graph_or_flash(self, kern, tensors, *flags):
        """``kern``, or "flash" for a cuDNN call whose shape has no graph yet and is not to get one
        at this call (:class:`~dilated.backends.graph_shapes.GraphShapes`)."""
        if kern != "cudnn" or self.graph_shapes is None or tensors[0].device.type != "cuda" \
                or self.graph_shapes.build(shape_key(tensors, *flags)):
            return kern
        note_kernel("sdpa_flash")
        return "flash"

    def value_head_dim_reason(self, q, v):
        # the math kernel takes any value head_dim; the fused ones here need v's equal to q's
        kern = self._resolve(q, q, False, v)
        if v.shape[-1] != q.shape[-1] and kern != "math":
            return (f"SDPA {kern} needs v's head_dim ({v.shape[-1]}) equal to q's ({q.shape[-1]}); "
                    "sdpa_math and manual take any")
        return None

    def reads_strided_rows(self, q, k, causal):
        # cuDNN and flash take a stride per batch, head and row: dilated rows as strided views run
        # as fast as gathered ones, with the same results (docs/performance-log.md)
        return q.device.type == "cuda" and self._resolve(q, k, causal) in ("cudnn", "flash")

    def longest_causal_block(self, q, k):
        # cuDNN's causal forward slows down past 128K rows, where the same work as 64K query chunks
        # (an unmasked call and a causal block each) keeps its rate; chunks lose below 128K, and
        # flash-attn 4 does not slow down, so this is the kernel's, not the problem's (H100 and
        # H200: docs/performance-log.md, "cuDNN's causal forward on long blocks")
        if q.device.type == "cuda" and self._resolve(q, k, True) == "cudnn":
            return CUDNN_LONGEST_CAUSAL_BLOCK
        return None

    # -- compute ------------------------------------------------------------------------
    def forward(self, q, k, v, causal, scale):
        kern = self._resolve(q, k, causal, v)
        if causal and q.device.type == "cpu" and not bool(torch.isfinite(v).all()):
            # the fused kernel's causal tiles multiply zero probabilities by every V row of the tile,
            # so a non-finite value would reach rows before it: on a CPU the check is cheap (one pass
            # over v against a quadratic kernel), and such calls take the exact masked computation
            with torch.no_grad():
                return ManualBackend().forward(q, k, v, causal, scale)
        qt, kt, vt = to_bhnd(q), to_bhnd(k), to_bhnd(v)
        kern = self._graph_or_flash(kern, (qt, kt, vt), "forward", causal)
        if kern != "cudnn" and k.shape[2] != q.shape[2]:  # only cuDNN takes GQA heads as they are
            k, v = (expand_kv_heads(t, q.shape[2] // k.shape[2]) for t in (k, v))
            kt, vt = to_bhnd(k), to_bhnd(v)
        if kern == "flash" and q.device.type == "cpu":
            out, lse = aten._scaled_dot_product_flash_attention_for_cpu(qt, kt, vt, 0.0, causal, scale=scale)
        elif kern == "flash":
            out, lse = aten._scaled_dot_product_flash_attention(qt, kt, vt, 0.0, causal, False, scale=scale)[:2]
        elif kern == "efficient":
            out, lse = aten._scaled_dot_product_efficient_attention(qt, kt, vt, None, True, 0.0, causal, scale=scale)[:2]
            lse = lse[..., : q.shape[1]]
        elif kern == "cudnn":
            out, lse = aten._scaled_dot_product_cudnn_attention(qt, kt, vt, None, True, 0.0, causal, False, scale=scale)[:2]
            lse = lse.reshape(q.shape[0], q.shape[2], q.shape[1])
        elif kern == "math":
            with torch.no_grad():
                out, lse = self.forward_autograd(q, k, v, causal, scale)
            return out, lse
        else:
            raise RuntimeError(f"{self.name}: PyTorch found no SDPA kernel for these inputs")
        return _back(out), lse.to(acc_dtype(q.dtype))

    def forward_autograd(self, q, k, v, causal, scale):
        if causal and not (torch.isfinite(k).all() and torch.isfinite(v).all()):
            # the math kernel adds the causal mask to the scores (NaN + -inf = NaN), so a non-finite
            # key would reach the rows before it; the same math with the mask applied by masked_fill
            return ManualBackend().forward_autograd(q, k, v, causal, scale)
        with sdpa_kernel(SDPBackend.MATH):
            out = F.scaled_dot_product_attention(to_bhnd(q), to_bhnd(k), to_bhnd(v), is_causal=causal, scale=scale)
        _, lse = ManualBackend().forward_autograd(q, k, k[..., :1], causal, scale)
        return _back(out), lse

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        kern = self._resolve(q, k, causal, v)
        if kern == "math":
            return super().backward(dout, q, k, v, out, lse, causal, scale)
        # The efficient kernel's backward gave wrong dq/dk for [B, H, N, D]-contiguous inputs
        # (seen with torch 2.11 on an H200); [B, N, H, D]-contiguous inputs are right for all.
        # cuDNN and flash read strided rows as they are (``reads_strided_rows``) when out and dout
        # have q's strides (the dilated path's views do). Otherwise all five go contiguous: torch's
        # cuDNN graph cache keys on the q, k, v strides only, and a graph built for other out/dout
        # strides gave wrong gradients or illegal accesses (torch 2.11, H200), so out/dout strides
        # must follow from q's.
        keep = (kern in ("cudnn", "flash") and q.device.type == "cuda" and q.stride(-1) == 1
                and out.stride() == dout.stride() == q.stride() and k.stride(-1) == v.stride(-1) == 1)
        qt, kt, vt, ot, dot = (to_bhnd(t if keep else t.contiguous()) for t in (q, k, v, out, dout))
        kern = self._graph_or_flash(kern, (qt, kt, vt, ot, dot), "backward", causal)
        reduce_to = None
        if kern != "cudnn" and k.shape[2] != q.shape[2]:  # the flash fallback of a GQA cuDNN call
            reduce_to = q.shape[2] // k.shape[2]
            kt, vt = (to_bhnd(expand_kv_heads(t, reduce_to)) for t in (k, v))
        nq, nk = q.shape[1], k.shape[1]
        lse = lse.to(acc_dtype(q.dtype) if q.device.type == "cpu" else torch.float32).contiguous()
        if kern == "flash" and q.device.type == "cpu":
            grads = aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dot, qt, kt, vt, ot, lse, 0.0, causal, scale=scale)
        elif kern == "flash":
            grads = _sliced_backward(lambda *t: aten._scaled_dot_product_flash_attention_backward(
                *t, None, None, nq, nk, 0.0, causal, None, None, scale=scale)[:3],
                FLASH_BACKWARD_MAX, "flash", dot, qt, kt, vt, ot, lse)
        elif kern == "efficient":
            pad = (-nq) % 32
            lse_p = F.pad(lse, (0, pad)) if pad else lse
            zero = torch.zeros((), dtype=torch.int64, device=q.device)
            grads = aten._scaled_dot_product_efficient_attention_backward(
                dot, qt, kt, vt, None, ot, lse_p, zero, zero, 0.0, [True, True, True, False], causal, scale=scale)[:3]
        elif kern == "cudnn":
            zero = torch.zeros((), dtype=torch.int64, device=q.device)
            grads = _sliced_backward(lambda *t: aten._scaled_dot_product_cudnn_attention_backward(
                *t[:5], t[5].unsqueeze(-1), zero, zero, None, None, None, nq, nk, 0.0, causal, scale=scale),
                CUDNN_BACKWARD_MAX, "sdpa_cudnn", dot, qt, kt, vt, ot, lse)
        else:
            raise RuntimeError(f"{self.name}: PyTorch found no SDPA kernel for these inputs")
        dq, dk, dv = (_back(g) for g in grads)
        if reduce_to is not None:  # the gradient of the expansion: each group's heads summed
            dk, dv = reduce_kv_heads(dk, reduce_to), reduce_kv_heads(dv, reduce_to)
        return dq, dk, dv


#: the largest float32 dq accumulator (elements) flash's backward indexes right
FLASH_BACKWARD_MAX = 2**31
#: the largest dq (elements) cuDNN's backward computes right
CUDNN_BACKWARD_MAX = 2**31


def backward_slices(b: int, h: int, n: int, d: int, most: int | None = None, group: int = 1,
                    kernel: str = "flash"):
    """``(dim, [(start, length), ...])``: slices of the batch (dim 0) of a ``[b, h, n, d]``
    backward whose dq (rows rounded up to 128, head_dim to 32, as flash's accumulator) stays
    within ``most`` (default :data:`FLASH_BACKWARD_MAX`) elements each, single entries where one
    is larger (then sliced again), or, for one batch entry, slices of the heads (dim 1) in whole
    groups of ``group`` heads (GQA: the heads sharing one k/v head); None where the whole call
    stays within. ValueError where one group is larger, naming ``kernel``."""
    most = FLASH_BACKWARD_MAX if most is None else most
    row = -(-n // 128) * 128 * (-(-d // 32) * 32)  # one head's dq
    if b * h * row <= most:
        return None
    if b > 1:
        step = max(1, most // (h * row))
        return 0, [(s, min(step, b - s)) for s in range(0, b, step)]
    if row * group > most:
        raise ValueError(f"{kernel}'s backward cannot take {n} query rows of head_dim {d} in {group} head(s) "
                         f"({row * group} dq elements > {most}): use flash_attn_4 for such calls")
    step = most // (row * group) * group
    return 1, [(s, min(step, h - s)) for s in range(0, h, step)]


def _sliced_backward(call, most: int, kernel: str, dot, qt, kt, vt, ot, lse):
    """``call(dot, qt, kt, vt, ot, lse) -> (dq, dk, dv)`` (``[B, H, N, D]`` views; k, v with
    ``H / group`` heads) in slices of the batch or of the heads that keep dq within ``most``
    elements (:func:`backward_slices`), their gradients joined in ``[B, N, H, D]`` memory order."""
    group = qt.shape[1] // kt.shape[1]
    slices = backward_slices(*qt.shape, most=most, group=group, kernel=kernel)
    if slices is None:
        return call(dot, qt, kt, vt, ot, lse)
    dim, parts = slices
    grads = []
    for s, n in parts:
        kv = (s, n) if dim == 0 else (s // group, n // group)
        grads.append(_sliced_backward(call, most, kernel, *(t.narrow(dim, s, n) for t in (dot, qt)),
                                      *(t.narrow(dim, *kv) for t in (kt, vt)),
                                      *(t.narrow(dim, s, n) for t in (ot, lse))))
    return tuple(to_bhnd(torch.cat([_back(x) for x in g], 0 if dim == 0 else 2)) for g in zip(*grads))


BACKENDS = [SDPABackend(None)] + [SDPABackend(k) for k in _KERNELS]
