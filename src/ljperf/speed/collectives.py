"""Collectives on link tiers: the seconds of the all-gathers, reduce-scatters and all-reduces of a step, from their
sizes and the links' bus bandwidth, as nccl-tests defines it (``doc/PERFORMANCE.md``): a ring over ``n`` ranks
moves ``size × factor(n)`` bytes over each rank's link, so ``time = size × factor(n) / busbw``.

Run: ``seconds(Collective(kind="all_reduce", what="all_reduce", size_bytes=2**30, ranks=8, calls=40), links)``.
``ljperf comm`` reports busbw with the same factors (``comm.bench.bandwidth``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}
"""Bus bandwidth = algbw × this factor of the world size n (nccl-tests, doc/PERFORMANCE.md)."""

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "tp", "pp_send")
"""The breakdown's collective entries: the data-parallel kinds, tensor parallel's activations, pipeline sends."""


@dataclass(frozen=True, kw_only=True)
class Links:
    """The two link tiers a rank's collectives run on, as bus bandwidth per rank."""

    intra_bytes_per_s: float
    """Within a node (NVLink; on a CPU, gloo between the processes of this machine)."""
    inter_bytes_per_s: float
    """Between nodes (the network: InfiniBand or RoCE per GPU)."""
    latency_s: float
    """Fixed seconds of one collective call (launch, synchronisation, the small-message floor)."""
    gpus_per_node: int
    """Ranks per node: a group wider than a node runs on the inter-node tier."""


@dataclass(frozen=True, kw_only=True)
class Collective:
    """Calls of one collective over one group of ranks, all of one size."""

    kind: str
    """all_gather, reduce_scatter or all_reduce (the bus factor's key)."""
    what: str
    """Its breakdown entry (``KINDS``): its kind for data parallel, ``tp`` for tensor parallel's activations."""
    size_bytes: float
    """nccl-tests' size of one call: the whole buffer (an all-gather's output, a reduce-scatter's input)."""
    ranks: int
    """Ranks in the group."""
    calls: int = 1
    stride: int = 1
    """Ranks between two members of the group (the data-parallel group under tensor parallel: ``tp``)."""

    def spans_nodes(self, gpus_per_node: int) -> bool:
        return self.ranks * self.stride > gpus_per_node

    def seconds(self, links: Links) -> float:
        """Seconds of all its calls on ``links`` (none on a group of one)."""
        if self.ranks <= 1 or self.calls <= 0:
            return 0.0
        bus = links.inter_bytes_per_s if self.spans_nodes(links.gpus_per_node) else links.intra_bytes_per_s
        return self.calls * (links.latency_s + self.size_bytes * BUS_FACTOR[self.kind](self.ranks) / bus)
