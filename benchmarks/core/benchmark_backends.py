"""Every attention backend of ``dilated.available_backends()`` on prefill and decode.

    python benchmarks/core/benchmark_backends.py --quick
    python benchmarks/core/benchmark_backends.py --backends sdpa_cudnn,sdpa_flash,flex --head-dims 64,128,256
"""
import sys

from dilated.bench.suites import backends_main

if __name__ == "__main__":
    sys.exit(backends_main())
