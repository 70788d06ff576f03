"""Walk one rank's training step block by block over the traced segments, and find its peak.

Use: ``walk_step(recipe, shard, blocks=..., layers=..., edges=...).peak`` (``timeline.compose`` walks each kind of
rank and takes the highest).

The step is ``accumulate`` (``grad_accum`` micro-steps, each a ``forward`` of the embedding, the decoder layers
and the head and loss, then a backward in reverse: ``head_backward``, ``layer_backward`` per layer,
``embedding_backward``, ``backward_end``) and then ``optimizer_step``. Each traced segment gives its peak above
the running level and its net change: the walk visits each peak and moves the level by each net change, with
what the engine gathers, buffers and reduces around the block (``sharding``). The step's peak is the highest
point visited, not a sum. The level starts at the persistent state: parameters, optimizer states, the batch,
sharded gradients or communication buffers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

from ljperf.forecast.blocks import BlockParams
from ljperf.forecast.recipe import Recipe
from ljperf.forecast.segments import Segment, SegmentKey
from ljperf.forecast.sharding.base import FP32, FsdpReduce, PipelinedFsdp, Sharding

TOKEN_BYTES = 8  # int64 token ids

Segments = Mapping[SegmentKey, tuple[int, int]]
"""Traced segments at the recipe's shape: ``(peak above its start, net change)`` each (``Patterns.evaluate``)."""


@dataclass(frozen=True)
class Moment:
    """A point the walk visited: where in the step, the bytes alive then, and what they are made of (the rest of
    ``total`` is temporaries)."""

    phase: str
    total: int
    parts: dict[str, int]


@dataclass
class Walk:
    """The running level and what it is made of, and the highest point seen."""

    level: int
    parts: dict[str, int]
    peak: int = -1
    peak_parts: dict[str, int] | None = None
    phase: str = ""
    history: list[Moment] | None = field(default=None, repr=False)
    """Every point visited, in order, where the walk was asked to keep them (``walk_step(record=True)``)."""

    @classmethod
    def start(cls, shard: Sharding, *, buffers: int, batch: int) -> Walk:
        """The level before the step: what lives between steps (``buffers``: the model's, ``batch``: token ids)."""
        held_grads = shard.grads if shard.grads_persistent else 0
        return cls(
            level=shard.params + buffers + shard.optimizer + shard.comm_buffers + batch + held_grads,
            parts={
                "parameters": shard.params + buffers,
                "optimizer_states": shard.optimizer,
                "gradients": held_grads,
                "activations": 0,
                "logits_and_loss": 0,
                "batch": batch,
                "comm_buffers": shard.comm_buffers,
                "gathered_parameters": 0,
            },
        )

    def visit(self, above: int, phase: str, **during: int) -> None:
        """A moment ``above`` the level (temporaries), with ``during`` bytes by part alive only for it (parameters
        gathered for it, a reduce-scatter's input)."""
        total = self.level + above + sum(during.values())
        if total <= self.peak and self.history is None:
            return
        parts = dict(self.parts)
        for part, nbytes in during.items():
            parts[part] += nbytes
        if self.history is not None:
            self.history.append(Moment(phase=phase, total=total, parts=parts))
        if total > self.peak:
            self.peak, self.peak_parts, self.phase = total, dict(parts), phase

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
        them; the embedding's gradient is freed before the output shard is made, the head's and norm's after (with
        one shard, before too: ``FsdpReduce.frees_root_grads``); gloo copies the input while the reduce-scatter
        runs."""
        reduce_input, fsdp = params * self.shard.kept_grad_bytes, self.shard.fsdp
        copy = reduce_input if fsdp and fsdp.copies_input else 0
        freed = self.made(params if fsdp and fsdp.frees_root_grads else embedding)
        return max(reduce_input, reduce_input + round(reduce_input * self.shard.grad_keep) - freed + copy)

    def settle(self, walk: Walk, params: int, *, beyond: int = 0) -> None:
        """After a block's backward over ``params``; ``beyond``: gradient elements its backward made beyond this
        rank's share (tensor parallel's whole embedding gradient), which the engine reduces away: FSDP2 before it
        reduce-scatters, a replicated engine before the step (``optimizer_step``)."""
        made = self.made(params + beyond)
        if self.replicated:
            kept = made  # the gradient itself stays
        else:
            kept = round(params * self.shard.kept_grad_bytes * self.shard.grad_keep) if self.first else 0
        walk.parts["gradients"] += kept
        walk.level -= made - kept


@dataclass(frozen=True)
class MicroStep:
    """One of the step's micro-steps."""

    number: int
    last: bool
    traced: int
    """The traced micro-step whose segments it walks: 1 allocates the gradients, 2 accumulates into them.
    Sharded engines make each block's full gradient anew every micro-step, then reduce it away: always 1."""

    @property
    def first(self) -> bool:
        return self.number == 1

    @property
    def where(self) -> str:
        return f"micro-step {self.number}"


