"""The collectives of one training step, per engine, from its sharding: what DDP, FSDP2 (and HSDP), DeepSpeed's
ZeRO-1/2/3 and tensor parallel move, over which group of ranks, how often, and where in the step.

Run: ``step_traffic(spec, recipe)`` → ``Traffic``; ``speed.overlap`` decides how much of it the step waits for.
Sizes are nccl-tests' (a call's whole buffer); the groups are the mesh's (tp innermost, then FSDP2's shards, then
HSDP's replicas), so a data-parallel group under tensor parallel has ranks ``tp`` apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from ljperf.forecast.blocks import BlockParams, block_params
from ljperf.forecast.recipe import Recipe
from ljperf.models.spec import ModelSpec
from ljperf.speed.collectives import Collective

DDP_BUCKET_BYTES = 25 * 2**20
"""DDP's ``bucket_cap_mb`` default: gradients are all-reduced in buckets of 25 MiB as backward fills them."""
ZERO_ALLGATHER_BUCKET = 500_000_000
"""DeepSpeed's ``allgather_bucket_size`` default (elements): ZeRO-1/2 gather the updated parameters in these."""


@dataclass(frozen=True, kw_only=True)
class EngineWork:
    """What an engine does around the model's own ops in one pass: its hooks (Python, a few ops each, per
    parameter tensor), and the bytes it copies (into and out of flat communication buffers)."""

    hooks: float = 0.0
    copy_bytes: float = 0.0


NO_WORK = EngineWork()


@dataclass(frozen=True, kw_only=True)
class Traffic:
    """A step's collectives, by where they run; the per-layer ones are one layer's in one micro-step."""

    style: str
    """How the engine runs them (``speed.overlap.EXPOSED``): none, ddp, fsdp, zero12 or zero3."""
    layer_gather: Collective | None = None
    """One layer's parameter all-gather before its forward (FSDP2, ZeRO-3); again before its backward when
    ``gather_in_backward``."""
    gather_in_backward: bool = False
    layer_reduce: tuple[Collective, ...] = ()
    """One layer's gradient reduce-scatter after its backward (and HSDP's all-reduce over the replicas)."""
    root_gather: Collective | None = None
    """Embedding, final norm and head: gathered at the forward's start (and backward's when resharded)."""
    root_reduce: tuple[Collective, ...] = ()
    layer_tp_forward: tuple[Collective, ...] = ()
    """Tensor parallel's activation all-gathers and reduce-scatters in one layer's forward (sequence parallel)."""
    layer_tp_backward: tuple[Collective, ...] = ()
    root_tp: tuple[Collective, ...] = ()
    """Tensor parallel's around the embedding and head, forward and backward together."""
    bucketed: tuple[Collective, ...] = ()
    """Gradient buckets reduced while backward runs: DDP's all-reduce, ZeRO-1/2's (an all-reduce too)."""
    bucketed_every_micro_step: bool = False
    """ZeRO-2 reduces every micro-step; DDP (``no_sync``) and ZeRO-1 only in the last."""
    overlapped_buckets: bool = True
    """The buckets run beside backward (DDP; ZeRO-1/2 with ``overlap_comm``), else in its way."""
    after_step: tuple[Collective, ...] = ()
    """After the optimizer step: ZeRO-1/2's all-gather of the updated parameters."""
    prefetch: float = 1.0
    """Share of the next layer's gather issued while this one computes (ZeRO-3: its prefetch bucket over a layer)."""
    engine_forward: EngineWork = NO_WORK
    """The engine's own work in one micro-step's forward (FSDP2's and ZeRO-3's gathers' copy-outs, hooks)."""
    engine_backward: EngineWork = NO_WORK
    """In one micro-step's backward (gradient hooks, copies into reduce buffers; DDP's and ZeRO-1's: in the
    micro-step that reduces)."""
    engine_reduce: EngineWork = NO_WORK
    """In each micro-step that reduces the gradient buckets (``bucketed_every_micro_step``): their copies."""
    engine_step: EngineWork = NO_WORK
    """Around the optimizer step (ZeRO: the updated partition copied to the compute parameters; FSDP2: each
    optimizer op dispatched on sharded tensors)."""

    @property
    def communicates(self) -> bool:
        """Whether any of its collectives runs over more than one rank."""
        return any(c.ranks > 1 for c in self.collectives())

    def collectives(self) -> tuple[Collective, ...]:
        single = tuple(c for c in (self.layer_gather, self.root_gather) if c is not None)
        lists = (self.layer_reduce, self.root_reduce, self.layer_tp_forward, self.layer_tp_backward, self.root_tp)
        return single + tuple(c for group in lists for c in group) + self.bucketed + self.after_step


