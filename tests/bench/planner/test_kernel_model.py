import math

import pytest

from dilated.bench.flops import dense_flops
from dilated.bench.planner.calibration import DocumentPoint
from dilated.bench.planner.kernel_model import KernelModel
from synthetic_calibration import calibration, true_ms, true_rate


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("mode", ["fwd", "fwd_bwd"])
@pytest.mark.parametrize("n, batch", [(128, 1), (3000, 2), (8192, 8), (24576, 2), (65536, 1)])
def test_a_call_takes_its_flops_at_the_calibrated_rate(causal, mode, n, batch):
    km = KernelModel(calibration())
    assert km.call_ms(n, n, batch, 32, 8, 128, causal, mode) == pytest.approx(
        true_ms(batch, n, n, 32, 128, causal, mode), rel=1e-9)


def test_other_head_counts_of_a_calibrated_ratio_are_read_by_their_work():
    km = KernelModel(calibration())
    # 8 q heads over 2 kv heads: the GQA ratio of llama3-8b's 32/8, a quarter of its work per row
    assert km.call_ms(4096, 4096, 1, 8, 2, 128, True, "fwd") == pytest.approx(true_ms(1, 4096, 4096, 8, 128, True, "fwd"),
                                                                             rel=1e-9)


def test_the_backward_alone_is_the_forward_and_backward_less_the_forward():
    km = KernelModel(calibration())
    fwd = km.call_ms(8192, 8192, 1, 32, 8, 128, True, "fwd")
    assert km.call_ms(8192, 8192, 1, 32, 8, 128, True, "bwd") == pytest.approx(2.5 * fwd, rel=1e-9)


def test_longer_calls_than_calibrated_take_the_longest_rate():
    km = KernelModel(calibration(longest=16384))
    n = 1 << 18
    rate_16k_single = true_rate(16384, 16384 * 16 * 4)  # the 16K row's most work: a batch of 4 x 16K rows
    assert km.call_ms(n, n, 1, 16, 16, 128, False, "fwd") == pytest.approx(
        dense_flops(1, 16, n, n, 128, False) / rate_16k_single, rel=1e-9)


def test_an_uncalibrated_head_dim_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match="head dim 64.*--head-shapes"):
        KernelModel(calibration()).call_ms(1024, 1024, 1, 8, 8, 64, True, "fwd")


def test_documents_are_timed_in_the_librarys_calls():
    km = KernelModel(calibration())
    cu = [0, 8192, 16384, 24576, 32768, 45056]  # four of 8K (one batched call) and one of 12K
    want = true_ms(4, 8192, 8192, 32, 128, False, "fwd") + true_ms(1, 12288, 12288, 32, 128, False, "fwd")
    assert km.documents_ms(cu, 1, 32, 8, 128, False, "fwd") == pytest.approx(want, rel=1e-9)


def test_non_causal_documents_in_causal_halves_are_timed_as_the_library_runs_them():
    """A calibration whose backend ran non-causal documents padded to bucket lengths in causal halves
    (``document_halves``): a call with padding is two causal calls of its bucket length, one without
    padding one non-causal call; a calibration that does not say keeps a call per length."""
    cu = [0, 8192, 16384, 24576, 32768, 45056, 57000]  # four of 8K (one call, no padding), 12288, 11944
    halves = KernelModel(calibration(document_halves=True))
    want = true_ms(4, 8192, 8192, 32, 128, False, "fwd") + 2 * true_ms(2, 12288, 12288, 32, 128, True, "fwd")
    assert halves.documents_ms(cu, 1, 32, 8, 128, False, "fwd") == pytest.approx(want, rel=1e-9)
    per_length = KernelModel(calibration())
    want = sum(true_ms(b, m, m, 32, 128, False, "fwd") for b, m in ((4, 8192), (1, 12288), (1, 11944)))
    assert per_length.documents_ms(cu, 1, 32, 8, 128, False, "fwd") == pytest.approx(want, rel=1e-9)
    causal = true_ms(4, 8192, 8192, 32, 128, True, "fwd") + true_ms(2, 12288, 12288, 32, 128, True, "fwd")
    assert halves.documents_ms(cu, 1, 32, 8, 128, True, "fwd") == pytest.approx(causal, rel=1e-9)
    # memory (forward: q, k, v, out per row): the padded call's rows held twice in halves (in order and
    # reversed); the 8K call's once
    per_row = 2 * (32 + 8) * 128 * 2
    assert halves.peak_bytes == 2 * 2 * 12288 * per_row
    assert per_length.peak_bytes == 4 * 8192 * per_row


