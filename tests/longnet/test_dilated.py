"""Both dilated implementations against the float64 dense reference of the definition."""
import pytest
import torch

import dilated
from dilated.backends import get_backend
from dilated.reference import dilated_reference

from conftest import GPU_CASE, TOL, check_gpu_bf16, rand, rel_err

IMPLS = {"dilated": dilated.dilated_attention, "improved": dilated.improved_dilated_attention}
CASES = [  # (N, H, Hkv, segments, dilations)
    (32, 4, 4, [8, 16], [1, 2]),          # N divisible by every w
    (30, 4, 4, [8, 16], [1, 2]),          # N not divisible
    (29, 6, 2, [12, 7], [5, 2]),          # w not a multiple of r, GQA
    (10, 4, 4, [16, 32], [2, 4]),         # N < w, no r = 1: uncovered positions
    (24, 8, 2, [8, 24], [2, 4]),          # GQA with r > 1
    (40, 3, 3, [8, 16, 32], [1, 2, 4]),   # heads not divisible by r
    (1, 2, 1, [4], [1]),                  # N = 1
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"N{c[0]}H{c[1]}kv{c[2]}w{c[3]}r{c[4]}")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference_forward_and_gradients(impl, case, causal, dtype, gen):
    n, h, hkv, segs, dils = case
    q = rand(2, n, h, 16, gen=gen, dtype=dtype, requires_grad=True)
    k = rand(2, n, hkv, 16, gen=gen, dtype=dtype, requires_grad=True)
    v = rand(2, n, hkv, 16, gen=gen, dtype=dtype, requires_grad=True)
    out = IMPLS[impl](q, k, v, segs, dils, causal=causal)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = dilated_reference(qd, kd, vd, segs, dils, causal)
    assert out.dtype == dtype
    assert rel_err(out, ref) < TOL[dtype]
    dout = rand(2, n, h, 16, gen=gen, dtype=dtype)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref, (qd, kd, vd), dout.double())
    for name, g, rg in zip("qkv", grads, ref_grads):
        assert rel_err(g, rg) < 2 * TOL[dtype], f"d{name}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"N{c[0]}H{c[1]}kv{c[2]}w{c[3]}r{c[4]}")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("batch", [1, 2])
def test_improved_in_place_matches_reference(case, causal, batch, gen, monkeypatch):
    """r > 1 branches read in place, strided views into the kernel (what cuDNN and flash get on
    CUDA; batch 1 also one call per segment with all head offsets), here forced for every branch
    on the CPU backends: forward and gradients."""
    from dilated.backends.sdpa import SDPABackend

    monkeypatch.setattr(SDPABackend, "reads_strided_rows", lambda self, q, k, causal: True)
    monkeypatch.setattr("dilated.longnet.plan.in_place_min_tiles", lambda device: 0)
    n, h, hkv, segs, dils = case
    q, k, v = (rand(batch, n, x, 16, gen=gen, requires_grad=True) for x in (h, hkv, hkv))
    out = dilated.improved_dilated_attention(q, k, v, segs, dils, causal=causal, backend="sdpa")
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = dilated_reference(qd, kd, vd, segs, dils, causal)
    assert rel_err(out, ref) < TOL[torch.float32]
    dout = rand(batch, n, h, 16, gen=gen)
    for g, rg in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref, (qd, kd, vd), dout.double())):
        assert rel_err(g, rg) < 2 * TOL[torch.float32]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"N{c[0]}H{c[1]}kv{c[2]}w{c[3]}r{c[4]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_place", [False, True])
def test_improved_merging_as_it_goes_matches_reference(case, dtype, in_place, gen, monkeypatch):
    """Where the calls' outputs do not fit together, each call is merged into the result as it
    finishes (forward) and each call's gradients added as they come (backward): forward and
    gradients against float64, causal, gathered and in-place plans; the calls' outputs are freed
    as they go."""
    import importlib
    import weakref

    from dilated.backends.sdpa import SDPABackend

    ida = importlib.import_module("dilated.longnet.dilated_calls")

    monkeypatch.setattr(ida, "merges_as_it_goes", lambda x, plan, tensors: True)
    if in_place:
        monkeypatch.setattr(SDPABackend, "reads_strided_rows", lambda self, q, k, causal: True)
        monkeypatch.setattr("dilated.longnet.plan.in_place_min_tiles", lambda device: 0)
    held = []
    each = ida._forward_each

    def tracked(*a):
        for c, o, lse in each(*a):
            assert all(r() is None for r in held[:-1]), "an earlier call's output is still held"
            held.append(weakref.ref(o))
            yield c, o, lse

    monkeypatch.setattr(ida, "_forward_each", tracked)
    n, h, hkv, segs, dils = case
    q, k, v = (rand(1, n, x, 16, gen=gen, dtype=dtype, requires_grad=True) for x in (h, hkv, hkv))
    out = dilated.improved_dilated_attention(q, k, v, segs, dils, causal=True, backend="sdpa")
    assert out.dtype == dtype and len(held) > 0
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = dilated_reference(qd, kd, vd, segs, dils, True)
    assert rel_err(out, ref) < TOL[dtype]
    dout = rand(1, n, h, 16, gen=gen, dtype=dtype)
    for name, g, rg in zip("qkv", torch.autograd.grad(out, (q, k, v), dout),
                           torch.autograd.grad(ref, (qd, kd, vd), dout.double())):
        assert g.dtype == dtype and rel_err(g, rg) < 2 * TOL[dtype], f"d{name}"


