"""Small agreements between the ranks of a run: one rank's value on all, the largest of each value on any.

Run: ``shared_from_rank0(plan)`` on every rank; as is without a process group.
"""

from __future__ import annotations

from typing import TypeVar

import torch

T = TypeVar("T")


def shared_from_rank0(value: T) -> T:
    """``value`` as rank 0 has it, on every rank of the default process group (as is without one): plans made
    from measured rates or free memory must agree across ranks, or sharded engines would diverge."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def max_over_ranks(values: list[int], device: torch.device) -> list[int]:
    """Each of ``values``' largest value on any rank of the default process group (as is without one); the
    tensor lives on ``device``, which must suit the group's backend (CUDA for NCCL)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return list(values)
    largest = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return largest.tolist()
