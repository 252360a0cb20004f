"""An honest command line: usage errors, exit status, flags that do what they say, results files."""
import contextlib
import io
import json
import os
import resource
import subprocess
import sys
import time

import pytest
import torch
from conftest import cpu_only_env

from dilated.bench import Case, Implementation, RunOptions, read_jsonl, register_implementation, run_sweep
from dilated.bench.registry import IMPLEMENTATIONS
from dilated.bench.results import ResultsWriteError, ResultWriter
from dilated.bench.suites import (backends_main, distributed_main, extreme_main, hopper_main, implementations_main,
                                  ring_main)

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]
MAINS = {"implementations": implementations_main, "backends": backends_main, "extreme": extreme_main,
         "distributed": distributed_main, "ring": ring_main, "hopper": hopper_main}
TINY = ["--no-progress", "--batch-size", "1", "--num-heads", "2", "--head-dim", "8", "--reps", "2", "--warmup", "1"]

USAGE_ERRORS = [
    (["--implementations", "bogus"], "--implementations"),
    (["--backend", "nope"], "--backend"),
    (["--mode", "fwd,sideways"], "--mode"),
    (["--dtype", "float8"], "--dtype"),
    (["--seq-lengths", ""], "--seq-lengths"),
    (["--seq-lengths", "inf"], "--seq-lengths"),
    (["--seq-lengths", "0"], "--seq-lengths"),
    (["--seq-lengths", "-8k"], "--seq-lengths"),
    (["--reps", "0"], "--reps"),
    (["--warmup", "-1"], "--warmup"),
    (["--time-budget", "0"], "--time-budget"),
    (["--time-budget", "-2"], "--time-budget"),
    (["--time-budget", "nan"], "--time-budget"),
    (["--device", "bogus"], "--device"),
    (["--num-heads", "4", "--num-kv-heads", "3"], "--num-kv-heads"),
    (["--segment-lengths", "8,16", "--dilation-rates", "1"], "--dilation-rates"),
]


def _usage_error(main, argv, capsys, tmp_path):
    out = tmp_path / "never.jsonl"
    with pytest.raises(SystemExit) as e:
        main([*argv, "--output", str(out)])
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert not out.exists()
    return err


@pytest.mark.parametrize("argv,option", USAGE_ERRORS)
def test_usage_errors_exit_2_with_one_line_naming_the_option(argv, option, capsys, tmp_path):
    renamed = {"--seq-lengths": "--max-seq-length", "--implementations": "--implementation"}  # the extreme script's
    for name, main in MAINS.items():
        args, opt = argv, option
        if name == "extreme":
            args, opt = [renamed.get(a, a) for a in argv], renamed.get(option, option)
        err = _usage_error(main, args, capsys, tmp_path)
        lines = err.strip().splitlines()
        named = opt.lstrip("-") in lines[0] or (name == "backends" and "segment-lengths" in lines[0])  # refused
        assert len(lines) == 1 and "error:" in lines[0] and named, (name, err)
        assert "Traceback" not in err


def test_usage_errors_in_a_real_process_leave_no_file(tmp_path):
    out = tmp_path / "x.jsonl"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks/core/benchmark_backends.py"), "--seq-lengths", "inf",
                          "--output", str(out)], capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1 and not out.exists()
    assert not (tmp_path / "results").exists()


def test_flags_a_script_cannot_honour_are_refused(capsys, tmp_path):
    assert "min-seq-length" in _usage_error(extreme_main, ["--seq-lengths", "1k"], capsys, tmp_path)
    assert "kernel floor" in _usage_error(distributed_main, ["--floor"], capsys, tmp_path)
    assert "schedule" in _usage_error(backends_main, ["--segment-lengths", "64"], capsys, tmp_path)
    assert "one list" in _usage_error(backends_main, ["--backend", "manual", "--backends", "sdpa"], capsys, tmp_path)
    assert "true or false" in _usage_error(hopper_main, ["--causal-modes", "maybe"], capsys, tmp_path)


