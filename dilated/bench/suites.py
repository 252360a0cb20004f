"""The sweeps behind the benchmark scripts: arguments in, (implementation, case, backend) jobs out."""
from __future__ import annotations

import argparse

import torch

import dilated

from .cli import (add_common_args, default_dtype, default_schedule, finish, open_writer, parse_with_config,
                  run_options, str_list)
from .registry import Case, get_implementation
from .runner import run_sweep


def _schedule(args, n):
    if args.segment_lengths:
        segs = tuple(min(w, n) for w in args.segment_lengths)
        dils = tuple(args.dilation_rates or [1] * len(segs))
        if len(dils) != len(segs):
            raise SystemExit("error: --dilation-rates needs one rate per --segment-lengths entry")
        return segs, tuple(min(r, w) for w, r in zip(segs, dils))
    return default_schedule(n)


def _cases(args, seq_lengths, modes, **overrides):
    dtype = default_dtype(args)
    for n in seq_lengths:
        segs, dils = _schedule(args, n)
        for mode in modes:
            kw = dict(batch=args.batch_size, seq_len=n, num_heads=args.num_heads, head_dim=args.head_dim,
                      num_kv_heads=args.num_kv_heads, dtype=dtype, causal=args.causal, mode=mode,
                      segment_lengths=segs, dilation_rates=dils)
            kw.update(overrides)
            yield Case(**kw)


# -- benchmark_implementations ------------------------------------------------------------
IMPLEMENTATION_SET = ["dense", "dilated", "improved", "improved_nocache", "improved_pool", "multihead",
                      "multihead_readable"]


def implementations_main(argv=None) -> int:
    p = argparse.ArgumentParser(description="DilatedAttention, ImprovedDilatedAttention (pattern cache and "
                                "memory pool on/off), MultiheadDilatedAttention (improved on/off) and dense "
                                "attention as the baseline, through the dilated.bench harness.")
    gpu = torch.cuda.is_available()
    add_common_args(p, seq_lengths="8192" if gpu else "1024")
    p.add_argument("--implementations", type=str_list, default=IMPLEMENTATION_SET)
    args = parse_with_config(p, argv)
    if args.quick:
        args.seq_lengths, args.reps, args.warmup = [min(args.seq_lengths[0], 2048 if gpu else 512)], 3, 1
    impls = [get_implementation(n) for n in args.implementations]
    args.baseline = args.baseline or "dense"
    jobs = [(impl, case, b) for case in _cases(args, args.seq_lengths, args.mode) for impl in impls
            for b in args.backend]
    writer = open_writer("benchmark_implementations", args)
    rows = run_sweep(jobs, run_options(args), writer, "benchmark_implementations", not args.no_progress)
    finish(rows, writer, args)
    return 0


# -- benchmark_backends -------------------------------------------------------------------
def backends_main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Every attention backend on dense attention: prefill and decode, "
                                "causal or not, GQA ratios, head dims, dtypes; plus torch.compile'd variants.")
    gpu = torch.cuda.is_available()
    add_common_args(p, seq_lengths="4096,16384" if gpu else "512", batch=1 if gpu else 1,
                    heads=16 if gpu else 4, head_dim=128 if gpu else 64)
    p.add_argument("--backends", type=str_list, default=None, help="backends to run (default: all available)")
    p.add_argument("--scenarios", type=str_list, default="prefill,decode")
    p.add_argument("--kv-lengths", type=lambda s: [int(x) for x in str_list(s)] if not isinstance(s, list) else s,
                   default=None, help="decode KV-cache lengths (default 2K..128K on GPU)")
    p.add_argument("--decode-batches", type=lambda s: [int(x) for x in str_list(s)], default=None)
    p.add_argument("--gqa-ratios", type=lambda s: [int(x) for x in str_list(s)], default=[1])
    p.add_argument("--head-dims", type=lambda s: [int(x) for x in str_list(s)], default=None)
    p.add_argument("--dtypes", type=str_list, default=None)
    p.add_argument("--no-compiled", action="store_true", help="skip the torch.compile rows")
    args = parse_with_config(p, argv)
    from .cli import size_list

    if isinstance(args.kv_lengths, str):
        args.kv_lengths = size_list(args.kv_lengths)
    if args.quick:
        args.seq_lengths = [min(args.seq_lengths[0], 4096 if gpu else 256)]
        args.kv_lengths = args.kv_lengths or ([8192] if gpu else [512])
        args.decode_batches = args.decode_batches or [1]
        args.reps, args.warmup = 3, 1
    kv_lengths = args.kv_lengths or ([2048, 8192, 32768, 131072] if gpu else [512, 2048])
    batches = args.decode_batches or ([1, 8] if gpu else [1, 4])
    head_dims = args.head_dims or [args.head_dim]
    dtypes = args.dtypes or [default_dtype(args)]
    report = dilated.available_backends(args.device)
    print("backends on this device:")
    for name, reason in report.items():
        print(f"  {name:<15} {'available' if reason is None else 'unavailable: ' + reason}")
    names = args.backends or [n for n, r in report.items() if r is None and n != "auto"]
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
                    cases += [Case(batch=args.batch_size, seq_len=n, mode=m, **base)
                              for n in args.seq_lengths for m in args.mode]
                if "decode" in args.scenarios:
                    cases += [Case(batch=b, seq_len=n, q_len=1, mode="fwd", **base)
                              for n in kv_lengths for b in batches]
                for case in cases:
                    jobs += [(dense, case, name) for name in names]
                    if case.q_len is None:
                        jobs += [(impl, case, "sdpa" if impl.name == "dense_compiled" else "manual") for impl in compiled]
    args.baseline = args.baseline or "dense/sdpa"
    writer = open_writer("benchmark_backends", args)
    rows = run_sweep(jobs, run_options(args), writer, "benchmark_backends", not args.no_progress)
    finish(rows, writer, args)
    return 0
