"""The memory a plan is for: ``--gpu-memory SIZE``, a known ``--gpu NAME`` at the capacity torch reports, or
this machine's device; and the name its calibration is saved under.

Run: ``device_memory(gpu_memory=None, gpu="H100", device="cuda")`` → (84,929,495,040, "H100").
"""

from __future__ import annotations

import os

from ljperf.core import hardware
from ljperf.core.errors import UsageError
from ljperf.core.units import parse_memory


def device_memory(*, gpu_memory: str | None, gpu: str | None, device: str) -> tuple[int, str | None]:
    """(bytes per device, the name its calibration is saved under) from --gpu-memory, --gpu or this machine;
    --gpu-memory takes the name of this machine's device (a CUDA plan on a machine without a GPU: none)."""
    if gpu_memory and gpu:
        raise UsageError("give one of --gpu-memory SIZE or --gpu NAME")
    if gpu:
        if device == "cpu":
            raise UsageError("--gpu names a GPU, but the plan is for --device cpu: give --gpu-memory SIZE instead")
        name = known_gpu(gpu)
        return hardware.GPU_MEMORY_BYTES[name], name.split("-")[0]
    import torch

    if device == "cpu":
        here = "cpu"
    else:
        here = hardware.calibration_name(torch.device("cuda", 0)) if torch.cuda.is_available() else None
    if gpu_memory:
        return parse_memory(gpu_memory, what="--gpu-memory"), here
    if here is None:
        raise UsageError("no GPU here to read its memory from: give --gpu-memory SIZE or --gpu NAME")
    if here == "cpu":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), here
    return torch.cuda.get_device_properties(0).total_memory, here


def known_gpu(text: str) -> str:
    """The entry of ``hardware.GPU_MEMORY_BYTES`` that --gpu ``text`` names, in any case: the whole name
    (``h100-80gb``), or the model alone (``H100``) where only one size of it is known."""
    table = hardware.GPU_MEMORY_BYTES
    candidates = [name for name in table if name.lower() == text.lower()] or [
        name for name in table if name.split("-")[0].lower() == text.lower()
    ]
    if len(candidates) == 1:
        return candidates[0]
    if candidates:
        raise UsageError(f"--gpu {text!r} names {len(candidates)} GPUs: choose one of {', '.join(candidates)}")
    raise UsageError(f"--gpu {text!r} is not known; choose one of {', '.join(table)}")
