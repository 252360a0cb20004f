"""Packed documents (``cu_seqlens``): attention within each document only, against a float64
reference that runs every document on its own."""
import pytest
import torch

import dilated
import dilated.packed
from dilated.packed import bucket_length, document_calls
from dilated.reference import dense_reference

from conftest import rand, rel_err


def _per_document(q, k, v, cu, causal):
    outs, lses = [], []
    for a, b in zip(cu, cu[1:]):
        o, l = dense_reference(q[:, a:b], k[:, a:b], v[:, a:b], causal=causal)
        outs.append(o)
        lses.append(l)
    return torch.cat(outs, 1), torch.cat(lses, 2)


def _assert_matches(out, lse, ref, ref_lse, inputs, ref_inputs, gen, tol=2e-4, lse_tol=2e-4, grad_tol=4e-4):
    """out and lse, and the gradients through both on random dout and dlse (out's dtype and device),
    against float64; returns dout (the reference's graph kept for more gradients)."""
    assert rel_err(out, ref) < tol and rel_err(lse, ref_lse) < lse_tol
    dout = rand(*out.shape, gen=gen, dtype=out.dtype).to(out.device)
    dlse = rand(*lse.shape, gen=gen).to(lse.device)
    grads = torch.autograd.grad((out, lse), inputs, (dout, dlse))
    ref_grads = torch.autograd.grad((ref, ref_lse), ref_inputs, (dout.double(), dlse.double()), retain_graph=True)
    for name, g, rg in zip("qkv", grads, ref_grads):
        assert rel_err(g, rg) < grad_tol, f"d{name}"
    return dout


def _assert_matches_in_bf16(out, lse, ref, ref_lse, inputs, ref_inputs, gen):
    """:func:`_assert_matches` with bfloat16's tolerances."""
    from conftest import TOL

    tol = TOL[torch.bfloat16]
    return _assert_matches(out, lse, ref, ref_lse, inputs, ref_inputs, gen, tol, 1e-3, 2 * tol)


DOCS = {"one": [0, 40], "fixed": [0, 8, 16, 24, 32, 40], "varied": [0, 1, 6, 19, 20, 33, 40],
        "lognormal-like": [0, 3, 4, 11, 29, 31, 40]}


