"""The benchmarked implementations, by name: what to build, its inputs, FLOPs and reference.

Register your own with :func:`register_implementation` (see ``examples/custom_benchmark.py``).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

import dilated
from dilated.reference import dense_reference, dilated_bias, sampled_reference

from . import flops as F

DTYPES = {"float16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float32": torch.float32, "fp32": torch.float32, "float64": torch.float64}


def device_generator(gen: torch.Generator, device) -> torch.Generator:
    """A generator on ``device`` seeded from ``gen``: inputs are made where they live (a 4M-token
    q in float32 would be 32 GB of host memory), reproducibly for a given seed and device type."""
    seed = int(torch.randint(0, 2 ** 62, (1,), generator=gen))
    return torch.Generator(device=device).manual_seed(seed)


@dataclass(frozen=True)
class Case:
    """One benchmarked configuration. ``q_len`` < ``seq_len`` is decode/chunked prefill against a KV cache."""

    batch: int
    seq_len: int
    num_heads: int
    head_dim: int
    num_kv_heads: int | None = None
    q_len: int | None = None
    dtype: str = "bfloat16"
    causal: bool = False
    mode: str = "fwd"
    segment_lengths: tuple | None = None
    dilation_rates: tuple | None = None
    input_scale: float = 1.0  # q and k (a module's x) multiplied by it: logits scale by its square
    head_dim_v: int | None = None  # v's head_dim where it differs from q's and k's

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def dv(self) -> int:
        return self.head_dim_v or self.head_dim

    @property
    def nq(self) -> int:
        return self.q_len or self.seq_len

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def config(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        for k in ("segment_lengths", "dilation_rates"):
            d[k] = list(d[k]) if d[k] is not None else None
        if d["input_scale"] == 1.0:  # the usual inputs: rows keep the keys they always had
            del d["input_scale"]
        if d["head_dim_v"] is None:
            del d["head_dim_v"]
        return d


@dataclass
class Implementation:
    """How the harness benchmarks one thing. ``build(case, backend)`` returns a callable on ``inputs``."""

    name: str
    kind: str  # "dense", "dilated" or "module" (takes a [B, N, E] input)
    build: callable
    description: str = ""
    options: dict = field(default_factory=dict)

    def inputs(self, case: Case, device, gen: torch.Generator, requires_grad: bool, captured: dict | None = None):
        """Seeded random inputs, or ``captured`` tensors (see :mod:`dilated.bench.captured`) moved to ``device``."""
        if captured is not None:
            keys = ("x",) if self.kind == "module" else ("q", "k", "v")
            if not set(keys) <= captured.keys():
                raise NotImplementedError(f"captured inputs hold {sorted(captured)}; a {self.kind} implementation "
                                          f"needs {', '.join(keys)}")
            return tuple(captured[k].detach().to(device=device, dtype=case.torch_dtype).requires_grad_(requires_grad)
                         for k in keys)

        dev_gen = device_generator(gen, device)

        def r(*shape):
            return torch.randn(*shape, generator=dev_gen, device=device, dtype=case.torch_dtype)

        s = case.input_scale
        if self.kind == "module":
            x = r(case.batch, case.seq_len, case.num_heads * case.head_dim) * s
            return (x.requires_grad_(requires_grad),)
        q = r(case.batch, case.nq, case.num_heads, case.head_dim) * s
        k = r(case.batch, case.seq_len, case.kv_heads, case.head_dim) * s
        v = r(case.batch, case.seq_len, case.kv_heads, case.dv)
        return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))

    def flops(self, case: Case, mode: str) -> float:
        if self.kind == "dense":
            return F.dense_flops(case.batch, case.num_heads, case.nq, case.seq_len, case.head_dim, case.causal, mode,
                                 case.dv)
        attn = F.dilated_flops(case.batch, case.num_heads, case.seq_len, case.head_dim, case.segment_lengths,
                               case.dilation_rates, case.causal, mode)
        if self.kind == "module":
            e, kv = case.num_heads * case.head_dim, case.kv_heads * case.head_dim
            linear_factor = {"fwd": 1.0, "bwd": 2.0, "fwd_bwd": 3.0}[mode]  # dX and dW in backward
            attn += 2.0 * case.batch * case.seq_len * e * (2 * e + 2 * kv) * linear_factor
        return attn

    def min_bytes(self, case: Case, mode: str) -> float:
        elem = torch.empty((), dtype=case.torch_dtype).element_size()
        return F.min_bytes(case.batch, case.nq, case.seq_len, case.num_heads, case.kv_heads, case.head_dim, elem, mode,
                           case.dv)

    # -- hooks for implementations spread over ranks (see dilated.bench.distributed) ---------
    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """The full tensor of which ``t`` is this process's part (identity on one device)."""
        return t

    def reduce_max(self, values: list[float]) -> list[float]:
        """Elementwise maximum over the ranks taking part (identity on one device)."""
        return values

    def before_call(self) -> None:
        """Runs untimed before each timed call (a barrier across ranks)."""

    def all_ranks_text(self, text: str) -> list[str]:
        """Every taking-part rank's ``text``, in rank order (``[text]`` on one device): how the
        ranks of a row learn each other's failures."""
        return [text]

    def comm_metrics(self, model, step, seconds_per_call: float = 0.0) -> dict | None:
        """Communication per call of ``step`` (bytes, messages, exposed wait), or None."""
        return None

    # -- references -----------------------------------------------------------------------
    def _qkv_for_reference(self, case, inputs, model):
        if self.kind != "module":
            return inputs
        (x,) = inputs
        b, n = x.shape[:2]
        return (model.q_proj(x).view(b, n, case.num_heads, case.head_dim),
                model.k_proj(x).view(b, n, case.kv_heads, case.head_dim),
                model.v_proj(x).view(b, n, case.kv_heads, case.head_dim))

    def reference(self, case: Case, inputs, model, dtype=torch.float64):
        """Full reference output (differentiable in ``inputs`` when they require grad)."""
        if self.kind == "module":
            model = copy.deepcopy(model).to(dtype)
            inputs = tuple(t.to(dtype) for t in inputs)
        q, k, v = (t.to(dtype) for t in self._qkv_for_reference(case, inputs, model))
        if self.kind == "dense":
            return dense_reference(q, k, v, causal=case.causal, dtype=dtype)[0]
        bias = dilated_bias(case.seq_len, case.num_heads, case.segment_lengths, case.dilation_rates, case.causal,
                            q.device, dtype)
        out = dense_reference(q, k, v, bias=bias, dtype=dtype)[0]
        if self.kind == "module":
            b, n = out.shape[:2]
            out = out.reshape(b, n, -1)
            if model.norm is not None:
                out = model.norm(out)
            out = model.out_proj(out)
        return out

    def sampled_reference(self, case: Case, inputs, model, rows):
        """Reference output at query ``rows`` only, streaming over keys (for long sequences)."""
        with torch.no_grad():
            q, k, v = self._qkv_for_reference(case, inputs, model)
            segs = case.segment_lengths if self.kind != "dense" else None
            out = sampled_reference(q, k, v, rows, causal=case.causal, segment_lengths=segs,
                                    dilation_rates=case.dilation_rates if segs else None)
            if self.kind == "module":
                b = out.shape[0]
                out = out.reshape(b, len(rows), -1).to(inputs[0].dtype)
                if model.norm is not None:
                    out = model.norm(out)
                out = model.out_proj(out).float()
            return out


