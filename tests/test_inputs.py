"""Right answers on every valid input: strided tensors, large logits, float64, NaN/Inf, bad values.

Every result is held to an independent float64 computation (``dilated.reference``), forward and
gradients.
"""
import math
import warnings

import pytest
import torch
from conftest import rand, rel_err

import dilated
from dilated.merge import empty_accumulators, merge_
from dilated.reference import dense_reference, dilated_reference

CPU_BACKENDS = ["sdpa", "sdpa_flash", "sdpa_math", "manual"]
SCHEDULE = ([8, 16], [1, 2])


def _strided(x: torch.Tensor, how: str) -> torch.Tensor:
    """``x`` with the same values and a non-contiguous last dimension."""
    if how == "every_other":  # x[..., ::2] of a tensor twice as wide
        wide = torch.empty(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype)
        wide[..., ::2] = x.detach()
        wide[..., 1::2] = float("nan")  # misreading the gaps shows up at once
        return wide[..., ::2].requires_grad_(x.requires_grad)
    if how == "head_dim_transposed":  # a [B, N, D, H] tensor transposed to [B, N, H, D]
        return x.detach().transpose(2, 3).contiguous().transpose(2, 3).requires_grad_(x.requires_grad)
    if how == "bhnd":  # [B, H, N, D] storage, the usual projection layout (last dim contiguous)
        return x.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_(x.requires_grad)
    raise ValueError(how)


def _grads(fn, inputs, dout):
    inputs = [t.detach().clone().requires_grad_() if t.is_contiguous() else t.detach().requires_grad_()
              for t in inputs]
    out = fn(*inputs)
    out.backward(dout)
    return out.detach(), [t.grad for t in inputs]


STRIDED = [("every_other", "qkv"), ("head_dim_transposed", "qkv"), ("every_other", "q"),
           ("head_dim_transposed", "v"), ("bhnd", "qkv")]


@pytest.mark.parametrize("how,which", STRIDED)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_attention_reads_strided_inputs_right(backend, how, which, gen):
    q, k, v = (rand(2, 24, 4, 16, gen=gen) for _ in range(3))
    dout = rand(2, 24, 4, 16, gen=gen)
    inputs = [_strided(t, how) if name in which else t for name, t in zip("qkv", (q, k, v))]
    assert any(t.stride(-1) != 1 for t in inputs) or how == "bhnd"
    ref, ref_g = _grads(lambda a, b, c: dense_reference(a, b, c, causal=True)[0], (q.double(), k.double(), v.double()),
                        dout.double())
    out, g = _grads(lambda a, b, c: dilated.attention(a, b, c, causal=True, backend=backend), inputs, dout)
    assert rel_err(out, ref) < 2e-4
    for gi, ri in zip(g, ref_g):
        assert rel_err(gi, ri) < 2e-4


def _dilated_modules(backend):
    return {"dilated": dilated.DilatedAttention(*SCHEDULE, causal=True, backend=backend),
            "improved": dilated.ImprovedDilatedAttention(*SCHEDULE, causal=True, backend=backend)}


@pytest.mark.parametrize("how,which", STRIDED[:4])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("name", ["dilated", "improved"])
def test_dilated_reads_strided_inputs_right(name, backend, how, which, gen):
    q, k, v = (rand(1, 32, 4, 8, gen=gen) for _ in range(3))
    dout = rand(1, 32, 4, 8, gen=gen)
    inputs = [_strided(t, how) if n in which else t for n, t in zip("qkv", (q, k, v))]
    ref, ref_g = _grads(lambda a, b, c: dilated_reference(a, b, c, *SCHEDULE, causal=True),
                        (q.double(), k.double(), v.double()), dout.double())
    out, g = _grads(_dilated_modules(backend)[name], inputs, dout)
    assert rel_err(out, ref) < 2e-4
    for gi, ri in zip(g, ref_g):
        assert rel_err(gi, ri) < 2e-4