def test_merging_as_it_goes_is_chosen_where_the_outputs_do_not_fit(monkeypatch):
    """The calls' outputs of LongNet's schedule are about 1.94 results (r = 1, 2, 4, 8, 16 cover
    1/r of the rows each): merged as they go where 1.5 times that exceeds the free memory, on
    CUDA only (a CUDA device is stood in for by the tensor's device type)."""
    import importlib

    from dilated.longnet.plan import build_plan

    ida = importlib.import_module("dilated.longnet.dilated_calls")
    b, n, h, d = 2, 1 << 20, 16, 128
    plan = build_plan(n, h, h, [2048, 4096, 8192, 16384, 32768], [1, 2, 4, 8, 16], "cpu")
    result = b * n * h * d * 2  # bytes of one bf16 result
    need = sum(ida._covered_pairs(c, h) for c in plan) * b * d * 2
    assert need == pytest.approx(result * (1 + 1 / 2 + 1 / 4 + 1 / 8 + 1 / 16))

    class Fake:  # the shape, dtype size and device type of a bf16 CUDA tensor
        shape, device = (b, n, h, d), torch.device("cuda", 0)

        @staticmethod
        def element_size():
            return 2

    for free, tensors, merges in ((2 * result, 1, True), (4 * result, 1, False), (8 * result, 3, True),
                                  (10 * result, 3, False)):
        monkeypatch.setattr(ida, "free_bytes", lambda device: free)
        assert ida.merges_as_it_goes(Fake, plan, tensors) == merges, (free / result, tensors)
    cpu = torch.zeros(1, 1, 1, 1, dtype=torch.bfloat16).expand(b, n, h, d)
    assert not ida.merges_as_it_goes(cpu, plan, 3)  # host memory: always the fast path


def test_pieces_cover_the_plan_in_small_runs():
    """Merged as they go, calls are cut into runs of whole segments: together exactly the plan's
    segments, each run within its share of the rows unless it is one segment."""
    import importlib

    from dilated.longnet.plan import build_plan

    ida = importlib.import_module("dilated.longnet.dilated_calls")
    n, h = 4096 + 96, 8
    plan = build_plan(n, h, h, [64, 256, 1024], [1, 2, 4], "cpu")
    cut = list(ida.pieces(plan, n, h))

    def segments(calls):
        return sorted((c.mode, c.r, c.offset, c.length, c.start + s * c.length) for c in calls for s in range(c.count))

    assert segments(cut) == segments(plan) and len(cut) > 3 * len(plan)
    assert all(c.count == 1 or ida._covered_pairs(c, h) <= n * h * ida.PIECE_SHARE for c in cut)


@pytest.mark.parametrize("causal", [False, True])
def test_in_place_calls_over_several_segments(causal, gen, monkeypatch):
    """In-place plans whose r > 1 branches span several segments: one call per segment holding all
    offsets (count 2 and 4, fewer calls than offsets) and one call per offset over all segments."""
    from dilated.backends.sdpa import SDPABackend
    from dilated.longnet.plan import build_plan

    monkeypatch.setattr(SDPABackend, "reads_strided_rows", lambda self, q, k, causal: True)
    monkeypatch.setattr("dilated.longnet.plan.in_place_min_tiles", lambda device: 0)
    n, h, segs, dils = 64, 8, [8, 16, 32], [1, 8, 8]
    plan = build_plan(n, h, h, segs, dils, "cpu", batch=1, in_place_tiles=0)
    per_segment = [c for c in plan if c.mode == "diag" and c.in_place]
    assert len(per_segment) == 4 + 2 and {c.start for c in per_segment} == {0, 16, 32, 48}
    plan2 = build_plan(n, 4, 4, [8, 16], [1, 2], "cpu", batch=2, in_place_tiles=0)
    assert any(c.mode == "offset" and c.in_place and c.count == 4 for c in plan2)
    for (b, hh, sg, dl) in ((1, h, segs, dils), (2, 4, [8, 16], [1, 2])):
        q, k, v = (rand(b, n, hh, 16, gen=gen, requires_grad=True) for _ in range(3))
        out = dilated.improved_dilated_attention(q, k, v, sg, dl, causal=causal, backend="sdpa")
        qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref = dilated_reference(qd, kd, vd, sg, dl, causal)
        assert rel_err(out, ref) < TOL[torch.float32]
        dout = rand(b, n, hh, 16, gen=gen)
        for g, rg in zip(torch.autograd.grad(out, (q, k, v), dout),
                         torch.autograd.grad(ref, (qd, kd, vd), dout.double())):
            assert rel_err(g, rg) < 2 * TOL[torch.float32]


