"""``benchmark_backends.py``: every attention backend on dense attention, prefill and decode."""
from __future__ import annotations

import dilated

from ..cli import (BenchParser, add_common_args, apply_quick, default_dtype, devices_of, int_list, parse_with_config,
                   positive_int, run_options, runs_on_gpus, size_list, str_list, usage_error)
from ..output import finish, open_writer, script_main
from ..registry import Case, get_implementation
from ..runner import run_sweep
from .common import jobs_of


@script_main
def backends_main(argv=None) -> int:
    p = BenchParser(description="Every attention backend on dense attention: prefill and decode, "
                                "causal or not, GQA ratios, head dims, dtypes; plus torch.compile'd variants.")
    p.several_devices = True
    gpu = runs_on_gpus(argv)
    add_common_args(p, seq_lengths="4096,16384" if gpu else "512", batch=1 if gpu else 1,
                    heads=16 if gpu else 4, head_dim=128 if gpu else 64)
    p.add_argument("--backends", type=str_list, default=None,
                   help="backends to run (default: all available; --backend works too)")
    p.add_argument("--scenarios", type=str_list, default="prefill,decode", help="prefill, decode (comma list)")
    p.add_argument("--kv-seq-lengths", "--kv-lengths", type=size_list, default=None, dest="kv_seq_lengths",
                   help="key/value lengths: decode's KV cache (default 2K..128K on a GPU) and, given, prefill's "
                        "too (each --seq-lengths query length against each of these, causal bottom-right aligned)")
    p.add_argument("--head-dim-v", type=positive_int, default=None,
                   help="v's head_dim where it differs from q's and k's (kernels that need them equal: unsupported rows)")
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
    apply_quick(args, seq_lengths=[4096 if gpu else 256], decode_batches=[1], reps=3, warmup=1)
    default_kv = ([8192] if gpu else [512]) if args.quick else ([2048, 8192, 32768, 131072] if gpu else [512, 2048])
    kv_lengths = args.kv_seq_lengths or default_kv
    batches = args.decode_batches or ([1, 8] if gpu else [1, 4])
    head_dims = args.head_dims or [args.head_dim]
    dtypes = args.dtypes or [default_dtype(args)]
    args.baseline = "dense/sdpa"
    writer = open_writer("benchmark_backends", args)
    rows = []
    for device in devices_of(args):
        jobs = _jobs_on(device, args, kv_lengths, batches, head_dims, dtypes)
        rows += run_sweep(jobs, run_options(args, device), writer, "benchmark_backends", not args.no_progress)
    return finish(rows, writer, args)


def _jobs_on(device, args, kv_lengths, batches, head_dims, dtypes) -> list:
    """The rows to run on ``device``: each available (or chosen) backend on each scenario."""
    report = dilated.available_backends(device)
    print(f"backends on {device or 'this device'}:")
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
                            causal=args.causal, segment_lengths=None, dilation_rates=None, head_dim_v=args.head_dim_v)
                cases = []
                if "prefill" in args.scenarios:  # q and kv of one length, or each length against each kv length
                    pairs = [(n, None) for n in args.seq_lengths] if not args.kv_seq_lengths else \
                        [(m, n if n != m else None) for n in args.seq_lengths for m in args.kv_seq_lengths]
                    cases += [Case(batch=args.batch_size, seq_len=kv, q_len=nq, mode=m, input_scale=s, **base)
                              for kv, nq in pairs for m in args.mode for s in args.input_scales]
                if "decode" in args.scenarios:
                    cases += [Case(batch=b, seq_len=n, q_len=1, mode="fwd", input_scale=s, **base)
                              for n in kv_lengths for b in batches for s in args.input_scales]
                for case in cases:
                    jobs += [(dense, case, name) for name in names]
                    if case.q_len is None and case.head_dim_v is None:
                        jobs += [(impl, case, "sdpa" if impl.name == "dense_compiled" else "manual") for impl in compiled]
    if args.inputs:  # captured tensors replace the generated scenarios
        jobs = jobs_of(args, [dense], names, None, args.mode)
    return jobs