def layer_segments(i: int, layers: int) -> tuple[Segment, Segment]:
    """The traced (forward, backward) segments layer ``i`` of ``layers`` walks: the first layer's, a middle one's
    or the last's (a lone layer: a middle one's)."""
    if layers == 1 or 0 < i < layers - 1:
        return Segment.F1, Segment.B1
    return (Segment.F0, Segment.B0) if i == 0 else (Segment.F2, Segment.B2)


@dataclass(frozen=True, kw_only=True)
class TrainingStep:
    """What the walk of one rank's step reads: its blocks, its engine's sharding and each block's segments."""

    blocks: BlockParams
    shard: Sharding
    layers: tuple[Segments, ...]
    """Each decoder layer's segments, from the trace of its recompute mode and kind."""
    edges: Segments
    """The embedding's, the head's and the gap's segments, with what each layer leaves to them."""
    grad_accum: int
    traced_grad_bytes: int
    """Bytes per gradient element in the trace (2 where the engine computes with bf16 parameters)."""
    first: bool = True
    """The step embeds the tokens (no pipeline, or its first stage)."""
    last: bool = True
    """The step runs the head and loss (no pipeline, or its last stage)."""
    boundary: int = 0
    """Bytes of the hidden states a pipeline stage receives or sends for one micro-batch (0: no pipeline)."""
    kept_output: int = 0
    """Bytes of the last pipeline stage's output (its logits) the schedule keeps from the stage's forward to the end
    of its backward (``PipelineStage.fwd_cache``, then ``backward_one_chunk``'s ``stage_output``); 0: no pipeline,
    or the chunked loss (the stage's output is its loss)."""

    def micro(self, number: int) -> MicroStep:
        replicated = self.shard.grad_keep == 1.0
        return MicroStep(number=number, last=number == self.grad_accum, traced=2 if number > 1 and replicated else 1)

    def edge(self, segment: Segment, micro: MicroStep) -> tuple[int, int]:
        return self.edges[SegmentKey(segment, micro.traced)]

    def layer_forward(self, i: int, micro: MicroStep) -> tuple[int, int]:
        return self._segments(micro.traced)[i][0]

    def layer_backward(self, i: int, micro: MicroStep) -> tuple[int, int]:
        return self._segments(micro.traced)[i][1]

    @cached_property
    def _tables(self) -> dict[int, tuple[tuple[tuple[int, int], tuple[int, int]], ...]]:
        return {}

    def _segments(self, traced: int) -> tuple[tuple[tuple[int, int], tuple[int, int]], ...]:
        """Each layer's (forward, backward) segments in traced micro-step ``traced``, looked up once a walk."""
        if traced not in self._tables:
            keys = [layer_segments(i, len(self.layers)) for i in range(len(self.layers))]
            self._tables[traced] = tuple(
                (segs[SegmentKey(f, traced)], segs[SegmentKey(b, traced)])
                for segs, (f, b) in zip(self.layers, keys, strict=True)
            )
        return self._tables[traced]

    @cached_property
    def runs(self) -> tuple[range, ...]:
        """The decoder layers in runs of consecutive middle layers that walk alike (``alike``); the first and the
        last layer each a run of its own."""
        keys = [self.alike(i) for i in range(len(self.layers))]
        starts = [i for i in range(len(keys)) if i == 0 or keys[i] is None or keys[i] != keys[i - 1]]
        return tuple(range(a, b) for a, b in zip(starts, [*starts[1:], len(keys)], strict=True))

    def alike(self, i: int) -> tuple | None:
        """What layer ``i``'s forward and backward walk read by its number (None: the first or the last layer):
        layers of equal keys move the level alike. Whatever ``forward`` or ``layer_backward`` reads of layer ``i``
        must be in it."""
        if i in (0, len(self.layers) - 1):
            return None
        shard, name = self.shard, f"layer {i}"
        fsdp, partition = shard.fsdp, shard.zero.partition if shard.zero else None
        return (
            id(self.layers[i]),
            shard.gathering.layer(i),
            self.blocks.layer_sizes[i],
            fsdp.prefetched[i] if fsdp and fsdp.prefetched else 0,
            (partition.made_in == name, partition.reduce_copies.get(name, 0)) if partition else None,
        )


