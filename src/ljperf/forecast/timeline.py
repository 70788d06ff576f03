"""Compose traced block patterns into one rank's training step and take the peak.

The step is: grad_accum × (forward of pre → layers → post, backward in reverse), then the optimizer step.
Each block's traced segment gives its peak above the running level and its net change; the peak of the step is
the maximum over all of them (not a sum). Persistent state (parameters, optimizer states, batch, sharded or
communication buffers) is the base level, computed from the parameter counts.
"""

from __future__ import annotations

from dataclasses import dataclass

from ljperf import models
from ljperf.forecast.recipe import Forecast, Recipe
from ljperf.forecast.trace import Patterns, shallow_spec

FP32 = 4
TOKEN_BYTES = 8  # int64 token ids


@dataclass(frozen=True, kw_only=True)
class BlockParams:
    """Parameter numbers of the blocks the timeline composes (a tied LM head counts in ``pre``)."""

    pre: int
    """Input embedding."""
    layer: int
    """One decoder layer."""
    post: int
    """Final norm and (untied) LM head."""
    layers: int
    """Decoder layers of the full model."""
    tensors: int
    """Parameter tensors of the full model (optimizer ``step`` scalars)."""
    largest: int
    """Elements of the largest parameter tensor."""
    buffer_bytes: int
    """Model buffers (RoPE frequencies)."""

    @property
    def total(self) -> int:
        return self.pre + self.layers * self.layer + self.post


_BLOCKS: dict[str, BlockParams] = {}


def block_params(spec: models.ModelSpec) -> BlockParams:
    """Parameter numbers per block, from a one-layer meta build (cached per config)."""
    key = spec.config.to_json_string()
    if key not in _BLOCKS:
        _BLOCKS[key] = _block_params(spec)
    return _BLOCKS[key]


def _block_params(spec: models.ModelSpec) -> BlockParams:
    model = models.build_meta(shallow_spec(spec, 1))
    layer = model.get_decoder().layers[0]
    embed = model.get_input_embeddings().weight
    in_layer = {id(p) for p in layer.parameters()}
    seen: set[int] = set()
    pre = post = 0
    per_layer_tensors = other_tensors = 0
    largest = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        largest = max(largest, p.numel())
        if id(p) in in_layer:
            per_layer_tensors += 1
            continue
        other_tensors += 1
        if p is embed:
            pre += p.numel()
        else:
            post += p.numel()
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return BlockParams(
        pre=pre,
        layer=sum(p.numel() for p in layer.parameters()),
        post=post,
        layers=spec.layers,
        tensors=other_tensors + spec.layers * per_layer_tensors,
        largest=largest,
        buffer_bytes=buffers,
    )


@dataclass(frozen=True, kw_only=True)
class Sharding:
    """How the engine holds the model states on one rank (bytes), and its extra buffers."""

    params: int
    grads: int
    optimizer: int
    comm_buffers: int = 0
    """Persistent communication buffers (DDP gradient buckets)."""
    gathered_transient: int = 0
    """Unsharded parameters alive while a block runs (FSDP/ZeRO-3 all-gather), added at every block peak."""
    grads_in_trace: bool = True
    """Whether the traced backward's gradient allocations are real on this rank (False: reduce-scattered)."""


