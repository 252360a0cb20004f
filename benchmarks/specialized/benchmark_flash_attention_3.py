"""Hopper-class attention kernels (flash-attn 3/4, cuDNN SDPA, flex_attention) against the previous
generation (flash-attn 2, SDPA flash, manual), on dense attention and under dilated attention.

    python benchmarks/specialized/benchmark_flash_attention_3.py --quick
    python benchmarks/specialized/benchmark_flash_attention_3.py --seq-lengths 512,2k,8k,32k,64k --head-dims 64,128,256
"""
import sys

from dilated.bench.suites import hopper_main

if __name__ == "__main__":
    sys.exit(hopper_main())
