"""The memory budget of ``--recompute auto``: the flag, ``$LJPERF_MEMORY_BUDGET``, or the device's memory.

Run: ``budget_bytes(torch.device("cuda", 0))`` → 90% of the GPU's memory; on CPU the RAM a process may use.
"""

from __future__ import annotations

import os

import torch

from ljperf.core import hardware
from ljperf.core.errors import UsageError
from ljperf.core.plans import BUDGET_ENV
from ljperf.core.units import format_bytes as hardware_bytes
from ljperf.core.units import parse_memory

GPU_MARGIN = 0.10
"""Share of a GPU's memory the default budget leaves free (CUDA context, NCCL buffers, fragmentation)."""


def budget_bytes(
    device: torch.device, *, given: str | None = None, local_world: int = 1, memory: int | None = None
) -> int:
    """The budget: ``given``, else ``$LJPERF_MEMORY_BUDGET``, else the GPU's memory (``memory``, or this
    machine's) minus ``GPU_MARGIN``, else (CPU) ``memory`` or the available RAM shared by the node's
    ``local_world`` processes, less what each holds beyond its tensors (``hardware.ram_share``)."""
    text = given or os.environ.get(BUDGET_ENV)
    if text:
        return parse_memory(text, what="memory budget" if given else f"${BUDGET_ENV}")
    if device.type == "cuda":
        return int((memory or torch.cuda.get_device_properties(device).total_memory) * (1 - GPU_MARGIN))
    if memory:
        return memory
    if (ram := hardware.available_ram()) is None:
        raise UsageError(f"cannot read the available RAM: set {BUDGET_ENV}, e.g. {BUDGET_ENV}=16GiB")
    return hardware.ram_share(ram, processes=local_world)


def budget_source(device_type: str, *, given: str | None = None, memory: int | None = None) -> str:
    """Where ``budget_bytes`` took the budget from, in words for the plan's line."""
    if given:
        return "--memory-budget"
    if os.environ.get(BUDGET_ENV):
        return f"${BUDGET_ENV}"
    if device_type == "cuda":
        device = f"the device's {hardware_bytes(memory)}" if memory else "the device's memory"
        return f"{1 - GPU_MARGIN:.0%} of {device}, {GPU_MARGIN:.0%} left for the CUDA context, NCCL and fragmentation"
    return "the given memory" if memory else "the RAM a process of this node may use"
