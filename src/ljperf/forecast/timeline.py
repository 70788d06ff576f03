"""Compose traced block patterns into one rank's training step and take the peak.

The step is: grad_accum × (forward of pre → layers → post, backward in reverse), then the optimizer step.
Each block's traced segment gives its peak above the running level and its net change; the peak of the step is
the maximum over all of them (not a sum). Persistent state (parameters, optimizer states, batch, sharded or
communication buffers) is the base level, computed from the parameter counts.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from ljperf.forecast.blocks import BlockParams, block_params
from ljperf.forecast.recipe import Forecast, Recipe
from ljperf.forecast.sharding import rank_shardings
from ljperf.forecast.sharding.base import FP32, Sharding, Zero2Partition, ZeroState
from ljperf.forecast.trace import EDGES, TRACE_LAYERS, Patterns, TraceError, peak_and_net, reference_kind
from ljperf.models.spec import ModelSpec

TOKEN_BYTES = 8  # int64 token ids


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
    zero = shard.zero or ZeroState(stage=0, optimizer_flat=0, step_grads=0, norm_copy=0)
    made = zero.partition or Zero2Partition(made_in="", unbucketed=0, reduce_copies={})
    reduce_input = shard.fsdp.reduce_input if shard.fsdp else 0
    root_reduced_last = shard.fsdp is not None
    extra = shard.gathering
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
        if block != made.made_in:
            return
        if after:
            phase = f"backward, {where}, gradient partition made"
            walk.visit(made.unbucketed, phase, gradients=shard.grads)
        walk.add("gradients", shard.grads)

    def all_reduce(block: str, phase: str) -> None:
        walk.visit(0, f"{phase}, gradient all-reduce", comm_buffers=made.reduce_copies.get(block, 0))

    for micro in micros:
        if micro == 2:
            second = walk.mark()
        elif micro == last - 1 and last > 4:
            walk.repeat(second, times=last - 4)
        # Sharded engines make each block's full gradient anew every micro-step, then reduce it away.
        k = "1" if micro == 1 or not replicated else "2"
        where = f"micro-step {micro}"

        walk.add("gathered_parameters", extra.resident)
        walk.step(
            edge[f"pre_f@{k}"],
            f"forward, {where}, embedding",
            gathered=extra.embedding_forward,
            activations=edge[f"pre_f@{k}"][1],
        )
        for i, pos in enumerate(position):
            seg = values[modes[i], kind[i]][f"{pos}@{k}"]
            gather, _, held = extra.layer(i)
            walk.step(seg, f"forward, {where}, layer {i}", gathered=gather, activations=seg[1])
            walk.add("gathered_parameters", held)
        post_f = edge[f"post_f@{k}"][1]
        head = f"{where}, LM head and loss"
        walk.step(edge[f"post_f@{k}"], f"forward, {head}", gathered=extra.head_forward, logits_and_loss=post_f)
        grads = _Grads(shard, first=micro == 1, traced=2 if recipe.trace_precision == "bf16-params" else FP32)
        walk.visit(0, f"backward, {head}, root all-gather", gathered_parameters=extra.root_backward)
        walk.step(edge[f"post_b@{k}"], f"backward, {head}", gathered=extra.head_backward, logits_and_loss=-post_f)
        if not root_reduced_last:
            grads.settle(walk, blocks.post)
        all_reduce("post", f"backward, {head}")
        partition("post", where, after=True)
        if micro == 1 or not zero.bucket_until_boundary:
            walk.add("comm_buffers", zero.bucket)
        for i, pos in reversed(list(enumerate(position))):
            seg = values[modes[i], kind[i]][f"b{pos[1]}@{k}"]
            saved = values[modes[i], kind[i]][f"{pos}@{k}"][1]
            _, gather, held = extra.layer(i)
            reducing = 0 if i == n - 1 else reduce_input
            partition(f"layer {i}", where, after=False)
            walk.step(seg, f"backward, {where}, layer {i}", gathered=gather, reducing=reducing, activations=-saved)
            walk.add("gathered_parameters", -held)
            grads.settle(walk, blocks.layer_sizes[i])
            all_reduce(f"layer {i}", f"backward, {where}, layer {i}")
        pre_f = edge[f"pre_f@{k}"][1]
        walk.step(
            edge[f"pre_b@{k}"],
            f"backward, {where}, embedding",
            gathered=extra.embedding_backward,
            reducing=reduce_input,
            activations=-pre_f,
        )
        if root_reduced_last:
            walk.add("gathered_parameters", -extra.resident)
            root = grads.reduce_root(blocks.pre + blocks.post, embedding=blocks.pre)
            walk.visit(0, f"backward, {where}, root reduce-scatter", comm_buffers=root)
        grads.settle(walk, blocks.pre + (blocks.post if root_reduced_last else 0))
        all_reduce("pre", f"backward, {where}, embedding")
        partition("pre", where, after=True)
        all_reduce("end", f"backward, {where}, last bucket")
        partition("end", where, after=True)
        if micro == last:
            walk.visit(0, f"backward, {where}, gradients into the partition", gradients=zero.boundary_partition)
        if micro == last or not zero.bucket_until_boundary:
            walk.add("comm_buffers", -zero.bucket)
        if micro > 1 and made.made_in:
            # ZeRO-2 made a new partition; the first, which the accumulated gradients fill, stays for the step
            walk.add("gradients", -shard.grads)
        walk.step(edge[f"gap@{k}"], f"backward, {where}")
        if not root_reduced_last:
            walk.add("gathered_parameters", -extra.resident)
    if not shard.grads_persistent and walk.parts["gradients"] != shard.grads:
        walk.level += shard.grads - walk.parts["gradients"]
        walk.parts["gradients"] = shard.grads
    if zero.norm_copy:
        walk.visit(zero.norm_copy, "optimizer step, gradient norm (fp64)")
    transient = optimizer_transient(blocks, recipe, local_params=shard.params, flat=shard.optimizer_flat)
    walk.visit(transient + zero.step_grads, "optimizer step")
    return walk
