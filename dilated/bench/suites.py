"""The sweeps behind the benchmark scripts: arguments in, (implementation, case, backend) jobs out."""
from __future__ import annotations

import dataclasses

import torch

import dilated

from .cli import (BenchParser, add_common_args, apply_quick, default_dtype, default_schedule, exit_status, finish,
                  int_list, open_writer, parse_with_config, positive_float, run_options, script_main, size_list,
                  str_list, usage_error)
from .captured import captured_case, load_captured
from .registry import Case, get_implementation, implementation_names
from .results import write_json
from .runner import run_sweep


def _schedule(args, n):
    if args.segment_lengths:
        segs = tuple(min(w, n) for w in args.segment_lengths)
        dils = tuple(args.dilation_rates or [1] * len(segs))
        return segs, tuple(min(r, w) for w, r in zip(segs, dils))  # a segment clipped to N keeps r <= w
    return default_schedule(n)


def _cases(args, seq_lengths, modes, **overrides):
    dtype = default_dtype(args)
    for n in seq_lengths:
        segs, dils = _schedule(args, n)
        for mode in modes:
            for scale in args.input_scales:
                kw = dict(batch=args.batch_size, seq_len=n, num_heads=args.num_heads, head_dim=args.head_dim,
                          num_kv_heads=args.num_kv_heads, dtype=dtype, causal=args.causal, mode=mode,
                          segment_lengths=segs, dilation_rates=dils, input_scale=scale)
                kw.update(overrides)
                yield Case(**kw)


def _jobs(args, impls, backends, seq_lengths, modes, **overrides):
    """(implementation, case, backend[, captured]) for every combination; from ``--inputs`` when given.
    ``overrides`` replace case fields taken from ``args`` (generated inputs only)."""
    if not args.inputs:
        return [(impl, case, b) for case in _cases(args, seq_lengths, modes, **overrides) for impl in impls
                for b in backends]
    try:
        caps = load_captured(args.inputs)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    jobs = []
    for cap in caps:
        for mode in modes:
            case = captured_case(cap, args.num_heads, mode=mode, causal=args.causal, dtype=args.dtype)
            segs, dils = _schedule(args, case.seq_len)
            case = dataclasses.replace(case, segment_lengths=segs, dilation_rates=dils)
            jobs += [(impl, case, b, cap) for impl in impls for b in backends]
    return jobs


# -- benchmark_implementations ------------------------------------------------------------
IMPLEMENTATION_SET = ["dense", "dilated", "improved", "improved_nocache", "improved_pool", "multihead",
                      "multihead_readable"]


@script_main
def implementations_main(argv=None) -> int:
    p = BenchParser(description="DilatedAttention, ImprovedDilatedAttention (pattern cache and "
                                "memory pool on/off), MultiheadDilatedAttention (improved on/off) and dense "
                                "attention as the baseline, through the dilated.bench harness.")
    gpu = torch.cuda.is_available()
    add_common_args(p, seq_lengths="8192" if gpu else "1024")
    p.add_argument("--implementations", type=str_list, default=IMPLEMENTATION_SET)
    args = parse_with_config(p, argv, implementation_names(distributed=False))
    apply_quick(args, seq_lengths=[2048 if gpu else 512], reps=3, warmup=1)
    impls = [get_implementation(n) for n in args.implementations]
    args.baseline = args.baseline or "dense"
    jobs = _jobs(args, impls, args.backend, args.seq_lengths, args.mode)
    writer = open_writer("benchmark_implementations", args)
    rows = run_sweep(jobs, run_options(args), writer, "benchmark_implementations", not args.no_progress)
    return finish(rows, writer, args)


