"""Figures derived from rows (winners, speed-ups, fits, efficiencies, comparisons) use only rows that
ran warm and passed their check; a peer runs its backward inside its own context; per-GPU figures
are per GPU; the harness's tools refuse what they cannot read. Each test plants the fault."""
import contextlib
import io
import json
import math
import time

import pytest
import torch
from conftest import usage_error

import dilated
from dilated.bench import Case, Implementation, RunOptions, read_jsonl, register_implementation, run_sweep
from dilated.bench.distributed import _add_scaling, baseline_backends
from dilated.bench.registry import IMPLEMENTATIONS
from dilated.bench.report import compare, format_scaling, format_tables
from dilated.bench.results import ResultWriter, check_passed, first_call_only, trusted

CASE = Case(batch=1, seq_len=32, num_heads=2, head_dim=8, dtype="float32")


@contextlib.contextmanager
def registered(*impls):
    try:
        yield [register_implementation(i) for i in impls]
    finally:
        for i in impls:
            IMPLEMENTATIONS.pop(i.name)


def _slow_first_call(seconds):
    """Dense attention whose first call in the process sleeps ``seconds`` (a compile)."""
    calls = []

    def build(case, backend):
        inner = IMPLEMENTATIONS["dense"].build(case, backend)

        def model(q, k, v):
            if not calls:
                time.sleep(seconds)
            calls.append(1)
            return inner(q, k, v)
        return model
    return build


# -- first calls ---------------------------------------------------------------------------------
def test_a_first_call_over_the_budget_is_followed_by_warm_calls():
    """A compile longer than --time-budget does not leave the row with its first call as one sample."""
    cold = Implementation("compiles_for_test", "dense", _slow_first_call(0.3))
    with registered(cold) as (impl,):
        row, = run_sweep([(impl, CASE, "manual")], RunOptions(warmup=3, reps=5, budget_s=0.1, device="cpu"), None,
                         "t", progress=False)
    assert row["first_call_ms"] >= 300 and row["second_call_ms"] < 300
    assert not row["first_call_only"] and row["time_ms"]["n"] > 1 and row["time_ms"]["median"] < 300
    assert trusted(row)


def test_a_row_timed_by_its_first_call_only_is_marked_and_derives_nothing():
    cold = Implementation("compiles_for_test", "dense", _slow_first_call(0.3))
    with registered(cold) as (impl,):
        opts = RunOptions(warmup=1, reps=5, budget_s=0.1, device="cpu")  # no warm-up call: the first is all
        rows = run_sweep([(impl, CASE, "manual"), (IMPLEMENTATIONS["dense"], CASE, "manual")], opts, None, "t",
                         progress=False)
    slow, warm = rows
    assert slow["first_call_only"] and slow["time_ms"]["n"] == 1 and slow["time_ms"]["median"] >= 300
    assert not warm["first_call_only"] and warm["time_ms"]["n"] > 1
    assert not trusted(slow) and trusted(warm)
    text = format_tables(rows, baseline="compiles_for_test")
    line = next(x for x in text.splitlines() if "compiles_for_test" in x and "manual" in x)
    assert "first call only" in line and not line.startswith("*")  # never the fastest
    assert "vs base" in text and "1.00x" not in text  # no speed-up against a first call
    # the winners are computed without it: one usable row left, so no scenario to rank
    assert "fastest per scenario" not in text


def test_a_first_call_only_row_is_left_out_of_the_extreme_fit(tmp_path, capsys):
    """The main job's exponent is fitted to warm rows only; the first call is named as left out."""
    from dilated.bench.suites.extreme import extreme_main

    cold = Implementation("compiles_for_test", "dense", _slow_first_call(0.5))
    out = tmp_path / "x.jsonl"
    with registered(cold):
        extreme_main(["--implementation", "compiles_for_test", "--min-seq-length", "64", "--max-seq-length", "256",
                      "--time-budget", "0.2", "--warmup", "1", "--device", "cpu", "--no-plot", "--no-progress",
                      "--output", str(out),
                      "--backend", "manual"])
    text = capsys.readouterr().out
    rows = read_jsonl(str(out))
    assert [r["first_call_only"] for r in rows] == [True, False, False]  # the process's first call only
    assert "left out: N=64 (first call only)" in text
    ns = [r["config"]["seq_len"] for r in rows[1:]]
    from dilated.bench.plots import fit_exponent

    e = fit_exponent(ns, [r["time_ms"]["median"] for r in rows[1:]])
    assert f"N^{e:.2f}" in text  # the printed exponent is the fit of the two warm rows


