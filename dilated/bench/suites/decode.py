"""``benchmark_decode.py``: decoding against a KV cache sharded over P ranks
(:func:`dilated.decode_attention`), latency per step (median and p99) at each cache length, batch
and P, beside the single-GPU decode of the whole cache where it fits.

Each rank of the first P holds ``S / P`` rows of the cache; the query tokens are the same on every
rank. A step is the local attention over the rank's rows and the one all-gather that merges them;
it is timed with CUDA events after warm-up, the L2 cache flushed before each step (in a model the
cache is read after other layers' work), the ranks starting each step together (a barrier) and a
step's time the slowest rank's; with ``--cuda-graph`` replays of the step captured in a
CUDA graph are timed instead, as serving engines run decode. Every row's output is checked once against float64
softmax over the whole cache (batch row 0, streamed over key blocks). A configuration that does
not fit is an ``oom`` row and the sweep goes on.
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

from ...parallel.decode_attention import decode_attention
from ...parallel.sharding import init_distributed
from ...reference import sampled_reference
from ..env import environment
from ..registry import Case
from ..results import ResultWriter
from ..sizes import size_list
from ..timing import measure_together, summarize
from .distributed import head_shapes

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _shard(seed: int, batch: int, rows: int, hkv: int, d: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``seed``'s k and v, batch row by batch row (batch row 0 alone can be drawn again)."""
    k, v = (torch.empty(batch, rows, hkv, d, device=device, dtype=dtype) for _ in range(2))
    for b in range(batch):
        g = torch.Generator(device).manual_seed(1000 * seed + b)
        k[b].copy_(torch.randn(rows, hkv, d, generator=g, device=device))
        v[b].copy_(torch.randn(rows, hkv, d, generator=g, device=device))
    return k, v


def _check(q, p: int, rows: int, hkv: int, d: int, device, dtype, out) -> dict:
    """``out``'s batch row 0 against float64 softmax over the whole cache (every shard drawn again)."""
    shards = [_shard(r, 1, rows, hkv, d, device, dtype) for r in range(p)]
    k, v = (torch.cat([s[i] for s in shards], 1) for i in (0, 1))
    ref = sampled_reference(q[:1], k, v, torch.arange(q.shape[1], device=device))
    err = ((out[:1].double() - ref).norm() / ref.norm()).item()
    tol = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}[dtype]
    return {"reference": "float64 softmax over the whole cache, batch row 0", "rel_err": err, "tolerance": tol,
            "passed": err < tol}


def _row(args, p, s, b, shape, group, rank, device, dtype) -> dict:
    h, hkv, d = shape
    case = Case(batch=b, seq_len=s, num_heads=h, num_kv_heads=hkv, head_dim=d, q_len=args.query_tokens,
                dtype=args.dtype, causal=False, mode="decode")  # seq_len: the cached tokens
    row = {"implementation": "decode", "backend": args.backend, "mode": "decode", "config": case.config(),
           "world_size": p, "cuda_graph": args.cuda_graph}
    rows = s // p
    try:
        q = torch.randn(b, args.query_tokens, h, d, generator=torch.Generator(device).manual_seed(7), device=device,
                        dtype=dtype)
        k, v = _shard(rank, b, rows, hkv, d, device, dtype)
        with torch.inference_mode():
            step = lambda: decode_attention(q, k, v, group, backend=args.backend)  # noqa: E731
            out = step()
            samples, own = measure_together(step, device, group, warmup=args.warmup, reps=args.reps,
                                            cuda_graph=args.cuda_graph)
    except torch.OutOfMemoryError as e:
        return {**row, "status": "oom", "reason": str(e).splitlines()[0]}
    medians = [torch.zeros(1, device=device) for _ in range(p)] if p > 1 else None
    if medians is not None:
        dist.all_gather(medians, torch.tensor([summarize(own)["median"]], device=device), group=group)
    row.update(status="ok", time_ms=summarize(samples), samples_ms=samples,
               rank_median_ms=[m.item() for m in medians] if medians else [summarize(samples)["median"]],
               kv_bytes_per_rank=2 * k.numel() * k.element_size())
    if rank == 0:
        del k, v
        torch.cuda.empty_cache() if device.type == "cuda" else None
        row["check"] = _check(q, p, rows, hkv, d, device, dtype, out)
    return row


def decode_main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cached-tokens", default="128k,1M,4M", help="cache lengths S, comma list (8k, 1M ...)")
    p.add_argument("--batch-sizes", default="1,8", help="sequences decoded together, comma list")
    p.add_argument("--query-tokens", type=int, default=1, help="query tokens per sequence and step")
    p.add_argument("--head-shapes", default="llama3-8b", help="H/Hkv/D or a model name, comma list")
    p.add_argument("--world-sizes", default=None, help="P values, each on ranks 0..P-1 (default 1 and the world)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--backend", default="auto")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--cuda-graph", action="store_true",
                   help="time replays of the step captured in a CUDA graph, as serving engines run decode (the "
                        "host's launches leave the step; every rank captures its collective)")
    p.add_argument("--output", required=True, help="results file (JSONL; refused if it exists)")
    args = p.parse_args(argv)
    if args.cuda_graph and not torch.cuda.is_available():
        p.error("--cuda-graph: CUDA graphs need a GPU")
    rank, world, device = init_distributed()
    sizes = [int(x) for x in (args.world_sizes or f"1,{world}").split(",")]
    bad = [x for x in sizes if not 1 <= x <= world]
    if bad:
        p.error(f"--world-sizes {bad}: each must be in 1..{world} (the launched world)")
    writer = ResultWriter(args.output) if rank == 0 else None
    env = environment()
    for ws in dict.fromkeys(sizes):
        group = dist.new_group(list(range(ws)))  # every rank takes part in making it
        for shape in head_shapes(args.head_shapes):
            for s in size_list(args.cached_tokens):
                for b in (int(x) for x in args.batch_sizes.split(",")):
                    if s % ws:
                        continue
                    if rank < ws:
                        row = _row(args, ws, s, b, shape, group, rank, device, DTYPES[args.dtype])
                        if rank == 0:
                            writer.append({**row, "env": env, "command": " ".join(sys.argv)})
                            print(_line(row), flush=True)
                    dist.barrier()
    dist.destroy_process_group()
    return 0


def _line(row: dict) -> str:
    c = row["config"]
    head = f"P={row['world_size']} S={c['seq_len']} B={c['batch']} H={c['num_heads']}/{c['num_kv_heads']}"
    if row["status"] != "ok":
        return f"{head}: {row['status']} ({row.get('reason')})"
    t = row["time_ms"]
    return (f"{head}: median {t['median'] * 1e3:.1f} us, p99 {t['p99'] * 1e3:.1f} us, rank medians "
            f"{[round(x * 1e3, 1) for x in row['rank_median_ms']]} us, check {row['check']['rel_err']:.1e} "
            f"{'ok' if row['check']['passed'] else 'FAILED'}")
