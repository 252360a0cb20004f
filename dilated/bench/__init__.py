"""dilated.bench: the one harness every benchmark script goes through.

* :mod:`timing`: CUDA events per call after warm-up, L2 flushed; medians and percentiles.
* :mod:`flops`: useful FLOPs and minimum bytes from the definitions.
* :mod:`memory`: peak memory per call (CUDA allocator; peak RSS on Linux CPUs).
* :mod:`registry`: the benchmarked implementations and their references.
* :mod:`runner`: one row (ok / oom / unsupported / error, with a correctness check), sweeps.
* :mod:`results`: JSONL rows appended whole as each finishes; CSV.
* :mod:`report`: tables, ``compare``, ``plot``.
* :mod:`distributed`: rows across ranks, scaling sweeps; :mod:`strategies` and
  :mod:`external_ring`: the sequence-parallel implementations; :mod:`workload`: documents and
  how work falls on the ranks.
"""
from .registry import Case, Implementation, get_implementation, load_providers, register_implementation
from .results import ResultWriter, read_jsonl
from .runner import RunOptions, run_case, run_sweep

load_providers()  # the sequence-parallel implementations register themselves

__all__ = ["Case", "Implementation", "register_implementation", "get_implementation", "RunOptions", "run_case",
           "run_sweep", "ResultWriter", "read_jsonl"]
