"""``auto`` by measurement (dilated.backends.auto) and the kernels a row records."""
import json
import time

import pytest
import torch

import dilated
from dilated.backends import auto, get_backend, record_kernels, register_backend
from dilated.backends.base import Backend
from dilated.backends import _REGISTRY, AUTO_ORDER

from conftest import rand


class _Timed(Backend):
    """The manual kernel, slowed by ``delay_s`` per call; counts its calls."""

    def __init__(self, name, delay_s):
        self.name, self.delay_s, self.calls = name, delay_s, 0

    def forward(self, q, k, v, causal, scale):
        self.calls += 1
        time.sleep(self.delay_s)
        return _REGISTRY["manual"].forward(q, k, v, causal, scale)

    def backward(self, *args):
        time.sleep(self.delay_s)
        return _REGISTRY["manual"].backward(*args)


def _by_delay(backend, q, k, v, dout, causal):
    """A candidate's time as its delay, after one call: which one wins is given, not left to the
    noise of a loaded host (``_time_ms`` itself is tested on its own)."""
    backend.forward(q, k, v, causal, q.shape[-1] ** -0.5)
    return backend.delay_s * 1e3


@pytest.fixture
def measured(monkeypatch, tmp_path):
    """Measuring on CPU, a fresh disk cache; two registered backends, the slow one first in the order."""
    monkeypatch.setattr(auto, "MEASURED_DEVICES", {"cpu"})
    monkeypatch.setattr(auto, "_time_ms", _by_delay)
    monkeypatch.setattr(auto, "ROWS_TIMED", 256)  # a small device-filling batch: the delays decide, not the work
    monkeypatch.setenv("DILATED_AUTO_CACHE", str(tmp_path / "auto.json"))
    monkeypatch.delenv("DILATED_AUTO", raising=False)
    slow, fast = register_backend(_Timed("slow_for_test", 0.02)), register_backend(_Timed("fast_for_test", 0.0))
    monkeypatch.setitem(AUTO_ORDER, "cpu", ["slow_for_test", "fast_for_test"])
    auto.clear()
    yield slow, fast, tmp_path / "auto.json"
    auto.clear()
    del _REGISTRY["slow_for_test"], _REGISTRY["fast_for_test"]


