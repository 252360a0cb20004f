"""Seeded random configurations against the float64 references: the corners a hand-picked case
list misses (lengths that no segment divides, rates up to the segment, grouped heads, bottom-right
causal with fewer or more queries than keys, packed documents, head dims other than 64).

On CPU: every CPU backend in float64, forward and gradients. On a GPU: every backend there in
bf16 with head dims 16-256; a backend may refuse a configuration only with a
:class:`~dilated.BackendUnavailableError` that says why.
"""
import random

import pytest
import torch

import dilated
from dilated.backends import BackendUnavailableError
from dilated.reference import dense_reference, dilated_reference

from conftest import TOL, rel_err

CPU_BACKENDS = ["manual", "sdpa", "sdpa_math", "auto"]
GPU_BACKENDS = ([n for n, r in dilated.available_backends("cuda").items() if r is None
                 and dilated.backends.get_backend(n, device="cuda").supports_backward]
                if torch.cuda.is_available() else [])


def _schedule(rng):
    segs = sorted(rng.choice([2, 3, 4, 6, 8, 12, 16, 24, 32, 48]) for _ in range(rng.randint(1, 4)))
    dils = [min(w, r) for w, r in zip(segs, sorted(rng.choice([1, 2, 3, 4]) for _ in segs))]
    dils[0] = 1  # every row covered (the uncovered-rows warning has tests of its own)
    return segs, dils


def _inputs(rng, gen, b, nq, nk, h, hkv, d, device, dtype):
    def one(n, heads):
        x = torch.randn(b, n, heads, d, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)
        if rng.random() < 0.3:  # [B, H, N, D] memory seen through a [B, N, H, D] view
            x = x.transpose(1, 2).contiguous().transpose(1, 2)
        return x.requires_grad_()
    return one(nq, h), one(nk, hkv), one(nk, hkv)


def _check(out, ref, inputs, ref_inputs, dout, tol):
    assert rel_err(out, ref) < tol
    grads = torch.autograd.grad(out, inputs, dout)
    for name, g, rg in zip("qkv", grads, torch.autograd.grad(ref, ref_inputs, dout.double())):
        assert rel_err(g, rg) < 2 * tol, f"d{name}"


def _documents(rng, n, device):
    cuts = sorted(rng.sample(range(1, n), min(n - 1, rng.randint(1, 4))))
    cu = [0, *cuts, n]
    doc = torch.zeros(n, dtype=torch.long)
    for i in range(len(cu) - 1):
        doc[cu[i]:cu[i + 1]] = i
    return torch.tensor(cu, dtype=torch.int32, device=device), doc


def _dense_case(seed, device, dtype, backends, head_dims):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    backend = rng.choice(backends)
    causal = rng.random() < 0.5
    b, hkv = rng.choice([1, 2]), rng.choice([1, 2])
    h, d = hkv * rng.choice([1, 2, 4]), rng.choice(head_dims)
    nq = rng.choice([1, 5, 31, 64, 97, 200])
    nk = nq if rng.random() < 0.6 else rng.choice([1, 9, 64, 150])
    q, k, v = _inputs(rng, gen, b, nq, nk, h, hkv, d, device, dtype)
    kw, bias = {}, None
    if nq == nk > 2 and rng.random() < 0.4:
        kw["cu_seqlens"], doc = _documents(rng, nq, device)
        seen = doc[:, None] == doc[None, :]
        if causal:
            seen &= torch.ones(nq, nq, dtype=torch.bool).tril()
        bias = torch.where(seen, 0.0, float("-inf")).double().unsqueeze(0).to(device)
    try:
        out = dilated.attention(q, k, v, causal=causal, backend=backend, **kw)
    except BackendUnavailableError as e:  # refused, and said why
        assert backend in str(e) or "auto" in str(e)
        return
    ref_in = tuple(t.detach().double().requires_grad_() for t in (q, k, v))
    ref = dense_reference(*ref_in, causal=causal and bias is None, bias=bias)[0]
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)
    _check(out, ref, (q, k, v), ref_in, dout, TOL[dtype])


