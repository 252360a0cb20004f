"""``benchmark_extreme_sequences.py``: the doubling length sweep, and the longest length each runs."""
from __future__ import annotations

import dataclasses

import torch

from ..cli import (BenchParser, add_common_args, apply_quick, parse_with_config, positive_float, run_options,
                   runs_on_gpus, str_list, usage_error)
from ..output import exit_status, finish, open_writer, script_main
from ..registry import get_implementation, implementation_names
from ..results import check_passed, trusted, untrusted_reason, write_json
from ..runner import run_sweep
from .common import cases_of, init_for_benchmark, launched_world, add_timeout_arg

EXTREME_SET = ["dilated", "improved", "improved_pool", "multihead", "dense"]
EXTREME_DISTRIBUTED = ["ring_zigzag", "distributed_dilated"]  # joined to "all" under torchrun
#: the CPU default schedule: LongNet's (w = 2048..32768, r = 1..16) with segments 8 times shorter
CPU_SEGMENTS, CPU_DILATIONS = (256, 512, 1024, 2048, 4096), (1, 2, 4, 8, 16)

#: the least peak memory above the inputs (MiB) at every length for a fit of memory against N
MIN_FITTED_PEAK_MIB = 1.0


def find_max_length(run, start: int, granularity: int, limit: int, known_ok: int | None = None,
                    max_call_s: float | None = None) -> tuple[int | None, dict | None, str]:
    """Longest N in [start, limit] for which ``run(N)`` returns an ok row: doubling from ``start``,
    then bisection to ``granularity``; if ``start`` itself fails, bisection down to ``known_ok``.

    The search also stops growing once one call takes longer than ``max_call_s`` (then the answer
    is limited by time, not memory, and the returned note says so). Returns ``(N, row, note)``.
    """
    def ok(row):  # a result that failed its correctness check does not count
        return row["status"] == "ok" and check_passed(row) is not False

    best, best_row, n, fail, note = known_ok, None, start, None, ""
    while n <= limit:
        row = run(n)
        if not ok(row):
            fail = n
            break
        best, best_row = n, row
        if max_call_s is not None and row["time_ms"]["median"] > 1e3 * max_call_s:
            return best, best_row, (f"stopped growing: one call took {row['time_ms']['median'] / 1e3:.1f} s "
                                    f"> --max-call-seconds {max_call_s:g}; memory was not the limit")
        n *= 2
    else:
        note = f"reached --find-max-limit {limit}"
    if fail is None or best is None:
        return best, best_row, note
    lo, hi = best, fail
    while hi - lo > granularity:
        mid = (lo + hi) // 2 // granularity * granularity
        if mid <= lo:
            break
        row = run(mid)
        if ok(row):
            lo, best_row = mid, row
            if max_call_s is not None and row["time_ms"]["median"] > 1e3 * max_call_s:
                return lo, best_row, (f"stopped bisecting: one call took {row['time_ms']['median'] / 1e3:.1f} s "
                                      f"> --max-call-seconds {max_call_s:g}; N={hi} failed")
        else:
            hi = mid
    return lo, best_row, f"first failure at N={hi}"


def _have_matplotlib() -> bool:
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        print("matplotlib is not installed: no plots (pip install matplotlib)")
        return False
    return True


def _parse(argv):
    from ..sizes import parse_size

    gpu = runs_on_gpus(argv)
    p = BenchParser(description="Sequence length sweep (doubling) of dilated, improved, multihead and "
                                "dense attention; --find-max searches the longest sequence each one runs.")
    # lengths come from --min/--max-seq-length. On a CPU: small heads, and LongNet's schedule scaled
    # down by 8 (CPU_SEGMENTS), so that the sweep shows within about a minute where dilated attention
    # overtakes dense and dense turns quadratic
    add_common_args(p, seq_lengths="1", batch=1, heads=16 if gpu else 2, head_dim=128 if gpu else 16)
    p.add_argument("--min-seq-length", type=parse_size, default=parse_size("8k") if gpu else 512)
    p.add_argument("--max-seq-length", type=parse_size, default=parse_size("1M") if gpu else parse_size("16k"))
    p.add_argument("--implementation", type=str_list, default="all")
    p.add_argument("--find-max", action="store_true", help="then search the longest N per implementation")
    p.add_argument("--find-max-limit", type=parse_size, default=parse_size("64M"))
    p.add_argument("--granularity", type=parse_size, default=None, help="bisection step (default: max/16)")
    p.add_argument("--max-call-seconds", type=positive_float, default=30.0,
                   help="--find-max stops growing N once one call takes longer (dense attention at many M tokens)")
    p.add_argument("--no-plot", action="store_true", help="do not write the PNG plots")
    add_timeout_arg(p)
    args = parse_with_config(p, argv, implementation_names(distributed=False) + EXTREME_DISTRIBUTED + ["all"], rejected={
        "seq_lengths": "the sweep doubles from --min-seq-length to --max-seq-length; set those",
        "inputs": "the length sweep generates its inputs; use benchmark_implementations.py for captured ones"})
    lo, hi = (parse_size("8k"), parse_size("32k")) if gpu else (256, 512)  # --quick's, within what the user set
    apply_quick(args, min_seq_length=min(lo, args.max_seq_length) if "max_seq_length" in args.given else lo,
                max_seq_length=max(hi, args.min_seq_length) if "min_seq_length" in args.given else hi, reps=3, warmup=1)
    if args.min_seq_length > args.max_seq_length:
        usage_error(p, f"--min-seq-length {args.min_seq_length} is above --max-seq-length {args.max_seq_length}")
    if args.plot and args.no_plot:
        usage_error(p, "--plot and --no-plot: choose one")
    if args.time_budget is None and gpu:
        args.time_budget = 5.0  # seconds per row (dense at 1M, ~15 s a call: its warm-up calls, the last its sample)
    if not gpu:
        args.default_schedule = (CPU_SEGMENTS, CPU_DILATIONS)  # where --segment-lengths is not given
    args.plot = not args.no_plot and _have_matplotlib()
    return args