def walk_step(
    recipe: Recipe,
    shard: Sharding,
    *,
    blocks: BlockParams,
    layers: tuple[Segments, ...],
    edges: Segments,
    boundary: int = 0,
    kept_output: int = 0,
    record: bool = False,
) -> Walk:
    """One rank's training step, as the walk of its running level (a pipeline stage's, ``recipe.stage``, whose
    hidden states in and out are ``boundary`` bytes a micro-batch); ``record``: keep every point visited
    (``Walk.history``)."""
    step = TrainingStep(
        blocks=blocks,
        shard=shard,
        layers=layers,
        edges=edges,
        grad_accum=recipe.grad_accum,
        traced_grad_bytes=2 if recipe.trace_precision == "bf16-params" else FP32,
        first=recipe.stage in (None, 0),
        last=recipe.stage is None or recipe.last_stage,
        boundary=boundary,
        kept_output=kept_output if recipe.stage is not None and recipe.last_stage else 0,
    )
    batch = recipe.grad_accum * recipe.micro_batch * recipe.seq_len * TOKEN_BYTES
    walk = Walk.start(shard, buffers=blocks.buffer_bytes, batch=batch)
    if record:
        walk.history = []
    if recipe.stage is None:
        accumulate(walk, step)
    else:
        walk.add("comm_buffers", receive_buffers(step))
        pipelined(walk, step, schedule_order(recipe), gpipe=recipe.pp_schedule == "gpipe")
    optimizer_step(walk, step, recipe)
    return walk


def schedule_order(recipe: Recipe) -> list[tuple[str, int]]:
    """The stage's forwards (``"F"``) and backwards (``"B"``) of micro-steps 1..M in the order its schedule runs
    them: GPipe every forward first; 1F1B (torch's ``Schedule1F1B``) as many forwards as stages from this one to the
    last, then one backward and one forward in turn, then the backwards left."""
    m = recipe.grad_accum
    if recipe.pp_schedule == "gpipe":
        return [("F", n) for n in range(1, m + 1)] + [("B", n) for n in range(1, m + 1)]
    assert recipe.stage is not None
    warmup = min(m, recipe.stages - recipe.stage)
    order = [("F", n) for n in range(1, warmup + 1)]
    for n in range(1, m + 1):
        order.append(("B", n))
        if warmup + n <= m:
            order.append(("F", warmup + n))
    return order


def receive_buffers(step: TrainingStep) -> int:
    """A pipeline stage's receive buffers, one a micro-batch made when the schedule first runs and kept: the
    hidden states from the previous stage (``args_recv_info``) and the gradients from the next
    (``grad_recv_info``); each received tensor is the buffer itself."""
    return step.grad_accum * step.boundary * ((not step.first) + (not step.last))


def pipelined(walk: Walk, step: TrainingStep, order: list[tuple[str, int]], *, gpipe: bool = False) -> None:
    """A pipeline stage's micro-steps in its schedule's ``order``: the activations of every forward not yet
    backwarded stay, so a stage holds as many micro-batches as it has in flight. FSDP2 runs as the schedule drives
    it (``PipelinedFsdp``), its gradients reduce-scattered after the last backward."""
    fsdp = step.shard.pipelined
    move = _plain_move(walk, step, order) if fsdp is None else _fsdp_move(walk, step, fsdp, order)
    let_go, kept = outputs_let_go(step, order, gpipe=gpipe)

    def move_and_let_go(index: int) -> None:
        move(index)
        walk.add("activations", -let_go.get(index, 0))

    backwards = [i for i, (kind, _) in enumerate(order) if kind == "B"]
    odd = frozenset(i for i in backwards if let_go.get(i, 0) != step.boundary) if not step.last else frozenset()
    _walk_steady(walk, move_and_let_go, order, odd=odd)
    sent_gradient_released(walk, step)
    if fsdp is not None:
        reduce_accumulated(walk, step, fsdp)
    walk.add("activations", -kept)


