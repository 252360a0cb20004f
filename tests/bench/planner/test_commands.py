import json

import pytest

from dilated.bench.__main__ import main
from dilated.bench.planner.kernel_model import KernelModel
from dilated.bench.planner.network import Network
from dilated.bench.planner.schedules import Model, Problem
from synthetic_calibration import calibration, with_graph_decode


@pytest.fixture
def cal_path(tmp_path):
    path = tmp_path / "cal.json"
    calibration().save(str(path))
    return str(path)


def test_plan_ranks_every_strategy_and_recommends_one(cal_path, capsys, tmp_path):
    out = tmp_path / "plan.json"
    assert main(["plan", "--calibration", cal_path, "--seq-len", "256k", "--gpus-per-node", "4",
                 "--doc-lengths", "lognormal:8k,1.0", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for name in ("ring_zigzag", "ulysses", "documents", "ring_documents", "hybrid 2x2", "hybrid_documents 2x2",
                 "hybrid_documents_row_groups 2x2", "hybrid_documents_row_groups_local 2x2"):
        assert f"\n{name} " in text
    data = json.loads(out.read_text())
    times = [p["time_ms"] for p in data["predictions"] if p["reason"] is None]
    assert times == sorted(times) and data["recommended"] == data["predictions"][0]["strategy"]
    assert "recommended: " + data["recommended"] in text and "assumptions:" in text


def test_plan_across_nodes_needs_their_bandwidth(cal_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--calibration", cal_path, "--nodes", "2"])
    assert e.value.code == 2 and "--inter-node-gbs" in capsys.readouterr().err
    assert main(["plan", "--calibration", cal_path, "--nodes", "8", "--inter-node-gbs", "50"]) == 0
    assert "64 GPUs" in capsys.readouterr().out


def test_plan_for_gpus_in_all_fills_whole_nodes(cal_path, capsys):
    """``--gpus N``: the GPUs in all (not an abbreviation of ``--gpus-per-node``): one node of them, or
    whole nodes of ``--gpus-per-node``, which then need the links between them; a count that leaves a
    node part full, or a ``--nodes`` that disagrees, is a usage error naming both."""
    assert main(["plan", "--calibration", cal_path, "--gpus", "2", "--seq-len", "64k"]) == 0
    out = capsys.readouterr().out
    assert "2 GPUs" in out and "8 GPUs per node" in out
    with pytest.raises(SystemExit) as e:
        main(["plan", "--calibration", cal_path, "--gpus", "64", "--gpus-per-node", "4"])
    assert e.value.code == 2 and "64 GPUs over 16 nodes of 4" in capsys.readouterr().err
    assert main(["plan", "--calibration", cal_path, "--gpus", "64", "--gpus-per-node", "4", "--inter-node-gbs",
                 "50", "--seq-len", "256k"]) == 0
    out = capsys.readouterr().out
    assert "64 GPUs" in out and "4 GPUs per node; between nodes 50 GB/s" in out
    for argv, says in ((["--gpus", "6", "--gpus-per-node", "4"], "give a multiple of it"),
                       (["--gpus", "8", "--gpus-per-node", "4", "--nodes", "3"], "not --nodes 3")):
        with pytest.raises(SystemExit) as e:
            main(["plan", "--calibration", cal_path, *argv])
        assert e.value.code == 2 and says in capsys.readouterr().err


def test_plan_of_a_missing_calibration_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--calibration", str(tmp_path / "none.json")])
    assert e.value.code == 2 and "dilated-bench calibrate" in capsys.readouterr().err


def _row(impl, p, ms, **more):
    cfg = {"batch": 1, "seq_len": 65536, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "q_len": None,
           "dtype": "bfloat16", "causal": True, "mode": "fwd_bwd", "documents": "lognormal:8k,1.0"}
    return {"implementation": impl, "backend": "auto", "status": "ok", "mode": "fwd_bwd", "config": cfg,
            "world_size": p, "role": "baseline" if p == 1 else "distributed", "check": {"passed": True},
            "time_ms": {"median": ms, "p10": ms, "p90": ms}, **more}


def test_validate_sets_each_modelled_row_beside_its_prediction(cal_path, tmp_path, capsys):
    cal = calibration()
    m = Model(KernelModel(cal), Network(cal, 8))
    prob = Problem(65536, 32, 8, 128, causal=True, mode="fwd_bwd", documents="lognormal:8k,1.0")
    right = m.predict("documents", prob, 2).time_ms
    rows = [_row("dense", 1, m.single_device(prob).time_ms), _row("documents", 2, right),
            _row("ulysses", 2, 2 * m.predict("ulysses", prob, 2).time_ms), _row("torch_cp", 2, 1.0),
            _row("ring_zigzag", 2, 1.0, check={"passed": False})]
    path = tmp_path / "run.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["plan", "--calibration", cal_path, "--validate", str(path)]) == 0
    text = capsys.readouterr().out
    lines = {ln.split()[0]: ln for ln in text.splitlines() if ln.split() and ln.split()[0] in ("dense", "documents",
                                                                                             "ulysses")}
    assert " 1.00" in lines["documents"] and "OUTSIDE" not in lines["documents"]
    assert " 0.50" in lines["ulysses"] and "OUTSIDE" in lines["ulysses"]
    assert "2 of 3 modelled rows within 10%" in text
    assert "torch_cp" in text and "not modelled" in text and "check failed" in text


def test_validate_leaves_out_rows_measured_on_other_gpus_or_kernels(cal_path, tmp_path, capsys):
    rows = [_row("dense", 1, 5.0, env={"gpu": "NVIDIA H100 80GB HBM3"}),
            _row("dense", 1, 5.0, backend="sdpa"),
            _row("dense", 1, 5.0, env={"gpu": "Synthetic GPU", "flash_attn_4": "4.0.0b36"})]
    path = tmp_path / "run.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["plan", "--calibration", cal_path, "--validate", str(path)]) == 0
    text = capsys.readouterr().out
    assert "0 of 0 modelled rows" in text
    assert "measured on NVIDIA H100" in text and "backend sdpa" in text and "flash-attn 4 4.0.0b36" in text


def test_a_decode_plan_weighs_splitting_the_cache_over_more_gpus(cal_path, capsys):
    assert main(["plan", "--calibration", cal_path, "--mode", "decode", "--seq-len", "512k", "--gpus-per-node", "4"]) == 0
    text = capsys.readouterr().out
    for p in ("1 GPU ", "2 GPUs", "4 GPUs"):
        assert f"decode over {p}" in text


def test_validate_leaves_out_runs_across_nodes(cal_path, tmp_path, capsys):
    path = tmp_path / "run.jsonl"
    path.write_text(json.dumps(_row("documents", 4, 5.0, env={"gpu": "Synthetic GPU", "gpu_count": 2})) + "\n")
    assert main(["plan", "--calibration", cal_path, "--validate", str(path)]) == 0
    assert "only runs of one node" in capsys.readouterr().out


def test_plan_takes_the_links_between_nodes_from_a_calibration_across_nodes(cal_path, tmp_path, capsys):
    across = tmp_path / "across.json"
    calibration(nodes=2).save(str(across))
    assert main(["plan", "--calibration", cal_path, "--nodes", "2", "--inter-node-calibration", str(across)]) == 0
    assert "measured: " + str(across) in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["plan", "--calibration", cal_path, "--nodes", "2", "--inter-node-calibration", cal_path])
    assert e.value.code == 2 and "two or more nodes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--calibration", cal_path, "--nodes", "2", "--inter-node-calibration", str(across),
              "--inter-node-gbs", "50"])