def test_the_process_warms_every_backend_before_its_first_row():
    from dilated.bench import warmup

    warmup._warmed.clear()
    case = Case(batch=1, seq_len=256, num_heads=2, head_dim=8, dtype="float32", mode="fwd_bwd")
    rows = run_sweep([(IMPLEMENTATIONS["dense"], case, "manual"), (IMPLEMENTATIONS["dense"], case, "sdpa_math")],
                     RunOptions(warmup=1, reps=2, device="cpu"), None, "t", progress=False)
    assert rows[0]["process_warmup"]["configurations"] == 2 and "process_warmup" not in rows[1]
    assert not rows[0]["process_warmup"]["failed"]
    again = run_sweep([(IMPLEMENTATIONS["dense"], case, "manual")], RunOptions(warmup=1, reps=2, device="cpu"),
                      None, "t", progress=False)
    assert "process_warmup" not in again[0]  # once a process


# -- efficiency against the fastest single-device run ----------------------------------------------
def _row(impl, backend, ms, *, p=1, role="distributed", passed=True, first=False, kernels=None, n=1024):
    cfg = Case(batch=1, seq_len=n, num_heads=2, head_dim=8).config()
    flops = 1e12
    return {"implementation": impl, "backend": backend, "mode": "fwd", "status": "ok", "config": cfg,
            "time_ms": {"median": ms, "p10": ms, "p90": ms, "n": 1 if first else 10}, "first_call_only": first,
            "check": {"passed": passed}, "world_size": p, "role": role, "kernels": kernels,
            "tflops": flops / (ms / 1e3) / 1e12, "per_rank_tflops": flops / (ms / 1e3) / 1e12 / p, "device": "cuda:0"}


def test_efficiency_is_against_the_fastest_warm_single_device_run():
    bases = {"k": {}}
    slow = _row("dense", "sdpa", 40.0, role="baseline", kernels=["sdpa_flash"])
    fast = _row("dense", "auto", 10.0, role="baseline", kernels=["sdpa_cudnn"])
    cold = _row("dense", "flex", 5000.0, role="baseline", first=True)  # a compile: never the baseline
    wrong = _row("dense", "bad", 1.0, role="baseline", passed=False)   # fast and wrong: never the baseline
    for r in (slow, fast, cold, wrong):
        _add_scaling(r, "baseline", "k", r["backend"], bases, 1, "strong")
    assert set(bases["k"]) == {"sdpa", "auto"}
    ring = _row("ring", "sdpa", 6.0, p=2, kernels=["sdpa_flash"])
    _add_scaling(ring, "distributed", "k", "sdpa", bases, 2, "strong")
    assert ring["baseline_backend"] == "auto" and ring["baseline_kernels"] == ["sdpa_cudnn"]
    assert ring["efficiency"] == pytest.approx(10.0 / (2 * 6.0))  # not 40 / 12 = 3.3 against the slow one
    assert ring["work_efficiency"] == pytest.approx((1e12 / 6e-3 / 2) / (1e12 / 1e-2))
    assert "efficiency_note" not in ring
    fast_pieces = _row("ulysses", "sdpa", 4.0, p=2, kernels=["sdpa_cudnn"])
    _add_scaling(fast_pieces, "distributed", "k", "sdpa", bases, 2, "strong")
    assert fast_pieces["work_efficiency"] > 1.02 and "outrun the single-device baseline" in fast_pieces["efficiency_note"]
    first = _row("hybrid", "sdpa", 900.0, p=2, first=True)
    _add_scaling(first, "distributed", "k", "sdpa", bases, 2, "strong")
    assert first["efficiency"] is None and first["efficiency_note"] == "this row: first call only"
    table = format_scaling([slow, fast, ring, first], compare=True)
    assert "fastest single-device run of the problem: auto (sdpa_cudnn) 10.000 ms" in table
    assert "efficiency: this row: first call only" in table
    assert baseline_backends(["sdpa"]) == ["sdpa", "auto"] and baseline_backends(["auto", "sdpa"]) == ["auto", "sdpa"]