def engine_sharding(spec: models.ModelSpec, recipe: Recipe) -> Sharding:
    """Model states per rank as each engine holds them (fp32 master weights, AdamW's two fp32 moments).

    torch: everything replicated, plus DDP's gradient buckets (one gradient-sized buffer). FSDP2 and ZeRO-3:
    parameters, gradients and moments sharded 1/world, while a block runs its parameters are gathered (in the
    compute dtype; backward prefetches the next block, so two) and the root's embedding and head stay gathered.
    ZeRO-1/2: replicated parameters, moments (and for stage 2 gradients) sharded.
    """
    blocks = block_params(spec)
    p = blocks.total * FP32
    w = recipe.world
    step_scalars = blocks.tensors * FP32 if recipe.device == "cpu" else 0  # non-capturable steps live on the CPU
    if recipe.engine == "torch":
        return Sharding(params=p, grads=p, optimizer=2 * p + step_scalars, comm_buffers=p if w > 1 else 0)
    compute = 2 if recipe.precision == "bf16-mixed" else FP32
    if recipe.engine == "fsdp" or recipe.zero_stage == 3:
        gathered = 2 * blocks.layer * compute + (blocks.pre + blocks.post) * compute
        if recipe.engine == "fsdp" and not recipe.reshard_after_forward:
            gathered = blocks.layers * blocks.layer * compute + (blocks.pre + blocks.post) * compute
        return Sharding(
            params=-(-p // w),
            grads=-(-p // w),
            optimizer=-(-2 * p // w) + step_scalars,
            gathered_transient=gathered,
            grads_in_trace=False,
        )
    grads = -(-p // w) if recipe.zero_stage == 2 else p
    return Sharding(
        params=p, grads=grads, optimizer=-(-2 * p // w) + step_scalars, grads_in_trace=recipe.zero_stage == 1
    )


def optimizer_transient(blocks: BlockParams, recipe: Recipe, *, local_params: int) -> int:
    """Temporaries of one AdamW step: single-tensor makes sqrt and its quotient per tensor; foreach a whole copy."""
    impl = recipe.optimizer_impl
    if impl == "single":
        return 2 * min(blocks.largest * FP32, local_params)
    if impl == "foreach":
        return local_params
    return 0


@dataclass
class _Walk:
    """The running level and what it is made of, and the highest point seen."""

    level: int
    parts: dict[str, int]
    peak: int = -1
    peak_parts: dict[str, int] | None = None
    phase: str = ""

    def visit(self, above: int, phase: str) -> None:
        if self.level + above > self.peak:
            self.peak = self.level + above
            self.peak_parts = dict(self.parts)
            self.phase = phase

    def step(self, seg: tuple[int, int], phase: str, *, extra: int = 0, **attributed: int) -> None:
        """Visit a segment ``(peak above start, net change)``; ``attributed`` moves bytes into named parts."""
        self.visit(seg[0] + extra, phase)
        self.level += seg[1]
        for name, value in attributed.items():
            self.parts[name] = self.parts.get(name, 0) + value


def compose(
    spec: models.ModelSpec, recipe: Recipe, patterns: dict[str, Patterns], *, sharding: Sharding | None = None
) -> Forecast:
    """The forecast of ``recipe`` from the traced patterns of each recompute mode it uses."""
    blocks = block_params(spec)
    shard = sharding or engine_sharding(spec, recipe)
    modes = recipe.layer_modes(spec.layers)
    values = {mode: pats.evaluate(recipe.micro_batch, recipe.seq_len) for mode, pats in patterns.items()}
    edge = values[modes[0]]
    batch = recipe.grad_accum * recipe.micro_batch * recipe.seq_len * TOKEN_BYTES
    walk = _Walk(
        level=shard.params + blocks.buffer_bytes + shard.optimizer + shard.comm_buffers + batch,
        parts={
            "parameters": shard.params + blocks.buffer_bytes,
            "optimizer_states": shard.optimizer,
            "gradients": 0,
            "activations": 0,
            "logits_and_loss": 0,
            "batch": batch,
            "comm_buffers": shard.comm_buffers,
        },
    )
    n = spec.layers
    position = ["f0"] + ["f1"] * (n - 2) + ["f2"] if n >= 2 else ["f1"]
    gather = shard.gathered_transient
    for micro in range(1, recipe.grad_accum + 1):
        k = "1" if micro == 1 else "2"
        grads = micro == 1 and shard.grads_in_trace
        where = f"micro-step {micro}"
        walk.step(edge[f"pre_f@{k}"], f"forward, {where}, embedding", activations=edge[f"pre_f@{k}"][1])
        for i, pos in enumerate(position):
            seg = values[modes[i]][f"{pos}@{k}"]
            walk.step(seg, f"forward, {where}, layer {i}", extra=gather, activations=seg[1])
        walk.step(edge[f"post_f@{k}"], f"forward, {where}, LM head and loss", logits_and_loss=edge[f"post_f@{k}"][1])
        walk.step(
            edge[f"post_b@{k}"],
            f"backward, {where}, LM head and loss",
            logits_and_loss=-edge[f"post_f@{k}"][1],
            gradients=blocks.post * FP32 if grads else 0,
        )
        for i, pos in reversed(list(enumerate(position))):
            b = "b" + pos[1]
            seg = values[modes[i]][f"{b}@{k}"]
            walk.step(
                seg,
                f"backward, {where}, layer {i}",
                extra=gather,
                activations=-values[modes[i]][f"{pos}@{k}"][1],
                gradients=blocks.layer * FP32 if grads else 0,
            )
        walk.step(
            edge[f"pre_b@{k}"],
            f"backward, {where}, embedding",
            activations=-edge[f"pre_f@{k}"][1],
            gradients=blocks.pre * FP32 if grads else 0,
        )
        walk.step(edge[f"gap@{k}"], f"backward, {where}")
    if not shard.grads_in_trace:
        # Sharded gradients: the traced full-size gradients were reduce-scattered away; keep this rank's share.
        walk.level += shard.grads - walk.parts["gradients"]
        walk.parts["gradients"] = shard.grads
    transient = optimizer_transient(blocks, recipe, local_params=shard.params)
    walk.visit(transient, "optimizer step")
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
