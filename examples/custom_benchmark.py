"""Benchmark your own attention module with the dilated.bench harness: register, sweep, print, save.

    python examples/custom_benchmark.py        (CPU or GPU; results under results/<device>/)
"""
import torch

from dilated.bench import Case, Implementation, RunOptions, register_implementation, run_sweep
from dilated.bench.env import device_slug
from dilated.bench.registry import get_implementation
from dilated.bench.report import format_tables
from dilated.bench.results import ResultWriter


class MyAttention(torch.nn.Module):  # yours here: [batch, seq, heads, head_dim] in and out
    def forward(self, q, k, v):
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return out.transpose(1, 2)


# problem "dense": checked against exact attention and counted as 4*B*H*N^2*D FLOPs
register_implementation(Implementation("mine", "dense", lambda case, backend: MyAttention(), "my SDPA wrapper"))

gpu = torch.cuda.is_available()
cases = [Case(batch=1, seq_len=n, num_heads=8, head_dim=64, dtype="bfloat16" if gpu else "float32", mode=mode)
         for n in ([4096, 16384] if gpu else [512, 1024]) for mode in ("fwd", "fwd_bwd")]
jobs = [(get_implementation(name), c, "auto") for c in cases for name in ("mine", "dense")]
writer = ResultWriter.fresh(f"results/{device_slug()}", "custom_benchmark")  # a new file per run
rows = run_sweep(jobs, RunOptions(warmup=2, reps=5), writer, "custom_benchmark")
print(format_tables(rows, baseline="dense"))
print(f"\nresults: {writer.path}")