def test_multihead_takes_a_strided_input(gen):
    torch.manual_seed(0)
    mha = dilated.MultiheadDilatedAttention(32, 4, *SCHEDULE, causal=True, backend="manual", dtype=torch.float64)
    x = rand(1, 32, 32, gen=gen, dtype=torch.float64)
    wide = torch.randn(1, 32, 64, dtype=torch.float64)
    wide[..., ::2] = x
    ref = mha(x.requires_grad_())
    ref.sum().backward()
    strided = wide[..., ::2].requires_grad_()
    out = mha(strided)
    out.sum().backward()
    assert rel_err(out, ref) < 1e-12 and rel_err(strided.grad, x.grad) < 1e-12


# -- large logits -----------------------------------------------------------------------------

@pytest.mark.parametrize("scale", [1e2, 1e4])
@pytest.mark.parametrize("name", ["dilated", "improved"])
def test_branch_mixing_is_exact_at_large_logits(name, scale, gen):
    """With q, k scaled by 1e4 every row's softmax is one key; where two branches pick the same key
    the mix must still weigh them to one (exp(lse - L) with L rounded in float32 summed to 2)."""
    q, k, v = (rand(1, 64, 2, 8, gen=gen, scale=s) for s in (scale, scale, 1.0))
    ref = dilated_reference(q, k, v, [16, 32], [1, 2])
    for backend in ("sdpa_flash", "manual"):
        mod = {"dilated": dilated.DilatedAttention, "improved": dilated.ImprovedDilatedAttention}[name]
        out = mod([16, 32], [1, 2], backend=backend)(q, k, v)
        assert rel_err(out, ref) < 1e-5, backend


def test_merge_weights_sum_to_one_at_any_scale():
    """Two partials with equal lse of magnitude 1e8: the merge is their mean, the lse grows by log 2."""
    acc, acc_lse = empty_accumulators(1, 1, 1, 3, "cpu")
    o1, o2 = torch.tensor([[[[1.0, 2.0, 3.0]]]]), torch.tensor([[[[3.0, 2.0, 1.0]]]])
    big = torch.full((1, 1, 1), 3.0e8)
    merge_(acc, acc_lse, o1, big)
    merge_(acc, acc_lse, o2, big)
    assert torch.allclose(acc, torch.full((1, 1, 1, 3), 2.0))
    # small scale: the lse is logaddexp exactly
    acc, acc_lse = empty_accumulators(1, 1, 1, 3, "cpu", torch.float64)
    merge_(acc, acc_lse, o1.double(), torch.full((1, 1, 1), 0.5, dtype=torch.float64))
    merge_(acc, acc_lse, o2.double(), torch.full((1, 1, 1), -1.0, dtype=torch.float64))
    w1 = math.exp(0.5) / (math.exp(0.5) + math.exp(-1.0))
    assert torch.allclose(acc, w1 * o1.double() + (1 - w1) * o2.double(), atol=1e-15)
    assert acc_lse.item() == pytest.approx(math.log(math.exp(0.5) + math.exp(-1.0)), abs=1e-15)


def test_stacked_parts_merge_to_softmax_over_all_their_keys(gen):
    """merge_stacked: parts of attention over disjoint key sets (one part empty: lse -inf; one row no
    part covers) against float64 softmax over the union, at large logits too."""
    from dilated.merge import merge_stacked

    q = torch.randn(2, 3, 4, generator=gen, dtype=torch.float64) * 30
    keys = [torch.randn(m, 4, generator=gen, dtype=torch.float64) for m in (5, 0, 7, 1)]
    vals = [torch.randn(m, 6, generator=gen, dtype=torch.float64) for m in (5, 0, 7, 1)]
    outs, lses = [], []
    for k, v in zip(keys, vals):
        s = torch.einsum("bqd,kd->bqk", q, k)
        lse = torch.logsumexp(s, -1) if k.shape[0] else torch.full(q.shape[:2], float("-inf"), dtype=q.dtype)
        outs.append(torch.einsum("bqk,kd->bqd", torch.exp(s - lse.unsqueeze(-1)), v) if k.shape[0]
                    else torch.zeros(*q.shape[:2], 6, dtype=q.dtype))
        lses.append(lse)
    outs, lses = torch.stack(outs), torch.stack(lses)
    lses[:, 1, 2] = float("-inf")  # a row no part covers
    outs[:, 1, 2] = 0
    out, lse = merge_stacked(outs, lses)
    s = torch.einsum("bqd,kd->bqk", q, torch.cat(keys))
    ref = torch.einsum("bqk,kd->bqd", torch.softmax(s, -1), torch.cat(vals))
    ref[1, 2] = 0
    ref_lse = torch.logsumexp(s, -1)
    ref_lse[1, 2] = float("-inf")
    assert torch.allclose(out, ref, atol=1e-12) and torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    assert torch.allclose(lse[torch.isfinite(lse)], ref_lse[torch.isfinite(ref_lse)], atol=1e-12)