class _ExtremeSweep:
    """The sweep of one launch: on every rank under torchrun/srun (the ring and distributed classes
    join "all"), where only rank 0 runs the single-device implementations, prints and writes."""

    SCRIPT = "benchmark_extreme_sequences"

    def __init__(self, args):
        from .. import env as envmod

        self.args = args
        self.launched = launched_world() > 1
        self.rank, self.world = 0, 1
        if self.launched:
            self.rank, self.world, device = init_for_benchmark(args)
            args.device = args.device or str(device)
        self.lead = self.rank == 0
        names = args.implementation
        if names == ["all"]:
            names = EXTREME_SET + (EXTREME_DISTRIBUTED if self.launched else [])
        self.impls = [get_implementation(n) for n in names]
        self.lengths = []
        n = args.min_seq_length
        while n <= args.max_seq_length:
            self.lengths.append(n)
            n *= 2
        self.opts = run_options(args)
        if args.time_budget is None and not torch.cuda.is_available():
            self.opts.reps, self.opts.warmup = min(self.opts.reps, 3), 1
        self.writer = open_writer(self.SCRIPT, args) if self.lead else None
        self.out("dilated extreme-sequence sweep on " + (envmod.environment()["gpu"] or "CPU")
                 + (f" x {self.world} ranks" if self.launched else "")
                 + f": N = {self.lengths[0]}..{self.lengths[-1]} (doubling), implementations {names}, "
                 f"modes {args.mode}, B={args.batch_size} H={args.num_heads} D={args.head_dim}; "
                 "each row checked against a reference.")

    def out(self, *a, **k):
        if self.lead:
            print(*a, **k)

    def here(self, impl) -> bool:
        """Whether this rank runs ``impl`` (every rank runs the distributed ones)."""
        from ..distributed import DistributedImplementation

        return self.lead or (self.launched and isinstance(impl, DistributedImplementation))

    def extra_row(self):
        if not self.launched:
            return None
        return lambda r: {"world_size": self.world if r["implementation"] in EXTREME_DISTRIBUTED else 1}

    def sweep(self) -> list[dict]:
        args = self.args
        jobs = [(impl, case, b) for case in cases_of(args, self.lengths, args.mode) for impl in self.impls
                for b in args.backend if self.here(impl)]
        return run_sweep(jobs, self.opts, self.writer, self.SCRIPT, self.lead and not args.no_progress,
                         extra_row=self.extra_row())

    def report(self, rows) -> int:
        """The tables and exit status of the sweep, and each implementation's scaling exponents."""
        from ..plots import fit_exponent

        args = self.args
        want_plot, args.plot = args.plot, False  # plotted at the end, with the --find-max rows
        status = finish(rows, self.writer, args) if self.lead else 0
        args.plot = want_plot
        self.out("\nscaling exponents (fit of log time and log memory against log N; rows that ran warm and "
                 "passed their check):")
        for impl in (self.impls if self.lead else []):
            for mode in args.mode:
                mine = [r for r in rows if r["implementation"] == impl.name and r["mode"] == mode]
                ok = [r for r in mine if trusted(r)]
                left = [f"N={r['config']['seq_len']} ({untrusted_reason(r)})" for r in mine
                        if r["status"] == "ok" and not trusted(r)]
                if left:
                    print(f"  {impl.name:<12} {mode:<8} left out: {', '.join(left)}")
                if len(ok) >= 2:
                    ns = [r["config"]["seq_len"] for r in ok]
                    et = fit_exponent(ns, [r["time_ms"]["median"] for r in ok])
                    peaks = [(r.get("memory") or {}).get("peak_above_inputs_mib") or 0 for r in ok]
                    # peaks of less than a MiB are the allocator's rounding more than the implementation's
                    em = fit_exponent(ns, peaks) if min(peaks) >= MIN_FITTED_PEAK_MIB else None
                    per_tok = ok[-1]["memory"]["peak_total_mib"] * (1 << 20) / ok[-1]["config"]["seq_len"]
                    print(f"  {impl.name:<12} {mode:<8} time ~ N^{et:.2f}" + (f", memory ~ N^{em:.2f}" if em else "")
                          + f" over N={min(ns)}..{max(ns)} ({len(set(ns))} lengths); {per_tok:.0f} bytes/token "
                          f"total at N={ns[-1]}")
        return status

    def find_max(self, rows) -> int:
        """The longest N each implementation and mode runs (and passes its check); returns the exit
        status of the probes."""
        args = self.args
        gran = args.granularity or max(1, args.max_seq_length // 16)
        self.out(f"\n--find-max: doubling from {args.max_seq_length}, then bisection to {gran} tokens")
        found, probes = [], []
        # a probe needs to run and be checked; a few timed calls are enough
        probe_opts = dataclasses.replace(self.opts, warmup=1, reps=min(self.opts.reps, 3), budget_s=None)
        for impl in [i for i in self.impls if self.here(i)]:
            for mode in args.mode:
                swept = {r["config"]["seq_len"]: r for r in rows if r["implementation"] == impl.name
                         and r["mode"] == mode and r["status"] == "ok"}
                n, row, note = find_max_length(lambda n, impl=impl, mode=mode, swept=swept:
                                               self._probe(impl, mode, n, swept, probe_opts, probes),
                                               args.max_seq_length, gran, args.find_max_limit,
                                               known_ok=max(swept) if swept else None, max_call_s=args.max_call_seconds)
                self._say_longest(impl, mode, n, row, note)
                found.append({"implementation": impl.name, "mode": mode, "max_seq_len": n, "note": note,
                              "memory": (row or {}).get("memory"), "backend": args.backend[0],
                              "config": (row or {}).get("config"), "check": (row or {}).get("check")})
        if not self.lead:
            return 0
        path = self.writer.path[:-len(".jsonl")] + "-find_max.json"
        write_json(path, {"granularity": gran, "max_call_seconds": args.max_call_seconds, "results": found})
        print(f"longest lengths: {path}")
        return exit_status(probes, "--find-max probe")

    def _probe(self, impl, mode, n, swept, probe_opts, probes) -> dict:
        from ..distributed import DistributedImplementation

        if n in swept:  # measured by the sweep already
            return swept[n]
        case = next(cases_of(self.args, [n], [mode]))
        r = run_sweep([(impl, case, self.args.backend[0])], probe_opts, self.writer, self.SCRIPT, False,
                      extra_row=lambda _: {"find_max": True})[0]
        probes.append(r)
        if self.launched and isinstance(impl, DistributedImplementation):  # every rank takes the same branch
            failed = impl.reduce_max([0.0 if r["status"] == "ok" and check_passed(r) is not False else 1.0])[0]
            if failed and r["status"] == "ok":
                r = dict(r, status="error", reason="failed on another rank")
        self.out(f"  {impl.name} {mode} N={n}: {r['status']}" + (f" ({r['reason'][:80]})" if r.get("reason") else "")
                 + (" CHECK FAILED: not counted" if check_passed(r) is False else ""))
        return r

    def _say_longest(self, impl, mode, n, row, note) -> None:
        if n is None:
            self.out(f"  => {impl.name} {mode}: nothing ran at N >= {self.args.min_seq_length}")
        elif row is None:
            self.out(f"  => {impl.name} {mode}: longest N = {n} (from the sweep; {note})")
        else:
            mem = row["memory"]
            self.out(f"  => {impl.name} {mode}: longest N = {n} (peak {mem['peak_total_mib']:.0f} MiB total, "
                     f"{mem['peak_above_inputs_mib']:.0f} MiB above inputs, "
                     f"{mem['peak_total_mib'] * (1 << 20) / n:.0f} bytes/token; {note})")

    def close(self) -> None:
        """Plots (with the --find-max rows), where the results are, and the process group ended."""
        if self.lead:
            if self.args.plot and self.writer.rows:
                from ..plots import plot

                print("plots: " + ", ".join(plot(self.writer.path)))
            print(f"\nresults are in {self.writer.path}"
                  + ("" if self.args.plot else f"; plot them with: python -m dilated.bench plot {self.writer.path}"))
        if self.launched:
            import torch.distributed as dist

            dist.barrier()
            dist.destroy_process_group()


@script_main
def extreme_main(argv=None) -> int:
    args = _parse(argv)
    sweep = _ExtremeSweep(args)
    rows = sweep.sweep()
    status = sweep.report(rows)
    if args.find_max:
        status = max(status, sweep.find_max(rows))
    sweep.close()
    return status