def test_a_calibration_of_one_gpu_plans_one_gpu_only(tmp_path, capsys):
    path = tmp_path / "one.json"
    calibration(links={}).save(str(path))
    with pytest.raises(SystemExit) as e:
        main(["plan", "--calibration", str(path), "--gpus-per-node", "4"])
    assert e.value.code == 2 and "no link times" in capsys.readouterr().err
    assert main(["plan", "--calibration", str(path), "--gpus-per-node", "1", "--mode", "decode"]) == 0
    assert "decode over 1 GPU " in capsys.readouterr().out


def test_validate_reads_a_decode_row_replayed_from_a_cuda_graph_against_the_steps_timed_so(tmp_path, capsys):
    cal = with_graph_decode(calibration())
    path = tmp_path / "cal.json"
    cal.save(str(path))
    m = Model(KernelModel(cal), Network(cal, 8))
    prob = Problem(1 << 18, 32, 8, 128, causal=False, mode="decode", cuda_graph=True)
    cfg = {"batch": 1, "seq_len": 1 << 18, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "q_len": 1,
           "dtype": "bfloat16", "causal": False, "mode": "decode", "documents": None}
    graphed = m.predict("decode", prob, 2).time_ms
    rows = [{"implementation": "decode", "backend": "auto", "status": "ok", "mode": "decode", "config": cfg,
             "world_size": 2, "cuda_graph": graph, "check": {"passed": True},
             "time_ms": {"median": graphed, "p10": graphed, "p90": graphed}} for graph in (True, False)]
    run = tmp_path / "decode.jsonl"
    run.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["plan", "--calibration", str(path), "--validate", str(run)]) == 0
    text = capsys.readouterr().out
    assert "1 of 2 modelled rows within 10%" in text  # the row called from Python is read against its own steps
    assert main(["plan", "--calibration", str(path), "--mode", "decode", "--seq-len", "256k", "--cuda-graph",
                 "--gpus-per-node", "2"]) == 0
    assert "decode over 2 GPUs" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["plan", "--calibration", str(path), "--cuda-graph"])
    assert e.value.code == 2 and "--mode decode only" in capsys.readouterr().err