def outputs_let_go(step: TrainingStep, order: list[tuple[str, int]], *, gpipe: bool) -> tuple[dict[int, int], int]:
    """When a stage that sends its output on (each micro-batch's, its last layer's output, in that layer's traced
    net) lets go of it: the bytes let go after the backward at each index of ``order``, and those kept until the
    schedule returns, after FSDP2's reduce-scatters. The stage keeps an output until its backward ends
    (``backward_one_chunk``'s ``stage_output``), and the schedule's own references to a send (gloo's work holds the
    sent tensor) keep some longer: 1F1B's last warm-up send it fired (``send_work``) until its steady state ends,
    its last forward's (``output``, ``fwd_sends``) until it returns; GPipe's every forward's (``fwd_sends_to_wait``)."""
    if step.last:
        return {}, 0
    backwards = {number: i for i, (kind, number) in enumerate(order) if kind == "B"}
    m = len(backwards)
    if gpipe:
        return {}, m * step.boundary
    after = dict(backwards)
    warmup = next(i for i, (kind, _) in enumerate(order) if kind == "B")
    if 2 <= warmup < m - warmup + 2:  # the steady state ends at micro-batch m - warmup + 1's backward
        after[warmup - 1] = backwards[m - warmup + 1]
    del after[m]
    let_go: dict[int, int] = {}
    for index in after.values():
        let_go[index] = let_go.get(index, 0) + step.boundary
    return let_go, step.boundary


def _plain_move(walk: Walk, step: TrainingStep, order: list[tuple[str, int]]) -> Callable[[int], None]:
    """The walk of ``order``'s forward or backward at an index: FSDP2's root stays gathered while any micro-batch
    is in flight."""
    in_flight = [0]  # before each index, and after the last
    for kind, _ in order:
        in_flight.append(in_flight[-1] + (1 if kind == "F" else -1))

    def move(index: int) -> None:
        kind, number = order[index]
        if kind == "F":
            forward(walk, step, step.micro(number), gather_root=in_flight[index] == 0)
        else:
            backward(walk, step, step.micro(number), release_root=in_flight[index + 1] == 0)

    return move


def _fsdp_move(
    walk: Walk, step: TrainingStep, fsdp: PipelinedFsdp, order: list[tuple[str, int]]
) -> Callable[[int], None]:
    """The walk of ``order``'s forward or backward at an index under FSDP2 as the schedule drives it
    (``PipelinedFsdp``): after the first backward the layers are gathered, and a forward reshards each as it
    runs."""
    gatherings = {("F", "B"): fsdp.reuse, ("F", "F"): fsdp.sync, ("B", "B"): fsdp.stay, ("B", "F"): fsdp.keep}
    steps: dict[tuple[str, str], TrainingStep] = {}  # one a kind of move, by it and the one before
    first_backward = next(i for i, (kind, _) in enumerate(order) if kind == "B")

    def move(index: int) -> None:
        kind, number = order[index]
        current = step
        if kind == "B" or index > first_backward:
            last = order[index - 1][0]
            if (kind, last) not in steps:
                steps[kind, last] = replace(step, shard=replace(fsdp.no_sync, gathering=gatherings[kind, last]))
            current = steps[kind, last]
        if kind == "F":
            forward(walk, current, current.micro(number), gather_root=index == 0)
        else:
            backward(walk, current, current.micro(number), release_root=False)

    return move


def _walk_steady(
    walk: Walk, move: Callable[[int], None], order: list[tuple[str, int]], *, odd: frozenset[int] = frozenset()
) -> None:
    """``move`` each index of ``order`` in turn. 1F1B's steady state, a backward then a forward, walks alike from
    its second pair to the one before its last (neither the first micro-step's backward nor the last's forward),
    so only those two pairs are walked and the ones between added as the second moved the level, as
    ``accumulate`` does. A pair whose backward is at an ``odd`` index (it lets go of less or more than the others,
    ``outputs_let_go``) is walked on its own, and the run after it from its first."""
    pairs = [i for i in range(len(order) - 1) if order[i][0] == "B" and order[i + 1][0] == "F"]
    if len(pairs) <= 4:
        _warm_up(walk, move, order, len(order))
        return
    _warm_up(walk, move, order, pairs[1])

    def pair(index: int) -> None:
        move(index)
        move(index + 1)

    run: list[int] = []
    for index in pairs[1:-2]:
        if index not in odd:
            run.append(index)
            continue
        walk_alike(walk, run, pair, head=0, tail=0)
        pair(index)
        run = []
    walk_alike(walk, run, pair, head=0, tail=0)
    for index in range(pairs[-2], len(order)):
        move(index)


