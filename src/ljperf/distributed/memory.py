"""Peak memory of a training step, as the record holds it per rank (``MemoryStats``): CUDA allocator statistics, or
live tensor bytes on CPU.

torch has no CPU allocator statistics, so on CPU ``LiveTensorBytes`` counts every tensor storage that
an aten op creates, from creation until Python frees it, on top of the storages already alive
(parameters, gradients, optimizer states, the batch). It slows a step, so it runs on an untimed step, and
compiled code runs eager while it measures (the figure is the eager step's).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

if TYPE_CHECKING:
    from types import TracebackType

    from torch._ops import OpOverload

CPU_METHOD = "live tensor storages (TorchDispatchMode), untimed warm-up step, compiled regions run eager"
CUDA_METHOD = "torch.cuda.max_memory_allocated / max_memory_reserved"


@dataclass(frozen=True, kw_only=True)
class MemoryStats:
    """One rank's memory over its measured steps: its entry in the record's ``results.*_per_rank``."""

    peak_allocated: int
    """Peak bytes: the CUDA allocator's since the measured step began; on CPU the measured step's live tensor
    storages."""
    peak_reserved: int | None
    """The CUDA allocator's peak reserved bytes (None on CPU: no caching allocator)."""
    num_alloc_retries: int | None
    """Times the CUDA allocator failed a device allocation, freed its cache and retried, since the process began (a
    sign of fragmentation near the memory's limit; None on CPU)."""
    num_ooms: int | None
    """Out-of-memory errors the CUDA allocator raised since the process began (None on CPU)."""
    method: str
    """How it was measured (``CUDA_METHOD`` or ``CPU_METHOD``)."""


class LiveTensorBytes(TorchDispatchMode):
    """Track the bytes of live tensor storages; ``peak`` is the maximum seen while active.

    Two things happen below the dispatcher, so they are caught another way: storages resized in place
    (FSDP2 frees and re-allocates its gathered parameters with ``untyped_storage().resize_``: followed
    through ``UntypedStorage.resize_`` while active), and storages that existed before the step but were not
    listed as alive (DDP's gradient buckets, which its reducer first writes mid-backward with an ``out=`` op):
    they were alive all along, so when first written they count from the start (baseline and peak both rise).

    And gloo copies a collective's input (FSDP2's reduce-scatter, ZeRO-3's all-gathers and reduce-scatters) where
    the dispatcher does not see it; it is seen when the calling thread views it. Holding it in Python (this
    count's storage object) makes gloo's thread take the GIL to free it after the collective, up to tens of
    milliseconds late on a busy CPU, whereas unwatched it frees it as the collective ends: such a storage freed
    on another thread is taken back from every moment after it was seen, so that the count does not depend on
    when gloo's thread got the GIL (``_late``). A collective's output is held by gloo's work as well (tensor
    parallel's functional gathers, FSDP2's all-gather buffer), and when that is its last reference it is freed there
    late the same way. So any storage an op made and another thread frees is taken back from every moment after the
    calling thread last used it (``_used``): on the calling thread it would have gone then (ZeRO-1/2's flattened
    buckets, handed to gloo's reduce, too).
    """

    def __init__(self, alive: Iterable[torch.Tensor] = ()):
        super().__init__()
        self.current = 0
        self.peak = 0
        self._seen: dict[int, int] = {}
        self._late: dict[int, int] = {}
        """Storages first seen as a view of a tensor made unseen (gloo's copies), or made by an op, by key: where in
        ``_trail`` they were seen (a copy) or last used (an op's output)."""
        self._used: set[int] = set()
        """The keys of ``_late`` that ops made: each op that reads one moves its place."""
        self._trail: list[int] = []
        """``current`` after each change since the oldest of ``_late`` was seen (the first entry: as it was)."""
        self._settled = 0
        """The peak before that."""
        self._thread = threading.get_ident()
        for tensor in alive:
            self._track(tensor)
        self.baseline = self.current
        self.peak = self.current
        self._resize = None

    def stats(self) -> MemoryStats:
        """The peak seen, as a CPU rank records it."""
        return MemoryStats(
            peak_allocated=self.peak, peak_reserved=None, num_alloc_retries=None, num_ooms=None, method=CPU_METHOD
        )

    def _track(
        self, tensor: torch.Tensor, *, existed: bool = False, unseen_view: bool = False, made: bool = False
    ) -> None:
        storage = _storage(tensor)
        if storage is not None:
            self._add(storage, existed=existed, unseen_view=unseen_view or made)
            if made and storage._cdata in self._late:
                self._used.add(storage._cdata)

    def _add(self, storage: torch.UntypedStorage, *, existed: bool, unseen_view: bool = False) -> None:
        key = storage._cdata
        if key in self._seen or storage.nbytes() == 0:
            return
        nbytes = storage.nbytes()
        self._seen[key] = nbytes
        self.current += nbytes
        if existed:
            self.baseline += nbytes
            self.peak += nbytes
            self._settled += nbytes
            self._trail = [level + nbytes for level in self._trail]
        if unseen_view:
            if not self._late:
                self._settled, self._trail = self.peak, []
            self._late[key] = len(self._trail)
        self._moved()
        weakref.finalize(storage, self._release, key)

    def _moved(self) -> None:
        """``current`` changed: the peak, and the trail a late release is taken back from."""
        if self._late:
            self._trail.append(self.current)
        self.peak = max(self.peak, self.current)

    def _release(self, key: int) -> None:
        nbytes = self._seen.pop(key, 0)
        self.current -= nbytes
        self._used.discard(key)
        seen_at = self._late.pop(key, None)
        if seen_at is not None and threading.get_ident() != self._thread:
            for i in range(seen_at + 1, len(self._trail)):
                self._trail[i] -= nbytes
            self.peak = max(self._settled, *self._trail)
        if self._late:
            self._trail.append(self.current)
        else:
            self._trail = []

    def _resized(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key not in self._seen:
            self._add(storage, existed=False)
            return
        self.current += storage.nbytes() - self._seen[key]
        self._seen[key] = storage.nbytes()
        self._moved()

    def __enter__(self):
        resize = torch.UntypedStorage.resize_

        def tracked_resize(storage: torch.UntypedStorage, size: int) -> torch.UntypedStorage:
            out = resize(storage, size)
            self._resized(storage)
            return out

        self._resize = resize
        setattr(torch.UntypedStorage, "resize_", tracked_resize)  # noqa: B010 (torch's stub types it returning Never)
        # Dynamo skips a frame called under a dispatch mode like this one and marks its code never to compile
        # again: every later step would run eager. Compiled regions run eager while measured instead (inductor's
        # CPU buffers bypass the dispatcher, so a compiled step could not be counted anyway).
        self._stance = torch.compiler.set_stance("force_eager")
        return super().__enter__()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc_val: BaseException | None, exc_tb: TracebackType | None
    ):
        setattr(torch.UntypedStorage, "resize_", self._resize)  # noqa: B010
        self._stance.__exit__(exc_type, exc_val, exc_tb)
        return super().__exit__(exc_type, exc_val, exc_tb)

    def __torch_dispatch__(
        self, func: OpOverload, types: Sequence[type], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ):
        out = func(*args, **(kwargs or {}))
        inputs = None
        for leaf in tree_leaves(out):
            storage = _storage(leaf)
            if storage is None or storage._cdata in self._seen:
                continue
            if inputs is None:
                inputs = _storage_keys((args, kwargs))
            # An untracked storage an op writes into (``out=``, in-place) existed before the step; one an op views
            # was made unseen (gloo makes its copies where the dispatcher does not see them).
            written = storage._cdata in inputs
            mutable = func._schema.is_mutable
            self._track(
                leaf,
                existed=written and mutable,
                unseen_view=written and not mutable,
                made=not written,
            )
        if self._used:
            # The op's last moment is the last entry of the trail: its outputs were made while it read its inputs.
            for key in (_storage_keys((args, kwargs)) if inputs is None else inputs) & self._used:
                self._late[key] = len(self._trail) - 1
        return out