def test_each_document_mix_gets_its_own_scaling_table_named_by_its_mix():
    """Rows of one problem on several document mixes: a comparison table per mix, each saying which,
    with its own baseline; one implementation's table per mix too."""
    rows = []
    for mix, base_ms in (("lognormal:8k,1.0#1", 10.0), ("lognormal:8k,1.0#2", 20.0)):
        for r in (_row("dense", "auto", base_ms, role="baseline"), _row("ring", "auto", base_ms / 1.5, p=2)):
            r["config"]["documents"] = mix
            r["baseline_backend"], r["baseline_ms"] = "auto", base_ms
            rows.append(r)
    table = format_scaling(rows, compare=True)
    heads = [line for line in table.splitlines() if line.endswith("every implementation")]
    assert [h.split("documents ")[1] for h in heads] == ["lognormal:8k,1.0#1: every implementation",
                                                         "lognormal:8k,1.0#2: every implementation"]
    for block, ms in zip([b.strip() for b in table.split("\n\n")], (10.0, 20.0)):
        assert f"auto {ms:.3f} ms" in block and "; " not in block.splitlines()[2]  # one baseline per table
    per_impl = format_scaling(rows)
    assert per_impl.count("ring (distributed) backend=auto fwd non-causal scaling=None, documents lognormal:8k") == 2


def test_a_baseline_on_auto_that_runs_a_named_backends_kernels_is_not_timed_twice():
    """``auto`` beside the run's backend: where its first two calls ran the kernels that backend's
    baseline ran, its row ends there (``duplicate``, naming which); where they differ, it is timed."""
    from dilated.backends import get_backend
    from dilated.bench.distributed import same_kernels_as

    q = torch.randn(1, 32, 2, 8)
    resolved = get_backend("auto", q, q, False, v=q).name  # what auto runs on this CPU (the fixed order)
    other = next(b for b in ("manual", "sdpa_math") if b != resolved)
    opts = RunOptions(warmup=2, reps=3, device="cpu")
    named, elsewhere = run_sweep([(IMPLEMENTATIONS["dense"], CASE, resolved), (IMPLEMENTATIONS["dense"], CASE, other)],
                                 opts, None, "t", progress=False)
    assert trusted(named) and named["kernels"] and named["kernels"] != elsewhere["kernels"]
    kernels = lambda r: (r["kernels"], r.get("second_call_kernels"))  # noqa: E731
    dup = run_sweep([(IMPLEMENTATIONS["dense"], CASE, "auto")], opts, None, "t", progress=False,
                    same_as=same_kernels_as({resolved: kernels(named), other: kernels(elsewhere)}))[0]
    assert dup["status"] == "duplicate" and f"the kernels of the {resolved} baseline" in dup["reason"]
    assert "time_ms" not in dup and not trusted(dup) and dup["first_call_ms"] > 0
    timed = run_sweep([(IMPLEMENTATIONS["dense"], CASE, "auto")], opts, None, "t", progress=False,
                      same_as=same_kernels_as({other: kernels(elsewhere)}))[0]
    assert timed["status"] == "ok" and timed["time_ms"]["n"] >= 3 and trusted(timed)


def test_per_gpu_figures_are_per_gpu():
    """A row over P ranks: ``tflops`` is the whole problem's rate, ``per_rank_tflops`` one GPU's."""
    class OverFourRanks(Implementation):
        def ranks(self):
            return 4

    impl = OverFourRanks("four_ranks_for_test", "dense", IMPLEMENTATIONS["dense"].build)
    with registered(impl):
        row = run_sweep([(impl, CASE, "manual")], RunOptions(warmup=1, reps=3, device="cpu"), None, "t",
                        progress=False)[0]
    assert row["ranks"] == 4 and row["per_rank_tflops"] == pytest.approx(row["tflops"] / 4)
    flops = 4 * CASE.seq_len * CASE.seq_len * CASE.num_heads * CASE.head_dim  # by hand: 4 N^2 H D
    assert row["tflops"] == pytest.approx(flops / (row["time_ms"]["median"] / 1e3) / 1e12)


# -- a peer whose backward must run inside its context ----------------------------------------------
class _Context:
    """A stand-in of a peer like PyTorch's context parallel: its attention is right only while its
    context is entered, the backward included (outside, the backward scales dq, dk, dv by 1/2)."""

    def __init__(self):
        self.inside = 0

    @contextlib.contextmanager
    def __call__(self):
        self.inside += 1
        try:
            yield
        finally:
            self.inside -= 1