def _warm_up(walk: Walk, move: Callable[[int], None], order: list[tuple[str, int]], stop: int) -> None:
    """``move`` each index of ``order`` up to ``stop``. The forwards before the first backward after the first
    (which gathers the root) walk alike, each keeping one micro-batch's activations more: only the second, the
    third and the last are walked, the ones between added as the third moved the level."""
    forwards = next((i for i in range(stop) if order[i][0] != "F"), stop)
    walk_alike(walk, range(forwards), move, head=2, tail=1)
    for index in range(forwards, stop):
        move(index)


def walk_alike(walk: Walk, items: Sequence[int], one: Callable[[int], None], *, head: int, tail: int) -> None:
    """``one(item)`` for each of ``items``, all of which but the first ``head`` and the last ``tail`` move the
    level alike: the first of those is walked and the others added as it moved the level (``Walk.repeat``), since
    their highest point is in the first or the last of them."""
    if len(items) <= head + 1 + tail:
        for item in items:
            one(item)
        return
    for item in items[:head]:
        one(item)
    since = walk.mark()
    one(items[head])
    walk.repeat(since, times=len(items) - head - 1 - tail)
    for item in items[len(items) - tail :]:
        one(item)


def sent_gradient_released(walk: Walk, step: TrainingStep) -> None:
    """The last micro-batch's input gradient, sent to the previous stage, let go when the schedule has waited for
    its send (``embedding_backward``)."""
    if not step.first:
        walk.add("activations", -step.boundary)


def reduce_accumulated(walk: Walk, step: TrainingStep, fsdp: PipelinedFsdp) -> None:
    """After a pipeline's last backward, FSDP2's gradients reduce-scattered group by group (the root first, then
    each layer): each group's parameters resharded, its whole gradient copied into the reduce's input and freed
    when the reduce is done (the previous group's input is let go first); gloo copies each input while it runs."""
    shard, blocks = step.shard, step.blocks
    assert shard.fsdp is not None
    groups = [("root", blocks.pre + blocks.post, shard.gathering.resident)]
    groups += [(f"layer {i}", size, fsdp.layer_bytes) for i, size in enumerate(blocks.layer_sizes)]
    for name, size, gathered in groups:
        reduce_input = size * shard.kept_grad_bytes
        output = round(reduce_input * shard.grad_keep)
        copy = reduce_input if shard.fsdp.copies_input else 0
        walk.add("gathered_parameters", -gathered)  # resharded before its reduce (``FSDPParamGroup.post_backward``)
        walk.visit(0, f"backward end, {name} reduce-scatter", comm_buffers=reduce_input + output + copy)
        walk.add("gradients", output - size * step.traced_grad_bytes)


def accumulate(walk: Walk, step: TrainingStep) -> None:
    """The ``grad_accum`` micro-steps. Micro-steps 2 .. last-1 walk the same way, each moving the level by the
    same few bytes (what a micro-step keeps), so only the first two and the last two are walked and the ones
    between are added as that amount each."""
    walk_alike(walk, range(1, step.grad_accum + 1), lambda number: micro_step(walk, step, number), head=1, tail=2)


def micro_step(walk: Walk, step: TrainingStep, number: int) -> None:
    """Micro-step ``number``: its forward, then its backward block by block in reverse."""
    micro = step.micro(number)
    forward(walk, step, micro)
    backward(walk, step, micro)


