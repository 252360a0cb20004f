"""The harness: FLOP counts, JSONL rows, compare, plot, OOM rows, bad input."""
import contextlib
import io
import json
import subprocess
import sys
import types

import pytest
import torch
from conftest import cpu_only_env, usage_error

from dilated.bench import Case, Implementation, RunOptions, read_jsonl, register_implementation, run_sweep
from dilated.bench.flops import dense_flops, dilated_flops, visible_pairs
from dilated.bench.registry import IMPLEMENTATIONS
from dilated.bench.plots import plot
from dilated.bench.suites import implementations_main
from dilated.bench.report import compare
from dilated.bench.results import ResultWriter

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


def test_flop_counts_by_hand():
    assert dense_flops(2, 4, 8, 8, 16) == 4 * 2 * 4 * 64 * 16
    assert visible_pairs(4, 4, True) == 10                 # 1 + 2 + 3 + 4
    assert visible_pairs(2, 5, True) == 4 + 5              # bottom-right: rows see 4 and 5 keys
    assert visible_pairs(5, 2, True) == 0 + 0 + 0 + 1 + 2  # early rows see nothing
    assert dense_flops(1, 8, 4, 4, 8) == dense_flops(1, 8, 4, 4, 8)  # GQA counted by q heads (same call)
    assert dense_flops(1, 1, 4, 4, 8, mode="fwd_bwd") == 3.5 * dense_flops(1, 1, 4, 4, 8)
    # N=10, w=4 (segments 4, 4, 2), r=2, two heads: head 0 rows {0,2},{0,2},{0}; head 1 {1,3},{1,3},{1}
    # -> per head 4 + 4 + 1 = 9 pairs; plus w=10, r=1: 100 pairs per head
    assert dilated_flops(1, 2, 10, 8, [4, 10], [2, 1]) == 4 * 8 * (2 * 9 + 2 * 100)
    # causal: w=4 r=1 over N=4 -> 10 pairs per head
    assert dilated_flops(1, 1, 4, 8, [4], [1], causal=True) == 4 * 8 * 10


