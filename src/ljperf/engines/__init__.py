"""Training engines behind one protocol, ``Engine``, that each implements in full: build from the meta-device model,
train a step, say what this rank holds, and describe itself for the record.

Run: ``engine = make_engine(run); engine.setup(build_meta(...)); loss = engine.train_step(micro_batches)``.
One module per engine: ``torch_engine`` (one device / DDP), ``fsdp_engine`` (FSDP2) and ``deepspeed_engine``
(ZeRO 1/2/3); ``make_engine(run)`` imports only the one a run uses.
"""

from __future__ import annotations

import importlib
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from ljperf.run.context import RunContext

_MODULES = {
    "torch": "ljperf.engines.torch_engine",
    "fsdp": "ljperf.engines.fsdp_engine",
    "deepspeed": "ljperf.engines.deepspeed_engine",
}


@dataclass(frozen=True, kw_only=True)
class EngineRecord:
    """The record's ``config.engine``: what every engine reports; each engine's module adds its own fields."""

    name: str
    """The engine (``--engine``)."""
    local_params: int
    """Parameter elements this rank holds (its shards under FSDP2 and ZeRO-3)."""
    optimizer: str
    """The optimizer that runs."""

    def record(self) -> dict[str, Any]:
        return asdict(self)


class Engine(Protocol):
    """What the benchmark needs from an engine: every engine implements all of it (``create(run) -> Engine`` in
    each engine's module has the type checker confirm it)."""

    @property
    def model(self) -> torch.nn.Module:
        """The model being trained, as the engine wrapped it (a recompute plan is applied to it)."""
        ...

    def setup(self, model: torch.nn.Module) -> None:
        """Take the meta-device model: materialize, apply optimizations, wrap or shard, create the optimizer."""
        ...

    def train_step(self, micro_batches: list[torch.Tensor]) -> torch.Tensor:
        """One optimizer step over ``micro_batches``; returns this rank's mean loss (detached)."""
        ...

    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor this rank keeps between steps (parameters or their shards, gradients, optimizer states,
        buffers): what a CPU step's memory counts from (``distributed.memory.LiveTensorBytes``)."""
        ...

    def local_params(self) -> int:
        """Parameter elements this rank holds."""
        ...

    def describe(self) -> EngineRecord:
        """The resolved engine configuration, recorded in the result."""
        ...


def make_engine(run: RunContext) -> Engine:
    module = importlib.import_module(_MODULES[run.engine])
    return module.create(run)
