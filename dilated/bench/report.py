"""What people read on the console: tables per configuration, winners, run-to-run comparison,
scaling tables (plots: :mod:`dilated.bench.plots`)."""
from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict

from .results import check_passed, device_kind, first_call_only, read_results, trusted, untrusted_reason


def _key(row, with_seq=True):
    cfg = dict(row["config"])
    if not with_seq:
        cfg.pop("seq_len", None)
    return json.dumps(cfg, sort_keys=True)


def _table_key(row, several_devices: bool):
    """The configuration of ``row`` (and its device, in a run over several)."""
    return (device_kind(row) if several_devices else "", _key(row))


def _backend_ran(row) -> str:
    """The backend asked for, and what ``auto`` ran (``auto=sdpa_cudnn``)."""
    ran = row.get("kernels")
    if row["backend"] == "auto" and ran:
        return f"auto={'+'.join(ran)}"
    return row["backend"]


def _fmt_time(t):
    if not t:
        return "-"
    spread = (t["p90"] - t["p10"]) / 2
    return f"{t['median']:.3f} ± {spread:.3f} ms"


def _cfg_title(cfg):
    parts = [f"B={cfg['batch']}", f"N={cfg['seq_len']}"]
    if cfg.get("q_len"):
        parts.append(f"Nq={cfg['q_len']}")
    parts += [f"H={cfg['num_heads']}", f"D={cfg['head_dim']}"]
    if cfg.get("head_dim_v"):
        parts.append(f"Dv={cfg['head_dim_v']}")
    if cfg.get("num_kv_heads") and cfg["num_kv_heads"] != cfg["num_heads"]:
        parts.append(f"Hkv={cfg['num_kv_heads']}")
    parts += [cfg["dtype"], "causal" if cfg["causal"] else "non-causal", cfg["mode"]]
    if cfg.get("input_scale", 1.0) != 1.0:
        parts.append(f"inputs x{cfg['input_scale']:g}")
    if cfg.get("segment_lengths"):
        parts.append(f"w={cfg['segment_lengths']} r={cfg['dilation_rates']}")
    return " ".join(parts)


def _name_width(rows: list[dict]) -> int:
    """The implementation column's width: 22, or wider where a name needs it."""
    return max([22] + [len(r["implementation"]) + 2 for r in rows])


def format_tables(rows: list[dict], baseline: str | None = None) -> str:
    """A table per config: the fastest marked *, speed-up against ``baseline`` (implementation or
    implementation/backend)."""
    several = len({device_kind(r) for r in rows}) > 1
    groups = defaultdict(list)
    for r in rows:
        groups[_table_key(r, several)].append(r)
    out = []
    width = _name_width(rows)
    head = f"{'implementation':<{width}}{'backend':<24}{'time (median ± p10-p90/2)':<30}{'tokens/s':>12}{'TFLOP/s/GPU':>12}{'%peak':>7}{'peak MiB':>10}{'rel err':>9}  {'vs base':>8}  status"
    for key, grp in groups.items():
        out.append("")
        out.append(_cfg_title(grp[0]["config"]) + (f" on {device_kind(grp[0])}" if several else ""))
        out.append(head)
        # a wrong result or a first call is never the fastest, nor a baseline
        usable = [r for r in grp if trusted(r)]
        best = min(usable, key=lambda r: r["time_ms"]["median"]) if usable else None
        base = None
        if baseline:
            for r in usable:
                if baseline in (r["implementation"], f"{r['implementation']}/{r['backend']}"):
                    base = r
                    break
        for r in grp:
            t = r.get("time_ms")
            mem = r.get("memory", {}).get("peak_above_inputs_mib")
            chk = r.get("check", {})
            err = f"{chk['rel_err']:.1e}" if chk.get("rel_err") is not None else "-"
            failed = check_passed(r) is False
            if failed:
                err += "!"
            speed = f"{base['time_ms']['median'] / t['median']:.2f}x" if base and trusted(r) else "-"
            status = r["status"] + ("" if not r.get("reason") else f" ({r['reason'][:60]})")
            if failed:
                status += " CHECK FAILED"
            if r["status"] == "ok" and first_call_only(r):
                status += " first call only (not warmed up: no speed-up, winner or fit uses it)"
            floors = []
            if r.get("floor_ratio"):
                floors.append(f"{r['floor_ratio']:.2f}x kernel floor {r['kernel_floor_ms']['median']:.3f} ms")
            if r.get("one_call_floor_ratio"):
                floors.append(f"{r['one_call_floor_ratio']:.2f}x the {r['one_call_floor_calls']}-call floor "
                              f"{r['one_call_floor_ms']['median']:.3f} ms")
            if floors:
                status += f" ({', '.join(floors)})"
            scores = (r.get("memory") or {}).get("score_matrix_mib")
            if scores is not None and r["status"] == "ok":
                status += f" (the score matrix alone: {scores:.4g} MiB)"
            mark = "*" if r is best else " "
            pct = f"{r['pct_peak']:.0f}" if r.get("pct_peak") else "-"
            tok = f"{r['tokens_per_s']:.3g}" if r.get("tokens_per_s") else "-"
            per_gpu = r.get("per_rank_tflops", r.get("tflops"))  # tflops is over all ranks; this and %peak per GPU
            tfl = f"{per_gpu:.2f}" if per_gpu else "-"
            mib = f"{mem:.1f}" if mem is not None else "-"
            out.append(f"{mark}{r['implementation']:<{width - 1}}{_backend_ran(r):<24}{_fmt_time(t):<30}"
                       f"{tok:>12}{tfl:>12}{pct:>7}{mib:>10}{err:>9}  {speed:>8}  {status}")
    return "\n".join(out + format_winners(rows) + format_device_speedups(rows) + format_repeats(rows))