def test_causal_flops_count_the_visible_half_by_hand():
    # 4 x 4 causal: 10 of 16 pairs; 4 FLOPs (QK^T and PV) per pair and head-dim element
    assert dense_flops(1, 1, 4, 4, 8, causal=True) == 4 * 10 * 8
    assert dense_flops(2, 3, 1024, 1024, 64, causal=True) == 4 * 2 * 3 * (1024 * 1025 // 2) * 64
    case = Case(batch=1, seq_len=64, num_heads=2, head_dim=8, dtype="float32", causal=True)
    full = Case(batch=1, seq_len=64, num_heads=2, head_dim=8, dtype="float32")
    impl = IMPLEMENTATIONS["dense"]
    assert impl.flops(case, "fwd") == 4 * 2 * (64 * 65 // 2) * 8
    assert impl.flops(full, "fwd") == 4 * 2 * 64 * 64 * 8


def test_summary_statistics_by_hand():
    from dilated.bench.timing import summarize

    t = summarize([5.0, 1.0, 3.0, 2.0, 4.0, 100.0])
    assert t["median"] == t["p50"] == 3.5 and t["min"] == 1.0 and t["max"] == 100.0
    assert t["mean"] == pytest.approx(115.0 / 6) and t["n"] == 6
    assert t["p10"] == pytest.approx(1.5) and t["p90"] == pytest.approx(52.5)  # linear between order statistics
    assert summarize([7.0])["median"] == 7.0 and summarize([2.0, 9.0, 4.0])["median"] == 4.0
    four = summarize([4.0, 1.0, 3.0, 2.0])  # deviations 1.5, 0.5, 0.5, 1.5: squares sum to 5, over n - 1
    assert four["std"] == pytest.approx((5 / 3) ** 0.5) and summarize([7.0])["std"] == 0.0
    assert four["p95"] == pytest.approx(3.85) and four["p99"] == pytest.approx(3.97)  # 3 + (4 - 3) x 0.85, x 0.97


def _run_script(script, *args, tmp_path):
    out = tmp_path / "run.jsonl"
    res = subprocess.run([sys.executable, str(ROOT / script), "--quick", "--no-progress", "--output", str(out), *args],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    return read_jsonl(str(out)), res.stdout


@pytest.mark.parametrize("script", ["benchmarks/core/benchmark_implementations.py",
                                    "benchmarks/core/benchmark_backends.py"])
def test_quick_run_writes_valid_rows(script, tmp_path):
    extra = ["--no-compiled"] if "backends" in script else []
    rows, stdout = _run_script(script, *extra, tmp_path=tmp_path)
    assert rows and "results:" in stdout
    for r in rows:
        assert r["status"] == "ok", r
        for key in ("implementation", "backend", "mode", "config", "time_ms", "tflops", "tokens_per_s", "memory",
                    "check", "env", "command", "run_timestamp", "bytes_min", "bandwidth_gbs", "arith_intensity"):
            assert key in r, key
        assert r["check"]["passed"] and r["time_ms"]["n"] >= 3
        for key in ("median", "mean", "std", "min", "p10", "p50", "p90", "p95", "p99"):
            assert key in r["time_ms"]
        for key in ("torch", "cuda", "cudnn", "triton", "flash_attn", "xformers", "hostname", "git_commit", "gpu_count"):
            assert key in r["env"]


def _fake_rows(path, factor):
    rows = []
    for i, n in enumerate([128, 256]):
        t = {"median": 10.0 * (i + 1) * factor, "p10": 9.9 * (i + 1) * factor, "p90": 10.1 * (i + 1) * factor}
        rows.append({"implementation": "x", "backend": "b", "mode": "fwd", "status": "ok", "time_ms": t,
                     "config": Case(batch=1, seq_len=n, num_heads=2, head_dim=8).config(),
                     "tokens_per_s": 1.0 / t["median"],
                     "memory": {"peak_above_inputs_mib": n / 100}})
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def test_compare_flags_a_2x_slowdown_not_1_percent(tmp_path):
    base, slow, same = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    _fake_rows(base, 1.0)
    _fake_rows(slow, 2.0)
    _fake_rows(same, 1.01)
    text, problems, _ = compare(str(base), str(slow))
    assert len(problems) == 2 and "REGRESSION" in text
    text, problems, _ = compare(str(base), str(same))
    assert not problems
    cli = [sys.executable, "-m", "dilated.bench", "compare", str(base), str(slow), "--fail-on-regression"]
    assert subprocess.run(cli, capture_output=True, cwd=ROOT).returncode == 1


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    run = tmp_path / "run.jsonl"
    _fake_rows(run, 1.0)
    paths = plot(str(run))
    assert paths and all(open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n" for p in paths)
    elsewhere = plot(str(run), str(tmp_path / "plots" / "new"))  # a folder not there yet is made
    assert elsewhere and all(p.startswith(str(tmp_path / "plots" / "new")) for p in elsewhere)


def test_injected_oom_is_recorded_and_the_sweep_goes_on(tmp_path):
    base = IMPLEMENTATIONS["dense"]

    def build(case, backend):
        def fn(q, k, v):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 PiB")
        return fn

    oom = register_implementation(Implementation("oom_for_test", "dense", build))
    try:
        case = Case(batch=1, seq_len=16, num_heads=2, head_dim=8, dtype="float32")
        writer = ResultWriter(str(tmp_path / "r.jsonl"))
        rows = run_sweep([(oom, case, "manual"), (base, case, "manual")], RunOptions(reps=3, warmup=1), writer,
                         "test", progress=False)
        assert [r["status"] for r in rows] == ["oom", "ok"]
        assert [r["status"] for r in read_jsonl(writer.path)] == ["oom", "ok"]
    finally:
        del IMPLEMENTATIONS["oom_for_test"]


def test_memory_budget_marks_rows_oom(tmp_path):
    case = Case(batch=1, seq_len=16, num_heads=2, head_dim=8, dtype="float32")
    rows = run_sweep([(IMPLEMENTATIONS["dense"], case, "manual")], RunOptions(reps=3, warmup=1,
                     memory_budget_mib=-1), None, "test", progress=False)
    assert rows[0]["status"] == "oom" and "budget" in rows[0]["reason"]


def test_malformed_yaml_and_unknown_implementation(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("seq-lengths: [1024\n  mode: : :\n")
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("sequence_lenghts: 1024\n")
    for args, why in [(["--config", str(bad)], "cannot read YAML"), (["--config", str(unknown)], "unknown option"),
                      (["--implementations", "nope", "--no-progress"], "unknown implementation 'nope'")]:
        err = io.StringIO()  # benchmarks/core/benchmark_implementations.py's main, in this process
        with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as stop:
            implementations_main([*args, "--output", str(tmp_path / "never.jsonl")])
        assert stop.value.code != 0 and why in err.getvalue(), err.getvalue()


def test_yaml_config_sets_the_sweep(tmp_path):
    cfg = tmp_path / "sweep.yaml"
    cfg.write_text("seq-lengths: [64, 128]\nnum-heads: 2\nhead-dim: 16\nimplementations: [dense, improved]\n"
                   "reps: 3\nwarmup: 1\n")
    out = tmp_path / "r.jsonl"
    script = str(ROOT / "benchmarks/core/benchmark_implementations.py")
    res = subprocess.run([sys.executable, script, "--config", str(cfg), "--output", str(out), "--no-progress"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr[-1500:]
    rows = read_jsonl(str(out))
    assert {(r["implementation"], r["config"]["seq_len"]) for r in rows} == {
        ("dense", 64), ("dense", 128), ("improved", 64), ("improved", 128)}


class _NotATensor:
    pass


def test_captured_inputs_give_the_case_and_are_loaded_weights_only(tmp_path):
    from dilated.bench.captured import load_captured

    d = tmp_path / "cap"
    d.mkdir()
    g = torch.Generator().manual_seed(3)
    torch.save({"q": torch.randn(1, 96, 4, 16, generator=g), "k": torch.randn(1, 96, 2, 16, generator=g),
                "v": torch.randn(1, 96, 2, 16, generator=g)}, d / "attn.pt")
    torch.save({"x": torch.randn(2, 64, 32, generator=g)}, d / "module.pt")
    out = tmp_path / "cap.jsonl"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks/core/benchmark_implementations.py"), "--inputs",
                          str(d), "--num-heads", "2", "--implementations", "dense,improved,multihead", "--reps", "2",
                          "--warmup", "1", "--no-progress", "--output", str(out)], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = {(r["implementation"], r["inputs"].rsplit("/", 1)[-1]): r for r in read_jsonl(str(out))}
    attn = rows[("improved", "attn.pt")]
    assert attn["status"] == "ok" and attn["check"]["passed"]
    assert (attn["config"]["seq_len"], attn["config"]["num_heads"], attn["config"]["num_kv_heads"]) == (96, 4, 2)
    assert rows[("multihead", "module.pt")]["status"] == "ok"
    assert rows[("multihead", "module.pt")]["config"]["head_dim"] == 16  # E=32 over --num-heads 2
    assert rows[("multihead", "attn.pt")]["status"] == "unsupported"  # a module needs x
    torch.save({"q": _NotATensor()}, d / "zz_code.pt")  # would run code on a full unpickle
    with pytest.raises(ValueError, match="weights_only"):
        load_captured(str(d))


def test_extreme_script_cpu_default_writes_results_and_plots(tmp_path):
    # the CPU defaults up to 1K (the default sweep goes on to 16K: under a minute of two cores)
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks/specialized/benchmark_extreme_sequences.py"),
                          "--max-seq-length", "1k"], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env=cpu_only_env())
    assert res.returncode == 0, res.stderr[-3000:]
    assert "extreme-sequence sweep on CPU" in res.stdout and "results are in" in res.stdout
    rows = read_jsonl(str(next((tmp_path / "results" / "cpu").glob("*.jsonl"))))
    assert {r["implementation"] for r in rows} == {"dilated", "improved", "improved_pool", "multihead", "dense"}
    assert all(r["status"] == "ok" and r["check"]["passed"] for r in rows)
    assert "time ~ N^" in res.stdout and list((tmp_path / "results" / "cpu").glob("*.png"))
    ns = sorted({r["config"]["seq_len"] for r in rows})
    assert f"over N={ns[0]}..{ns[-1]} ({len(ns)} lengths)" in res.stdout, res.stdout[-2000:]
    for line in res.stdout.splitlines():  # a fit of memory only where every peak is a MiB or more
        if "memory ~ N^" in line:
            name = line.split()[0]
            assert min((r.get("memory") or {}).get("peak_above_inputs_mib") or 0 for r in rows
                       if r["implementation"] == name) >= 1.0, line


def test_find_max_under_a_memory_budget_finds_the_right_length(tmp_path):
    """A fake implementation that holds exactly N x 64 KiB: with a 208 MiB budget and 512-token
    bisection the longest length is 3072 (192 MiB; 3584 would need 224 MiB)."""
    from dilated.bench.suites import extreme_main, find_max_length

    def build(case, backend):
        def fn(q, k, v):
            held = torch.ones(case.seq_len * 16384)  # N x 64 KiB, touched
            return q * held[0]
        return fn

    register_implementation(Implementation("holds_64k_per_token", "dense", build))
    try:
        out = tmp_path / "fm.jsonl"
        extreme_main(["--implementation", "holds_64k_per_token", "--min-seq-length", "512", "--max-seq-length", "1024",
                      "--find-max", "--memory-budget-mib", "208", "--granularity", "512", "--no-check", "--reps", "2",
                      "--device", "cpu", "--no-progress", "--no-plot", "--output", str(out)])
    finally:
        IMPLEMENTATIONS.pop("holds_64k_per_token")
    found = json.loads((tmp_path / "fm-find_max.json").read_text())["results"][0]
    assert found["max_seq_len"] == 3072, found
    probes = {r["config"]["seq_len"]: r["status"] for r in read_jsonl(str(out)) if r.get("find_max")}
    assert probes[4096] == probes[3584] == "oom" and probes[3072] == "ok"
    # a failure at the configured maximum bisects down towards the last length that ran
    assert find_max_length(lambda n: {"status": "ok" if n <= 700 else "oom"}, 1024, 64, 1 << 20, known_ok=512)[0] == 640


def test_custom_benchmark_example_runs(tmp_path):
    example = ROOT / "examples" / "custom_benchmark.py"
    assert len(example.read_text().splitlines()) < 40
    res = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = read_jsonl(str(next(tmp_path.glob("results/*/custom_benchmark-*.jsonl"))))
    assert {r["implementation"] for r in rows} == {"mine", "dense"} and all(r["check"]["passed"] for r in rows)


@pytest.mark.parametrize("mode", ["fwd", "fwd_bwd"])
def test_a_call_does_not_hold_the_previous_calls_output(mode):
    """Memory per token is the step's own: the previous call's output (at the longest lengths as
    large as q) is dropped before the next call makes its own."""
    import weakref

    base = IMPLEMENTATIONS["dense"]
    last, held = [], []

    def build(case, backend):
        attention = base.build(case, backend)

        def model(*inputs):
            held.append(bool(last) and last[-1]() is not None)
            out = attention(*inputs)
            last.append(weakref.ref(out))
            return out
        return model

    impl = register_implementation(Implementation("remembers_its_outputs_for_test", "dense", build))
    try:
        case = Case(batch=1, seq_len=16, num_heads=2, head_dim=8, dtype="float32", mode=mode)
        row = run_sweep([(impl, case, "manual")], RunOptions(reps=3, warmup=1, device="cpu"), None, "t",
                        progress=False)[0]
    finally:
        IMPLEMENTATIONS.pop("remembers_its_outputs_for_test")
    assert row["status"] == "ok" and row["check"]["passed"] and len(held) > 3
    assert not any(held), held


def test_a_failed_row_across_ranks_frees_its_tensors_before_the_next_row():
    """A row that fails on a rank (an out-of-memory check, say) keeps its failure until the ranks agree;
    that failure's traceback holds the frames it went through and their tensors: they are freed when
    the row ends, not at some later garbage collection after the next row has allocated."""
    import dataclasses
    import gc
    import weakref

    @dataclasses.dataclass
    class TimedAcrossRanks(Implementation):  # a row whose ranks agree on failures (one rank here)
        def reduce_max(self, values):
            return list(values)

    held = []

    def build(case, backend):
        def model(q, k, v):
            gathered = torch.ones(1 << 16)  # what a failing check had gathered
            held.append(weakref.ref(gathered))
            raise RuntimeError("fails with its gathered tensor in the frame")
        return model

    impl = register_implementation(TimedAcrossRanks("fails_across_ranks_for_test", "dense", build))
    gc.disable()  # only reference counts free what the row leaves
    try:
        case = Case(batch=1, seq_len=16, num_heads=2, head_dim=8, dtype="float32")
        row = run_sweep([(impl, case, "manual")], RunOptions(reps=1, warmup=1, device="cpu"), None, "t",
                        progress=False)[0]
        alive = [ref() is not None for ref in held]
    finally:
        gc.enable()
        IMPLEMENTATIONS.pop("fails_across_ranks_for_test")
    assert row["status"] == "error" and "gathered tensor" in row["reason"] and held
    assert not any(alive), alive


def test_kernel_floor_is_timed_beside_dilated_rows():
    impl = IMPLEMENTATIONS["improved"]
    case = Case(batch=1, seq_len=256, num_heads=4, head_dim=16, dtype="float32", mode="fwd_bwd",
                segment_lengths=(64, 256), dilation_rates=(1, 4))
    row = run_sweep([(impl, case, "auto")], RunOptions(warmup=1, reps=3, floor=True, device="cpu"), None, "t",
                    progress=False)[0]
    assert row["status"] == "ok" and row["check"]["passed"]
    assert row["kernel_floor_ms"]["n"] == 3 and row["floor_ratio"] > 0
    assert row["one_call_floor_ms"]["n"] == 3 and row["one_call_floor_ratio"] > 0
    assert row["one_call_floor_step_ms"]["n"] == 3  # the step timed again, in turns with the one-call floor
    assert row["one_call_floor_calls"] == 1  # w / r = 64 in both branches: one dense call


def test_the_floors_run_the_kernel_the_step_ran(monkeypatch):
    """``auto`` resolves per shape class and the floors' calls have other shapes than the step's
    inputs: both floors are given the kernel the step ran, and the row names it."""
    from dilated.bench.problems import DilatedAttention

    given = []
    for name in ("kernel_floor", "one_call_floor"):
        real = getattr(DilatedAttention, name)
        monkeypatch.setattr(DilatedAttention, name, lambda self, inputs, case, backend, real=real: (
            given.append(backend), real(self, inputs, case, backend))[1])
    case = Case(batch=1, seq_len=256, num_heads=4, head_dim=16, dtype="float32", mode="fwd",
                segment_lengths=(64, 256), dilation_rates=(1, 4))
    row = run_sweep([(IMPLEMENTATIONS["improved"], case, "auto")], RunOptions(warmup=1, reps=2, floor=True,
                                                                             device="cpu"), None, "t",
                    progress=False)[0]
    assert row["status"] == "ok" and len(row["kernels"]) == 1 and row["kernels"][0] != "auto"
    assert given == [row["kernels"][0]] * 2 and row["floor_kernel"] == row["kernels"][0]


def test_the_kernel_floor_makes_the_steps_kernel_calls(monkeypatch):
    """A kernel that reads strided rows gets a plan of more, smaller calls in place: the kernel
    floor makes the same calls as the step (of the same shapes), not those of the gathered plan."""
    import dilated
    from dilated.backends.manual import ManualBackend
    from dilated.bench.floor import kernel_floor_step

    shapes = []
    real = ManualBackend.forward
    monkeypatch.setattr(ManualBackend, "reads_strided_rows", lambda self, q, k, causal: True)
    monkeypatch.setattr(ManualBackend, "forward", lambda self, q, k, v, c, s: (
        shapes.append(tuple(q.shape)), real(self, q, k, v, c, s))[1])
    segs, dils = (32, 64, 128), (1, 2, 4)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 128, 4, 8, generator=gen) for _ in range(3))
    with torch.no_grad():
        dilated.ImprovedDilatedAttention(segs, dils, backend="manual")(q, k, v)
    step_calls = sorted(shapes)
    shapes.clear()
    kernel_floor_step(q, k, v, segs, dils, False, "manual", "fwd")()
    assert sorted(shapes) == step_calls and len(step_calls) > len(segs)


def test_the_kernel_floor_is_freed_before_the_one_call_floor_is_made(monkeypatch):
    """At long lengths the step and both floors' tensors do not fit together: the kernel floor's
    tensors are gone when the one-call floor's are made."""
    import weakref

    from dilated.bench.problems import DilatedAttention

    alive = []
    make_kernel_floor, make_one_call = DilatedAttention.kernel_floor, DilatedAttention.one_call_floor

    def kernel_floor(self, *a):
        step = make_kernel_floor(self, *a)
        alive.append(weakref.ref(step))
        return step

    def one_call_floor(self, *a):
        assert alive and alive[-1]() is None, "the kernel floor is still held"
        return make_one_call(self, *a)

    monkeypatch.setattr(DilatedAttention, "kernel_floor", kernel_floor)
    monkeypatch.setattr(DilatedAttention, "one_call_floor", one_call_floor)
    case = Case(batch=1, seq_len=256, num_heads=4, head_dim=16, dtype="float32", mode="fwd",
                segment_lengths=(64, 256), dilation_rates=(1, 4))
    row = run_sweep([(IMPLEMENTATIONS["improved"], case, "auto")], RunOptions(warmup=1, reps=2, floor=True, device="cpu"),
                    None, "t", progress=False)[0]
    assert row["status"] == "ok" and row["one_call_floor_ms"]["n"] == 2, row.get("error")


@pytest.mark.parametrize("segs, dils, calls", [((64, 256), (1, 4), 1), ((64, 256), (1, 2), 2),
                                               ((2048, 4096, 8192), (1, 2, 4), 1), ((40, 100), (1, 3), 3)])
def test_one_call_floor_covers_exactly_the_attended_pairs(segs, dils, calls):
    """The one-call floor runs the plan's rows, heads folded into the batch: its pairs are the
    dilated pairs counted independently (flops.dilated_pairs), in as few calls as row counts."""
    from dilated.bench.flops import dilated_pairs
    from dilated.bench.floor import one_call_floor_step

    n, h = max(segs) * 2 if max(segs) < 1000 else max(segs), 4
    q, k = torch.randn(1, n, h, 8), torch.randn(1, n, h // 2, 8)
    step, shapes = one_call_floor_step(q, k, k, segs, dils, False, "manual", "fwd")
    step()
    assert len(shapes) == calls
    assert sum(b * rows * rows for b, rows in shapes) == dilated_pairs(n, h, segs, dils)


def test_side_by_side_timing_takes_turns():
    """Steps timed side by side alternate call by call (so that drift falls on each alike)."""
    from dilated.bench.timing import measure_side_by_side

    order = []
    runs = measure_side_by_side([(lambda: order.append("a"), None), (lambda: order.append("b"), lambda: order.append("s"))],
                                "cpu", warmup=1, reps=4)
    assert [len(r) for r in runs] == [4, 4]
    assert order == ["a", "s", "b"] * 5  # one warm-up round, then four timed rounds


def test_settle_pause_and_gpu_state(monkeypatch):
    """--settle-s idles before each row's timed calls; the GPU's state is recorded only where it can be read."""
    from dilated.bench import cli, runner
    from dilated.bench.env import gpu_state

    assert gpu_state("cpu") is None
    p = __import__("argparse").ArgumentParser()
    cli.add_common_args(p)
    assert cli.run_options(cli.parse_with_config(p, ["--settle-s", "0.5"])).settle_s == 0.5
    slept = []
    monkeypatch.setattr(runner.time, "sleep", slept.append)
    case = Case(batch=1, seq_len=128, num_heads=2, head_dim=8, dtype="float32", mode="fwd",
                segment_lengths=(32, 128), dilation_rates=(1, 2))
    row = run_sweep([(IMPLEMENTATIONS["improved"], case, "auto")], RunOptions(warmup=1, reps=3, settle_s=2.0, device="cpu"),
                    None, "t", progress=False)[0]
    assert row["status"] == "ok" and slept == [2.0] and "gpu_state" not in row


def test_warmup_seconds_extend_the_warm_up():
    """--warmup-s: warm-up goes on until that much time has run (steady clocks), then the timed calls."""
    import time

    from dilated.bench.timing import measure

    calls = []  # when each call began
    samples = measure(lambda: (calls.append(time.perf_counter()), time.sleep(0.005)), "cpu", warmup=1, reps=3,
                      warmup_s=0.05)
    # warm-up went on past its 1 call until 50 ms had run, then the 3 timed calls (by the calls' start
    # times, not by how many a loaded machine fits in that time)
    assert len(samples) == 3 and len(calls) > 1 + 3 and calls[-3] - calls[0] >= 0.045, calls


def test_no_timed_call_builds_a_cudnn_graph(monkeypatch):
    """On a GPU, warm-up runs at least up to the call at which a shape's cuDNN graph is built
    (its second by default), whatever --warmup asks; floors timed in turns with a step start cold."""
    from dilated.bench.runner import warmup_calls

    monkeypatch.setenv("DILATED_CUDNN_BUILD_AFTER", "2")  # the default (the tests build at once)
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert warmup_calls(gpu, 1, 1) == 1 and warmup_calls(gpu, 0, 1) == 1 and warmup_calls(gpu, 1, 0) == 2
    assert warmup_calls(gpu, 3, 2) == 1 and warmup_calls(gpu, 3, 0) == 3
    assert warmup_calls(cpu, 1, 1) == 0 and warmup_calls(cpu, 1, 0) == 1 and warmup_calls(cpu, 0, 0) == 0
    monkeypatch.setenv("DILATED_CUDNN_BUILD_AFTER", "3")
    assert warmup_calls(gpu, 1, 1) == 2 and warmup_calls(gpu, 5, 2) == 3


def test_floors_timed_in_turns_are_warmed_up(monkeypatch):
    """A floor timed in turns with the step has run no call before: it gets the warm-up the step
    got (--warmup calls), so its first call is not a timed one."""
    from dilated.bench.problems import DilatedAttention

    calls = {"kernel_floor": 0, "one_call_floor": 0}
    for name in calls:
        real = getattr(DilatedAttention, name)

        def counted(self, inputs, case, backend, real=real, name=name):
            made = real(self, inputs, case, backend)
            step = made[0] if isinstance(made, tuple) else made

            def call():
                calls[name] += 1
                return step()
            return (call, *made[1:]) if isinstance(made, tuple) else call
        monkeypatch.setattr(DilatedAttention, name, counted)
    case = Case(batch=1, seq_len=256, num_heads=4, head_dim=16, dtype="float32", mode="fwd",
                segment_lengths=(64, 256), dilation_rates=(1, 4))
    row = run_sweep([(IMPLEMENTATIONS["improved"], case, "auto")], RunOptions(warmup=2, reps=3, floor=True,
                                                                             device="cpu"), None, "t",
                    progress=False)[0]
    assert row["status"] == "ok" and row["kernel_floor_ms"]["n"] == 3 and row["one_call_floor_ms"]["n"] == 3
    assert calls == {"kernel_floor": 2 + 3, "one_call_floor": 2 + 3}


def test_rep_seconds_extend_the_timed_calls_and_repeats_are_reported():
    """--rep-s: timed calls go on until that much time has run; a config timed twice in one run is
    reported with how far apart its medians are, flagged beyond 2%."""
    import time

    from dilated.bench.report import format_repeats
    from dilated.bench.timing import measure

    samples = measure(lambda: time.sleep(0.005), "cpu", warmup=1, reps=3, rep_s=0.05, flush_l2=False)
    # past the 3 reps until 50 ms of timed calls had run (counted by the calls' own times, not by how
    # many a loaded machine fits in that wall time)
    assert len(samples) > 3 and sum(samples) >= 45, samples
    row = {"status": "ok", "implementation": "improved", "backend": "auto",
           "config": {"batch": 1, "seq_len": 64, "num_heads": 2, "head_dim": 8, "dtype": "float32",
                      "causal": False, "mode": "fwd"}}
    rows = [dict(row, time_ms={"median": m}) for m in (1.0, 1.01)]
    assert "1.0% apart" in "\n".join(format_repeats(rows)) and "BEYOND" not in "\n".join(format_repeats(rows))
    assert "BEYOND 2%" in "\n".join(format_repeats(rows + [dict(row, time_ms={"median": 1.05})]))
    assert format_repeats(rows[:1]) == []


def test_plot_lines_are_one_configuration_each():
    from dilated.bench.plots import scaling_efficiency, series_of

    def row(n, q_len=None, d=64, status="ok"):
        return {"implementation": "dense", "backend": "sdpa", "mode": "fwd", "status": status,
                "config": Case(batch=1, seq_len=n, num_heads=2, head_dim=d, q_len=q_len).config()}

    rows = [row(n, q, d) for n in (256, 512) for q in (None, 1) for d in (64, 128)] + [row(1024, status="oom")]
    series = series_of(rows)
    assert len(series) == 4  # prefill and decode, two head dims: never joined into one line
    assert all(len({(r["config"]["q_len"], r["config"]["head_dim"]) for r in s}) == 1 for s in series.values())
    assert any(r["status"] == "oom" for s in series.values() for r in s)
    assert set(series_of([row(256), row(512)])) == {"dense/sdpa"}  # nothing varies: the plain name
    weak = {"scaling": "weak", "efficiency": 0.25, "work_efficiency": 0.97}
    assert scaling_efficiency(weak) == 0.97 and scaling_efficiency(dict(weak, scaling="strong")) == 0.25


def test_winners_per_scenario_never_a_row_that_failed_its_check():
    from dilated.bench.report import format_tables

    def row(impl, ms, q_len=None, failed=False, n=256):
        return {"implementation": impl, "backend": "b", "mode": "fwd", "status": "ok", "check": {"passed": not failed},
                "time_ms": {"median": ms, "p10": ms, "p90": ms},
                "config": Case(batch=1, seq_len=n, num_heads=2, head_dim=8, q_len=q_len).config()}

    rows = [row("fast_but_wrong", 1.0, failed=True), row("a", 2.0), row("b", 3.0),
            row("a", 2.0, n=512), row("b", 2.5, n=512), row("a", 4.0, q_len=1), row("b", 1.0, q_len=1)]
    text = format_tables(rows)
    assert "prefill fwd      a/b" in text and "fastest in 2 of 2 configuration(s), 1.38x the runner-up" in text
    assert "decode  fwd      b/b" in text and "fastest in 1 of 1" in text
    assert "*fast_but_wrong" not in text and "*a" in text


def test_dense_rows_say_what_the_score_matrix_would_take():
    case = Case(batch=2, seq_len=64, num_heads=4, head_dim=8, dtype="float32")
    row = run_sweep([(IMPLEMENTATIONS["dense"], case, "manual")], RunOptions(reps=2, warmup=1), None, "t",
                    progress=False)[0]
    assert row["memory"]["score_matrix_mib"] == 2 * 4 * 64 * 64 * 4 / (1 << 20)


def test_a_new_problem_is_a_class_the_harness_asks_not_a_branch():
    """A problem of its own (sliding-window attention here) makes its inputs, counts its FLOPs and
    checks against its own reference; a dense attention registered as that problem fails its check."""
    from dilated.bench.problems import DenseAttention
    from dilated.reference import dense_reference

    window = 4

    class SlidingWindow(DenseAttention):
        name = "sliding_window_for_test"

        def flops(self, case, mode):
            return 4.0 * case.batch * case.num_heads * case.nq * window * case.head_dim

        def reference(self, case, inputs, model, dtype=torch.float64):
            q, k, v = (t.to(dtype) for t in inputs)
            i = torch.arange(case.seq_len)
            bias = torch.where((i[:, None] - i[None, :]).abs() < window, 0.0, float("-inf")).to(dtype)
            return dense_reference(q, k, v, bias=bias, dtype=dtype)[0]

    def windowed(case, backend):
        i = torch.arange(case.seq_len)
        allowed = (i[:, None] - i[None, :]).abs() < window
        return lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=allowed).transpose(1, 2)

    problem = SlidingWindow()
    right = register_implementation(Implementation("window_for_test", problem, windowed))
    wrong = register_implementation(Implementation("window_as_dense_for_test", problem,
                                                   IMPLEMENTATIONS["dense"].build))
    try:
        case = Case(batch=1, seq_len=32, num_heads=2, head_dim=8, dtype="float32", mode="fwd_bwd")
        opts = RunOptions(reps=2, warmup=1, device="cpu")
        rows = run_sweep([(right, case, "manual"), (wrong, case, "manual")], opts, None, "test", progress=False)
        assert [r["check"]["passed"] for r in rows] == [True, False]
        assert rows[0]["flops"] == 4.0 * 2 * 32 * window * 8
        assert rows[0]["memory"]["score_matrix_mib"] == pytest.approx(2 * 32 * 32 * 4 / (1 << 20))
    finally:
        del IMPLEMENTATIONS["window_for_test"], IMPLEMENTATIONS["window_as_dense_for_test"]


def test_an_unknown_problem_name_is_refused():
    with pytest.raises(ValueError, match="unknown problem 'sparse'.*dense, dilated, dilated_residue_major, module"):
        Implementation("x", "sparse", lambda c, b: None)


def test_a_run_on_cpu_and_gpu_reports_the_gpu_speed_up_per_configuration():
    from dilated.bench.report import format_tables

    def row(impl, device, ms, host="h", failed=False):
        return {"implementation": impl, "backend": "auto", "mode": "fwd", "status": "ok", "device": device,
                "check": {"passed": not failed}, "env": {"hostname": host}, "time_ms": {"median": ms, "p10": ms, "p90": ms},
                "config": Case(batch=1, seq_len=256, num_heads=2, head_dim=8, dtype="float32").config()}

    rows = [row("a", "cpu", 50.0), row("b", "cpu", 80.0), row("a", "cuda:0", 2.0), row("b", "cuda:0", 4.0),
            row("c", "cpu", 9.0), row("c", "cuda:0", 1.0, host="other"),  # another host: no pair
            row("d", "cpu", 9.0), row("d", "cuda:0", 1.0, failed=True)]   # a failed check: no pair
    text = format_tables(rows)
    assert "GPU over CPU" in text
    assert "cpu 50.000 ms, cuda 2.000 ms: 25.0x" in text and "cpu 80.000 ms, cuda 4.000 ms: 20.0x" in text
    assert "c/auto" not in text.split("GPU over CPU")[1] and "d/auto" not in text.split("GPU over CPU")[1]
    assert "non-causal fwd on cpu" in text and "non-causal fwd on cuda" in text  # one table per device
    assert "prefill fwd cpu" in text and "prefill fwd cuda" in text  # the fastest per device
    assert "timed more than once" not in text  # a CPU and a GPU row are not repeats


@pytest.mark.parametrize("devices, says", [("cpu,cpu:0", "one device named twice"),
                                            ("cpu,cuda:7", "no such CUDA device"), ("cpu,tpu", "not a device")])
def test_several_devices_are_checked_before_any_work(devices, says, tmp_path):
    from dilated.bench.suites import implementations_main

    out = tmp_path / "r.jsonl"
    code, err = usage_error(implementations_main, ["--quick", "--device", devices, "--output", str(out)])
    assert code == 2 and says in err and not out.exists()


def test_varied_lengths_scenario_reports_each_first_call(tmp_path):
    out = tmp_path / "r.jsonl"
    run = subprocess.run([sys.executable, "benchmarks/core/benchmark_implementations.py", "--varied-lengths", "--quick",
                          "--warmup", "2", "--implementations", "improved", "--output", str(out)], capture_output=True,
                         text=True, cwd=ROOT, env=cpu_only_env())
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["config"]["seq_len"] for r in rows] == [500, 600, 700, 1000]
    # one module at every length (a schedule per length would time new schedules, not new lengths)
    assert len({(tuple(r["config"]["segment_lengths"]), tuple(r["config"]["dilation_rates"])) for r in rows}) == 1
    assert rows[0]["check"]["passed"] and rows[0]["config"]["segment_lengths"][-1] > 500  # segments longer than N
    assert all(r["first_call_ms"] > 0 and r["second_call_ms"] > 0 and r["kernels"] and r["second_call_kernels"]
               for r in rows)
    table = run.stdout.split("first and second call at each new length")[1]
    for r in rows:  # each row's line holds its first and second call
        line = next(x for x in table.splitlines() if f" {r['config']['seq_len']} " in x)
        assert f"{r['first_call_ms']:.3f}" in line and f"{r['second_call_ms']:.3f}" in line


def test_nonfinite_entries_are_counted_across_chunks():
    from dilated.bench.runner import _nonfinite

    x = torch.randn(10, 100)
    x[0, 3], x[9, 99], x[5, 50] = float("nan"), float("inf"), float("-inf")
    assert _nonfinite(x, chunk=64) == 3 and _nonfinite(x.t(), chunk=7) == 3 and _nonfinite(x[:, :50]) == 1


def test_a_row_says_whether_it_was_timed_as_cuda_graph_replays():
    """--cuda-graph where a row cannot be replayed: timed eagerly, and the row says so and why."""
    case = Case(batch=1, seq_len=64, num_heads=2, head_dim=8, dtype="float32", mode="fwd_bwd",
                segment_lengths=(32, 64), dilation_rates=(1, 2))
    row = run_sweep([(IMPLEMENTATIONS["improved"], case, "manual")], RunOptions(warmup=1, reps=2, cuda_graph=True,
                                                                               device="cpu"), None, "t",
                    progress=False)[0]
    assert row["status"] == "ok" and row["cuda_graph"] is False
    assert "CUDA graphs need a CUDA device" in row["time_note"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["fwd", "fwd_bwd", "bwd"])
def test_gpu_cuda_graph_rows(mode):
    """fwd and fwd_bwd rows (and their floors) are timed as replays and pass their check; a bwd
    row, whose forward is an untimed setup, is timed eagerly and says so."""
    case = Case(batch=1, seq_len=4096, num_heads=4, head_dim=64, dtype="bfloat16", mode=mode,
                segment_lengths=(1024, 2048, 4096), dilation_rates=(1, 2, 4))
    row = run_sweep([(IMPLEMENTATIONS["improved"], case, "auto")], RunOptions(warmup=2, reps=3, cuda_graph=True,
                                                                             floor=True), None, "t",
                    progress=False)[0]
    assert row["status"] == "ok" and row["check"]["passed"], row
    assert row["cuda_graph"] is (mode != "bwd")
    if mode == "bwd":
        assert "untimed setup" in row["time_note"]
    else:
        assert row["floor_ratio"] > 0 and row["one_call_floor_ratio"] > 0


@pytest.mark.parametrize("name,documents", [("improved", None), ("dense", "fixed:10")])
def test_long_rows_check_the_query_gradients_of_sampled_rows(name, documents, monkeypatch):
    """Past the float64 reference's size the check streams sampled rows, and in fwd_bwd rows their
    dq (a query's gradient depends on its own row only): a step whose dq is wrong fails its check."""
    from dilated.bench import runner

    class WrongDq(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q):
            return q.view_as(q)

        @staticmethod
        def backward(ctx, g):
            return g * 1.5

    base = IMPLEMENTATIONS[name]

    def wrong_build(case, backend):
        step = base.build(case, backend)
        return lambda q, k, v, *rest: step(WrongDq.apply(q), k, v, *rest)

    wrong = register_implementation(Implementation(f"{name}_wrong_dq_for_test", base.problem, wrong_build))
    monkeypatch.setattr(runner, "DENSE_REFERENCE_LIMIT", 0)
    kw = dict(segment_lengths=(16, 32), dilation_rates=(1, 2)) if name == "improved" else dict(documents=documents)
    try:
        case = Case(batch=1, seq_len=32, num_heads=4, num_kv_heads=2, head_dim=8, dtype="float32", mode="fwd_bwd",
                    causal=True, **kw)
        rows = run_sweep([(base, case, "manual"), (wrong, case, "manual")], RunOptions(reps=2, warmup=1, device="cpu"),
                         None, "t", progress=False)
    finally:
        del IMPLEMENTATIONS[f"{name}_wrong_dq_for_test"]
    right_row, wrong_row = (r["check"] for r in rows)
    assert "sampled rows" in right_row["reference"] and "dq of the sampled rows" in right_row["grad_check"]
    assert right_row["passed"] and right_row["grad_rel_err"] < 1e-4
    assert not wrong_row["passed"] and wrong_row["grad_rel_err"] > 0.1


@pytest.mark.parametrize("sampled", [False, True])
def test_residue_major_rows_are_checked_in_their_order(sampled, monkeypatch):
    """The residue-major implementation's rows are checked against the float64 definition in its
    order (the full reference, or sampled rows with their dq), and report the one-call floor; a
    step that ran the natural order on those inputs fails its check."""
    from dilated.bench import runner

    if sampled:
        monkeypatch.setattr(runner, "DENSE_REFERENCE_LIMIT", 0)
    base = IMPLEMENTATIONS["improved_residue_major"]
    natural = register_implementation(Implementation("natural_order_for_test", base.problem,
                                                     IMPLEMENTATIONS["improved"].build))
    try:
        case = Case(batch=1, seq_len=256, num_heads=4, num_kv_heads=2, head_dim=8, dtype="float32",
                    mode="fwd_bwd", segment_lengths=(32, 64, 128), dilation_rates=(1, 2, 4))
        rows = run_sweep([(base, case, "manual"), (natural, case, "manual")],
                         RunOptions(reps=2, warmup=1, floor=True, device="cpu"), None, "t", progress=False)
    finally:
        del IMPLEMENTATIONS["natural_order_for_test"]
    right, wrong = rows
    assert right["status"] == "ok" and right["check"]["passed"] and right["check"]["rel_err"] < 1e-5
    assert ("sampled rows" in right["check"]["reference"]) == sampled
    if sampled:
        assert right["check"]["grad_rel_err"] < 1e-5
    assert right["kernels"] == ["manual"] and right["one_call_floor_ratio"] > 0 and "floor_ratio" not in right
    assert not wrong["check"]["passed"]


def test_trace_summary_tells_a_ranks_wait_from_its_work(tmp_path):
    """benchmarks/specialized/trace_summary.py on two written traces: rank 0's compute stream idles
    3 ms while its NCCL kernel runs 3 ms, then 1 ms of which 0.61 ms before the host had launched the
    next kernel; rank 1's index copy takes 2.5 ms more than rank 0's; flash-attn 4's kernel is named
    apart from cuDNN's."""
    import gzip
    import json as _json

    def trace(name, copy_us, nccl_us):
        ev = [{"ph": "X", "cat": "kernel", "name": "cudnn_fwd", "ts": 0, "dur": 1000, "args": {"stream": 7}},
              {"ph": "X", "cat": "kernel", "name": "index_elementwise_kernel", "ts": 1000, "dur": copy_us,
               "args": {"stream": 7}},
              {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_SendRecv", "ts": 1000 + copy_us, "dur": nccl_us,
               "args": {"stream": 17}},
              {"ph": "X", "cat": "kernel", "name": "cudnn_bwd", "ts": 1000 + copy_us + nccl_us, "dur": 1000,
               "args": {"stream": 7, "correlation": 1}},
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 1200, "dur": 10,
               "args": {"correlation": 1}},  # launched long before it ran: waiting for NCCL
              {"ph": "X", "cat": "kernel", "name": "kernel_cutlass_kernel_flash_attncuteflash_fwd_sm90_0",
               "ts": 3000 + copy_us + nccl_us, "dur": 250, "args": {"stream": 7, "correlation": 2}},
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 2600 + copy_us + nccl_us,
               "dur": 10, "args": {"correlation": 2}}]  # launched 0.61 ms after cudnn_bwd ended
        path = tmp_path / name
        with gzip.open(path, "wt") as f:
            _json.dump({"traceEvents": ev}, f)
        return str(path)

    paths = [trace("rank0.json.gz", 500, 3000), trace("rank1.json.gz", 3000, 100)]
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks/specialized/trace_summary.py"), *paths],
                         capture_output=True, text=True, check=True)
    out = res.stdout
    assert "idle 3.00 ms at 1.5 ms: after index_elementwise_kernel | before cudnn_bwd" in out, out
    assert "NCCL at 1.5 ms for 3.00 ms" in out, out
    # rank 0's compute stream: 3 ms waiting for NCCL, then 1 ms before the host had launched the next kernel
    assert "idle 4.00 ms: 0.61 ms of it before the host had launched the next kernel" in out, out
    assert "idle 1.00 ms at 5.5 ms: after cudnn_bwd | before kernel_cutlass_kernel_flash_attncuteflash_fwd_sm " \
           "(launched 0.61 ms late)" in out, out
    assert "attention (cuDNN)" in out and "2.00 ms (   2)" in out, out
    fa4 = next(line for line in out.splitlines() if line.startswith("attention (flash-attn 4)"))
    assert fa4.split()[3:] == ["0.25", "ms", "(", "1)", "0.25", "ms", "(", "1)"], fa4
    row = next(line for line in out.splitlines() if line.startswith("index_elementwise_kernel"))
    assert row.split()[1:] == ["0.50", "ms", "(", "1)", "3.00", "ms", "(", "1)"], row  # rank 0, rank 1