def test_the_documents_paths_cost_per_call_is_read_off_the_calibrated_mixes():
    cu = (0, 8192, 20480, 36864, 45056, 57344, 73728)  # 8K, 12K, 16K twice: three calls without the mask
    kernels = sum(true_ms(2, m, m, 32, 128, False, "fwd") for m in (8192, 12288, 16384))
    cal = calibration(documents=[DocumentPoint(32, 8, 128, False, "fwd", cu, kernels + 3 * 0.4)])
    km = KernelModel(cal)
    assert km.per_call_ms(128, 4, False, "fwd") == pytest.approx(0.4, rel=1e-9)
    assert km.documents_ms(cu, 1, 32, 8, 128, False, "fwd") == pytest.approx(kernels + 1.2, rel=1e-9)
    assert km.per_call_ms(128, 4, True, "fwd") == 0.0  # no causal mix calibrated


def test_two_mixes_part_the_documents_paths_cost_per_call_from_its_cost_per_row():
    """Mixes of many calls and of one call of many rows: the cost per call and per element of q, k,
    v and out in batched calls are both recovered, and a third mix is predicted from them."""
    per_call, per_element = 0.3, 2e-9

    def timed(cu):
        km = KernelModel(calibration())
        kernels, calls, rows = km._documents(cu, 1, 32, 8, 128, False, "fwd")
        return DocumentPoint(32, 8, 128, False, "fwd", cu,
                             kernels + calls * per_call + rows * (2 * 32 + 2 * 8) * 128 * per_element)

    many = (0, 8192, 20480, 36864, 45056, 57344, 73728)  # 8K, 12K, 16K twice: three calls
    one = tuple(range(0, 16 * 8192 + 1, 8192))  # sixteen of 8K: one call
    km = KernelModel(calibration(documents=[timed(many), timed(one)]))
    assert km.per_call_ms(128, 4, False, "fwd") == pytest.approx(per_call, rel=1e-6)
    third = (0, 4096, 8192, 12288, 16384, 32768)  # four of 4K, one of 16K: two calls
    kernels, calls, rows = km._documents(third, 1, 32, 8, 128, False, "fwd")
    assert (calls, rows) == (2, 32768)
    want = kernels + 2 * per_call + 32768 * (2 * 32 + 2 * 8) * 128 * per_element
    assert km.documents_ms(third, 1, 32, 8, 128, False, "fwd") == pytest.approx(want, rel=1e-6)
    # one mix: all of it per call, as before
    single = KernelModel(calibration(documents=[timed(many)]))
    per = (timed(many).ms - km._documents(many, 1, 32, 8, 128, False, "fwd")[0]) / 3
    assert single.per_call_ms(128, 4, False, "fwd") == pytest.approx(per, rel=1e-9)


def test_the_small_documents_call_is_scaled_by_what_the_calibrated_short_mix_took():
    """Mixes of many calls, of one call and of short documents (one call of the small ones, which the
    library runs on torch's varlen kernel): with that call taking 1.6x its modelled kernel time, the
    factor, the cost per call and per element are all recovered (they depend on each other), and a
    mix of other short documents is predicted from them."""
    from dilated.bench.planner.measure import document_mix, one_length_mix, short_mix

    per_call, per_element, factor = 0.3, 2e-9, 1.6
    bare = KernelModel(calibration())

    def timed(cu):
        big, small, calls, rows = bare._documents_parts(cu, 1, 32, 8, 128, True, "fwd")
        return DocumentPoint(32, 8, 128, True, "fwd", cu, big + factor * small + calls * per_call
                             + rows * (2 * 32 + 2 * 8) * 128 * per_element)

    km = KernelModel(calibration(documents=[timed(document_mix()), timed(one_length_mix()), timed(short_mix())]))
    assert km._factor(128, 4, True, "fwd") == pytest.approx(factor, rel=1e-3)
    assert km.per_call_ms(128, 4, True, "fwd") == pytest.approx(per_call, rel=1e-3)
    other = short_mix(shortest=100, longest=1500, times=3)
    assert km.documents_ms(other, 1, 32, 8, 128, True, "fwd") == pytest.approx(timed(other).ms, rel=1e-3)
    # without a short mix the small call is taken as modelled
    two = KernelModel(calibration(documents=[timed(document_mix()), timed(one_length_mix())]))
    assert two._factor(128, 4, True, "fwd") == 1.0


