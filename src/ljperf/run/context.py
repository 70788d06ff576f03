"""What a rank knows about its run (``RunContext``): the ``RunConfig``, this process's ranks and device, and the
recompute plan it runs.

Run: ``init_process(unjoined(cfg), need_group=False)`` in a worker; engines, the forecast recipe
(``Recipe.from_run``) and the recompute solver read it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ljperf.core import hardware
from ljperf.core.mesh import MeshShape
from ljperf.core.options import EngineConfig, LaunchConfig, OptimizationConfig, TrainConfig
from ljperf.core.plans import Plan
from ljperf.distributed.runtime import Process, resolve_device_type
from ljperf.run.config import RunConfig, fixed_recompute

if TYPE_CHECKING:
    from ljperf.core.hardware import DeviceInfo
    from ljperf.models.spec import ModelSpec


@dataclass(kw_only=True)
class RunContext:
    """Everything a rank knows about its run."""

    config: RunConfig
    """The run, as resolved from the command line (the same on every rank)."""
    process: Process = field(default_factory=Process)
    """This process's ranks and device (``init_process`` sets them from torchrun's)."""
    plan: Plan | None = None
    """The recompute mode of each decoder layer the engine applies (None: no recompute), set once resolved."""

    @property
    def engine(self) -> str:
        return self.config.engine

    @property
    def model(self) -> ModelSpec:
        return self.config.model

    @property
    def train(self) -> TrainConfig:
        return self.config.train

    @property
    def launch(self) -> LaunchConfig:
        return self.config.launch

    @property
    def engine_opts(self) -> EngineConfig:
        return self.config.engine_opts

    @property
    def optim(self) -> OptimizationConfig:
        return self.config.optim

    @property
    def deepspeed_user(self) -> dict:
        return self.config.deepspeed_user

    @property
    def rank(self) -> int:
        return self.process.rank

    @property
    def world(self) -> int:
        return self.process.world

    @property
    def device(self) -> DeviceInfo:
        return self.process.device

    @property
    def is_main(self) -> bool:
        return self.process.is_main

    @property
    def mesh(self) -> MeshShape:
        """How this run's ranks split: pipeline stages × HSDP replicas × FSDP shards × tensor-parallel ranks."""
        opts = self.engine_opts
        return MeshShape.of(world=self.world, tp=opts.tp, dp_replicate=opts.dp_replicate, pp=opts.pp)

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index: the ranks of a tensor-parallel group train on the same sequences."""
        return self.mesh.dp_rank(self.rank)

    @property
    def bf16(self) -> bool:
        """bf16 compute: ``bf16-mixed`` or ``bf16``."""
        return self.train.precision in ("bf16-mixed", "bf16")

    @property
    def weight_dtype(self) -> torch.dtype:
        """The parameters' dtype: bf16 for ``bf16``, else fp32 (master weights)."""
        return torch.bfloat16 if self.train.precision == "bf16" else torch.float32

    def autocast(self) -> contextlib.AbstractContextManager:
        """bf16 autocast for ``bf16-mixed`` (fp32 master weights) and ``bf16``, nothing for ``fp32``."""
        if not self.bf16:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)


def unjoined(cfg: RunConfig, *, world: int = 1) -> RunContext:
    """The run context of ``cfg`` before the process group is joined: rank 0 of ``world`` on an unnamed device,
    with ``--recompute``'s plan where it is fixed (``auto`` is solved later: ``recompute.run.prepare_run``)."""
    device = hardware.DeviceInfo(type=resolve_device_type(cfg.train.device), index=None, name="unknown")
    return RunContext(config=cfg, process=Process(world=world, device=device), plan=fixed_recompute(cfg))


def init_process(run: RunContext, *, need_group: bool) -> RunContext:
    """Put this process's ranks and device into ``run`` (first: a failure to join still knows them), set its CPU
    threads (``--threads``, resolved), then join."""
    run.process = Process.here(run.device.type)
    if run.train.threads is not None:
        torch.set_num_threads(run.train.threads)
    run.process.join(launch=run.launch, need_group=need_group)
    return run
