"""The sweeps behind the benchmark scripts, one module per script: arguments in, rows out.

The scripts under ``benchmarks/`` are thin shims over these entry points.
"""
from .backends import backends_main
from .decode import decode_main
from .distributed import distributed_main, ring_main
from .extreme import extreme_main, find_max_length
from .hopper import hopper_main
from .implementations import implementations_main

__all__ = ["backends_main", "decode_main", "distributed_main", "extreme_main", "find_max_length", "hopper_main",
           "implementations_main", "ring_main"]