@pytest.mark.parametrize("docs", DOCS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", ["manual", "sdpa_math", "sdpa"])
def test_packed_documents_match_each_document_alone(docs, causal, backend, gen):
    cu = DOCS[docs]
    q = rand(2, 40, 4, 8, gen=gen, requires_grad=True)
    k, v = rand(2, 40, 2, 8, gen=gen, requires_grad=True), rand(2, 40, 2, 8, gen=gen, requires_grad=True)
    out, lse = dilated.attention(q, k, v, causal=causal, backend=backend, return_lse=True,
                                 cu_seqlens=torch.tensor(cu, dtype=torch.int32))
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = _per_document(qd, kd, vd, cu, causal)
    _assert_matches(out, lse, ref, ref_lse, (q, k, v), (qd, kd, vd), gen)


def test_documents_share_kernel_calls():
    cu = [0] + torch.tensor([8] * 50 + [9, 10, 11, 12, 13, 14, 15, 16] * 3).cumsum(0).tolist()
    calls = document_calls(cu, causal=False)  # per distinct length, in power-of-two batches
    assert [(length, len(docs)) for length, docs in calls] == [
        (16, 2), (16, 1), (15, 2), (15, 1), (14, 2), (14, 1), (13, 2), (13, 1), (12, 2), (12, 1), (11, 2), (11, 1),
        (10, 2), (10, 1), (9, 2), (9, 1), (8, 32), (8, 16), (8, 2)]
    causal_calls = document_calls(cu, causal=True)  # short documents: padded to four buckets per octave
    assert [(length, len(docs)) for length, docs in causal_calls] == [
        (16, 4), (16, 2), (14, 4), (14, 2), (12, 4), (12, 2), (10, 4), (10, 2), (8, 32), (8, 16), (8, 2)]
    assert all(length <= 1.25 * min(l for _, l in docs) + 1 for length, docs in causal_calls)
    for c in (calls, causal_calls):  # every document in exactly one call, each by its own length
        assert sorted(d for _, docs in c for d in docs) == list(zip(cu, (b - a for a, b in zip(cu, cu[1:]))))
    assert [bucket_length(n) for n in (1000, 1025, 1300, 1600, 1800)] == [1024, 1280, 1536, 1792, 2048]


def test_long_documents_take_finer_buckets():
    # four bucket lengths per octave up to 4096 positions, eight above (the default)
    assert [bucket_length(n) for n in (4096, 4097, 4500, 4609, 5000, 8193, 9000, 62329)] == [
        4096, 4608, 4608, 5120, 5120, 9216, 9216, 65536]
    assert [bucket_length(n, 4) for n in (4097, 5000, 62329)] == [5120, 5120, 65536]
    cu = [0, 4100, 4700, 9200, 9300]  # 4100 and 4500 share the 4608 call; 600 and 100 have calls of their own
    assert [(length, [d for _, d in docs]) for length, docs in document_calls(cu, causal=True)] == [
        (4608, [4100, 4500]), (640, [600]), (112, [100])]


@pytest.mark.parametrize("value, per_octave", [(None, 8), ("4", 4), ("1", 1), ("16", 16)])
def test_buckets_per_octave_from_the_environment(monkeypatch, value, per_octave):
    if value is None:
        monkeypatch.delenv("DILATED_BUCKETS_PER_OCTAVE", raising=False)
    else:
        monkeypatch.setenv("DILATED_BUCKETS_PER_OCTAVE", value)
    assert dilated.packed.buckets_per_octave_from_env() == per_octave


@pytest.mark.parametrize("value", ["32", "3", "0", "eight"])
def test_buckets_per_octave_refuses_other_values(monkeypatch, value):
    monkeypatch.setenv("DILATED_BUCKETS_PER_OCTAVE", value)
    with pytest.raises(ValueError, match="DILATED_BUCKETS_PER_OCTAVE.*1, 2, 4, 8 or 16"):
        dilated.packed.buckets_per_octave_from_env()


def test_long_documents_padded_to_a_fine_bucket_match_each_document_alone(gen):
    """Causal documents past 4096 positions padded to a bucket of eight per octave, one call for two of them."""
    cu = [0, 4100, 4700, 9200]
    q = rand(1, 9200, 1, 8, gen=gen, requires_grad=True)
    k, v = rand(1, 9200, 1, 8, gen=gen, requires_grad=True), rand(1, 9200, 1, 8, gen=gen, requires_grad=True)
    out, lse = dilated.attention(q, k, v, causal=True, backend="sdpa_math", return_lse=True,
                                 cu_seqlens=torch.tensor(cu, dtype=torch.int32))
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = _per_document(qd, kd, vd, cu, causal=True)
    _assert_matches(out, lse, ref, ref_lse, (q, k, v), (qd, kd, vd), gen)


@pytest.mark.parametrize("bad, exc, says", [
    (torch.tensor([0, 10, 40], dtype=torch.int64), TypeError, "must be int32"),
    (torch.tensor([0, 10, 30], dtype=torch.int32), ValueError, "sum to N"),
    (torch.tensor([1, 10, 40], dtype=torch.int32), ValueError, "start at 0"),
    (torch.tensor([0, 20, 10, 40], dtype=torch.int32), ValueError, "strictly increasing"),
    (torch.tensor([0, 10, 10, 40], dtype=torch.int32), ValueError, "strictly increasing"),
    (torch.tensor([[0, 40]], dtype=torch.int32), ValueError, "1-d"),
    ([0, 40], TypeError, "must be a torch.Tensor"),
])
def test_bad_cu_seqlens_is_a_clear_error(bad, exc, says, gen):
    q = rand(1, 40, 2, 8, gen=gen)
    with pytest.raises(exc, match=says):
        dilated.attention(q, q, q, cu_seqlens=bad)


@pytest.mark.parametrize("kernel, release", [("torch", "new"), ("torch", "old"), ("fa4", "new")])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hkv", [4, 2])
def test_packed_documents_through_a_kernels_varlen_entry_point(kernel, release, causal, hkv, monkeypatch, gen):
    """``backend="auto"`` (torch's varlen ops, the 2.13 schema and the first one) and
    ``"flash_attn_4"`` (its ``_flash_attn_fwd`` / ``_flash_attn_bwd``) send packed documents to
    the kernel's varlen entry point, one call forward and one backward (two for torch's op when
    lse has a gradient), with lse ``[H, T]`` back to ``[B, H, N]``: against float64, forward and
    the gradients through out and lse."""
    import varlen_standins

    varlen_standins.install(monkeypatch, kernel, release)
    varlen_standins.CALLS.clear()
    cu = DOCS["varied"]
    q = rand(2, 40, 4, 8, gen=gen, requires_grad=True)
    k, v = rand(2, 40, hkv, 8, gen=gen, requires_grad=True), rand(2, 40, hkv, 8, gen=gen, requires_grad=True)
    scale = None if release == "old" else 0.3
    out, lse = dilated.attention(q, k, v, causal=causal, scale=scale, return_lse=True,
                                 backend="auto" if kernel == "torch" else "flash_attn_4",
                                 cu_seqlens=torch.tensor(cu, dtype=torch.int32))
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    outs, lses = zip(*(dense_reference(qd[:, a:b], kd[:, a:b], vd[:, a:b], causal=causal, scale=scale)
                       for a, b in zip(cu, cu[1:])))
    ref, ref_lse = torch.cat(outs, 1), torch.cat(lses, 2)
    assert lse.shape == (2, 4, 40)
    _assert_matches(out, lse, ref, ref_lse, (q, k, v), (qd, kd, vd), gen)
    expected = {"torch": {"torch_forward": 1, "torch_backward": 2}, "fa4": {"fa4_forward": 1, "fa4_backward": 1}}
    assert dict(varlen_standins.CALLS) == expected[kernel]


def test_when_the_varlen_kernel_is_not_used(gen):
    from dilated.backends.varlen import varlen_reason

    q = rand(1, 16, 2, 64, gen=gen)
    assert "'manual' has no varlen entry point" in varlen_reason(q, q, q, "manual")
    assert "'sdpa_cudnn' has no varlen entry point" in varlen_reason(q, q, q, "sdpa_cudnn")
    assert "CUDA" in varlen_reason(q, q, q, "sdpa_flash")  # a CPU tensor
    assert "CUDA" in varlen_reason(q, q, q, "flash_attn_4")


def _gpu_varlen_cases():
    if not torch.cuda.is_available():
        return []
    from dilated.backends.varlen import varlen_reason

    q = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16, device="cuda")
    return [b for b in ("sdpa_flash", "flash_attn_4") if varlen_reason(q, q, q, b) is None]