STYLES = ("ddp", "fsdp", "zero12", "zero3")
"""The engines' ways of running collectives and hooks (``Traffic.style``; ``none``: one device, no engine work)."""


def step_traffic(spec: ModelSpec, recipe: Recipe) -> Traffic:
    """The collectives ``recipe``'s engine runs for ``spec`` on one rank."""
    blocks = block_params(spec, tp=recipe.tp)
    if recipe.engine == "fsdp":
        return _fsdp(spec, recipe, blocks)
    if recipe.engine == "deepspeed":
        return _zero(spec, recipe, blocks)
    return _ddp(recipe, blocks)


def _compute_bytes(recipe: Recipe) -> int:
    """Bytes per element the sharding engines gather and compute with: bf16 unless fp32."""
    return 4 if recipe.precision == "fp32" else 2


def _ddp(recipe: Recipe, blocks: BlockParams) -> Traffic:
    world = recipe.world
    if world == 1:
        return Traffic(style="none")
    total = blocks.total * recipe.weight_bytes  # DDP's gradients are its parameters' dtype
    calls = max(1, -(-total // DDP_BUCKET_BYTES))
    bucket = Collective(kind="all_reduce", what="all_reduce", size_bytes=total / calls, ranks=world, calls=calls)
    return Traffic(
        style="ddp",
        bucketed=(bucket,),
        engine_backward=EngineWork(hooks=blocks.tensors),  # a gradient hook per parameter
        engine_reduce=EngineWork(copy_bytes=4 * total),  # into the buckets and back, each read and written
    )


def _tp(spec: ModelSpec, recipe: Recipe) -> tuple[tuple[Collective, ...], tuple[Collective, ...], tuple]:
    """Sequence parallel's per layer: an all-gather before attention and the MLP, a reduce-scatter after each,
    and the same transposed in backward; around the root one of each, forward and backward."""
    if recipe.tp == 1:
        return (), (), ()
    size = recipe.micro_batch * recipe.seq_len * spec.hidden * _compute_bytes(recipe)
    gather = Collective(kind="all_gather", what="tp", size_bytes=size, ranks=recipe.tp, calls=2)
    scatter = Collective(kind="reduce_scatter", what="tp", size_bytes=size, ranks=recipe.tp, calls=2)
    root = (
        Collective(kind="all_gather", what="tp", size_bytes=size, ranks=recipe.tp, calls=2),
        Collective(kind="reduce_scatter", what="tp", size_bytes=size, ranks=recipe.tp, calls=2),
    )
    return (gather, scatter), (gather, scatter), root


def _fsdp(spec: ModelSpec, recipe: Recipe, blocks: BlockParams) -> Traffic:
    """FSDP2 over the mesh's shards (ranks ``tp`` apart), HSDP's all-reduce over the replicas after each
    reduce-scatter; gradients reduced in the master dtype, every micro-step."""
    mesh, compute, master = recipe.mesh, _compute_bytes(recipe), recipe.weight_bytes
    shards, stride = mesh.dp_shard, recipe.tp
    tp_forward, tp_backward, root_tp = _tp(spec, recipe)

    def gather(elements: int) -> Collective:
        return Collective(
            kind="all_gather", what="all_gather", size_bytes=elements * compute, ranks=shards, stride=stride
        )

    def reduce(elements: int) -> tuple[Collective, ...]:
        scatter = Collective(
            kind="reduce_scatter", what="reduce_scatter", size_bytes=elements * master, ranks=shards, stride=stride
        )
        if mesh.dp_replicate == 1:
            return (scatter,)
        replicas = Collective(
            kind="all_reduce",
            what="all_reduce",
            size_bytes=elements * master / shards,
            ranks=mesh.dp_replicate,
            stride=stride * shards,
        )
        return scatter, replicas

    root = blocks.pre + blocks.post
    gathered = EngineWork(hooks=blocks.tensors, copy_bytes=2 * blocks.total * compute)  # the copy-out of each
    reduced = EngineWork(hooks=blocks.tensors, copy_bytes=2 * blocks.total * master)  # the copy-in of gradients
    backward = reduced
    if recipe.reshard_after_forward:
        backward = EngineWork(hooks=2 * blocks.tensors, copy_bytes=gathered.copy_bytes + reduced.copy_bytes)
    return Traffic(
        style="fsdp",
        engine_forward=gathered,
        engine_backward=backward,
        engine_step=EngineWork(hooks=blocks.tensors),
        layer_gather=gather(blocks.layer),
        gather_in_backward=recipe.reshard_after_forward,
        layer_reduce=reduce(blocks.layer),
        root_gather=gather(root),
        root_reduce=reduce(root),
        layer_tp_forward=tp_forward,
        layer_tp_backward=tp_backward,
        root_tp=root_tp,
    )


def _zero(spec: ModelSpec, recipe: Recipe, blocks: BlockParams) -> Traffic:
    """ZeRO over every rank: stage 3 gathers each layer forward and backward (its prefetch bucket ahead) and
    reduce-scatters its gradients in buckets; stages 1/2 all-reduce the gradient buckets (2: every micro-step, 1: at
    the accumulation boundary; each rank then keeps its partition: DeepSpeed's ``use_multi_rank_bucket_allreduce``,
    on by default, reduces a bucket whole, twice a reduce-scatter's bus bytes) and gather the updated parameters
    after the step."""
    world, compute, zero = recipe.world, _compute_bytes(recipe), recipe.zero
    bucket = zero.reduce_bucket_elements(spec.hidden)

    def buckets(elements: int, what: str, kind: str, per_call: int) -> Collective:
        calls = max(1, -(-elements // per_call))
        return Collective(kind=kind, what=what, size_bytes=elements * compute / calls, ranks=world, calls=calls)

    if recipe.zero_stage == 3:
        root = blocks.pre + blocks.post
        fetches = EngineWork(hooks=2 * blocks.tensors)  # fetch and release each parameter: views of the gathered
        return Traffic(
            style="zero3",
            engine_forward=fetches,
            engine_backward=EngineWork(hooks=3 * blocks.tensors, copy_bytes=2 * blocks.total * compute),
            engine_step=EngineWork(copy_bytes=2 * blocks.total * recipe.weight_bytes / world),
            layer_gather=buckets(blocks.layer, "all_gather", "all_gather", blocks.layer),
            gather_in_backward=True,
            layer_reduce=(buckets(blocks.layer, "reduce_scatter", "reduce_scatter", bucket),),
            root_gather=buckets(root, "all_gather", "all_gather", root),
            root_reduce=(buckets(root, "reduce_scatter", "reduce_scatter", bucket),),
            prefetch=min(1.0, zero.prefetch_bucket_size / max(blocks.layer, 1)),
        )
    calls = ipg_calls([n for _, n in reversed(blocks.order)], bucket=bucket)
    return Traffic(
        style="zero12",
        engine_backward=EngineWork(hooks=blocks.tensors),
        engine_reduce=EngineWork(copy_bytes=2 * blocks.total * compute),  # into the IPG bucket
        engine_step=EngineWork(copy_bytes=2 * blocks.total * recipe.weight_bytes / world),
        bucketed=(
            Collective(
                kind="all_reduce",
                what="all_reduce",
                size_bytes=blocks.total * compute / calls,
                ranks=world,
                calls=calls,
            ),
        ),
        bucketed_every_micro_step=recipe.zero_stage == 2,
        overlapped_buckets=zero.overlap_comm,
        after_step=(buckets(blocks.total, "all_gather", "all_gather", ZERO_ALLGATHER_BUCKET),),
    )


def ipg_calls(sizes: list[int], *, bucket: int) -> int:
    """Reductions of ZeRO-1/2's IPG bucket over gradients of ``sizes`` elements in the order they are ready: a
    gradient that would overflow the bucket first reduces what it holds, so one larger than the bucket goes alone
    (DeepSpeed's ``reduce_independent_p_g_buckets_and_remove_grads``), and the last bucket after backward."""
    calls, held = 0, 0
    for n in sizes:
        if held and held + n > bucket:
            calls, held = calls + 1, 0
        held += n
    return calls + (held > 0)
