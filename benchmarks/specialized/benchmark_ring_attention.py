"""Ring attention variants against each other, PyTorch's context parallel and ring-flash-attn.

    torchrun --nproc_per_node=2 benchmarks/specialized/benchmark_ring_attention.py --seq-lengths 256k --causal
    python benchmarks/specialized/benchmark_ring_attention.py   # one process: the single-device baseline only
"""
import sys

from dilated.bench.suites import ring_main

if __name__ == "__main__":
    sys.exit(ring_main())
