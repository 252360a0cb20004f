"""Rows timed across ranks: how one rank's failure becomes the same row outcome on every rank.

A rank that fails records its first failure and goes on taking part in the row's collectives
without doing the work; at agreed points (before any collective that could wait on it forever)
every rank learns every rank's failure by one small all-gather, and all end the row together with
the same status, naming the failing ranks and the causes. On one device all of this is a no-op.
"""
from __future__ import annotations

from dilated.backends import BackendUnavailableError

from .memory import is_oom
from .progress import checkpoint
from .registry import Implementation


class OverBudget(RuntimeError):
    """A row's peak memory is over ``--memory-budget-mib``: recorded as oom."""


def outcome(e: BaseException) -> tuple[str, str]:
    """(status, reason) of a row that raised ``e``."""
    first = str(e).splitlines()[0][:300] if str(e) else ""
    if isinstance(e, BackendUnavailableError):
        return "unsupported", str(e)
    if isinstance(e, OverBudget) or is_oom(e):
        return "oom", first
    if isinstance(e, NotImplementedError):
        return "unsupported", f"{type(e).__name__}: {first}"
    return "error", f"{type(e).__name__}: {first}"


class FailedOnRanks(RuntimeError):
    """Some ranks of a collective row failed: ``failures`` is ``[(rank, status, reason)]``."""

    def __init__(self, failures, local: BaseException | None):
        self.failures, self.local = failures, local
        by_reason = {}  # the same cause on several ranks is said once
        for r, _, why in failures:
            by_reason.setdefault(why, []).append(r)
        super().__init__("; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {why}"
                                   for why, rs in by_reason.items()))

    @property
    def status(self) -> str:
        statuses = {s for _, s, _ in self.failures}
        return next(s for s in ("error", "oom", "unsupported") if s in statuses)


class RankFailures:
    """The failures of one row on this rank, and the agreement on them with the other ranks
    (``collective``; else failures raise at once)."""

    def __init__(self, impl: Implementation, collective: bool, label: str = ""):
        self.impl, self.collective, self.error = impl, collective, None
        self.label = label

    def guard(self, fn):
        if not self.collective or fn is None:
            return fn

        def run(*args):
            if self.error is None:
                try:
                    fn(*args)
                except Exception as e:  # noqa: BLE001 - recorded; every rank learns it at the next settle()
                    self.error = e
        return run

    def record(self, e: Exception) -> None:
        """A failure outside a guarded call (raised at once on a row of one rank)."""
        if not self.collective:
            raise e
        self.error = self.error or e

    def settle(self, done: str) -> None:
        """All ranks agree on the row's outcome so far; ``done``: what the row has done by now."""
        if not self.collective:
            return
        checkpoint(f"{self.label}: {done}")
        mine = "|".join(outcome(self.error)) if self.error is not None else ""
        texts = self.impl.all_ranks_text(mine)
        failed = [(r, *t.split("|", 1)) for r, t in enumerate(texts) if t]
        if failed:
            raise FailedOnRanks(failed, self.error)
