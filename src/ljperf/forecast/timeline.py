"""Compose traced block patterns into one rank's training step and take the peak.

The step is: grad_accum × (forward of pre → layers → post, backward in reverse), then the optimizer step.
Each block's traced segment gives its peak above the running level and its net change; the peak of the step is
the maximum over all of them (not a sum). Persistent state (parameters, optimizer states, batch, sharded or
communication buffers) is the base level, computed from the parameter counts.
"""

from __future__ import annotations

import functools
import itertools
from collections import Counter
from dataclasses import dataclass, field, replace

from ljperf.forecast.blocks import BlockParams, block_params
from ljperf.forecast.recipe import Forecast, Recipe, ZeroSettings
from ljperf.forecast.trace import EDGES, TRACE_LAYERS, Patterns, TraceError, peak_and_net, reference_kind
from ljperf.models.spec import ModelSpec

FP32 = 4
FP64 = 8
TOKEN_BYTES = 8  # int64 token ids


@dataclass(frozen=True, kw_only=True)
class Sharding:
    """How one rank holds the model states (bytes) and what its engine gathers or buffers around each block."""

    params: int
    """Parameters held between steps (shards, and fp32 master copies where the engine keeps them apart)."""
    grads: int
    """Gradients held at the optimizer step."""
    optimizer: int
    """AdamW moments (and step scalars)."""
    grads_persistent: bool = False
    """Gradient storage allocated once, alive between steps (DeepSpeed's flat partitions)."""
    comm_buffers: int = 0
    """Persistent communication buffers (DDP gradient buckets)."""
    grad_keep: float = 1.0
    """Share of each block's traced gradient this rank keeps after backward (1/world when reduce-scattered)."""
    kept_grad_bytes: int = FP32
    """Bytes per element of a kept share (FSDP2 reduces in its master dtype; ZeRO-2 keeps the compute dtype)."""
    resident: int = 0
    """Gathered from the first forward to the end of backward (FSDP2's root: embedding, final norm, head)."""
    gather_fwd: int = 0
    """Gathered bytes while a decoder layer runs forward (its parameters, prefetched ones, all-gather buffers)."""
    gather_bwd: int = 0
    """Gathered bytes while a decoder layer runs backward (the current layer's and the prefetched one's)."""
    gather_edges: dict[str, int] = field(default_factory=dict)
    """Gathered bytes in the embedding and head segments (``pre_f``, ``post_f``, ``post_b``, ``pre_b``), in the
    last and first layers' backward where they differ from ``gather_bwd`` (``last_b``, ``first_b``), and at
    the start of backward (``root_bwd``: FSDP2's re-gather of the root)."""
    reduce_input: int = 0
    """Bytes of the previous layer's reduce-scatter input, held while a layer (not the last, whose backward
    runs first) and the embedding run backward (FSDP2: one layer's gradients in fp32)."""
    held_per_layer: int = 0
    """Gathered bytes a layer keeps from its forward to its backward (FSDP2 without resharding)."""
    root_reduced_last: bool = False
    """The root's head and norm gradients wait, unreduced, for the embedding's, and ``resident`` is released
    before they are reduced (FSDP2: one root group, resharded after its backward)."""
    optimizer_flat: int = 0
    """Bytes of the one flat fp32 partition the optimizer steps (DeepSpeed); 0: it steps each parameter."""
    backward_bucket: int = 0
    """Bytes alive from a backward's first gradient to its end (ZeRO-1/2's IPG bucket)."""
    bucket_until_boundary: bool = False
    """The bucket lives on until the accumulation boundary's backward ends (ZeRO-1 releases it when it
    reduces, at the boundary; ZeRO-2 reduces and releases it every micro-step)."""
    boundary_partition: int = 0
    """Bytes of the gradient partition made when the boundary's backward ends, while the whole gradients,
    not yet reduced, and the bucket are alive (ZeRO-1's ``grads_in_partition``)."""
    partition_made_in: str = ""
    """The backward block in which ZeRO-2 makes its gradient partition (``grads``, whole) every micro-step:
    ``post``, ``layer i``, ``pre`` or ``end`` (see ``ZeroPartition``). From micro-step 2 on the previous one
    stays alive too, until that backward ends; empty: the partition fills block by block (``grad_keep``)."""
    partition_unbucketed: int = 0
    """Bytes of a gradient larger than the bucket, alive while it is reduced as the partition is made."""
    reduce_copies: dict[str, int] = field(default_factory=dict)
    """By backward block, bytes of the largest flat copy a bucket all-reduce makes in it (ZeRO-1/2)."""
    step_grads: int = 0
    """Extra bytes of the fp32 gradient the optimizer step makes from the held ones (DeepSpeed), alive in it."""
    norm_copy: int = 0
    """Bytes of the fp64 copy DeepSpeed makes of each of this rank's gradient pieces in turn for the global norm
    (``get_norm_dtype``), the largest piece's: before the step's own gradient and temporaries exist."""
    by_layer: tuple[tuple[int, int, int], ...] = ()
    """Per decoder layer ``(gather_fwd, gather_bwd, held)`` where they differ by layer (ZeRO-3's prefetch and
    reuse distance); replaces ``gather_fwd``, ``gather_bwd`` and ``held_per_layer`` when given."""

    def layer_terms(self, i: int) -> tuple[int, int, int]:
        if self.by_layer:
            return self.by_layer[i]
        return self.gather_fwd, self.gather_bwd, self.held_per_layer


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
    """The engine's sharding as each kind of rank holds it: ZeRO-2's gradient partitions differ by rank (their
    size, their largest piece, when backward makes them), so one per backward block that makes one, with the
    largest of each; other engines hold the same on every rank."""
    if recipe.engine != "deepspeed" or recipe.zero_stage != 2 or not recipe.zero.contiguous_gradients:
        return [engine_sharding(spec, recipe)]
    blocks = block_params(spec)
    bucket = recipe.zero.reduce_bucket_elements(spec.hidden)
    partitions, _ = zero_partitions(blocks, world=recipe.world, bucket=bucket)
    kinds: dict[str, ZeroPartition] = {}
    for p in partitions:
        q = kinds.get(p.made_in, p)
        largest, unbucketed = max(p.largest_piece, q.largest_piece), max(p.unbucketed, q.unbucketed)
        kinds[p.made_in] = replace(
            p, elements=max(p.elements, q.elements), largest_piece=largest, unbucketed=unbucketed
        )
    return [engine_sharding(spec, recipe, partition=p) for p in kinds.values()]


