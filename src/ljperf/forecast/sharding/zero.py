"""DeepSpeed ZeRO-1/2/3's sharding, as ``stage_1_and_2.py``, ``stage3.py`` and ``partitioned_param_coordinator.py``
hold it from step 2 (a recorded trace).

Use: ``zero_sharding(spec, recipe)`` (``sharding.engine_sharding`` picks it for ``engine="deepspeed"``), and
``rank_shardings(spec, recipe)`` for each kind of rank where they differ (ZeRO-2's gradient partitions).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, replace

from ljperf.forecast.blocks import BlockParams
from ljperf.forecast.recipe import Recipe, ZeroSettings
from ljperf.forecast.sharding.base import (
    FP32,
    FP64,
    Gathering,
    LayerGather,
    Sharding,
    Sizes,
    Zero2Partition,
    ZeroState,
)
from ljperf.models.spec import ModelSpec


@dataclass(frozen=True, kw_only=True)
class ZeroPartition:
    """One rank's ZeRO-1/2 gradient partition as ``stage_1_and_2.py`` makes it (``copy_grads_in_partition``)."""

    elements: int
    """Of ``grads_in_partition``: every parameter tensor that overlaps the rank's slice of the flat buffer, whole
    (``params_in_partition``), so a rank whose slice starts inside a large embedding holds all of it."""
    largest_piece: int
    """Elements of the rank's largest gradient piece (the fp64 norm copies one piece at a time)."""
    made_in: str
    """The backward block in which the first bucket holding one of its tensors is reduced (the partition is made
    then): ``post``, ``layer i``, ``pre``, or ``end`` (the epilogue reduces the last bucket)."""
    unbucketed: int = 0
    """Elements of the gradient reduced then outside the bucket (a tensor larger than it), alive until copied."""


