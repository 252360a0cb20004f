"""The ``calibrate`` and ``plan`` subcommands of ``dilated-bench``."""
from __future__ import annotations

import json
import math
import sys

from ..cli import nonnegative_float, positive_float, positive_int
from ..sizes import parse_size
from .calibration import Calibration
from .kernel_model import KernelModel
from .network import InterNode, Network
from .plan import candidates, format_plan, label, recommend
from .schedules import Model, Problem
from .validate import validate


def add_calibrate_parser(sub):
    from ..suites.distributed import head_shapes

    c = sub.add_parser("calibrate", help="measure this GPU type's kernels and links for the planner (under torchrun "
                                         "with 2 or more GPUs of one node for the links)")
    c.add_argument("--out", required=True, help="the calibration file to write (JSON)")
    c.add_argument("--head-shapes", type=head_shapes, default=head_shapes("llama3-8b,16/16/128"), metavar="SHAPES",
                   help="head shapes whose kernels are timed, H/Hkv/D or a model name (default llama3-8b,16/16/128); "
                        "the planner reads a shape's head dim and GQA ratio, any head count")
    c.add_argument("--longest", type=parse_size, default=parse_size("64k"),
                   help="the longest calls timed (default 64k; longer calls take its rate)")
    c.add_argument("--backend", default="auto", help="the local kernel the calibration times (default auto)")
    return c


def add_plan_parser(sub):
    from ..suites.distributed import doc_specs, head_shapes

    p = sub.add_parser("plan", help="predict every context-parallel strategy and grid for a cluster, or validate the "
                                    "model against a run (--validate)")
    p.add_argument("--calibration", required=True, help="a file written by dilated-bench calibrate")
    p.add_argument("--heads", type=head_shapes, default=head_shapes("llama3-8b"), metavar="SHAPE",
                   help="H/Hkv/D or a model name (default llama3-8b = 32/8/128)")
    p.add_argument("--seq-len", type=parse_size, default=parse_size("1M"),
                   help="global tokens (decode: cached tokens); default 1M")
    p.add_argument("--doc-lengths", type=doc_specs, default=None, metavar="SPEC",
                   help="packed documents, as the benchmarks take them (e.g. lognormal:8k,1.0)")
    p.add_argument("--mode", choices=["fwd", "fwd_bwd", "decode"], default="fwd_bwd")
    p.add_argument("--non-causal", action="store_true", help="attention without the causal mask")
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--query-tokens", type=positive_int, default=1, help="decode: query tokens per step")
    p.add_argument("--cuda-graph", action="store_true",
                   help="decode: each step replayed from a CUDA graph, as serving engines run decode (default: "
                        "called from Python, the host's launches included)")
    p.add_argument("--gpus", type=positive_int, default=None,
                   help="GPUs in all (default: --gpus-per-node x --nodes); past one node, whole nodes of "
                        "--gpus-per-node")
    p.add_argument("--gpus-per-node", type=positive_int, default=8)
    p.add_argument("--nodes", type=positive_int, default=None, help="nodes (default 1, or as --gpus needs)")
    p.add_argument("--inter-node-gbs", type=positive_float, default=None,
                   help="bandwidth between nodes per GPU, GB/s one way (e.g. 50 for 400 Gb/s InfiniBand per GPU); "
                        "needed for more than one node")
    p.add_argument("--inter-node-latency-us", type=nonnegative_float, default=10.0)
    p.add_argument("--inter-node-calibration", default=None, metavar="CAL.json",
                   help="links between nodes as measured: a calibration run with one GPU on each of two or more nodes "
                        "(instead of --inter-node-gbs)")
    p.add_argument("--validate", nargs="+", default=None, metavar="RESULTS.jsonl",
                   help="print predicted beside measured for every row of these runs the model covers")
    p.add_argument("--json", default=None, help="also write the predictions to this file")
    return p


def run_calibrate(args) -> int:
    import torch
    import torch.distributed as dist

    from ..suites.common import launched_world
    from .measure import calibrate

    if not torch.cuda.is_available():
        print("calibrate measures GPUs: no CUDA device here", file=sys.stderr)
        return 2
    world = launched_world()
    if world > 1:
        from ...parallel.sharding import init_distributed

        _, _, device = init_distributed(timeout_s=1800.0)
    else:
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    rank = dist.get_rank() if dist.is_initialized() else 0
    log = print if rank == 0 else (lambda *_: None)
    cal = calibrate(args.head_shapes, args.longest, device, args.backend, " ".join(sys.argv), log=log)
    if rank == 0:
        cal.save(args.out)
        print(cal.describe())
        print(f"wrote {args.out}")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


def _model(args, cal: Calibration, parser) -> Model:
    inter = None
    if args.inter_node_gbs is not None and args.inter_node_calibration:
        parser.error("--inter-node-gbs and --inter-node-calibration: give the links between nodes one way")
    if args.inter_node_gbs is not None:
        inter = InterNode(args.inter_node_gbs, args.inter_node_latency_us)
    elif args.inter_node_calibration:
        try:
            inter = InterNode.measured(Calibration.load(args.inter_node_calibration), args.inter_node_calibration)
        except ValueError as e:
            parser.error(str(e))
    return Model(KernelModel(cal), Network(cal, args.gpus_per_node, inter))