def backward(walk: Walk, step: TrainingStep, micro: MicroStep, *, release_root: bool = True) -> None:
    """A micro-step's backward, block by block in reverse; ``release_root``: FSDP2 releases its gathered root at
    the end (a pipeline stage: when no other micro-batch is in flight)."""
    grads = _Grads(step.shard, first=micro.first, traced=step.traced_grad_bytes)
    head_backward(walk, step, micro, grads)
    walk_layers(walk, step, lambda i: layer_backward(walk, step, micro, grads, i), backward=True)
    embedding_backward(walk, step, micro, grads, release_root=release_root)
    walk.add("logits_and_loss", -step.kept_output)
    backward_end(walk, step, micro)


def forward(walk: Walk, step: TrainingStep, micro: MicroStep, *, gather_root: bool = True) -> None:
    """The embedding, each decoder layer and the head and loss: what each keeps for its backward stays (the
    activations, the logits and loss); an engine that shards the parameters gathers each block's while it runs,
    and some it keeps."""
    gathering = step.shard.gathering
    walk.add("gathered_parameters", gathering.resident if gather_root else 0)
    phase = f"forward, {micro.where}"
    if step.first:
        embedding = step.edge(Segment.PRE_F, micro)
        walk.step(embedding, f"{phase}, embedding", gathered=gathering.embedding_forward, activations=embedding[1])
    else:  # the previous stage's hidden states, received into their buffer: the first layer's input
        walk.visit(0, f"{phase}, activations received")

    def layer(i: int) -> None:
        seg, gather = step.layer_forward(i, micro), gathering.layer(i)
        walk.step(seg, f"{phase}, layer {i}", gathered=gather.forward, activations=seg[1])
        walk.add("gathered_parameters", gather.held)

    walk_layers(walk, step, layer)
    if step.last:
        head = step.edge(Segment.POST_F, micro)
        walk.step(head, f"{phase}, LM head and loss", gathered=gathering.head_forward, logits_and_loss=head[1])
        walk.add("logits_and_loss", step.kept_output)
    else:  # the stage's output, the last layer's, sent on and kept (``outputs_let_go``)
        walk.visit(0, f"{phase}, activations sent")


def walk_layers(walk: Walk, step: TrainingStep, one: Callable[[int], None], *, backward: bool = False) -> None:
    """``one(i)`` for each decoder layer in order (``backward``: in reverse). A run of alike layers
    (``TrainingStep.alike``) moves the level by the same bytes each, so only its first two and its last are walked
    and the ones between added as the second moved it: its highest point is in one of those three. A recorded
    walk (``Walk.history``) walks every layer."""
    for run in reversed(step.runs) if backward else step.runs:
        order = run[::-1] if backward else run
        if walk.history is not None:
            for i in order:
                one(i)
        else:
            walk_alike(walk, order, one, head=1, tail=1)


def head_backward(walk: Walk, step: TrainingStep, micro: MicroStep, grads: _Grads) -> None:
    """The head and loss's backward frees the logits and loss; FSDP2 gathers its root again first, ZeRO-1/2 make
    their IPG bucket at its first parameter gradient (``Segment.POST_G``), while its temporaries are alive."""
    shard, gathering, zero = step.shard, step.shard.gathering, step.shard.zero
    if not step.last:  # the next stage's gradient of this stage's output, received into its buffer
        walk.visit(0, f"backward, {micro.where}, gradient received")
        return
    phase = f"backward, {micro.where}, LM head and loss"
    if shard.fsdp is not None:
        walk.visit(0, f"{phase}, root all-gather", gathered_parameters=gathering.root_backward)
    logits = step.edge(Segment.POST_F, micro)[1]
    walk.step(step.edge(Segment.POST_B, micro), phase, gathered=gathering.head_backward, logits_and_loss=-logits)
    if zero and zero.bucket and (micro.first or not zero.bucket_until_boundary):  # made at the first gradient's
        walk.add("comm_buffers", zero.bucket)  # hook
        walk.visit(0, f"{phase}, IPG bucket made")
    # ZeRO-2 copies that gradient into the bucket and frees it for the rest of the head's backward
    taken = zero.partition.first_grad * step.traced_grad_bytes if zero and zero.partition else 0
    walk.level -= taken
    walk.step(step.edge(Segment.POST_G, micro), phase, gathered=gathering.head_backward)
    walk.level += taken
    if shard.fsdp is None:  # FSDP2 reduces the head's gradients with the embedding's
        grads.settle(walk, step.blocks.post)
    _all_reduce(walk, shard, "post", phase)
    _make_partition(walk, shard, "post", micro, after=True)


