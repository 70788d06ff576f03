"""Device meshes: a run's (HSDP replicas, FSDP shards, tensor-parallel ranks) over its process group, and the fake
tensor-parallel mesh the forecast traces on.

Run: ``device_mesh("cpu", MeshShape.of(world=4, tp=2))`` in each rank of a run (after the process group is
joined); ``fake_tp_mesh(8)`` anywhere, in a process with or without a process group.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, cast

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ljperf.core.mesh import DIMS, MeshShape

if TYPE_CHECKING:
    from torch._C._distributed_c10d import ProcessGroup
    from torch.distributed.distributed_c10d import GroupName


def device_mesh(device_type: str, shape: MeshShape) -> DeviceMesh:
    """The run's mesh, named as ``core.mesh.DIMS`` (torchtitan's names), tensor parallel innermost."""
    return init_device_mesh(device_type, shape.sizes, mesh_dim_names=DIMS)


def data_parallel_mesh(mesh: DeviceMesh, shape: MeshShape) -> DeviceMesh:
    """What FSDP2 shards over: the shards alone, or (HSDP) the replicas × shards, whose 2-D mesh makes
    ``fully_shard`` reduce-scatter over the shards and all-reduce over the replicas."""
    return mesh["dp_replicate", "dp_shard"] if shape.dp_replicate > 1 else mesh["dp_shard"]


def fake_tp_mesh(tp: int) -> DeviceMesh:
    """Rank 0 of a ``tp``-rank mesh on PyTorch's fake process group, which moves no data (the collectives of fake
    tensors only make outputs of the right sizes): the forecast parallelizes and traces a model on it. It is a
    group of its own, registered by name for the functional collectives DTensor calls, beside a process group
    this process may have joined (a benchmark's rank forecasts too), not the default one as ``init_process_group``
    would make it. Its dimension's name is its own: DTensor caches sharding decisions by mesh, and meshes are
    equal by ranks, layout and names, so a fake ``tp`` over ranks 0-1 would stand for a run's real one there
    (its collectives then went to the fake group on the rank that forecast: a collective mismatch). Registered
    again if ``destroy_process_group`` has since dropped every name this process registered."""
    from torch._C._distributed_c10d import _register_process_group, _resolve_process_group

    mesh, group = _fake_tp(tp)
    try:
        _resolve_process_group(group.group_name)
    except RuntimeError:
        _register_process_group(group.group_name, group)
    return mesh


@functools.cache
def _fake_tp(tp: int) -> tuple[DeviceMesh, ProcessGroup]:
    """The mesh of ``fake_tp_mesh`` and its group, made once a process."""
    from torch._C._distributed_c10d import FakeProcessGroup, ProcessGroup, _register_process_group
    from torch.distributed import HashStore

    # torch's group names are a NewType of str (cast: not every torch ljperf runs on has the NewType to call)
    name = cast("GroupName", f"ljperf-fake-tp-{tp}")
    group = ProcessGroup(HashStore(), 0, tp)
    group._register_backend(
        torch.device("cpu"), ProcessGroup.BackendType.CUSTOM, FakeProcessGroup._create_internal(0, tp)
    )
    group._set_group_name(name)
    _register_process_group(name, group)
    mesh = DeviceMesh("cpu", torch.arange(tp), mesh_dim_names=(name,), _init_backend=False, _rank=0)
    mesh._dim_group_names = [name]
    mesh._pg_registry[name] = group
    return mesh, group
