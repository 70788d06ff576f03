"""The device mesh of a run as numbers: pipeline stages, HSDP replicas, FSDP shards and tensor-parallel ranks, and
where a rank sits.

Run: ``MeshShape.of(world=16, tp=2, dp_replicate=2, pp=2)`` → pp 2 × 2 replicas × 2 shards × 2 tensor-parallel
ranks; degrees whose product does not divide the world are a usage error (exit 2, one line). Laid out as torchtitan
lays it out: tensor parallel innermost (the ranks of a node), then the shards, the replicas, and the pipeline
stages outermost.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ljperf.core.errors import UsageError

DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
"""The mesh's dimension names, outermost first (torchtitan's names)."""


@dataclass(frozen=True, kw_only=True)
class MeshShape:
    """How a run's ranks split: ``pp`` × ``dp_replicate`` × ``dp_shard`` × ``tp``."""

    pp: int = 1
    """Pipeline ranks: each holds a run of decoder layers (its stages) and passes activations to the next."""
    dp_replicate: int = 1
    """HSDP replicas: each holds the whole model, sharded over its ``dp_shard`` ranks."""
    dp_shard: int = 1
    """Ranks FSDP2 shards parameters, gradients and optimizer states over."""
    tp: int = 1
    """Tensor-parallel ranks: they share each sequence and split each block's weights."""

    @classmethod
    def of(cls, *, world: int, tp: int = 1, dp_replicate: int = 1, pp: int = 1) -> MeshShape:
        """The mesh of ``world`` ranks with ``tp``, ``dp_replicate`` and ``pp``; the rest of the world shards."""
        degrees = (("pp", pp), ("dp-replicate", dp_replicate), ("tp", tp))
        if world % (tp * dp_replicate * pp):
            given = [f"--{name} {n}" for name, n in degrees if n > 1]
            product = f"{' × '.join(given)} = {tp * dp_replicate * pp}" if len(given) > 1 else given[0]
            raise UsageError(
                f"{product} does not divide the world size {world}: the mesh is pipeline stages × replicas × shards"
                " × tensor-parallel ranks, so their product must divide the processes or GPUs"
            )
        return cls(pp=pp, dp_replicate=dp_replicate, dp_shard=world // (tp * dp_replicate * pp), tp=tp)

    @property
    def dp(self) -> int:
        """Data-parallel ranks: each trains on its own sequences (a tensor-parallel group shares them)."""
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        """The sizes of ``DIMS``, in order."""
        return self.pp, self.dp_replicate, self.dp_shard, self.tp

    @property
    def beyond_fsdp(self) -> bool:
        """More than FSDP2's one dimension over every rank: pipeline stages, tensor parallel or HSDP."""
        return self.pp > 1 or self.tp > 1 or self.dp_replicate > 1

    @property
    def tp_alone(self) -> bool:
        """Tensor parallel over every rank of a stage: nothing is left for FSDP2 to shard, so it is not applied
        (as torchtitan), and bf16-mixed runs as autocast over fp32 parameters."""
        return self.tp > 1 and self.dp == 1

    def dp_rank(self, rank: int) -> int:
        """The data-parallel index of global ``rank`` (its tensor-parallel group's, the same in every pipeline
        stage), which picks its sequences."""
        return (rank % (self.world // self.pp)) // self.tp

    def pp_rank(self, rank: int) -> int:
        """The pipeline rank of global ``rank``: which stages it holds."""
        return rank // (self.world // self.pp)

    def record(self) -> dict[str, int]:
        return asdict(self)

    def describe(self) -> str:
        """The split for people, e.g. ``pp 2 × 2 replicas × 4 shards × tp 8``; empty for FSDP2's one dimension."""
        if not self.beyond_fsdp:
            return ""
        parts = [f"pp {self.pp}"] if self.pp > 1 else []
        parts += [f"{self.dp_replicate} replicas"] if self.dp_replicate > 1 else []
        shards = f"{self.dp_shard} shard{'s' if self.dp_shard > 1 else ''}"
        return " × ".join([*parts, shards, f"tp {self.tp}"])
