"""Engine ``torch``: plain PyTorch on one device, DistributedDataParallel across processes.

Run: ``ljperf benchmark --model torch/llama-tiny [--nproc-per-node 2]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel

from ljperf.core.phases import phase
from ljperf.distributed import memory
from ljperf.engines import Engine, EngineRecord
from ljperf.engines.common import adamw
from ljperf.engines.parallelize import apply_optimizations
from ljperf.models.build import materialize
from ljperf.models.step import accumulate
from ljperf.run.context import RunContext


@dataclass(frozen=True, kw_only=True)
class TorchRecord(EngineRecord):
    wrapper: str
    """``ddp`` across processes, ``none`` on one."""


class TorchEngine:
    """One device, or DDP when the run has more than one process."""

    def __init__(self, run: RunContext):
        self.run = run
        self.model: torch.nn.Module
        self.optimizer: torch.optim.Optimizer

    def setup(self, model: torch.nn.Module) -> None:
        """The ``Engine``'s; a model whose parameters are already off the meta device (``benchmark.fakestep``'s
        fake ones, which ``materialize`` could not move) is trained as it is."""
        device = self.run.device.torch_device
        if any(p.device.type == "meta" for p in model.parameters()):
            model = materialize(model, device=device, seed=self.run.train.seed, dtype=self.run.weight_dtype)
        model = apply_optimizations(model, self.run)
        if self.run.world > 1:
            ids = [device.index] if device.type == "cuda" else None
            model = DistributedDataParallel(model, device_ids=ids)
        self.model = model
        self.optimizer = adamw(model.parameters(), run=self.run)

    def train_step(self, micro_batches: list[torch.Tensor]) -> torch.Tensor:
        no_sync = self.model.no_sync if isinstance(self.model, DistributedDataParallel) else None
        loss = accumulate(self.model, micro_batches, autocast=self.run.autocast, no_sync=no_sync)
        with phase("optimizer"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return loss

    def state_tensors(self) -> list[torch.Tensor]:
        return memory.training_state_tensors(self.model, self.optimizer)

    def local_params(self) -> int:
        """Every parameter (DDP replicates them); a tied weight once."""
        return sum(p.numel() for p in self.model.parameters())

    def describe(self) -> TorchRecord:
        wrapper = "ddp" if self.run.world > 1 else "none"
        return TorchRecord(name="torch", local_params=self.local_params(), wrapper=wrapper, optimizer="AdamW")


def create(run: RunContext) -> Engine:
    return TorchEngine(run)