def format_winners(rows: list[dict]) -> list[str]:
    """Per scenario (prefill or decode, and mode): which implementation/backend was fastest among
    the rows that ran warm and passed their check, in how many of its configurations, and by how
    much over the runner-up (median of the per-configuration ratios)."""
    several = len({device_kind(r) for r in rows}) > 1
    scenarios = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if trusted(r):
            c = r["config"]
            scenario = (("decode" if c.get("q_len") else "prefill"), c["mode"])
            if several:
                scenario += (device_kind(r),)
            scenarios[scenario][_key(r)].append(r)
    out = []
    for scenario, configs in sorted(scenarios.items()):
        kind, mode = scenario[:2]
        if several:
            mode = f"{mode} {scenario[2]}"
        wins, margins, total = defaultdict(int), defaultdict(list), 0
        for grp in configs.values():
            names = {f"{r['implementation']}/{r['backend']}" for r in grp}
            if len(names) < 2:
                continue
            total += 1
            ranked = sorted(grp, key=lambda r: r["time_ms"]["median"])
            name = f"{ranked[0]['implementation']}/{ranked[0]['backend']}"
            wins[name] += 1
            margins[name].append(ranked[1]["time_ms"]["median"] / ranked[0]["time_ms"]["median"])
        if not total:
            continue
        if not out:
            out += ["", "fastest per scenario (rows that ran warm and passed their check):"]
        for name, n in sorted(wins.items(), key=lambda kv: -kv[1]):
            m = statistics.median(margins[name])
            out.append(f"  {kind:<8}{mode:<9}{name:<36}fastest in {n} of {total} configuration(s), "
                       f"{m:.2f}x the runner-up (median)")
    return out


def format_device_speedups(rows: list[dict]) -> list[str]:
    """Where one configuration ran on a CPU and a GPU of one host (same implementation and
    backend, both passed their check): the GPU's speed-up over the CPU (median over median)."""
    by = defaultdict(dict)
    for r in rows:
        if trusted(r):
            host = (r.get("env") or {}).get("hostname")
            by[(host, r["implementation"], r["backend"], _key(r))][device_kind(r)] = r
    out = []
    for (_, impl, backend, _), pair in by.items():
        if "cpu" in pair and "cuda" in pair:
            cpu, gpu = pair["cpu"]["time_ms"]["median"], pair["cuda"]["time_ms"]["median"]
            if not out:
                out += ["", "GPU over CPU (one host, the same configuration; medians):"]
            out.append(f"  {impl + '/' + backend:<36}{_cfg_title(pair['cpu']['config']):<60} "
                       f"cpu {cpu:.3f} ms, cuda {gpu:.3f} ms: {cpu / gpu:.1f}x")
    return out


