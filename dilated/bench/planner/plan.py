"""``dilated-bench plan``: every strategy and grid for a problem on a cluster, predicted, ranked, and
one recommended with the reasons and the assumptions it rests on."""
from __future__ import annotations

import math

from ...parallel.ulysses_attention import kv_heads_for
from .schedules import Model, Prediction, Problem

#: strategies planned for dense sequences and for packed documents
DENSE = ["ring", "ring_zigzag", "ulysses", "hybrid"]
DOCUMENTS = ["ring_zigzag", "ulysses", "documents", "ring_documents", "ring_head_tail", "hybrid",
             "hybrid_documents", "hybrid_documents_row_groups", "hybrid_documents_row_groups_local"]


def grids(world: int, heads: int, kv_heads: int) -> list[tuple[int, int]]:
    """``(ulysses, ring)`` grids of ``world`` ranks, both sides at least 2, the heads divisible by
    the Ulysses side (and its kv heads spread, replicated where needed)."""
    out = []
    for u in range(2, world // 2 + 1):
        if world % u or heads % u:
            continue
        try:
            kv_heads_for(heads, kv_heads, u)
        except ValueError:
            continue
        out.append((u, world // u))
    return out


def candidates(model: Model, problem: Problem, world: int) -> list[Prediction]:
    """Every strategy (and hybrid grid) predicted on ``world`` ranks, fastest first; those that
    cannot run last, with why."""
    if problem.mode == "decode":  # the cache split over 1, 2, 4, ... of the GPUs (the others idle or serving more)
        out = []
        p = 1
        while p <= world:
            pred = model.predict("decode", problem, p)
            pred.strategy = f"decode over {p} GPU{'s' if p > 1 else ''}"
            out.append(pred)
            p *= 2
        return sorted(out, key=_fastest_first)
    names = DOCUMENTS if problem.has_documents else DENSE
    out = []
    for name in names:
        if name.startswith("hybrid"):
            gs = grids(world, problem.heads, problem.kv_heads)
            out += [model.predict(name, problem, world, g) for g in gs]
            if not gs:
                p = model.predict(name, problem, world, (0, 0))
                p.reason = f"no ulysses x ring grid of {world} ranks splits {problem.heads} heads with both sides >= 2"
                out.append(p)
        else:
            out.append(model.predict(name, problem, world))
    return sorted(out, key=_fastest_first)


def _fastest_first(p: Prediction):
    return not p.supported, p.time_ms if p.supported else math.inf


def recommend(preds: list[Prediction], memory_gib: float) -> tuple[Prediction | None, str]:
    """The fastest prediction that fits ``memory_gib`` per GPU, and why."""
    fits = [p for p in preds if p.supported and p.memory_gib <= memory_gib]
    if not fits:
        return None, (f"nothing fits {memory_gib:.0f} GiB per GPU by the estimate: use more GPUs or a shorter sequence"
                      if any(p.supported for p in preds) else "no strategy runs this problem on these GPUs")
    best = fits[0]
    why = [f"{label(best)} is predicted fastest: {best.time_ms:.1f} ms per call, {best.tflops_per_gpu:.0f} TFLOP/s per "
           f"GPU, {100 * best.exposed_fraction:.0f}% of it communication nothing hides"]
    if len(fits) > 1:
        nxt = fits[1]
        why.append(f"next: {label(nxt)} at {nxt.time_ms:.1f} ms ({100 * (nxt.time_ms / best.time_ms - 1):.0f}% slower)")
    dropped = [p for p in preds if p.supported and p.memory_gib > memory_gib and p.time_ms < best.time_ms]
    if dropped:
        why.append("faster but over memory: " + ", ".join(f"{label(p)} ({p.memory_gib:.0f} GiB)" for p in dropped))
    return best, "; ".join(why)


def label(p: Prediction) -> str:
    return f"{p.strategy} {p.grid[0]}x{p.grid[1]}" if p.grid else p.strategy


def format_plan(preds: list[Prediction], problem: Problem, world: int, best: Prediction | None, why: str,
                assumptions: list[str]) -> str:
    lines = [f"plan: {problem.describe()}; {world} GPU{'s' if world > 1 else ''}", ""]
    width = max([24] + [len(label(p)) for p in preds])
    lines.append(f"{'strategy':<{width}} {'ms/call':>9} {'TFLOP/s/GPU':>11} {'exposed':>8} {'GiB/GPU':>8} {'GB sent':>8}")
    for p in preds:
        if not p.supported:
            lines.append(f"{label(p):<{width}} cannot run: {p.reason}")
            continue
        lines.append(f"{label(p):<{width}} {p.time_ms:>9.2f} {p.tflops_per_gpu:>11.0f} {100 * p.exposed_fraction:>7.0f}% "
                     f"{p.memory_gib:>8.1f} {p.bytes_sent / 1e9:>8.2f}{'  *' if p.notes else ''}")
    noted = [p for p in preds if p.notes]
    if noted:
        lines += [""] + [f"* {label(p)}: {'; '.join(p.notes)}" for p in noted]
    lines += ["", f"recommended: {label(best) if best else 'none'}", f"why: {why}", "", "assumptions:"]
    lines += [f"- {a}" for a in assumptions]
    return "\n".join(lines)