GPU_DOCS = [0, 100, 101, 357, 640, 1000]  # 1000 positions: 5 documents, one of 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", _gpu_varlen_cases())
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hkv", [8, 2])
def test_gpu_varlen_kernels_in_bf16(backend, causal, hkv, gen):
    """The real varlen kernels in bf16 against float64, forward and gradients through out and lse;
    then ring attention on one rank (zigzag: its chunks with themselves go to the varlen kernel,
    the pair across them to the dense one) against the same reference."""
    import torch.distributed as dist

    from conftest import TOL

    tol = TOL[torch.bfloat16]
    q = rand(2, 1000, 8, 64, gen=gen, dtype=torch.bfloat16).cuda().requires_grad_()
    k, v = (rand(2, 1000, hkv, 64, gen=gen, dtype=torch.bfloat16).cuda().requires_grad_() for _ in range(2))
    cu = torch.tensor(GPU_DOCS, dtype=torch.int32)
    out, lse = dilated.attention(q, k, v, causal=causal, backend=backend, return_lse=True, cu_seqlens=cu)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = _per_document(qd, kd, vd, GPU_DOCS, causal)
    dout = _assert_matches_in_bf16(out, lse, ref, ref_lse, (q, k, v), (qd, kd, vd), gen)
    ref_out_grads = torch.autograd.grad(ref, (qd, kd, vd), dout.double())
    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=0, world_size=1, store=dist.HashStore())
    try:
        for layout in ("contiguous", "zigzag"):
            ring = dilated.RingAttention(causal=causal, backend=backend, layout=layout)
            out = ring(q, k, v, cu_seqlens=cu)
            assert rel_err(out, ref) < tol, layout
            grads = torch.autograd.grad(out, (q, k, v), dout)
            for name, g, rg in zip("qkv", grads, ref_out_grads):
                assert rel_err(g, rg) < 2 * tol, f"ring {layout} d{name}"
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_host_values_reach_the_device_without_waiting():
    """The index tensors of packed documents are copied without a stream synchronization: with a
    long kernel queued, the call returns while the GPU is still busy, and the values arrive."""
    from dilated._transfer import host_values_on

    values = [[3, 5], [8, 13], [21, 34]]
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time queued before the copy
    got, source = host_values_on(values, torch.int64, "cuda")
    assert not torch.cuda.current_stream().query()  # the host did not wait for the sleep
    torch.cuda.synchronize()
    assert got.device.type == "cuda" and got.tolist() == values and source.is_pinned()


