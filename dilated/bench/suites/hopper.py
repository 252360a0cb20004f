"""``benchmark_flash_attention_3.py``: Hopper-class kernels against the previous generation."""
from __future__ import annotations

import dilated

from ..cli import (BenchParser, add_common_args, apply_quick, int_list, parse_with_config, run_options, runs_on_gpus,
                   str_list, usage_error)
from ..output import finish, open_writer, script_main
from ..registry import get_implementation, implementation_names
from ..runner import run_sweep
from .common import jobs_of

HOPPER_CLASS = ["flash_attn_3", "flash_attn_4", "sdpa_cudnn", "flex"]
PREVIOUS_CLASS = ["flash_attn", "sdpa_flash", "manual"]
QUANTIZED = ["sageattention", "sdpa_fp8"]  # forward only, not exact: its error against float64 is in each row


@script_main
def hopper_main(argv=None) -> int:
    from ..report import format_speedups

    gpu = runs_on_gpus(argv)
    p = BenchParser(description="Hopper-class kernels (flash-attn 3/4, cuDNN SDPA, flex_attention) "
                                "against the previous generation (flash-attn 2, SDPA flash, manual) on dense "
                                "attention and under ImprovedDilatedAttention.")
    add_common_args(p, seq_lengths="512,2k,8k,32k,64k" if gpu else "256", batch=1, heads=16 if gpu else 4,
                    head_dim=128 if gpu else 32, mode="fwd,fwd_bwd")
    p.add_argument("--head-dims", type=int_list, default=None, help="default 64,128,256 on a GPU")
    p.add_argument("--causal-modes", type=str_list, default="false,true",
                   help="false,true: both (--causal alone: true only)")
    p.add_argument("--implementations", type=str_list, default="dense,improved")
    p.add_argument("--backends", type=str_list, default=HOPPER_CLASS + PREVIOUS_CLASS + QUANTIZED,
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
        cls = "Hopper class" if name in HOPPER_CLASS else "quantized" if name in QUANTIZED else "previous class"
        print(f"  {name:<15} {cls:<15} {'available' if reason is None else 'unavailable: ' + reason}")
    names = [n for n in args.backends if report.get(n) is None]
    impls = [get_implementation(n) for n in args.implementations]
    jobs = []
    for d in head_dims:
        for causal in (c.lower() == "true" for c in args.causal_modes):
            jobs += jobs_of(args, impls, names, args.seq_lengths, args.mode, head_dim=d, causal=causal)
    writer = open_writer("benchmark_flash_attention_3", args)
    rows = run_sweep(jobs, run_options(args), writer, "benchmark_flash_attention_3", not args.no_progress)
    status = finish(rows, writer, args)
    print(format_speedups(rows, HOPPER_CLASS, PREVIOUS_CLASS))
    return status
