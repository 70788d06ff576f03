"""The shape of one rank's sharding: what each engine's module fills in and ``forecast.walk`` walks.

Use: ``Sharding(params=..., grads=..., optimizer=...)``, with an engine's own parts (``gathering``, ``fsdp``,
``zero``) where it has them; ``Sizes.of(spec, recipe)`` gives the numbers every engine starts from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from ljperf.forecast.blocks import BlockParams, recipe_blocks
from ljperf.forecast.recipe import Recipe
from ljperf.models.spec import ModelSpec

FP32 = 4
FP64 = 8


class LayerGather(NamedTuple):
    """Gathered bytes around one decoder layer."""

    forward: int
    """While it runs forward (its parameters, prefetched ones, all-gather buffers)."""
    backward: int
    """While it runs backward (its own and the prefetched ones)."""
    held: int
    """Kept from its forward to its backward."""


NOTHING_GATHERED = LayerGather(forward=0, backward=0, held=0)


@dataclass(frozen=True, kw_only=True)
class Gathering:
    """What an engine that shards the parameters (FSDP2, ZeRO-3) gathers around each block, in bytes."""

    resident: int = 0
    """Gathered from the first forward to the end of backward (FSDP2's root: embedding, final norm, head)."""
    layers: tuple[LayerGather, ...] = ()
    """Each decoder layer's (ZeRO-3's differ by layer: its prefetch and reuse distance); empty: none."""
    embedding_forward: int = 0
    head_forward: int = 0
    head_backward: int = 0
    embedding_backward: int = 0
    """Gathered in the embedding and head segments."""
    root_backward: int = 0
    """At the start of backward (FSDP2's re-gather of the root)."""

    def layer(self, i: int) -> LayerGather:
        return self.layers[i] if self.layers else NOTHING_GATHERED


@dataclass(frozen=True, kw_only=True)
class FsdpReduce:
    """FSDP2's reduce-scatters. The root's (one group: embedding, final norm, head) come last: its head and norm
    gradients wait, unreduced, for the embedding's, and ``Gathering.resident`` is released before they are
    reduced (the root is resharded after its backward)."""

    reduce_input: int
    """Bytes of the previous layer's reduce-scatter input, held while a layer (not the last, whose backward runs
    first) and the embedding run backward (one layer's gradients in fp32)."""
    copies_input: bool = False
    """The process group copies a reduce-scatter's whole input while it runs: gloo (a CPU run) does, NCCL not."""
    prefetched: tuple[int, ...] = ()
    """By decoder layer, bytes of the next layer's all-gather alive while this one's gradients are reduced."""
    synced: bool = True
    """False: no reduce-scatter in backward, the gradients accumulated whole (``PipelinedFsdp``)."""
    frees_root_grads: bool = False
    """One shard: the root's reduce copies its input into the output after every root gradient is freed (with
    several shards the head's and norm's are still alive as the output is made)."""
    holds_reduce_output: bool = False
    """HSDP: each group's reduce-scatter output, which it all-reduces over the replicas, is held until the backward
    ends (``FSDPParamGroup._all_reduce_state``); from micro-step 2 on it is a buffer beside the accumulated
    gradient (in micro-step 1 it becomes the gradient)."""


@dataclass(frozen=True, kw_only=True)
class Zero2Partition:
    """ZeRO-2's gradient partition with contiguous gradients (``grads``, whole), which each micro-step's backward
    makes anew as the first of this rank's gradients is reduced; from micro-step 2 on the previous one stays
    alive too, until that backward ends."""

    made_in: str
    """The backward block in which it is made: ``post``, ``layer i``, ``pre`` or ``end`` (see ``ZeroPartition``);
    empty: never (a rank that holds no parameter)."""
    unbucketed: int
    """Bytes of a gradient larger than the bucket, alive while it is reduced as the partition is made."""
    reduce_copies: dict[str, int]
    """By backward block, bytes of the largest flat copy a bucket all-reduce makes in it."""
    first_grad: int = 0
    """Elements of the backward's first gradient (the head's), copied into the IPG bucket and freed as its hook
    makes the bucket; 0 where it is larger than the bucket (reduced on its own, alive until then)."""


@dataclass(frozen=True, kw_only=True)
class ZeroState:
    """What DeepSpeed's ZeRO holds beyond the model states, in bytes."""

    stage: int
    optimizer_flat: int
    """The one flat fp32 partition the optimizer steps (ZeRO-3: its largest sub-group)."""
    step_grads: int
    """Extra bytes of the fp32 gradient the optimizer step makes from the held ones, alive in it."""
    norm_copy: int
    """The fp64 copy DeepSpeed makes of each of this rank's gradient pieces in turn for the global norm
    (``get_norm_dtype``), the largest piece's: before the step's own gradient and temporaries exist."""
    bucket: int = 0
    """Alive from a backward's first gradient to its end (ZeRO-1/2's IPG bucket): ZeRO-2 reduces and releases it
    every micro-step, ZeRO-1 when it reduces, at the accumulation boundary."""
    boundary_partition: int = 0
    """ZeRO-1's gradient partition (``grads_in_partition``), made when the boundary's backward ends while the
    whole gradients, not yet reduced, and the bucket are alive."""
    partition: Zero2Partition | None = None
    """ZeRO-2 with contiguous gradients; without, each block keeps its share (``Sharding.grad_keep``)."""

    @property
    def bucket_until_boundary(self) -> bool:
        return self.stage == 1


@dataclass(frozen=True, kw_only=True)
class PipelinedFsdp:
    """FSDP2 inside torch's pipeline schedules (``PipelineStage.backward_maybe_with_nosync``): every micro-batch's
    backward runs without gradient sync and without resharding after backward; the gradients accumulate whole,
    and ``perform_reduce_grad`` reduce-scatters them group by group after the last backward, resharding each.

    A backward after a forward gathers each layer again and keeps it (``keep``); a forward after a backward finds
    the layers gathered and reshards each after it runs (``reuse``); a backward after a backward moves nothing
    (``stay``). The root stays gathered from the first forward to the end."""

    no_sync: Sharding
    """The sharding from the first backward on: gradients kept whole, no reduce-scatter in backward."""
    keep: Gathering
    reuse: Gathering
    stay: Gathering
    sync: Gathering
    """A forward after a forward: gathered and resharded, as outside a pipeline."""
    layer_bytes: int
    """One decoder layer's gathered parameters (compute dtype)."""


@dataclass(frozen=True, kw_only=True)
class Sharding:
    """How one rank holds the model states (bytes), and what its engine gathers or buffers around each block."""

    params: int
    """Parameters held between steps (shards, and fp32 master copies where the engine keeps them apart)."""
    grads: int
    """Gradients held at the optimizer step."""
    optimizer: int
    """AdamW moments (and step scalars)."""
    comm_buffers: int = 0
    """Persistent communication buffers (DDP's gradient buckets, ZeRO-3's IPG bucket)."""
    grad_keep: float = 1.0
    """Share of each block's traced gradient this rank keeps after backward (1/world when reduce-scattered)."""
    kept_grad_bytes: int = FP32
    """Bytes per element of a kept share (FSDP2 reduces in its master dtype; ZeRO-2 keeps the compute dtype)."""
    embedding_grad_shares: int = 1
    """The embedding's gradient as its backward makes it, in this rank's shares: tensor parallel's is whole over
    the vocabulary (DTensor's embedding backward makes it replicated), ``tp`` shares, until the engine reduces it
    to this rank's."""
    gathering: Gathering = field(default_factory=Gathering)
    fsdp: FsdpReduce | None = None
    zero: ZeroState | None = None
    pipelined: PipelinedFsdp | None = None
    """FSDP2 under ``--pp``: how its stages gather and reduce inside torch's pipeline schedules."""

    @property
    def grads_persistent(self) -> bool:
        """Gradient storage allocated once, alive between steps (ZeRO-3's flat partition)."""
        return self.zero is not None and self.zero.stage == 3

    @property
    def gradient_reduce(self) -> str | None:
        """The moment a block's gradients are reduced, in the engine's words: ZeRO's bucketed ``gradient reduce``,
        DDP's ``gradient all-reduce`` (its buckets: more than one rank), none on one device or under FSDP2, whose
        reduce-scatters are moments of their own."""
        if self.fsdp is not None:
            return None
        if self.zero is not None:
            return "gradient reduce"
        return "gradient all-reduce" if self.comm_buffers else None

    @property
    def optimizer_flat(self) -> int:
        """Bytes of the one flat partition the optimizer steps; 0: it steps each parameter."""
        return self.zero.optimizer_flat if self.zero else 0


@dataclass(frozen=True, kw_only=True)
class Sizes:
    """What every engine sizes its sharding from."""

    blocks: BlockParams
    """This rank's parameters per block (its tensor-parallel shards under ``--tp``)."""
    world: int
    """Ranks the parameters are sharded or replicated over (FSDP2 under HSDP: one replica's)."""
    weights: int
    """Bytes of all the parameters the optimizer steps (fp32 master weights, or bf16 ones)."""
    compute: int
    """Bytes per element the sharding engines compute with: bf16 parameters unless fp32."""
    step_scalars: int
    """AdamW's ``step`` scalars: non-capturable steps live on the CPU."""

    @classmethod
    def of(cls, spec: ModelSpec, recipe: Recipe) -> Sizes:
        blocks = recipe_blocks(spec, recipe)
        return cls(
            blocks=blocks,
            world=recipe.mesh.dp_shard,
            weights=blocks.total * recipe.weight_bytes,
            compute=2 if recipe.precision != "fp32" else FP32,
            step_scalars=blocks.tensors * FP32 if recipe.device == "cpu" else 0,
        )

    @property
    def shard(self) -> int:
        """This rank's share of ``weights``."""
        return -(-self.weights // self.world)

    @property
    def moments(self) -> int:
        """AdamW's two moments of the shard, and the step scalars."""
        return 2 * self.shard + self.step_scalars