def test_the_harness_gives_the_library_its_documents_on_the_host():
    """The timed calls pass ``cu_seqlens`` as a CPU tensor, as the library asks (it reads the lengths
    on the host; a GPU tensor's read waits for the GPU in every call): whatever device q is on (meta
    here, standing in for CUDA), the single-GPU baseline and the sequence-parallel wrapper both."""
    import dilated
    from dilated.bench import registry
    from dilated.bench.workload import WithDocuments

    seen = []

    class Record(torch.nn.Module):
        def forward(self, q, k, v, cu_seqlens=None):
            seen.append(cu_seqlens)
            return q

    q = torch.empty(1, 64, 2, 8, device="meta")
    WithDocuments(Record(), "fixed:16", 64)(q, q, q)
    case = types.SimpleNamespace(causal=True, documents="fixed:16", seq_len=64)
    real = dilated.attention
    try:
        dilated.attention = lambda q, k, v, **kw: seen.append(kw["cu_seqlens"]) or q
        registry._dense(case, "manual")(q, q, q)
    finally:
        dilated.attention = real
    assert len(seen) == 2
    for cu in seen:
        assert cu.device.type == "cpu" and cu.dtype == torch.int32 and cu.tolist() == [0, 16, 32, 48, 64]


def test_rows_record_the_variables_that_set_communication_and_kernel_calls(monkeypatch):
    from dilated.bench import env

    monkeypatch.setenv("TORCH_NCCL_HIGH_PRIORITY", "1")
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    monkeypatch.setenv("DILATED_BUCKETS_PER_OCTAVE", "16")
    env.environment.cache_clear()
    try:
        recorded = env.environment()["variables"]
    finally:
        env.environment.cache_clear()
    assert recorded["TORCH_NCCL_HIGH_PRIORITY"] == "1" and recorded["CUDA_DEVICE_MAX_CONNECTIONS"] is None
    assert recorded["DILATED_BUCKETS_PER_OCTAVE"] == "16"
    assert set(recorded) == set(env.RECORDED_VARIABLES)


