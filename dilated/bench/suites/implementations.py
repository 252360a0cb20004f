"""``benchmark_implementations.py``: the implementations of dilated attention against dense attention."""
from __future__ import annotations

from ..cli import (BenchParser, add_common_args, apply_quick, devices_of, parse_with_config, run_options, runs_on_gpus,
                   str_list)
from ..output import finish, open_writer, script_main
from ..registry import get_implementation, implementation_names
from ..report import format_first_calls
from ..runner import run_sweep
from .common import jobs_of, schedule_of

#: lengths a training run over varied documents or an inference server meets one after another
VARIED_LENGTHS = {"cuda": [30000, 31000, 33000, 40000, 65536], "cpu": [500, 600, 700, 1000]}
IMPLEMENTATION_SET = ["dense", "dilated", "improved", "improved_nocache", "improved_pool", "multihead",
                      "multihead_readable"]


@script_main
def implementations_main(argv=None) -> int:
    p = BenchParser(description="DilatedAttention, ImprovedDilatedAttention (pattern cache and "
                                "memory pool on/off), MultiheadDilatedAttention (improved on/off) and dense "
                                "attention as the baseline, through the dilated.bench harness.")
    p.several_devices = True
    gpu = runs_on_gpus(argv)
    add_common_args(p, seq_lengths="8192" if gpu else "1024")
    p.add_argument("--implementations", type=str_list, default=IMPLEMENTATION_SET)
    p.add_argument("--varied-lengths", action="store_true",
                   help="the varied-lengths scenario: one module (the schedule of the longest length) at lengths "
                        "never seen before, one after another (default "
                        f"{','.join(map(str, VARIED_LENGTHS['cuda' if gpu else 'cpu']))}), and a table of each first "
                        "call's cost over a steady call (compilation, plans, the choice of auto)")
    args = parse_with_config(p, argv, implementation_names(distributed=False))
    apply_quick(args, seq_lengths=[2048 if gpu else 512], reps=3, warmup=1)
    if args.varied_lengths and "seq_lengths" not in args.given:
        args.seq_lengths = VARIED_LENGTHS["cuda" if gpu else "cpu"]
    impls = [get_implementation(n) for n in args.implementations]
    args.baseline = args.baseline or "dense"
    fixed = {}
    if args.varied_lengths:  # one module at every length: the schedule of the longest, not one per length
        fixed = dict(zip(("segment_lengths", "dilation_rates"), schedule_of(args, max(args.seq_lengths))))
    jobs = jobs_of(args, impls, args.backend, args.seq_lengths, args.mode, **fixed)
    writer = open_writer("benchmark_implementations", args)
    rows = []
    for device in devices_of(args):
        rows += run_sweep(jobs, run_options(args, device), writer, "benchmark_implementations", not args.no_progress)
    if args.varied_lengths:
        print(format_first_calls(rows))
    return finish(rows, writer, args)
