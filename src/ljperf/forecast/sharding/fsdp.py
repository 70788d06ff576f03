"""FSDP2's sharding, as ``_fully_shard/_fsdp_param_group.py`` allocates.

Use: ``fsdp_sharding(spec, recipe)`` (``sharding.engine_sharding`` picks it for ``engine="fsdp"``).
"""

from __future__ import annotations

from dataclasses import replace

from ljperf.forecast.recipe import Recipe
from ljperf.forecast.sharding.base import FsdpReduce, Gathering, LayerGather, PipelinedFsdp, Sharding, Sizes
from ljperf.models.spec import ModelSpec


def fsdp_sharding(spec: ModelSpec, recipe: Recipe) -> Sharding:
    """Parameters, gradients and moments sharded 1/world. A group's all-gather lands in a flat buffer, then is
    copied out into the per-parameter tensors; in forward the flat buffer is kept until the next group's copy-out
    (overlap), so a running layer costs two gathered copies, and the last layer's buffer lives on through the head
    and loss. Backward prefetches the next layer (its flat buffer) and keeps the previous layer's reduce-scatter
    input (fp32 gradients) until the next reduce. The root (embedding, norm, head) is gathered from its forward to
    the end of backward: resharded after the forward, it is gathered again at the start of backward (its flat
    buffer alive while the copy-out refills its parameters), and resharded before its gradients are
    reduce-scattered together at the end (the head's stays whole through the layers' backward). Without
    resharding after forward, layers stay gathered until their backward. On a CPU run gloo copies each
    reduce-scatter's whole input while it runs (NCCL does not), with the next layer's all-gather in flight."""
    size = Sizes.of(spec, recipe)
    blocks, master = size.blocks, recipe.weight_bytes
    layer = blocks.layer * size.compute
    n = blocks.layers
    gathering = _gathering(size, reshard_after_forward=recipe.reshard_after_forward)
    shard = Sharding(
        params=size.shard,
        grads=size.shard,
        optimizer=size.moments,
        grad_keep=1 / size.world,
        kept_grad_bytes=master,
        embedding_grad_shares=recipe.tp,
        gathering=gathering,
        fsdp=FsdpReduce(
            reduce_input=blocks.layer * master,
            copies_input=recipe.device == "cpu" and size.world > 1,  # one shard: no collective runs
            prefetched=tuple(
                layer if recipe.reshard_after_forward and i > 0 and size.world > 1 else 0 for i in range(n)
            ),
            frees_root_grads=size.world == 1,
            holds_reduce_output=recipe.dp_replicate > 1,
        ),
    )
    if recipe.pp > 1 and recipe.reshard_after_forward:
        flat = layer if size.world > 1 else 0
        return replace(shard, pipelined=_pipelined(shard, layer=layer, flat=flat, root=gathering.resident, layers=n))
    return shard


def _pipelined(shard: Sharding, *, layer: int, flat: int, root: int, layers: int) -> PipelinedFsdp:
    """``shard`` inside a pipeline schedule (``PipelinedFsdp``); ``flat``: a layer's all-gather buffer (none with
    one shard)."""
    assert shard.fsdp is not None
    fsdp = replace(shard.fsdp, reduce_input=0, copies_input=False, prefetched=(0,) * layers, synced=False)
    backward = [layer + flat] * layers
    if layers > 1:
        backward[0] = layer
    keep = Gathering(
        resident=root,
        layers=tuple(LayerGather(forward=0, backward=b, held=-layer) for b in backward),
        head_backward=flat,
    )
    reuse = Gathering(resident=root, layers=(LayerGather(forward=0, backward=0, held=-layer),) * layers)
    stay = Gathering(resident=root, layers=(LayerGather(forward=0, backward=0, held=0),) * layers)
    no_sync = replace(shard, grad_keep=1.0, fsdp=fsdp, gathering=keep)
    return PipelinedFsdp(no_sync=no_sync, keep=keep, reuse=reuse, stay=stay, sync=shard.gathering, layer_bytes=layer)


def _gathering(size: Sizes, *, reshard_after_forward: bool) -> Gathering:
    """What FSDP2 gathers around each block (``fsdp_sharding``). With one shard there is no all-gather: a group's
    unsharded parameters are copied from its shards when it is waited for (``FSDPParamGroup.wait_for_unshard``),
    so no flat buffer exists and a prefetch allocates nothing until the layer runs."""
    blocks = size.blocks
    layer = blocks.layer * size.compute
    root = (blocks.pre + blocks.post) * size.compute
    n = blocks.layers
    flat_layer, flat_root = (layer, root) if size.world > 1 else (0, 0)
    if reshard_after_forward:
        backward = [layer + flat_layer] * n
        if n > 1:  # the first layer's backward (the last to run) prefetches nothing; a lone layer is walked as last
            backward[0] = layer
        return Gathering(
            resident=root,
            layers=tuple(LayerGather(forward=layer + flat_layer, backward=b, held=0) for b in backward),
            embedding_forward=flat_root,
            head_forward=flat_layer,
            head_backward=flat_layer,
            root_backward=flat_root,
        )
    # no re-gather
    layers = (LayerGather(forward=layer, backward=0, held=layer),) * n
    return Gathering(resident=root, layers=layers, embedding_forward=flat_root, head_forward=flat_layer)
