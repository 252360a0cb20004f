"""Command-line plumbing shared by every benchmark script: sizes, YAML sweeps, output, summary."""
from __future__ import annotations

import argparse
import os
import sys

import yaml

from . import env as envmod
from .report import format_tables, plot
from .results import ResultWriter, write_csv
from .runner import RunOptions

LONGNET_SEGMENTS = (2048, 4096, 8192, 16384, 32768)
LONGNET_DILATIONS = (1, 2, 4, 8, 16)


def parse_size(text) -> int:
    """``8192``, ``8k``, ``1M``, ``2m`` -> int (k = 1024)."""
    if isinstance(text, int):
        return text
    s = str(text).strip().lower()
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(s[-1:], 1)
    num = s[:-1] if mult > 1 else s
    try:
        value = float(num) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 8192, 8k, 1M)") from None
    if value <= 0 or value != int(value):
        raise argparse.ArgumentTypeError(f"not a positive whole size: {text!r}")
    return int(value)


def size_list(text) -> list[int]:
    if isinstance(text, (list, tuple)):
        return [parse_size(t) for t in text]
    return [parse_size(t) for t in str(text).split(",") if t.strip()]


def str_list(text) -> list[str]:
    if isinstance(text, (list, tuple)):
        return [str(t) for t in text]
    return [t.strip() for t in str(text).split(",") if t.strip()]


