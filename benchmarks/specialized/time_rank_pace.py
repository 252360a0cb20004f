"""Each launched rank times the same attention call at the same moment: how far apart GPUs of one
type run under their power caps, and which physical GPU each rank is on.

Every rank runs a causal forward and backward of SDPA on inputs of the same shape, timed with CUDA
events after warm-up, the ranks starting each sample together (a barrier); rank 0 prints each rank's
median, its physical GPU (from ``CUDA_VISIBLE_DEVICES``) and its pace against the ranks' mean. Run
it again with ``CUDA_VISIBLE_DEVICES`` in another order: a pace that follows the physical GPU is the
hardware's, not the rank's.

    torchrun --nproc_per_node=4 benchmarks/specialized/time_rank_pace.py
    CUDA_VISIBLE_DEVICES=3,2,1,0 torchrun --nproc_per_node=4 benchmarks/specialized/time_rank_pace.py
"""
import argparse
import os
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dilated.bench.sizes import size_list


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", default="32k", help="tokens of the timed call (8k, 32k ...)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--reps", type=int, default=60, help="samples, each three calls")
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs CUDA GPUs (launch with torchrun, one rank per GPU)")
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    physical = int(visible.split(",")[local]) if visible else local
    n = size_list(args.seq_len)[0]
    gen = torch.Generator(device).manual_seed(0)
    q, k, v = (torch.randn(1, args.heads, n, args.head_dim, generator=gen, device=device, dtype=torch.bfloat16)
               .requires_grad_() for _ in range(3))

    def call():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    for _ in range(args.warmup):
        call()
    samples = []
    for _ in range(args.reps):
        torch.cuda.synchronize()
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            call()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 3)
    mine = torch.tensor([statistics.median(samples), max(samples) - min(samples), physical], device=device,
                        dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    if rank == 0:
        mean = sum(float(x[0]) for x in every) / world
        print(f"{torch.cuda.get_device_name(device)} x{world}, causal fwd+bwd SDPA, {n} tokens, H={args.heads}, "
              f"D={args.head_dim}, bf16; median of {args.reps} samples (spread max - min)")
        for r, x in enumerate(every):
            print(f"rank {r} (GPU {int(x[2])}): {float(x[0]):.3f} ms (spread {float(x[1]):.3f}), "
                  f"pace {float(x[0]) / mean:.3f} of the mean", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