ROW_PIECES = {  # row ranges of the pieces, in order (each piece sees its own fifth of the keys)
    "whole rows first": [(0, 24), (5, 15), (10, 24)],
    "overlapping parts, a gap left": [(0, 8), (4, 16), (12, 20)],
    "a part, then the whole rows": [(10, 14), (0, 24), (2, 12)],
    "only the whole rows": [(0, 24)],
    "the whole rows twice": [(0, 24), (0, 24)],
    "adjacent parts": [(0, 8), (8, 16), (16, 24), (3, 21)],
    "later rows first, then across them": [(16, 20), (2, 6), (0, 24)],
    "later rows first, gaps left": [(16, 20), (2, 6)],
}


@pytest.mark.parametrize("case", ROW_PIECES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_row_accumulator_is_attention_over_the_union_of_its_pieces_keys(case, dtype, gen):
    """Pieces of attention over row ranges, each over its own keys, merged as they come (copied where
    no row holds a result, merged where some do, a whole-rows piece kept as it came): every row is
    attention over the keys of all pieces that cover it; rows none covers are 0 with lse -inf.
    Summed pieces are the plain sum per row."""
    from dilated.merge import RowAccumulator

    n, nk, h, d = 24, 30, 2, 8
    q = rand(1, n, h, d, gen=gen, dtype=dtype)
    k, v = (rand(1, nk, h, d, gen=gen, dtype=dtype) for _ in range(2))
    keys = torch.arange(nk) % 5  # piece i sees the keys with keys == i: no key twice in a row
    merged = RowAccumulator.merging((1, n, h, d), "cpu", torch.float64 if dtype == torch.float64 else torch.float32)
    summed = RowAccumulator.summing([(1, n, h, d)], "cpu", merged.dtype)
    sees = torch.zeros(n, nk, dtype=torch.bool)
    total = torch.zeros(1, n, h, d, dtype=torch.float64)
    pieces = []
    for i, (a, b) in enumerate(ROW_PIECES[case]):
        mine = (keys == i).expand(b - a, nk)
        o, lse = dense_reference(q[:, a:b], k, v, bias=torch.where(mine, 0.0, float("-inf"))[None], dtype=dtype)
        pieces.append((o, lse))
        merged.add(slice(a, b), (o, lse.transpose(1, 2)))
        summed.add(slice(a, b), (o,))
        sees[a:b] |= mine
        total[:, a:b] += o.double()
    out, lse = merged.result()
    (added,) = summed.result()
    if len(pieces) == 1:  # kept as it came: no accumulator, no copy
        assert out is pieces[0][0] and added is pieces[0][0]
    covered = sees.any(1)
    ref, ref_lse = dense_reference(q[:, covered], k, v, bias=torch.where(sees[covered], 0.0, float("-inf"))[None])
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert rel_err(out[:, covered], ref) < tol and rel_err(lse.transpose(1, 2)[:, :, covered], ref_lse) < tol
    assert (out[:, ~covered] == 0).all() and (lse[:, ~covered] == float("-inf")).all()
    assert rel_err(added, total) < tol


def test_causal_pieces_merge_exactly_at_large_logits(gen):
    """seq_q < seq_k causal is two kernel calls merged by lse."""
    q = rand(1, 16, 2, 8, gen=gen, scale=1e3)
    k = rand(1, 40, 2, 8, gen=gen, scale=1e3)
    v = rand(1, 40, 2, 8, gen=gen)
    ref = dense_reference(q, k, v, causal=True)[0]
    for backend in ("sdpa_flash", "manual"):
        assert rel_err(dilated.attention(q, k, v, causal=True, backend=backend), ref) < 1e-5


@pytest.mark.parametrize("nq, nk, longest", [(10, 10, 3), (10, 10, 5), (7, 19, 2), (19, 7, 4), (12, 12, None),
                                             (9, 9, 9), (9, 9, 8), (6, 14, 100)])
def test_causal_pieces_cover_the_causal_mask_once(nq, nk, longest):
    """The calls' areas tile exactly the bottom-right causal mask, and no causal call is longer
    than ``longest`` nor other than square."""
    from dilated.dense import causal_pieces

    covered = torch.zeros(nq, nk, dtype=torch.int64)
    for q0, q1, k0, k1, c in causal_pieces(nq, nk, True, longest):
        block = torch.ones(q1 - q0, k1 - k0, dtype=torch.int64)
        if c:
            assert q1 - q0 == k1 - k0 and (longest is None or q1 - q0 <= longest)
            block = block.tril()
        covered[q0:q1, k0:k1] += block
    i, j = torch.arange(nq)[:, None], torch.arange(nk)[None, :]
    assert torch.equal(covered, (j <= i + nk - nq).to(torch.int64))


@pytest.mark.parametrize("nq, nk", [(17, 17), (11, 17), (17, 11)])
def test_long_causal_blocks_are_chunked_in_the_forward_only(nq, nk, gen):
    """A backend that caps its causal calls: the forward's calls respect the cap and the result,
    forward and gradients, is float64-exact (rows that see no key: 0 and lse -inf); the backward
    stays one call per piece of the unchunked split."""
    from dilated.backends import _REGISTRY, register_backend
    from dilated.backends.manual import ManualBackend

    class Capped(ManualBackend):
        name = "capped_for_test"
        calls: list

        def longest_causal_block(self, q, k):
            return 5

        def forward(self, q, k, v, causal, scale):
            self.calls.append(("fwd", q.shape[1], k.shape[1], causal))
            return super().forward(q, k, v, causal, scale)

        def backward(self, dout, q, k, v, out, lse, causal, scale):
            self.calls.append(("bwd", q.shape[1], k.shape[1], causal))
            return super().backward(dout, q, k, v, out, lse, causal, scale)

    capped = register_backend(Capped())
    capped.calls = []
    try:
        q = rand(2, nq, 2, 8, gen=gen, dtype=torch.float64, requires_grad=True)
        k, v = (rand(2, nk, 2, 8, gen=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
        dilated.backends.get_backend("capped_for_test", q, k, True)  # its availability probe calls it
        capped.calls.clear()
        dout = rand(2, nq, 2, 8, gen=gen, dtype=torch.float64)
        out, lse = dilated.attention(q, k, v, causal=True, backend="capped_for_test", return_lse=True)
        (out * dout).sum().backward()
        r_out, r_lse = dense_reference(q.detach(), k.detach(), v.detach(), causal=True)
        ref_g = torch.autograd.grad(dense_reference(q, k, v, causal=True)[0], (q, k, v), dout)
        blind = nq - min(nq, nk)  # rows that see no key
        assert rel_err(out, r_out) < 1e-12 and rel_err(lse[..., blind:], r_lse[..., blind:]) < 1e-12
        assert bool((out[:, :blind] == 0).all()) and bool((lse[..., :blind] == float("-inf")).all())
        for g, r in zip((q.grad, k.grad, v.grad), ref_g):
            assert rel_err(g, r) < 1e-11
        fwd = [c for c in capped.calls if c[0] == "fwd"]
        assert all(n_q <= 5 and n_q == n_k for _, n_q, n_k, causal in fwd if causal)
        if nq == nk:
            assert sum(causal for *_, causal in fwd) == 4 and len(fwd) == 7  # 17 rows: chunks of 5, 5, 5, 2
        bwd = [c for c in capped.calls if c[0] == "bwd"]
        assert max(n_q for _, n_q, _, causal in bwd if causal) == min(nq, nk)  # not chunked
    finally:
        del _REGISTRY["capped_for_test"]


# -- float64 ----------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", CPU_BACKENDS + ["auto"])
def test_float64_end_to_end(backend, gen):
    q, k, v = (rand(1, 24, 4, 8, gen=gen, dtype=torch.float64) for _ in range(3))
    dout = rand(1, 24, 4, 8, gen=gen, dtype=torch.float64)
    ref, ref_g = _grads(lambda a, b, c: dilated_reference(a, b, c, *SCHEDULE, causal=True), (q, k, v), dout)
    for mod in _dilated_modules(backend).values():
        out, g = _grads(mod, (q, k, v), dout)
        assert out.dtype == torch.float64
        assert rel_err(out, ref) < 1e-12
        for gi, ri in zip(g, ref_g):
            assert gi.dtype == torch.float64 and rel_err(gi, ri) < 1e-11
    out, lse = dilated.attention(q, k, v, backend=backend, return_lse=True)
    r_out, r_lse = dense_reference(q, k, v)
    assert lse.dtype == torch.float64 and rel_err(out, r_out) < 1e-12 and rel_err(lse, r_lse) < 1e-12


# -- NaN and Inf ------------------------------------------------------------------------------

def _bad_rows(x):
    return ~torch.isfinite(x).all(-1)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_non_finite_input_reaches_exactly_the_rows_that_read_it(backend, where, value, gen):
    for causal in (False, True):
        t = [rand(1, 40, 2, 8, gen=gen) for _ in range(3)]
        t["qkv".index(where)][0, 20, 1, 3] = value
        ref = dense_reference(*t, causal=causal)[0]
        out = dilated.attention(*t, causal=causal, backend=backend)
        assert _bad_rows(ref).any()
        assert torch.equal(_bad_rows(out), _bad_rows(ref)), (causal, _bad_rows(out).sum(), _bad_rows(ref).sum())
        fine = ~_bad_rows(out)
        assert rel_err(out[fine], ref[fine]) < 2e-4


@pytest.mark.parametrize("backend", ["sdpa_flash", "manual"])
@pytest.mark.parametrize("name", ["dilated", "improved"])
def test_nan_in_dilated_inputs_reaches_exactly_its_segment_rows(name, backend, gen):
    q, k, v = (rand(1, 32, 4, 8, gen=gen) for _ in range(3))
    k[0, 5, 2, 0] = float("nan")  # segment 0 of w = 8 and 16; head 2 (offset 0 of r = 2), position 5
    ref = dilated_reference(q, k, v, *SCHEDULE, causal=True)
    out = _dilated_modules(backend)[name](q, k, v)
    assert torch.equal(_bad_rows(out), _bad_rows(ref))
    assert _bad_rows(ref).sum() > 0 and not _bad_rows(ref)[0, 16:].any()
    fine = ~_bad_rows(ref)
    assert rel_err(out[fine], ref[fine]) < 2e-4


def test_manual_backward_keeps_nan(gen):
    q, k, v = (rand(1, 16, 2, 8, gen=gen, requires_grad=True) for _ in range(3))
    with torch.no_grad():
        v[0, 3, 0, 0] = float("nan")
    dilated.attention(q, k, v, backend="manual").sum().backward()
    assert torch.isnan(q.grad[0, :, 0]).all() and torch.isfinite(q.grad[0, :, 1]).all()


# -- bad values -------------------------------------------------------------------------------

def test_invalid_values_raise_naming_the_argument(gen):
    q = rand(1, 16, 2, 8, gen=gen)
    with pytest.raises(ValueError, match="head_dim"):
        z = torch.randn(1, 16, 2, 0)
        dilated.attention(z, z, z)
    for bad in (float("inf"), float("nan"), -1.0, 0.0):
        with pytest.raises(ValueError, match="scale"):
            dilated.attention(q, q, q, scale=bad)
        with pytest.raises(ValueError, match="scale"):
            dilated.ImprovedDilatedAttention(*SCHEDULE, scale=bad)
    with pytest.raises(TypeError, match="scale"):
        dilated.attention(q, q, q, scale=True)
    with pytest.raises(TypeError, match="causal"):
        dilated.attention(q, q, q, causal="false")
    with pytest.raises(TypeError, match="causal"):
        dilated.DilatedAttention(*SCHEDULE, causal="false")
    with pytest.raises(ValueError, match="dilation rate 16 is larger than its segment length 8"):
        dilated.DilatedAttention([8, 16], [16, 1])


def test_a_schedule_without_rate_one_warns_that_rows_are_uncovered(gen):
    with pytest.warns(dilated.UncoveredRowsWarning, match="no rate 1"):
        dilated.DilatedAttention([8, 16], [2, 4])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dilated.DilatedAttention([8, 16], [1, 4])
    q = rand(1, 16, 2, 8, gen=gen)
    with pytest.warns(dilated.UncoveredRowsWarning):
        out = dilated.dilated_attention(q, q, q, [8], [2])
    assert (out[0, 1, 0] == 0).all()  # the row the warning names


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_non_finite_value_within_a_causal_tile_reaches_only_later_rows(backend, gen):
    """A NaN in v at position 5 of 8 (one tile of a fused kernel): rows 5.. read it and are NaN;
    rows 0..4 are exact (a fused kernel multiplying the tile's zero probabilities by V would make
    them NaN too)."""
    q, k, v = (rand(1, 8, 1, 8, gen=gen) for _ in range(3))
    v[0, 5, 0, 0] = float("nan")
    out = dilated.attention(q, k, v, causal=True, backend=backend)
    assert _bad_rows(out)[0, 5:].all() and not _bad_rows(out)[0, :5].any()
    ref = dense_reference(q, k, v, causal=True)[0]
    assert rel_err(out[0, :5], ref[0, :5]) < 2e-4


# -- the same contracts on CUDA kernels (cuDNN/flash reading strided rows, the Triton combine) ---

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
GPU_SCHEDULE = ([256, 512, 1024], [1, 2, 4])


@needs_cuda
@pytest.mark.parametrize("how,which", STRIDED[:4])
def test_gpu_improved_reads_strided_inputs_right(how, which, gen):
    q, k, v = (rand(1, 1024, 8, 64, gen=gen) for _ in range(3))
    dout = rand(1, 1024, 8, 64, gen=gen)
    ref, ref_g = _grads(lambda a, b, c: dilated_reference(a, b, c, *GPU_SCHEDULE, causal=True),
                        (q.double(), k.double(), v.double()), dout.double())
    inputs = [(_strided(t, how) if n in which else t).cuda().to(torch.bfloat16) for n, t in zip("qkv", (q, k, v))]
    inputs = [t.detach().requires_grad_() for t in inputs]
    out = dilated.ImprovedDilatedAttention(*GPU_SCHEDULE, causal=True)(*inputs)
    out.backward(dout.cuda().to(torch.bfloat16))
    assert rel_err(out.cpu(), ref) < 3e-2
    for t, r in zip(inputs, ref_g):
        assert rel_err(t.grad.cpu(), r) < 6e-2


@needs_cuda
def test_gpu_nan_and_large_logits_through_the_triton_combine(gen):
    q, k, v = (rand(1, 1024, 8, 64, gen=gen) for _ in range(3))
    k[0, 300, 2, 0] = float("nan")
    ref = dilated_reference(q, k, v, *GPU_SCHEDULE)
    out = dilated.ImprovedDilatedAttention(*GPU_SCHEDULE)(*(t.cuda().to(torch.bfloat16) for t in (q, k, v))).cpu()
    assert torch.equal(_bad_rows(out), _bad_rows(ref)) and _bad_rows(ref).any()
    fine = ~_bad_rows(ref)
    assert rel_err(out[fine], ref[fine]) < 3e-2
    q, k, v = (rand(1, 1024, 8, 64, gen=gen, scale=s) for s in (1e2, 1e2, 1.0))
    ref = dilated_reference(q, k, v, *GPU_SCHEDULE)
    mod = dilated.ImprovedDilatedAttention(*GPU_SCHEDULE, backend="sdpa_efficient")  # float32 kernel
    assert rel_err(mod(q.cuda(), k.cuda(), v.cuda()).cpu(), ref) < 1e-3


@needs_cuda
def test_gpu_float64(gen):
    q, k, v = (rand(1, 512, 4, 32, gen=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    ref = dilated_reference(q, k, v, *GPU_SCHEDULE, causal=True)
    qc, kc, vc = (t.detach().cuda().requires_grad_() for t in (q, k, v))
    out = dilated.ImprovedDilatedAttention(*GPU_SCHEDULE, causal=True, backend="manual")(qc, kc, vc)
    assert out.dtype == torch.float64 and rel_err(out.cpu(), ref) < 1e-12
    dout = torch.randn_like(ref)
    out.backward(dout.cuda())
    for t, r in zip((qc, kc, vc), torch.autograd.grad(ref, (q, k, v), dout)):
        assert rel_err(t.grad.cpu(), r) < 1e-11


@pytest.mark.parametrize("backend", ["manual", "sdpa_math", "sdpa", "auto"])
def test_value_head_dim_other_than_qk(backend, gen):
    """v with its own head_dim (e.g. 16 against 32), forward and gradients, causal bottom-right."""
    q, k = rand(1, 12, 4, 32, gen=gen), rand(1, 20, 2, 32, gen=gen)
    v, dout = rand(1, 20, 2, 16, gen=gen), rand(1, 12, 4, 16, gen=gen)
    ref, ref_g = _grads(lambda a, b, c: dense_reference(a, b, c, causal=True)[0], (q.double(), k.double(), v.double()),
                        dout.double())
    out, g = _grads(lambda a, b, c: dilated.attention(a, b, c, causal=True, backend=backend), (q, k, v), dout)
    assert out.shape == (1, 12, 4, 16) and rel_err(out, ref) < 2e-4
    for gi, ri in zip(g, ref_g):
        assert rel_err(gi, ri) < 2e-4


def test_value_head_dim_where_a_kernel_cannot(gen):
    q = rand(1, 8, 2, 32, gen=gen)
    v = rand(1, 8, 2, 16, gen=gen)
    with pytest.raises(dilated.BackendUnavailableError, match="head_dim"):
        dilated.attention(q, q, v, backend="sdpa_flash")
    with pytest.raises(ValueError, match="v's head_dim"):
        dilated.DilatedAttention(*SCHEDULE)(q, q, v)


@pytest.mark.parametrize("local_ranks,gpus,backend,fails", [
    (2, 1, None, True), (8, 4, "nccl", True), (2, 2, None, False), (1, 8, None, False), (2, 1, "gloo", False)])
def test_more_torchrun_ranks_than_gpus_is_refused_before_nccl_starts(monkeypatch, local_ranks, gpus, backend, fails):
    """Two NCCL ranks on one GPU fail deep inside NCCL; every rank gets an error naming the fix first."""
    import dilated.parallel.sharding as dd

    started = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dd.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dd.dist, "init_process_group", lambda *a, **k: started.append(a))
    monkeypatch.setattr(dd.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dd.dist, "get_world_size", lambda: local_ranks)
    for var, value in {"RANK": "0", "WORLD_SIZE": str(local_ranks), "LOCAL_RANK": "0",
                       "LOCAL_WORLD_SIZE": str(local_ranks), "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(var, value)
    if fails:
        with pytest.raises(RuntimeError, match=rf"{local_ranks} ranks on this node but {gpus} GPU.*"
                                               rf"--nproc_per_node={gpus}.*gloo"):
            dd.init_distributed(backend=backend)
        assert not started
    else:
        dd.init_distributed(backend=backend)
        assert len(started) == 1


@pytest.mark.parametrize("backend, asked, given, expected", [
    (None, True, None, "1"), ("nccl", True, "0", "0"), ("nccl", False, None, None), ("gloo", True, None, None)])
def test_nccl_groups_issue_on_high_priority_streams_unless_told_otherwise(monkeypatch, backend, asked, given,
                                                                         expected):
    """NCCL's streams at high priority where NCCL starts (a variable the user set is kept); not for gloo."""
    import dilated.parallel.sharding as dd

    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dd.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dd.dist, "init_process_group",
                        lambda *a, **k: seen.append(__import__("os").environ.get(dd.NCCL_HIGH_PRIORITY)))
    monkeypatch.setattr(dd.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dd.dist, "get_world_size", lambda: 1)
    for var, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(var, value)
    if given is None:
        monkeypatch.delenv(dd.NCCL_HIGH_PRIORITY, raising=False)
    else:
        monkeypatch.setenv(dd.NCCL_HIGH_PRIORITY, given)
    dd.init_distributed(backend=backend, nccl_high_priority=asked)
    assert seen == [expected]
