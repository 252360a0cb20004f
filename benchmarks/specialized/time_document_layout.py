"""Host time of ``DocumentLayout.balance`` (computed once per batch): 1M tokens of lognormal
documents (mean 1K and 8K), a new mix for each of 200 builds (none cached), P=4 and 8; and of the
rest of a rank's host work for the batch: its positions (``layout.positions``, what ``shard``
takes) and its plan of crossing rows and rectangles (``rank_plan``, what a call runs).

    python benchmarks/specialized/time_document_layout.py
    python benchmarks/specialized/time_document_layout.py --against COMMIT   # that commit's layout, in turns

``--against`` loads ``dilated/parallel/document_layout.py`` as it was at ``COMMIT`` (``git show``) and
times both on each mix in turns (so the host's drift falls on both alike), and checks that they give
the same layouts.
"""
import argparse
import importlib.util
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

from dilated.bench.documents import cu_seqlens_of
from dilated.parallel import document_layout
from dilated.parallel.document_attention import rank_plan

PATH = "dilated/parallel/document_layout.py"


def _at_commit(commit: str):
    """The layout module as it was at ``commit``."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    text = subprocess.run(["git", "-C", root, "show", f"{commit}:{PATH}"], check=True, capture_output=True,
                          text=True).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(text)
    name = f"dilated.parallel.document_layout_{commit}"
    spec = importlib.util.spec_from_file_location(name, f.name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", default=None, metavar="COMMIT", help="also time the layout of this commit, in turns")
    args = p.parse_args()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor()) if platform.system() == "Linux" else platform.processor()
    print(cpu)
    versions = [("this", document_layout)] + ([(args.against, _at_commit(args.against))] if args.against else [])
    for spec in ("lognormal:1k,1.0", "lognormal:8k,1.0"):
        for p_ in (4, 8):
            mixes = [cu_seqlens_of(f"{spec}#{i}", 1 << 20) for i in range(1, 201)]  # draws #1..#200
            times = {name: [] for name, _ in versions}
            rest = []  # this tree's positions and rank plan of rank 0, per mix
            same = True
            for cu in mixes:
                built = []
                for name, module in versions:
                    start = time.perf_counter()
                    layout = module.DocumentLayout.balance(cu, p_)
                    times[name].append((time.perf_counter() - start) * 1e3)
                    built.append(tuple(tuple(map(tuple, mine)) for mine in layout.pieces))
                    if module is document_layout:
                        start = time.perf_counter()
                        layout.positions(0)
                        rank_plan(layout, 0)
                        rest.append((time.perf_counter() - start) * 1e3)
                same = same and all(b == built[0] for b in built)
            docs = statistics.median(len(cu) - 1 for cu in mixes)
            for name, ts in times.items():
                label = "" if len(versions) == 1 else f" [{name}]"
                print(f"{spec}: median {docs:.0f} documents, P={p_}{label}: median {statistics.median(ts):.3f} ms, "
                      f"min {min(ts):.3f} ms, max {max(ts):.3f} ms")
            print(f"{spec}, P={p_}: rank 0's positions and rank plan after the layout: median "
                  f"{statistics.median(rest):.3f} ms, max {max(rest):.3f} ms")
            if len(versions) > 1:
                print(f"{spec}, P={p_}: the same layouts from both: {same}")


if __name__ == "__main__":
    main()
