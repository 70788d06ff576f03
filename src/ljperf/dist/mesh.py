"""Device meshes: a run's (HSDP replicas, FSDP shards, tensor-parallel ranks) over its process group.

Run: ``device_mesh("cpu", MeshShape.of(world=4, tp=2))`` in each rank of a run (after the process group is
joined).
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ljperf.core.mesh import DIMS, MeshShape


def device_mesh(device_type: str, shape: MeshShape) -> DeviceMesh:
    """The run's mesh, named as ``core.mesh.DIMS`` (torchtitan's names), tensor parallel innermost."""
    return init_device_mesh(device_type, shape.sizes, mesh_dim_names=DIMS)


def data_parallel_mesh(mesh: DeviceMesh, shape: MeshShape) -> DeviceMesh:
    """What FSDP2 shards over: the shards alone, or (HSDP) the replicas × shards, whose 2-D mesh makes
    ``fully_shard`` reduce-scatter over the shards and all-reduce over the replicas."""
    return mesh["dp_replicate", "dp_shard"] if shape.dp_replicate > 1 else mesh["dp_shard"]
