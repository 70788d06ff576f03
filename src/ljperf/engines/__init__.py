"""Training engines behind one small interface: build model + optimizer, run a step, report memory.

One module per engine: ``torch_engine`` (one device / DDP), ``fsdp_engine`` (FSDP2) and
``deepspeed_engine`` (ZeRO 1/2/3). ``make_engine(run)`` imports only the one a run uses.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from ljperf.run.context import RunContext

_MODULES = {
    "torch": "ljperf.engines.torch_engine",
    "fsdp": "ljperf.engines.fsdp_engine",
    "deepspeed": "ljperf.engines.deepspeed_engine",
}


class Engine(Protocol):
    """What the shared benchmark loop needs from an engine."""

    model: torch.nn.Module
    """The (possibly wrapped) model being trained."""
    optimizer: torch.optim.Optimizer | None
    """The optimizer, where the engine exposes a torch one (for memory accounting)."""

    def setup(self, model: torch.nn.Module) -> None:
        """Take the meta-device model: materialize, apply optimizations, wrap, create the optimizer."""

    def train_step(self, micro_batches: list[torch.Tensor]) -> torch.Tensor:
        """One optimizer step over ``micro_batches``; returns the local mean loss (detached)."""

    def describe(self) -> dict:
        """The resolved engine configuration, recorded in the result."""

    # Optional: ``state_tensors() -> list[torch.Tensor]``, the tensors kept between steps on this rank, for an
    # engine whose state ``memory.training_state_tensors(model, optimizer)`` does not see (DeepSpeed).


def make_engine(run: RunContext) -> Engine:
    module = importlib.import_module(_MODULES[run.engine])
    return module.create(run)