def test_auto_takes_the_fastest_not_the_first_and_remembers_it(measured, gen):
    slow, fast, cache = measured
    q, k, v = (rand(1, 64, 2, 16, gen=gen) for _ in range(3))
    assert get_backend("auto", q, k, False, v=v) is fast
    calls = slow.calls
    assert get_backend("auto", q, k, False, v=v) is fast and slow.calls == calls  # no second measurement
    out = dilated.attention(q, k, v)  # and it computes the right thing through the chosen kernel
    assert torch.allclose(out, dilated.attention(q, k, v, backend="manual"))
    entries = json.loads(cache.read_text())  # the class and its sibling of the other batch state
    assert list(entries.values()) == ["fast_for_test"] * 2
    keys = [json.loads(key) for key in entries]
    assert all(key[1] == ["slow_for_test", "fast_for_test"] and key[2]["nq"] == 64 and key[2]["causal"] is False
               for key in keys)
    assert sorted(key[2]["batch"] for key in keys) == [1, auto.ROWS_TIMED // 64]


def test_a_timing_is_the_median_of_its_repetitions_after_warm_up(gen):
    """Each call sleeps 20 ms: every repetition is at least that, so the median is too, whatever
    the host's load; the warm-up calls run but are not timed."""
    timed = _Timed("timed_for_test", 0.02)
    q = rand(1, 64, 2, 16, gen=gen)
    ms = auto._time_ms(timed, q, q, q, None, False)
    assert timed.calls == auto.WARMUP + auto.REPS
    assert 20.0 <= ms < 20.0 * auto.REPS  # one call's time, not the sum of the repetitions


def test_the_disk_cache_answers_a_new_process(measured, gen):
    slow, fast, cache = measured
    q, k, v = (rand(1, 100, 2, 16, gen=gen) for _ in range(3))
    get_backend("auto", q, k, True, v=v)
    auto.clear()  # as a new process: only the disk remembers
    data = json.loads(cache.read_text())
    cache.write_text(json.dumps({key: "slow_for_test" for key in data}))  # the file's answer is used as is
    calls = slow.calls + fast.calls
    assert get_backend("auto", q, k, True, v=v) is slow and slow.calls + fast.calls == calls


def test_shape_classes_are_measured_apart(measured, gen):
    q = rand(1, 3000, 2, 16, gen=gen)
    other = rand(1, 5000, 2, 16, gen=gen)
    assert auto.shape_class(q, q, q, False)["nq"] == 4096 == auto.shape_class(other, other, other, False)["nq"]
    assert auto.shape_class(q[:, :1], q, q, False)["nq"] == 1  # decode is its own class
    assert auto.shape_class(q, q, q, True) != auto.shape_class(q, q, q, False)
    qg = q.clone().requires_grad_()
    assert auto.shape_class(qg, q, q, False)["grad"] and not auto.shape_class(q, q, q, False)["grad"]


def test_each_field_of_a_shape_class_reads_its_own_input():
    """q [2, 100, 4, 32], k [2, 300, 2, 32], v [2, 300, 2, 16], float64, causal: every field from the
    input it names (powers of two for lengths, kv heads from k, head_dim_v from v, a batch that
    fills the device for more than one sequence)."""
    q = torch.zeros(2, 100, 4, 32, dtype=torch.float64)
    k = torch.zeros(2, 300, 2, 32, dtype=torch.float64)
    v = torch.zeros(2, 300, 2, 16, dtype=torch.float64)
    cls = auto.shape_class(q, k, v, True)
    assert cls == {"device": "cpu", "dtype": "float64", "head_dim": 32, "head_dim_v": 16, "heads": 4,
                   "kv_heads": 2, "causal": True, "grad": False, "nq": 128, "nk": 512,
                   "batch": auto.ROWS_TIMED // 512}
    assert auto.shape_class(q[:1], k[:1], v[:1], False)["batch"] == 1  # one short sequence: as it is
    assert auto.shape_class(q[:1], k[:1], None, False)["head_dim_v"] == 32  # no v: k's


def test_fixed_order_when_asked(measured, monkeypatch, gen):
    slow, fast, _ = measured
    monkeypatch.setenv("DILATED_AUTO", "order")
    q = rand(1, 32, 2, 16, gen=gen)
    assert get_backend("auto", q, q, False, v=q) is slow


def test_rows_record_the_kernel_that_ran_and_the_first_call():
    from dilated.bench import Case, Implementation, RunOptions, run_sweep
    from dilated.bench.registry import IMPLEMENTATIONS

    case = Case(batch=1, seq_len=64, num_heads=2, head_dim=8, dtype="float32", segment_lengths=(16, 32),
                dilation_rates=(1, 2), mode="fwd_bwd")
    plain = Implementation("plain_sdpa_for_test", "dense", lambda c, b: lambda q, k, v: torch.nn.functional
                           .scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                         v.transpose(1, 2)).transpose(1, 2))
    jobs = [(IMPLEMENTATIONS["improved"], case, "manual"), (IMPLEMENTATIONS["dense"], case, "auto"), (plain, case, "x")]
    rows = run_sweep(jobs, RunOptions(reps=2, warmup=1, device="cpu"), None, "test", progress=False)
    assert rows[0]["kernels"] == ["manual"]
    assert rows[1]["kernels"] == [dilated.backends.AUTO_ORDER["cpu"][0]]  # auto on CPU: the first that works
    assert rows[2]["kernels"] is None  # not through dilated's backends: nothing to say
    assert all(r["first_call_ms"] > 0 for r in rows)


def test_the_batch_is_one_sequence_or_a_device_filling_call(gen):
    """One short sequence is timed as it is (host overhead is most of its time); anything larger (a
    dilated branch's segments, one long sequence) as a batch that fills the GPU."""
    one = rand(1, 2048, 2, 16, gen=gen)
    assert auto.shape_class(one, one, one, False)["batch"] == 1
    assert auto.shape_class(*[rand(3, 64, 2, 16, gen=gen)] * 3, False)["batch"] == auto.ROWS_TIMED // 64
    big = torch.empty(1, 1, 2, 16).expand(512, 2048, 2, 16)
    assert auto.shape_class(big, big, big, False)["batch"] == auto.ROWS_TIMED // 2048
    long = torch.empty(1, 1, 2, 16).expand(1, 100_000, 2, 16)
    assert auto.shape_class(long, long, long, False)["batch"] == auto.ROWS_TIMED // auto.LONGEST_TIMED
    decode = auto.shape_class(torch.empty(8, 1, 2, 16), long[:1], long[:1], False)  # bounded by the keys too
    assert decode["nq"] == 1 and decode["batch"] == auto.ROWS_TIMED // auto.LONGEST_TIMED


def test_a_segment_count_that_crosses_batch_states_measures_nothing(measured, gen):
    """A dilated step at a new length has another segment count (the batch of its largest call):
    both batch states of its class are measured at the first call, so the later length measures
    nothing."""
    slow, fast, _ = measured
    seg = 64
    one, many = rand(1, seg, 2, 16, gen=gen), rand(5, seg, 2, 16, gen=gen)
    assert get_backend("auto", one, one, False, v=one) is fast
    calls = slow.calls + fast.calls
    assert get_backend("auto", many, many, False, v=many) is fast and slow.calls + fast.calls == calls
    auto.clear()
    assert get_backend("auto", many, many, True, v=many) is fast  # and from the other side
    calls = slow.calls + fast.calls
    assert get_backend("auto", one, one, True, v=one) is fast and slow.calls + fast.calls == calls


def test_one_kernel_is_timed_once_and_per_shape_compilers_not_beside_others(measured, monkeypatch, gen):
    """A backend that would run the same kernel as one before it (``sdpa`` resolving to cuDNN) is
    not timed again; one that compiles per shape (flex) is not timed where another works."""
    slow, fast, _ = measured
    twin = register_backend(_Timed("twin_for_test", 0.0))
    twin.kernel_name = lambda q, k, causal: "slow_for_test"
    compiler = register_backend(_Timed("compiler_for_test", 0.0))
    compiler.compiles_per_shape = True
    try:
        monkeypatch.setitem(AUTO_ORDER, "cpu", ["compiler_for_test", "slow_for_test", "twin_for_test"])
        q = rand(1, 64, 2, 16, gen=gen)
        from dilated.backends import backend_reason

        for name in ("twin_for_test", "compiler_for_test"):
            assert backend_reason(name, q.device) is None  # availability probes before counting
        before = twin.calls, compiler.calls
        assert get_backend("auto", q, q, False, v=q) is slow  # the twin, as fast as it is, never ran
        assert (twin.calls, compiler.calls) == before
        monkeypatch.setitem(AUTO_ORDER, "cpu", ["compiler_for_test"])  # the only one: taken
        auto.clear()
        assert get_backend("auto", q, q, False, v=q) is compiler
    finally:
        del _REGISTRY["twin_for_test"], _REGISTRY["compiler_for_test"]


def test_sdpa_rows_name_the_kernel_pytorch_chose(gen):
    q, k = rand(1, 64, 4, 16, gen=gen), rand(1, 64, 2, 16, gen=gen)
    with record_kernels() as ran:
        dilated.attention(q, k, k, backend="sdpa")
    assert len(ran) == 1 and next(iter(ran)).startswith("sdpa_")
    assert ran == {get_backend("sdpa").kernel_name(q, k.repeat_interleave(2, 2), False)}


def test_dilated_attention_chooses_its_kernel_by_the_calls_it_makes(monkeypatch, gen):
    """``auto`` in ``ImprovedDilatedAttention`` is resolved on the shape of the plan's largest
    call (segments folded into the batch), not on the whole sequence."""
    seen = []

    def fastest(candidates, q, k, v, causal):
        seen.append(tuple(q.shape))
        return candidates[0]

    monkeypatch.setattr(auto, "fastest", fastest)
    q, k, v = (rand(1, 8192, 2, 8, gen=gen) for _ in range(3))
    out = dilated.ImprovedDilatedAttention([1024, 2048, 4096], [1, 2, 4])(q, k, v)
    assert seen == [(8, 1024, 2, 8)]  # 8 segments of 1024 rows; the r > 1 branches have fewer
    ref = dilated.ImprovedDilatedAttention([1024, 2048, 4096], [1, 2, 4], backend="manual")(q, k, v)
    assert torch.allclose(out, ref, atol=1e-5)


def test_kernels_that_materialise_the_scores_are_not_timed_beside_fused_ones(measured, monkeypatch, gen):
    """Their scores would take gigabytes at a device-filling shape: with a fused kernel working,
    a score-materialising one is neither timed nor chosen, even where it would time fastest."""
    slow, fast, _ = measured
    scores = register_backend(_Timed("scores_for_test", 0.0))
    scores.materializes_scores = True
    try:
        monkeypatch.setitem(AUTO_ORDER, "cpu", ["scores_for_test", "slow_for_test", "fast_for_test"])
        q = rand(1, 64, 2, 16, gen=gen)
        from dilated.backends import backend_reason

        assert backend_reason("scores_for_test", q.device) is None  # its availability probe, one call
        calls = scores.calls
        assert get_backend("auto", q, q, False, v=q) is fast and scores.calls == calls
        monkeypatch.setitem(AUTO_ORDER, "cpu", ["scores_for_test"])  # the only one: taken
        auto.clear()
        assert get_backend("auto", q, q, False, v=q) is scores
    finally:
        del _REGISTRY["scores_for_test"]


def test_a_measurement_that_ran_out_of_memory_is_not_kept_on_disk(measured, gen):
    """With more memory free another time, the kernel that ran out might have won: the choice holds
    for this process only."""
    slow, fast, cache = measured

    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory (a stand-in)")

    fast.forward = out_of_memory
    try:
        q = rand(1, 64, 2, 16, gen=gen)
        assert get_backend("auto", q, q, False, v=q) is slow
        assert not cache.exists() or json.loads(cache.read_text()) == {}
        calls = slow.calls
        assert get_backend("auto", q, q, False, v=q) is slow and slow.calls == calls  # remembered in-process
    finally:
        del fast.forward
