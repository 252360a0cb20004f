"""Dilated, improved, multihead and dense attention through the dilated.bench harness.

    python benchmarks/core/benchmark_implementations.py --quick
    python benchmarks/core/benchmark_implementations.py --seq-lengths 8k,32k --mode fwd,fwd_bwd --causal
"""
import sys

from dilated.bench.suites import implementations_main

if __name__ == "__main__":
    sys.exit(implementations_main())
