"""The residue-major layout of a geometric schedule (dilated.longnet.residue_major): its order, its block
lists (against the counts of the float64 definition) and ``layout="residue_major"`` against
float64 dilated attention in the natural order, forward and gradients."""
import warnings

import pytest
import torch

import dilated
from dilated.backends import get_backend, record_kernels
from dilated.reference import dilated_bias, dilated_reference
from dilated.longnet.residue_major import block_lists, residue_major_fast_path_reason

from conftest import TOL, rand, rel_err

GEOMETRIC = [([64, 128, 256], [1, 2, 4]), ([128, 256], [2, 4]), ([256, 64], [4, 1]),
             ([64, 256, 256], [1, 4, 4]), ([64, 128, 256, 512], [1, 2, 4, 8]), ([64], [1])]


def times_listed(lists, n):
    """``[H, N/block, N/block]``: how often each query block lists each key block."""
    h, m = lists.counts.shape[1:]
    out = torch.zeros(h, m, n // lists.block)
    for hh in range(h):
        for i in range(m):
            for j in lists.indices[0, hh, i, :lists.counts[0, hh, i]].tolist():
                out[hh, i, j] += 1
    return out


@pytest.mark.parametrize("segs,rates", GEOMETRIC)
@pytest.mark.parametrize("n,heads", [(512, 3), (1024, 9)])
def test_block_lists_are_the_definitions_counts(segs, rates, n, heads):
    """Each query block lists each key block as often as branches select the pair (the count of
    the float64 definition, permuted to the residue-major order), the same for every row and column
    of the block; the lists are symmetric (the backward reads them per key block)."""
    block = 8
    lists = block_lists(n, heads, segs, rates, block=block)
    count = dilated_bias(n, heads, segs, rates).exp().round()
    pos = dilated.residue_major_positions(n, segs, rates)
    count = count[:, pos][:, :, pos].view(heads, n // block, block, n // block, block)
    corner = count[:, :, 0, :, 0]
    assert (count == corner[:, :, None, :, None]).all()
    got = times_listed(lists, n)
    assert torch.equal(got, corner)
    assert torch.equal(got, got.transpose(1, 2))


def test_order_and_positions():
    """Position ``R a + b`` of each largest segment goes to row ``b * W / R + a``."""
    segs, rates = [4, 8], [1, 2]  # W = 8, R = 2
    pos = dilated.residue_major_positions(16, segs, rates)
    assert pos.tolist() == [0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15]
    x = torch.randn(2, 16, 3, 5)
    y = dilated.to_residue_major(x, segs, rates)
    assert torch.equal(y, x[:, pos])
    assert torch.equal(dilated.from_residue_major(y, segs, rates), x)


def layout_case(segs, rates, n, heads, kv_heads, dtype, backend, gen, d=16, device="cpu", batch=2):
    """``layout="residue_major"`` on inputs in that order against float64 dilated attention of the
    same tokens in the natural order: output and dq, dk, dv."""
    q = rand(batch, n, heads, d, gen=gen, dtype=dtype).to(device)
    k, v = (rand(batch, n, kv_heads, d, gen=gen, dtype=dtype).to(device) for _ in range(2))
    attn = dilated.ImprovedDilatedAttention(segs, rates, backend=backend, layout="residue_major")
    qr, kr, vr = (attn.to_layout(t).requires_grad_() for t in (q, k, v))
    out = attn(qr, kr, vr)
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    g = heads // kv_heads
    ref = dilated_reference(qd, kd.repeat_interleave(g, 2), vd.repeat_interleave(g, 2), segs, rates)
    tol = TOL[dtype]
    assert rel_err(attn.from_layout(out), ref) < tol
    dout = rand(*ref.shape, gen=gen, dtype=dtype).to(device)
    grads = torch.autograd.grad(out, (qr, kr, vr), attn.to_layout(dout))
    for got, want in zip(grads, torch.autograd.grad(ref, (qd, kd, vd), dout.double())):
        assert rel_err(attn.from_layout(got), want) < 2 * tol


@pytest.mark.parametrize("segs,rates", GEOMETRIC[:5])
@pytest.mark.parametrize("backend", ["manual", "auto"])
def test_layout_against_float64(segs, rates, backend, gen):
    """``manual`` runs the block lists (one call); ``auto`` on a CPU has no block-sparse kernel and
    runs the natural-order computation between permutes: both exact, GQA included."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dilated.UncoveredRowsWarning)
        layout_case(segs, rates, 512, 6, 3, torch.float64, backend, gen)
        layout_case(segs, rates, 512, 4, 4, torch.float32, backend, gen)


def test_fast_path_runs_one_block_sparse_call(gen):
    q, k = rand(1, 512, 4, 16, gen=gen), rand(1, 512, 4, 16, gen=gen)
    segs, rates = [64, 128, 256], [1, 2, 4]
    assert residue_major_fast_path_reason(q, k, segs, rates, backend="manual") is None
    assert "non-causal" in residue_major_fast_path_reason(q, k, segs, rates, causal=True, backend="manual")
    assert "does not take lists" in residue_major_fast_path_reason(q, k, segs, rates, backend="sdpa")
    if get_backend("auto", q, k).name != "flash_attn_4":
        assert "flash-attn 4" in residue_major_fast_path_reason(q, k, segs, rates)
    calls = []
    manual = get_backend("manual")
    original = manual.block_sparse_forward
    try:
        manual.block_sparse_forward = lambda *a: calls.append(1) or original(*a)
        attn = dilated.ImprovedDilatedAttention(segs, rates, backend="manual", layout="residue_major")
        with record_kernels() as ran:
            attn(q, k, k)
    finally:
        manual.block_sparse_forward = original
    assert calls == [1] and ran == {"manual"}


def test_causal_layout_runs_between_permutes(gen):
    segs, rates = [64, 128, 256], [1, 2, 4]
    q, k, v = (rand(1, 512, 4, 16, gen=gen, dtype=torch.float64) for _ in range(3))
    attn = dilated.ImprovedDilatedAttention(segs, rates, causal=True, backend="manual", layout="residue_major")
    out = attn.from_layout(attn(*(attn.to_layout(t) for t in (q, k, v))))
    assert rel_err(out, dilated_reference(q, k, v, segs, rates, causal=True)) < TOL[torch.float64]


def test_layout_errors(gen):
    with pytest.raises(ValueError, match="layout must be one of"):
        dilated.ImprovedDilatedAttention([64], [1], layout="zigzag")
    with pytest.raises(ValueError, match="geometric schedule.*layout='natural'"):
        dilated.ImprovedDilatedAttention([64, 192], [1, 2], layout="residue_major")
    with pytest.raises(ValueError, match="divide the largest"):
        dilated.ImprovedDilatedAttention([128, 192, 256], [2, 3, 4], layout="residue_major")
    attn = dilated.ImprovedDilatedAttention([64, 128], [1, 2], layout="residue_major")
    x = rand(1, 192, 2, 8, gen=gen)
    with pytest.raises(ValueError, match="multiple of the largest segment \\(128\\); got 192: pad the sequence to 256"):
        attn(x, x, x)
    with pytest.raises(ValueError, match="multiple of the largest segment"):
        attn.to_layout(x)
    natural = dilated.ImprovedDilatedAttention([64, 128], [1, 2])
    assert natural.to_layout(x) is x and natural.from_layout(x) is x


def test_uncovered_rows_warn_on_the_fast_path(gen):
    q = rand(1, 256, 2, 8, gen=gen)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dilated.UncoveredRowsWarning)  # the constructor's own warning
        attn = dilated.ImprovedDilatedAttention([128, 256], [2, 4], backend="manual", layout="residue_major")
    with pytest.warns(dilated.UncoveredRowsWarning):
        attn(q, q, q)


FA4_HERE = torch.cuda.is_available() and dilated.available_backends("cuda").get("flash_attn_4") is None


@pytest.mark.skipif(not FA4_HERE, reason="needs flash-attn 4 on a CUDA device")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("segs,rates", [([512, 1024, 2048], [1, 2, 4]), ([1024, 2048], [2, 4])])
def test_gpu_flash_attn_4_block_sparse(d, dtype, kv_heads, segs, rates, gen):
    """flash-attn 4's block-sparse call (one call forward, one backward) against float64, rows no
    branch covers included."""
    q = torch.empty(1, 4096, 4, d, device="cuda", dtype=dtype)
    reason = residue_major_fast_path_reason(q, q[:, :, :kv_heads], segs, rates, backend="flash_attn_4")
    if reason:
        pytest.skip(reason)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dilated.UncoveredRowsWarning)
        with record_kernels() as ran:
            layout_case(segs, rates, 4096, 4, kv_heads, dtype, "auto", gen, d=d, device="cuda", batch=2)
    assert ran == {"flash_attn_4"}


@pytest.mark.parametrize("backend", ["manual", "sdpa"])
@pytest.mark.parametrize("compiler", ["eager", "aot_eager"])
def test_compiled_layout_is_one_custom_op(backend, compiler, gen):
    """Under ``torch.compile(fullgraph=True)`` the layout is one custom op (``manual``: the block
    lists inside it; ``sdpa``: the natural path between permutes inside it): the same output and
    gradients as eager."""
    segs, rates = [64, 128, 256], [1, 2, 4]
    attn = dilated.ImprovedDilatedAttention(segs, rates, backend=backend, layout="residue_major")
    q, k, v = (rand(1, 512, 4, 16, gen=gen, requires_grad=True) for _ in range(3))
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm.code)
        return torch._dynamo.backends.registry.lookup_backend(compiler)(gm, example_inputs)

    out = torch.compile(attn, fullgraph=True, backend=capture)(q, k, v)
    assert "residue_major_forward" in graphs[0]
    ref = attn(q, k, v)
    assert rel_err(out, ref) < TOL[torch.float32]
    dout = rand(*ref.shape, gen=gen)
    for g, rg in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref, (q, k, v), dout)):
        assert rel_err(g, rg) < TOL[torch.float32]


def test_multihead_layer_in_the_layout(gen):
    """A layer with ``layout="residue_major"`` on the permuted sequence is the natural layer, permuted."""
    segs, rates = [64, 128, 256], [1, 2, 4]
    natural = dilated.MultiheadDilatedAttention(64, 4, segs, rates, num_kv_heads=2, backend="manual", dtype=torch.float64)
    layer = dilated.MultiheadDilatedAttention(64, 4, segs, rates, num_kv_heads=2, backend="manual",
                                              dtype=torch.float64, layout="residue_major")
    layer.load_state_dict(natural.state_dict())
    x = rand(2, 512, 64, gen=gen, dtype=torch.float64)
    got = layer(layer.attention.to_layout(x))
    assert rel_err(layer.attention.from_layout(got), natural(x)) < TOL[torch.float64]
    with pytest.raises(ValueError, match="needs improved=True"):
        dilated.MultiheadDilatedAttention(64, 4, segs, rates, improved=False, layout="residue_major")


@pytest.mark.skipif(not FA4_HERE, reason="needs flash-attn 4 on a CUDA device")
def test_gpu_compiled_flash_attn_4_block_sparse(gen):
    """Compiled (inductor, fullgraph), the layout on flash-attn 4 is its block-sparse call inside the
    custom op: the output and gradients of the eager module."""
    segs, rates = [512, 1024, 2048], [1, 2, 4]
    attn = dilated.ImprovedDilatedAttention(segs, rates, backend="flash_attn_4", layout="residue_major")
    q, k, v = (rand(1, 4096, 4, 128, gen=gen, dtype=torch.bfloat16).cuda().requires_grad_() for _ in range(3))
    if residue_major_fast_path_reason(q, k, segs, rates, backend="flash_attn_4"):
        pytest.skip(residue_major_fast_path_reason(q, k, segs, rates, backend="flash_attn_4"))
    with record_kernels() as ran:
        out = torch.compile(attn, fullgraph=True)(q, k, v)
    ref = attn(q, k, v)
    assert ran == {"flash_attn_4"} and rel_err(out, ref) < 1e-6
    dout = rand(*ref.shape, gen=gen, dtype=torch.bfloat16).cuda()
    for g, rg in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref, (q, k, v), dout)):
        assert rel_err(g, rg) < 1e-2  # the backward's dq accumulates in float32 atomics: not bitwise