@pytest.mark.parametrize("backend", ["sdpa", "sdpa_math", "manual"])
def test_backends_agree_under_dilated(backend, gen):
    q, k, v = (rand(1, 48, 4, 16, gen=gen, requires_grad=True) for _ in range(3))
    out = dilated.improved_dilated_attention(q, k, v, [16, 48], [1, 2], causal=True, backend=backend)
    ref = dilated_reference(q.double(), k.double(), v.double(), [16, 48], [1, 2], True)
    assert rel_err(out, ref) < TOL[torch.float32]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("scale", [0.01, 1.0, 100.0])
def test_input_scales_stay_finite_and_exact(impl, scale, gen):
    q, k, v = (rand(1, 32, 4, 16, gen=gen, scale=scale) for _ in range(3))
    out = IMPLS[impl](q, k, v, [8, 32], [1, 4])
    assert torch.isfinite(out).all()
    assert rel_err(out, dilated_reference(q, k, v, [8, 32], [1, 4])) < 1e-3


def test_positions_no_branch_selects_output_zero(gen):
    q, k, v = (rand(1, 16, 4, 8, gen=gen) for _ in range(3))
    out = dilated.improved_dilated_attention(q, k, v, [8], [2])
    # head 0 reads offsets 0, 2, 4...: odd positions are selected by no branch
    assert torch.equal(out[0, 1::2, 0], torch.zeros_like(out[0, 1::2, 0]))
    assert out[0, 0::2, 0].abs().sum() > 0


@pytest.mark.parametrize("impl", IMPLS)
def test_deterministic(impl, gen):
    q, k, v = (rand(1, 40, 4, 16, gen=gen) for _ in range(3))
    a = IMPLS[impl](q, k, v, [8, 16], [1, 2])
    b = IMPLS[impl](q, k, v, [8, 16], [1, 2])
    assert torch.equal(a, b)


def test_modules_give_the_same_results(gen):
    q, k, v = (rand(2, 40, 4, 16, gen=gen) for _ in range(3))
    a = dilated.DilatedAttention([8, 16], [1, 2], causal=True)(q, k, v)
    b = dilated.ImprovedDilatedAttention([8, 16], [1, 2], causal=True)(q, k, v)
    c = dilated.ImprovedDilatedAttention([8, 16], [1, 2], causal=True, memory_pool=True)(q, k, v)
    assert rel_err(a, b) < 1e-5 and rel_err(b, c) < 1e-6


def test_pattern_cache_hits_and_stays_bounded(gen):
    cache = dilated.PatternCache(max_entries=4)
    attn = dilated.ImprovedDilatedAttention([8, 16], [1, 2], pattern_cache=cache)
    q = rand(1, 32, 4, 8, gen=gen)
    for _ in range(100):
        attn(q, q, q)
    assert cache.stats()["misses"] == 1 and cache.stats()["hits"] == 99 and cache.stats()["size"] == 1
    for n in range(10, 20):
        x = rand(1, n, 4, 8, gen=gen)
        attn(x, x, x)
    assert cache.stats()["size"] == 4


def test_memory_pool_reuses_and_does_not_grow(gen):
    pool = dilated.MemoryPool()
    attn = dilated.ImprovedDilatedAttention([8, 16], [1, 2], memory_pool=pool)
    q = rand(1, 32, 4, 8, gen=gen)
    attn(q, q, q)
    held = pool.stats()["bytes_held"]
    for _ in range(100):
        attn(q, q, q)
    s = pool.stats()
    assert s["hits"] > 0 and s["bytes_held"] == held and s["outstanding"] == 0
    small = dilated.MemoryPool(max_bytes=1024)
    dilated.ImprovedDilatedAttention([8, 16], [1, 2], memory_pool=small)(q, q, q)
    assert small.stats()["bytes_held"] <= 1024