def _context_peer(case, backend):
    ctx = _Context()

    class Halved(torch.autograd.Function):
        @staticmethod
        def forward(_, x):
            return x.view_as(x)

        @staticmethod
        def backward(_, g):
            return g if ctx.inside else g / 2

    class Peer(torch.nn.Module):
        step_context = ctx

        def forward(self, q, k, v):
            if not ctx.inside:
                raise RuntimeError("called outside its context")
            q, k, v = (Halved.apply(t) for t in (q, k, v))
            return dilated.attention(q, k, v, causal=case.causal, backend="manual")

    return Peer()


@pytest.mark.parametrize("mode", ["fwd", "bwd", "fwd_bwd"])
def test_a_peers_backward_runs_inside_its_context(mode):
    peer = Implementation("context_peer_for_test", "dense", _context_peer)
    with registered(peer):
        case = Case(batch=1, seq_len=32, num_heads=2, head_dim=8, dtype="float32", mode=mode, causal=True)
        row = run_sweep([(peer, case, "manual")], RunOptions(warmup=1, reps=2, device="cpu"), None, "t",
                        progress=False)[0]
    assert row["status"] == "ok", row.get("reason")
    assert row["check"]["passed"], row["check"]
    if mode != "fwd":
        assert row["check"]["grad_rel_err"] < 1e-4


def test_torch_cp_refuses_a_forward_outside_its_step_context():
    from dilated.bench.external_ring import TorchContextParallel

    peer = TorchContextParallel.__new__(TorchContextParallel)
    torch.nn.Module.__init__(peer)
    peer.entered, peer.causal, peer.backend = 0, True, "sdpa"
    q = torch.randn(1, 8, 2, 8)
    with pytest.raises(RuntimeError, match="inside its step_context"):
        peer(q, q, q)


# -- the tools ----------------------------------------------------------------------------------
def _write(path, rows, newline=True):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows)[: None if newline else -1])
    return str(path)


def test_compare_tells_world_sizes_and_devices_apart(tmp_path):
    rows = [_row("ring", "auto", 10.0, p=2), _row("ring", "auto", 6.0, p=4),
            dict(_row("dense", "auto", 50.0), device="cpu"), _row("dense", "auto", 2.0)]
    path = _write(tmp_path / "a.jsonl", rows)
    _, problems, _ = compare(path, path)
    assert not problems, problems  # four measurements, each matched with itself
    slower = [dict(r, time_ms={k: v * 1.5 for k, v in r["time_ms"].items()}) if r["world_size"] == 4 else r
              for r in rows]
    _, problems, _ = compare(path, _write(tmp_path / "b.jsonl", slower))
    assert len(problems) == 1 and "P=4" in problems[0] and "1.500x" in problems[0]
    cold = [dict(r, first_call_only=True) if r["world_size"] == 2 else r for r in rows]
    _, problems, _ = compare(path, _write(tmp_path / "c.jsonl", cold))
    assert len(problems) == 1 and "first call only" in problems[0]


def _cli(capsys, *args):
    """``python -m dilated.bench ARGS`` in this process: (exit status, stderr)."""
    from dilated.bench.__main__ import main

    try:
        code = main(list(args))
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("noise", ["nan", "inf", "-0.1"])
def test_compare_refuses_a_min_noise_that_is_no_fraction(tmp_path, capsys, noise):
    path = _write(tmp_path / "a.jsonl", [_row("dense", "auto", 2.0)])
    code, err = _cli(capsys, "compare", path, path, "--min-noise", noise)
    assert code == 2 and "--min-noise" in err and len(err.strip().splitlines()) == 1, err
    with pytest.raises(ValueError, match="--min-noise"):
        compare(path, path, float(noise))


@pytest.mark.parametrize("bad", [{"config": None}, {"time_ms": {"median": "fast"}}, {"status": 3},
                                 {"config": {"batch": 1}}, "a string row"])
def test_compare_and_plot_name_the_line_of_a_malformed_row(tmp_path, capsys, bad):
    good = _row("dense", "auto", 2.0)
    row = bad if isinstance(bad, str) else dict(good, **bad)
    path = _write(tmp_path / "a.jsonl", [good, row])
    for args in (("compare", path, path), ("plot", path)):
        code, err = _cli(capsys, *args)
        assert code == 2 and f"{path}:2: not a result row" in err and len(err.strip().splitlines()) == 1, (args, err)


