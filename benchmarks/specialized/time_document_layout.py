"""Host time of ``DocumentLayout.balance`` (computed once per batch): 1M tokens of lognormal
documents (mean 1K and 8K), a new mix for each of 200 builds (none cached), P=4 and 8.

    python benchmarks/specialized/time_document_layout.py
"""
import platform
import statistics
import time

from dilated.bench.documents import cu_seqlens_of
from dilated.parallel.document_layout import DocumentLayout


def main() -> None:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor()) if platform.system() == "Linux" else platform.processor()
    print(cpu)
    for spec in ("lognormal:1k,1.0", "lognormal:8k,1.0"):
        for p in (4, 8):
            mixes = [cu_seqlens_of(f"{spec}#{i}", 1 << 20) for i in range(1, 201)]  # draws #1..#200
            times = []
            for cu in mixes:
                start = time.perf_counter()
                DocumentLayout.balance(cu, p)
                times.append((time.perf_counter() - start) * 1e3)
            docs = statistics.median(len(cu) - 1 for cu in mixes)
            print(f"{spec}: median {docs:.0f} documents, P={p}: median {statistics.median(times):.3f} ms, "
                  f"min {min(times):.3f} ms, max {max(times):.3f} ms")


if __name__ == "__main__":
    main()