def test_host_values_on_the_cpu():
    from dilated._transfer import host_values_on

    got, source = host_values_on([1, 2, 3], torch.int32, "cpu")
    assert got.dtype == torch.int32 and got.tolist() == [1, 2, 3] and source is None


@pytest.mark.parametrize("backend", ["manual", "sdpa_math", "sdpa"])
def test_a_nan_stays_in_its_document(backend, gen):
    """Padded rows of a batched call read no other document's values: a NaN in the first row of
    the first document leaves every other document's output and gradients exact."""
    cu = [0, 5, 11, 17, 40]  # causal buckets 5, 6 and 24: the last call pads one row
    q, k, v = (rand(1, 40, 2, 8, gen=gen) for _ in range(3))
    k[0, 0], v[0, 0] = float("nan"), float("nan")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = dilated.attention(q, k, v, causal=True, backend=backend, cu_seqlens=torch.tensor(cu, dtype=torch.int32))
    dout = rand(*out.shape, gen=gen)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    qd, kd, vd = (t.detach()[:, 5:].double().requires_grad_() for t in (q, k, v))
    ref, _ = _per_document(qd, kd, vd, [c - 5 for c in cu[1:]], causal=True)
    ref_grads = torch.autograd.grad(ref, (qd, kd, vd), dout[:, 5:].double())
    assert out[:, :5].isnan().all() and rel_err(out[:, 5:], ref) < 2e-4
    for name, g, rg in zip("qkv", grads, ref_grads):
        assert rel_err(g[:, 5:], rg) < 4e-4, f"d{name}"


