"""``python -m dilated.bench compare OLD.jsonl NEW.jsonl`` and ``python -m dilated.bench plot RUN.jsonl``."""
from __future__ import annotations

import argparse
import sys

from .report import compare, plot


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dilated.bench")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compare", help="time ratios of matching rows of two runs")
    c.add_argument("old")
    c.add_argument("new")
    c.add_argument("--fail-on-regression", action="store_true", help="exit 1 when a row regressed")
    c.add_argument("--min-noise", type=float, default=0.03, help="smallest relative change that counts")
    pl = sub.add_parser("plot", help="PNG plots of a run")
    pl.add_argument("run")
    pl.add_argument("--out-dir", default=None)
    args = p.parse_args(argv)
    if args.cmd == "compare":
        text, regressed = compare(args.old, args.new, args.min_noise)
        print(text)
        return 1 if (regressed and args.fail_on_regression) else 0
    for path in plot(args.run, args.out_dir):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