def format_first_calls(rows: list[dict]) -> str:
    """Each row's first and second calls against its steady median, in the order run: what a length
    never seen before costs (the process's own set-up ran before the first row: its warm-up), and
    what it costs when it comes back (where a kernel builds per shape at that call). A row timed by
    its first call only has no steady median to compare with."""
    width = _name_width(rows)
    out = ["", "first and second call at each new length (in the order run, after the process's warm-up):",
           f"{'implementation':<{width}}{'backend':<24}{'mode':<9}{'N':>9}{'first ms':>12}{'second ms':>12}"
           f"{'steady ms':>12}{'extra 1st':>11}{'extra 2nd':>11}"]
    for r in rows:
        first, t = r.get("first_call_ms"), (r.get("time_ms") or {}).get("median")
        if first is None or t is None:
            continue
        if first_call_only(r):
            out.append(f"{r['implementation']:<{width}}{_backend_ran(r):<24}{r['config']['mode']:<9}"
                       f"{r['config']['seq_len']:>9}{first:>12.3f}{'-':>12}{'-':>12}{'-':>11}{'-':>11}  first call only")
            continue
        second = r.get("second_call_ms")
        two = ("-".rjust(12), "-".rjust(11)) if second is None else (f"{second:>12.3f}", f"{second - t:>11.3f}")
        out.append(f"{r['implementation']:<{width}}{_backend_ran(r):<24}{r['config']['mode']:<9}{r['config']['seq_len']:>9}"
                   f"{first:>12.3f}{two[0]}{t:>12.3f}{first - t:>11.3f}{two[1]}")
    return "\n".join(out)


def format_repeats(rows: list[dict], tolerance: float = 0.02) -> list[str]:
    """Lines for the configs timed more than once in one run: their medians and how far apart
    (largest over smallest, minus one), flagged beyond ``tolerance``: the run's own noise."""
    groups = defaultdict(list)
    for r in rows:
        if trusted(r):  # a first call is no repeat of a steady time
            groups[_match_key(r)].append(r)  # a CPU and a GPU row are no repeat (the key has the device)
    out = []
    for (impl, backend, *_), grp in groups.items():
        if len(grp) < 2:
            continue
        meds = [r["time_ms"]["median"] for r in grp]
        apart = max(meds) / min(meds) - 1
        flag = "" if apart <= tolerance else f"  BEYOND {100 * tolerance:.0f}%"
        out.append(f"  {impl}/{backend} {_cfg_title(grp[0]['config'])}: "
                   f"{' / '.join(f'{m:.3f}' for m in meds)} ms, {100 * apart:.1f}% apart{flag}")
    return ["", "timed more than once in this run:"] + out if out else []


# -- compare ------------------------------------------------------------------------------
def _match_key(r):
    """What makes two rows the same measurement: implementation, backend, world size, device kind
    (a CPU row is no GPU row's repeat) and configuration."""
    return (r["implementation"], r["backend"], r.get("world_size", 1), device_kind(r), _key(r))


_ENV_FIELDS = ("gpu", "driver", "torch", "cuda", "cudnn", "triton", "flash_attn", "flash_attn_3", "flash_attn_4", "xformers",
               "sageattention")


def _what(r) -> str:
    p = r.get("world_size", 1)
    return (f"{r['implementation']}/{r['backend']}{f' P={p}' if p > 1 else ''} on {device_kind(r) or '?'} "
            f"{_cfg_title(r['config'])}")


def _rows_for_compare(path: str, problems: list[str]) -> list[dict]:
    """The rows of ``path`` (a ValueError names a malformed line); an empty file or a configuration
    measured twice is a problem."""
    try:
        rows = read_results(path)
    except (OSError, UnicodeDecodeError) as e:
        problems.append(f"cannot read {path}: {e}")
        return []
    if not rows:
        problems.append(f"{path} holds no rows")
    seen = {}
    for r in rows:
        if r.get("find_max"):  # --find-max probes are searches, not configurations of the sweep
            continue
        key = _match_key(r)
        if key in seen:
            problems.append(f"{path}: configuration {_what(r)} appears more than once (which one would vouch?)")
        seen[key] = r
    return [r for r in rows if not r.get("find_max")]


def _spread(t: dict) -> float:
    """Half the p10-p90 spread relative to the median (0 for a zero median: nothing to scale)."""
    return (t["p90"] - t["p10"]) / (2 * t["median"]) if t["median"] > 0 else 0.0