@functools.cache
def zero_partitions(
    blocks: BlockParams, *, world: int, bucket: int
) -> tuple[tuple[ZeroPartition, ...], tuple[tuple[str, int], ...]]:
    """Each rank's gradient partition, and ``(backward block, elements)`` pairs of the largest flat copy its
    bucket all-reduces make there (``allreduce_bucket`` flattens a bucket's pieces, merged while their owner rank
    repeats, in groups of just over ``bucket`` elements; a lone piece is reduced in place). Tuples: it is cached.

    Gradients arrive in reverse flat order (an untied LM head first, a tied embedding last) into the IPG bucket;
    one that would overflow it has the bucket reduced first, and a tensor larger than the bucket is reduced
    alone. The flat buffer is padded to a multiple of 2·world (``nccl_start_alignment_factor``)."""
    flat = blocks.order
    align = 2 * world
    part = -(-sum(n for _, n in flat) // align) * align // world
    offsets = list(itertools.accumulate((n for _, n in flat), initial=0))

    def pieces(k: int) -> list[tuple[int, int]]:
        start, end = offsets[k], offsets[k + 1]
        ranks = range(start // part, (end - 1) // part + 1)
        return [(r, min(end, (r + 1) * part) - max(start, r * part)) for r in ranks]

    elements, largest, made, unbucketed = [0] * world, [0] * world, [""] * world, [0] * world
    for k, (_, n) in enumerate(flat):
        for r, piece in pieces(k):
            elements[r] += n
            largest[r] = max(largest[r], piece)
    copies: dict[str, int] = {}

    def reduce(held: list[int], at: str) -> None:
        slices: list[list[int]] = []
        for k in held:
            for r, piece in pieces(k):
                if slices and slices[-1][0] == r:
                    slices[-1][1] += piece
                else:
                    slices.append([r, piece])
                if not made[r]:
                    made[r], unbucketed[r] = at, flat[k][1] if flat[k][1] > bucket else 0
        group = count = 0
        for i, (_, piece) in enumerate(slices):
            group, count = group + piece, count + 1
            if group > bucket or i == len(slices) - 1:
                if count > 1:
                    copies[at] = max(copies.get(at, 0), group)
                group = count = 0

    held: list[int] = []
    filled = 0
    for k in reversed(range(len(flat))):
        if held and filled + flat[k][1] > bucket:
            reduce(held, flat[k][0])
            held, filled = [], 0
        held.append(k)
        filled += flat[k][1]
    reduce(held, "end")
    ranks = zip(elements, largest, made, unbucketed, strict=True)
    partitions = tuple(ZeroPartition(elements=e, largest_piece=p, made_in=m, unbucketed=u) for e, p, m, u in ranks)
    return partitions, tuple(copies.items())


def rank_shardings(spec: ModelSpec, recipe: Recipe) -> list[Sharding]:
    """ZeRO's sharding as each kind of rank holds it: ZeRO-2's gradient partitions differ by rank (their size,
    their largest piece, when backward makes them), so one per backward block that makes one, with the largest
    of each; the other stages, and ZeRO-2 without contiguous gradients, hold the same on every rank."""
    if not _partitions_in_backward(recipe):
        return [zero_sharding(spec, recipe)]
    size = Sizes.of(spec, recipe)
    bucket = recipe.zero.reduce_bucket_elements(spec.hidden)
    partitions, _ = zero_partitions(size.blocks, world=recipe.world, bucket=bucket)
    kinds: dict[str, ZeroPartition] = {}
    for p in partitions:
        q = kinds.get(p.made_in, p)
        largest, unbucketed = max(p.largest_piece, q.largest_piece), max(p.unbucketed, q.unbucketed)
        kinds[p.made_in] = replace(
            p, elements=max(p.elements, q.elements), largest_piece=largest, unbucketed=unbucketed
        )
    return [zero_sharding(spec, recipe, partition=p) for p in kinds.values()]


def _partitions_in_backward(recipe: Recipe) -> bool:
    """ZeRO-2 with contiguous gradients reduces each bucket into the gradient partition in backward; so does
    ZeRO-1 with ``overlap_comm`` in the accumulation boundary's backward (``reduce_ready_partitions_and_remove_grads``
    calls ``copy_grads_in_partition`` for it too): a step of one micro-step is then ZeRO-2's. With accumulation its
    other micro-steps keep whole gradients, as ZeRO-1's do, and the step is walked as ZeRO-1's."""
    if not recipe.zero.contiguous_gradients:
        return False
    return recipe.zero_stage == 2 or (recipe.zero_stage == 1 and recipe.zero.overlap_comm and recipe.grad_accum == 1)


def zero_sharding(spec: ModelSpec, recipe: Recipe, *, partition: ZeroPartition | None = None) -> Sharding:
    """Model states per rank as ZeRO holds them (fp32 master weights, AdamW's two fp32 moments), by stage;
    ``partition``: ZeRO-2's, by rank, from ``zero_partitions`` (default: the largest)."""
    size = Sizes.of(spec, recipe)
    bucket = recipe.zero.reduce_bucket_elements(spec.hidden)
    ipg = bucket * size.compute  # the IPG (gradient) bucket
    if recipe.zero_stage == 3:
        return zero3_sharding(size, zero=recipe.zero, ipg=ipg)
    ipg *= recipe.zero.ipg_buffers()
    if recipe.zero_stage == 2 or _partitions_in_backward(recipe):
        return zero2_sharding(size, bucket=bucket, ipg=ipg, partition=partition)
    return zero1_sharding(size, ipg=ipg)


def _norm_copy(size: Sizes) -> int:
    """ZeRO-1/2 cut one flat buffer into partitions: a parameter larger than a partition fills one."""
    return FP64 * min(size.blocks.largest, -(-size.blocks.total // size.world))


def zero1_sharding(size: Sizes, *, ipg: int) -> Sharding:
    """Replicated compute-dtype parameters, sharded fp32 master weights and moments; the optimizer steps the flat
    partition (its single-tensor temporaries are partition-sized). ZeRO-1 keeps whole gradients through backward
    and flattens this rank's share for the step."""
    shard, compute = size.shard, size.compute
    return Sharding(
        params=size.weights * compute // FP32 + shard,
        grads=shard * compute // FP32,  # the partition in grad_accum_dtype (the model's), at the norm
        optimizer=size.moments,
        zero=ZeroState(
            stage=1,
            optimizer_flat=shard,
            step_grads=shard - shard * compute // FP32,  # the partition, as the fp32 gradient of the master copy
            norm_copy=_norm_copy(size),
            bucket=ipg,
            boundary_partition=shard * compute // FP32,  # grad_accum_dtype: the model's
        ),
    )


def zero2_sharding(size: Sizes, *, bucket: int, ipg: int, partition: ZeroPartition | None) -> Sharding:
    """As ZeRO-1, but each gradient is reduced into a partition buffer that each micro-step's backward makes
    anew (``partition``: its size and when it is made, from ``zero_partitions``; default: the largest) and that
    is dropped after the step. ``bucket``: elements of the IPG bucket; ``ipg``: bytes of its buffers."""
    shard, compute = size.shard, size.compute
    params = size.weights * compute // FP32 + shard
    optimizer_flat = shard
    step_grads = shard - shard * compute // FP32  # the partition, as the fp32 gradient of the master copy
    if not ipg:  # without contiguous gradients no partition buffer: each block keeps its share
        return Sharding(
            params=params,
            grads=shard * compute // FP32,
            optimizer=size.moments,
            grad_keep=1 / size.world,
            kept_grad_bytes=compute,
            zero=ZeroState(stage=2, optimizer_flat=optimizer_flat, step_grads=step_grads, norm_copy=_norm_copy(size)),
        )
    partitions, copies = zero_partitions(size.blocks, world=size.world, bucket=bucket)
    mine = partition or max(partitions, key=lambda q: q.elements)
    made = Zero2Partition(
        made_in=mine.made_in,
        unbucketed=mine.unbucketed * compute,
        reduce_copies={at: n * compute for at, n in copies},
        first_grad=first if (first := size.blocks.order[-1][1]) <= bucket else 0,
    )
    return Sharding(
        params=params,
        grads=mine.elements * compute,  # grads_in_partition: grad_accum_dtype, the model's by default
        optimizer=size.moments,
        grad_keep=0.0,
        zero=ZeroState(
            stage=2,
            optimizer_flat=optimizer_flat,
            step_grads=step_grads,
            norm_copy=FP64 * mine.largest_piece,
            bucket=ipg,
            partition=made,
        ),
    )


def zero3_sub_group(blocks: BlockParams, *, world: int, size: int) -> int:
    """Elements of a rank's largest ZeRO-3 optimizer sub-group (``_create_fp16_sub_groups``): its parameter
    partitions in ``parameters()`` order, a sub-group closed once it reaches ``size`` elements."""
    pieces = [-(-n // world) for _, n in blocks.order]
    largest = current = 0
    for n in pieces:
        current += n
        if current >= size:
            largest, current = max(largest, current), 0
    return max(largest, current)


def zero3_sharding(size: Sizes, *, zero: ZeroSettings, ipg: int) -> Sharding:
    """ZeRO-3 as ``stage3.py`` and ``partitioned_param_coordinator.py`` hold it, from step 2 (a recorded trace).

    Persistent: the compute-dtype partition, its fp32 master copy, the flat gradient partition (compute dtype:
    DeepSpeed's default ``grad_accum_dtype``; the step flattens an fp32 copy of it, one optimizer sub-group at a
    time, and steps that: ``zero3_sub_group``) and the IPG bucket
    (``ipg`` bytes, allocated whole). Gathering: each submodule's fetch prefetches up to
    ``stage3_prefetch_bucket_size`` elements in one all-gather whose flat buffer lives until its last parameter
    is fetched, while every parameter gets its own copy when the handle is waited; with about ten fetches per
    layer the prefetch outruns the compute, so ``stage3_max_live_parameters`` bounds what is gathered ahead.
    The trace starts at the model's root, which has no parameters: its fetch prefetches from the embedding on,
    so a model that fits in one bucket (and in max-live) is gathered whole, twice over, from the embedding
    until the head's fetch. After its forward a block stays gathered if its backward is within
    ``stage3_max_reuse_distance`` elements of the trace; else what the prefetch already reached of its backward
    use stays (DeepSpeed does not release a parameter whose later use it has dequeued: the last max-live
    elements of the forward), and the rest is released and gathered again in backward. Each block is released
    after its backward. Each parameter is partitioned on its own: the largest piece (the fp64 norm's) is its
    shard.
    """
    blocks, compute, shard = size.blocks, size.compute, size.shard
    n, pre, sizes, post = blocks.layers, blocks.pre, blocks.layer_sizes, blocks.post
    after = list(itertools.accumulate(reversed(sizes), initial=0))[::-1]  # after[i]: layers i.. n-1
    before = list(itertools.accumulate(sizes, initial=0))  # before[i]: layers 0 .. i-1
    # Every submodule's fetch prefetches a bucket, many per layer: the prefetch outruns the compute until the
    # gathered elements reach max_live_parameters, so that (not the bucket) bounds what is gathered ahead.
    window = min(zero.max_live_parameters, blocks.total)
    whole = min(zero.prefetch_bucket_size, window) == blocks.total  # one all-gather of the whole model
    bucket_elems = min(zero.prefetch_bucket_size, window)

    def ahead(i: int) -> int:
        """Elements of the forward trace from layer ``i`` on."""
        return after[i] + post

    def kept(i: int) -> int:
        """Elements of layer ``i`` still gathered after its forward: all within the reuse distance; else what
        the prefetch reached of its backward use (the last max_live_parameters elements of the forward)."""
        if 2 * ahead(i + 1) < zero.max_reuse_distance:
            return sizes[i]
        return min(sizes[i], max(0, zero.max_live_parameters - ahead(i + 1)))

    def in_flight(elements: int) -> int:
        """Prefetched elements: their flat all-gather buffers, and the one being copied out into parameters."""
        return min(window, elements) + min(bucket_elems, elements)

    # While layer i runs forward: its copy and the prefetched ones after it, and the in-flight flat buffers.
    forward = [ahead(i) + blocks.total if whole else sizes[i] + in_flight(ahead(i + 1)) for i in range(n)]
    held = [kept(i) for i in range(n)]
    backward = [0 if held[i] == sizes[i] else sizes[i] - held[i] + in_flight(before[i] + pre) for i in range(n)]
    pre_held = 2 * ahead(0) < zero.max_reuse_distance
    step = FP32 * zero3_sub_group(blocks, world=size.world, size=zero.sub_group_size)
    gathering = Gathering(
        resident=pre * compute if pre_held else 0,
        layers=tuple(
            LayerGather(forward=f * compute, backward=b * compute, held=h * compute)
            for f, b, h in zip(forward, backward, held, strict=True)
        ),
        # the embedding's own copy is in ``resident`` when it stays gathered
        embedding_forward=(pre + (2 * ahead(0) + pre if whole else in_flight(ahead(0))) - (pre if pre_held else 0))
        * compute,
        head_forward=post * compute,
        # a released embedding is prefetched again for its backward once the window spans the model
        head_backward=(post + (pre if window == blocks.total and not pre_held else 0)) * compute,
        embedding_backward=0 if pre_held else pre * compute,
    )
    return Sharding(
        params=shard * compute // FP32 + shard,
        grads=shard * compute // FP32,  # gradient_accumulation_dtype: the model's dtype unless configured
        optimizer=size.moments,
        comm_buffers=ipg,
        grad_keep=0.0,
        gathering=gathering,
        zero=ZeroState(
            stage=3, optimizer_flat=step, step_grads=step, norm_copy=FP64 * -(-blocks.largest // size.world)
        ),
    )