def test_plot_keeps_cpu_and_gpu_rows_apart():
    from dilated.bench.plots import series_of

    rows = [dict(_row("dense", "auto", 1.0, n=n), device=d) for n in (256, 512) for d in ("cpu", "cuda:0")]
    series = series_of(rows)
    assert set(series) == {"dense/auto on cpu", "dense/auto on cuda"}
    assert all(len(s) == 2 for s in series.values())


def test_append_onto_a_file_without_its_last_newline_keeps_rows_whole(tmp_path):
    first = _row("dense", "auto", 2.0)
    path = _write(tmp_path / "a.jsonl", [first], newline=False)
    w = ResultWriter(path, append=True)
    w.append(_row("dense", "auto", 3.0, n=2048))
    rows = read_jsonl(path)
    assert [r["config"]["seq_len"] for r in rows] == [1024, 2048]
    (tmp_path / "partial.jsonl").write_text(json.dumps(first) + "\n" + json.dumps(first)[:40])
    with pytest.raises(ValueError, match="partial line"):
        ResultWriter(str(tmp_path / "partial.jsonl"), append=True)


def test_one_field_decides_whether_a_row_passed():
    assert check_passed({"check": {"passed": False}}) is False
    assert check_passed({"check": {"passed": True}, "check_failed": True}) is True  # check.passed decides
    assert check_passed({"check_failed": True}) is False  # a file written before: its only field
    assert check_passed({}) is None
    assert first_call_only({"time_note": "... the only sample, not warmed up"}) and not first_call_only({})


@pytest.mark.parametrize("text, why", [("reps: 2.5", "--config .*reps: not a whole number >= 1: 2.5"),
                                        ("reps: null", "reps is null"),
                                        ("warmup: 1.5", "warmup: not a whole number >= 0")])
def test_a_config_file_is_checked_like_the_command_line(tmp_path, text, why):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text + "\n")
    from dilated.bench.suites import backends_main  # benchmarks/core/benchmark_backends.py's main

    code, err = usage_error(backends_main, ["--config", str(cfg), "--device", "cpu", "--output", str(tmp_path / "o.jsonl")])
    assert code == 2 and "Traceback" not in err, err[-1500:]
    assert len(err.strip().splitlines()) == 1
    import re
    assert re.search(why, err), err


@pytest.mark.parametrize("spec", ["uniform:1k-1e30", "fixed:99999999999999999999G", "lognormal:1e300,1"])
def test_doc_lengths_that_overflow_are_one_line(spec):
    from dilated.bench.cli import parse_size
    from dilated.bench.documents import cu_seqlens_of, parse_spec

    with pytest.raises(ValueError, match="--doc-lengths"):
        parse_spec(spec)
    cu = cu_seqlens_of("lognormal:8k,40", 4096)  # a huge sigma: lengths cut at N, never an overflow
    assert cu[0] == 0 and cu[-1] == 4096 and all(b > a for a, b in zip(cu, cu[1:]))
    assert not math.isinf(parse_size("1G"))


