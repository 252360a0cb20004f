"""Plots of a results file: time, throughput and peak memory against sequence length (one line
per configuration), and the scaling plots of distributed runs."""
from __future__ import annotations

import math
import os
from collections import defaultdict

from .results import check_passed, device_kind, first_call_only, read_results, trusted


def fit_exponent(xs, ys) -> float | None:
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x and y and x > 0 and y > 0]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    den = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / den if den else None


_SERIES_FIELDS = (("batch", "B={}"), ("q_len", "Nq={}"), ("num_heads", "H={}"), ("num_kv_heads", "Hkv={}"),
                  ("head_dim", "D={}"), ("head_dim_v", "Dv={}"), ("dtype", "{}"), ("causal", "{}"),
                  ("input_scale", "inputs x{:g}"))


def series_of(rows: list[dict]) -> dict[str, list[dict]]:
    """The rows of each line of a plot against N: one line per implementation, backend, world size
    and configuration (prefill and decode, head dims, dtypes, ... are separate lines; the label
    names the fields that differ between lines)."""
    def field(r, k):
        v = r["config"].get(k, 1.0 if k == "input_scale" else None)
        return ("causal" if v else "non-causal") if k == "causal" else v

    varying = [(k, fmt) for k, fmt in _SERIES_FIELDS if len({str(field(r, k)) for r in rows}) > 1]
    several_devices = len({device_kind(r) for r in rows}) > 1  # a CPU row and a GPU row are never one line
    out = defaultdict(list)
    for r in rows:
        name = f"{r['implementation']}/{r['backend']}"
        if r.get("world_size", 1) > 1:
            name += f" P={r['world_size']}"
        if several_devices:
            name += f" on {device_kind(r) or '?'}"
        parts = [fmt.format(field(r, k)) if field(r, k) is not None else f"{k}=-" for k, fmt in varying]
        out[" ".join([name, *parts])].append(r)
    return dict(out)


def plot(jsonl_path: str, out_dir: str | None = None) -> list[str]:
    """PNG plots of time, throughput and peak memory against sequence length, per mode: one line
    per configuration (:func:`series_of`), its lengths that ran out of memory marked x on the axis."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("plotting needs matplotlib: pip install 'dilated[plot]'") from None
    all_rows = [r for r in read_results(jsonl_path) if r["status"] in ("ok", "oom") and check_passed(r) is not False]
    rows = [r for r in all_rows if r["status"] == "ok"]
    out_dir = out_dir or os.path.dirname(os.path.abspath(jsonl_path))
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.splitext(os.path.basename(jsonl_path))[0]
    written = []
    by_mode = defaultdict(list)
    for r in all_rows:
        by_mode[r["mode"]].append(r)
    metrics = [("time_ms", "time (ms, median)", lambda r: r["time_ms"]["median"]),
               ("tokens_per_s", "throughput (tokens/s)", lambda r: r["tokens_per_s"]),
               ("memory", "peak memory above inputs (MiB)", lambda r: (r.get("memory") or {}).get("peak_above_inputs_mib"))]
    for mode, mrows in by_mode.items():
        fig, axes = plt.subplots(1, 3, figsize=(18, 5))
        for ax, (_, label, get) in zip(axes, metrics):
            for name, srows in sorted(series_of(mrows).items()):
                # warm rows make the line and its fit; a row timed by its first call only is a hollow point
                pts = sorted((r["config"]["seq_len"], get(r)) for r in srows if trusted(r) and get(r))
                cold = sorted((r["config"]["seq_len"], get(r)) for r in srows
                              if r["status"] == "ok" and first_call_only(r) and get(r))
                ooms = sorted(r["config"]["seq_len"] for r in srows if r["status"] == "oom")
                color = None
                if pts:
                    xs, ys = zip(*pts)
                    e = fit_exponent(xs, ys)
                    color = ax.plot(xs, ys, marker="o", label=f"{name} (N^{e:.2f})" if e is not None else name)[0].get_color()
                if cold:
                    xs, ys = zip(*cold)
                    color = ax.plot(xs, ys, "o", mfc="none", color=color,
                                    label=f"{name}: first call only (not warmed up; not fitted)")[0].get_color()
                if ooms:  # on the axis: no value to plot, but where it stopped fitting
                    ax.plot(ooms, [0.02] * len(ooms), "x", color=color, markersize=9, transform=ax.get_xaxis_transform(),
                            label=f"{name}: oom")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length")
            ax.set_ylabel(label)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle(f"{stem} — {mode}")
        fig.tight_layout()
        path = os.path.join(out_dir, f"{stem}_{mode}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    scaled = [r for r in rows if r.get("role") == "distributed" and r.get("efficiency") is not None and trusted(r)]
    if scaled:
        written.append(_plot_scaling(plt, scaled, os.path.join(out_dir, f"{stem}_scaling.png"), stem))
    return written


def scaling_efficiency(r: dict) -> float | None:
    """What a scaling plot shows for a distributed row: strong scaling's ``T_1 / (P T_P)``; for weak
    scaling the work efficiency (per-rank TFLOP/s over one GPU's), since ``T_1(n) / T_P(P n)`` falls
    like 1/P for quadratic attention even when every GPU runs at full speed."""
    return r.get("work_efficiency") if r.get("scaling") == "weak" else r.get("efficiency")


def _plot_scaling(plt, rows, path, title):
    """Scaling efficiency (strong) or work efficiency (weak) and per-GPU TFLOP/s against the ranks."""
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    series = defaultdict(list)
    for r in rows:
        c = r["config"]
        n = c["seq_len"] if r.get("scaling") == "strong" else r.get("tokens_per_rank")
        name = (f"{r['implementation']} {r['mode']} {'causal' if c['causal'] else 'non-causal'} "
                f"{'N' if r.get('scaling') == 'strong' else 'N/rank'}={n}")
        series[name].append((r["world_size"], scaling_efficiency(r), r.get("per_rank_tflops")))
    for name, pts in sorted(series.items()):
        pts.sort()
        ps = [p[0] for p in pts]
        axes[0].plot(ps, [p[1] for p in pts], marker="o", label=name)
        axes[1].plot(ps, [p[2] for p in pts], marker="o", label=name)
    kinds = {r.get("scaling") for r in rows}
    axes[0].axhline(1.0, color="grey", lw=0.8)
    axes[0].set_ylabel({frozenset({"strong"}): "scaling efficiency T_1 / (P T_P)",
                        frozenset({"weak"}): "work efficiency (TFLOP/s per rank / one GPU's)"}.get(
        frozenset(kinds), "strong: T_1 / (P T_P); weak: work efficiency"))
    axes[1].set_ylabel("TFLOP/s per rank")
    for ax in axes:
        ax.set_xlabel("ranks (P)")
        ax.set_xscale("log", base=2)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{title} — scaling")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
