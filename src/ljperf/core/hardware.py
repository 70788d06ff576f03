"""Devices: which one a run uses, its name, memory, and its peak dense bf16 TFLOPS for MFU.

Peak figures are the vendors' dense (no sparsity) BF16 tensor-core numbers from their datasheets
(see docs/metrics.md). An unknown device gets no MFU rather than a guessed one. torch is imported where a
function needs it: ``ljperf plan`` on a CPU-less name (``--gpu H100-80GB``) and every command's flags need none.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ljperf.core.choices import DeviceType

if TYPE_CHECKING:
    import torch

# Ordered: the first pattern that matches the device name wins, so narrower names come first.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    (r"H100.*PCIe", 756.0),
    (r"H100.*NVL", 835.0),
    (r"GH200", 989.4),
    (r"H100|H800", 989.4),
    (r"H200.*NVL", 835.0),
    (r"H200", 989.4),
    (r"\bH20\b", 148.0),
    (r"A100|A800", 312.0),
    (r"\bL40S\b", 362.0),
    (r"\bL20\b", 119.5),
    (r"\bL4\b", 121.0),
    (r"B200", 2250.0),
    (r"B100", 1750.0),
    (r"MI300X", 1307.4),
)

# Peak memory bandwidth (TB/s) from the same datasheets, same matching; the recompute solver ranks plans by
# FLOPs / peak FLOPS against memory-bound bytes / this bandwidth when it plans for a GPU it cannot measure.
PEAK_MEMORY_TBPS: tuple[tuple[str, float], ...] = (
    (r"H100.*PCIe", 2.0),
    (r"H100.*NVL", 3.9),
    (r"GH200", 4.0),
    (r"H100|H800", 3.35),
    (r"H200.*NVL", 4.8),
    (r"H200", 4.8),
    (r"\bH20\b", 4.0),
    (r"A100|A800", 2.039),
    (r"\bL40S\b", 0.864),
    (r"\bL20\b", 0.864),
    (r"\bL4\b", 0.3),
    (r"B200", 8.0),
    (r"B100", 8.0),
    (r"MI300X", 5.3),
)

# Known accelerators by memory, for ``--gpu NAME`` in ``ljperf plan``: the capacity torch reports
# (``total_memory``, the "GPU 0 has a total capacity of ... GiB" of CUDA OOM messages), not the marketing size:
# the driver keeps the rest, and a plan within a GiB of the nominal size would say "fits" and then fail.
GPU_MEMORY_BYTES: dict[str, int] = {
    name: round(gib * 1024**3)
    for name, gib in {
        "A100-40GB": 39.39,
        "A100-80GB": 79.15,
        "H100-80GB": 79.11,
        "H800-80GB": 79.11,
        "H20-96GB": 94.97,
        "H200-141GB": 139.80,
        "L20-48GB": 44.39,
        "L40S-48GB": 44.39,
        "B200-180GB": 178.35,
    }.items()
}


def peak_tflops(device_name: str) -> float | None:
    """Peak dense BF16 TFLOPS of a device by name, or None when unknown."""
    return _lookup(PEAK_BF16_TFLOPS, device_name)


def peak_memory_tbps(device_name: str) -> float | None:
    """Peak memory bandwidth (TB/s) of a device by name, or None when unknown."""
    return _lookup(PEAK_MEMORY_TBPS, device_name)


def _lookup(table: tuple[tuple[str, float], ...], device_name: str) -> float | None:
    return next((value for pattern, value in table if re.search(pattern, device_name)), None)


@dataclass(frozen=True, kw_only=True)
class DeviceInfo:
    """The device a rank runs on."""

    type: DeviceType
    """``cpu`` or ``cuda``."""
    index: int | None
    """The CUDA device index, None on CPU."""
    name: str
    """Human name, e.g. ``NVIDIA H200`` or the CPU model."""

    @property
    def torch_device(self) -> torch.device:
        import torch

        return torch.device(self.type, self.index) if self.index is not None else torch.device(self.type)

    @property
    def calibration_name(self) -> str:
        """The name its forecast overheads are calibrated under (``ljperf plan --calibrate``)."""
        return "cpu" if self.type == "cpu" else calibration_name(self.torch_device)


def calibration_name(device: torch.device) -> str:
    """The name a device's forecast overheads are calibrated under: the GPU's name, ``cpu`` for any CPU."""
    if device.type != "cuda":
        return "cpu"
    import torch

    return torch.cuda.get_device_name(device)


def default_device_type() -> DeviceType:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def local_device(device_type: DeviceType, local_rank: int) -> DeviceInfo:
    if device_type == "cuda":
        import torch

        torch.cuda.set_device(local_rank)
        return DeviceInfo(type="cuda", index=local_rank, name=torch.cuda.get_device_name(local_rank))
    return DeviceInfo(type="cpu", index=None, name=cpu_name())


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "cpu"


def available_ram() -> int | None:
    """Bytes of this machine's RAM available to new allocations (``MemAvailable``); None where unreadable."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


HOST_MARGIN = (21, 20, 256 * 2**20)
"""What a CPU process holds beyond its tensors once its imports are resident (they are when ljperf reads the
available RAM): 21/20 of the tensors plus 256 MiB (the allocator's free lists, the model build). Measured:
llama3.2-1b fp32, 20.37 GiB of tensors, 21.55 GiB max RSS of which 0.31 GiB imports (+4.3%); llama-tiny,
146 MiB of tensors, 575 MB max RSS of which 321 MB imports (+108 MB)."""


def host_ram_needed(peak: int, *, processes: int) -> int:
    """The RAM ``processes`` CPU processes need whose tensors peak at ``peak`` bytes each (``HOST_MARGIN``)."""
    num, den, fixed = HOST_MARGIN
    return processes * (-(-peak * num // den) + fixed)


def ram_share(memory: int, *, processes: int) -> int:
    """The largest tensor peak per process for which ``processes`` CPU processes fit ``memory`` bytes of RAM."""
    num, den, fixed = HOST_MARGIN
    return max(0, (memory // max(processes, 1) - fixed) * den // num)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