# -- benchmark_backends -------------------------------------------------------------------
@script_main
def backends_main(argv=None) -> int:
    p = BenchParser(description="Every attention backend on dense attention: prefill and decode, "
                                "causal or not, GQA ratios, head dims, dtypes; plus torch.compile'd variants.")
    gpu = torch.cuda.is_available()
    add_common_args(p, seq_lengths="4096,16384" if gpu else "512", batch=1 if gpu else 1,
                    heads=16 if gpu else 4, head_dim=128 if gpu else 64)
    p.add_argument("--backends", type=str_list, default=None,
                   help="backends to run (default: all available; --backend works too)")
    p.add_argument("--scenarios", type=str_list, default="prefill,decode", help="prefill, decode (comma list)")
    p.add_argument("--kv-lengths", type=size_list, default=None, help="decode KV-cache lengths (default 2K..128K on GPU)")
    p.add_argument("--decode-batches", type=int_list, default=None)
    p.add_argument("--gqa-ratios", type=int_list, default=[1])
    p.add_argument("--head-dims", type=int_list, default=None)
    p.add_argument("--dtypes", type=str_list, default=None)
    p.add_argument("--no-compiled", action="store_true", help="skip the torch.compile rows")
    args = parse_with_config(p, argv, ["dense"], rejected={
        "segment_lengths": "dense attention has no schedule (benchmark_implementations.py runs the dilated ones)",
        "dilation_rates": "dense attention has no schedule (benchmark_implementations.py runs the dilated ones)",
        "floor": "the kernel floor is a dilated row's (benchmark_implementations.py --floor)",
        "baseline": "the baseline here is dense/sdpa"})
    if "backend" in args.given and "backends" in args.given:
        usage_error(p, "--backend and --backends: give one list of backends")
    for scenario in args.scenarios:
        if scenario not in ("prefill", "decode"):
            usage_error(p, f"--scenarios: unknown scenario {scenario!r} (choose from prefill, decode)")
    for ratio in args.gqa_ratios:
        if args.num_heads % ratio:
            usage_error(p, f"--gqa-ratios {ratio} must divide --num-heads {args.num_heads}")
    apply_quick(args, seq_lengths=[4096 if gpu else 256], kv_lengths=[8192] if gpu else [512], decode_batches=[1],
                reps=3, warmup=1)
    kv_lengths = args.kv_lengths or ([2048, 8192, 32768, 131072] if gpu else [512, 2048])
    batches = args.decode_batches or ([1, 8] if gpu else [1, 4])
    head_dims = args.head_dims or [args.head_dim]
    dtypes = args.dtypes or [default_dtype(args)]
    report = dilated.available_backends(args.device)
    print("backends on this device:")
    for name, reason in report.items():
        print(f"  {name:<15} {'available' if reason is None else 'unavailable: ' + reason}")
    chosen = args.backends or (args.backend if "backend" in args.given else None)
    names = chosen or [n for n, r in report.items() if r is None and n != "auto"]
    dense = get_implementation("dense")
    compiled = [] if args.no_compiled else [get_implementation("dense_compiled"), get_implementation("manual_compiled")]
    jobs = []
    for dtype in dtypes:
        for d in head_dims:
            for ratio in args.gqa_ratios:
                hkv = max(1, args.num_heads // ratio)
                base = dict(num_heads=args.num_heads, num_kv_heads=hkv, head_dim=d, dtype=dtype,
                            causal=args.causal, segment_lengths=None, dilation_rates=None)
                cases = []
                if "prefill" in args.scenarios:
                    cases += [Case(batch=args.batch_size, seq_len=n, mode=m, input_scale=s, **base)
                              for n in args.seq_lengths for m in args.mode for s in args.input_scales]
                if "decode" in args.scenarios:
                    cases += [Case(batch=b, seq_len=n, q_len=1, mode="fwd", input_scale=s, **base)
                              for n in kv_lengths for b in batches for s in args.input_scales]
                for case in cases:
                    jobs += [(dense, case, name) for name in names]
                    if case.q_len is None:
                        jobs += [(impl, case, "sdpa" if impl.name == "dense_compiled" else "manual") for impl in compiled]
    if args.inputs:  # captured tensors replace the generated scenarios
        jobs = _jobs(args, [dense], names, None, args.mode)
    args.baseline = "dense/sdpa"
    writer = open_writer("benchmark_backends", args)
    rows = run_sweep(jobs, run_options(args), writer, "benchmark_backends", not args.no_progress)
    return finish(rows, writer, args)


# -- benchmark_extreme_sequences ----------------------------------------------------------
EXTREME_SET = ["dilated", "improved", "improved_pool", "multihead", "dense"]
EXTREME_DISTRIBUTED = ["ring_zigzag", "distributed_dilated"]  # joined to "all" under torchrun


def find_max_length(run, start: int, granularity: int, limit: int, known_ok: int | None = None,
                    max_call_s: float | None = None) -> tuple[int | None, dict | None, str]:
    """Longest N in [start, limit] for which ``run(N)`` returns an ok row: doubling from ``start``,
    then bisection to ``granularity``; if ``start`` itself fails, bisection down to ``known_ok``.

    The search also stops growing once one call takes longer than ``max_call_s`` (then the answer
    is limited by time, not memory, and the returned note says so). Returns ``(N, row, note)``.
    """
    def ok(row):  # a result that failed its correctness check does not count
        return row["status"] == "ok" and not row.get("check_failed")

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


@script_main
def extreme_main(argv=None) -> int:
    from .cli import parse_size
    from .report import fit_exponent
    from . import env as envmod

    gpu = torch.cuda.is_available()
    p = BenchParser(description="Sequence length sweep (doubling) of dilated, improved, multihead and "
                                "dense attention; --find-max searches the longest sequence each one runs.")
    add_common_args(p, seq_lengths="1", batch=1, heads=16 if gpu else 4, head_dim=128 if gpu else 32)  # lengths come from --min/--max-seq-length
    p.add_argument("--min-seq-length", type=parse_size, default=parse_size("8k") if gpu else 256)
    p.add_argument("--max-seq-length", type=parse_size, default=parse_size("1M") if gpu else 4096)
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
    launched = _launched_world() > 1  # under torchrun/srun: the ring and distributed classes join "all"
    rank = 0
    if launched:
        from .distributed import DistributedImplementation

        rank, world, device = _init_for_benchmark(args)
        args.device = args.device or str(device)
    lead = rank == 0  # only rank 0 runs the single-device implementations, prints and writes
    if args.time_budget is None and gpu:
        args.time_budget = 5.0  # seconds per row (dense at 1M: ~15 s a call: its first call is its one sample)
    args.plot = not args.no_plot and _have_matplotlib()
    names = args.implementation
    if names == ["all"]:
        names = EXTREME_SET + (EXTREME_DISTRIBUTED if launched else [])
    impls = [get_implementation(n) for n in names]

    def here(impl):
        return lead or (launched and isinstance(impl, DistributedImplementation))
    lengths = []
    n = args.min_seq_length
    while n <= args.max_seq_length:
        lengths.append(n)
        n *= 2
    opts = run_options(args)
    if args.time_budget is None and not gpu:
        opts.reps, opts.warmup = min(opts.reps, 3), 1
    writer = open_writer("benchmark_extreme_sequences", args) if lead else None
    out = print if lead else (lambda *a, **k: None)
    out(f"dilated extreme-sequence sweep on {envmod.environment()['gpu'] or 'CPU'}"
        + (f" x {world} ranks" if launched else "") + f": N = {lengths[0]}..{lengths[-1]} (doubling), "
        f"implementations {names}, modes {args.mode}, B={args.batch_size} H={args.num_heads} D={args.head_dim}; "
        "each row checked against a reference.")
    jobs = [(impl, case, b) for case in _cases(args, lengths, args.mode) for impl in impls for b in args.backend
            if here(impl)]
    rows = run_sweep(jobs, opts, writer, "benchmark_extreme_sequences", lead and not args.no_progress,
                     extra_row=(lambda r: {"world_size": world if r["implementation"] in EXTREME_DISTRIBUTED else 1})
                     if launched else None)
    want_plot, args.plot = args.plot, False  # plotted at the end, with the --find-max rows
    status = finish(rows, writer, args) if lead else 0
    args.plot = want_plot
    out("\nscaling exponents (fit of log time and log memory against log N):")
    for impl in (impls if lead else []):
        for mode in args.mode:
            ok = [r for r in rows if r["implementation"] == impl.name and r["mode"] == mode and r["status"] == "ok"]
            if len(ok) >= 2:
                ns = [r["config"]["seq_len"] for r in ok]
                et = fit_exponent(ns, [r["time_ms"]["median"] for r in ok])
                em = fit_exponent(ns, [(r.get("memory") or {}).get("peak_above_inputs_mib") or 0 for r in ok])
                per_tok = ok[-1]["memory"]["peak_total_mib"] * (1 << 20) / ok[-1]["config"]["seq_len"]
                print(f"  {impl.name:<12} {mode:<8} time ~ N^{et:.2f}" + (f", memory ~ N^{em:.2f}" if em else "")
                      + f"; {per_tok:.0f} bytes/token total at N={ns[-1]}")
    if args.find_max:
        gran = args.granularity or max(1, args.max_seq_length // 16)
        out(f"\n--find-max: doubling from {args.max_seq_length}, then bisection to {gran} tokens")
        found, probes = [], []
        # a probe needs to run and be checked; a few timed calls are enough
        probe_opts = dataclasses.replace(opts, warmup=1, reps=min(opts.reps, 3), budget_s=None)
        for impl in [i for i in impls if here(i)]:
            for mode in args.mode:
                done = {r["config"]["seq_len"]: r for r in rows if r["implementation"] == impl.name
                        and r["mode"] == mode and r["status"] == "ok"}

                def run(n, impl=impl, mode=mode, done=done):
                    if n in done:  # measured by the sweep already
                        return done[n]
                    case = next(_cases(args, [n], [mode]))
                    r = run_sweep([(impl, case, args.backend[0])], probe_opts, writer, "benchmark_extreme_sequences",
                                  False, extra_row=lambda _: {"find_max": True})[0]
                    probes.append(r)
                    if launched and isinstance(impl, DistributedImplementation):  # every rank takes the same branch
                        ok = impl.reduce_max([0.0 if r["status"] == "ok" and not r.get("check_failed") else 1.0])[0]
                        if ok and r["status"] == "ok":
                            r = dict(r, status="error", reason="failed on another rank")
                    out(f"  {impl.name} {mode} N={n}: {r['status']}" + (f" ({r['reason'][:80]})" if r.get("reason") else "")
                          + (" CHECK FAILED: not counted" if r.get("check_failed") else ""))
                    return r
                swept = [r["config"]["seq_len"] for r in rows if r["implementation"] == impl.name
                         and r["mode"] == mode and r["status"] == "ok"]
                n, row, note = find_max_length(run, args.max_seq_length, gran, args.find_max_limit,
                                               known_ok=max(swept) if swept else None,
                                               max_call_s=args.max_call_seconds)
                if n is None:
                    out(f"  => {impl.name} {mode}: nothing ran at N >= {args.min_seq_length}")
                elif row is None:
                    out(f"  => {impl.name} {mode}: longest N = {n} (from the sweep; {note})")
                else:
                    mem = row["memory"]
                    out(f"  => {impl.name} {mode}: longest N = {n} (peak {mem['peak_total_mib']:.0f} MiB total, "
                          f"{mem['peak_above_inputs_mib']:.0f} MiB above inputs, "
                          f"{mem['peak_total_mib'] * (1 << 20) / n:.0f} bytes/token; {note})")
                found.append({"implementation": impl.name, "mode": mode, "max_seq_len": n, "note": note,
                              "memory": (row or {}).get("memory"), "backend": args.backend[0],
                              "config": (row or {}).get("config"), "check": (row or {}).get("check")})
        if lead:
            path = writer.path[:-len(".jsonl")] + "-find_max.json"
            write_json(path, {"granularity": gran, "max_call_seconds": args.max_call_seconds, "results": found})
            print(f"longest lengths: {path}")
            status = max(status, exit_status(probes, "--find-max probe"))
    if lead and args.plot and writer.rows:
        from .report import plot
        print("plots: " + ", ".join(plot(writer.path)))
    if lead:
        print(f"\nresults are in {writer.path}"
              + ("" if args.plot else f"; plot them with: python -m dilated.bench plot {writer.path}"))
    if launched:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    return status


# -- benchmark_distributed ----------------------------------------------------------------
DISTRIBUTED_SET = ["ring", "ring_zigzag", "distributed_dilated"]


def _launched_world() -> int:
    import os

    for var in ("WORLD_SIZE", "SLURM_NTASKS"):
        if var in os.environ:
            return int(os.environ[var])
    return 1


def _init_for_benchmark(args):
    """Join the torchrun/srun world (or a world of one when run plainly) with a timeout."""
    import os
    import socket

    from dilated.distributed import init_distributed

    if "RANK" not in os.environ and "SLURM_PROCID" not in os.environ:
        with socket.socket() as s:  # a plain run: a world of one on a free port
            s.bind(("127.0.0.1", 0))
            os.environ.setdefault("MASTER_PORT", str(s.getsockname()[1]))
    gpu = torch.cuda.is_available() and not (args.device or "").startswith("cpu")
    return init_distributed(timeout_s=args.timeout, backend=None if gpu else "gloo")


def distributed_args(description: str, default_impls: list[str]):
    gpu = torch.cuda.is_available()
    p = BenchParser(description=description)
    add_common_args(p, seq_lengths="128k" if gpu else "1024", batch=1, heads=16 if gpu else 4,
                    head_dim=128 if gpu else 32)
    p.add_argument("--implementations", type=str_list, default=default_impls)
    p.add_argument("--scaling", choices=["strong", "weak"], default="strong",
                   help="strong: --seq-lengths are global N; weak: --seq-lengths are tokens per rank")
    p.add_argument("--world-sizes", type=int_list, default=None,
                   help="run on ranks 0..P-1 for each P (default: the whole launched world)")
    add_timeout_arg(p)
    return p


def add_timeout_arg(p) -> None:
    p.add_argument("--timeout", type=positive_float, default=300.0,
                   help="process-group timeout in seconds: how long a rank waits for a dead or stuck peer "
                        "before the job ends naming it (default 300)")


@script_main
def distributed_main(argv=None, script="benchmark_distributed", default_impls=None, description=None,
                     one_process_baseline_only: bool = False) -> int:
    import torch.distributed as dist

    from .distributed import BASELINE_OF, distributed_schedule, run_scaling_sweep
    from .report import format_scaling

    p = distributed_args(description or "RingAttention (contiguous and zigzag) and DistributedDilatedAttention "
                         "under torchrun: strong or weak scaling against the single-device run of the same problem.",
                         default_impls or DISTRIBUTED_SET)
    args = parse_with_config(p, argv, implementation_names(distributed=True), rejected={
        "inputs": "distributed runs generate their shards; captured inputs are not supported here",
        "floor": "the kernel floor is timed on one device (benchmark_implementations.py --floor)",
        "cuda_graph": "distributed rows start every call on all ranks together, which a graph replay cannot",
        "baseline": "the baseline here is the single-device run of the same problem"})
    apply_quick(args, seq_lengths=[args.seq_lengths[0]], reps=3, warmup=1)
    sizes = args.world_sizes or [_launched_world()]
    if any(s > _launched_world() for s in sizes):
        usage_error(p, f"--world-sizes {sizes}: each must be at most the launched world size {_launched_world()}")
    rank, world, device = _init_for_benchmark(args)
    args.device = args.device or str(device)
    impls = [get_implementation(n) for n in args.implementations]
    if world == 1 and one_process_baseline_only:
        print("one process: only the single-device baseline is measured (a ring of one is not a ring); "
              "launch with torchrun --nproc_per_node=P to compare the rings")
        impls = []
    elif world == 1:
        print("one process: reporting the single-device baseline and the distributed classes on a world of 1; "
              "launch with torchrun --nproc_per_node=P for P ranks")
    dtype = default_dtype(args)

    def schedule(n):
        if args.segment_lengths:
            return _schedule(args, n)
        return distributed_schedule(n)

    def cases_for(p_, impl):
        out = []
        for n in args.seq_lengths:
            big_n = n * p_ if args.scaling == "weak" else n
            segs, dils = schedule(big_n) if impl.kind == "dilated" else (None, None)
            out += [Case(batch=args.batch_size, seq_len=big_n, num_heads=args.num_heads, head_dim=args.head_dim,
                         num_kv_heads=args.num_kv_heads, dtype=dtype, causal=args.causal, mode=m,
                         segment_lengths=segs, dilation_rates=dils, input_scale=s)
                    for m in args.mode for s in args.input_scales]
        return out

    def baseline_case(case, p_):
        n = case.seq_len if args.scaling == "strong" else case.seq_len // p_
        segs, dils = schedule(n) if case.segment_lengths else (None, None)
        return dataclasses.replace(case, seq_len=n, segment_lengths=segs, dilation_rates=dils)

    baselines = {kind: get_implementation(name) for kind, name in BASELINE_OF.items()}
    writer = open_writer(script, args) if rank == 0 else None
    if rank == 0:
        print(f"{script}: world {world} ({device.type}), P in {sizes}, {args.scaling} scaling, "
              f"N={args.seq_lengths}{' per rank' if args.scaling == 'weak' else ''}, {args.implementations}, "
              f"modes {args.mode}{', causal' if args.causal else ''}; baseline: the single-device run")
    if impls:
        rows = run_scaling_sweep(impls, baselines, cases_for, baseline_case, sizes, args.backend, run_options(args),
                                 writer, script, args.scaling, not args.no_progress)
    else:
        dense = get_implementation("dense")
        rows = run_sweep([(dense, c, b) for c in cases_for(1, dense) for b in args.backend], run_options(args),
                         writer, script, not args.no_progress,
                         lambda r: {"world_size": 1, "role": "baseline", "scaling": args.scaling,
                                    "tokens_per_rank": r["config"]["seq_len"]})
    table = format_scaling(rows, compare=script == "benchmark_ring_attention")  # the ring script: one comparison
    status = finish(rows, writer, args, table=table) if rank == 0 else 0
    dist.barrier()
    dist.destroy_process_group()
    return status


# -- benchmark_ring_attention -------------------------------------------------------------
RING_SET = ["ring", "ring_zigzag", "ring_zigzag_p2p", "ring_no_overlap", "ring_zigzag_no_overlap", "torch_cp", "ring_flash_attn",
            "ring_flash_attn_zigzag"]


@script_main
def ring_main(argv=None) -> int:
    return distributed_main(argv, "benchmark_ring_attention", RING_SET,
                            "Ring attention variants (layout, transport, overlap on/off) against PyTorch's context parallel "
                            "attention and ring-flash-attn where installed, with the single-device run as baseline.",
                            one_process_baseline_only=True)


# -- benchmark_flash_attention_3 ----------------------------------------------------------
HOPPER_CLASS = ["flash_attn_3", "flash_attn_4", "sdpa_cudnn", "flex"]
PREVIOUS_CLASS = ["flash_attn", "sdpa_flash", "manual"]


@script_main
def hopper_main(argv=None) -> int:
    from .report import format_speedups

    gpu = torch.cuda.is_available()
    p = BenchParser(description="Hopper-class kernels (flash-attn 3/4, cuDNN SDPA, flex_attention) "
                                "against the previous generation (flash-attn 2, SDPA flash, manual) on dense "
                                "attention and under ImprovedDilatedAttention.")
    add_common_args(p, seq_lengths="512,2k,8k,32k,64k" if gpu else "256", batch=1, heads=16 if gpu else 4,
                    head_dim=128 if gpu else 32, mode="fwd,fwd_bwd")
    p.add_argument("--head-dims", type=int_list, default=None, help="default 64,128,256 on a GPU")
    p.add_argument("--causal-modes", type=str_list, default="false,true",
                   help="false,true: both (--causal alone: true only)")
    p.add_argument("--implementations", type=str_list, default="dense,improved")
    p.add_argument("--backends", type=str_list, default=HOPPER_CLASS + PREVIOUS_CLASS,
                   help="kernels to compare (--backend works too)")
    args = parse_with_config(p, argv, implementation_names(distributed=False),
                             rejected={"baseline": "this script compares the Hopper class with the previous one"})
    for mode in args.causal_modes:
        if mode.lower() not in ("true", "false"):
            usage_error(p, f"--causal-modes: {mode!r} is not true or false")
    if "causal" in args.given and "causal_modes" in args.given:
        usage_error(p, "--causal and --causal-modes: give one")
    if "causal" in args.given:
        args.causal_modes = ["true" if args.causal else "false"]
    if "backend" in args.given and "backends" in args.given:
        usage_error(p, "--backend and --backends: give one list of backends")
    if "backend" in args.given:
        args.backends = args.backend
    if "head_dim" in args.given and "head_dims" in args.given:
        usage_error(p, "--head-dim and --head-dims: give one")
    if "head_dim" in args.given:
        args.head_dims = [args.head_dim]
    apply_quick(args, seq_lengths=[args.seq_lengths[0]], reps=3, warmup=1, head_dims=[args.head_dim])
    head_dims = args.head_dims or ([64, 128, 256] if gpu else [args.head_dim])
    report = dilated.available_backends(args.device)
    print("kernels on this device:")
    for name in args.backends:
        reason = report.get(name, "unknown backend")
        cls = "Hopper class" if name in HOPPER_CLASS else "previous class"
        print(f"  {name:<15} {cls:<15} {'available' if reason is None else 'unavailable: ' + reason}")
    names = [n for n in args.backends if report.get(n) is None]
    impls = [get_implementation(n) for n in args.implementations]
    jobs = []
    for d in head_dims:
        for causal in (c.lower() == "true" for c in args.causal_modes):
            jobs += _jobs(args, impls, names, args.seq_lengths, args.mode, head_dim=d, causal=causal)
    writer = open_writer("benchmark_flash_attention_3", args)
    rows = run_sweep(jobs, run_options(args), writer, "benchmark_flash_attention_3", not args.no_progress)
    status = finish(rows, writer, args)
    print(format_speedups(rows, HOPPER_CLASS, PREVIOUS_CLASS))
    return status