def layer_backward(walk: Walk, step: TrainingStep, micro: MicroStep, grads: _Grads, i: int) -> None:
    """Decoder layer ``i``'s backward frees its saved activations and leaves its gradients (or this rank's share);
    FSDP2 holds the previous layer's reduce-scatter input meanwhile (the last layer's backward runs first)."""
    shard = step.shard
    gather = shard.gathering.layer(i)
    reducing = shard.fsdp.reduce_input if shard.fsdp and i < len(step.layers) - 1 else 0
    phase = f"backward, {micro.where}, layer {i}"
    _make_partition(walk, shard, f"layer {i}", micro, after=False)
    saved = step.layer_forward(i, micro)[1]
    walk.step(step.layer_backward(i, micro), phase, gathered=gather.backward, reducing=reducing, activations=-saved)
    walk.add("gathered_parameters", -gather.held)
    if not step.last and i == len(step.layers) - 1:  # the stage's output, which the trace frees here, is kept
        walk.add("activations", step.boundary)  # until the backward ends (``outputs_let_go``)
    if shard.fsdp and shard.fsdp.copies_input:
        _gloo_reduce_scatter(walk, step, shard.fsdp, grads, i, phase)
    grads.settle(walk, step.blocks.layer_sizes[i])
    walk.add("comm_buffers", _held_reduce_output(step, micro, step.blocks.layer_sizes[i]))
    _all_reduce(walk, shard, f"layer {i}", phase)


def _held_reduce_output(step: TrainingStep, micro: MicroStep, params: int) -> int:
    """Bytes of the reduce-scatter output HSDP holds beside the accumulated gradients of ``params`` until the
    backward ends (``FsdpReduce.holds_reduce_output``)."""
    shard = step.shard
    if shard.fsdp is None or not shard.fsdp.holds_reduce_output or micro.first:
        return 0
    return round(params * shard.kept_grad_bytes * shard.grad_keep)


def _gloo_reduce_scatter(walk: Walk, step: TrainingStep, fsdp: FsdpReduce, grads: _Grads, i: int, phase: str) -> None:
    """Layer ``i``'s reduce-scatter on gloo: its gradients copied into the input and freed, the output shard made,
    and gloo's copy of the input alive while the call runs, with the next layer's all-gather in flight."""
    size, shard = step.blocks.layer_sizes[i], step.shard
    reduce_input = size * shard.kept_grad_bytes
    during = 2 * reduce_input + round(reduce_input * shard.grad_keep) - grads.made(size)
    walk.visit(0, f"{phase}, reduce-scatter", comm_buffers=during, gathered_parameters=fsdp.prefetched[i])


def embedding_backward(
    walk: Walk, step: TrainingStep, micro: MicroStep, grads: _Grads, *, release_root: bool = True
) -> None:
    """The embedding's backward frees what its forward kept; FSDP2 then releases its root and reduce-scatters the
    root's gradients, the head's with the embedding's."""
    shard, blocks = step.shard, step.blocks
    phase = f"backward, {micro.where}"
    if not step.first:  # the received input's gradient, sent back: the send holds it until the next one's is made
        walk.visit(step.boundary, f"{phase}, gradient sent")  # (``stage_backward``'s note), the input buffer stays
        if micro.first:
            walk.add("activations", step.boundary)
    embedding = step.edge(Segment.PRE_F, micro)[1] if step.first else 0
    beyond = blocks.pre * (shard.embedding_grad_shares - 1)
    walk.step(
        step.edge(Segment.PRE_B, micro) if step.first else (0, 0),
        f"{phase}, embedding",
        gathered=shard.gathering.embedding_backward,
        reducing=shard.fsdp.reduce_input if shard.fsdp else 0,
        activations=-embedding,
    )
    if shard.fsdp:
        walk.add("gathered_parameters", -shard.gathering.resident if release_root else 0)
    if shard.fsdp and shard.fsdp.synced:
        root = grads.reduce_root(blocks.pre + blocks.post, embedding=blocks.pre + beyond)
        walk.visit(0, f"{phase}, root reduce-scatter", comm_buffers=root)
    grads.settle(walk, blocks.pre + (blocks.post if shard.fsdp else 0), beyond=beyond)
    _all_reduce(walk, shard, "pre", f"{phase}, embedding")
    _make_partition(walk, shard, "pre", micro, after=True)


