"""``dilated-bench`` (``python -m dilated.bench``): ``compare OLD.jsonl NEW.jsonl``, ``plot RUN.jsonl``,
``calibrate --out CAL.json`` and ``plan --calibration CAL.json ...``."""
from __future__ import annotations

import sys

from .cli import BenchParser, nonnegative_float
from .planner.commands import add_calibrate_parser, add_plan_parser, run_calibrate, run_plan
from .plots import plot
from .report import compare


def main(argv=None) -> int:
    p = BenchParser(prog="python -m dilated.bench")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compare", help="time ratios of matching rows of two runs")
    c.add_argument("old")
    c.add_argument("new")
    c.add_argument("--fail-on-regression", action="store_true",
                   help="exit 1 unless NEW vouches for OLD: no row regressed, none errored or failed its check where "
                        "OLD's ran, some rows matched, neither file is empty, unreadable or holds a configuration twice")
    c.add_argument("--min-noise", type=nonnegative_float, default=0.03,
                   help="smallest relative change that counts (a finite number >= 0)")
    pl = sub.add_parser("plot", help="PNG plots of a run")
    pl.add_argument("run")
    pl.add_argument("--out-dir", default=None)
    add_calibrate_parser(sub)
    plan = add_plan_parser(sub)
    args = p.parse_args(argv)
    if args.cmd == "calibrate":
        return run_calibrate(args)
    if args.cmd == "plan":
        return run_plan(args, plan)
    if args.cmd == "compare":
        try:
            text, problems, warnings = compare(args.old, args.new, args.min_noise)
        except ValueError as e:  # a malformed row: the file and line
            c.error(str(e))
        print(text)
        for w in warnings:
            print(f"warning: {w}")
        for problem in problems:
            print(f"NOT VOUCHED: {problem}")
        if problems and args.fail_on_regression:
            print(f"exit 1: {len(problems)} reason(s) NEW does not vouch for OLD")
            return 1
        return 0
    try:
        paths = plot(args.run, args.out_dir)
    except (OSError, ValueError) as e:
        pl.error(f"cannot plot {args.run}: {e}")
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