# -- YAML configs ------------------------------------------------------------------------------

@pytest.mark.parametrize("text,option", [('causal: "false"\n', "causal"), ("causal: 0\n", "causal"),
                                         ('reps: "3"\n', "reps"), ("reps: 0\n", "reps"),
                                         ("seq-lengths: [64, zero]\n", "seq-lengths"),
                                         ("mode: [fwd, up]\n", "mode"), ("dtype: float8\n", "dtype")])
def test_yaml_values_are_checked_like_the_command_line(text, option, capsys, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    err = _usage_error(implementations_main, ["--config", str(cfg)], capsys, tmp_path)
    assert option in err and len(err.strip().splitlines()) == 1


def test_the_command_line_wins_over_the_file_abbreviated_or_not(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("seq-lengths: [128]\ncausal: true\nimplementations: [dense]\nbackend: [manual]\nmode: [fwd]\n")
    for flag in ("--seq-lengths", "--seq-len", "--seq-lengths=64"):
        out = tmp_path / f"r{len(flag)}{flag[-1]}.jsonl"
        argv = ["--config", str(cfg), *TINY, "--output", str(out)] + ([flag] if "=" in flag else [flag, "64"])
        assert implementations_main(argv) == 0
        rows = read_jsonl(str(out))
        assert [r["config"]["seq_len"] for r in rows] == [64] and rows[0]["config"]["causal"] is True


# -- --quick -----------------------------------------------------------------------------------

def test_quick_fills_only_what_the_user_did_not_set(tmp_path):
    out = tmp_path / "q.jsonl"
    assert implementations_main(["--quick", *TINY, "--reps", "4", "--seq-lengths", "64", "--implementations", "dense",
                                 "--backend", "manual", "--output", str(out)]) == 0
    rows = read_jsonl(str(out))
    assert [r["config"]["seq_len"] for r in rows] == [64] and rows[0]["time_ms"]["n"] == 4
    out = tmp_path / "x.jsonl"
    assert extreme_main(["--quick", *TINY, "--implementation", "dense", "--backend", "manual", "--no-plot",
                         "--max-seq-length", "128", "--output", str(out)]) == 0
    assert {r["config"]["seq_len"] for r in read_jsonl(str(out))} == {128}  # quick's min 256 > 128: user's max wins


def test_device_cpu_on_a_gpu_host_gets_the_cpu_defaults(monkeypatch, tmp_path):
    """Lengths, head sizes and the per-row time budget follow --device, not whether CUDA is there."""
    from dilated.bench.cli import runs_on_gpus
    from dilated.bench.suites.extreme import _parse

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert runs_on_gpus([]) and runs_on_gpus(["--device=cuda:0,cuda:1"]) and runs_on_gpus(["--quick"])
    assert not runs_on_gpus(["--device", "cpu"]) and not runs_on_gpus(["--device", "cuda,cpu"])
    cfg = tmp_path / "c.yaml"
    cfg.write_text("device: cpu\n")
    assert not runs_on_gpus(["--config", str(cfg)]) and runs_on_gpus(["--config", str(cfg), "--device", "cuda"])
    for argv in (["--device", "cpu"], ["--config", str(cfg)]):
        args = _parse([*argv, "--no-plot"])
        assert (args.num_heads, args.head_dim, args.max_seq_length, args.time_budget) == (2, 16, 16384, None)
        assert args.default_schedule == ((256, 512, 1024, 2048, 4096), (1, 2, 4, 8, 16))  # LongNet's, w / 8
    args = _parse(["--no-plot"])
    assert (args.num_heads, args.head_dim, args.max_seq_length, args.time_budget) == (16, 128, 1 << 20, 5.0)
    assert not hasattr(args, "default_schedule")  # LongNet's own


def test_quick_turns_off_the_time_based_warm_up_and_repetition_the_user_did_not_set():
    """On a GPU each row warms up and repeats for a second by default: a smoke run skips that."""
    from argparse import Namespace

    from dilated.bench.cli import apply_quick

    args = Namespace(quick=True, given={"rep_s"}, warmup_s=None, rep_s=2.0, reps=10)
    apply_quick(args, reps=3)
    assert (args.warmup_s, args.rep_s, args.reps) == (0.0, 2.0, 3)


# -- flags that are honoured -------------------------------------------------------------------

def test_backends_script_runs_only_the_backend_asked_for(tmp_path):
    out = tmp_path / "b.jsonl"
    assert backends_main(["--quick", *TINY, "--no-compiled", "--backend", "manual", "--output", str(out)]) == 0
    assert {r["backend"] for r in read_jsonl(str(out))} == {"manual"}


def test_hopper_script_runs_only_causal_rows_with_causal(tmp_path):
    out = tmp_path / "h.jsonl"
    assert hopper_main(["--quick", *TINY, "--causal", "--backend", "manual", "--seq-lengths", "64",
                        "--implementations", "dense", "--output", str(out)]) == 0
    rows = read_jsonl(str(out))
    assert rows and all(r["config"]["causal"] for r in rows) and {r["backend"] for r in rows} == {"manual"}


# -- exit status -------------------------------------------------------------------------------

@pytest.fixture
def wrong_implementation():
    """Dense attention whose output is 10% too large: every row must fail its check."""
    def build(case, backend):
        def fn(q, k, v):
            import dilated
            return dilated.attention(q, k, v, causal=case.causal, backend=backend) * 1.1
        return fn

    register_implementation(Implementation("ten_percent_wrong", "dense", build))
    yield "ten_percent_wrong"
    del IMPLEMENTATIONS["ten_percent_wrong"]


def test_a_wrong_kernel_fails_its_check_and_the_run_exits_1(wrong_implementation, tmp_path, capsys):
    out = tmp_path / "w.jsonl"
    status = implementations_main([*TINY, "--seq-lengths", "64", "--implementations", f"dense,{wrong_implementation}",
                                   "--backend", "manual", "--mode", "fwd,fwd_bwd", "--output", str(out)])
    rows = read_jsonl(str(out))
    by = {(r["implementation"], r["mode"]): r for r in rows}
    assert status == 1
    assert "check_failed" not in by[("dense", "fwd")] and by[("dense", "fwd")]["check"]["passed"]
    for mode in ("fwd", "fwd_bwd"):
        r = by[(wrong_implementation, mode)]
        assert not r["check"]["passed"] and r["check"]["rel_err"] > 0.05
    assert f"{wrong_implementation}/manual N=64 fwd: failed its check (rel err" in capsys.readouterr().out


def test_an_error_row_exits_1_oom_and_unsupported_exit_0(tmp_path):
    def build(case, backend):
        def fn(q, k, v):
            raise ValueError("broken on purpose")
        return fn

    register_implementation(Implementation("raises_for_test", "dense", build))
    try:
        assert implementations_main([*TINY, "--seq-lengths", "32", "--implementations", "raises_for_test",
                                     "--backend", "manual", "--output", str(tmp_path / "e.jsonl")]) == 1
    finally:
        del IMPLEMENTATIONS["raises_for_test"]
    # sdpa_cudnn is unsupported on a CPU: a run of only unsupported rows is not a failure
    status = implementations_main([*TINY, "--seq-lengths", "32", "--implementations", "dense", "--backend",
                                   "sdpa_cudnn", "--device", "cpu", "--output", str(tmp_path / "u.jsonl")])
    assert [r["status"] for r in read_jsonl(str(tmp_path / "u.jsonl"))] == ["unsupported"] and status == 0


def test_cpu_allocation_failure_is_an_oom_row():
    def build(case, backend):
        def fn(q, k, v):
            return torch.empty(1 << 50)  # more than any machine: the CPU allocator refuses it
        return fn

    impl = register_implementation(Implementation("huge_for_test", "dense", build))
    try:
        case = Case(batch=1, seq_len=16, num_heads=2, head_dim=8, dtype="float32")
        row = run_sweep([(impl, case, "manual")], RunOptions(reps=2, warmup=1), None, "t", progress=False)[0]
        assert row["status"] == "oom", row
    finally:
        del IMPLEMENTATIONS["huge_for_test"]


def _row_of_calls_taking(seconds: float, opts: RunOptions):
    """A row of an implementation whose every call sleeps ``seconds``: (row, calls made, wall time)."""
    calls = []

    def build(case, backend):
        def fn(q, k, v):
            calls.append(1)
            time.sleep(seconds)
            return q * 1.0
        return fn

    impl = register_implementation(Implementation("sleeps_for_test", "dense", build))
    try:
        case = Case(batch=1, seq_len=8, num_heads=1, head_dim=4, dtype="float32")
        t = time.perf_counter()
        row = run_sweep([(impl, case, "manual")], opts, None, "t", progress=False)[0]
        return row, len(calls), time.perf_counter() - t
    finally:
        del IMPLEMENTATIONS["sleeps_for_test"]


def test_time_budget_bounds_a_row_whose_one_call_is_longer():
    """Calls each longer than the budget: the warm-up calls, then none; the last warm-up call is the sample."""
    row, calls, wall = _row_of_calls_taking(0.4, RunOptions(reps=10, warmup=2, budget_s=0.1, check=False))
    assert wall < 2.0 and calls == 2
    assert row["status"] == "ok" and row["time_ms"]["n"] == 1 and "still exceeded --time-budget" in row["time_note"]
    assert not row["first_call_only"] and row["second_call_ms"] == row["time_ms"]["median"]


def test_time_budget_bounds_a_row_of_calls_shorter_than_it():
    row, calls, wall = _row_of_calls_taking(0.1, RunOptions(reps=50, warmup=10, budget_s=0.35, check=False))
    # the first (probe) call, then warm-up up to a quarter of the budget and timed calls up to all of it;
    # the wall bound leaves room for a loaded machine (without the budget: 60 calls, 6 s)
    assert wall < 2.0 and calls <= 8 and 1 <= row["time_ms"]["n"] <= 5, (calls, wall)


# -- results files -----------------------------------------------------------------------------

def test_an_existing_output_is_refused_unless_append(tmp_path, capsys):
    out = tmp_path / "keep.jsonl"
    out.write_text('{"old": 1}\n')
    with pytest.raises(SystemExit) as e:
        implementations_main([*TINY, "--seq-lengths", "32", "--output", str(out)])
    assert e.value.code == 2 and "exists" in capsys.readouterr().err
    assert out.read_text() == '{"old": 1}\n'
    assert implementations_main([*TINY, "--seq-lengths", "32", "--implementations", "dense", "--backend", "manual",
                                 "--output", str(out), "--append"]) == 0
    lines = out.read_text().splitlines()
    assert lines[0] == '{"old": 1}' and len(lines) == 2


def test_default_result_files_never_collide(tmp_path):
    paths = {ResultWriter.fresh(str(tmp_path), "script").path for _ in range(20)}
    assert len(paths) == 20 and all(os.path.exists(p) for p in paths)


def test_an_unwritable_results_place_fails_before_any_row(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as e:
        implementations_main([*TINY, "--seq-lengths", "32", "--output", str(blocker / "sub" / "r.jsonl")])
    assert e.value.code == 2 and "cannot write results" in capsys.readouterr().err


def test_a_failed_write_leaves_only_whole_rows(tmp_path, monkeypatch):
    writer = ResultWriter(str(tmp_path / "r.jsonl"))
    writer.append({"row": 1})
    real = os.write

    def short(fd, data):  # half the bytes, then the disk is full
        if len(data) > 10:
            real(fd, data[: len(data) // 2])
            raise OSError(28, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(os, "write", short)
    with pytest.raises(ResultsWriteError, match="No space left"):
        writer.append({"row": 2, "pad": "x" * 100})
    monkeypatch.undo()
    assert read_jsonl(writer.path) == [{"row": 1}]


def test_a_file_size_limit_stops_the_run_with_exit_1_and_whole_rows(tmp_path):
    out = tmp_path / "limited.jsonl"

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (6000, 6000))

    res = subprocess.run([sys.executable, str(ROOT / "benchmarks/core/benchmark_implementations.py"), *TINY,
                          "--seq-lengths", "32,64,96,128", "--implementations", "dense", "--backend", "manual",
                          "--output", str(out)], capture_output=True, text=True, cwd=tmp_path, preexec_fn=limit,
                         timeout=300, env=cpu_only_env())
    assert res.returncode == 1 and "could not be written" in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    rows = read_jsonl(str(out))  # every line parses
    assert 0 < len(rows) < 4 and out.read_bytes().endswith(b"\n")


# -- compare -----------------------------------------------------------------------------------

def _rows(path, status="ok", gpu="H200", factor=1.0, lengths=(128, 256), check_failed=False):
    rows = []
    for n in lengths:
        t = {"median": 10.0 * factor, "p10": 9.9 * factor, "p90": 10.1 * factor}
        rows.append({"implementation": "x", "backend": "b", "mode": "fwd", "status": status, "time_ms": t,
                     "config": Case(batch=1, seq_len=n, num_heads=2, head_dim=8).config(),
                     "check": {"passed": not check_failed},
                     "env": {"gpu": gpu, "torch": "2.11"}})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _compare(old, new):
    """``python -m dilated.bench compare OLD NEW --fail-on-regression`` in this process (the module's
    entry point itself runs in tests/bench/test_bench.py): exit code and output."""
    from dilated.bench.__main__ import main

    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
        try:
            code = main(["compare", old, new, "--fail-on-regression"])
        except SystemExit as e:  # a usage error
            code = e.code
    return code, text.getvalue()


def test_compare_exits_1_when_new_cannot_vouch_for_old(tmp_path):
    old = _rows(tmp_path / "old.jsonl")
    assert _compare(old, _rows(tmp_path / "same.jsonl"))[0] == 0
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_text('{"implementation": "x"\n')
    code, text = _compare(old, str(garbage))  # a malformed file is a usage error: one line naming it, exit 2
    assert code == 2 and "garbage.jsonl:1: not a JSON row" in text and len(text.strip().splitlines()) == 1, text
    cases = {"empty": str(empty), "missing": str(tmp_path / "nope.jsonl"),
             "all error": _rows(tmp_path / "err.jsonl", status="error"),
             "check failed": _rows(tmp_path / "bad.jsonl", check_failed=True),
             "no matching rows": _rows(tmp_path / "other.jsonl", lengths=(512,)),
             "duplicates": _rows(tmp_path / "dup.jsonl", lengths=(128, 128, 256))}
    for name, new in cases.items():
        code, text = _compare(old, new)
        assert code == 1 and "NOT VOUCHED" in text, (name, text)


def test_compare_warns_when_the_runs_differ_in_gpu(tmp_path):
    code, text = _compare(_rows(tmp_path / "a.jsonl"), _rows(tmp_path / "b.jsonl", gpu="H100"))
    assert code == 0 and "warning: the runs differ in gpu" in text


# -- correctness reports -----------------------------------------------------------------------

def test_determinism_and_input_scales_are_rows(tmp_path):
    out = tmp_path / "s.jsonl"
    implementations_main([*TINY, "--seq-lengths", "64", "--implementations", "dense,improved", "--backend", "manual",
                          "--mode", "fwd_bwd", "--input-scales", "0.01,1,100", "--check-determinism",
                          "--output", str(out)])
    rows = read_jsonl(str(out))
    assert sorted({r["config"].get("input_scale", 1.0) for r in rows}) == [0.01, 1.0, 100.0]
    for r in rows:
        d = r["determinism"]
        assert d["output_bit_identical"] is True and d["grads_bit_identical"] == [True, True, True]
        assert r["check"]["nonfinite_outputs"] == 0 and "rel_err" in r["check"]


def test_determinism_sees_a_kernel_that_is_not_deterministic(tmp_path):
    calls = []

    def build(case, backend):
        def fn(q, k, v):
            calls.append(1)
            return q * (1.0 + 1e-7 * len(calls))  # a different last bit on every call
        return fn

    impl = register_implementation(Implementation("drifts_for_test", "dense", build))
    try:
        case = Case(batch=1, seq_len=8, num_heads=1, head_dim=4, dtype="float32")
        row = run_sweep([(impl, case, "manual")], RunOptions(reps=2, warmup=1, check=False, check_determinism=True),
                        None, "t", progress=False)[0]
        assert row["determinism"]["output_bit_identical"] is False
    finally:
        del IMPLEMENTATIONS["drifts_for_test"]


def test_non_finite_outputs_are_counted_and_fail_the_check(tmp_path):
    def build(case, backend):
        def fn(q, k, v):
            out = q * 1.0
            out[0, 0, 0, 0] = float("nan")
            return out
        return fn

    impl = register_implementation(Implementation("nan_for_test", "dense", build))
    try:
        case = Case(batch=1, seq_len=8, num_heads=1, head_dim=4, dtype="float32")
        row = run_sweep([(impl, case, "manual")], RunOptions(reps=2, warmup=1), None, "t", progress=False)[0]
        assert row["check"]["nonfinite_outputs"] == 1 and not row["check"]["passed"]
    finally:
        del IMPLEMENTATIONS["nan_for_test"]


def test_float64_rows_run_and_pass(tmp_path):
    out = tmp_path / "f64.jsonl"
    assert implementations_main([*TINY, "--seq-lengths", "64", "--dtype", "float64", "--mode", "fwd,fwd_bwd",
                                 "--implementations", "dense,dilated,improved,multihead", "--output", str(out)]) == 0
    rows = read_jsonl(str(out))
    assert len(rows) == 8 and all(r["status"] == "ok" and r["check"]["rel_err"] < 1e-12 for r in rows)


def test_profile_writes_one_trace_per_row(tmp_path):
    traces = tmp_path / "traces"
    out = tmp_path / "p.jsonl"
    assert implementations_main([*TINY, "--seq-lengths", "32", "--implementations", "dense,improved", "--backend",
                                 "manual", "--causal", "--profile", str(traces), "--output", str(out)]) == 0
    rows = read_jsonl(str(out))
    names = sorted(p.name for p in traces.iterdir())
    assert names == sorted(os.path.basename(r["profile"]) for r in rows) and len(names) == 2
    assert names[0].startswith("dense-manual-N32-fwd-causal")
    for p in traces.iterdir():
        assert "traceEvents" in json.loads(p.read_text())


def test_backends_script_takes_kv_lengths_and_a_value_head_dim(tmp_path):
    out = tmp_path / "kv.jsonl"
    assert backends_main([*TINY, "--no-compiled", "--backend", "manual,sdpa_flash", "--seq-lengths", "32",
                          "--kv-seq-lengths", "32,48", "--head-dim-v", "4", "--causal", "--output", str(out)]) == 0
    rows = read_jsonl(str(out))
    prefill = [r for r in rows if r["config"].get("q_len") != 1]
    assert {(r["config"]["seq_len"], r["config"].get("q_len")) for r in prefill} == {(32, None), (48, 32)}
    for r in rows:
        assert r["config"]["head_dim_v"] == 4
        if r["backend"] == "manual":  # takes v's own head_dim: checked against float64, FLOPs 2*pairs*(d + d_v)
            assert r["status"] == "ok" and r["check"]["passed"]
        else:  # the fused CPU kernel needs equal head dims: says so
            assert r["status"] == "unsupported" and "head_dim" in r["reason"]
    r = next(r for r in prefill if r["backend"] == "manual" and r["config"]["seq_len"] == 48)
    pairs = sum(min(48, i + 17) for i in range(32))  # bottom-right causal: query i sees keys <= i + 16
    assert r["flops"] == 2 * 1 * 2 * pairs * (8 + 4)
