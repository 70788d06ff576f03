"""Parameter numbers of the blocks the forecast composes (embedding, each decoder layer, head), from a full-depth
build on the meta device, cached on disk per architecture and depth.

Run: ``block_params(resolve(name="llama3-8b")).layer_sizes``.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor

from ljperf.core.cache import cached
from ljperf.distributed.mesh import fake_tp_mesh
from ljperf.forecast.cache_key import architecture_key, cache_dir
from ljperf.models.layout import decoder_layers, weight
from ljperf.models.spec import ModelSpec, build_meta
from ljperf.models.tensor_parallel import parallelize

if TYPE_CHECKING:
    from ljperf.forecast.recipe import Recipe


@dataclass(frozen=True, kw_only=True)
class BlockParams:
    """Parameter numbers of the blocks the timeline composes (a tied LM head counts in ``pre``)."""

    pre: int
    """Input embedding."""
    layer_sizes: tuple[int, ...]
    """Each decoder layer of the full model (they differ where some are mixtures of experts and some dense:
    DeepSeek-V3's first three, Qwen MoE's ``mlp_only_layers``, Llama 4's interleaving)."""
    post: int
    """Final norm and (untied) LM head."""
    tensors: int
    """Parameter tensors of the full model (optimizer ``step`` scalars)."""
    largest: int
    """Elements of the largest parameter tensor."""
    largest_rows: int
    """Its first dimension (FSDP2 shards every parameter on it)."""
    buffer_bytes: int
    """Model buffers (RoPE frequencies)."""
    layer_kinds: tuple[int, ...]
    """Each decoder layer's kind: layers with the same parameters (names, shapes) and modules are one kind,
    numbered in order (DeepSeek-V3: 0, 0, 0, 1, ..., 1); the trace copies one layer of each."""
    order: tuple[tuple[str, int], ...] = ()
    """Each parameter tensor of the full model in ``parameters()`` order (DeepSpeed's flat order), as (backward
    block: ``pre``, ``layer i`` or ``post``, elements): ZeRO-1/2 cut that order into partitions."""

    @property
    def layers(self) -> int:
        return len(self.layer_sizes)

    @property
    def layer(self) -> int:
        """The largest decoder layer: what a gather, prefetch or reduce of one layer holds at most."""
        return max(self.layer_sizes)

    @property
    def total(self) -> int:
        return self.pre + sum(self.layer_sizes) + self.post


_BLOCKS: dict[str, BlockParams] = {}


def block_params(spec: ModelSpec, *, tp: int = 1) -> BlockParams:
    """Parameter numbers per block: from a full-depth meta build, cached per architecture and depth on disk;
    ``tp``: one tensor-parallel rank's of that many (its shards: ``models.tensor_parallel``)."""
    key = architecture_key(spec, f"{spec.layers} layers", *([f"tp {tp}"] if tp > 1 else []))
    if key not in _BLOCKS:
        path = cache_dir() / f"{spec.architecture}-blocks-{key}.json"
        _BLOCKS[key] = cached(path, load=_load_blocks, make=lambda: _block_counts(spec, tp=tp), dump=asdict)
    return _BLOCKS[key]


def recipe_blocks(spec: ModelSpec, recipe: Recipe) -> BlockParams:
    """The blocks one rank of ``recipe`` holds: the whole model's (one tensor-parallel rank's), or under ``--pp``
    the stage's (``recipe.stage``): its decoder layers, the embedding on the first, the norm and head on the last."""
    blocks = block_params(spec, tp=recipe.tp)
    if recipe.stage is None:
        return blocks
    return stage_blocks(blocks, layers=recipe.stage_layers, first=recipe.stage == 0, last=recipe.last_stage)


@functools.cache  # a search cuts the same stages thousands of times
def stage_blocks(blocks: BlockParams, *, layers: range, first: bool, last: bool) -> BlockParams:
    """``blocks`` cut down to a pipeline stage of decoder ``layers`` (numbered from the stage's first)."""

    def held(tag: str) -> str | None:
        if tag in ("pre", "post"):
            return tag if (first if tag == "pre" else last) else None
        index = int(tag.split()[1])
        return f"layer {index - layers.start}" if index in layers else None

    order = tuple((mine, n) for tag, n in blocks.order if (mine := held(tag)) is not None)
    return replace(
        blocks,
        pre=blocks.pre if first else 0,
        layer_sizes=tuple(blocks.layer_sizes[i] for i in layers),
        post=blocks.post if last else 0,
        tensors=len(order),
        largest=max(n for _, n in order),
        layer_kinds=tuple(blocks.layer_kinds[i] for i in layers),
        order=order,
    )


def _local(param: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel parameter's shard on this rank (a DTensor's local tensor), else the parameter."""
    return param._local_tensor if isinstance(param, DTensor) else param


def _load_blocks(data: dict) -> BlockParams:
    ints = {k: int(data[k]) for k in ("pre", "post", "tensors", "largest", "largest_rows", "buffer_bytes")}
    order = tuple((str(tag), int(n)) for tag, n in data["order"])
    sizes, kinds = (tuple(int(n) for n in data[k]) for k in ("layer_sizes", "layer_kinds"))
    return BlockParams(**ints, layer_sizes=sizes, layer_kinds=kinds, order=order)


def _block_counts(spec: ModelSpec, *, tp: int) -> BlockParams:
    """``BlockParams`` of a full-depth build on the meta device (about 1 s at 70B–671B: nothing allocated), split
    over ``tp`` ranks (rank 0's shards are counted)."""
    model = build_meta(spec, initialize=False)
    if tp > 1:
        parallelize(model, fake_tp_mesh(tp))
    layers = decoder_layers(model)
    embed = _local(weight(model.get_input_embeddings()))
    owner = {id(_local(p)): f"layer {i}" for i, layer in enumerate(layers) for p in layer.parameters()}
    unique = list({id(p): p for p in map(_local, model.parameters())}.values())
    order = [(owner.get(id(p), "pre" if p is embed else "post"), p.numel()) for p in unique]
    largest = max(unique, key=lambda p: p.numel())
    signatures = [
        (
            tuple((name, tuple(p.shape)) for name, p in layer.named_parameters()),
            tuple(type(m).__name__ for m in layer.modules()),
        )
        for layer in layers
    ]
    kinds = {signature: None for signature in signatures}
    return BlockParams(
        pre=embed.numel(),
        layer_sizes=tuple(sum(_local(p).numel() for p in layer.parameters()) for layer in layers),
        post=sum(n for tag, n in order if tag == "post"),
        tensors=len(unique),
        largest=largest.numel(),
        largest_rows=largest.shape[0],
        buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
        layer_kinds=tuple(list(kinds).index(signature) for signature in signatures),
        order=tuple(order),
    )