def engine_sharding(spec: ModelSpec, recipe: Recipe, *, partition: ZeroPartition | None = None) -> Sharding:
    """Model states per rank as each engine holds them (fp32 master weights, AdamW's two fp32 moments).

    torch: replicated, plus DDP's gradient buckets (one gradient-sized buffer, alive from construction).
    FSDP2 (``_fsdp_param_group.py``): parameters, gradients and moments sharded 1/world. A group's all-gather
    lands in a flat buffer, then is copied out into the per-parameter tensors; in forward the flat buffer is
    kept until the next group's copy-out (overlap), so a running layer costs two gathered copies, and the last
    layer's buffer lives on through the head and loss. Backward prefetches the next layer (its flat buffer)
    and keeps the previous layer's reduce-scatter input (fp32 gradients) until the next reduce. The root
    (embedding, norm, head) is gathered from its forward to the end of backward: resharded after the forward,
    it is gathered again at the start of backward (its flat buffer alive while the copy-out refills its
    parameters), and resharded before its gradients are reduce-scattered together at the end (the head's stays
    whole through the layers' backward). ZeRO-3: see
    ``zero3_sharding``. ZeRO-1/2 (``stage_1_and_2.py``): replicated compute-dtype parameters, sharded fp32
    master weights and moments; the optimizer steps the flat partition (its single-tensor temporaries are
    partition-sized). ZeRO-1 keeps whole gradients through backward and flattens this rank's share for the
    step; ZeRO-2 reduces each gradient into a partition buffer that each micro-step's backward makes anew
    (``partition``: its size and when it is made, by rank, from ``zero_partitions``) and drops after the step.
    """
    blocks = block_params(spec)
    w = recipe.world
    step_scalars = blocks.tensors * FP32 if recipe.device == "cpu" else 0  # non-capturable steps live on the CPU
    master = recipe.weight_bytes
    p = blocks.total * master
    if recipe.engine == "torch":
        return Sharding(params=p, grads=p, optimizer=2 * p + step_scalars, comm_buffers=p if w > 1 else 0)
    compute = 2 if recipe.precision != "fp32" else FP32
    shard = -(-p // w)
    layer = blocks.layer * compute
    root = (blocks.pre + blocks.post) * compute
    moments = 2 * shard + step_scalars
    if recipe.engine == "fsdp":
        edges = {"pre_f": root, "post_f": layer}
        if recipe.reshard_after_forward:
            gathered = {
                "gather_fwd": 2 * layer,
                "gather_bwd": 2 * layer,
                # The first layer's backward (the last to run) prefetches nothing.
                "gather_edges": edges | {"post_b": layer, "first_b": layer, "root_bwd": root},
            }
        else:  # layers stay gathered until their backward: no re-gather
            gathered = {"gather_fwd": layer, "gather_edges": edges, "held_per_layer": layer}
        return Sharding(
            params=shard,
            grads=shard,
            optimizer=moments,
            grad_keep=1 / w,
            resident=root,
            root_reduced_last=True,
            kept_grad_bytes=master,
            reduce_input=blocks.layer * master,
            **gathered,
        )
    ipg = recipe.zero.reduce_bucket_elements(spec.hidden) * compute  # the IPG (gradient) bucket
    if recipe.zero_stage == 3:  # each parameter is partitioned on its own: the largest piece is its shard
        sharding = zero3_sharding(
            blocks, zero=recipe.zero, world=w, compute=compute, shard=shard, moments=moments, ipg=ipg
        )
        return replace(sharding, norm_copy=FP64 * -(-blocks.largest // w))
    # ZeRO-1/2 cut one flat buffer into partitions: a parameter larger than a partition fills one
    norm_copy = FP64 * min(blocks.largest, -(-blocks.total // w))
    ipg *= recipe.zero.ipg_buffers()
    if recipe.zero_stage == 2:
        zero2 = {
            "params": p * compute // FP32 + shard,
            "optimizer": moments,
            "optimizer_flat": shard,
            "step_grads": shard - shard * compute // FP32,  # the partition, as the fp32 gradient of the master copy
            "backward_bucket": ipg,
        }
        if not ipg:  # without contiguous gradients no partition buffer: each block keeps its share
            return Sharding(
                **zero2,
                grads=shard * compute // FP32,
                grad_keep=1 / w,
                kept_grad_bytes=compute,
                norm_copy=norm_copy,
            )
        bucket = recipe.zero.reduce_bucket_elements(spec.hidden)
        partitions, copies = zero_partitions(blocks, world=w, bucket=bucket)
        mine = partition or max(partitions, key=lambda q: q.elements)
        return Sharding(
            **zero2,
            grads=mine.elements * compute,  # grads_in_partition: grad_accum_dtype, the model's by default
            grad_keep=0.0,
            partition_made_in=mine.made_in,
            partition_unbucketed=mine.unbucketed * compute,
            reduce_copies={at: n * compute for at, n in copies},
            norm_copy=FP64 * mine.largest_piece,
        )
    return Sharding(
        params=p * compute // FP32 + shard,
        grads=shard * compute // FP32,  # the partition in grad_accum_dtype (the model's), at the norm
        optimizer=moments,
        optimizer_flat=shard,
        step_grads=shard - shard * compute // FP32,  # the partition, as the fp32 gradient of the master copy
        backward_bucket=ipg,
        bucket_until_boundary=True,
        boundary_partition=shard * compute // FP32,  # grad_accum_dtype: the model's
        norm_copy=norm_copy,
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


def zero3_sharding(
    blocks: BlockParams, *, zero: ZeroSettings, world: int, compute: int, shard: int, moments: int, ipg: int
) -> Sharding:
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
    after its backward.
    """
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
    step = FP32 * zero3_sub_group(blocks, world=world, size=zero.sub_group_size)
    return Sharding(
        params=shard * compute // FP32 + shard,
        grads=shard * compute // FP32,  # gradient_accumulation_dtype: the model's dtype unless configured
        optimizer=moments,
        grads_persistent=True,
        step_grads=step,
        comm_buffers=ipg,
        grad_keep=0.0,
        optimizer_flat=step,
        resident=pre * compute if pre_held else 0,
        gather_edges={
            # the embedding's own copy is in ``resident`` when it stays gathered
            "pre_f": (pre + (2 * ahead(0) + pre if whole else in_flight(ahead(0))) - (pre if pre_held else 0))
            * compute,
            "post_f": post * compute,
            # a released embedding is prefetched again for its backward once the window spans the model
            "post_b": (post + (pre if window == blocks.total and not pre_held else 0)) * compute,
            "pre_b": 0 if pre_held else pre * compute,
        },
        by_layer=tuple(
            (f * compute, b * compute, h * compute) for f, b, h in zip(forward, backward, held, strict=True)
        ),
    )


def optimizer_transient(blocks: BlockParams, recipe: Recipe, *, local_params: int, flat: int = 0) -> int:
    """Temporaries of one AdamW step: single-tensor makes sqrt and its quotient per tensor, the largest setting the
    peak (``flat``: bytes of the one flat partition an engine steps instead); foreach one copy of all it steps."""
    impl = recipe.optimizer_impl
    if impl == "single":
        largest = blocks.largest
        if recipe.engine == "fsdp":  # rank 0 holds the first, largest, chunk of the rows
            largest = -(-blocks.largest_rows // recipe.world) * (blocks.largest // blocks.largest_rows)
        return 2 * (flat or largest * recipe.weight_bytes)
    if impl == "foreach":  # one copy of what it steps: the flat partition where the engine steps one
        return flat or local_params
    return 0


@dataclass
class _Walk:
    """The running level and what it is made of, and the highest point seen."""

    level: int
    parts: dict[str, int]
    peak: int = -1
    peak_parts: dict[str, int] | None = None
    phase: str = ""

    def visit(self, above: int, phase: str, **during: int) -> None:
        """A moment ``above`` the level (temporaries), with ``during`` bytes by part alive only for it (parameters
        gathered for it, a reduce-scatter's input)."""
        above += sum(during.values())
        if self.level + above > self.peak:
            self.peak = self.level + above
            self.peak_parts = dict(self.parts)
            for part, nbytes in during.items():
                self.peak_parts[part] += nbytes
            self.phase = phase

    def add(self, part: str, nbytes: int) -> None:
        """Bytes that join (or leave, negative) the running level as ``part``."""
        self.level += nbytes
        self.parts[part] += nbytes

    def mark(self) -> tuple[int, dict[str, int]]:
        """The level and its parts now: where a micro-step that repeats starts."""
        return self.level, dict(self.parts)

    def repeat(self, since: tuple[int, dict[str, int]], *, times: int) -> None:
        """Move the level ``times`` more by what it moved ``since`` a mark (no new highs in between: the walk
        after the repeats reaches higher, or the one before did)."""
        level, parts = since
        self.level += (self.level - level) * times
        for name, value in self.parts.items():
            self.parts[name] += (value - parts.get(name, 0)) * times

    def step(
        self, seg: tuple[int, int], phase: str, *, gathered: int = 0, reducing: int = 0, **attributed: int
    ) -> None:
        """Visit a segment ``(peak above start, net change)`` with what it gathers and reduces while it runs;
        ``attributed`` moves bytes into named parts."""
        self.visit(seg[0], phase, gathered_parameters=gathered, comm_buffers=reducing)
        self.level += seg[1]
        for name, value in attributed.items():
            self.parts[name] = self.parts.get(name, 0) + value


@dataclass(frozen=True)
class _Grads:
    """After a block's backward: the traced full gradient stays (replicated), or only this rank's share."""

    shard: Sharding
    first: bool
    traced: int
    """Bytes per gradient element in the trace (2 where the engine computes with bf16 parameters)."""

    @property
    def replicated(self) -> bool:
        return self.shard.grad_keep == 1.0

    def made(self, params: int) -> int:
        """Gradient bytes a block's backward allocates (replicated: later micro-steps accumulate in place)."""
        return params * self.traced if self.first or not self.replicated else 0

    def reduce_root(self, params: int, *, embedding: int) -> int:
        """Bytes above the level while FSDP2 reduce-scatters the root's gradients: the input is filled from
        them; the embedding's gradient is freed before the output shard is made, the head's and norm's after."""
        reduce_input = params * self.shard.kept_grad_bytes
        return max(reduce_input, reduce_input + round(reduce_input * self.shard.grad_keep) - self.made(embedding))

    def settle(self, walk: _Walk, params: int) -> None:
        made = self.made(params)
        if self.replicated:
            kept = made  # the gradient itself stays
        else:
            kept = round(params * self.shard.kept_grad_bytes * self.shard.grad_keep) if self.first else 0
        walk.parts["gradients"] += kept
        walk.level -= made - kept


def edge_values(patterns: dict[str, Patterns], modes: tuple[str, ...], b: int, s: int) -> dict[str, tuple[int, int]]:
    """The edge segments of ``modes[0]``'s trace, with what each layer leaves to them (``Patterns.per_layer``)
    counted for the plan's layers in their own modes instead of the traced copy's ``TRACE_LAYERS``."""
    first = patterns[modes[0]]
    counts = Counter(modes)
    counts[modes[0]] -= TRACE_LAYERS
    out = {}
    for name in first.segments:
        if name.split("@")[0] not in EDGES:
            continue
        values = first.points(name, b, s)
        for mode, count in counts.items():
            if count and name in patterns[mode].per_layer:
                share = patterns[mode].points(name, b, s, per_layer=True)
                if len(share) != len(values):
                    raise TraceError(f"segment {name} runs other ops in recompute modes {modes[0]} and {mode}")
                values = [v + count * d for v, d in zip(values, share, strict=True)]
        out[name] = peak_and_net(values)
    return out


def compose(spec: ModelSpec, recipe: Recipe, patterns: dict[tuple[str, int], Patterns]) -> Forecast:
    """The forecast of ``recipe`` from the traced patterns of each recompute mode it uses and each kind of layer
    (``(mode, kind)``; see ``trace.layer_picks``): the highest rank's."""
    modes = recipe.layer_modes(spec.layers)
    values = {key: pats.evaluate(recipe.micro_batch, recipe.seq_len) for key, pats in patterns.items()}
    ref = reference_kind(block_params(spec).layer_kinds)
    by_mode = {mode: pats for (mode, kind), pats in patterns.items() if kind == ref}
    edge = edge_values(by_mode, modes, recipe.micro_batch, recipe.seq_len)
    shards = rank_shardings(spec, recipe)
    walks = [_walk_step(spec, recipe, shard, modes=modes, values=values, edge=edge) for shard in shards]
    walk = max(walks, key=lambda w: w.peak)
    parts = dict(walk.peak_parts or {})
    parts["temporaries"] = walk.peak - sum(parts.values())
    return Forecast(
        peak_allocated_bytes=walk.peak,
        peak_reserved_bytes=None,
        context_bytes=0,
        breakdown={k: v for k, v in parts.items() if v or k in ("parameters", "activations")},
        phase=walk.phase,
        source="traced",
    )


def _walk_step(
    spec: ModelSpec,
    recipe: Recipe,
    shard: Sharding,
    *,
    modes: tuple[str, ...],
    values: dict[tuple[str, int], dict[str, tuple[int, int]]],
    edge: dict[str, tuple[int, int]],
) -> _Walk:
    """One rank's training step, as the walk of its running level."""
    blocks = block_params(spec)
    ref = reference_kind(blocks.layer_kinds)
    # a middle layer walks its own kind's copy; the first and last are alike in every copy
    kind = [ref, *blocks.layer_kinds[1:-1], ref][: blocks.layers]
    batch = recipe.grad_accum * recipe.micro_batch * recipe.seq_len * TOKEN_BYTES
    held_grads = shard.grads if shard.grads_persistent else 0
    walk = _Walk(
        level=shard.params + blocks.buffer_bytes + shard.optimizer + shard.comm_buffers + batch + held_grads,
        parts={
            "parameters": shard.params + blocks.buffer_bytes,
            "optimizer_states": shard.optimizer,
            "gradients": held_grads,
            "activations": 0,
            "logits_and_loss": 0,
            "batch": batch,
            "comm_buffers": shard.comm_buffers,
            "gathered_parameters": 0,
        },
    )
    n = spec.layers
    position = ["f0"] + ["f1"] * (n - 2) + ["f2"] if n >= 2 else ["f1"]
    replicated = shard.grad_keep == 1.0
    last = recipe.grad_accum
    # Micro-steps 2 .. last-1 walk the same way, each moving the level by the same few bytes (what a step keeps), so
    # only the first two and the last two are walked and the ones between are added as that amount each.
    micros = range(1, last + 1) if last <= 4 else (1, 2, last - 1, last)

    def partition(block: str, where: str, *, after: bool) -> None:
        """ZeRO-2's partition, made as the first of this rank's gradients is reduced: in a decoder layer's
        backward before its peak (the MLP's output projection's gradient comes first); in the head's, the
        embedding's and the epilogue after (their gradients come after the logits' and the lookup's
        temporaries), while a gradient reduced outside the bucket is still alive."""
        if block != shard.partition_made_in:
            return
        if after:
            phase = f"backward, {where}, gradient partition made"
            walk.visit(shard.partition_unbucketed, phase, gradients=shard.grads)
        walk.add("gradients", shard.grads)

    def all_reduce(block: str, phase: str) -> None:
        walk.visit(0, f"{phase}, gradient all-reduce", comm_buffers=shard.reduce_copies.get(block, 0))

    for micro in micros:
        if micro == 2:
            second = walk.mark()
        elif micro == last - 1 and last > 4:
            walk.repeat(second, times=last - 4)
        # Sharded engines make each block's full gradient anew every micro-step, then reduce it away.
        k = "1" if micro == 1 or not replicated else "2"
        where = f"micro-step {micro}"

        walk.add("gathered_parameters", shard.resident)
        extra = shard.gather_edges
        walk.step(
            edge[f"pre_f@{k}"],
            f"forward, {where}, embedding",
            gathered=extra.get("pre_f", 0),
            activations=edge[f"pre_f@{k}"][1],
        )
        for i, pos in enumerate(position):
            seg = values[modes[i], kind[i]][f"{pos}@{k}"]
            gather, _, held = shard.layer_terms(i)
            walk.step(seg, f"forward, {where}, layer {i}", gathered=gather, activations=seg[1])
            walk.add("gathered_parameters", held)
        post_f = edge[f"post_f@{k}"][1]
        head = f"{where}, LM head and loss"
        walk.step(edge[f"post_f@{k}"], f"forward, {head}", gathered=extra.get("post_f", 0), logits_and_loss=post_f)
        grads = _Grads(shard, first=micro == 1, traced=2 if recipe.trace_precision == "bf16-params" else FP32)
        walk.visit(0, f"backward, {head}, root all-gather", gathered_parameters=extra.get("root_bwd", 0))
        walk.step(edge[f"post_b@{k}"], f"backward, {head}", gathered=extra.get("post_b", 0), logits_and_loss=-post_f)
        if not shard.root_reduced_last:
            grads.settle(walk, blocks.post)
        all_reduce("post", f"backward, {head}")
        partition("post", where, after=True)
        if micro == 1 or not shard.bucket_until_boundary:
            walk.add("comm_buffers", shard.backward_bucket)
        for i, pos in reversed(list(enumerate(position))):
            seg = values[modes[i], kind[i]][f"b{pos[1]}@{k}"]
            saved = values[modes[i], kind[i]][f"{pos}@{k}"][1]
            _, gather, held = shard.layer_terms(i)
            if i == n - 1:
                gather = extra.get("last_b", gather)
            elif i == 0:
                gather = extra.get("first_b", gather)
            reducing = 0 if i == n - 1 else shard.reduce_input
            partition(f"layer {i}", where, after=False)
            walk.step(seg, f"backward, {where}, layer {i}", gathered=gather, reducing=reducing, activations=-saved)
            walk.add("gathered_parameters", -held)
            grads.settle(walk, blocks.layer_sizes[i])
            all_reduce(f"layer {i}", f"backward, {where}, layer {i}")
        pre_f = edge[f"pre_f@{k}"][1]
        walk.step(
            edge[f"pre_b@{k}"],
            f"backward, {where}, embedding",
            gathered=extra.get("pre_b", 0),
            reducing=shard.reduce_input,
            activations=-pre_f,
        )
        if shard.root_reduced_last:
            walk.add("gathered_parameters", -shard.resident)
            root = grads.reduce_root(blocks.pre + blocks.post, embedding=blocks.pre)
            walk.visit(0, f"backward, {where}, root reduce-scatter", comm_buffers=root)
        grads.settle(walk, blocks.pre + (blocks.post if shard.root_reduced_last else 0))
        all_reduce("pre", f"backward, {where}, embedding")
        partition("pre", where, after=True)
        all_reduce("end", f"backward, {where}, last bucket")
        partition("end", where, after=True)
        if micro == last:
            walk.visit(0, f"backward, {where}, gradients into the partition", gradients=shard.boundary_partition)
        if micro == last or not shard.bucket_until_boundary:
            walk.add("comm_buffers", -shard.backward_bucket)
        if micro > 1 and shard.partition_made_in:
            # ZeRO-2 made a new partition; the first, which the accumulated gradients fill, stays for the step
            walk.add("gradients", -shard.grads)
        walk.step(edge[f"gap@{k}"], f"backward, {where}")
        if not shard.root_reduced_last:
            walk.add("gathered_parameters", -shard.resident)
    if not shard.grads_persistent and walk.parts["gradients"] != shard.grads:
        walk.level += shard.grads - walk.parts["gradients"]
        walk.parts["gradients"] = shard.grads
    if shard.norm_copy:
        walk.visit(shard.norm_copy, "optimizer step, gradient norm (fp64)")
    transient = optimizer_transient(blocks, recipe, local_params=shard.params, flat=shard.optimizer_flat)
    walk.visit(transient + shard.step_grads, "optimizer step")
    return walk