@pytest.mark.parametrize("args, match", [
    (([], []), "segment_lengths is empty"),
    (([8], []), "dilation_rates is empty"),
    (([8, 16], [1]), "same length"),
    (([0], [1]), "positive"),
    (([8], [-1]), "positive"),
    (([4], [8]), "larger than its segment"),
])
def test_bad_schedules(args, match):
    with pytest.raises(ValueError, match=match):
        dilated.DilatedAttention(*args)
    with pytest.raises(ValueError, match=match):
        dilated.ImprovedDilatedAttention(*args)


def test_bad_shapes(gen):
    q = rand(1, 8, 4, 8, gen=gen)
    with pytest.raises(ValueError, match="divisible"):
        dilated.dilated_attention(q, rand(1, 8, 3, 8, gen=gen), rand(1, 8, 3, 8, gen=gen), [4], [1])
    with pytest.raises(ValueError, match="one length"):
        dilated.improved_dilated_attention(q, rand(1, 9, 4, 8, gen=gen), rand(1, 9, 4, 8, gen=gen), [4], [1])


def test_multihead_layer(gen):
    torch.manual_seed(0)
    for improved in (True, False):
        layer = dilated.MultiheadDilatedAttention(32, 4, [8, 16], [1, 2], num_kv_heads=2, causal=True,
                                                  improved=improved)
        x = rand(2, 24, 32, gen=gen, requires_grad=True)
        y = layer(x)
        assert y.shape == x.shape and torch.isfinite(y).all()
        y.square().mean().backward()
        assert all(p.grad is not None for p in layer.parameters())
    # the layer computes out_proj(norm(dilated(q_proj x, k_proj x, v_proj x)))
    layer.eval()
    with torch.no_grad():
        b, n = 2, 24
        q = layer.q_proj(x).view(b, n, 4, 8)
        k = layer.k_proj(x).view(b, n, 2, 8)
        v = layer.v_proj(x).view(b, n, 2, 8)
        ref = dilated_reference(q, k, v, [8, 16], [1, 2], True).float().reshape(b, n, 32)
        assert rel_err(layer(x), layer.out_proj(layer.norm(ref))) < 1e-4
    with pytest.raises(ValueError, match="num_kv_heads"):
        dilated.MultiheadDilatedAttention(32, 4, [8], [1], num_kv_heads=3)
    with pytest.raises(ValueError, match="divisible by num_heads"):
        dilated.MultiheadDilatedAttention(30, 4, [8], [1])


# the backends the dilated path can run on a GPU here (quantized forward-only kernels have no backward)
GPU_BACKENDS = [n for n, r in dilated.available_backends("cuda").items()
                if r is None and get_backend(n, device="cuda").supports_backward] \
    if torch.cuda.is_available() else []


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_bf16_each_backend(backend, impl, causal, gen):
    check_gpu_bf16(lambda *a: IMPLS[impl](*a, causal=causal, backend=backend), causal, gen)


@pytest.mark.skipif(not GPU_BACKENDS, reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["sdpa_cudnn", "sdpa_flash", "flash_attn_4"])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_in_place_calls(backend, causal, gen, monkeypatch):
    """Every r > 1 branch read in place (strided views into the kernel, no gather): bf16 against float64."""
    if backend not in GPU_BACKENDS:
        pytest.skip(f"{backend} is not available here")
    monkeypatch.setattr("dilated.longnet.plan.in_place_min_tiles", lambda device: 0)
    n, segs, dils = GPU_CASE
    plan = dilated.longnet.plan.build_plan(n, 8, 8, segs, dils, "cuda", in_place_tiles=0)
    assert all(c.in_place for c in plan if c.r > 1) and {c.mode for c in plan if c.r > 1} == {"offset", "diag"}
    check_gpu_bf16(lambda *a: dilated.improved_dilated_attention(*a, causal=causal, backend=backend), causal, gen)


def test_layer_norm_in_row_chunks_equals_one_call():
    from dilated.longnet.multihead import layer_norm_rows

    norm = torch.nn.LayerNorm(12)
    x = torch.randn(2, 37, 12, requires_grad=True)
    ref = norm(x)
    out = layer_norm_rows(norm, x, max_elements=100)  # 4 rows of 24 elements per chunk
    assert torch.allclose(out, ref, atol=1e-6)
    g = torch.randn_like(ref)
    (gx,) = torch.autograd.grad(out, x, g)
    (rx,) = torch.autograd.grad(ref, x, g)
    assert torch.allclose(gx, rx, atol=1e-5)
