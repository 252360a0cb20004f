"""A rank's local varlen call (every piece of a document layout against itself, causal) timed with
its pieces in several orders, forward and backward apart, on one GPU: the order a rank's shard
holds its pieces in is the order of the varlen call's sequences, which decides when the kernel's
longest tiles start. For each rank of ``DocumentLayout.balance`` of a document mix over P ranks:
the pieces in sequence order (the layout's), longest first, longest last, and in two calls (the
pieces of at least a quarter of the longest, then the others); the orders timed in turns (CUDA
events after warm-up, L2 flushed), median and spread, and the (query, key) pairs per nanosecond.

    python benchmarks/specialized/time_piece_order.py --backend flash_attn_4
    python benchmarks/specialized/time_piece_order.py --doc-lengths lognormal:8k,1.0 --seq-len 256k --world-size 2
"""
import argparse

import torch

from dilated.backends.varlen import varlen_kernel_of_shape
from dilated.bench.documents import add_layout_args, cu_seqlens_of
from dilated.bench.sizes import parse_size
from dilated.bench.timing import measure_side_by_side, summarize
from dilated.packed import varlen_backward, varlen_forward
from dilated.parallel.document_layout import DocumentLayout, piece_work


def _orders(lengths: list[int]) -> dict:
    """``name -> [call, ...]``, each call the piece lengths it runs in its order."""
    longest = max(lengths)
    long = [m for m in lengths if 4 * m >= longest]
    return {"sequence": [lengths],
            "longest first": [sorted(lengths, reverse=True)],
            "longest last": [sorted(lengths)],
            "two calls": [long, [m for m in lengths if 4 * m < longest]]}


def _calls(kernel, calls, heads: int, kv_heads: int, device, scale: float):
    """``(forward, backward)`` steps of the varlen calls ``calls`` (lists of piece lengths) on fresh
    random inputs, the backward from saved outputs."""
    made = []
    for lengths in calls:
        if not lengths:
            continue
        n = sum(lengths)
        cu = [0]
        for m in lengths:
            cu.append(cu[-1] + m)
        q = torch.randn(1, n, heads, 128, device=device, dtype=torch.bfloat16)
        k, v = (torch.randn(1, n, kv_heads, 128, device=device, dtype=torch.bfloat16) for _ in range(2))
        out, lse = varlen_forward(kernel, q, k, v, cu, True, scale)
        dout = torch.randn_like(out)
        made.append((q, k, v, cu, (dout, q, k, v, out, lse)))

    def forward():
        for q, k, v, cu, _ in made:
            varlen_forward(kernel, q, k, v, cu, True, scale)

    def backward():
        for _, _, _, cu, saved in made:
            varlen_backward(kernel, saved, cu, True, scale)
    return forward, backward


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_layout_args(p)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    device = torch.device("cuda")
    n = parse_size(args.seq_len)
    layout = DocumentLayout.balance(cu_seqlens_of(args.doc_lengths, n), args.world_size)
    print(f"{torch.cuda.get_device_name(device)}; {args.doc_lengths} N={n} P={args.world_size}; backend {args.backend}")
    for shape in args.head_shapes.split(","):
        heads, kv_heads = map(int, shape.split("/"))
        kernel = varlen_kernel_of_shape(args.backend, heads, kv_heads, 128, device)
        if kernel is None:
            raise SystemExit(f"backend {args.backend} has no varlen entry point here")
        for rank in range(args.world_size):
            lengths = [x.length for x in layout.pieces_of(rank)]
            pairs = sum(piece_work(m, 0, m, True) for m in lengths) * heads
            orders = _orders(lengths)
            steps = {name: _calls(kernel, calls, heads, kv_heads, device, 128 ** -0.5) for name, calls in orders.items()}
            print(f"H={heads}/{kv_heads} rank {rank}: {len(lengths)} pieces, longest {max(lengths)}, "
                  f"{sum(lengths)} rows, {pairs:.4g} (query, key) pairs over the heads")
            for part, index in (("forward", 0), ("backward", 1)):
                samples = measure_side_by_side([(s[index], None) for s in steps.values()], device, warmup=3,
                                               reps=args.reps)
                for name, xs in zip(steps, samples):
                    s = summarize(xs)
                    print(f"  {part:8s} {name:14s} median {s['median']:8.3f} ms (p10 {s['p10']:.3f}, p90 "
                          f"{s['p90']:.3f}, n {s['n']}); {pairs / s['median'] / 1e9:.3f} pairs/ns")


if __name__ == "__main__":
    main()
