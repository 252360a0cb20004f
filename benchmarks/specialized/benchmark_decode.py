"""Decoding against a KV cache sharded over GPUs: latency per step at each cache length and P.

    torchrun --nproc_per_node=4 benchmarks/specialized/benchmark_decode.py --cached-tokens 128k,1M,4M \\
        --world-sizes 1,2,4 --output decode.jsonl
"""
import sys

from dilated.bench.suites import decode_main

if __name__ == "__main__":
    sys.exit(decode_main())
