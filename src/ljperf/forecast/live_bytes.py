"""Storage accounting of a traced step: the live tensor-storage bytes after every allocating op (fake tensors too).

Run: ``with LiveBytesTimeline() as timeline: step()``, then ``timeline.points`` (``trace.trace_shape`` does).
Storages are counted exactly as ``distributed.memory.LiveTensorBytes`` counts them on a real CPU step: each once, from
its first op to its release (a DTensor by this rank's shard).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

if TYPE_CHECKING:
    from torch._ops import OpOverload

_DEVICE = torch.ops.prim.device.default
_WAIT = torch.ops._c10d_functional.wait_tensor.default


def fake_device(func: OpOverload, args: Sequence[Any]) -> torch.device | None:
    """A fake tensor's device where ``func`` is ``prim.device``, answered as FakeTensor answers it (None for any
    other op or tensor), so that a dispatch mode spares it the trip through FakeTensorMode's dispatch: autograd
    asks every fake tensor's device, two of three ops a fake step dispatches (a trace takes ~13% less time)."""
    if func is _DEVICE and type(args[0]) is FakeTensor and not args[0].fake_mode.in_kernel_invocation:
        return args[0].fake_device
    return None


class LiveBytesTimeline(TorchDispatchMode):
    """Live tensor-storage bytes after every allocating aten op, with named marks (works on fake tensors)."""

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.points: list[int] = []
        self.marks: list[tuple[str, int]] = []
        self._sizes: dict[int, int] = {}
        self._alive: dict[int, weakref.ref] = {}

    def track(self, tensor: torch.Tensor) -> bool:
        if isinstance(tensor, DTensor):  # this rank's shard, as ``distributed.memory.LiveTensorBytes`` counts it
            tensor = tensor._local_tensor
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._sizes:
            return False
        nbytes = storage.nbytes()
        if nbytes == 0:
            return False
        self._sizes[key] = nbytes
        self.current += nbytes
        self._alive[key] = weakref.ref(storage, functools.partial(self._release, key))
        return True

    def _release(self, key: int, _dead: weakref.ref | None = None) -> None:
        self.current -= self._sizes.pop(key, 0)
        self._alive.pop(key, None)

    def mark(self, name: str) -> None:
        self.points.append(self.current)
        self.marks.append((name, len(self.points) - 1))

    def __torch_dispatch__(
        self, func: OpOverload, types: Sequence[type], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ):
        if (device := fake_device(func, args)) is not None:
            return device
        if func is _WAIT:
            # A real wait returns the collective's output itself; its meta kernel (what a fake tensor runs) a new
            # ``empty_like`` of it, one whole gathered input more at every all-gather under --tp.
            return args[0]
        out = func(*args, **(kwargs or {}))
        if func is _DEVICE:  # another tensor's: no allocation
            return out
        tensors = (
            (out,) if isinstance(out, torch.Tensor) else [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        )
        if any([self.track(t) for t in tensors]):
            self.points.append(self.current)
        return out