IMPLEMENTATIONS: dict[str, Implementation] = {}


def register_implementation(impl: Implementation) -> Implementation:
    IMPLEMENTATIONS[impl.name] = impl
    return impl


def implementation_names(distributed: bool | None = None) -> list[str]:
    """Every registered implementation (``distributed``: only those that run across ranks, or only
    those that do not)."""
    from . import external_ring  # noqa: F401  (registers the ring implementations)
    from .distributed import DistributedImplementation

    return [n for n, impl in IMPLEMENTATIONS.items()
            if distributed is None or isinstance(impl, DistributedImplementation) == distributed]


def get_implementation(name: str) -> Implementation:
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"unknown implementation {name!r}; choose from: {', '.join(IMPLEMENTATIONS)}")
    return IMPLEMENTATIONS[name]


def _dense(case, backend, compile=False):
    def fn(q, k, v):
        return dilated.attention(q, k, v, causal=case.causal, backend=backend)

    if compile:
        return torch.compile(fn)
    return fn


def _dilated(case, backend):
    return dilated.DilatedAttention(case.segment_lengths, case.dilation_rates, causal=case.causal, backend=backend)


def _improved(case, backend, pattern_cache=True, memory_pool=False):
    return dilated.ImprovedDilatedAttention(case.segment_lengths, case.dilation_rates, causal=case.causal,
                                            backend=backend, pattern_cache=pattern_cache, memory_pool=memory_pool)


def _multihead(case, backend, improved=True):
    layer = dilated.MultiheadDilatedAttention(
        case.num_heads * case.head_dim, case.num_heads, case.segment_lengths, case.dilation_rates,
        num_kv_heads=case.num_kv_heads, causal=case.causal, backend=backend, improved=improved)
    return layer


def _manual_compiled(case, backend):
    from dilated.reference import dense_reference as _ref

    def fn(q, k, v):
        return _ref(q, k, v, causal=case.causal, dtype=q.dtype)[0]

    return torch.compile(fn)


for _impl in [
    Implementation("dense", "dense", _dense, "dilated.attention: exact dense attention (the quadratic baseline)"),
    Implementation("dense_compiled", "dense", lambda c, b: _dense(c, b, compile=True),
                   "torch.compile(dilated.attention)"),
    Implementation("manual_compiled", "dense", _manual_compiled,
                   "torch.compile of plain matmul-softmax-matmul (materialises the scores)"),
    Implementation("dilated", "dilated", _dilated, "DilatedAttention (readable)"),
    Implementation("improved", "dilated", _improved, "ImprovedDilatedAttention (pattern cache on, pool off)"),
    Implementation("improved_pool", "dilated", lambda c, b: _improved(c, b, memory_pool=True),
                   "ImprovedDilatedAttention with the memory pool on"),
    Implementation("improved_nocache", "dilated", lambda c, b: _improved(c, b, pattern_cache=False),
                   "ImprovedDilatedAttention with the pattern cache off"),
    Implementation("multihead", "module", _multihead, "MultiheadDilatedAttention(improved=True)"),
    Implementation("multihead_readable", "module", lambda c, b: _multihead(c, b, improved=False),
                   "MultiheadDilatedAttention(improved=False)"),
]:
    register_implementation(_impl)
