"""What a benchmark program does around its rows: the results file, the exit status, the report at
the end, and the entry-point wrapper (stops on a results file that cannot take a row; names the
rank that died or stopped when a collective fails)."""
from __future__ import annotations

import functools
import os
import sys

from . import env as envmod
from .plots import plot
from .progress import last_seen
from .report import format_tables
from .results import ResultWriter, ResultsWriteError, check_passed, write_csv


def open_writer(script: str, args) -> ResultWriter:
    """The run's results file, created before the first row is computed (so an unwritable place
    fails at once): ``--output`` (refused if it exists, unless ``--append``) or a fresh name under
    ``results/<device>/`` that no other run has, even one started in the same second."""
    try:
        if args.output:
            return ResultWriter(args.output, append=getattr(args, "append", False))
        return ResultWriter.fresh(os.path.join("results", envmod.device_slug()), script)
    except FileExistsError:
        print(f"error: --output {args.output} exists; give --append to add rows to it, or another path",
              file=sys.stderr)
        raise SystemExit(2) from None
    except OSError as e:
        print(f"error: cannot write results: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except ValueError as e:  # --append onto a file that ends in a partial line
        print(f"error: --output {e}", file=sys.stderr)
        raise SystemExit(2) from None


def script_main(fn):
    """A benchmark entry point: a results file that cannot take a whole row stops the run with
    exit status 1 and one clear message (the file keeps its whole rows)."""
    @functools.wraps(fn)
    def run(argv=None, *a, **kw):
        from .memory import track_large_allocations

        track_large_allocations()  # a benchmark program: CPU peak memory follows every large tensor
        try:
            return fn(argv, *a, **kw)
        except ResultsWriteError as e:
            print(f"error: {e}. The run stopped.", file=sys.stderr)
            return 1
        except Exception as e:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                raise
            # a collective failed or timed out: another rank died or stopped. Say which, and where.
            first = (str(e).strip().splitlines() or [""])[0][:300]
            seen = last_seen()
            me = dist.get_rank()
            mine = seen[me].split(": ", 1)[-1] if me < len(seen) else None
            behind = [line for line in seen if line.split(": ", 1)[-1] != mine]
            print(f"error: rank {me}: {type(e).__name__}: {first}\n"
                  f"a collective failed: a rank died, or stopped for longer than --timeout. "
                  + (f"Not where rank {me} is ({mine}): " + "; ".join(behind) if behind else
                     "Where each rank last checked in: " + "; ".join(seen)), file=sys.stderr, flush=True)
            return 1
    return run


def exit_status(rows, what: str = "row") -> int:
    """0 when every row is ok, oom or unsupported; else 1, after naming the rows that errored or
    failed their correctness check."""
    bad = [r for r in rows if r.get("status") == "error" or check_passed(r) is False]
    for r in bad:
        cfg = r.get("config") or {}
        if r.get("status") == "error":
            why = f"error: {r.get('reason')}"
        else:
            c = r["check"]
            errs = f"rel err {c['rel_err']:.3g}" + (f", gradients {c['grad_rel_err']:.3g}" if "grad_rel_err" in c else "")
            why = f"failed its check ({errs}; tolerance {c['tolerance']:g}, gradients {2 * c['tolerance']:g})"
        scale = f" inputs x{cfg['input_scale']:g}" if cfg.get("input_scale", 1.0) != 1.0 else ""
        print(f"{what} {r.get('implementation')}/{r.get('backend')} N={cfg.get('seq_len')} {r.get('mode')}{scale}: {why}")
    return 1 if bad else 0


def finish(rows, writer: ResultWriter, args, title: str = "", table: str | None = None) -> int:
    """Print ``table`` (default: the per-config tables), then write CSV and plots and say where;
    return the exit status (:func:`exit_status`)."""
    print(table if table is not None else format_tables(rows, args.baseline))
    if writer.rows == 0:
        print("\nno rows were written")
        return exit_status(rows)
    if args.csv:
        write_csv(writer.path, writer.path[:-6] + ".csv")
    plots = plot(writer.path) if args.plot else []
    print(f"\n{title}results: {writer.path} ({writer.rows} rows)" + (" + .csv" if args.csv else ""))
    for p in plots:
        print(f"plot: {p}")
    bad = [r for r in rows if check_passed(r) is False or r.get("status") == "error"]
    if bad:
        print(f"\n{len(bad)} row(s) errored or FAILED their correctness check (marked ! above); exit status 1:")
    return exit_status(rows)