def compare(old_path: str, new_path: str, min_noise: float = 0.03) -> tuple[str, list[str], list[str]]:
    """Ratio new/old of median time per matching row, flagged beyond the measured spread.

    A row regresses when ``new/old > 1 + noise`` with ``noise`` the larger of the two runs'
    relative half p10-p90 spreads and ``min_noise``. Returns ``(report, problems, warnings)``:
    a problem is a reason NEW cannot vouch for OLD (a regression; a file that is empty, unreadable
    or holds one configuration twice; no matching rows; a NEW row that errored, failed its check
    or was timed by its first call only where OLD's ran warm); warnings name different GPUs or
    library versions and OLD rows NEW did not measure. Rows match on implementation, backend,
    world size, device kind and configuration. A malformed row raises ValueError (file and line).
    """
    if not (isinstance(min_noise, (int, float)) and math.isfinite(min_noise) and min_noise >= 0):
        raise ValueError(f"--min-noise must be a finite number >= 0, got {min_noise!r}")
    problems, warnings = [], []
    old_rows = _rows_for_compare(old_path, problems)
    new_rows = _rows_for_compare(new_path, problems)
    old = {_match_key(r): r for r in old_rows if trusted(r)}
    lines = [f"{'implementation':<20}{'backend':<14}{'config':<58}{'old ms':>10}{'new ms':>10}{'new/old':>9}  flag"]
    matched = set()
    for r in new_rows:
        key = _match_key(r)
        o = old.get(key)
        if o is None:
            continue
        matched.add(key)
        why = untrusted_reason(r)
        if why:
            why = {"check failed": "failed its correctness check",
                   "first call only": "was timed by its first call only (not warmed up)"}.get(why, f"{why}: {r.get('reason')}")
            problems.append(f"{_what(r)}: ok in OLD, {why} in NEW")
            lines.append(f"{r['implementation']:<20}{r['backend']:<14}{_cfg_title(r['config'])[:57]:<58}"
                         f"{o['time_ms']['median']:>10.3f}{'-':>10}{'-':>9}  {r['status'].upper()}"
                         + (" CHECK FAILED" if check_passed(r) is False else "")
                         + (" FIRST CALL ONLY" if r["status"] == "ok" and first_call_only(r) else ""))
            continue
        what = _what(r)
        to, tn = o["time_ms"], r["time_ms"]
        ratio = tn["median"] / to["median"] if to["median"] > 0 else math.inf
        noise = max(min_noise, _spread(to), _spread(tn))
        flag = "REGRESSION" if ratio > 1 + noise else ("faster" if ratio < 1 - noise else "")
        if flag == "REGRESSION":
            problems.append(f"{what}: {ratio:.3f}x the old time (noise {noise:.3f})")
        lines.append(f"{r['implementation']:<20}{r['backend']:<14}{_cfg_title(r['config'])[:57]:<58}"
                     f"{to['median']:>10.3f}{tn['median']:>10.3f}{ratio:>9.3f}  {flag}")
    if old_rows and new_rows and not matched:
        problems.append("no configuration of OLD that ran is in NEW: nothing to compare")
        lines.append("(no matching ok rows)")
    missing = [k for k in old if k not in matched]
    if missing and matched:
        warnings.append(f"{len(missing)} configuration(s) that ran in OLD are not in NEW")
    for field in _ENV_FIELDS:
        a = {str((r.get("env") or {}).get(field)) for r in old_rows}
        b = {str((r.get("env") or {}).get(field)) for r in new_rows}
        if old_rows and new_rows and a != b:
            warnings.append(f"the runs differ in {field}: OLD {', '.join(sorted(a))}; NEW {', '.join(sorted(b))}")
    return "\n".join(lines), problems, warnings


