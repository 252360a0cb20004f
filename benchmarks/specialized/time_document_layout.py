"""Host time of ``DocumentLayout.balance`` (computed once per batch): 1M tokens of lognormal
documents (mean 1K and 8K), a new mix for each of 200 builds (none cached), P=2, 4 and 8, with the
crossing rows of its most loaded rank (what travels and is gathered); and of the
rest of a rank's host work for the batch: its positions (``layout.positions``, what ``shard``
takes, with the rank's pieces where the layout makes them when first asked) and its plan of crossing
rows and rectangles (``rank_plan``, what a call runs); then the hybrid's row plans.

    python benchmarks/specialized/time_document_layout.py
    python benchmarks/specialized/time_document_layout.py --against COMMIT   # that commit's code, in turns
    python benchmarks/specialized/time_document_layout.py --device cuda       # positions and plan put on a GPU

``--against`` loads the ``dilated`` package as it was at ``COMMIT`` (``git archive``, imported under
another name) and times both on each mix in turns (so the host's drift falls on both alike), and
checks that they give the same layouts and rank plans.
"""
import argparse
import gc
import importlib.util
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from dilated.bench.documents import cu_seqlens_of
from dilated.parallel import document_layout
from dilated.parallel.document_attention import rank_plan


def _at_commit(commit: str):
    """``(DocumentLayout, rank_plan)`` of the package as it was at ``commit``."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    where = tempfile.mkdtemp(prefix=f"dilated-{commit}-")
    archive = subprocess.run(["git", "-C", root, "archive", commit, "dilated"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", where], input=archive, check=True)
    name = f"dilated_at_{commit}"
    spec = importlib.util.spec_from_file_location(name, os.path.join(where, "dilated", "__init__.py"),
                                                  submodule_search_locations=[os.path.join(where, "dilated")])
    package = importlib.util.module_from_spec(spec)
    sys.modules[name] = package
    spec.loader.exec_module(package)
    layout = importlib.import_module(f"{name}.parallel.document_layout")
    attention = importlib.import_module(f"{name}.parallel.document_attention")
    return layout.DocumentLayout, attention.rank_plan


def _same(a, b) -> bool:
    """Whether two ``(layout, positions, plan)`` agree (pieces compare as tuples, tensors by value)."""
    (la, pa, ra), (lb, pb, rb) = a, b
    return (la.pieces == lb.pieces and torch.equal(pa, pb)
            and all(getattr(ra, f) == getattr(rb, f) for f in ("local_cu", "rows", "cu_q", "cu_k"))
            and all(torch.equal(getattr(ra, f), getattr(rb, f)) for f in ("send", "q_rows", "k_slots")))


def _crossing_rows(layout) -> int:
    """The most rows of crossing documents any rank holds."""
    crossing = layout.crossing()
    return max(sum(x.length for x in mine if x.doc in crossing) for mine in layout.pieces)


def _put_on(layout, plan, device):
    """Rank 0's positions and plan on ``device`` (the host's time is what is timed): ``positions(rank,
    device)`` where the code has it, else the host's positions copied there."""
    if device.type == "cpu":
        return layout.positions(0), plan
    try:
        positions = layout.positions(0, device)
    except TypeError:  # a commit whose positions are made on the host only
        positions = layout.positions(0).to(device)
    plan.on(device)
    return positions, plan


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", default=None, metavar="COMMIT", help="also time the code of this commit, in turns")
    p.add_argument("--device", default="cpu", help="where rank 0's positions and plan are put (cuda: the host's time "
                                                   "to build them and put them there)")
    args = p.parse_args()
    device = torch.device(args.device)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor()) if platform.system() == "Linux" else platform.processor()
    print(cpu)
    versions = [("this", document_layout.DocumentLayout, rank_plan)]
    if args.against:
        versions.append((args.against, *_at_commit(args.against)))
    for spec in ("lognormal:1k,1.0", "lognormal:8k,1.0"):
        for p_ in (2, 4, 8):
            mixes = [cu_seqlens_of(f"{spec}#{i}", 1 << 20) for i in range(1, 201)]  # draws #1..#200
            layout_ms = {name: [] for name, *_ in versions}
            rest_ms = {name: [] for name, *_ in versions}
            crossing = {name: [] for name, *_ in versions}
            full_gcs = {name: 0 for name, *_ in versions}
            same = True
            for i, cu in enumerate(mixes):
                built = []
                for name, layout_cls, plan_of in (versions if i % 2 == 0 else versions[::-1]):
                    before = gc.get_stats()[2]["collections"]
                    start = time.perf_counter()
                    layout = layout_cls.balance(cu, p_)
                    layout_ms[name].append((time.perf_counter() - start) * 1e3)
                    full_gcs[name] += gc.get_stats()[2]["collections"] - before
                    crossing[name].append(_crossing_rows(layout))
                    start = time.perf_counter()
                    positions, plan = _put_on(layout, plan_of(layout, 0), device)
                    rest_ms[name].append((time.perf_counter() - start) * 1e3)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)  # untimed: the next build starts from an idle GPU
                    built.append((layout, positions.cpu(), plan))
                same = same and all(_same(b, built[0]) for b in built[1:])
            docs = statistics.median(len(cu) - 1 for cu in mixes)
            for name, *_ in versions:
                label = "" if len(versions) == 1 else f" [{name}]"
                ts, rs = layout_ms[name], rest_ms[name]
                print(f"{spec}: median {docs:.0f} documents, P={p_}{label}: layout median {statistics.median(ts):.3f} "
                      f"ms (min {min(ts):.3f}, max {max(ts):.3f}; {full_gcs[name]} of the builds ran a full garbage "
                      f"collection of the process); rank 0's positions and rank plan ({device.type}) median "
                      f"{statistics.median(rs):.3f} ms (max {max(rs):.3f}); crossing rows of the most loaded rank "
                      f"median {statistics.median(crossing[name]):.0f} (max {max(crossing[name])})")
            if len(versions) > 1:
                print(f"{spec}, P={p_}: the same layouts, positions and rank plans from both: {same}")
    _time_row_plans()


def _time_row_plans() -> None:
    """The hybrid's host work per batch on the documents' layout over its rows: every row's plan of
    the documents its ranks keep and the rest it exchanges (``row_plans``, what
    ``HybridAttention(layout="documents")`` computes for each new mix, the layout over the rows
    built first and not counted), 2 x 2 and 2 x 4 (ulysses x ring) grids."""
    from dilated.parallel.row_documents import row_plans

    for spec in ("lognormal:1k,1.0", "lognormal:8k,1.0"):
        for u, r in ((2, 2), (2, 4)):
            times, full_gcs = {True: [], False: []}, 0
            for i in range(1, 201):
                layout = document_layout.DocumentLayout.balance(cu_seqlens_of(f"{spec}#{i}", 1 << 20), r)
                before = gc.get_stats()[2]["collections"]
                start = time.perf_counter()
                plans = row_plans(layout, u, "auto", by_documents=False)
                times[plans is not None].append((time.perf_counter() - start) * 1e3)
                full_gcs += gc.get_stats()[2]["collections"] - before
            said = [f"{'rows keeping documents' if kept else 'none kept'} in {len(ts)} of 200 mixes, median "
                    f"{statistics.median(ts):.3f} ms (max {max(ts):.3f})" for kept, ts in times.items() if ts]
            print(f"{spec}: the hybrid's row plans, {u} x {r} (ulysses x ring): {'; '.join(said)}; {full_gcs} of "
                  "the plans ran a full garbage collection of the process")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
