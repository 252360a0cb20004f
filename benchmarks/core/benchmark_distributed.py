"""Ring attention and distributed dilated attention under torchrun, against one device.

    torchrun --nproc_per_node=2 benchmarks/core/benchmark_distributed.py
    torchrun --nproc_per_node=4 benchmarks/core/benchmark_distributed.py --seq-lengths 256k,1M --causal \
        --mode fwd,fwd_bwd --world-sizes 1,2,4
    torchrun --nproc_per_node=4 benchmarks/core/benchmark_distributed.py --scaling weak --seq-lengths 256k
    # several nodes: torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 ...
"""
import sys

from dilated.bench.suites import distributed_main

if __name__ == "__main__":
    sys.exit(distributed_main())