def _storage_keys(tree: object) -> set[int]:
    return {s._cdata for s in map(_storage, tree_leaves(tree)) if s is not None}


def _storage(tensor: object) -> torch.UntypedStorage | None:
    """The storage this rank holds for ``tensor`` (a DTensor's local shard; the tensor a collective's result not yet
    waited for wraps), None for non-tensors and meta."""
    if isinstance(tensor, DTensor):
        tensor = tensor._local_tensor
    if isinstance(tensor, AsyncCollectiveTensor):  # a wrapper without data of its own (tensor parallel's results)
        tensor = tensor.elem
    if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
        return None
    return tensor.untyped_storage()


def training_state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """Tensors alive between steps: parameters, buffers, gradients and optimizer states, and the optimizer's own
    parameters when they are copies (DeepSpeed's flat fp32 partitions)."""
    tensors: list[torch.Tensor] = [*model.parameters(), *model.buffers()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    if optimizer is not None:
        tensors += [p for group in optimizer.param_groups for p in group["params"]]
        for state in optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def reachable_tensors(obj: Any) -> list[torch.Tensor]:
    """Tensors (and their gradients) reachable from a DeepSpeed or torch optimizer through its attributes,
    lists and dicts: DeepSpeed keeps its flat partitions and gradient buffers there, not in ``state``."""
    found: list[torch.Tensor] = []
    _collect(obj, found, seen=set(), depth=0)
    return found


def _collect(obj: Any, found: list[torch.Tensor], *, seen: set[int], depth: int) -> None:
    if id(obj) in seen or depth > 6:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        found.append(obj)
        if obj.grad is not None:
            found.append(obj.grad)
        return
    if isinstance(obj, dict):
        children = list(obj.values())
    elif isinstance(obj, list | tuple | set):
        children = list(obj)
    elif type(obj).__module__.startswith(("deepspeed.", "torch.optim")) and hasattr(obj, "__dict__"):
        children = list(vars(obj).values())
    else:
        return
    for child in children:
        _collect(child, found, seen=seen, depth=depth + 1)


def reset_cuda_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def cuda_peaks(device: torch.device) -> tuple[int, int]:
    """(max allocated, max reserved) bytes since the last reset."""
    return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)


def allocator_failures(device: torch.device) -> tuple[int, int]:
    """(retries, OOMs) of the CUDA caching allocator since the process began, as torchtitan reports them."""
    stats = torch.cuda.memory_stats(device)
    return stats.get("num_alloc_retries", 0), stats.get("num_ooms", 0)


def cuda_stats(device: torch.device) -> MemoryStats:
    """This rank's CUDA figures: peaks since the last ``reset_cuda_peak``, the allocator's failures."""
    (allocated, reserved), (retries, ooms) = cuda_peaks(device), allocator_failures(device)
    return MemoryStats(
        peak_allocated=allocated, peak_reserved=reserved, num_alloc_retries=retries, num_ooms=ooms, method=CUDA_METHOD
    )
