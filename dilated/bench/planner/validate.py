"""``dilated-bench plan --validate RUN.jsonl``: the model's prediction beside the measured time of every
row of a run it can model (distributed rows, their single-GPU baselines, decode rows), and whether
each is within the tolerance.

Only rows that vouch for a time count: status ok, check passed, timed warm
(:func:`dilated.bench.results.trusted`), on the calibration's GPU, backend and flash-attn 4. A row
the model does not follow (other people's code, dilated attention) is listed with why.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..results import read_results, untrusted_reason
from .schedules import NOT_MODELLED, Model, Prediction, Problem

TOLERANCE = 0.10


@dataclass
class Check:
    row: dict
    prediction: Prediction | None
    measured_ms: float
    skipped: str | None = None

    @property
    def ratio(self) -> float:
        return self.prediction.time_ms / self.measured_ms if self.prediction and self.prediction.supported else math.nan

    @property
    def within(self) -> bool:
        return abs(self.ratio - 1) <= TOLERANCE


def problem_of(row: dict) -> Problem:
    c = row["config"]
    h = c["num_heads"]
    return Problem(seq_len=c["seq_len"], heads=h, kv_heads=c.get("num_kv_heads") or h, head_dim=c["head_dim"],
                   causal=bool(c.get("causal")), mode=c["mode"], batch=c["batch"], documents=c.get("documents"),
                   query_tokens=c.get("q_len") or 1, cuda_graph=c["mode"] == "decode" and bool(row.get("cuda_graph")))


def _grid(row: dict) -> tuple | None:
    if not str(row["implementation"]).startswith("hybrid"):
        return None
    from ..workload import ulysses_size_for

    p = row.get("world_size", 1)
    u = ulysses_size_for(p, row["config"]["num_heads"])
    return None if u is None else (u, p // u)


def unlike(row: dict, calibration) -> str | None:
    """Why ``row`` was measured on something other than what ``calibration`` timed, or None: across
    nodes, on another GPU, another backend, another flash-attn 4 (which ``auto`` takes for documents)."""
    env = row.get("env") or {}
    if isinstance(env.get("gpu_count"), int) and row.get("world_size", 1) > env["gpu_count"]:
        return f"ran on {row['world_size']} ranks of nodes of {env['gpu_count']} GPUs: only runs of one node are validated"
    gpu = env.get("gpu")
    if gpu and gpu != calibration.device:
        return f"measured on {gpu}; the calibration is of {calibration.device}"
    if row.get("backend") != calibration.backend:
        return f"measured on backend {row.get('backend')}; the calibration timed {calibration.backend}"
    fa4, cal_fa4 = env.get("flash_attn_4"), calibration.software.get("flash_attn_4")
    if "env" in row and fa4 != cal_fa4:
        return f"measured with flash-attn 4 {fa4 or 'absent'}; the calibration's {cal_fa4 or 'absent'}"
    return None


def check_rows(model: Model, rows: list[dict]) -> list[Check]:
    out = []
    for row in rows:
        why = untrusted_reason(row)
        measured = (row.get("time_ms") or {}).get("median", math.nan)
        if why:
            out.append(Check(row, None, measured, f"not a trusted time ({why})"))
            continue
        other = unlike(row, model.network.calibration)
        if other:
            out.append(Check(row, None, measured, other))
            continue
        impl, p = row["implementation"], row.get("world_size", 1)
        if row.get("role") == "baseline" or (impl == "dense" and p == 1):
            pred = model.single_device(problem_of(row))
        elif impl in NOT_MODELLED:
            out.append(Check(row, None, measured, NOT_MODELLED[impl]))
            continue
        else:
            pred = model.predict(impl, problem_of(row), p, _grid(row))
        if not pred.supported:
            out.append(Check(row, None, measured, pred.reason))
            continue
        out.append(Check(row, pred, measured))
    return out


def _what(row: dict) -> str:
    c = row["config"]
    hk = c.get("num_kv_heads") or c["num_heads"]
    docs = c.get("documents") or "dense"
    causal = "causal" if c.get("causal") else "full"
    return f"{c['seq_len'] // 1024}K {docs} {causal} {c['mode']} {c['num_heads']}/{hk}/{c['head_dim']} B{c['batch']}"


def _errors(modelled: list[Check]) -> str:
    errs = sorted(abs(c.ratio - 1) for c in modelled)
    return f"median |error| {100 * errs[len(errs) // 2]:.1f}%, largest {100 * errs[-1]:.1f}%"


def _memory_errors(modelled: list[Check]) -> str:
    """The predicted peak memory against the measured one (rows that recorded it)."""
    errs = sorted(abs(c.prediction.memory_gib * 1024 / mem - 1) for c in modelled
                  for mem in [(c.row.get("memory") or {}).get("peak_total_mib")] if mem)
    if not errs:
        return "peak memory: not recorded"
    return (f"peak memory ({len(errs)} rows): median |error| {100 * errs[len(errs) // 2]:.1f}%, largest "
            f"{100 * errs[-1]:.1f}%, within 25%: {sum(e <= 0.25 for e in errs)}")


def format_checks(checks: list[Check], source: str, calibration: str) -> str:
    modelled = [c for c in checks if c.skipped is None]
    width = max([22] + [len(c.row["implementation"]) for c in modelled])
    lines = [f"validation: {source} against the model on {calibration} (within {TOLERANCE:.0%} counts)", "",
             f"{'implementation':<{width}} {'P':>2} {'problem':<44} {'measured':>9} {'predicted':>9} {'ratio':>6} "
             f"{'GiB meas':>8} {'GiB pred':>8}"]
    for c in modelled:
        r = c.row
        mem = (r.get("memory") or {}).get("peak_total_mib")
        mark = "" if c.within else "  OUTSIDE"
        lines.append(f"{r['implementation']:<{width}} {r.get('world_size', 1):>2} {_what(r):<44} {c.measured_ms:>9.2f} "
                     f"{c.prediction.time_ms:>9.2f} {c.ratio:>6.2f} "
                     f"{(mem / 1024 if mem else math.nan):>8.1f} {c.prediction.memory_gib:>8.1f}{mark}")
    inside = sum(c.within for c in modelled)
    lines += ["", f"{inside} of {len(modelled)} modelled rows within {TOLERANCE:.0%}"]
    if modelled:
        lines += [_errors(modelled), _memory_errors(modelled)]
    skipped = [c for c in checks if c.skipped is not None]
    if skipped:
        lines += ["", "not modelled:"]
        lines += [f"- {c.row['implementation']} P={c.row.get('world_size', 1)} {_what(c.row)}: {c.skipped}" for c in skipped]
    return "\n".join(lines)


def validate(model: Model, paths: list[str], calibration: str) -> tuple[str, list[Check]]:
    checks, texts = [], []
    for path in paths:
        mine = check_rows(model, read_results(path))
        checks += mine
        texts.append(format_checks(mine, path, calibration))
    modelled = [c for c in checks if c.skipped is None]
    if len(paths) > 1 and modelled:
        texts.append(f"all {len(paths)} files: {sum(c.within for c in modelled)} of {len(modelled)} modelled rows within "
                     f"{TOLERANCE:.0%}; {_errors(modelled)}; {_memory_errors(modelled)}")
    return "\n\n".join(texts), checks