# -- scaling ------------------------------------------------------------------------------
def format_scaling(rows: list[dict], compare: bool = False) -> str:
    """The rows of a distributed run by world size: one table per (implementation, backend, mode,
    causal); with ``compare``, one table per problem (mode, causal, length) holding every
    implementation side by side, fastest first at each world size (the ring script's comparison)."""
    groups = defaultdict(list)
    for r in rows:
        c = r["config"]
        if compare:
            n = c["seq_len"] if r.get("scaling") != "weak" or r.get("role") == "baseline" else r.get("tokens_per_rank")
            heads = (c["num_heads"], c.get("num_kv_heads") or c["num_heads"], c["head_dim"])
            groups[(c["mode"], c["causal"], r.get("scaling"), n, heads, c.get("documents"))].append(r)
        else:
            groups[(r["implementation"], r["backend"], c["mode"], c["causal"], c.get("documents"))].append(r)
    out = []
    head = (f"{'P':>3}{'N':>10}{'N/rank':>10}{'time ms':>12}{'TFLOP/s/rank':>14}{'efficiency':>12}{'work eff':>10}"
            f"{'work imb':>9}{'time imb':>9}{'exposed comm':>14}{'MiB sent/rank':>15}{'peak MiB':>10}  check")
    width = max([26, *(len(r["implementation"]) + 2 for r in rows)])  # the implementation column
    for key, grp in groups.items():
        docs = f", documents {key[-1]}" if key[-1] else ""  # a table per mix: its rows and baseline are that mix's
        if compare:
            mode, causal, scaling, n, (h, hkv, d), _ = key
            out += ["", f"{mode} {'causal' if causal else 'non-causal'} {scaling} scaling, "
                        f"{'N' if scaling != 'weak' else 'N/rank'}={n}, H={h}{f'/{hkv}' if hkv != h else ''} D={d}"
                        f"{docs}: every implementation",
                    f"{'implementation':<{width}}{'backend':<16}" + head]
            order = sorted(grp, key=lambda r: (r.get("world_size", 1), (r.get("time_ms") or {}).get("median") or 1e30))
        else:
            impl, backend, mode, causal, _ = key
            out += ["", f"{impl} ({grp[0].get('role', '')}) backend={backend} {mode} "
                        f"{'causal' if causal else 'non-causal'} scaling={grp[0].get('scaling')}{docs}", head]
            order = sorted(grp, key=lambda r: (r.get("world_size", 1), r["config"]["seq_len"]))
        bases = sorted({f"{r['baseline_backend']}" + (f" ({'+'.join(r['baseline_kernels'])})" if r.get("baseline_kernels")
                                                      else "") + f" {r['baseline_ms']:.3f} ms"
                        for r in grp if r.get("baseline_backend")})
        if bases:
            out.append("efficiency against the fastest single-device run of the problem: " + "; ".join(bases))
        for r in order:
            lead = f"{r['implementation']:<{width}}{r['backend']:<16}" if compare else ""
            out.append(lead + _scaling_line(r))
    return "\n".join(out)


def _scaling_line(r: dict) -> str:
    def f(v, fmt):
        return format(v, fmt) if v is not None else "-"
    t = (r.get("time_ms") or {}).get("median")
    comm = r.get("comm") or {}
    exp = r.get("exposed_comm_fraction")
    sent = comm.get("bytes_sent_per_rank_max")
    passed = check_passed(r)
    chk = "-" if passed is None else ("ok" if passed else "FAILED")
    if r["status"] == "ok" and first_call_only(r):
        chk += " first call only"
    return (f"{r.get('world_size', 1):>3}{r['config']['seq_len']:>10}{r.get('tokens_per_rank', 0):>10}"
            f"{f(t, '.3f'):>12}{f(r.get('per_rank_tflops', r.get('tflops')), '.2f'):>14}"
            f"{f(r.get('efficiency'), '.3f'):>12}{f(r.get('work_efficiency'), '.3f'):>10}"
            f"{f(r.get('work_imbalance'), '.3f'):>9}{f(r.get('time_imbalance'), '.3f'):>9}"
            f"{(f(100 * exp, '.1f') + '%') if exp is not None else '-':>14}"
            f"{f(sent / (1 << 20) if sent is not None else None, '.1f'):>15}"
            f"{f((r.get('memory') or {}).get('peak_total_mib'), '.0f'):>10}  {chk}"
            + ("" if r["status"] == "ok" else f"  {r['status']}: {(r.get('reason') or '')[:60]}")
            + (f"  efficiency: {r['efficiency_note'][:160]}" if r.get("efficiency_note") else ""))


def format_speedups(rows: list[dict], new_class: list[str], old_class: list[str]) -> str:
    """Per config: the best backend of ``new_class`` against the best of ``old_class`` (rows that ran
    warm and passed their check)."""
    groups = defaultdict(list)
    for r in rows:
        if trusted(r):
            groups[(r["implementation"], _key(r))].append(r)
    out = ["", "best Hopper-class kernel against the best previous-class one, per config:",
           f"{'implementation':<16}{'config':<62}{'best new':>22}{'best previous':>24}{'speed-up':>10}"]
    for (impl, _), grp in groups.items():
        def best(names):
            cand = [r for r in grp if r["backend"] in names]
            return min(cand, key=lambda r: r["time_ms"]["median"]) if cand else None

        new, old = best(new_class), best(old_class)
        cfg = _cfg_title(grp[0]["config"])
        cfg = cfg.split(" w=")[0]
        fmt = lambda r: f"{r['backend']} {r['time_ms']['median']:.3f} ms" if r else "-"  # noqa: E731
        sp = f"{old['time_ms']['median'] / new['time_ms']['median']:.2f}x" if new and old else "-"
        out.append(f"{impl:<16}{cfg:<62}{fmt(new):>22}{fmt(old):>24}{sp:>10}")
    return "\n".join(out)
