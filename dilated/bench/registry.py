"""The benchmarked implementations, by name: what to build, its inputs, FLOPs and reference.

Register your own with :func:`register_implementation` (see ``examples/custom_benchmark.py``).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import torch

import dilated
from .documents import cu_tensor
from .problems import problem_named

DTYPES = {"float16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float32": torch.float32, "fp32": torch.float32, "float64": torch.float64}


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
    documents: str | None = None  # packed documents (a --doc-lengths spec, dilated.bench.documents)

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
        for key in ("head_dim_v", "documents"):  # set only where used: rows keep the keys they always had
            if d[key] is None:
                del d[key]
        return d


@dataclass
class Implementation:
    """How the harness benchmarks one thing: ``build(case, backend)`` returns a callable on the
    inputs that ``problem`` (a :mod:`~dilated.bench.problems` problem, or its name) makes, and the
    problem counts its FLOPs and computes its reference."""

    name: str
    problem: object  # a Problem, or "dense", "dilated" or "module"
    build: callable
    description: str = ""
    options: dict = field(default_factory=dict)
    #: True for implementations whose inputs are shards over ranks (DistributedImplementation)
    runs_on_ranks = False

    def __post_init__(self):
        self.problem = problem_named(self.problem)

    def inputs(self, case: Case, device, gen: torch.Generator, requires_grad: bool, captured: dict | None = None):
        """Seeded random inputs, or ``captured`` tensors (see :mod:`dilated.bench.captured`) moved to ``device``."""
        return self.problem.inputs(case, device, gen, requires_grad, captured)

    def flops(self, case: Case, mode: str) -> float:
        return self.problem.flops(case, mode)

    def min_bytes(self, case: Case, mode: str) -> float:
        return self.problem.min_bytes(case, mode)

    def reference(self, case: Case, inputs, model, dtype=torch.float64):
        """Full reference output (differentiable in ``inputs`` when they require grad)."""
        return self.problem.reference(case, inputs, model, dtype)

    def sampled_reference(self, case: Case, inputs, model, rows, dout=None):
        """Reference output at query ``rows`` only, streaming over keys (for long sequences); with
        ``dout``, ``(out, dq)`` of those rows (dq None where the inputs are not q, k, v)."""
        return self.problem.sampled_reference(case, inputs, model, rows, dout)

    # -- hooks for implementations spread over ranks (see dilated.bench.distributed) ---------
    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """The full tensor of which ``t`` is this process's part (identity on one device)."""
        return t

    def reduce_max(self, values: list[float]) -> list[float]:
        """Elementwise maximum over the ranks taking part (identity on one device)."""
        return values

    def ranks(self) -> int:
        """How many GPUs (ranks) share one call: a row's ``tflops`` is over all of them, its
        ``per_rank_tflops`` and ``pct_peak`` are per GPU."""
        return 1

    def before_call(self) -> None:
        """Runs untimed before each timed call (a barrier across ranks)."""

    def all_ranks_text(self, text: str) -> list[str]:
        """Every taking-part rank's ``text``, in rank order (``[text]`` on one device): how the
        ranks of a row learn each other's failures."""
        return [text]

    def comm_metrics(self, model, step, seconds_per_call: float = 0.0) -> dict | None:
        """Communication per call of ``step`` (bytes, messages, exposed wait), or None."""
        return None


IMPLEMENTATIONS: dict[str, Implementation] = {}
#: the modules that register the sequence-parallel implementations, loaded by name (this module
#: imports none of them: they import it)
PROVIDERS = ("dilated.bench.strategies", "dilated.bench.external_ring")


def load_providers() -> None:
    """Import every module of :data:`PROVIDERS` (each registers its implementations once)."""
    for name in PROVIDERS:
        importlib.import_module(name)


def register_implementation(impl: Implementation) -> Implementation:
    IMPLEMENTATIONS[impl.name] = impl
    return impl


def implementation_names(distributed: bool | None = None) -> list[str]:
    """Every registered implementation (``distributed``: only those that run across ranks, or only
    those that do not)."""
    load_providers()
    return [n for n, impl in IMPLEMENTATIONS.items()
            if distributed is None or impl.runs_on_ranks == distributed]


def get_implementation(name: str) -> Implementation:
    if name not in IMPLEMENTATIONS:
        load_providers()
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"unknown implementation {name!r}; choose from: {', '.join(IMPLEMENTATIONS)}")
    return IMPLEMENTATIONS[name]


def _dense(case, backend, compile=False):
    def fn(q, k, v):
        return dilated.attention(q, k, v, causal=case.causal, backend=backend,
                                 cu_seqlens=cu_tensor(case.documents, case.seq_len))

    if compile:
        return torch.compile(fn)
    return fn


def _dilated(case, backend):
    return dilated.DilatedAttention(case.segment_lengths, case.dilation_rates, causal=case.causal, backend=backend)


def _improved(case, backend, pattern_cache=True, memory_pool=False, layout="natural"):
    return dilated.ImprovedDilatedAttention(case.segment_lengths, case.dilation_rates, causal=case.causal,
                                            backend=backend, pattern_cache=pattern_cache, memory_pool=memory_pool,
                                            layout=layout)


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
    Implementation("improved_residue_major", "dilated_residue_major",
                   lambda c, b: _improved(c, b, layout="residue_major"),
                   "ImprovedDilatedAttention(layout='residue_major') on inputs in that order: one block-sparse "
                   "call where a kernel takes block lists (flash-attn 4 on Hopper), else the natural path between "
                   "permutes"),
    Implementation("multihead", "module", _multihead, "MultiheadDilatedAttention(improved=True)"),
    Implementation("multihead_readable", "module", lambda c, b: _multihead(c, b, improved=False),
                   "MultiheadDilatedAttention(improved=False)"),
]:
    register_implementation(_impl)
