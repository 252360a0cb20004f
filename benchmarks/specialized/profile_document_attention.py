"""Where a rank's time goes in ``DocumentParallelAttention`` (or ``RingAttention(layout="documents")``):
torch.profiler over a few causal forward + backward steps (after warm-up) of packed documents on
every launched rank; rank 0 prints its wall time per step and its CUDA kernels and host calls by
time, or with ``--every-rank`` each rank's wall time, kernel time per step and top kernels (where
the ranks' times part).

    torchrun --nproc_per_node=2 benchmarks/specialized/profile_document_attention.py --heads 16/16,32/8
    torchrun --nproc_per_node=4 benchmarks/specialized/profile_document_attention.py --every-rank \
        --strategy ring_documents
"""
import argparse
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import dilated
from dilated.bench.documents import cu_seqlens_of
from dilated.bench.sizes import parse_size


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=parse_size, default=parse_size("256k"))
    p.add_argument("--doc-lengths", default="lognormal:8k,1.0")
    p.add_argument("--heads", default="16/16,32/8", help="H/Hkv pairs, comma list (head dim 128)")
    p.add_argument("--steps", type=int, default=3, help="profiled steps (after 5 warm-up and 5 timed ones)")
    p.add_argument("--strategy", choices=("documents", "ring_documents"), default="documents",
                   help="DocumentParallelAttention, or RingAttention on the documents' layout")
    p.add_argument("--every-rank", action="store_true", help="each rank's times and top kernels, gathered on rank 0")
    args = p.parse_args()
    rank, world, device = dilated.init_distributed()
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    dtype = torch.bfloat16 if cuda else torch.float32
    n = args.seq_len
    cu = torch.tensor(cu_seqlens_of(args.doc_lengths, n), dtype=torch.int32, device=device)
    for pair in args.heads.split(","):
        h, hkv = (int(x) for x in pair.split("/"))
        mod = dilated.DocumentParallelAttention(causal=True) if args.strategy == "documents" else \
            dilated.RingAttention(causal=True, layout="documents")
        layout = mod.document_layout(cu)
        g = torch.Generator(device).manual_seed(0)
        q = torch.randn(1, n, h, 128, generator=g, device=device, dtype=dtype)
        k, v = (torch.randn(1, n, hkv, 128, generator=g, device=device, dtype=dtype) for _ in range(2))
        ql, kl, vl = (mod.shard(t, layout).detach().requires_grad_() for t in (q, k, v))
        dout = torch.randn_like(ql)

        def step():
            out = mod(ql, kl, vl, layout=layout)
            torch.autograd.grad(out, (ql, kl, vl), dout)
        for _ in range(5):
            step()
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(5):
            step()
        sync()
        wall = (time.perf_counter() - t0) / 5 * 1e3
        with profile(activities=activities) as prof:
            for _ in range(args.steps):
                step()
            sync()
        ev = prof.key_averages()
        if args.every_rank:
            _print_every_rank(ev, rank, world, f"{args.strategy} P={world} N={n} {args.doc_lengths} H={h}/{hkv}",
                              wall, args.steps, cuda)
        elif rank == 0:
            print(f"{args.strategy} P={world} N={n} {args.doc_lengths} H={h}/{hkv}: wall per step {wall:.2f} ms; "
                  f"tables over {args.steps} steps")
            if cuda:
                print(ev.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=70))
            print(ev.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=70))
        dist.barrier()
    dist.destroy_process_group()


def _print_every_rank(ev, rank: int, world: int, what: str, wall: float, steps: int, cuda: bool, top: int = 14):
    """Each rank's wall time, kernel (or, on a CPU, host op) time per step and its ``top`` entries,
    printed by rank 0 in rank order."""
    own = [e.self_device_time_total if cuda else e.self_cpu_time_total for e in ev]
    rows = sorted(((t / steps / 1e3, e.count // steps, e.key[:90]) for t, e in zip(own, ev)), reverse=True)
    kind = "GPU kernels" if cuda else "host ops (self)"
    lines = [f"rank {rank}: {what}: wall per step {wall:.2f} ms, {kind} per step {sum(r[0] for r in rows):.2f} ms"]
    lines += [f"   {ms:9.3f} ms {count:5d}x {name}" for ms, count, name in rows[:top]]
    gathered = [None] * world
    dist.all_gather_object(gathered, "\n".join(lines))
    if rank == 0:
        print("\n".join(gathered), flush=True)


if __name__ == "__main__":
    main()