def test_auto_takes_flash_attn_4s_varlen_entry_point_wherever_it_runs(monkeypatch, gen):
    """Packed documents on ``auto`` go to flash-attn 4's one varlen call even where ``auto``'s dense
    measurement picked a kernel without a varlen entry point (cuDNN); where flash-attn 4 does not
    run, to the batched calls of the kernel ``auto`` resolved to."""
    import varlen_standins
    from dilated.backends import flash_attn_4, varlen

    real_reason = varlen.varlen_reason
    fa4_runs = [True]
    monkeypatch.setattr(flash_attn_4, "cute_interface", lambda: varlen_standins.FA4)
    monkeypatch.setattr(varlen, "dense_kernel", lambda q, k, v, backend, causal: "manual" if backend == "auto" else backend)
    monkeypatch.setattr(varlen, "varlen_reason", lambda q, k, v, backend, causal=False: (
        (None if fa4_runs[0] else "flash-attn 4 is not installed") if backend == "flash_attn_4"
        else real_reason(q, k, v, backend, causal)))
    cu = DOCS["varied"]
    q, k, v = (rand(1, 40, 2, 8, gen=gen, requires_grad=True) for _ in range(3))
    ref, _ = _per_document(*(t.detach().double() for t in (q, k, v)), cu, True)
    for runs, calls in ((True, {"fa4_forward": 1, "fa4_backward": 1}), (False, {})):
        fa4_runs[0] = runs
        varlen_standins.CALLS.clear()
        out = dilated.attention(q, k, v, causal=True, cu_seqlens=torch.tensor(cu, dtype=torch.int32))
        out.sum().backward()
        assert rel_err(out, ref) < 2e-4 and dict(varlen_standins.CALLS) == calls


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("threshold", [0.0, 13 * 13 * 2 * 8 * 4 / 2, float("inf")])  # none, some, all small
def test_auto_runs_small_documents_in_one_varlen_call(causal, threshold, monkeypatch, gen):
    """``auto``: the documents of batched calls below ``SMALL_CALL_FLOPS`` go to one call of torch's
    varlen kernel, the others stay in batched calls; output, lse and gradients (through both) exact
    whatever the split."""
    calls = _small_documents_on_torch_varlen(monkeypatch, threshold)
    _grouped_documents_match(causal, 2, 2, gen)  # lengths 1, 5, 13, 1, 13, 7
    varlen_calls = 0 if threshold == 0.0 else 1
    assert calls["torch_forward"] == varlen_calls
    assert calls["torch_backward"] == 2 * varlen_calls  # the second for lse's gradient


def _small_documents_on_torch_varlen(monkeypatch, threshold: float) -> dict:
    """``auto``'s small documents on the stand-in of torch's varlen kernel (calls below ``threshold``
    FLOPs); returns the stand-in's call counts."""
    import varlen_standins
    from dilated import packed
    from dilated.backends import varlen

    monkeypatch.setattr(varlen, "torch_varlen_ops", lambda: varlen_standins.TORCH_OPS["new"])
    monkeypatch.setattr(packed, "small_documents_kernel", lambda q, k, v, causal=False: varlen.TorchVarlen())
    monkeypatch.setattr(packed, "SMALL_CALL_FLOPS", threshold)
    varlen_standins.CALLS.clear()
    return varlen_standins.CALLS