def default_schedule(n: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """LongNet's schedule w = 2048..32768, r = 1..16, keeping the branches that fit in N;
    for N < 2048 a scaled one (N/4, N/2, N with r = 1, 2, 4)."""
    if n >= LONGNET_SEGMENTS[0]:
        keep = [(w, r) for w, r in zip(LONGNET_SEGMENTS, LONGNET_DILATIONS) if w <= n]
    else:
        keep = [(max(1, n // 4), 1), (max(1, n // 2), 2), (n, 4)]
        keep = [(w, r) for w, r in keep if r <= w]
    return tuple(w for w, _ in keep), tuple(r for _, r in keep)


def add_common_args(p: argparse.ArgumentParser, *, seq_lengths="8192", batch=2, heads=8, head_dim=64,
                    mode="fwd", dtype=None) -> None:
    g = p.add_argument_group("problem")
    g.add_argument("--batch-size", type=int, default=batch)
    g.add_argument("--seq-lengths", type=size_list, default=seq_lengths, help="comma list; accepts 8k, 1M")
    g.add_argument("--num-heads", type=int, default=heads)
    g.add_argument("--num-kv-heads", type=int, default=None, help="GQA: fewer k/v heads")
    g.add_argument("--head-dim", type=int, default=head_dim)
    g.add_argument("--segment-lengths", type=size_list, default=None, help="default: LongNet's, clipped to N")
    g.add_argument("--dilation-rates", type=size_list, default=None)
    g.add_argument("--causal", action="store_true")
    g.add_argument("--dtype", default=dtype, help="bfloat16 (GPU default), float32 (CPU default), float16")
    g.add_argument("--mode", type=str_list, default=mode, help="fwd, bwd, fwd_bwd (comma list)")
    g.add_argument("--backend", type=str_list, default="auto", help="attention backend(s), comma list")
    g.add_argument("--inputs", default=None, metavar="DIR",
                   help="captured tensors: a directory of .pt files, each a dict of q, k, v [B, N, H, D] "
                        "(or x [B, N, E] for modules), loaded with weights_only; shapes come from the files")
    t = p.add_argument_group("measurement")
    t.add_argument("--warmup", type=int, default=3)
    t.add_argument("--warmup-s", type=float, default=None,
                   help="warm up for at least this many seconds too (default 1 on a GPU, 0 on CPU: a GPU held at "
                        "its power cap lowers its clocks within a row's first second; each GPU row records them)")
    t.add_argument("--reps", type=int, default=10)
    t.add_argument("--rep-s", type=float, default=None,
                   help="time calls for at least this many seconds too (default 1 on a GPU, 0 on CPU: the median "
                        "then spans a power-capped GPU's clock swings, so that repeats of a config agree)")
    t.add_argument("--time-budget", type=float, default=None, help="at most this many seconds of timed calls per row (at least 3 calls)")
    t.add_argument("--no-check", action="store_true", help="skip the correctness check of each row")
    t.add_argument("--cuda-graph", action="store_true", help="time CUDA-graph replays (fwd rows and their --floor; marked in results)")
    t.add_argument("--no-l2-flush", action="store_true")
    t.add_argument("--floor", action="store_true",
                   help="dilated rows: also time the kernel floor (the kernels alone on pre-gathered segments)")
    t.add_argument("--settle-s", type=float, default=0.0,
                   help="idle this many seconds before each row's timed calls, so that a GPU slowed by the row "
                        "before (clocks, temperature) recovers; each row records the GPU's state around its timing")
    t.add_argument("--memory-budget-mib", type=float, default=None, help="record rows above this peak as oom")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--device", default=None)
    o = p.add_argument_group("output")
    o.add_argument("--config", default=None, help="YAML file of argument values (safe-loaded)")
    o.add_argument("--quick", action="store_true", help="a small preset that finishes fast")
    o.add_argument("--output", default=None, help="JSONL path (default results/<device>/<script>-<time>.jsonl)")
    o.add_argument("--csv", action="store_true", help="also write a CSV next to the JSONL")
    o.add_argument("--plot", action="store_true", help="also write PNG plots")
    o.add_argument("--baseline", default=None, help="implementation[/backend] for speed-ups")
    o.add_argument("--no-progress", action="store_true")


def parse_with_config(p: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """Parse, then apply ``--config`` YAML values for options not given on the command line."""
    args = p.parse_args(argv)
    if args.config:
        try:
            with open(args.config) as f:
                data = yaml.safe_load(f)
        except (OSError, yaml.YAMLError) as e:
            p.error(f"--config {args.config}: cannot read YAML: {e}")
        if not isinstance(data, dict):
            p.error(f"--config {args.config}: expected a mapping of option: value, got {type(data).__name__}")
        known = {a.dest: a for a in p._actions}
        given = {a.dest for a in p._actions for s in (argv if argv is not None else sys.argv[1:])
                 if s.split("=")[0] in a.option_strings}
        for key, value in data.items():
            dest = key.replace("-", "_")
            if dest not in known:
                p.error(f"--config {args.config}: unknown option {key!r}")
            if dest in given:
                continue
            action = known[dest]
            if action.type is not None and value is not None and not isinstance(value, bool):
                value = action.type(value) if not isinstance(value, list) else action.type(",".join(map(str, value)))
            setattr(args, dest, value)
    return args


def run_options(args) -> RunOptions:
    return RunOptions(warmup=args.warmup, reps=args.reps, budget_s=args.time_budget, check=not args.no_check,
                      cuda_graph=args.cuda_graph, flush_l2=not args.no_l2_flush,
                      memory_budget_mib=args.memory_budget_mib, seed=args.seed, device=args.device,
                      floor=args.floor, settle_s=args.settle_s, warmup_s=args.warmup_s,
                      rep_s=args.rep_s)


def default_dtype(args) -> str:
    import torch

    if args.dtype:
        return args.dtype
    gpu = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    return "bfloat16" if gpu else "float32"


def open_writer(script: str, args) -> ResultWriter:
    path = args.output or os.path.join("results", envmod.device_slug(), f"{script}-{envmod.timestamp()}.jsonl")
    return ResultWriter(path)


def finish(rows, writer: ResultWriter, args, title: str = "", table: str | None = None) -> None:
    """Print ``table`` (default: the per-config tables), then write CSV and plots and say where."""
    print(table if table is not None else format_tables(rows, args.baseline))
    if writer.rows == 0:
        print("\nno rows were written")
        return
    if args.csv:
        write_csv(writer.path, writer.path[:-6] + ".csv")
    plots = plot(writer.path) if args.plot else []
    bad = [r for r in rows if r.get("check_failed")]
    if bad:
        print(f"\n{len(bad)} row(s) FAILED their correctness check (marked ! above)")
    print(f"\n{title}results: {writer.path} ({writer.rows} rows)" + (" + .csv" if args.csv else ""))
    for p in plots:
        print(f"plot: {p}")