# -- mistakes a new user makes: one line naming the option, exit 2 -----------------------------------
@pytest.mark.parametrize("content, why", [
    ({"q": [1, 2], "k": torch.zeros(1, 8, 2, 8), "v": torch.zeros(1, 8, 2, 8)}, "q is a list, not a tensor"),
    ({"q": torch.zeros(1, 8, 3, 8), "k": torch.zeros(1, 8, 2, 8), "v": torch.zeros(1, 8, 2, 8)}, "multiple of k"),
    ({"q": torch.zeros(1, 8, 2, 8), "k": torch.zeros(1, 8, 2, 8), "v": torch.zeros(1, 9, 2, 8)}, "k and v must"),
    ({"q": torch.zeros(1, 8, 2, 8), "k": torch.zeros(1, 8, 2, 4), "v": torch.zeros(1, 8, 2, 4)}, "one head_dim"),
    ({"q": torch.zeros(1, 0, 2, 8), "k": torch.zeros(1, 8, 2, 8), "v": torch.zeros(1, 8, 2, 8)}, "non-empty"),
    ({"x": torch.zeros(1, 8, 6, dtype=torch.int64)}, "floating point"),
    ({"x": torch.zeros(1, 8, 6)}, "not divisible by --num-heads 4"),
    (None, "cannot load"),
])
def test_captured_inputs_that_do_not_fit_are_one_line_and_exit_2(tmp_path, content, why):
    d = tmp_path / "cap"
    d.mkdir()
    if content is None:
        (d / "empty.pt").write_bytes(b"")
    else:
        torch.save(content, d / "c.pt")
    from dilated.bench.suites import implementations_main

    err = io.StringIO()  # benchmarks/core/benchmark_implementations.py's main, in this process
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as stop:
        implementations_main(["--inputs", str(d), "--num-heads", "4", "--implementations", "dense,multihead",
                              "--device", "cpu", "--output", str(tmp_path / "o.jsonl")])
    err = err.getvalue()
    assert stop.value.code == 2 and "--inputs" in err and why in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("call, exc, match", [
    (lambda a: a.to_layout(torch.randn(128)), ValueError, "x must be \\[batch, seq, ...\\]"),
    (lambda a: a.to_layout([1, 2, 3]), TypeError, "x must be a torch.Tensor"),
    (lambda a: a.from_layout(torch.tensor(1.0)), ValueError, "at least 2 dimensions"),
    (lambda a: dilated.residue_major_positions("128", [64, 128], [1, 2]), ValueError, "n must be a positive int"),
    (lambda a: dilated.residue_major_positions(-5, [64, 128], [1, 2]), ValueError, "n must be a positive int"),
])
def test_residue_major_helpers_name_the_argument(call, exc, match):
    attn = dilated.ImprovedDilatedAttention([64, 128], [1, 2], layout="residue_major")
    with pytest.raises(exc, match=match):
        call(attn)


@pytest.mark.parametrize("args, why", [
    (["--segment-lengths", "32,64", "--dilation-rates", "64,2"], "--dilation-rates: rate 64 is above its segment"),
    (["--baseline", "nosuch"], "--baseline 'nosuch'"),
    (["--baseline", "dense/nosuch"], "--baseline 'dense/nosuch'"),
    (["--profile", "/proc/nope"], "--profile /proc/nope: cannot make the directory"),
])
def test_options_that_cannot_be_honoured_are_refused_before_any_work(tmp_path, args, why):
    from dilated.bench.suites import implementations_main

    code, err = usage_error(implementations_main, ["--device", "cpu", "--seq-lengths", "64", "--output",
                                                   str(tmp_path / "o.jsonl"), *args])
    assert code == 2 and why in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o.jsonl").exists()


def test_repeats_speedups_and_first_call_tables_leave_first_calls_out():
    from dilated.bench.report import format_first_calls, format_repeats, format_speedups

    warm = dict(_row("dense", "sdpa_cudnn", 2.0), first_call_ms=50.0)
    again = _row("dense", "sdpa_cudnn", 2.02)
    cold = dict(_row("dense", "sdpa_cudnn", 900.0, first=True), first_call_ms=900.0)
    old_kernel = _row("dense", "sdpa_flash", 3.0)
    cold_new = _row("dense", "flash_attn_4", 0.5, first=True)
    assert "2.000 / 2.020 ms, 1.0% apart" in "\n".join(format_repeats([warm, again, cold]))  # not 45000% apart
    text = format_speedups([warm, old_kernel, cold_new], ["sdpa_cudnn", "flash_attn_4"], ["sdpa_flash"])
    assert "sdpa_cudnn 2.000 ms" in text and "1.50x" in text  # not flash_attn_4's first call at 6.00x
    lines = format_first_calls([warm, cold]).splitlines()
    assert lines[-1].endswith("first call only") and "900.000" in lines[-1] and " 0.000" not in lines[-1]
    assert "48.000" in lines[-2]  # the warm row's first call over its steady median


@pytest.mark.parametrize("call, exc, match", [
    (lambda: dilated.ImprovedDilatedAttention("1024", [1]), TypeError, "segment_lengths must be a list"),
    (lambda: dilated.DilatedAttention([1024], 1), TypeError, "dilation_rates must be a list"),
    (lambda: dilated.available_backends("tpu"), ValueError, "device must name a torch device"),
    (lambda: dilated.attention(*[torch.randn(1, 8, 2, 8)] * 3, return_lse="yes"), TypeError, "return_lse must be"),
])
def test_library_arguments_of_the_wrong_kind_name_the_argument(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
