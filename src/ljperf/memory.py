"""Peak memory of a training step: CUDA allocator statistics, or live tensor bytes on CPU.

torch has no CPU allocator statistics, so on CPU ``LiveTensorBytes`` counts every tensor storage that
an aten op creates, from creation until Python frees it, on top of the storages already alive
(parameters, gradients, optimizer states, the batch). It slows a step, so it runs on an untimed step.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

CPU_METHOD = "live tensor storages (TorchDispatchMode), untimed warm-up step"
CUDA_METHOD = "torch.cuda.max_memory_allocated / max_memory_reserved"


class LiveTensorBytes(TorchDispatchMode):
    """Track the bytes of live tensor storages; ``peak`` is the maximum seen while active."""

    def __init__(self, alive: Iterable[torch.Tensor] = ()):
        super().__init__()
        self.current = 0
        self.peak = 0
        self._seen: dict[int, int] = {}
        for tensor in alive:
            self._track(tensor)
        self.baseline = self.current
        self.peak = self.current

    def _track(self, tensor: torch.Tensor) -> None:
        if isinstance(tensor, DTensor):
            # A DTensor is a wrapper: this rank holds its local shard (ops on it run below this mode).
            tensor = tensor._local_tensor
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._seen or storage.nbytes() == 0:
            return
        nbytes = storage.nbytes()
        self._seen[key] = nbytes
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._release, key)

    def _release(self, key: int) -> None:
        self.current -= self._seen.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._track(leaf)
        return out


def training_state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """Tensors alive between steps: parameters, buffers, gradients and optimizer states."""
    tensors: list[torch.Tensor] = [*model.parameters(), *model.buffers()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    if optimizer is not None:
        for state in optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def reset_cuda_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def cuda_peaks(device: torch.device) -> tuple[int, int]:
    """(max allocated, max reserved) bytes since the last reset."""
    return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
