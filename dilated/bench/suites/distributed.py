"""``benchmark_distributed.py`` and ``benchmark_ring_attention.py``: runs across ranks, with the
launch helpers (the torchrun/srun world, the process-group timeout)."""
from __future__ import annotations

import dataclasses

import torch

from ..cli import (BenchParser, add_common_args, apply_quick, default_dtype, int_list, parse_with_config, run_options,
                   str_list, usage_error)
from ..documents import parse_spec
from ..output import finish, open_writer, script_main
from ..registry import Case, get_implementation, implementation_names
from ..runner import run_sweep
from .common import init_for_benchmark, launched_world, schedule_of, add_timeout_arg

DISTRIBUTED_SET = ["ring", "ring_zigzag", "distributed_dilated"]


#: head shapes of models people train with long context: (heads, kv heads, head dim)
MODEL_HEADS = {"llama3-8b": (32, 8, 128), "llama3-70b": (64, 8, 128)}


def head_shapes(text: str) -> list[tuple[int, int, int]]:
    """``16/16/128,llama3-8b`` -> ``[(16, 16, 128), (32, 8, 128)]`` (a usage error names the forms)."""
    import argparse

    shapes = []
    for item in str(text).split(","):
        item = item.strip().lower()
        if item in MODEL_HEADS:
            shapes.append(MODEL_HEADS[item])
            continue
        try:
            h, hkv, d = (int(x) for x in item.split("/"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r}: give H/Hkv/D (e.g. 32/8/128) or one of "
                                             f"{', '.join(MODEL_HEADS)}") from None
        if min(h, hkv, d) <= 0 or h % hkv:
            raise argparse.ArgumentTypeError(f"{item!r}: positive sizes with Hkv dividing H")
        shapes.append((h, hkv, d))
    return shapes


def doc_specs(text: str) -> list[str]:
    """``--doc-lengths``: one spec or several separated by ``;``, each checked (a usage error names
    the forms)."""
    import argparse

    specs = [s.strip() for s in text.split(";")]
    try:
        for spec in specs:
            parse_spec(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return specs


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
    p.add_argument("--head-shapes", type=head_shapes, default=None, metavar="SHAPES",
                   help="several head shapes in one run, each H/Hkv/D or a model name: e.g. 16/16/128,llama3-8b "
                        "(llama3-8b = 32/8/128); default: --num-heads, --num-kv-heads, --head-dim")
    p.add_argument("--doc-lengths", type=doc_specs, default=None, metavar="SPEC",
                   help="packed documents (dense attention): fixed:8k, uniform:1k-64k or lognormal:MEAN,SIGMA, drawn "
                        "with a fixed seed and packed up to N; attention and FLOPs stay within documents. #K after a "
                        "spec is another draw (a new document mix); several specs separated by ';' are rows one "
                        "after another (e.g. 'lognormal:8k,1.0#1;lognormal:8k,1.0#2': each row's first_call_ms is "
                        "the first call at a new mix)")
    add_timeout_arg(p)
    return p


@script_main
def distributed_main(argv=None, script="benchmark_distributed", default_impls=None, description=None,
                     one_process_baseline_only: bool = False) -> int:
    import torch.distributed as dist

    from ..distributed import ScalingSweep, distributed_schedule, run_scaling_sweep
    from ..strategies import BASELINE_OF
    from ..report import format_scaling

    p = distributed_args(description or "RingAttention (contiguous and zigzag) and DistributedDilatedAttention "
                         "under torchrun: strong or weak scaling against the single-device run of the same problem.",
                         default_impls or DISTRIBUTED_SET)
    args = parse_with_config(p, argv, implementation_names(distributed=True), rejected={
        "inputs": "distributed runs generate their shards; captured inputs are not supported here",
        "floor": "the kernel floor is timed on one device (benchmark_implementations.py --floor)",
        "cuda_graph": "distributed rows start every call on all ranks together, which a graph replay cannot",
        "baseline": "the baseline here is the single-device run of the same problem"})
    clash = [f"--{d.replace('_', '-')}" for d in ("num_heads", "num_kv_heads", "head_dim") if d in args.given]
    if args.head_shapes and clash:
        usage_error(p, f"--head-shapes and {', '.join(clash)}: give the heads one way")
    apply_quick(args, seq_lengths=[args.seq_lengths[0]], reps=3, warmup=1)
    sizes = args.world_sizes or [launched_world()]
    if any(s > launched_world() for s in sizes):
        usage_error(p, f"--world-sizes {sizes}: each must be at most the launched world size {launched_world()}")
    rank, world, device = init_for_benchmark(args)
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
            return schedule_of(args, n)
        return distributed_schedule(n)

    shapes = args.head_shapes or [(args.num_heads, args.num_kv_heads or args.num_heads, args.head_dim)]

    def cases_for(p_, impl):
        out = []
        for n in args.seq_lengths:
            big_n = n * p_ if args.scaling == "weak" else n
            segs, dils = schedule(big_n) if impl.problem.needs_schedule else (None, None)
            mixes = [None] if impl.problem.needs_schedule or not args.doc_lengths else args.doc_lengths
            out += [Case(batch=args.batch_size, seq_len=big_n, num_heads=h, head_dim=d,
                         num_kv_heads=None if hkv == h else hkv, dtype=dtype, causal=args.causal, mode=m,
                         segment_lengths=segs, dilation_rates=dils, input_scale=s, documents=docs)
                    for h, hkv, d in shapes for m in args.mode for s in args.input_scales
                    for docs in mixes]  # documents: dense attention's
        return out

    def baseline_case(case, p_):
        n = case.seq_len if args.scaling == "strong" else case.seq_len // p_
        segs, dils = schedule(n) if case.segment_lengths else (None, None)
        return dataclasses.replace(case, seq_len=n, segment_lengths=segs, dilation_rates=dils)  # documents kept

    baselines = {problem: get_implementation(name) for problem, name in BASELINE_OF.items()}
    writer = open_writer(script, args) if rank == 0 else None
    if rank == 0:
        print(f"{script}: world {world} ({device.type}), P in {sizes}, {args.scaling} scaling, "
              f"N={args.seq_lengths}{' per rank' if args.scaling == 'weak' else ''}, {args.implementations}, "
              f"modes {args.mode}{', causal' if args.causal else ''}; baseline: the single-device run")
    if impls:
        sweep = ScalingSweep(impls, baselines, cases_for, baseline_case, sizes, args.backend, args.scaling)
        rows = run_scaling_sweep(sweep, run_options(args), writer, script, not args.no_progress)
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
RING_SET = ["ring", "ring_zigzag", "ring_zigzag_p2p", "ring_no_overlap", "ring_zigzag_no_overlap", "ulysses",
            "ulysses_no_overlap", "hybrid",
            "torch_cp", "ring_flash_attn", "ring_flash_attn_zigzag", "yunchang_usp", "yunchang_ulysses"]


@script_main
def ring_main(argv=None) -> int:
    return distributed_main(argv, "benchmark_ring_attention", RING_SET,
                            "Every context-parallel strategy on one problem: ring attention variants (layout, transport, "
                            "overlap on/off), Ulysses, the Ulysses x ring hybrid, PyTorch's context parallel attention "
                            "and ring-flash-attn and yunchang (USP, Ulysses) where installed, with the single-device run as "
                            "baseline.",
                            one_process_baseline_only=True)