def _world(args, parser) -> int:
    """The GPUs planned for: ``--gpus`` (one node of them, or whole nodes of ``--gpus-per-node``), else
    ``--gpus-per-node`` x ``--nodes``; sets ``args.nodes``. A usage error where they disagree."""
    if args.gpus is None:
        args.nodes = args.nodes or 1
        return args.gpus_per_node * args.nodes
    nodes = -(-args.gpus // args.gpus_per_node)
    if args.gpus > args.gpus_per_node and args.gpus % args.gpus_per_node:
        parser.error(f"--gpus {args.gpus}: past one node the GPUs fill whole nodes of --gpus-per-node "
                     f"{args.gpus_per_node}; give a multiple of it")
    if args.nodes is not None and args.nodes != nodes:
        parser.error(f"--gpus {args.gpus} with --gpus-per-node {args.gpus_per_node} is {nodes} node(s), not "
                     f"--nodes {args.nodes}: give two of the three")
    args.nodes = nodes
    return args.gpus


def run_plan(args, parser) -> int:
    try:
        cal = Calibration.load(args.calibration)
    except ValueError as e:
        parser.error(str(e))
    if args.validate:  # runs of one node: its ranks share the calibrated links (validate leaves out the others)
        args.gpus_per_node = 1 << 30
        text, checks = validate(_model(args, cal, parser), args.validate, args.calibration)
        print(f"calibration: {cal.describe()}\n")
        print(text)
        if args.json:
            _write(args.json, [{"implementation": c.row["implementation"], "world_size": c.row.get("world_size", 1),
                                "config": c.row["config"], "measured_ms": c.measured_ms,
                                "predicted_ms": c.prediction.time_ms if c.prediction else None,
                                "skipped": c.skipped} for c in checks])
        return 0
    if len(args.heads) != 1:
        parser.error("--heads: one shape for a plan")
    h, hkv, d = args.heads[0]
    doc = args.doc_lengths[0] if args.doc_lengths else None
    if args.doc_lengths and len(args.doc_lengths) > 1:
        parser.error("--doc-lengths: one spec for a plan")
    if args.mode == "decode" and doc:
        parser.error("--doc-lengths: decode reads one cache per sequence; leave it out")
    if args.cuda_graph and args.mode != "decode":
        parser.error("--cuda-graph: for --mode decode only")
    world = _world(args, parser)
    if world > 1 and not cal.links:
        parser.error(f"--calibration {args.calibration}: it holds no link times (calibrated on one GPU), so it plans "
                     "one GPU only: calibrate under torchrun with 2 or more GPUs of one node to plan for more")
    if args.nodes > 1 and args.inter_node_gbs is None and not args.inter_node_calibration:
        parser.error(f"{world} GPUs over {args.nodes} nodes of {args.gpus_per_node}: give --inter-node-gbs (per-GPU "
                     "bandwidth between nodes, GB/s) or "
                     "--inter-node-calibration")
    problem = Problem(args.seq_len, h, hkv, d, causal=not args.non_causal, mode=args.mode, batch=args.batch,
                      documents=doc, query_tokens=args.query_tokens, cuda_graph=args.cuda_graph)
    model = _model(args, cal, parser)
    preds = candidates(model, problem, world)
    best, why = recommend(preds, cal.memory_gib)
    one = model.single_device(problem) if args.mode != "decode" else None
    assumptions = [f"calibration: {cal.describe()}", f"network: {model.network.describe()}",
                   "kernel times: each call's FLOPs at the rate calibrated for its length and size (head dim and "
                   "GQA ratio as calibrated)" + _distributed_terms(model),
                   "within a node every GPU moves its bytes at the calibrated per-GPU rate whatever the group size; "
                   "a group across nodes is limited by the per-GPU link between nodes, and its all-gathers and "
                   "reduce-scatters (rings of P - 1 steps) pay the link's latency at every step",
                   "memory: the schedule's tensors (shards, gradients, buffers in flight) and the largest documents "
                   "call's gathered rows, not kernels' workspaces or the allocator's slack; "
                   f"fits if at most {cal.memory_gib:.0f} GiB"]
    if one is not None and math.isfinite(one.time_ms):
        assumptions.append(f"one GPU would take {one.time_ms:.1f} ms for the whole problem (if it fit); "
                           f"the recommendation's speed-up over it: "
                           f"{one.time_ms / best.time_ms:.1f}x on {world} GPUs" if best else "")
    print(format_plan(preds, problem, world, best, why, [a for a in assumptions if a]))
    if args.json:
        _write(args.json, {"problem": problem.__dict__, "world": world, "recommended": label(best) if best else None,
                           "why": why, "assumptions": assumptions,
                           "predictions": [{"strategy": label(p), "time_ms": p.time_ms,
                                            "tflops_per_gpu": p.tflops_per_gpu,
                                            "exposed_fraction": p.exposed_fraction, "memory_gib": p.memory_gib,
                                            "bytes_sent": p.bytes_sent, "reason": p.reason} for p in preds]})
    return 0


def _distributed_terms(model: Model) -> str:
    """What the plan adds to the kernels and bytes of a distributed call, from the calibration."""
    pace = (f"; on several GPUs every kernel at the pace of the calibration's slowest GPU ({model.pace:.3f}x the "
            "ranks' mean; a cluster's slowest GPU may be slower)") if model.pace != 1.0 else ""
    timed = model.kernels.calibration.strategies
    if not timed:
        return pace + "; the host not modelled (the calibration timed no strategy calls)"
    slow = [f"{x.strategy} {x.mode} {x.ms:.1f} ms" for x in timed
            if model.floor_ms(x.strategy, Problem.timed(x), x.ranks)]
    return (f"{pace}; the host not modelled: a call takes at least its strategy's calibrated call on "
            f"{timed[0].ranks} ranks of {timed[0].seq_len // timed[0].ranks} rows where that was slower than "
            f"modelled, for calls of its kind with as much work per rank or more ({', '.join(slow) or 'none was'})")


def _write(path: str, data) -> None:
    from ..results import write_json

    write_json(path, json.loads(json.dumps(data, default=str)))
