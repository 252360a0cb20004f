"""Communication time on a cluster of nodes: the calibrated curves within a node, and the user's
stated (or measured) bandwidth and latency between nodes.

Ranks are placed in order, ``gpus_per_node`` to a node (as torchrun and SLURM place them). A group
of ranks all on one node moves at the calibrated curves, read at the bytes each rank moves (the
curves were measured on the calibration's GPUs of one node: a larger group within a node is
assumed to move each rank's bytes at the same per-GPU bandwidth, as on NVSwitch). A group that
spans nodes is limited by the links between nodes: each GPU's share of its node's inter-node
bandwidth, for the bytes that leave the node, stated by the user or measured by a calibration
whose ranks were on different nodes. An all-gather or reduce-scatter across nodes is a ring of
``P - 1`` steps (NCCL's ring), each paying the latency between nodes: for the small messages of decode
that latency, not the bandwidth, is its time.
"""
from __future__ import annotations

from dataclasses import dataclass

from .calibration import Calibration


@dataclass(frozen=True)
class InterNode:
    """The links between nodes: stated per-GPU bandwidth (GB/s, one direction) and one message's
    latency (us), or measured ``curves`` (pattern -> :class:`Curve`, from a calibration whose ranks
    were on different nodes), which then decide the patterns they hold."""

    gbs: float
    latency_us: float = 10.0
    source: str = "stated"
    curves: dict | None = None
    #: the ring steps of the measured curves' collectives (their ranks less one)
    curve_steps: int = 1

    @classmethod
    def measured(cls, calibration: Calibration, source: str) -> "InterNode":
        """The links of ``calibration``, measured among ranks on different nodes."""
        if calibration.nodes < 2 or "p2p" not in calibration.links:
            raise ValueError(f"{source}: its links were measured within one node ({calibration.nodes} node): "
                             "calibrate with the ranks on two or more nodes (one GPU per node) for the links between them")
        lat, per_ms = calibration.links["p2p"].fit()
        return cls(per_ms * 1e3 / 1e9, lat * 1e3, f"measured: {source}", dict(calibration.links),
                   max(1, calibration.gpus - 1))

    def time_ms(self, nbytes: float, pattern: str = "p2p", steps: int = 1) -> float:
        """Milliseconds for ``nbytes`` each GPU moves across nodes in ``pattern``, in ``steps`` messages
        one after another (a ring collective over P ranks: P - 1), each paying the link's latency."""
        if nbytes <= 0:
            return 0.0
        if self.curves and pattern in self.curves:
            return self.curves[pattern].time_ms(nbytes) + max(0, steps - self.curve_steps) * self.latency_us * 1e-3
        return steps * self.latency_us * 1e-3 + nbytes / (self.gbs * 1e9) * 1e3


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
        return max(self._intra("all_to_all", nbytes * (here - 1) / p), self._cross(ranks).time_ms(leaving, "all_to_all"))

    def all_gather_ms(self, nbytes: float, ranks: list[int]) -> float:
        """all_gather of ``nbytes`` from each rank (each receives ``(P - 1) x nbytes``)."""
        p = len(ranks)
        if nbytes <= 0 or p < 2:
            return 0.0
        if not self.spans_nodes(ranks):
            return self._intra("all_gather", nbytes * (p - 1))
        # over the nodes every GPU receives it all, in P - 1 ring steps
        return self._cross(ranks).time_ms(nbytes * (p - 1), "all_gather", p - 1)

    def reduce_scatter_ms(self, nbytes: float, ranks: list[int]) -> float:
        """reduce_scatter of a buffer of ``nbytes`` per rank (``(P - 1)/P`` of it leaves each rank)."""
        p = len(ranks)
        if nbytes <= 0 or p < 2:
            return 0.0
        if not self.spans_nodes(ranks):
            return self._intra("reduce_scatter", nbytes * (p - 1) / p)
        return self._cross(ranks).time_ms(nbytes * (p - 1) / p, "reduce_scatter", p - 1)

    def relayed_ms(self, nbytes: float, ranks: list[int]) -> float:
        """An all-gather or reduce-scatter relayed round the ring: ``P - 1`` hops of ``nbytes``."""
        return (len(ranks) - 1) * self.p2p_ms(nbytes, ranks)

    def describe(self) -> str:
        inter = "no links between nodes given"
        if self.inter:
            inter = (f"between nodes {self.inter.gbs:.0f} GB/s per GPU + {self.inter.latency_us:.0f} us "
                     f"({self.inter.source})")
        return f"{self.gpus_per_node} GPUs per node; {inter}"