def _dilated_case(seed, device, dtype, backends, head_dims):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    backend = rng.choice(backends)
    causal = rng.random() < 0.5
    segs, dils = _schedule(rng)
    b, hkv = rng.choice([1, 2]), rng.choice([1, 2])
    h, d = hkv * rng.choice([2, 4]), rng.choice(head_dims)
    n = rng.randint(1, 100)
    q, k, v = _inputs(rng, gen, b, n, n, h, hkv, d, device, dtype)
    cls = rng.choice([dilated.ImprovedDilatedAttention, dilated.DilatedAttention])
    try:
        out = cls(segs, dils, causal=causal, backend=backend)(q, k, v)
    except BackendUnavailableError as e:
        assert backend in str(e) or "auto" in str(e)
        return
    ref_in = tuple(t.detach().double().requires_grad_() for t in (q, k, v))
    ref = dilated_reference(*ref_in, segs, dils, causal=causal)
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)
    _check(out, ref, (q, k, v), ref_in, dout, TOL[dtype])


@pytest.mark.parametrize("seed", range(24))
def test_random_dense_configurations(seed):
    _dense_case(seed, "cpu", torch.float64, CPU_BACKENDS, [4, 8, 12])


@pytest.mark.parametrize("seed", range(24))
def test_random_dilated_configurations(seed):
    _dilated_case(seed, "cpu", torch.float64, CPU_BACKENDS, [4, 8, 12])


GPU_HEAD_DIMS = [16, 20, 48, 64, 80, 96, 128, 256]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("seed", range(32))
def test_gpu_random_dense_configurations(seed):
    _dense_case(seed, "cuda", torch.bfloat16, GPU_BACKENDS, GPU_HEAD_DIMS)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("seed", range(32))
def test_gpu_random_dilated_configurations(seed):
    _dilated_case(seed, "cuda", torch.bfloat16, GPU_BACKENDS, GPU_HEAD_DIMS)


def _harness_case(rng):
    """A random configuration at the sizes users run: an implementation, a backend (fused, or
    auto), thousands to hundreds of thousands of tokens, GQA, head dims 32-256, bf16/fp16, causal
    or not, packed documents, a schedule that N does not divide, a logit scale."""
    from dilated.bench import Case

    fused = [n for n in GPU_BACKENDS if not dilated.backends.get_backend(n, device="cuda").materializes_scores]
    impl = rng.choice(["improved", "improved", "dilated", "multihead", "improved_pool", "dense", "dense"])
    hkv = rng.choice([1, 2, 4, 8])
    h, d = hkv * rng.choice([1, 2, 4]), rng.choice([32, 64, 80, 96, 128, 192, 256])
    segs = sorted({rng.choice([512, 1000, 1536, 2048, 3000, 4096, 8192, 16384, 32768]) for _ in range(rng.randint(1, 5))})
    rates = sorted(rng.choice([1, 2, 3, 4, 6, 8, 16]) for _ in segs)
    rates[0] = 1
    n = rng.randint(3000, 32000 if impl == "dense" else 200_000)
    b = rng.choice([1, 1, 2])
    while b * n * h * d > 2e8:
        n //= 2
    docs = rng.choice([None, "fixed:4k", "uniform:1k-16k", "lognormal:8k,1.0"]) if impl == "dense" else None
    case = Case(batch=b, seq_len=n * (4 if docs else 1), num_heads=h, head_dim=d,
                num_kv_heads=None if hkv == h or impl == "multihead" else hkv,
                dtype=rng.choice(["bfloat16", "bfloat16", "float16"]), causal=rng.random() < 0.5,
                mode=rng.choice(["fwd", "fwd_bwd", "fwd_bwd"]), documents=docs,
                segment_lengths=None if impl == "dense" else tuple(segs),
                dilation_rates=None if impl == "dense" else tuple(rates), input_scale=rng.choice([1.0, 0.1, 4.0]))
    return impl, case, rng.choice(fused + ["auto"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("seed", range(16))
def test_gpu_random_configurations_at_scale_through_the_harness(seed):
    """Beyond the float64 reference's size: every row checked on sampled rows (output, and dq for
    gradients) against the streamed float64 reference, or a clean unsupported/oom row."""
    from dilated.bench import RunOptions, run_sweep
    from dilated.bench.registry import get_implementation

    impl, case, backend = _harness_case(random.Random(1000 + seed))
    row = run_sweep([(get_implementation(impl), case, backend)], RunOptions(warmup=1, reps=1, warmup_s=0, rep_s=0),
                    None, "test", progress=False)[0]
    if row["status"] in ("unsupported", "oom"):
        assert row["reason"]
        return
    assert row["status"] == "ok", row["reason"]
    assert row["check"]["passed"], (impl, backend, case, row["check"])