def test_time_layout_ranks_runs_every_ranks_local_and_crossing_calls(monkeypatch, capsys):
    """benchmarks/specialized/time_layout_ranks.py through flash-attn 4's varlen entry point (a CPU
    stand-in that checks every call's cumulative lengths and longest documents): each rank's step is
    its local call and, where it holds crossing pieces, its rectangles call, forward and backward; it
    prints every rank of every weighting, with the rank's causal and rectangle pairs adding up to the
    layout's work."""
    import importlib.util

    import varlen_standins
    from dilated import DocumentLayout
    from dilated.bench.documents import cu_seqlens_of

    spec = importlib.util.spec_from_file_location("time_layout_ranks",
                                                  ROOT / "benchmarks/specialized/time_layout_ranks.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    varlen_standins.install(monkeypatch, "fa4")
    varlen_standins.CALLS.clear()
    docs = "lognormal:64,1.0"
    script.main(["--device", "cpu", "--doc-lengths", docs, "--seq-len", "512", "--world-size", "2",
                 "--head-shapes", "2/1", "--pair-costs", "1/1,12/11", "--reps", "2"])
    out = capsys.readouterr().out
    steps = 0
    for costs in ((1, 1), (12, 11)):
        layout = DocumentLayout.balance(cu_seqlens_of(docs, 512), 2, True, pair_costs=costs)
        for rank in range(2):
            own, before = script._pairs(layout, rank)
            assert own + before == layout.work_per_rank()[rank]
            assert f"pair costs {costs[0]}/{costs[1]} rank {rank}: median" in out, out
            steps += 2 if any(x.doc in layout.crossing() and x.start > x.doc_start
                              for x in layout.pieces_of(rank)) else 1
        assert f"pair costs {costs[0]}/{costs[1]}: slowest rank over the mean" in out
    assert steps > 4  # some rank holds a piece with keys before it on another rank
    # each step: one forward at set-up, then warm-up and timed runs of forward and backward
    runs = varlen_standins.CALLS["fa4_backward"]
    assert runs % steps == 0 and varlen_standins.CALLS["fa4_forward"] == steps + runs, dict(varlen_standins.CALLS)
