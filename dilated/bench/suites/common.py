"""What the sweeps share: the schedule of a length, the cases of the arguments, the jobs."""
from __future__ import annotations

import dataclasses
import sys

import torch

from ..cli import default_dtype, default_schedule, positive_float
from ..captured import captured_case, load_captured
from ..registry import Case


def schedule_of(args, n):
    if args.segment_lengths:
        segs = tuple(min(w, n) for w in args.segment_lengths)
        dils = tuple(args.dilation_rates or [1] * len(segs))
        return segs, tuple(min(r, w) for w, r in zip(segs, dils))  # a segment clipped to N keeps r <= w
    return default_schedule(n, *getattr(args, "default_schedule", ()))


def cases_of(args, seq_lengths, modes, **overrides):
    dtype = default_dtype(args)
    for n in seq_lengths:
        segs, dils = schedule_of(args, n)
        for mode in modes:
            for scale in args.input_scales:
                kw = dict(batch=args.batch_size, seq_len=n, num_heads=args.num_heads, head_dim=args.head_dim,
                          num_kv_heads=args.num_kv_heads, dtype=dtype, causal=args.causal, mode=mode,
                          segment_lengths=segs, dilation_rates=dils, input_scale=scale)
                kw.update(overrides)
                yield Case(**kw)


def jobs_of(args, impls, backends, seq_lengths, modes, **overrides):
    """(implementation, case, backend[, captured]) for every combination; from ``--inputs`` when given.
    ``overrides`` replace case fields taken from ``args`` (generated inputs only)."""
    if not args.inputs:
        return [(impl, case, b) for case in cases_of(args, seq_lengths, modes, **overrides) for impl in impls
                for b in backends]
    jobs = []
    try:
        for cap in load_captured(args.inputs):
            for mode in modes:
                case = captured_case(cap, args.num_heads, mode=mode, causal=args.causal, dtype=args.dtype)
                segs, dils = schedule_of(args, case.seq_len)
                case = dataclasses.replace(case, segment_lengths=segs, dilation_rates=dils)
                jobs += [(impl, case, b, cap) for impl in impls for b in backends]
    except ValueError as e:  # a usage error: one line, exit 2 (as the parser's)
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    return jobs


def launched_world() -> int:
    import os

    for var in ("WORLD_SIZE", "SLURM_NTASKS"):
        if var in os.environ:
            return int(os.environ[var])
    return 1


def init_for_benchmark(args):
    """Join the torchrun/srun world (or a world of one when run plainly) with a timeout."""
    import os
    import socket

    from dilated.parallel.sharding import init_distributed

    if "RANK" not in os.environ and "SLURM_PROCID" not in os.environ:
        with socket.socket() as s:  # a plain run: a world of one on a free port
            s.bind(("127.0.0.1", 0))
            os.environ.setdefault("MASTER_PORT", str(s.getsockname()[1]))
    gpu = torch.cuda.is_available() and not (args.device or "").startswith("cpu")
    return init_distributed(timeout_s=args.timeout, backend=None if gpu else "gloo")


def add_timeout_arg(p) -> None:
    p.add_argument("--timeout", type=positive_float, default=300.0,
                   help="process-group timeout in seconds: how long a rank waits for a dead or stuck peer "
                        "before the job ends naming it (default 300)")
