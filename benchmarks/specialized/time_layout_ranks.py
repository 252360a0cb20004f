"""Each rank's attention kernels on a document layout, every rank timed on one GPU: what the layout
balances, apart from the GPUs' own pace and the communication of a run over several.

For a mix of packed documents over P ranks, :meth:`DocumentLayout.balance` with each ``--pair-costs``
weighting of causal pairs; for every rank its two varlen calls, as ``DocumentParallelAttention`` makes
them (``rank_plan``): every local piece against itself (causal) and every piece of a crossing document
against its document's keys before it (rectangles), forward then backward on fresh random inputs. All
(weighting, rank) steps are timed in turns on one GPU (CUDA events after warm-up, L2 flushed); per
weighting: each rank's median, the slowest over the mean (what a step over P GPUs of one pace waits
for), and the ranks' pairs.

    python benchmarks/specialized/time_layout_ranks.py --backend flash_attn_4
    python benchmarks/specialized/time_layout_ranks.py --world-size 4 --pair-costs 1/1,12/11,6/5
"""
import argparse
import statistics

import torch

from dilated.backends.varlen import VarlenCall, varlen_kernel_of_shape
from dilated.bench.documents import add_layout_args, cu_seqlens_of
from dilated.bench.sizes import parse_size
from dilated.bench.timing import measure_side_by_side, summarize
from dilated.packed import varlen_backward, varlen_forward
from dilated.parallel.document_attention import rank_plan
from dilated.parallel.document_layout import DocumentLayout


def _rank_step(kernel, layout, rank: int, heads: int, kv_heads: int, device, scale: float):
    """The forward and backward of rank ``rank``'s varlen calls on ``layout``, as one step."""
    plan = rank_plan(layout, rank)
    cu = list(plan.local_cu)

    def made(tq, tk):
        q = torch.randn(1, tq, heads, 128, device=device, dtype=torch.bfloat16)
        k, v = (torch.randn(1, tk, kv_heads, 128, device=device, dtype=torch.bfloat16) for _ in range(2))
        return q, k, v

    q, k, v = made(cu[-1], cu[-1])
    out, lse = varlen_forward(kernel, q, k, v, cu, True, scale)
    local = (torch.randn_like(out), q, k, v, out, lse)
    rect = None
    if len(plan.cu_q) > 1:  # the crossing pieces' rectangles: every key of each visible
        cu_q, cu_k = (torch.tensor(c, dtype=torch.int32, device=device) for c in (plan.cu_q, plan.cu_k))
        call = VarlenCall(cu_q, cu_k, max(b - a for a, b in zip(plan.cu_q, plan.cu_q[1:])),
                          max(b - a for a, b in zip(plan.cu_k, plan.cu_k[1:])), False, scale)
        rq, rk, rv = (x[0] for x in made(plan.cu_q[-1], plan.cu_k[-1]))
        rout, rlse = kernel.forward(rq, rk, rv, call)
        rect = (call, (torch.randn_like(rout), rq, rk, rv, rout, rlse))

    def step():
        varlen_forward(kernel, q, k, v, cu, True, scale)
        if rect is not None:
            kernel.forward(*rect[1][1:4], rect[0])
        varlen_backward(kernel, local, cu, True, scale)
        if rect is not None:
            kernel.backward(*rect[1], rect[0])
    return step


def _pairs(layout, rank: int) -> tuple[int, int]:
    """``(causal pairs, rectangle pairs)`` of a rank's queries: its pieces' own keys, and their
    documents' keys before them."""
    own = sum(x.length * (x.length + 1) // 2 for x in layout.pieces_of(rank))
    return own, layout.work_per_rank()[rank] - own


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_layout_args(p)
    p.add_argument("--pair-costs", default="1/1,12/11", help="triangle/rectangle weightings of causal pairs, "
                                                             "comma-separated")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("time_layout_ranks.py times varlen kernels on a CUDA GPU; none is visible")
    n = parse_size(args.seq_len)
    cu = cu_seqlens_of(args.doc_lengths, n)
    weightings = [tuple(map(int, w.split("/"))) for w in args.pair_costs.split(",")]
    layouts = {w: DocumentLayout.balance(cu, args.world_size, True, pair_costs=w) for w in weightings}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    print(f"{name}; {args.doc_lengths} N={n} ({len(cu) - 1} documents), "
          f"P={args.world_size}, causal fwd_bwd; backend {args.backend}")
    for shape in args.head_shapes.split(","):
        heads, kv_heads = map(int, shape.split("/"))
        kernel = varlen_kernel_of_shape(args.backend, heads, kv_heads, 128, device)
        if kernel is None:
            raise SystemExit(f"backend {args.backend} has no varlen entry point here")
        keys = [(w, r) for w in weightings for r in range(args.world_size)]
        steps = [(_rank_step(kernel, layouts[w], r, heads, kv_heads, device, 128 ** -0.5), None) for w, r in keys]
        samples = dict(zip(keys, measure_side_by_side(steps, device, warmup=3, reps=args.reps)))
        for w in weightings:
            medians = []
            for r in range(args.world_size):
                s = summarize(samples[(w, r)])
                medians.append(s["median"])
                own, before = _pairs(layouts[w], r)
                print(f"H={heads}/{kv_heads} pair costs {w[0]}/{w[1]} rank {r}: median {s['median']:8.3f} ms "
                      f"(p10 {s['p10']:.3f}, p90 {s['p90']:.3f}, n {s['n']}); causal pairs {own:.4g}, rectangle "
                      f"pairs {before:.4g}")
            print(f"H={heads}/{kv_heads} pair costs {w[0]}/{w[1]}: slowest rank over the mean "
                  f"{max(medians) / statistics.mean(medians):.4f}, ranks' sum {sum(medians):.3f} ms, pairs' "
                  f"imbalance {layouts[w].imbalance():.4f}")


if __name__ == "__main__":
    main()
