"""The main job: how far each implementation goes in sequence length, measured and checked.

    python benchmarks/specialized/benchmark_extreme_sequences.py            # CPU: ~2 minutes; GPU: up to 1M
    python benchmarks/specialized/benchmark_extreme_sequences.py --find-max --mode fwd_bwd
"""
import sys

from dilated.bench.suites import extreme_main

if __name__ == "__main__":
    sys.exit(extreme_main())