def backward_end(walk: Walk, step: TrainingStep, micro: MicroStep) -> None:
    """After the last block's backward: ZeRO reduces its last bucket (ZeRO-1, at the accumulation boundary, into
    the gradient partition) and releases the bucket; then the gap to the next micro-step."""
    shard, zero = step.shard, step.shard.zero
    phase = f"backward, {micro.where}"
    if shard.fsdp is not None and shard.fsdp.holds_reduce_output:
        walk.add("comm_buffers", -sum(_held_reduce_output(step, micro, n) for n in step.blocks.layer_sizes))
    if zero is not None:
        _all_reduce(walk, shard, "end", f"{phase}, last bucket")
    _make_partition(walk, shard, "end", micro, after=True)
    if micro.last and zero is not None:
        walk.visit(0, f"{phase}, gradients into the partition", gradients=zero.boundary_partition)
    if zero and (micro.last or not zero.bucket_until_boundary):
        walk.add("comm_buffers", -zero.bucket)
    if zero and zero.partition and micro.number > 1:
        # ZeRO-2 made a new partition; the first, which the accumulated gradients fill, stays for the step
        walk.add("gradients", -shard.grads)
    walk.step(step.edge(Segment.GAP, micro), phase)
    if shard.fsdp is None:
        walk.add("gathered_parameters", -shard.gathering.resident)


def _all_reduce(walk: Walk, shard: Sharding, block: str, phase: str) -> None:
    """The moment a block's gradients are reduced (``Sharding.gradient_reduce``; none where the engine runs no such
    collective): the largest flat copy ZeRO-2's bucket reduces make in it."""
    zero = shard.zero
    if (word := shard.gradient_reduce) is None:
        return
    copies = zero.partition.reduce_copies.get(block, 0) if zero and zero.partition else 0
    walk.visit(0, f"{phase}, {word}", comm_buffers=copies)


def _make_partition(walk: Walk, shard: Sharding, block: str, micro: MicroStep, *, after: bool) -> None:
    """ZeRO-2's partition, made as the first of this rank's gradients is reduced: in a decoder layer's backward
    before its peak (the MLP's output projection's gradient comes first); in the head's, the embedding's and the
    epilogue after (their gradients come after the logits' and the lookup's temporaries), while a gradient
    reduced outside the bucket is still alive."""
    partition = shard.zero.partition if shard.zero else None
    if partition is None or block != partition.made_in:
        return
    if after:
        phase = f"backward, {micro.where}, gradient partition made"
        walk.visit(partition.unbucketed, phase, gradients=shard.grads)
    walk.add("gradients", shard.grads)


def optimizer_step(walk: Walk, step: TrainingStep, recipe: Recipe) -> None:
    """The AdamW step, over the gradients as the engine holds them for it: DeepSpeed's fp64 norm copy first, then
    the step's temporaries (and DeepSpeed's fp32 gradient)."""
    shard, zero = step.shard, step.shard.zero
    if not shard.grads_persistent and walk.parts["gradients"] != shard.grads:
        walk.add("gradients", shard.grads - walk.parts["gradients"])
    if zero and zero.norm_copy:
        walk.visit(zero.norm_copy, "optimizer step, gradient norm (fp64)")
    transient = optimizer_transient(step.blocks, recipe, local_params=shard.params, flat=shard.optimizer_flat)
    walk.visit(transient + (zero.step_grads if zero else 0), "optimizer step")


def optimizer_transient(blocks: BlockParams, recipe: Recipe, *, local_params: int, flat: int = 0) -> int:
    """Temporaries of one AdamW step: single-tensor makes sqrt and its quotient per tensor, the largest setting the
    peak (``flat``: bytes of the one flat partition an engine steps instead); foreach one copy of all it steps."""
    impl = recipe.optimizer_impl
    if impl == "single":
        largest = blocks.largest
        if recipe.engine == "fsdp" and (shards := recipe.mesh.dp_shard) > 1:  # rank 0: the first, largest rows
            largest = -(-blocks.largest_rows // shards) * (blocks.largest // blocks.largest_rows)
        return 2 * (flat or largest * recipe.weight_bytes)
    if impl == "foreach":  # one copy of what it steps: the flat partition where the engine steps one
        return flat or local_params
    return 0
