"""This process in a run: its ranks and device, and the process group it joins and leaves.

Run: ``Process.here("cpu").join(launch=LaunchConfig(), need_group=False)``. A process is a worker when torchrun
started it (``LOCAL_RANK``/``WORLD_SIZE`` set) or when the run has one process; ``dist.launch`` starts torchrun for
``--nproc-per-node``/``--nnodes`` runs.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from ljperf.core import hardware
from ljperf.core.choices import Device, DeviceType
from ljperf.core.errors import UsageError
from ljperf.core.hardware import DeviceInfo
from ljperf.core.options import LaunchConfig
from ljperf.distributed.launch import under_torchrun


@dataclass(frozen=True, kw_only=True)
class Process:
    """This process's place in the run: the ranks torchrun gave it (0 of 1 without torchrun) and its device."""

    rank: int = 0
    """Global rank of this process."""
    local_rank: int = 0
    """Rank within the node (the CUDA device index)."""
    world: int = 1
    """Number of processes in the run."""
    device: DeviceInfo = field(default_factory=lambda: hardware.local_device("cpu", 0))
    """This rank's device."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def here(cls, device_type: DeviceType) -> Process:
        rank, local_rank, world = 0, 0, 1
        if under_torchrun():
            rank, local_rank, world = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
        return cls(rank=rank, local_rank=local_rank, world=world, device=hardware.local_device(device_type, local_rank))

    def join(self, *, launch: LaunchConfig, need_group: bool) -> None:
        """Join the process group (gloo on CPU, NCCL on GPU) when the run is distributed or ``need_group``."""
        if (self.world == 1 and not need_group) or dist.is_initialized():
            return
        if not under_torchrun():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group(
            backend="nccl" if self.device.type == "cuda" else "gloo",
            rank=self.rank,
            world_size=self.world,
            timeout=timedelta(seconds=launch.collective_timeout),
            device_id=self.device.torch_device if self.device.type == "cuda" else None,
        )


def resolve_device_type(requested: Device) -> DeviceType:
    if requested == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda but torch sees no CUDA device (use --device cpu)")
    return hardware.default_device_type() if requested == "auto" else requested


def check_process_count(launch: LaunchConfig, device_type: DeviceType) -> None:
    """More processes per node than GPUs (or, on CPU, than cores) is a usage error."""
    have = torch.cuda.device_count() if device_type == "cuda" else (os.cpu_count() or 1)
    if launch.nproc_per_node > have:
        what = "GPU(s)" if device_type == "cuda" else "CPU core(s)"
        raise UsageError(f"--nproc-per-node {launch.nproc_per_node} but this node has {have} {what}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shutdown_process() -> None:
    """Leave the process group after a healthy run.

    gloo's worker threads free a finished collective (and its Python tensors, which needs the GIL) after
    ``wait()`` has returned. If the group is destroyed then, its destructor joins those threads while holding
    the GIL and the process hangs at exit; a barrier and a short GIL-free sleep let them finish first.
    """
    if dist.is_initialized():
        dist.barrier()
        time.sleep(0.2)
        dist.destroy_process_group()