def _grouped_documents_match(causal: bool, batch: int, heads: int, gen) -> None:
    """``DOCS["varied"]`` on ``heads`` query heads sharing each kv head in pairs, against float64."""
    cu = DOCS["varied"]
    q = rand(batch, 40, heads, 8, gen=gen, requires_grad=True)
    k, v = (rand(batch, 40, heads // 2, 8, gen=gen, requires_grad=True) for _ in range(2))
    out, lse = dilated.attention(q, k, v, causal=causal, return_lse=True, cu_seqlens=torch.tensor(cu, dtype=torch.int32))
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = _per_document(qd, kd.repeat_interleave(2, 2), vd.repeat_interleave(2, 2), cu, causal)
    _assert_matches(out, lse, ref, ref_lse, (q, k, v), (qd, kd, vd), gen)


@pytest.mark.parametrize("causal", [False, True])
def test_a_varlen_backward_past_the_accumulator_limit_runs_in_head_groups(causal, monkeypatch, gen):
    """torch's varlen backward whose float32 dq accumulator would pass its 32-bit indexing runs in
    slices of whole GQA groups (a limit of two heads here: two slices of one group each, and one
    more backward each for lse's gradient); output, lse and gradients exact."""
    from dilated.backends import varlen

    calls = _small_documents_on_torch_varlen(monkeypatch, float("inf"))
    per_head = (40 + 128 * (len(DOCS["varied"]) - 1)) * 32  # rows and 128 per document, head_dim 8 rounded up to 32
    monkeypatch.setattr(varlen.TorchVarlen, "dq_accumulator_limit", 2 * per_head)
    _grouped_documents_match(causal, 1, 4, gen)
    assert calls["torch_forward"] == 1 and calls["torch_backward"] == 4


def test_accumulator_head_slices():
    from dilated.backends.varlen import accumulator_head_slices

    # 1M tokens of short documents on Llama-3-8B heads: 439119 rows of 783 documents pass 2**31 at 32 heads
    assert accumulator_head_slices(439119, 783, 32, 8, 128, 2**31) == [(0, 16), (16, 32)]
    assert accumulator_head_slices(249199, 561, 32, 8, 128, 2**31) is None
    assert accumulator_head_slices(10**9, 1, 32, 8, 128, None) is None
    assert accumulator_head_slices(100, 2, 8, 8, 100, (100 + 256) * 128 * 3) == [(0, 3), (3, 6), (6, 8)]
    assert accumulator_head_slices(100, 2, 12, 4, 128, (100 + 256) * 128 * 7) == [(0, 6), (6, 12)]
    with pytest.raises(ValueError, match="flash_attn_4"):
        accumulator_head_slices(4_000_000, 1, 32, 4, 128, 2**31)


def test_a_hybrid_with_a_ring_of_one_is_ulysses(gen):
    """``ring_size=1``: after the all-to-all each rank holds the whole sequence on its heads, which
    is one device's attention (no ring steps nor float32 accumulators); exact with documents,
    forward and backward."""
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        cu = [0, 40, 45, 96]
        for layout in ("contiguous", "zigzag"):
            hybrid = dilated.HybridAttention(1, 1, causal=True, layout=layout)
            q, k, v = (rand(1, 96, 2, 16, gen=gen, requires_grad=True) for _ in range(3))
            out = hybrid(q, k, v, cu_seqlens=torch.tensor(cu, dtype=torch.int32))
            assert hybrid.stats.steps == 0
            ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
            ref = _per_document(*ref_inputs, cu, True)[0]
            assert rel_err(out, ref) < 2e-4
            dout = rand(*out.shape, gen=gen)
            grads = torch.autograd.grad(out, (q, k, v), dout)
            for name, g, rg in zip("qkv", grads, torch.autograd.grad(ref, ref_inputs, dout.double())):
                assert rel_err(g, rg) < 4e-4, f"d{name}"
    finally:
        dist.destroy_process_group()


def test_a_mix_met_again_makes_no_new_rows(monkeypatch, gen):
    """The rows of a mix's batched calls are made once and kept: a call's backward, and the next
    call at the same mix (a model's next layer), make none; mixes met one after another, more of
    them than are kept and some of one length and count of documents, each match every document
    alone, forward and gradients, the second time round too; what is kept stays within its bounds."""
    from dilated import packed

    made = []
    real = packed._make_rows
    monkeypatch.setattr(packed, "_make_rows", lambda *a: made.append(a[0]) or real(*a))
    packed._KEPT.clear()
    monkeypatch.setattr(packed, "KEPT_MIXES", 4)
    mixes = [[0, 1, 6, 19, 20, 33, 40], [0, 3, 4, 11, 29, 31, 40], [0, 7, 13, 19, 20, 33, 40],
             [0, 13, 19, 20, 26, 39, 40], [0, 8, 16, 24, 32, 40], [0, 5, 13, 21, 29, 40]]
    assert len(mixes) > packed.KEPT_MIXES
    for rnd in range(2):
        for cu in mixes:
            q = rand(2, 40, 4, 8, gen=gen, requires_grad=True)
            k, v = rand(2, 40, 2, 8, gen=gen, requires_grad=True), rand(2, 40, 2, 8, gen=gen, requires_grad=True)
            before = len(made)
            for _ in range(2):
                out, lse = dilated.attention(q, k, v, causal=True, backend="manual", return_lse=True,
                                             cu_seqlens=torch.tensor(cu, dtype=torch.int32))
            qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
            ref, ref_lse = _per_document(qd, kd, vd, cu, True)
            _assert_matches(out, lse, ref, ref_lse, (q, k, v), (qd, kd, vd), gen)
            assert made[before:] == [tuple(cu)], (rnd, cu, made[before:])  # once: forwards and backward
            assert len(packed._KEPT) <= 4
    monkeypatch.setattr(packed, "KEPT_POSITIONS", 100)  # two mixes of 40 positions at most
    for cu in mixes:
        dilated.attention(q, k, v, causal=True, backend="manual", cu_seqlens=torch.tensor(cu, dtype=torch.int32))
    assert [key[0] for key in packed._KEPT] == [tuple(cu) for cu in mixes[-2:]]


@pytest.mark.parametrize("cu", [DOCS["varied"], DOCS["lognormal-like"], [0, 17, 36, 37, 40]])
def test_non_causal_documents_padded_to_buckets_as_two_causal_halves(cu, monkeypatch, gen):
    """Where non-causal documents go padded to bucket lengths (on SDPA's cuDNN kernel:
    ``halves_backend``; here the manual kernel stands in), a call with padding runs as two causal
    calls, each document in order and reversed, merged less the diagonal: exact against float64,
    forward and gradients through out and lse, GQA heads, two batch rows, a call holding documents of
    two lengths ([0, 17, 36, ...]: 17 and 19 rows in one call of 20)."""
    from dilated import causal_halves, packed
    from dilated.backends import get_backend

    merged = []
    merge = causal_halves.merge

    def counted(*args):
        merged.append(args[0].shape[:2])
        return merge(*args)

    monkeypatch.setattr(packed, "halves_backend", lambda backend, q, k, v, causal: None if causal else
                        get_backend("manual"))
    monkeypatch.setattr(causal_halves, "merge", counted)
    q = rand(2, 40, 4, 8, gen=gen, requires_grad=True)
    k, v = (rand(2, 40, 2, 8, gen=gen, requires_grad=True) for _ in range(2))
    out, lse = dilated.attention(q, k, v, backend="manual", return_lse=True,
                                 cu_seqlens=torch.tensor(cu, dtype=torch.int32))
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = _per_document(qd, kd.repeat_interleave(2, 2), vd.repeat_interleave(2, 2), cu, False)
    _assert_matches(out, lse, ref, ref_lse, (q, k, v), (qd, kd, vd), gen)
    calls = document_calls(cu, causal=False, halves=True)
    assert [(n, len(d)) for n, d in calls] == [(n, len(d)) for n, d in document_calls(cu, causal=True)]
    padded = [(2 * len(d), n) for n, d in calls if any(m < n for _, m in d)]
    assert padded and sorted(merged) == sorted(padded)  # each call with padding, and only those, in halves


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("hkv", [8, 2])
def test_gpu_non_causal_documents_on_cudnn_as_causal_halves_in_bf16(hkv, monkeypatch, gen):
    """Non-causal documents on SDPA's cuDNN kernel go padded to bucket lengths, a call with padding
    as two causal cuDNN calls (calls of 320 rows holding documents of 280, 300 and 320): bf16 against
    float64, forward and gradients through out and lse."""
    from dilated import causal_halves

    merged = []
    merge = causal_halves.merge
    monkeypatch.setattr(causal_halves, "merge", lambda *a: merged.append(a[0].shape) or merge(*a))
    cu = [0, 300, 620, 900, 1000, 1100, 1400, 1700, 2048]
    q = rand(2, 2048, 8, 64, gen=gen, dtype=torch.bfloat16).cuda().requires_grad_()
    k, v = (rand(2, 2048, hkv, 64, gen=gen, dtype=torch.bfloat16).cuda().requires_grad_() for _ in range(2))
    out, lse = dilated.attention(q, k, v, backend="sdpa_cudnn", return_lse=True,
                                 cu_seqlens=torch.tensor(cu, dtype=torch.int32))
    assert merged, "no call ran as causal halves"
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    rep = 8 // hkv
    ref, ref_lse = _per_document(qd, kd.repeat_interleave(rep, 2), vd.repeat_interleave(rep, 2), cu, False)
    _assert_matches_in_bf16(out, lse, ref, ref_lse, (q, k, v), (qd, kd, vd), gen)
