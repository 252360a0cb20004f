"""Communication time on a cluster of nodes: the calibrated curves within a node, and the user's
stated (or measured) bandwidth and latency between nodes.

Ranks are placed in order, ``gpus_per_node`` to a node (as torchrun and SLURM place them). A group
of ranks all on one node moves at the calibrated curves, read at the bytes each rank moves (the
curves were measured on the calibration's GPUs of one node: a larger group within a node is
assumed to move each rank's bytes at the same per-GPU bandwidth, as on NVSwitch). A group that
spans nodes is limited by the links between nodes: each GPU's share of its node's inter-node
bandwidth, for the bytes that leave the node.
"""
from __future__ import annotations

from dataclasses import dataclass

from .calibration import Calibration


@dataclass(frozen=True)
class InterNode:
    """Per-GPU bandwidth between nodes (GB/s, one direction) and one message's latency (us)."""

    gbs: float
    latency_us: float = 10.0
    source: str = "stated"

    def time_ms(self, nbytes: float) -> float:
        return 0.0 if nbytes <= 0 else self.latency_us * 1e-3 + nbytes / (self.gbs * 1e9) * 1e3


@dataclass
class Network:
    calibration: Calibration
    gpus_per_node: int
    inter: InterNode | None = None

    def spans_nodes(self, ranks: list[int]) -> bool:
        return len({r // self.gpus_per_node for r in ranks}) > 1

    def _intra(self, pattern: str, moved: float) -> float:
        links = self.calibration.links
        if pattern not in links:
            fallback = {"copy_engine": "p2p", "reduce_scatter": "all_gather"}.get(pattern)
            if fallback is None or fallback not in links:
                raise ValueError(f"the calibration has no {pattern} times (it has {sorted(links) or 'none'}): "
                                 "calibrate under torchrun with 2 or more GPUs")
            pattern = fallback
        return links[pattern].time_ms(moved)

    def _cross(self, ranks: list[int]) -> InterNode:
        if self.inter is None:
            raise ValueError(f"ranks {ranks[0]}..{ranks[-1]} span nodes of {self.gpus_per_node} GPUs: give the "
                             "bandwidth between nodes (--inter-node-gbs, per GPU) to plan across nodes")
        return self.inter

    def p2p_ms(self, nbytes: float, ranks: list[int], pattern: str = "p2p") -> float:
        """Every rank of the ring ``ranks`` passes ``nbytes`` to the next at once (``pattern``:
        ``"p2p"`` or ``"copy_engine"``): the slowest hop."""
        if nbytes <= 0 or len(ranks) < 2:
            return 0.0
        hops = list(zip(ranks, ranks[1:] + ranks[:1]))
        if any(a // self.gpus_per_node != b // self.gpus_per_node for a, b in hops):
            return self._cross(ranks).time_ms(nbytes)
        return self._intra("p2p" if pattern == "p2p" else pattern, nbytes)

    def all_to_all_ms(self, nbytes: float, ranks: list[int]) -> float:
        """all_to_all_single of a buffer of ``nbytes`` per rank."""
        p = len(ranks)
        if nbytes <= 0 or p < 2:
            return 0.0
        moved = nbytes * (p - 1) / p
        if not self.spans_nodes(ranks):
            return self._intra("all_to_all", moved)
        here = sum(1 for r in ranks if r // self.gpus_per_node == ranks[0] // self.gpus_per_node)
        leaving = nbytes * (p - here) / p
        return max(self._intra("all_to_all", nbytes * (here - 1) / p), self._cross(ranks).time_ms(leaving))

    def all_gather_ms(self, nbytes: float, ranks: list[int]) -> float:
        """all_gather of ``nbytes`` from each rank (each receives ``(P - 1) x nbytes``)."""
        p = len(ranks)
        if nbytes <= 0 or p < 2:
            return 0.0
        if not self.spans_nodes(ranks):
            return self._intra("all_gather", nbytes * (p - 1))
        return self._cross(ranks).time_ms(nbytes * (p - 1))  # a ring over the nodes: every hop carries it all

    def reduce_scatter_ms(self, nbytes: float, ranks: list[int]) -> float:
        """reduce_scatter of a buffer of ``nbytes`` per rank (``(P - 1)/P`` of it leaves each rank)."""
        p = len(ranks)
        if nbytes <= 0 or p < 2:
            return 0.0
        if not self.spans_nodes(ranks):
            return self._intra("reduce_scatter", nbytes * (p - 1) / p)
        return self._cross(ranks).time_ms(nbytes * (p - 1) / p)

    def relayed_ms(self, nbytes: float, ranks: list[int]) -> float:
        """An all-gather or reduce-scatter relayed round the ring: ``P - 1`` hops of ``nbytes``."""
        return (len(ranks) - 1) * self.p2p_ms(nbytes, ranks)

    def describe(self) -> str:
        inter = "no links between nodes given"
        if self.inter:
            inter = f"between nodes {self.inter.gbs:.0f} GB/s per GPU + {self.inter.latency_us:.0f} us ({self.inter.source})"
        return f"{self.gpus_per_node} GPUs per node; {inter}"