def test_crossing_rectangles_are_one_dense_call_each_without_a_varlen_kernel():
    """Rectangles of 4000 x 20000 and 8000 x 16000 rows (about 1.2e12 FLOPs each at 32 heads of 128,
    over dilated.packed.SMALL_CALL_FLOPS): a dense call each."""
    km = KernelModel(calibration())
    cu_q, cu_k = (0, 4000, 12000), (0, 20000, 36000)
    want = true_ms(1, 4000, 20000, 32, 128, False, "fwd") + true_ms(1, 8000, 16000, 32, 128, False, "fwd")
    assert km.rectangles_ms(cu_q, cu_k, 1, 32, 8, 128, "fwd") == pytest.approx(want, rel=1e-9)


def test_small_crossing_rectangles_are_one_call_of_torchs_varlen_kernel():
    """Rectangles of 1000 x 5000 and 2000 x 4000 rows (1.1e11 FLOPs on average, under
    dilated.packed.SMALL_CALL_FLOPS): one call, their FLOPs at the rate of two rectangles of the mean
    size (1500 x 4500) at once (no calibrated factor for the small call here)."""
    km = KernelModel(calibration())
    cu_q, cu_k = (0, 1000, 3000), (0, 5000, 9000)
    flops = dense_flops(1, 32, 1000, 5000, 128, False, "fwd") + dense_flops(1, 32, 2000, 4000, 128, False, "fwd")
    want = flops / true_rate(math.sqrt(1500 * 4500), 2 * 1500 * 32)
    assert km.rectangles_ms(cu_q, cu_k, 1, 32, 8, 128, "fwd") == pytest.approx(want, rel=1e-9)


def _varlen_want(lengths, heads, causal, mode):
    """One varlen call: each document's FLOPs at the rate of its length given every document's rows."""
    work = sum(lengths) * heads
    return sum(dense_flops(1, heads, m, m, 128, causal, mode) / true_rate(m, work) for m in lengths)


@pytest.mark.parametrize("causal", [True, False])
def test_documents_on_flash_attn_4_are_one_varlen_call(causal):
    cu = [0, 8192, 16384, 24576, 32768, 45056, 45556]  # 8K four times, 12K, 500
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    km = KernelModel(calibration(backend="auto", varlen_kernel="flash_attn_4_varlen"))
    for mode in ("fwd", "fwd_bwd"):
        want = _varlen_want(lengths, 32, causal, mode)
        assert km.documents_ms(cu, 1, 32, 8, 128, causal, mode) == pytest.approx(want, rel=1e-9)
    bwd = _varlen_want(lengths, 32, causal, "fwd_bwd") - _varlen_want(lengths, 32, causal, "fwd")
    assert km.documents_ms(cu, 1, 32, 8, 128, causal, "bwd") == pytest.approx(bwd, rel=1e-9)
    # more work in the call than any of its calls alone would give: faster than those calls one by one
    batched = KernelModel(calibration()).documents_ms(cu, 1, 32, 8, 128, causal, "fwd")
    assert km.documents_ms(cu, 1, 32, 8, 128, causal, "fwd") < batched


def test_torchs_varlen_kernel_named_by_an_auto_calibration_leaves_documents_in_batched_calls():
    """auto runs torch's varlen kernel only where its dense pick for the shard is torch's flash kernel."""
    cu = [0, 8192, 16384, 24576, 32768, 45056]
    auto = KernelModel(calibration(backend="auto", varlen_kernel="torch_varlen"))
    assert auto.documents_ms(cu, 1, 32, 8, 128, False, "fwd") == pytest.approx(
        KernelModel(calibration()).documents_ms(cu, 1, 32, 8, 128, False, "fwd"), rel=1e-12)
    named = KernelModel(calibration(backend="sdpa_flash", varlen_kernel="torch_varlen"))
    want = _varlen_want([b - a for a, b in zip(cu, cu[1:])], 32, False, "fwd")
    assert named.documents_ms(cu, 1, 32, 8, 128, False, "fwd") == pytest.approx(want, rel=1e-9)



def test_calls_of_less_work_than_calibrated_with_a_tie_among_the_least_work_points():
    """Two head shapes of one GQA ratio whose least-work calls at a length do the same work (32/8 at
    batch 1, 8/2 at batch 4) tell no slope between them: a call of less work takes the slope from
    the next point of more work, not a division by zero."""
    from dilated.bench.planner.calibration import KernelPoint

    cal = calibration()
    n = 4096
    extra = [KernelPoint(8, 2, 128, True, "fwd", n, 4, true_ms(4, n, n, 8, 128, True, "fwd"))]
    cal.kernels = extra + cal.kernels
    ms = KernelModel(cal).call_ms(n, n, 1, 4, 1, 128, True, "fwd")  # a quarter of the least work at 4K
    assert 0 < ms < KernelModel(cal).call_ms(n, n, 1, 32, 8, 128, True, "fwd")
